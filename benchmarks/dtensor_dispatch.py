"""What DTensor dispatch costs ``torch.optim.AdamW``: over fsdp_optim's parameters vs over FSDP2's.

Both runtimes' parameters are DTensors, so ``torch.optim.AdamW(model.parameters())`` dispatches every
op of its step through a tensor subclass: FSDP2's through DTensor's sharding propagation, ours through
``RaggedDTensor.__torch_dispatch__`` (``sharding/_dtensor_ops.py``). One launch, W ranks (default 2,
gloo on CPU), the same model and gradients on both sides, and on each side the same step over plain
tensors holding the same local pieces (what an optimizer that computes on ``to_local()`` does, as
fsdp_optim's own optimizers do), and fsdp_optim's own ``AdamW`` over our parameters. The overhead is
the DTensor step minus the plain step, per runtime,
median over the timed steps (the four parameter sets step in turn, the order rotating every round),
max over ranks; for both ``foreach`` settings (on CPU torch defaults to the for-loop).

Where ours goes: a ``cProfile`` of one foreach step over our parameters, the functions of
``fsdp_optim`` by own time.

Usage: ``python benchmarks/dtensor_dispatch.py [--world-size 2] [--steps 20]``; writes
benchmarks/results/dtensor_dispatch.json (any flag changed: runs/bench-quick/).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import fsdp_optim  # noqa: E402
from tests._models import TinyConfig, TinyTransformer, make_batch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _out import out_dir  # noqa: E402


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.out_file = str(out_dir(ap, args, keep=("out_file",)) / "dtensor_dispatch.json")
    return args


def _models(a, mesh):
    from torch.distributed.fsdp import fully_shard

    cfg = TinyConfig(vocab_size=a.vocab, dim=a.dim, num_heads=4, num_layers=a.layers, mlp_dim=4 * a.dim,
                     tie_embeddings=False, frozen=False)
    torch.manual_seed(0)
    ours, peer = TinyTransformer(cfg), TinyTransformer(cfg)
    peer.load_state_dict(ours.state_dict())
    for layer in ours.layers:
        fsdp_optim.fully_shard(layer)
    fsdp_optim.fully_shard(ours)
    for layer in peer.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(peer, mesh=mesh)
    x, y = make_batch(batch_size=2, seq_len=32, vocab_size=a.vocab, seed=dist.get_rank())
    for m in (ours, peer):
        F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    return ours, peer


def _plain(params):
    """Plain parameters holding the same local pieces and gradients (clones: the DTensor step must not
    see the plain step's writes)."""
    out = []
    for p in params:
        q = torch.nn.Parameter(p.to_local().detach().clone())
        q.grad = p.grad.to_local().detach().clone()
        out.append(q)
    return out


def _ragged_copy(model) -> list:
    """Parameters of the same layout as ``model``'s (its RaggedDTensors' specs) on cloned local pieces, with
    cloned gradients: a second optimizer steps them without touching ``model``."""
    from fsdp_optim.sharding import RaggedDTensor

    out = []
    for p in model.parameters():
        q = torch.nn.Parameter(RaggedDTensor._from_local_and_spec(p.to_local().detach().clone(), p._spec))
        q.grad = RaggedDTensor._from_local_and_spec(p.grad.to_local().detach().clone(), p.grad._spec)
        out.append(q)
    return out


def _time_alternating(param_sets: dict[str, list], foreach: bool, a) -> dict[str, float]:
    """Median step time of ``torch.optim.AdamW`` over each parameter set, the sets stepping in turn
    within each round (the order rotating every round), so load and frequency drift hit all alike."""
    from fsdp_optim.optimizers import AdamW

    opts = {k: (AdamW if k[1] == "fsdp_optim_adamw_s" else torch.optim.AdamW)(ps, lr=1e-3, weight_decay=0.1, foreach=foreach)
            for k, ps in param_sets.items()}
    times: dict[str, list[float]] = {k: [] for k in opts}
    names = list(opts)
    for i in range(a.warmup + a.steps):
        for k in names[i % len(names):] + names[: i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            opts[k].step()
            t1 = time.perf_counter()
            if i >= a.warmup:
                times[k].append(t1 - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _run(a):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ours, peer = _models(a, mesh)
    out = {"params": sum(1 for _ in ours.parameters()),
           "local_numel": {n: sum(p.to_local().numel() for p in m.parameters()) for n, m in (("fsdp_optim", ours), ("fsdp2", peer))}}
    for foreach in (False, True):
        sets = {}
        for name, model in (("fsdp_optim", ours), ("fsdp2", peer)):
            params = list(model.parameters())
            sets[(name, "dtensor_s")], sets[(name, "plain_s")] = params, _plain(params)
        # fsdp_optim's own AdamW over our parameters (on their local pieces: no dispatch), on a copy
        sets[("fsdp_optim", "fsdp_optim_adamw_s")] = _ragged_copy(ours)
        t = _time_alternating(sets, foreach, a)
        out[f"foreach={foreach}"] = {n: {k: v for (m, k), v in t.items() if m == n} for n in ("fsdp_optim", "fsdp2")}
    prof = cProfile.Profile()
    opt = torch.optim.AdamW(list(ours.parameters()), lr=1e-3, weight_decay=0.1, foreach=True)
    opt.step()
    prof.enable()
    opt.step()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = stats.total_tt
    rows = sorted(((v[2], v[0], f"{os.path.basename(k[0])}:{k[2]}") for k, v in stats.stats.items()
                   if "fsdp_optim" in k[0] or "torch/distributed/tensor" in k[0]), reverse=True)
    out["profile_foreach_step"] = {"total_s": total, "top_own_time": [
        {"where": w, "own_s": t, "calls": n} for t, n, w in rows[:8]]}
    return out


def main(argv=None) -> None:
    a = _parse(argv)
    from fsdp_optim._testing import run_distributed

    results = run_distributed(lambda: _run(a), world_size=a.world_size, timeout=3600)
    summary = {}
    for key in ("foreach=False", "foreach=True"):
        summary[key] = {n: {k: max(r[key][n][k] for r in results) for k in results[0][key][n]}
                        for n in ("fsdp_optim", "fsdp2")}
        for n, s in summary[key].items():
            s["overhead_s"] = s["dtensor_s"] - s["plain_s"]
            s["ratio_dtensor_over_plain"] = s["dtensor_s"] / s["plain_s"]
        o, p = summary[key]["fsdp_optim"], summary[key]["fsdp2"]
        summary[key]["ratio_ours_over_fsdp2"] = o["dtensor_s"] / p["dtensor_s"]
    print(f"torch.optim.AdamW step, {results[0]['params']} parameters, W={a.world_size}, median of {a.steps}, "
          "max over ranks (ms)")
    print(f"{'':16s}{'runtime':>12s}{'DTensor':>10s}{'plain':>10s}{'overhead':>10s}{'x plain':>9s}")
    for key in ("foreach=False", "foreach=True"):
        for n in ("fsdp_optim", "fsdp2"):
            s = summary[key][n]
            print(f"{key:16s}{n:>12s}{s['dtensor_s'] * 1e3:10.2f}{s['plain_s'] * 1e3:10.2f}"
                  f"{s['overhead_s'] * 1e3:10.2f}{s['ratio_dtensor_over_plain']:9.2f}")
        print(f"{key:16s} ours / FSDP2 (DTensor steps): {summary[key]['ratio_ours_over_fsdp2']:.3f}; "
              f"fsdp_optim.optimizers.AdamW over ours: {summary[key]['fsdp_optim']['fsdp_optim_adamw_s'] * 1e3:.2f} ms, "
              f"{summary[key]['fsdp_optim']['fsdp_optim_adamw_s'] / summary[key]['fsdp2']['dtensor_s']:.3f}x FSDP2 + torch.optim.AdamW")
    print("local elements per rank: " + "; ".join(f"rank {i}: " + ", ".join(f"{n} {v}" for n, v in r["local_numel"].items())
                                                  for i, r in enumerate(results)))
    prof = results[0]["profile_foreach_step"]
    print(f"rank 0, one foreach step over ours under cProfile ({prof['total_s'] * 1e3:.1f} ms), own time:")
    for row in prof["top_own_time"]:
        print(f"  {row['own_s'] * 1e3:8.2f} ms {row['calls']:6d} calls  {row['where']}")
    record = {"config": {k: v for k, v in vars(a).items() if k not in ("out", "out_file")}, "per_rank": results,
              "summary": summary, "torch": torch.__version__}
    os.makedirs(os.path.dirname(a.out_file), exist_ok=True)
    with open(a.out_file, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {a.out_file}")


if __name__ == "__main__":
    main()
