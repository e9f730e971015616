"""Muon's optimizer step under FSDP x tensor parallelism, modelled (issue #35 item 2): per step, the
optimizer's bytes sent per rank, collectives, Newton-Schulz FLOPs summed over the ranks over one process's
torch.optim.Muon step, and alpha-beta time, for ours, Megatron-LM's TensorParallelMuon (duplicated) and
LayerShardedMuon, and FSDP2 + torch.optim.Muon on DTensor parameters. The model and every assumption:
``benchmarks/_comm_tp.py``'s docstring.

    python benchmarks/comm_model_tp.py      # the default configurations -> results/comm_model_tp.{json,md} (~1 s)
    python benchmarks/comm_model_tp.py --configs llama3.1-70b:64x8 --no-write

Default configurations: the measured size, W = 4, on the recipes' ``tiny`` (dp 2 x tp 2; its 6 heads and
2 KV heads do not split over 4) and Llama 3.2 1B dims (``recipes/configs/llama3-1b.toml``, dp 2 x tp 2 and
1 x 4), and Llama 3.1 405B (``tests/data/model_shapes.json``) at W = 16384 = dp 2048 x tp 8, and at W = 1024 =
dp 128 x tp 8 beside it (each TP group then holds ~7 matrices instead of <= 3: where NS redundancy costs time).
tp = 16 is not modelled by default: Llama 3.1 405B's 8 KV heads do not split over 16 TP ranks (and a
16-rank TP group leaves the 8-GPU node).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _comm_tp as tp  # noqa: E402
import comm_model as cm  # noqa: E402
from _out import out_dir  # noqa: E402

DEFAULT_CONFIGS = ("tiny:2x2", "llama3-1b:2x2", "llama3-1b:1x4", "llama3.1-405b:2048x8", "llama3.1-405b:128x8")


def parse_config(text: str) -> tuple[str, int, int]:
    """``model:DPxTP`` -> (model, dp, tp)."""
    try:
        name, mesh = text.split(":")
        dp, t = (int(x) for x in mesh.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODEL:DPxTP, e.g. llama3-1b:2x2") from None
    if name not in tp.MODELS:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown model; choose from {', '.join(tp.MODELS)}")
    return name, dp, t


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f}" if x >= 1e-3 else f"{x * 1e3:.3f}"


def to_markdown(data: dict) -> str:
    a, li = data["assumptions"], data["tp_links"]
    out = [
        "# Muon's optimizer step under FSDP x tensor parallelism (modelled, issue #35 item 2)",
        "",
        f"Made by: `{data['command']}`",
        "",
        f"Per optimizer step, Muon matrices only (wq wk wv wo w1 w2 w3 per layer; embeddings, head, norms are AdamW's "
        f"and exchange nothing in any scheme). Exchanges in {8 * li['exchange_bytes']}-bit for every scheme. Links: "
        f"a group inside one {li['gpus_per_node']}-GPU node {li['nvlink_gbps']:g} Gb/s, alpha {li['nvlink_alpha_us']:g} us "
        f"(NVLink); across nodes {a['bandwidth_gbps']:g} Gb/s, alpha {a['alpha_us']:g} us (comm_model.py's); {a['latency']} "
        f"latency. NS: {li['ns_steps']} iterations, the busiest rank's FLOPs at {li['ns_tflops']:g} TFLOP/s (assumed). "
        "GB = 1e9 bytes the busiest rank sends per step; collectives = those the busiest rank joins; "
        "NS ratio = NS FLOPs summed over all ranks / one process's torch.optim.Muon step; total = comm + NS "
        "(no overlap). Schemes and assumptions: `benchmarks/_comm_tp.py`.",
    ]
    for r in data["rows"]:
        out += [
            "",
            f"## {r['model']}, dp {r['dp']} x tp {r['tp']} (W = {r['world_size']})",
            "",
            f"{r['num_matrices']} Muon matrices, {r['matrix_bytes'] / 1e9:.3f} GB at the exchange dtype; single-process "
            f"NS {r['single_ns_flops'] / 1e12:,.2f} TFLOP; TP groups on {r['tp_link']}, dp groups {r['dp_link']}. "
            f"Shapes: `{r['source']}`.",
            "",
            "| scheme | GB/rank/step (sent, max rank) | collectives/step | NS FLOPs sum / single | busiest rank NS TFLOP "
            "| comm ms | NS ms | total ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k in tp.SCHEMES:
            s = r["schemes"][k]
            out.append(
                f"| {tp.SCHEME_LABELS[k]} | {s['bytes'] / 1e9:.4g} | {s['collectives']} | {s['ns_flops_ratio']:g} | "
                f"{s['ns_flops_busiest_rank'] / 1e12:,.4g} | {_ms(s['comm_seconds'])} | {_ms(s['ns_seconds'])} | "
                f"{_ms(s['seconds'])} |"
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", type=parse_config, default=[parse_config(c) for c in DEFAULT_CONFIGS],
                    help="MODEL:DPxTP ... (models: " + ", ".join(tp.MODELS) + ")")
    ap.add_argument("--bandwidth-gbps", type=float, default=cm.LinkConfig.bandwidth_gbps, help="inter-node, per GPU")
    ap.add_argument("--alpha-us", type=float, default=cm.LinkConfig.alpha_us, help="inter-node latency per step")
    ap.add_argument("--latency", default=cm.LinkConfig.latency, choices=("ring", "log2"))
    ap.add_argument("--nvlink-gbps", type=float, default=tp.TPLinks.nvlink_gbps,
                    help="inside a node, per GPU each direction (default: H100 NVLink 4, 450 GB/s)")
    ap.add_argument("--nvlink-alpha-us", type=float, default=tp.TPLinks.nvlink_alpha_us,
                    help="inside a node (default: assumed equal to the inter-node 5 us)")
    ap.add_argument("--gpus-per-node", type=int, default=tp.TPLinks.gpus_per_node)
    ap.add_argument("--exchange-bytes", type=int, default=tp.TPLinks.exchange_bytes,
                    help="bytes per element of every scheme's optimizer exchanges (bf16: 2)")
    ap.add_argument("--ns-tflops", type=float, default=tp.TPLinks.ns_tflops, help="sustained NS rate per GPU (assumed)")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/ for a full run, "
                    "runs/bench-quick/ when any flag is changed)")  # fmt: skip
    args = ap.parse_args(argv)
    results = out_dir(ap, args, keep=("no_write",))
    inter = cm.LinkConfig(bandwidth_gbps=args.bandwidth_gbps, alpha_us=args.alpha_us, latency=args.latency)
    links = tp.TPLinks(nvlink_gbps=args.nvlink_gbps, nvlink_alpha_us=args.nvlink_alpha_us,
                       gpus_per_node=args.gpus_per_node, exchange_bytes=args.exchange_bytes, ns_tflops=args.ns_tflops)  # fmt: skip
    t0 = time.perf_counter()
    rows = [tp.model_tp(name, dp, t, inter=inter, links=links) for name, dp, t in args.configs]
    data = {"command": " ".join(["python benchmarks/comm_model_tp.py", *(sys.argv[1:] if argv is None else argv)]),
            "assumptions": {k: asdict(inter)[k] for k in ("bandwidth_gbps", "alpha_us", "latency")}, "tp_links": asdict(links), "seconds": time.perf_counter() - t0,
            "python": platform.python_version(), "rows": rows}  # fmt: skip
    md = to_markdown(data)
    if args.no_write:
        print(md)
        return 0
    results.mkdir(parents=True, exist_ok=True)
    (results / "comm_model_tp.json").write_text(json.dumps(data, indent=1))
    (results / "comm_model_tp.md").write_text(md)
    print(md)
    print(f"wrote {results}/comm_model_tp.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
