"""Muon's orthogonalization: torch's Newton–Schulz vs Gram Newton–Schulz vs Polar Express, time per step.

Matrices: the Llama-3.1-8B dense layer and the DeepSeek-V3 routed experts of ``tests/data/model_shapes.json``,
every dimension divided by ``--scale`` (default 8: aspect ratios kept; 2 CPU cores cannot repeat the full
sizes often enough for a median), ``--layers`` Llama layers and ``--experts`` experts per projection (a
multiple of 2, 3 and 4, so W = 2..4 share them evenly). One thread per process throughout. Methods
(``Muon(...)`` arguments): ``torch NS`` (the default: torch.optim.Muon's bits), ``Polar Express``, ``Gram NS
fp16`` (the authors' dtype), ``Gram NS bf16`` and ``Gram + PE bf16`` (``gram_dtype=torch.bfloat16``).

0. ``full_size``: one DeepSeek-V3 expert matrix at its real 2048 x 7168, torch NS vs Gram NS bf16 and
   the GEMM floor (``--full-size-rounds``).
1. ``per_shape``: one orthogonalization of one matrix of each shape (the pure functions; the authors'
   gram-newton-schulz 0.1.6, pure-torch fp16 backend, beside them when installed), median ms, ratio to
   torch NS, and the FLOP ratio (``_orthogonalize.flops``); ``bf16 GEMMs only`` rows time each algorithm's
   matrix products alone (plain ``mm`` on fixed operands): the floor this CPU's BLAS sets.
2. ``step``: a whole ``Muon.step()`` on every matrix of a set, one process; ``llama3-8b mlp`` is the
   gate/up/down matrices alone (3.5:1, the issue's "MLP aspect"), ``deepseek-v3 experts`` is all 3.5:1.
3. ``sharded``: the same step at W = 2..4 (forked gloo ranks; matrices dealt to ranks longest first by
   Newton–Schulz flops, experts in equal contiguous runs: each rank's share, no collectives). The ranks
   take turns (a barrier between turns) so each rank's step runs alone on the shared cores, and in the
   same rounds rank 0 also times the single-process step. Ratio = slowest rank's step / (single-process
   step / W), target <= 1.05, two ways: ``ratio_best_rounds`` from each rank's and the single process's
   fastest round (the load-free time: the figure the target is read on), and ``ratio_to_single_over_w``,
   the median over rounds of that round's slowest rank over its single-process step / W (the max of W
   noisy samples: biased upward by the shared machine's noise, the more the larger W).
   ``sum_over_ranks_over_single``: all ranks' work over the single process's (sharding's overhead).

Every table interleaves the methods round by round and reports medians of the process's CPU time
(``time.process_time``; one thread, so the compute time of the step: wall time on the shared cores also
counted the time other processes held them); ratios are medians of per-round ratios (paired in time).
Polar Express runs torch NS's ops with other coefficients: its ratio to torch NS shows the noise.

    python benchmarks/bench_orthogonalize.py          # -> benchmarks/results/bench_orthogonalize.{json,md}
    python benchmarks/bench_orthogonalize.py --quick  # -> runs/bench-quick/ (scale 32, 3 rounds, W = 2)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _out import ROOT, out_dir  # noqa: E402
from fsdp_optim._testing import make_sharded_param, run_distributed, sharded_grad  # noqa: E402
from fsdp_optim.optimizers import Muon  # noqa: E402
from fsdp_optim.optimizers._muon import assign_owners  # noqa: E402
from fsdp_optim.optimizers._orthogonalize import POLAR_EXPRESS, flops, gram_newton_schulz, newton_schulz  # noqa: E402
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding import expert, whole  # noqa: E402

METHODS = {
    "torch NS": {},
    "Polar Express": dict(coefficients="polar_express"),
    "Gram NS fp16": dict(orthogonalize="gram_newton_schulz"),
    "Gram NS bf16": dict(orthogonalize="gram_newton_schulz", gram_dtype=torch.bfloat16),
    "Gram + PE bf16": dict(orthogonalize="gram_newton_schulz", coefficients="polar_express", gram_dtype=torch.bfloat16),
}
MLP = ("gate_proj", "up_proj", "down_proj")
_clock = time.process_time
"""CPU time of this process: the cores are shared, and wall time would count the time other processes
held them (in the results made so, Polar Express and torch NS, the same flops, differed by 20% in wall
time). One thread per process, so it is the step's compute time."""


def model_sets(scale: int, layers: int, experts: int) -> dict[str, dict[str, tuple[int, ...]]]:
    """``{set: {name: shape}}`` from tests/data/model_shapes.json, dims divided by ``scale``."""
    models = {m["name"]: m for m in json.loads((ROOT / "tests" / "data" / "model_shapes.json").read_text())}
    small = lambda s: tuple(max(1, d // scale) for d in s)  # noqa: E731
    llama = {k: small(s) for k, s in models["Llama-3.1-8B"]["layers"]["dense"].items() if len(s) == 2}
    ds = models["DeepSeek-V3 (671B)"]["layers"]["moe"]
    routed = {k.split(".")[-2]: small(s) for k, s in ds.items() if k.startswith("mlp.experts.")}
    sets = {
        "llama3-8b": {f"layers.{i}.{k}": s for i in range(layers) for k, s in llama.items()},
        "llama3-8b mlp": {f"layers.{i}.{k}": s for i in range(layers) for k, s in llama.items() if k.split(".")[-2] in MLP},
        "deepseek-v3 experts": {f"experts.{k}": (experts, *s) for k, s in routed.items()},
    }
    assert set(routed) == set(MLP) and all(sets.values())
    return sets


def matrices(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [shape[-2:]] * (shape[0] if len(shape) == 3 else 1)


def set_flops(shapes: dict[str, tuple[int, ...]], kw: dict) -> int:
    method = kw.get("orthogonalize", "newton_schulz")
    return sum(flops(method, r, c, 5) for s in shapes.values() for r, c in matrices(s))


def _median_ms(ts: list[float]) -> float:
    return statistics.median(ts) * 1e3


def _paired(ts: list[float], base: list[float], scale: float = 1.0) -> float:
    """Median over rounds of ``ts[i] / (base[i] * scale)``: each ratio from one round, so a slow drift of
    the machine's load cancels (the ratio of medians does not pair them)."""
    return statistics.median(t / (b * scale) for t, b in zip(ts, base))


def _grads(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def _plain_opt(shapes, kw, grads):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes.values()]
    for p, g in zip(params, grads.values()):
        p.grad = g.clone()
    return Muon([{"params": params, "use_muon": True}], lr=0.02, **kw)


def per_shape(shapes: dict[str, tuple[int, ...]], rounds: int) -> list[dict]:
    """One orthogonalization of one matrix per distinct shape, every method and the authors' code."""
    try:
        import gram_newton_schulz as gns
    except ImportError:  # the reference is a test dependency (scripts/setup.sh); the table works without it
        gns = None
    rows = []
    for r, c in sorted({rc for s in shapes.values() for rc in matrices(s)}):
        g = torch.randn(r, c, generator=torch.Generator().manual_seed(r * c)).bfloat16()
        fns = {
            "torch NS": lambda: newton_schulz(g),
            "Polar Express": lambda: newton_schulz(g, coefficients=POLAR_EXPRESS),
            "Gram NS fp16": lambda: gram_newton_schulz(g),
            "Gram NS bf16": lambda: gram_newton_schulz(g, dtype=torch.bfloat16),
            "Gram + PE bf16": lambda: gram_newton_schulz(g, coefficients=POLAR_EXPRESS, dtype=torch.bfloat16),
        }
        kinds = {k: "gram_newton_schulz" if k.startswith("Gram") else "newton_schulz" for k in fns}
        if r != c:  # the floor: each algorithm's bf16 matmuls alone (no casts, norms or addmm epilogues)
            fns["bf16 GEMMs only: NS"], fns["bf16 GEMMs only: Gram"] = gemms(r, c)
            kinds |= {"bf16 GEMMs only: NS": "newton_schulz", "bf16 GEMMs only: Gram": "gram_newton_schulz"}
        if gns is not None:
            pe = [list(t) for t in POLAR_EXPRESS]
            common = dict(ns_use_kernels=False, compile_kwargs=None, ns_coefficients=pe)
            theirs_gram, theirs_ns = gns.GramNewtonSchulz(**common), gns.StandardNewtonSchulz(**common)
            fns["authors: NS fp16 (PE)"] = lambda: theirs_ns(g)
            fns["authors: Gram fp16 (PE)"] = lambda: theirs_gram(g)
            kinds |= {"authors: NS fp16 (PE)": "newton_schulz", "authors: Gram fp16 (PE)": "gram_newton_schulz"}
        times = {k: [] for k in fns}
        for f in fns.values():
            f()  # warm up
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = _clock()
                f()
                times[k].append(_clock() - t0)
        for k in fns:
            rows.append(dict(shape=[r, c], method=k, ms=_median_ms(times[k]), min_ms=min(times[k]) * 1e3,
                             ratio_to_torch_ns=_paired(times[k], times["torch NS"]),
                             flop_ratio=flops(kinds[k], r, c, 5) / flops("newton_schulz", r, c, 5)))  # fmt: skip
    return rows


def gemms(rows: int, cols: int, steps: int = 5):
    """Two callables: the bf16 matrix products of Newton–Schulz / Gram Newton–Schulz (restart at 2) on a
    ``[rows, cols]`` matrix, as plain ``mm`` on fixed operands (what a perfect implementation would pay)."""
    n, m = min(rows, cols), max(rows, cols)
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(n, m, generator=gen) / m).bfloat16(), (torch.randn(n, n, generator=gen) / n).bfloat16()

    def ns():
        for _ in range(steps):
            a = x @ x.mT
            b = a @ a
            b @ x

    def gram():
        x @ x.mT  # R
        for _ in range(3 + 2 * 4 + 3):  # 14 n x n products: steps 0..4 as flops() counts them
            r @ r
        r @ x, x @ x.mT  # the restart
        r @ x  # Q X

    assert flops("gram_newton_schulz", n, m, steps) == 4 * 2 * n * n * m + 14 * 2 * n**3 and steps == 5
    return ns, gram


def full_size(rounds: int) -> list[dict]:
    """One DeepSeek-V3 expert matrix at its real size (2048 x 7168): the small matrices above pay a fixed
    cost per op (Gram runs about twice NS's ops), which the real size amortizes."""
    r, c = 2048, 7168
    g = torch.randn(r, c, generator=torch.Generator().manual_seed(0)).bfloat16()
    fns = {"torch NS": lambda: newton_schulz(g), "Gram NS bf16": lambda: gram_newton_schulz(g, dtype=torch.bfloat16)}
    fns["bf16 GEMMs only: NS"], fns["bf16 GEMMs only: Gram"] = gemms(r, c)
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = _clock()
            f()
            times[k].append(_clock() - t0)
    kind = lambda k: "gram_newton_schulz" if "Gram" in k else "newton_schulz"  # noqa: E731
    return [dict(shape=[r, c], method=k, ms=_median_ms(times[k]), min_ms=min(times[k]) * 1e3,
                 ratio_to_torch_ns=_paired(times[k], times["torch NS"]),
                 flop_ratio=flops(kind(k), r, c, 5) / flops("newton_schulz", r, c, 5)) for k in fns]  # fmt: skip


def step_one_process(shapes: dict[str, tuple[int, ...]], rounds: int) -> list[dict]:
    grads = _grads(shapes)
    opts = {k: _plain_opt(shapes, kw, grads) for k, kw in METHODS.items()}
    times = {k: [] for k in METHODS}
    for opt in opts.values():
        opt.step()  # warm up (and the momentum buffers exist)
    for _ in range(rounds):
        for k, opt in opts.items():
            t0 = _clock()
            opt.step()
            times[k].append(_clock() - t0)
    base_flops = set_flops(shapes, {})
    return [dict(method=k, ms=_median_ms(times[k]), min_ms=min(times[k]) * 1e3,
                 ratio_to_torch_ns=_paired(times[k], times["torch NS"]),
                 flop_ratio=set_flops(shapes, kw) / base_flops) for k, kw in METHODS.items()]  # fmt: skip


def layouts_for(shapes: dict[str, tuple[int, ...]], w: int) -> dict[str, RaggedLayout]:
    """Each rank's share: 2-D matrices whole on an owner (longest first by flops), experts in equal runs."""
    out, two_d = {}, [k for k, s in shapes.items() if len(s) == 2]
    owners = assign_owners([flops("newton_schulz", *shapes[k], 5) for k in two_d], [[1] * w] * len(two_d), [0] * w)
    for k, o in zip(two_d, owners):
        n = math.prod(shapes[k])
        out[k] = RaggedLayout(shapes[k], tuple([0] * (o + 1) + [n] * (w - o)))
    for k, s in shapes.items():
        if len(s) == 3:
            if s[0] % w:
                raise ValueError(f"--experts {s[0]} does not divide evenly over W = {w}")
            per = math.prod(s[1:])
            out[k] = RaggedLayout(s, tuple(r * (s[0] // w) * per for r in range(w)) + (math.prod(s),))
    return out


def sharded(shapes: dict[str, tuple[int, ...]], w: int, rounds: int) -> dict:
    """In one launch: each rank's step on its share, and rank 0's single-process step, turn by turn."""
    layouts = layouts_for(shapes, w)

    def fn():
        torch.set_num_threads(1)
        rank = dist.get_rank()
        grads = _grads(shapes)
        gen = torch.Generator().manual_seed(0)
        init = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
        opts = {}
        for name, kw in METHODS.items():
            params = []
            for k, s in shapes.items():
                p = make_sharded_param(init[k], spec=whole() if len(s) == 2 else expert(), layout=layouts[k], fqn=k)
                p.grad = sharded_grad(p, grads[k])
                params.append(p)
            opts[name] = Muon(params, lr=0.02, **kw)
        plain = {k: _plain_opt(shapes, kw, grads) for k, kw in METHODS.items()} if rank == 0 else {}
        counts = []
        for opt in opts.values():
            with CommDebugMode() as mode:
                opt.step()  # warm up; no optimizer collective
            counts.append(sum(mode.get_comm_counts().values()))
        for opt in plain.values():
            opt.step()
        mine = {k: [] for k in METHODS}
        one = {k: [] for k in METHODS}
        for _ in range(rounds):
            for k in METHODS:
                if rank == 0:
                    t0 = _clock()
                    plain[k].step()
                    one[k].append(_clock() - t0)
                for r in range(w):
                    dist.barrier()
                    if r == rank:
                        t0 = _clock()
                        opts[k].step()
                        mine[k].append(_clock() - t0)
                dist.barrier()
        return dict(step_s=mine, one_s=one if rank == 0 else None,
                    collectives=max(counts), flops=sum(flops("newton_schulz", *rc, 5) for k in shapes
                                                      for rc in _local_matrices(shapes[k], layouts[k], rank)))  # fmt: skip

    outs = run_distributed(fn, world_size=w, timeout=3600)
    rows = []
    for k in METHODS:
        one, ranks = outs[0]["one_s"][k], [o["step_s"][k] for o in outs]
        slowest = [max(per) for per in zip(*ranks)]  # per round
        rows.append(dict(method=k, world_size=w, single_process_ms=_median_ms(one), slowest_rank_ms=_median_ms(slowest),
                         per_rank_ms=[_median_ms(t) for t in ranks],
                         ratio_to_single_over_w=_paired(slowest, one, 1 / w),
                         ratio_best_rounds=max(min(t) for t in ranks) / (min(one) / w),
                         sum_over_ranks_over_single=_paired([sum(per) for per in zip(*ranks)], one),
                         raw_s={"single_process": one, "ranks": ranks},
                         collectives_per_step=max(o["collectives"] for o in outs),
                         flops_max_over_mean=max(o["flops"] for o in outs) / (sum(o["flops"] for o in outs) / w)))  # fmt: skip
    return {"rows": rows}


def _local_matrices(shape: tuple[int, ...], layout: RaggedLayout, rank: int) -> list[tuple[int, int]]:
    lo, hi = layout.bounds[rank], layout.bounds[rank + 1]
    per = math.prod(shape[-2:])
    return [shape[-2:]] * ((hi - lo) // per)


def markdown(res: dict) -> str:
    lines = [f"# Orthogonalization for Muon (`{res['command']}`)", "",
             f"{res['platform']}, torch {res['torch']}, 1 thread per process; dims of the real shapes / "
             f"{res['config']['scale']}, medians of {res['config']['rounds']} interleaved rounds, process CPU time (ms); "
             "ratios: medians of per-round ratios. Polar Express runs torch NS's ops: its ratio is the noise.", ""]  # fmt: skip
    for name, s in res["sets"].items():
        lines += [f"## {name}", "", "| shape | method | ms | ratio to torch NS | FLOP ratio |", "|---|---|---|---|---|"]
        for r in s["per_shape"]:
            lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['method']} | {r['ms']:.2f} | "
                         f"{r['ratio_to_torch_ns']:.2f} | {r['flop_ratio']:.2f} |")  # fmt: skip
        lines += ["", f"Muon step, one process ({s['num_matrices']} matrices):", "",
                  "| method | ms | ratio to torch NS | FLOP ratio |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['method']} | {r['ms']:.1f} | {r['ratio_to_torch_ns']:.2f} | {r['flop_ratio']:.2f} |"
                  for r in s["step"]]  # fmt: skip
        if s.get("sharded"):
            lines += ["", "Sharded step (slowest rank) / (single-process step / W), target <= 1.05 (best rounds; "
                      "the median of per-round slowest ranks beside it), all ranks' work / single process's, collectives:", "",
                      "| method | W | slowest rank ms | single process ms | ratio, best rounds | ratio, median of rounds | "
                      "sum of ranks / single | FLOP max/mean | collectives |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
            for w_res in s["sharded"]:
                lines += [f"| {r['method']} | {r['world_size']} | {r['slowest_rank_ms']:.1f} | {r['single_process_ms']:.1f} | "
                          f"{r['ratio_best_rounds']:.3f} | {r['ratio_to_single_over_w']:.3f} | {r['sum_over_ranks_over_single']:.3f} | "
                          f"{r['flops_max_over_mean']:.3f} | {r['collectives_per_step']} |" for r in w_res["rows"]]  # fmt: skip
        lines.append("")
    if res.get("full_size"):
        lines += ["## One DeepSeek-V3 expert matrix at full size", "", "| shape | method | ms | ratio to torch NS | FLOP ratio |",
                  "|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['shape'][0]}x{r['shape'][1]} | {r['method']} | {r['ms']:.0f} | {r['ratio_to_torch_ns']:.2f} | "
                  f"{r['flop_ratio']:.2f} |" for r in res["full_size"]]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=8, help="divide every dimension by this (aspect ratios kept)")
    ap.add_argument("--layers", type=int, default=4, help="Llama layers")
    ap.add_argument("--experts", type=int, default=12, help="DeepSeek-V3 experts per projection")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--world-sizes", type=int, nargs="*", default=[2, 3, 4])
    ap.add_argument("--full-size-rounds", type=int, default=5, help="rounds of the 2048 x 7168 table (0: skip)")
    ap.add_argument("--quick", action="store_true", help="scale 32, 3 rounds, W = 2: a smoke run")
    ap.add_argument("--out", default=None, help="output directory")
    args = ap.parse_args(argv)
    folder = out_dir(ap, args)
    if args.quick:
        args.scale, args.rounds, args.world_sizes, args.full_size_rounds = 32, 3, [2], 0
    torch.set_num_threads(1)
    t0 = time.time()
    res: dict = {"command": "python benchmarks/bench_orthogonalize.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
                 "config": {k: v for k, v in vars(args).items() if k != "out"}, "torch": torch.__version__,
                 "platform": platform.platform(), "threads_per_process": 1, "sets": {}}  # fmt: skip
    for name, shapes in model_sets(args.scale, args.layers, args.experts).items():
        s = {"shapes": shapes, "num_matrices": sum(len(matrices(v)) for v in shapes.values())}
        s["per_shape"] = per_shape(shapes, args.rounds) if name != "llama3-8b mlp" else []
        s["step"] = step_one_process(shapes, args.rounds)
        s["sharded"] = [sharded(shapes, w, args.rounds) for w in args.world_sizes] if name != "llama3-8b mlp" else []
        res["sets"][name] = s
        print(f"[bench_orthogonalize] {name}: " + ", ".join(f"{r['method']} {r['ratio_to_torch_ns']:.2f}x"
                                                           for r in s["step"]), flush=True)  # fmt: skip
    res["full_size"] = full_size(args.full_size_rounds) if args.full_size_rounds else []
    mlp = [r for n in ("llama3-8b mlp", "deepseek-v3 experts") for r in res["sets"][n]["step"]]
    res["target_gram_step_on_mlp_aspect_le_0.80"] = {
        k: max(r["ratio_to_torch_ns"] for r in mlp if r["method"] == k) for k in METHODS if k.startswith("Gram")
    }
    res["sharded_max_ratio_best_rounds"] = max((r["ratio_best_rounds"] for s in res["sets"].values()
                                                for w in s["sharded"] for r in w["rows"]), default=None)  # fmt: skip
    res["wall_s"] = time.time() - t0
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench_orthogonalize.json").write_text(json.dumps(res, indent=1) + "\n")
    (folder / "bench_orthogonalize.md").write_text(markdown(res))
    print(f"[bench_orthogonalize] {res['wall_s']:.0f} s -> {folder / 'bench_orthogonalize.json'}")
    return res


if __name__ == "__main__":
    main()
