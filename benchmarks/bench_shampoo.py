"""Shampoo and SOAP steps on block-aligned shards at W ranks vs their own single-process step / W,
and batched vs looped (per-block) Shampoo and SOAP, side by side in one launch.

One launch of W (default 2) forked gloo ranks, 1 thread each. Parameters: ``--layers`` matrices
``[dim, dim]`` plus a few odd shapes (a ``[dim, 3 * dim // 2]`` matrix, a ``[dim]`` vector). Every
step every rank draws the same full gradients (seeded), outside any timed region, and feeds them to:

- ``shampoo W`` / ``shampoo looped W``: ``Shampoo(max_preconditioner_dim=k)`` (``batched=True``, the
  CUDA default / ``False``, the CPU default) on RaggedLayout layouts that deal each tensor's ``k``-strips evenly to the ranks;
- ``shampoo 1p``: the same optimizer on full (unsharded) parameters, run on every rank (each rank's
  single core does the whole step: the "single-process step");
- ``soap W`` / ``soap looped W`` / ``soap 1p`` / ``soap looped 1p``: ``SOAP(block_size=k)`` likewise
  (``batched=True`` / ``False``).

Per side: the slowest rank's step time each step (sides timed in rotating order so a load spike on
the shared machine hits all alike), reported as the median over the steps after ``--warmup`` and
as the mean over whole ``precondition_frequency`` periods (which include the root / eigenbasis
steps). The target: ``W step / (1p step / W) <= 1.2``. The batched/looped ratios compare each
optimizer's two modes at W and in one process; ``soap_batched_equals_looped_bitwise`` checks SOAP's.

    python benchmarks/bench_shampoo.py            # -> benchmarks/results/bench_shampoo.json
    python benchmarks/bench_shampoo.py --quick    # -> runs/bench-quick/bench_shampoo.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fsdp_optim._testing import make_sharded_param, run_distributed, sharded_grad  # noqa: E402
from fsdp_optim.optimizers import SOAP, Shampoo  # noqa: E402
from fsdp_optim.optimizers._shampoo import shampoo_blocks  # noqa: E402
from fsdp_optim.sharding.contract import local_tensor
from fsdp_optim.sharding.plan import RaggedLayout  # noqa: E402

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def strip_layout(shape: tuple[int, ...], k: int, world_size: int, spec) -> RaggedLayout:
    """Each tensor's k-strips dealt in contiguous runs of (nearly) equal count to the ranks."""
    geom = shampoo_blocks(shape, k, spec)
    numel = math.prod(shape)
    starts = [geom.strip_start_row(i) * geom.cols for i in range(geom.num_strips)] + [numel]
    bounds = [starts[round(geom.num_strips * r / world_size)] for r in range(world_size)] + [numel]
    bounds[0] = 0
    return RaggedLayout(shape, tuple(bounds))


def _slowest(t: float) -> float:
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def bench(args) -> dict:
    rank, w = dist.get_rank(), dist.get_world_size()
    d, k = args.dim, args.k
    shapes = {f"layers.{i}.weight": (d, d) for i in range(args.layers)}
    shapes |= {"proj.weight": (d, 3 * d // 2), "norm.weight": (d,)}
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    rule = Shampoo.rule(max_preconditioner_dim=k)
    specs = {n: rule(n, init[n], None) for n in shapes}
    layouts = {n: strip_layout(s, k, w, specs[n]) for n, s in shapes.items()}
    shampoo_kw = dict(lr=1e-3, betas=(0.9, 0.95), grafting="adam", max_preconditioner_dim=k,
                      precondition_frequency=args.precondition_frequency)  # fmt: skip
    soap_kw = dict(lr=3e-3, block_size=k, precondition_frequency=args.precondition_frequency)

    def sharded():
        return {n: make_sharded_param(init[n], spec=specs[n], layout=layouts[n], fqn=n) for n in shapes}

    def plain():
        return {n: torch.nn.Parameter(init[n].clone()) for n in shapes}

    sides = {}
    for key, params, make in [
        ("shampoo W", sharded(), lambda ps: Shampoo(ps, **shampoo_kw, batched=True)),
        ("shampoo looped W", sharded(), lambda ps: Shampoo(ps, **shampoo_kw, batched=False)),
        ("shampoo 1p", plain(), lambda ps: Shampoo(ps, **shampoo_kw, batched=True)),
        ("shampoo looped 1p", plain(), lambda ps: Shampoo(ps, **shampoo_kw, batched=False)),
        ("soap W", sharded(), lambda ps: SOAP(list(ps), **soap_kw, batched=True)),
        ("soap looped W", sharded(), lambda ps: SOAP(list(ps), **soap_kw, batched=False)),
        ("soap 1p", plain(), lambda ps: SOAP(list(ps), **soap_kw, batched=True)),
        ("soap looped 1p", plain(), lambda ps: SOAP(list(ps), **soap_kw, batched=False)),
    ]:
        sides[key] = (params, make(list(params.values())), key.endswith(" W"))
    keys = list(sides)
    times: dict[str, list[float]] = {key: [] for key in keys}
    for step in range(args.steps):
        g = torch.Generator().manual_seed(100 + step)
        full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        for params, _, is_sharded in sides.values():
            for n, p in params.items():
                p.grad = sharded_grad(p, full[n])
        for i in range(len(keys)):
            key = keys[(i + step) % len(keys)]
            dist.barrier()
            t0 = time.perf_counter()
            sides[key][1].step()
            times[key].append(_slowest(time.perf_counter() - t0))
    f = args.precondition_frequency
    out = {}
    for key, t in times.items():
        body = t[args.warmup :]
        n_periods = len(body) // f
        window = body[: n_periods * f] if n_periods else body
        out[key] = {"step_s_median": statistics.median(body), "step_s_mean_over_periods": statistics.fmean(window)}
    ratios = {}
    for stat in ("step_s_median", "step_s_mean_over_periods"):
        tag = stat.replace("step_s_", "")
        for name in ("shampoo", "shampoo looped", "soap", "soap looped"):
            ratios[f"{name} W / (1p / W), {tag}"] = out[f"{name} W"][stat] / (out[f"{name} 1p"][stat] / w)
        for name in ("shampoo", "soap"):
            for at in ("W", "1p"):
                where = "at W" if at == "W" else "1p"
                ratios[f"{name} batched / looped {where}, {tag}"] = (
                    out[f"{name} {at}"][stat] / out[f"{name} looped {at}"][stat]
                )
    # agreement of the sharded and single-process runs (bitwise expected: the same blocks, same kernels)
    same = {}
    for name in ("shampoo", "shampoo looped", "soap", "soap looped"):
        ps, ps1 = sides[f"{name} W"][0], sides[f"{name} 1p"][0]
        same[name] = all(torch.equal(local_tensor(ps[n]), layouts[n].shard(local_tensor(ps1[n]).detach(), rank)) for n in shapes)
    batched_same = {
        at: all(torch.equal(sides[f"soap {at}"][0][n], sides[f"soap looped {at}"][0][n]) for n in shapes)
        for at in ("W", "1p")
    }
    return {"steps": out, "ratios": ratios, "sharded_equals_single_process_bitwise": same,
            "soap_batched_equals_looped_bitwise": batched_same}  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--k", type=int, default=128, help="max_preconditioner_dim / SOAP block_size")
    ap.add_argument("--precondition-frequency", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a small config (dim 128, k 32, 2 layers, 7 steps)")
    ap.add_argument("--out", default=None, help="output directory")
    args = ap.parse_args(argv)
    if args.quick:
        args.dim, args.k, args.layers, args.steps, args.warmup = 128, 32, 2, 7, 2
    out_dir = args.out or os.path.join(_ROOT, "runs/bench-quick" if args.quick else "benchmarks/results")
    if args.steps <= args.warmup:
        raise ValueError("--steps must be > --warmup")
    t0 = time.time()
    [res, *rest] = run_distributed(lambda: bench(args), world_size=args.world_size, timeout=3600)
    res["sharded_equals_single_process_bitwise"] = {
        k: all(r["sharded_equals_single_process_bitwise"][k] for r in [res, *rest])
        for k in res["sharded_equals_single_process_bitwise"]
    }
    res["soap_batched_equals_looped_bitwise"] = {
        k: all(r["soap_batched_equals_looped_bitwise"][k] for r in [res, *rest])
        for k in res["soap_batched_equals_looped_bitwise"]
    }
    out = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads_per_rank": 1,
        "wall_s": time.time() - t0,
        **res,
    }
    print(f"W={args.world_size}, {args.layers} x [{args.dim}, {args.dim}] + [{args.dim}, {3 * args.dim // 2}] + "
          f"[{args.dim}], k={args.k}, precondition_frequency={args.precondition_frequency}, gloo, CPU, 1 thread/rank")  # fmt: skip
    print(f"{'step':<20}{'median s':>10}{'mean/period s':>15}")
    for key, r in res["steps"].items():
        print(f"{key:<20}{r['step_s_median']:>10.4f}{r['step_s_mean_over_periods']:>15.4f}")
    for key, v in res["ratios"].items():
        print(f"{key:<52}{v:>8.3f}")
    print("sharded == single process (bitwise):", res["sharded_equals_single_process_bitwise"])
    print("soap batched == looped (bitwise):", res["soap_batched_equals_looped_bitwise"])
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_shampoo.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
