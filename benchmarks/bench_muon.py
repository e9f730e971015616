"""Muon and Shampoo optimizer steps: ours on block-aligned shards vs FSDP2 + torch.optim.Muon.

One launch of W (default 2) forked gloo ranks; one model (``--layers`` bias-free
``Linear(dim, dim)``), one data stream. Every step the FSDP2 model (``torch.distributed.fsdp.
fully_shard``) runs forward/backward on each rank's batch; its reduced gradients, gathered to
full tensors outside any timed region, are fed to every optimizer, so all see the same gradients:

- ``fsdp2+torch.Muon``: ``torch.optim.Muon`` on FSDP2's DTensor parameters (Newton–Schulz runs
  through DTensor on Shard(0) pieces);
- ``ours ragged``: our ``Muon`` on RaggedLayout layouts that keep each matrix whole on one rank
  (matrices dealt to ranks longest-first), what a ragged plan gives: no communication; batched
  Newton–Schulz (the default);
- ``ours ragged per-matrix``: the same with ``batched=False`` (the per-matrix reference mode);
- ``ours even-split``: our ``Muon`` on FSDP2's even row layout (every matrix cut across ranks,
  recorded as split, one bucket): one all_to_all_single pair per step;
- ``torch.Muon unsharded``: ``torch.optim.Muon`` on full replicas, every rank doing all of it;
  its time / W is the physical limit of a sharded step (``x limit`` = step / (that / W)); the
  summary gives it as a ratio of medians and as the median of per-step ratios (both sides timed
  in the same step, so under the same load).

Per side: the optimizer step time (the slowest rank's, median over the steps after ``--warmup``;
each step times the sides in rotating order so a load spike on the shared machine hits all
alike), the collectives one step issues (``CommDebugMode``), and after 4 steps the max-abs
distance of the weights to the reference, relative to the reference's largest weight.

Then batched vs per-matrix Newton–Schulz alone (``newton_schulz`` on a stack vs one call per
matrix; each rank runs its own copy, slowest rank, median) at a few ``[n, d, d]`` stacks, and
whether ``Muon`` stacks that shape on this device (on CPU only up to ``_CPU_STACK_MAX_NUMEL``).

Then our ``Shampoo`` (``rows(k)`` strips, whole per rank) vs our ``AdamW`` on the same layouts and
gradients: per-step time (median, and mean over whole ``precondition_frequency`` periods, which
includes the inverse-root steps).

    python benchmarks/bench_muon.py            # -> benchmarks/results/bench_muon.json
    python benchmarks/bench_muon.py --quick    # -> runs/bench-quick/bench_muon.json (never the committed one)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fsdp_optim._testing import make_sharded_param, run_distributed, sharded_grad  # noqa: E402
from fsdp_optim.optimizers import AdamW, Muon, Shampoo  # noqa: E402
from fsdp_optim.optimizers._muon import _stacks_well, newton_schulz  # noqa: E402
from fsdp_optim.sharding.contract import local_tensor
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding import rows, whole  # noqa: E402

MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")


class Stack(nn.Module):
    def __init__(self, dim: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def owner_layouts(shapes: dict[str, tuple[int, ...]], world_size: int) -> dict[str, RaggedLayout]:
    """Each tensor whole on one rank, dealt longest-first to the least-loaded rank."""
    loads = [0] * world_size
    out = {}
    for name in sorted(shapes, key=lambda n: (-torch.Size(shapes[n]).numel(), n)):
        r = min(range(world_size), key=lambda q: (loads[q], q))
        n = torch.Size(shapes[name]).numel()
        loads[r] += n
        out[name] = RaggedLayout(shapes[name], tuple([0] * (r + 1) + [n] * (world_size - r)))
    return out


def _slowest(t: float) -> float:
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def _maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = local_tensor(a).detach().reshape(-1), local_tensor(b).detach().reshape(-1)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _timed(step, key: str, times: dict, comms: dict) -> None:
    dist.barrier()
    with CommDebugMode() as mode:
        t0 = time.perf_counter()
        step()
        t = time.perf_counter() - t0
    times.setdefault(key, []).append(_slowest(t))
    comms.setdefault(key, []).append(mode.get_total_counts())


def bench(args) -> dict:
    from torch.distributed.fsdp import fully_shard

    rank, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Stack(args.dim, args.layers)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in init.items()}
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    fsdp_params = dict(model.named_parameters())
    opt_fsdp = torch.optim.Muon(list(fsdp_params.values()), **MUON)

    ragged = owner_layouts(shapes, w)
    even = {n: RaggedLayout.even_rows(s, w) for n, s in shapes.items()}
    ours = {n: make_sharded_param(init[n], spec=whole(), layout=ragged[n], fqn=n) for n in shapes}
    opt_ours = Muon(list(ours.values()), **MUON)
    per = {n: make_sharded_param(init[n], spec=whole(), layout=ragged[n], fqn=n) for n in shapes}
    opt_per = Muon(list(per.values()), **MUON, batched=False)
    split = {n: make_sharded_param(init[n], spec=whole(), layout=even[n], fqn=n, split=True) for n in shapes}
    opt_split = Muon(list(split.values()), **MUON)
    ref = {n: nn.Parameter(init[n].clone()) for n in shapes}
    opt_ref = torch.optim.Muon(list(ref.values()), **MUON)

    times: dict[str, list[float]] = {}
    comms: dict[str, list[int]] = {}
    dist_at_4: dict[str, float] = {}
    grads_log: list[dict[str, torch.Tensor]] = []
    sides = [
        ("fsdp2+torch.Muon", opt_fsdp.step),
        ("ours ragged", opt_ours.step),
        ("ours ragged per-matrix", opt_per.step),
        ("ours even-split", opt_split.step),
        ("torch.Muon unsharded", opt_ref.step),
    ]
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(args.batch, args.dim, generator=gen)
        model(x).square().mean().backward()
        full = {n: p.grad.full_tensor() for n, p in fsdp_params.items()}  # outside the timed region
        if step < args.shampoo_steps:
            grads_log.append(full)
        for n in shapes:
            ours[n].grad = sharded_grad(ours[n], full[n])
            per[n].grad = sharded_grad(per[n], full[n])
            split[n].grad = sharded_grad(split[n], full[n])
            ref[n].grad = full[n].clone()
        for i in range(len(sides)):
            key, fn = sides[(i + step) % len(sides)]
            _timed(fn, key, times, comms)
        if step == 3:
            scale = max(p.detach().abs().max().item() for p in ref.values())
            d = {
                "fsdp2+torch.Muon": max(_maxabs(fsdp_params[n].to_local(), even[n].shard(ref[n], rank)) for n in shapes),
                "ours ragged": max(_maxabs(ours[n], ragged[n].shard(ref[n], rank)) for n in shapes),
                "ours ragged per-matrix": max(_maxabs(per[n], ragged[n].shard(ref[n], rank)) for n in shapes),
                "torch.Muon unsharded": 0.0,
                "ours even-split": max(_maxabs(split[n], even[n].shard(ref[n], rank)) for n in shapes),
            }
            dist_at_4 = {k: _slowest(v) / scale for k, v in d.items()}
        for opt in (opt_fsdp, opt_ours, opt_per, opt_split, opt_ref):
            opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    muon = {}
    for key in times:
        t = times[key][args.warmup :]
        muon[key] = {
            "step_s_median": statistics.median(t),
            "collectives_per_step": max(comms[key]),
            "max_abs_dist_after_4_steps_rel": dist_at_4[key],
        }
    base = muon["fsdp2+torch.Muon"]["step_s_median"]
    limit = muon["torch.Muon unsharded"]["step_s_median"] / w
    for key in muon:
        muon[key]["time_ratio_vs_fsdp2"] = muon[key]["step_s_median"] / base
        muon[key]["time_ratio_vs_physical_limit"] = muon[key]["step_s_median"] / limit
    def paired(a: str, b: str, scale: float = 1.0) -> float:
        """Median over steps of a's time / (b's time * scale), each pair from the same step."""
        return statistics.median(x / (y * scale) for x, y in zip(times[a][args.warmup :], times[b][args.warmup :]))

    muon_summary = {
        "ours_over_physical_limit_paired_median": paired("ours ragged", "torch.Muon unsharded", 1 / w),
        "ours_per_matrix_over_physical_limit_paired_median": paired("ours ragged per-matrix", "torch.Muon unsharded", 1 / w),
        "batched_over_per_matrix_step_paired_median": paired("ours ragged", "ours ragged per-matrix"),
        "physical_limit_s": limit,
        "ours_over_physical_limit": muon["ours ragged"]["step_s_median"] / limit,
        "ours_per_matrix_over_physical_limit": muon["ours ragged per-matrix"]["step_s_median"] / limit,
        "batched_over_per_matrix_step": muon["ours ragged"]["step_s_median"] / muon["ours ragged per-matrix"]["step_s_median"],
    }

    # ---- Newton–Schulz alone: batched stack vs one call per matrix ------------------------------
    ns_rows = []
    for n, d in args.ns_stacks:
        g = torch.randn(n, d, d, generator=torch.Generator().manual_seed(n * d))
        nt: dict[str, list[float]] = {}
        for rep in range(args.ns_reps):
            pair = [("batched", lambda: newton_schulz(g)), ("per-matrix", lambda: [newton_schulz(g[i]) for i in range(n)])]
            for i in range(2):
                key, fn = pair[(i + rep) % 2]
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                nt.setdefault(key, []).append(_slowest(time.perf_counter() - t0))
        b, m = statistics.median(nt["batched"][1:]), statistics.median(nt["per-matrix"][1:])
        same = torch.equal(newton_schulz(g), torch.stack([newton_schulz(g[i]) for i in range(n)]))
        ns_rows.append({"stack": [n, d, d], "batched_s_median": b, "per_matrix_s_median": m,
                        "speedup_batched": m / b, "bitwise_equal": same,
                        "muon_stacks_it": _stacks_well(d, d, g.device)})  # fmt: skip

    # ---- Shampoo vs AdamW on the same strip-whole layouts and gradients -------------------------
    k = args.shampoo_k
    strips = owner_layouts(shapes, w)
    sh = {n: make_sharded_param(init[n], spec=rows(k), layout=strips[n], fqn=n) for n in shapes}
    aw = {n: make_sharded_param(init[n], spec=rows(k), layout=strips[n], fqn=n) for n in shapes}
    opt_sh = Shampoo(list(sh.values()), lr=1e-3, max_preconditioner_dim=k, grafting="adam",
                     precondition_frequency=args.precondition_frequency)  # fmt: skip
    opt_aw = AdamW(list(aw.values()), lr=1e-3)
    st: dict[str, list[float]] = {}
    sc: dict[str, list[int]] = {}
    for step, full in enumerate(grads_log):
        for n in shapes:
            sh[n].grad = sharded_grad(sh[n], full[n])
            aw[n].grad = sharded_grad(aw[n], full[n])
        pair = [("shampoo", opt_sh.step), ("adamw", opt_aw.step)]
        for i in range(2):
            key, fn = pair[(i + step) % 2]
            _timed(fn, key, st, sc)
    f = args.precondition_frequency
    n_periods = len(grads_log) // f
    shampoo = {}
    for key in st:
        window = st[key][:n_periods * f] if n_periods else st[key]
        shampoo[key] = {
            "step_s_median": statistics.median(st[key][args.warmup :]),
            "step_s_mean_over_periods": statistics.fmean(window),
            "collectives_per_step": max(sc[key]),
        }
    for stat in ("step_s_median", "step_s_mean_over_periods"):
        shampoo["shampoo"][stat.replace("step_s", "ratio_vs_adamw")] = shampoo["shampoo"][stat] / shampoo["adamw"][stat]
    return {"muon": muon, "muon_summary": muon_summary, "newton_schulz_batched_vs_per_matrix": ns_rows,
            "shampoo_vs_adamw": shampoo}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--shampoo-k", type=int, default=512, help="max_preconditioner_dim")
    ap.add_argument("--precondition-frequency", type=int, default=10)
    ap.add_argument("--shampoo-steps", type=int, default=10, help="steps (gradients reused from the Muon run)")
    ap.add_argument("--ns-stacks", type=lambda v: [tuple(int(x) for x in s.split("x")) for s in v.split(",")],
                    default=[(32, 64), (16, 128), (8, 256), (4, 512)], help="n x d stacks, e.g. 32x64,4x512")
    ap.add_argument("--ns-reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small run (6 steps, 2 Shampoo steps) for a smoke test")
    ap.add_argument("--out", default=None, help="output directory (default benchmarks/results/, --quick: runs/bench-quick/)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.shampoo_steps, args.ns_reps = 6, 2, 4, 3
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = args.out or os.path.join(root, *(("runs", "bench-quick") if args.quick else ("benchmarks", "results")))
    args.out = os.path.join(out_dir, "bench_muon.json")
    if args.steps < max(4, args.warmup + 1) or args.shampoo_steps > args.steps:
        raise ValueError("--steps must be >= 4 and > --warmup, and >= --shampoo-steps")
    t0 = time.time()
    [res, *_] = run_distributed(lambda: bench(args), world_size=args.world_size, timeout=3600)
    out = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "command": "python benchmarks/bench_muon.py" + (" --quick" if args.quick else ""),
        "muon_hparams": MUON,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads_per_rank": 1,
        "wall_s": time.time() - t0,
        **res,
    }
    print(f"W={args.world_size}, {args.layers} x Linear({args.dim}, {args.dim}), gloo, CPU, 1 thread per rank")
    print(f"{'Muon step':<24}{'median s':>10}{'x fsdp2':>9}{'x limit':>9}{'colls/step':>12}{'dist@4 (rel)':>14}")
    for key, r in res["muon"].items():
        print(f"{key:<24}{r['step_s_median']:>10.4f}{r['time_ratio_vs_fsdp2']:>9.3f}{r['time_ratio_vs_physical_limit']:>9.3f}"
              f"{r['collectives_per_step']:>12}{r['max_abs_dist_after_4_steps_rel']:>14.2e}")  # fmt: skip
    m = res["muon_summary"]
    print(f"ours ragged / physical limit (torch.optim.Muon unsharded / W): {m['ours_over_physical_limit']:.3f}x "
          f"(ratio of medians), {m['ours_over_physical_limit_paired_median']:.3f}x (median of per-step ratios); "
          f"batched / per-matrix step: {m['batched_over_per_matrix_step']:.3f}x, "
          f"{m['batched_over_per_matrix_step_paired_median']:.3f}x paired")
    print(f"{'NS stack':<14}{'batched s':>11}{'per-matrix s':>14}{'speedup':>9}{'same bits':>11}{'Muon stacks':>13}")
    for r in res["newton_schulz_batched_vs_per_matrix"]:
        n, d, _ = r["stack"]
        print(f"{f'{n} x {d}x{d}':<14}{r['batched_s_median']:>11.5f}{r['per_matrix_s_median']:>14.5f}"
              f"{r['speedup_batched']:>9.2f}{str(r['bitwise_equal']):>11}{str(r['muon_stacks_it']):>13}")
    s = res["shampoo_vs_adamw"]
    print(f"{'step':<20}{'median s':>10}{'mean s':>10}{'colls/step':>12}")
    for key, r in s.items():
        print(f"{key:<20}{r['step_s_median']:>10.4f}{r['step_s_mean_over_periods']:>10.4f}{r['collectives_per_step']:>12}")
    print(f"Shampoo / AdamW: median {s['shampoo']['ratio_vs_adamw_median']:.2f}x, "
          f"mean over periods {s['shampoo']['ratio_vs_adamw_mean_over_periods']:.2f}x")  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
