"""Planner at scale, simulated: every preset x optimizer x world size x layout.

The default plan table (issue 27; Muon and Shampoo with ``balance="auto"``, ``optimizer_balance``): per preset and W in {64, 256, 1024, 4096, 16384}, the busiest rank's bytes
over the mean, the whole-block lower bound, split blocks, plan seconds, and for a Shampoo cell above
the cap the HSDP shard size the plan names and that shard group's figure.

Writes benchmarks/results/planner_scale.{json,md,png} (a --quick run: runs/bench-quick/; --out DIR): padding %, split matrix bytes %,
per-rank bytes and optimizer cost max/mean, the whole-block lower bound (``whole_block_bound``, a
proven bound on any plan keeping blocks whole, over the mean per-rank bytes), plan seconds; and per preset the largest power-of-two W at which Muon
matrices / Shampoo blocks (ragged, whole blocks) still balance within 10%.

    python benchmarks/planner_scale.py            # full grid (a few minutes on 2 cores)
    python benchmarks/planner_scale.py --quick    # W in {8, 1024}, for a smoke run -> runs/bench-quick/
    python benchmarks/planner_scale.py --table    # the default plan table only (writes planner_scale_default.*)
    python benchmarks/planner_scale.py --alignment  # padding of 64 B aligned pieces (planner_alignment.md)
    python benchmarks/planner_scale.py --shard-size 64   # HSDP: plan over 64 ranks, replicate W/64
                                                         # (writes planner_scale_hsdp64.*)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _out import out_dir  # noqa: E402

from fsdp_optim._cli import optimizer_balance, optimizer_rule
from fsdp_optim.sharding import PlanConfig
from fsdp_optim.sharding.plan import plan_model
from fsdp_optim.sharding.plan import preset_buckets, preset_names

OPTIMIZERS = ("adamw", "adamw8bit", "muon", "shampoo")
LAYOUTS = ("even", "ragged", "auto")
WORLD_SIZES = (8, 64, 256, 1024, 4096, 16384)
SWEEP = tuple(2**k for k in range(3, 15))  # 8 .. 16384 for the "largest balanced W" summary
RESULTS = Path(__file__).resolve().parent / "results"


TABLE_WORLD_SIZES = (64, 256, 1024, 4096, 16384)


def _timed_plan(buckets, w: int, config: PlanConfig):
    """The plan, its wall time best of up to 3 when over 0.5 s (shared machine); warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # balance="whole" above the cap: the figures say it
        plan = plan_model(buckets, world_size=w, config=config)
        secs = plan.seconds
        for _ in range(2):
            if secs <= 0.5:
                break
            secs = min(secs, plan_model(buckets, world_size=w, config=config).seconds)
    return plan, secs


def default_table(world_sizes=TABLE_WORLD_SIZES, models=None) -> list[dict]:
    """Every preset x Muon / Shampoo x W with the default PlanConfig (see the module docstring)."""
    rows = []
    for model in models or preset_names():
        for opt in ("muon", "shampoo"):
            buckets = preset_buckets(model, rule=optimizer_rule(opt))
            for w in world_sizes:
                config = PlanConfig(balance=optimizer_balance(opt))
                plan, secs = _timed_plan(buckets, w, config)
                st = plan.stats()
                row = {"model": model, "optimizer": opt, "world_size": w, "balance": config.balance,
                       **st.as_dict(), "plan_seconds": secs, "balance_note": plan.balance_note,
                       "hsdp_shard_size": plan.balance_shard_size, "hsdp_balance_ratio": None}  # fmt: skip
                if plan.balance_shard_size:
                    row["hsdp_balance_ratio"] = _timed_plan(buckets, plan.balance_shard_size, config)[0].stats().balance_ratio
                rows.append(row)
                print(f"default {model:16s} {opt:8s} W={w:<6d} {st.balance_ratio:8.3f} (lb {st.bytes_lower_bound:7.3f}) "
                      f"split={st.num_split_blocks:6d} t={secs:.3f}s hsdp={plan.balance_shard_size} "
                      f"{row['hsdp_balance_ratio'] or ''}", flush=True)  # fmt: skip
    return rows


def alignment_md(world_sizes=(64, 1024, 16384), models=None) -> str:
    """[Note: aligned pieces]: padding of the default plans (64 B aligned pieces) vs ``piece_align_bytes=1``."""
    out = [
        "# Aligned pieces: padding they cost (default plans, fp32)",
        "",
        "Made by: `python benchmarks/planner_scale.py --alignment`. Every tensor's local piece starts on a 64 B "
        "boundary of its segment (`PlanConfig.piece_align_bytes=64`, the default) vs unaligned (`=1`). Padding % of "
        "parameters; extra = the aligned plan's padding minus the unaligned one's, per rank on average.",
        "",
        "| preset | optimizer | W | padding % aligned | padding % unaligned | extra bytes per rank |",
        "|---|---|---|---|---|---|",
    ]
    for model in models or preset_names():
        for opt in ("muon", "shampoo"):
            buckets = preset_buckets(model, rule=optimizer_rule(opt))
            for w in world_sizes:
                a, u = (_timed_plan(buckets, w, PlanConfig(balance=optimizer_balance(opt), piece_align_bytes=k))[0].stats()
                        for k in (64, 1))  # fmt: skip
                extra = (a.padding_ratio - u.padding_ratio) * a.param_numel * 4 / w
                out.append(f"| {model} | {opt} | {w} | {100 * a.padding_ratio:.5f} | {100 * u.padding_ratio:.5f} | "
                           f"{extra:,.0f} B |")  # fmt: skip
    return "\n".join(out) + "\n"


def _table_md(rows: list[dict]) -> list[str]:
    ws = sorted({r["world_size"] for r in rows})
    out = [
        "## Default plan (issue 27): busiest rank's bytes over the mean",
        "",
        "`PlanConfig()` defaults, Muon and Shampoo with `balance='auto'` (matrix blocks / strips split on rows where "
        "whole ones miss the 1.10 cap). Cell: `balance_ratio` (busiest rank's "
        "bytes, padding included, over the mean parameter bytes) / whole-block lower bound / split matrix blocks / "
        "plan seconds (split blocks: Muon matrices, Shampoo strips). A cell above the cap with whole blocks: "
        "`-> N: x` = the HSDP shard size N the plan names and the ratio of the plan over N ranks (replicated W / N "
        "times).",
        "",
        "| preset / rule | " + " | ".join(f"W = {w}" for w in ws) + " |",
        "|---|" + "---|" * len(ws),
    ]
    keyed = {(r["model"], r["optimizer"], r["world_size"]): r for r in rows}
    for model in dict.fromkeys(r["model"] for r in rows):
        for opt in ("muon", "shampoo"):
            cells = []
            for w in ws:
                r = keyed.get((model, opt, w))
                if r is None:
                    cells.append("-")
                    continue
                c = (f"**{r['balance_ratio']:.3f}** / {r['bytes_lower_bound']:.3f} / {r['num_split_blocks']} / "
                     f"{r['plan_seconds']:.2f}")  # fmt: skip
                if r["hsdp_shard_size"]:
                    c += f" -> {r['hsdp_shard_size']}: {r['hsdp_balance_ratio']:.3f}"
                cells.append(c)
            out.append(f"| {model} / {opt} | " + " | ".join(cells) + " |")
    over = [r for r in rows if r["balance_ratio"] > 1.10]
    miss = [r for r in rows if r["num_split_blocks"] == 0 and r["balance_ratio"] <= 1.10
            and r["balance_ratio"] > max(1.02 * r["bytes_lower_bound"], 1.05)]  # fmt: skip
    slow = [r for r in rows if r["plan_seconds"] >= 1.0]
    out += [
        "",
        f"Cells above 1.10: {len(over)} of {len(rows)}"
        + (" (" + ", ".join(f"{r['model']}/{r['optimizer']} W={r['world_size']}"
                            + (f" -> HSDP {r['hsdp_shard_size']}: {r['hsdp_balance_ratio']:.3f}" if r["hsdp_shard_size"] else "")
                            for r in over) + ")" if over else "")  # fmt: skip
        + f". Whole-block cells above max(1.02 x bound, 1.05): {len(miss)}"
        + (" (" + ", ".join(f"{r['model']}/{r['optimizer']} W={r['world_size']}: {r['balance_ratio']:.3f}" for r in miss) + ")" if miss else "")
        + f". Plans of 1 s or more: {len(slow)}.",
    ]
    return out


def run(world_sizes, sweep, shard_size: int | None = None) -> dict:
    """Plan every preset x optimizer x W x layout. With ``shard_size`` (HSDP) each W is planned over
    ``min(W, shard_size)`` ranks and replicated over the rest: the per-rank layout of a replica is
    the plan over the shard group (replication changes no rank's bytes)."""
    rows = []
    for model in preset_names():
        for opt in OPTIMIZERS:
            buckets = preset_buckets(model, rule=optimizer_rule(opt))
            for w in world_sizes:
                pw = w if shard_size is None else min(w, shard_size)
                for layout in LAYOUTS:
                    plan, secs = _timed_plan(buckets, pw, PlanConfig(layout=layout, balance=optimizer_balance(opt)))
                    st = plan.stats()._replace(plan_seconds=secs, world_size=w)
                    rows.append(
                        {"model": model, "optimizer": opt, "layout": layout, **st.as_dict(),
                         "shard_size": pw, "num_replicas": w // pw}
                    )  # fmt: skip
                    print(
                        f"{model:16s} {opt:9s} W={w:<6d} {layout:6s} pad={100 * st.padding_ratio:7.3f}% "
                        f"split={100 * st.split_bytes_ratio:6.2f}% bytes={st.bytes_max_over_mean:8.3f} "
                        f"(lb {st.bytes_lower_bound:8.3f}) cost={st.cost_max_over_mean:8.3f} t={st.plan_seconds:.3f}s",
                        flush=True,
                    )
    largest = {}
    for model in [] if shard_size is not None else preset_names():
        for opt in ("muon", "shampoo"):
            buckets = preset_buckets(model, rule=optimizer_rule(opt))
            best = None
            for w in sweep:
                st = _timed_plan(buckets, w, PlanConfig(layout="ragged", balance="whole"))[0].stats()
                if st.bytes_max_over_mean <= 1.10:
                    best = w
                else:
                    break
            largest[f"{model}/{opt}"] = best
    table = default_table() if shard_size is None and world_sizes == WORLD_SIZES else []
    return {"rows": rows, "largest_balanced_w": largest, "default_table": table}


def _md(data: dict, command: str) -> str:
    rows = data["rows"]
    out = [
        "# Planner at scale (simulated)",
        "",
        f"Made by: `{command}` ({platform.python_version()}, {platform.machine()})",
        "",
        "Per-rank bytes include padding; `lb` = the whole-block lower bound (`whole_block_bound`: counting "
        "and bin-packing bounds, proven) / mean per-rank bytes (floored at 1): no whole-block plan does better. `split %` = bytes of matrix blocks "
        "cut across ranks / bytes of all matrix blocks. fp32 (4-byte) parameters, one bucket per layer. "
        "`plan s`: wall time of `plan_model` (best of up to 3 when over 0.5 s: the machine is shared). "
        "Shampoo plans with `shampoo_rule(1024, per_expert=True)` (one block per routed expert). "
        "Balance: Muon and Shampoo `balance='auto'` (the default: blocks split where whole ones miss the 1.10 "
        "cap); the largest-W summary keeps blocks whole (`balance='whole'`).",
    ]
    if data.get("shard_size"):
        out += ["", f"HSDP: every W is planned over a shard group of min(W, {data['shard_size']}) ranks and replicated "
                "across W / shard size groups (the `S x R` column); a replica's per-rank layout is the shard group's."]
    if data.get("default_table"):
        out += ["", *_table_md(data["default_table"])]
    if data["largest_balanced_w"]:
        out += [
            "",
            "## Largest power-of-two W up to which whole blocks balance within 10% (ragged layout)",
            "",
            "| preset | Muon matrices | Shampoo blocks |",
            "|---|---|---|",
        ]
        for model in preset_names():
            lw = data["largest_balanced_w"]
            out.append(f"| {model} | {lw.get(f'{model}/muon')} | {lw.get(f'{model}/shampoo')} |")
    out += [
        "",
        "## All runs",
        "",
        "| preset | optimizer | W | S x R | layout | padding % | split % | bytes max/mean | lb | cost max/mean | even/ragged buckets | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sxr = f"{r.get('shard_size', r['world_size'])} x {r.get('num_replicas', 1)}"
        out.append(
            f"| {r['model']} | {r['optimizer']} | {r['world_size']} | {sxr} | {r['layout']} | {100 * r['padding_ratio']:.3f} | "
            f"{100 * r['split_bytes_ratio']:.2f} | {r['bytes_max_over_mean']:.3f} | {r['bytes_lower_bound']:.3f} | "
            f"{r['cost_max_over_mean']:.3f} | {r['num_even_buckets']}/{r['num_ragged_buckets']} | {r['plan_seconds']:.3f} |"
        )
    return "\n".join(out) + "\n"


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, opt in zip(axes, ("muon", "shampoo")):
        for model in preset_names():
            rs = [r for r in data["rows"] if r["model"] == model and r["optimizer"] == opt and r["layout"] == "ragged"]
            ws = [r["world_size"] for r in rs]
            (line,) = ax.plot(ws, [r["bytes_max_over_mean"] for r in rs], marker="o", label=model)
            ax.plot(ws, [r["bytes_lower_bound"] for r in rs], ls="--", color=line.get_color(), alpha=0.6)
        ax.axhline(1.10, color="gray", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="world size W", title=f"{opt}: ragged, whole blocks")
    axes[0].set_ylabel("per-rank bytes max/mean (solid) vs lower bound (dashed)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="W in {8, 1024} only")
    ap.add_argument("--table", action="store_true", help="the default plan table only (planner_scale_default.*)")
    ap.add_argument("--alignment", action="store_true", help="padding of 64 B aligned pieces (planner_alignment.md)")
    ap.add_argument("--shard-size", type=int, default=None, help="HSDP: plan over this many ranks, replicate the rest")
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/; --quick: runs/bench-quick/)")
    args = ap.parse_args(argv)
    results = out_dir(ap, args, keep=("shard_size", "table", "alignment"))
    world_sizes = (8, 1024) if args.quick else WORLD_SIZES
    if args.shard_size is not None and any(w % min(w, args.shard_size) for w in world_sizes):
        ap.error(f"--shard-size {args.shard_size} must divide every world size {world_sizes} it is smaller than")
    command = "python benchmarks/planner_scale.py" + (" --quick" if args.quick else "")
    command += f" --shard-size {args.shard_size}" if args.shard_size else ""
    name = "planner_scale" + (f"_hsdp{args.shard_size}" if args.shard_size else "")
    t0 = time.perf_counter()
    if args.alignment:
        results.mkdir(parents=True, exist_ok=True)
        (results / "planner_alignment.md").write_text(alignment_md())
        print(f"wrote {results}/planner_alignment.md in {time.perf_counter() - t0:.0f} s")
        return 0
    if args.table:
        rows = default_table()
        md = "# Planner at scale: the default plan (simulated)\n\n" + f"Made by: `python benchmarks/planner_scale.py --table`\n\n"
        results.mkdir(parents=True, exist_ok=True)
        (results / "planner_scale_default.json").write_text(json.dumps({"rows": rows}, indent=1))
        (results / "planner_scale_default.md").write_text(md + "\n".join(_table_md(rows)) + "\n")
        print(f"wrote {results}/planner_scale_default.{{json,md}} in {time.perf_counter() - t0:.0f} s")
        return 0
    data = run(world_sizes, (8, 64, 1024) if args.quick else SWEEP, args.shard_size)
    data["command"] = command
    data["shard_size"] = args.shard_size
    data["seconds"] = time.perf_counter() - t0
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(data, indent=1))
    (results / f"{name}.md").write_text(_md(data, command))
    _plot(data, results / f"{name}.png")
    print(f"wrote {results}/{name}.{{json,md,png}} in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
