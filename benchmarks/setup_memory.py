"""Setup memory per rank: fsdp_optim.fully_shard vs PyTorch FSDP2 on the same model and pattern.

A stack of ``--num-layers`` x ``Linear(--dim, --dim)`` (fp32) is built on meta or on the CPU,
sharded layer by layer and then at the root (the documented pattern of both), initialized, and run
through one forward and backward on gloo. Per rank: peak growth of live tensor bytes
(``fsdp_optim._testing.LiveBytes``) and of RSS (glibc's mmap threshold pinned with
``MALLOC_MMAP_THRESHOLD_=131072`` so freed tensors leave RSS; the peak is reset through
``/proc/self/clear_refs`` after the model is built), both from the moment the model exists. The
table gives the largest rank's figures and ours / FSDP2.

    python benchmarks/setup_memory.py                 # 24 x Linear(2048, 2048), W = 2 and 4
    python benchmarks/setup_memory.py --quick         # 8 x Linear(512, 512), writes runs/bench-quick/
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "131072":  # glibc reads it at start-up: re-exec
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _out import out_dir  # noqa: E402

import fsdp_optim  # noqa: E402
from fsdp_optim._testing import LiveBytes, run_distributed  # noqa: E402

MIB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run(runtime: str, device: str, num_layers: int, dim: int):
    def fn():
        torch.manual_seed(0)
        with torch.device(device):
            model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(num_layers)])
        base_rss = _rss()
        _reset_peak_rss()
        with LiveBytes() as live:
            if runtime == "ours":
                for layer in model:
                    fsdp_optim.fully_shard(layer)
                fsdp_optim.fully_shard(model)
                if device == "meta":
                    fsdp_optim.init_weights(model)
            else:
                from torch.distributed.fsdp import fully_shard

                for layer in model:
                    fully_shard(layer)
                fully_shard(model)
                if device == "meta":
                    model.to_empty(device="cpu")
                    for m in model:
                        m.reset_parameters()
            model(torch.ones(4, dim)).sum().backward()
        return live.peak, _peak_rss() - base_rss

    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--quick", action="store_true", help="8 x Linear(512, 512)")
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/, --quick: runs/bench-quick/)")
    args = ap.parse_args()
    dest = out_dir(ap, args)
    if args.quick:
        args.num_layers, args.dim = 8, 512
    model_mib = args.num_layers * args.dim * args.dim * 4 / MIB
    rows = []
    print(f"model: {args.num_layers} x Linear({args.dim}, {args.dim}) fp32 = {model_mib:.0f} MiB; "
          "peak growth per rank (largest rank), live tensor bytes | RSS")
    print(f"{'W':>2} {'built':>5} | {'ours live':>10} {'FSDP2 live':>10} {'ratio':>6} | {'ours RSS':>9} {'FSDP2 RSS':>9} {'ratio':>6}")
    for w in args.world_sizes:
        for device in ("meta", "cpu"):
            res = {}
            for runtime in ("ours", "fsdp2"):
                out = run_distributed(_run(runtime, device, args.num_layers, args.dim), world_size=w, timeout=900)
                res[runtime] = (max(o[0] for o in out) / MIB, max(o[1] for o in out) / MIB)
            row = dict(
                world_size=w, built=device, model_mib=model_mib,
                ours_live_mib=res["ours"][0], fsdp2_live_mib=res["fsdp2"][0], live_ratio=res["ours"][0] / res["fsdp2"][0],
                ours_rss_mib=res["ours"][1], fsdp2_rss_mib=res["fsdp2"][1], rss_ratio=res["ours"][1] / max(res["fsdp2"][1], 1e-9),
            )
            rows.append(row)
            print(f"{w:>2} {device:>5} | {row['ours_live_mib']:>10.0f} {row['fsdp2_live_mib']:>10.0f} {row['live_ratio']:>6.2f} | "
                  f"{row['ours_rss_mib']:>9.0f} {row['fsdp2_rss_mib']:>9.0f} {row['rss_ratio']:>6.2f}")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "setup_memory.json").write_text(json.dumps(dict(config=vars(args), rows=rows), indent=1))
    print(f"wrote {dest / 'setup_memory.json'}")


if __name__ == "__main__":
    main()
