"""Collect benchmarks/results/*.json into one markdown file of tables for the README.

Each benchmark was written by a different script with its own JSON layout; one renderer per file
reads that layout. A missing file is listed as "not run"; a file a renderer cannot read (its
layout changed) is listed with the error instead of stopping the report. Every table says the
command that made it (from the JSON, or rebuilt from its recorded config and the script's flags).

    python benchmarks/report.py                      # -> benchmarks/results/README_tables.md
    python benchmarks/report.py --results DIR --out FILE
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHOW_W = (8, 64, 1024, 16384)
"""World sizes shown in the compact planner table (the JSON has more)."""


# ---- helpers ---------------------------------------------------------------------------------
def _command_from_config(script: str, config: dict) -> str:
    """``python benchmarks/<script> --flag value ...`` for the config keys the script accepts."""
    path = HERE / script
    flags = set(re.findall(r'add_argument\(\s*"--([a-z0-9-]+)"', path.read_text())) if path.exists() else set()
    parts = [f"python benchmarks/{script}"]
    for key, value in config.items():
        flag = key.replace("_", "-")
        if flag in flags and flag != "out" and not isinstance(value, (dict, list)):
            parts.append(f"--{flag} {value}")
    return " ".join(parts)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


# ---- one renderer per results file ----------------------------------------------------------
def render_planner_scale(d: dict) -> list[str]:
    out = [f"Command: `{d.get('command', 'python benchmarks/planner_scale.py')}`", ""]
    lw = d.get("largest_balanced_w", {})
    models = list(dict.fromkeys(r["model"] for r in d["rows"]))
    out += ["Largest power-of-two W at which whole blocks balance within 10% (ragged layout, per-rank bytes max/mean <= 1.10):", ""]
    out += _table(["preset", "Muon matrices", "Shampoo blocks"], [[m, lw.get(f"{m}/muon"), lw.get(f"{m}/shampoo")] for m in models])
    rows = [r for r in d["rows"] if r["layout"] == "auto"]
    ws = [w for w in SHOW_W if any(r["world_size"] == w for r in rows)]
    out += ["", "Auto layout (the planner picks even or ragged per bucket): per-rank bytes max/mean, padding %, "
            "split matrix bytes % at each W; worst plan time over all W and layouts in the JSON.", ""]
    table = []
    for m in models:
        for opt in dict.fromkeys(r["optimizer"] for r in rows if r["model"] == m):
            cells = []
            for w in ws:
                r = next((r for r in rows if r["model"] == m and r["optimizer"] == opt and r["world_size"] == w), None)
                cells.append("-" if r is None else f"{r['bytes_max_over_mean']:.3f} / {100 * r['padding_ratio']:.2f}% / "
                             f"{100 * r['split_bytes_ratio']:.1f}%")
            secs = max(r["plan_seconds"] for r in d["rows"] if r["model"] == m and r["optimizer"] == opt)
            table.append([m, opt, *cells, f"{secs:.2f}"])
    out += _table(["preset", "optimizer", *[f"W={w}: bytes max/mean / pad / split" for w in ws], "max plan s"], table)
    out += ["", "Full grid (every W and layout, with the whole-block lower bound): `benchmarks/results/planner_scale.md`."]
    return out


def render_collectives(d: dict) -> list[str]:
    meta = d.get("meta", {})
    out = [f"Command: `{meta.get('command', 'python benchmarks/collectives.py')}` ({meta.get('backend', 'gloo')}, "
           f"{meta.get('numel', '?')} {meta.get('dtype', '')} elements, median of {meta.get('reps', '?')} reps, "
           f"{meta.get('cpus', '?')} CPUs, load avg {float(meta.get('load_avg_1m_at_end', float('nan'))):.1f} at the end)", ""]
    rows = [[r["world_size"], r["split"], r["direction"], r["form"], _ms(r["median_s"]), f"{r['ratio_to_even']:.2f}"]
            for r in d["rows"]]
    return out + _table(["W", "split", "direction", "form", "median ms", "x even form"], rows)


def render_bench_muon(d: dict) -> list[str]:
    cfg = d.get("config", {})
    out = [f"Command: `{d.get('command') or _command_from_config('bench_muon.py', cfg)}` "
           f"(W={cfg.get('world_size')}, {cfg.get('layers')} x Linear({cfg.get('dim')}, {cfg.get('dim')}), gloo, CPU)", ""]
    rows = [[k, _ms(r["step_s_median"]), f"{r['time_ratio_vs_fsdp2']:.3f}", r["collectives_per_step"],
             f"{r['max_abs_dist_after_4_steps_rel']:.2e}"] for k, r in d["muon"].items()]
    out += _table(["Muon optimizer step", "median ms", "x FSDP2 + torch.optim.Muon", "collectives / step",
                   "max dist to unsharded torch.optim.Muon after 4 steps (rel)"], rows)
    s = d.get("shampoo_vs_adamw")
    if s:
        out += [""]
        rows = [[k, _ms(r["step_s_median"]), _ms(r["step_s_mean_over_periods"]), r["collectives_per_step"]] for k, r in s.items()]
        out += _table(["step", "median ms", "mean ms over precondition periods", "collectives / step"], rows)
        sh = s.get("shampoo", {})
        out += ["", f"Shampoo / AdamW per step: median {sh.get('ratio_vs_adamw_median', float('nan')):.2f}x, "
                f"mean over periods {sh.get('ratio_vs_adamw_mean_over_periods', float('nan')):.2f}x."]
    return out


def render_bench_adamw8bit(d: dict) -> list[str]:
    cfg = d.get("config", {})
    out = [f"Command: `{d.get('command') or _command_from_config('bench_adamw8bit.py', cfg)}`", ""]
    t = d["step_time_s_median_slowest_rank"]
    by = d["state_bytes_per_rank"]
    ll = d.get("like_for_like", {})
    lt = ll.get("step_time_s_median_slowest_rank", {})
    dist = d.get("max_dist_after_5_steps_where_torchao_quantizes_unsharded", {})
    rows = []
    for side in ("fsdp2+torchao", "ours"):
        rows.append([side, _ms(t[side]), _ms(lt[side]) if side in lt else "-",
                     " / ".join(_mib(b) for b in by[side]), f"{dist.get(side, float('nan')):.2e}"])
    out += _table(["side", "step ms (whole model)", f"step ms (like for like, {len(ll.get('tensors', []))} tensors)",
                   "state MiB per rank", "max dist to unsharded torchao after 5 steps (rel)"], rows)
    left = d.get("torchao_fp32_under_fsdp2_but_8bit_unsharded", [])
    tensors = d.get("tensors", {})
    ours_fp32 = [n for n, x in tensors.items() if x.get("torchao_unsharded_8bit") and not x.get("ours_8bit")]
    out += ["", f"Unsharded torchao state: {_mib(d.get('state_bytes_unsharded_torchao', 0))} MiB. Tensors torchao "
            f"quantizes unsharded but leaves fp32 under FSDP2: {', '.join(left) or 'none'}; that we leave fp32: "
            f"{', '.join(ours_fp32) or 'none'}."]
    return out


def render_bench_fsdp_adamw(d: dict) -> list[str]:
    cfg = d.get("config", {})
    out = [f"Command: `{d.get('command') or _command_from_config('bench_fsdp_adamw.py', cfg)}` "
           f"({d.get('num_params', '?'):,} parameters; max over ranks; {d.get('memory_measure', '')})", ""]
    s = d["summary_max_over_ranks"]
    ratio = d.get("ratio_ours_over_fsdp2", {})
    keys = ("fwd_bwd_s", "optim_s", "step_s", "persistent_bytes", "peak_bytes")
    rows = []
    for side in ("fsdp_optim", "fsdp2"):
        r = s[side]
        rows.append([side, *(_ms(r[k]) if k.endswith("_s") else _mib(r[k]) for k in keys)])
    rows.append(["ours / FSDP2", *(f"{ratio[k]:.3f}" if k in ratio else "-" for k in keys)])
    return out + _table(["runtime + torch.optim.AdamW", "fwd+bwd ms", "optimizer ms", "step ms", "persistent MiB", "peak MiB"], rows)


def render_comm_model(d: dict) -> list[str]:
    sys.path.insert(0, str(HERE))
    from comm_model import to_markdown

    md = to_markdown(d).splitlines()  # title, blank, "Made by", blank, assumptions, blank, table
    return [f"Command: `{d['command']}`", "", *md[4:], "", "Plot: `benchmarks/results/comm_model.png` (written by the run; not tracked)."]


def render_gpu_check(d: dict) -> list[str]:
    env = d.get("env", {})
    out = [f"Command: `{d.get('command', 'bash benchmarks/gpu_check.sh')}` on {env.get('device')} "
           f"(torch {env.get('torch')}, CUDA {env.get('cuda')})"]
    if env.get("smoke_run"):
        out += ["", "**CPU smoke run with tiny sizes, not a GPU measurement.**"]
    out += [""]
    rows = [[f"{r['shape'][0]}x{r['shape'][1]}", f"{r['ours']['tflops']:.1f}", f"{r['torch.optim.Muon']['tflops']:.1f}",
             f"{r['ours_over_torch_time']:.2f}", f"{r['max_abs_diff']:.2g}"] for r in d["newton_schulz"]]
    header = ["Newton-Schulz (5 steps, bf16)", "ours TFLOP/s", "torch.optim.Muon TFLOP/s", "time ours / torch", "max abs diff"]
    out += _table(header, rows)
    a = d.get("adamw8bit")
    if not a:
        return out + ["", "8-bit AdamW part: not finished (the run stopped after Newton-Schulz)."]
    out += [""] + _table(
        ["8-bit AdamW step", "ours GB/s", "torchao GB/s", "time ours / torchao", "max abs diff"],
        [[f"{a['numel']:,} elements (16 B/element counted)", f"{a['ours']['gb_per_s']:.1f}",
          f"{a['torchao']['gb_per_s']:.1f}", f"{a['ours_over_torchao_time']:.2f}", f"{a['max_abs_diff_after_steps']:.2g}"]])
    return out


# ---- the targets of issue 7, checked against whatever results exist ---------------------------
def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except ValueError:
        return None


def _mark(ok: bool | str | None) -> str:
    return ok if isinstance(ok, str) else {True: "met", False: "**not met**", None: "not run"}[ok]


def targets(results: Path) -> list[str]:
    """One row per target: status and the figure behind it (read from the JSON, never typed in)."""
    rows = []

    def add(target: str, fn: Callable[[], tuple[bool | str | None, str]]) -> None:
        try:
            ok, figure = fn()
        except (KeyError, TypeError, ValueError, StopIteration) as e:
            ok, figure = None, f"results present but unreadable ({type(e).__name__}: {e})"
        rows.append([target, _mark(ok), figure])

    def muon():
        d = _load(results, "bench_muon")
        if d is None:
            return None, "bench_muon.json missing"
        m = d["muon"]
        base = m["fsdp2+torch.Muon"]
        ours = m["ours ragged"]
        ratio = ours["step_s_median"] / base["step_s_median"]
        ok = ratio <= 0.5 and ours["collectives_per_step"] == 0
        return ok, (f"ours (ragged) {ratio:.2f}x FSDP2 + torch.optim.Muon's step, {ours['collectives_per_step']} "
                    f"collectives vs {base['collectives_per_step']} (W={d['config'].get('world_size')})")

    def adamw():
        d = _load(results, "bench_fsdp_adamw")
        if d is None:
            return None, "bench_fsdp_adamw.json missing"
        r = d["ratio_ours_over_fsdp2"]
        return r["step_s"] <= 1.0, (f"step (fwd+bwd+opt) {r['step_s']:.2f}x FSDP2's; fwd+bwd {r['fwd_bwd_s']:.2f}x, "
                                    f"optimizer {r['optim_s']:.2f}x; peak memory {r.get('peak_bytes', float('nan')):.2f}x")

    def adamw8bit():
        d = _load(results, "bench_adamw8bit")
        if d is None:
            return None, "bench_adamw8bit.json missing"
        by = d["state_bytes_per_rank"]
        ours, theirs = max(by["ours"]), max(by["fsdp2+torchao"])
        ours_fp32 = [n for n, t in d["tensors"].items() if t["torchao_unsharded_8bit"] and not t["ours_8bit"]]
        ok = ours <= theirs and not ours_fp32
        return ok, (f"largest rank's state {ours / theirs:.3f}x torchao's on FSDP2; left fp32 by us where torchao "
                    f"quantizes unsharded: {', '.join(ours_fp32) or 'none'} (torchao under FSDP2: "
                    f"{', '.join(d.get('torchao_fp32_under_fsdp2_but_8bit_unsharded', [])) or 'none'})")

    def planner():
        d = _load(results, "planner_scale")
        if d is None:
            return None, "planner_scale.json missing"
        fails = []
        for r in d["rows"]:
            tag = f"{r['model']}/{r['optimizer']}/W={r['world_size']}/{r['layout']}"
            if r["plan_seconds"] > 1.0:
                fails.append(f"{tag} took {r['plan_seconds']:.2f} s")
            if r["layout"] != "auto":
                continue
            if r["optimizer"] in ("adamw", "adamw8bit") and r["world_size"] in (8, 64, 1024, 16384):
                if r["padding_ratio"] > 0.02 or r["bytes_max_over_mean"] > 1.02:
                    fails.append(tag)
            if r["optimizer"] in ("muon", "shampoo") and r["world_size"] in (8, 64):
                if r["padding_ratio"] > 0.02 or r["num_split_blocks"] or r["bytes_max_over_mean"] > 1.10:
                    fails.append(tag)
        worst = max(r["plan_seconds"] for r in d["rows"])
        return not fails, (f"{len(d['rows'])} plans, slowest {worst:.2f} s; "
                           + ("every padding / split / balance threshold of issue 2 holds" if not fails
                              else "fails: " + "; ".join(fails[:8])))

    def balanced():
        d = _load(results, "planner_scale")
        if d is None:
            return None, "planner_scale.json missing"
        lw = d["largest_balanced_w"]
        models = list(dict.fromkeys(k.split("/")[0] for k in lw))
        figures = "; ".join(f"{m} {lw.get(f'{m}/muon')} / {lw.get(f'{m}/shampoo')}" for m in models)
        return "reported", figures + " (Muon / Shampoo)"

    add("Muon optimizer step at W=2 <= 0.5x FSDP2 + torch.optim.Muon, zero optimizer collectives", muon)
    add("AdamW training step (fwd+bwd+opt) no slower than FSDP2 + torch.optim.AdamW", adamw)
    add("AdamW8bit state bytes <= torchao's on FSDP2, nothing fp32 that torchao quantizes unsharded", adamw8bit)
    add("Planner figures of issue 2 (plan <= 1 s; padding, splits, balance per optimizer and W)", planner)
    add("Largest W at which whole Muon matrices / Shampoo blocks balance within 10%", balanced)
    return _table(["target (issue 7)", "status", "figure from the results"], rows)


SECTIONS: list[tuple[str, str, str, Callable[[dict], list[str]]]] = [
    ("planner_scale", "Planner at scale (simulated)", "python benchmarks/planner_scale.py", render_planner_scale),
    ("collectives", "Even vs uneven bucket collectives (gloo)", "python benchmarks/collectives.py", render_collectives),
    ("bench_muon", "Muon (and Shampoo vs AdamW) optimizer step: ours vs FSDP2 + torch.optim.Muon",
     "python benchmarks/bench_muon.py", render_bench_muon),
    ("bench_adamw8bit", "8-bit AdamW: ours vs FSDP2 + torchao.optim.AdamW8bit", "python benchmarks/bench_adamw8bit.py",
     render_bench_adamw8bit),
    ("bench_fsdp_adamw", "Training step with AdamW: our fully_shard vs FSDP2", "python benchmarks/bench_fsdp_adamw.py",
     render_bench_fsdp_adamw),
    ("comm_model", "Communication model (alpha-beta), Muon, per training step per rank", "python benchmarks/comm_model.py",
     render_comm_model),
    ("gpu_check", "Single-GPU optimizer throughput", "bash benchmarks/gpu_check.sh", render_gpu_check),
]


def build(results: Path) -> str:
    where = results.relative_to(HERE.parent) if results.is_relative_to(HERE.parent) else results
    out = ["# Benchmark tables", "",
           f"Generated by `python benchmarks/report.py` from `{where}/*.json`; "
           "each table names the command that made it. How to rerun and what each measures: `benchmarks/README.md`.", "",
           "## Targets", "", *targets(results), ""]
    for name, title, command, render in SECTIONS:
        out += [f"## {title}", ""]
        path = results / f"{name}.json"
        if not path.exists():
            out += [f"Not run (no `{name}.json`). Run: `{command}`", ""]
            continue
        try:
            out += render(json.loads(path.read_text())) + [""]
        except Exception as e:  # a results layout this renderer does not know: say so, keep going
            out += [f"`{name}.json` is present but could not be read ({type(e).__name__}: {e}). Rerun: `{command}`", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=HERE / "results")
    ap.add_argument("--out", type=Path, default=None, help="default: <results>/README_tables.md")
    args = ap.parse_args(argv)
    out = args.out or args.results / "README_tables.md"
    out.write_text(build(args.results.resolve()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
