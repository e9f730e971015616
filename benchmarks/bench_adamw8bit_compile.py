"""AdamW8bit's compiled step: one graph per local shape (``dynamic=False``, as torchao, and what
``AdamW8bit(compile=True)`` uses) vs one graph with dynamic shapes (``dynamic=True``), side by side.

Ragged layouts give every rank many distinct local sizes (a tensor's piece on a rank is whatever the
planner's cut left), so a per-shape compile recompiles once per size on every rank. Each mode runs in
its own fresh process (no shared compile cache): ``--num-sizes`` flat parameters of distinct sizes
(multiples of the 256-element block plus a partial tail), ``--steps`` compiled steps. Reported: the
graphs compiled, the first step (compilation included), the median of the later steps, and whether
both modes give the same bits.

    python benchmarks/bench_adamw8bit_compile.py            # -> benchmarks/results/bench_adamw8bit_compile.json
    python benchmarks/bench_adamw8bit_compile.py --quick    # 4 sizes -> runs/bench-quick/
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


def _run(dynamic: bool, num_sizes: int, steps: int):
    def fn():
        import torch._dynamo

        import fsdp_optim.optimizers._quantized_adamw as q
        from fsdp_optim.optimizers import AdamW8bit

        torch.set_num_threads(1)
        q._compiled_step.cache_clear()
        orig = torch.compile

        def compile_with(fn, **kw):
            return orig(fn, **{**kw, "dynamic": dynamic})

        torch.compile = compile_with
        try:
            torch._dynamo.reset()
            g = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(4096 + 256 * i + 7 * i, generator=g)) for i in range(num_sizes)]
            opt = AdamW8bit(params, lr=1e-3, compile=True)
            times = []
            for _ in range(steps):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        finally:
            torch.compile = orig
        return {"first_step_s": times[0], "step_s_median": statistics.median(times[1:]), "graphs": graphs,
                "params": [p.detach().clone() for p in params]}  # fmt: skip

    return fn


def main(argv=None) -> None:
    from fsdp_optim._testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-sizes", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dest = out_dir(ap, a)
    if a.quick:
        a.num_sizes, a.steps = 4, 3
    res = {}
    for dynamic in (False, True):
        [res[dynamic]] = run_distributed(_run(dynamic, a.num_sizes, a.steps), world_size=1, timeout=1800)
    same = all(torch.equal(x, y) for x, y in zip(res[False].pop("params"), res[True].pop("params")))
    for dynamic, r in res.items():
        label = "dynamic" if dynamic else "per shape (ours)"
        print(f"{label:15s} graphs {r['graphs']:3d}  first step {r['first_step_s']:7.2f} s  "
              f"later steps median {r['step_s_median'] * 1e3:7.2f} ms")  # fmt: skip
    ratio = res[True]["step_s_median"] / res[False]["step_s_median"]
    print(f"same bits: {same}; dynamic / per-shape: first step {res[True]['first_step_s'] / res[False]['first_step_s']:.2f}x, "
          f"later steps {ratio:.2f}x")  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    out = {"config": vars(a), "per_shape": res[False], "dynamic": res[True], "same_bits": same}
    (dest / "bench_adamw8bit_compile.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {dest / 'bench_adamw8bit_compile.json'}")


if __name__ == "__main__":
    main()
