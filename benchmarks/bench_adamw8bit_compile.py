"""AdamW8bit's compiled step on a ``fully_shard`` model: one call per parameter (one graph per distinct
local size, ``dynamic=False`` as torchao), the same with dynamic shapes (``dynamic=True``), and one call
per run of adjacent shards (``fuse_runs=True``, the default; [Note: runs]), side by side.

One launch of W (default 2) forked gloo ranks per mode, each with a fresh compile cache: a small
transformer (per-layer calls plus the root, ``AdamW8bit.blocks``), a forward and backward per step
(not timed), ``--steps`` optimizer steps timed. Reported per mode: the graphs compiled (largest rank),
the first step (compilation included) and the median of the later steps (slowest rank), the step calls
per step, and whether all modes end with the same bits.

    python benchmarks/bench_adamw8bit_compile.py            # -> benchmarks/results/bench_adamw8bit_compile.json
    python benchmarks/bench_adamw8bit_compile.py --quick    # 2 layers, 3 steps -> runs/bench-quick/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _out import out_dir  # noqa: E402

MODES = {  # name: (fuse_runs, dynamic)
    "per_tensor": (False, False),
    "dynamic": (False, True),
    "runs": (True, False),
}


def _run(mode: str, a):
    fuse_runs, dynamic = MODES[mode]

    def fn():
        import torch._dynamo
        import torch.distributed as dist
        import torch.nn.functional as F

        import fsdp_optim
        import fsdp_optim.optimizers._quantized_adamw as q
        from fsdp_optim.optimizers import AdamW8bit
        from tests._models import TinyConfig, TinyTransformer, make_batch

        torch.set_num_threads(1)
        rank = dist.get_rank()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(a.cache_root, f"{mode}-rank{rank}")
        q._compiled_step.cache_clear()
        orig = torch.compile
        torch.compile = lambda f, **kw: orig(f, **{**kw, "dynamic": dynamic})
        calls = []
        real = q._step_fn
        q._step_fn = lambda compile: (lambda *args: (calls.append(1), real(compile)(*args))[1])
        try:
            torch._dynamo.reset()
            torch.manual_seed(0)
            cfg = TinyConfig(vocab_size=4096, dim=a.dim, num_heads=4, num_layers=a.layers, mlp_dim=4 * a.dim,
                             tie_embeddings=False, frozen=False)  # fmt: skip
            model = TinyTransformer(cfg)
            for layer in model.layers:
                fsdp_optim.fully_shard(layer, blocks=AdamW8bit.blocks)
            fsdp_optim.fully_shard(model, blocks=AdamW8bit.blocks)
            opt = AdamW8bit(model.parameters(), lr=1e-3, compile=True, fuse_runs=fuse_runs)
            times, num_calls = [], []
            for step in range(a.steps):
                x, y = make_batch(batch_size=2, seq_len=32, vocab_size=cfg.vocab_size, seed=100 * step + rank)
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                calls.clear()
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
                num_calls.append(len(calls))
                opt.zero_grad()
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            full = fsdp_optim.full_state_dict(model)
        finally:
            torch.compile = orig
            q._step_fn = real
        return {"times": times, "graphs": graphs, "calls_per_step": num_calls[-1], "runs": len(opt._runs),
                "params": full}  # fmt: skip

    return fn


def main(argv=None) -> None:
    import tempfile

    from fsdp_optim._testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dest = out_dir(ap, a)
    if a.quick:
        a.layers, a.steps, a.dim = 2, 3, 128
    res = {}
    with tempfile.TemporaryDirectory() as cache_root:
        a.cache_root = cache_root
        for mode in MODES:
            per_rank = run_distributed(_run(mode, a), world_size=a.world_size, timeout=3600)
            steps = list(zip(*(r["times"] for r in per_rank)))  # per step: every rank's time
            slowest = [max(t) for t in steps]
            res[mode] = {
                "graphs": max(r["graphs"] for r in per_rank),
                "first_step_s": slowest[0],
                "step_s_median": statistics.median(slowest[1:]),
                "calls_per_step": max(r["calls_per_step"] for r in per_rank),
                "runs": max(r["runs"] for r in per_rank),
                "params": per_rank[0]["params"],
            }
    del a.cache_root
    ref = res["per_tensor"]["params"]
    same = {m: all(torch.equal(ref[k], r["params"][k]) for k in ref) for m, r in res.items()}
    for r in res.values():
        r.pop("params")
    print(f"W={a.world_size}, {a.layers} layers, dim {a.dim}: AdamW8bit(compile=True) step, slowest rank")
    for mode, r in res.items():
        print(f"{mode:11s} graphs {r['graphs']:3d}  calls/step {r['calls_per_step']:3d}  first step "
              f"{r['first_step_s']:7.2f} s  later steps median {r['step_s_median'] * 1e3:7.2f} ms  same bits {same[mode]}")  # fmt: skip
    base = res["per_tensor"]
    ratios = {m: {"first_step": r["first_step_s"] / base["first_step_s"], "later_steps": r["step_s_median"] / base["step_s_median"]}
              for m, r in res.items() if m != "per_tensor"}  # fmt: skip
    for m, rr in ratios.items():
        print(f"{m} / per_tensor: first step {rr['first_step']:.2f}x, later steps {rr['later_steps']:.2f}x")
    dest.mkdir(parents=True, exist_ok=True)
    out = {"config": vars(a), "modes": res, "same_bits_as_per_tensor": same, "ratios_to_per_tensor": ratios}
    (dest / "bench_adamw8bit_compile.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {dest / 'bench_adamw8bit_compile.json'}")


if __name__ == "__main__":
    main()
