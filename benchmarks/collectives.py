"""Even vs uneven bucket collectives on gloo, through DistributedBuffer, side by side.

For each world size W (one launch of W forked gloo ranks each), one bucket of ``--numel``
float32 elements is moved with:

- the even forms (equal segments): ``all_gather_single`` / ``reduce_scatter_single``;
- the uneven forms, for a realistic uneven split: all-gather as one group of per-owner
  ``broadcast`` (what DistributedBuffer uses on gloo), all-gather as ``all_to_all_single``
  with split sizes (the alternative), and reduce-scatter as list-form ``reduce_scatter``.

Splits: ``skewed`` has one empty rank and one rank holding 3x the mean (at W = 2 the most a
rank can hold is 2x: it holds everything), ``mild`` is +-20% around the mean. Each rep runs every
form once, in rotating order (so a load spike on the shared machine hits all forms alike); the
time of a rep is the slowest rank's; we report the median over ``--reps`` reps after
``--warmup`` warm-up reps, and each form's ratio to the even form of the same direction.

    python benchmarks/collectives.py            # W = 2 and 4, 8M floats -> benchmarks/results/collectives.json
    python benchmarks/collectives.py --reps 3   # any changed flag is a partial run -> runs/bench-quick/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _out import out_dir  # noqa: E402

from fsdp_optim._testing import run_distributed  # noqa: E402
from fsdp_optim.sharding.plan import BucketPlan, Layout, Placement, RaggedLayout
from fsdp_optim.sharding._buffer import DistributedBuffer
from fsdp_optim.sharding import elements  # noqa: E402


def _plan(numel: int, sizes: list[int]) -> BucketPlan:
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    assert bounds[-1] == numel
    even = len(set(sizes)) == 1
    p = Placement(name="x", shape=(numel,), spec=elements(1), offset=0, shard=RaggedLayout((numel,), tuple(bounds)))
    layout = Layout.EVEN if even else Layout.RAGGED
    return BucketPlan(name="bench", layout=layout, placements=(p,), rank_bounds=tuple(bounds))


def _splits(numel: int, w: int) -> dict[str, list[int]]:
    mean = numel // w
    out = {"even": [mean] * w}
    if w == 2:
        out["skewed"] = [0, numel]
    else:
        big = 3 * mean
        rest = numel - big
        k = w - 2
        out["skewed"] = [0, big] + [rest // k + (1 if i < rest % k else 0) for i in range(k)]
    mild = [mean + (mean // 5 if r % 2 == 0 else -(mean // 5)) for r in range(w)]
    mild[-1] += numel - sum(mild)
    out["mild"] = mild
    return out


def _bench(numel: int, reps: int, warmup: int):
    rank, w = dist.get_rank(), dist.get_world_size()
    assert numel % w == 0, "numel must divide by W for the even reference"
    cases = []  # (split, form, direction, fn)
    for split, sizes in _splits(numel, w).items():
        plan = _plan(numel, sizes)
        full_grad = torch.ones(numel)
        for mode in ["auto", "broadcast", "all_to_all"] if split == "even" else ["broadcast", "all_to_all"]:
            buf = DistributedBuffer(plan, uneven_gather=mode)
            if split == "even" and mode != "auto":
                # Benchmark only: route an even bucket through an uneven form to compare the
                # algorithms on the same bytes (DistributedBuffer uses the tensor forms for it).
                buf.is_even = False
            buf.segment.fill_(rank + 1)
            out = buf.new_full()
            form = "all_gather_single" if buf.is_even else mode
            cases.append((split, form, "all_gather", lambda b=buf, o=out: b.all_gather(out=o)))
            if split == "even" and mode in ("auto", "broadcast"):
                form = "reduce_scatter_single" if buf.is_even else "reduce_scatter(list)"
                cases.append((split, form, "reduce_scatter", lambda b=buf, g=full_grad: b.reduce_scatter(g)))
        if split != "even":
            rs = lambda b=buf, g=full_grad: b.reduce_scatter(g)  # noqa: E731
            cases.append((split, "reduce_scatter(list)", "reduce_scatter", rs))
    times = {i: [] for i in range(len(cases))}
    flag = torch.zeros(1)
    for it in range(warmup + reps):
        shift = it % len(cases)
        for i in list(range(shift, len(cases))) + list(range(shift)):
            dist.barrier()
            t0 = time.perf_counter()
            cases[i][3]()
            flag[0] = time.perf_counter() - t0
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if it >= warmup:
                times[i].append(flag.item())
    rows = []
    for i, (split, form, direction, _) in enumerate(cases):
        rows.append(
            {
                "world_size": w,
                "split": split,
                "sizes": _splits(numel, w)[split],
                "direction": direction,
                "form": form,
                "median_s": statistics.median(times[i]),
                "min_s": min(times[i]),
                "reps": reps,
            }
        )
    ref = {r["direction"]: r["median_s"] for r in rows if r["form"] in ("all_gather_single", "reduce_scatter_single")}
    for r in rows:
        r["ratio_to_even"] = r["median_s"] / ref[r["direction"]]
    return rows if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=8 * 2**20)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/ for the full run, "
                    "runs/bench-quick/ when any flag is changed)")
    args = ap.parse_args(argv)
    out = out_dir(ap, args) / "collectives.json"
    all_rows = []
    for w in args.world_sizes:
        rows = run_distributed(lambda w=w: _bench(args.numel, args.reps, args.warmup), world_size=w, timeout=1800)[0]
        all_rows += rows
    print(f"gloo, {args.numel} float32 elements ({args.numel * 4 / 2**20:.0f} MiB), median of {args.reps} reps")
    print(f"{'W':>2} {'split':>7} {'direction':>15} {'form':>22} {'median ms':>10} {'x even':>7}  sizes (M elements)")
    for r in all_rows:
        sizes = ",".join(f"{s / 2**20:.2f}" for s in r["sizes"])
        print(
            f"{r['world_size']:>2} {r['split']:>7} {r['direction']:>15} {r['form']:>22} "
            f"{r['median_s'] * 1e3:>10.1f} {r['ratio_to_even']:>7.2f}  [{sizes}]"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "backend": "gloo",
        "numel": args.numel,
        "dtype": "float32",
        "reps": args.reps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_avg_1m_at_end": os.getloadavg()[0],
        "command": "python benchmarks/collectives.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out.write_text(json.dumps({"meta": meta, "rows": all_rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
