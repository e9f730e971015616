"""Setup memory per rank: fsdp_optim.fully_shard vs PyTorch FSDP2 on the same model and pattern.

A stack of ``--num-layers`` x ``Linear(--dim, --dim)`` (fp32, no bias: one matrix per layer) is built
on meta or on the CPU, sharded layer by layer and then at the root (the documented pattern of both),
with the default (element-wise) rule and with Muon's rule (whole matrices, each owned by one rank),
initialized, and run through one forward and backward on gloo. Per rank: peak growth of live tensor
bytes (``fsdp_optim._testing.LiveBytes``; meta-built, with the parameter storages it cannot see: see
``_Live``) and of RSS (glibc's mmap threshold pinned with ``MALLOC_MMAP_THRESHOLD_=131072`` so freed
tensors leave RSS; the peak is reset through ``/proc/self/clear_refs``), both over the built model.
The first table gives the busiest rank's peak over all phases, ours / FSDP2, and the bound of issue
#27 item 4: ours <= 1.10 x FSDP2 + one bucket's gradient (a whole-matrix owner receives its matrices'
whole gradients; nothing more may pile up). The second gives every rank's peak in every phase: build
(over the empty process), inner calls, root call, init (meta-built: ``init_weights`` /
``to_empty`` + ``reset_parameters``), forward, backward. RSS can be negative: a CPU-built model's
full tensors are freed while it is sharded. FSDP2 has no block rule: its figures are the same run
for both rules.

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
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _out import out_dir  # noqa: E402

import fsdp_optim  # noqa: E402
from fsdp_optim.optimizers import muon_rule  # noqa: E402
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


class _Live(LiveBytes):
    """Live tensor bytes, plus (meta-built models) parameter storages the dispatch counter cannot see:
    FSDP2's ``model.to_empty`` makes its sharded parameters outside any op it dispatches, so without
    this FSDP2's meta-built figures would leave its whole shard out (192 MiB at W = 2)."""

    model: nn.Module | None = None

    def _total(self) -> int:
        total = super()._total()
        if self.model is not None:
            seen = set()
            for p in self.model.parameters():
                t = getattr(p, "_local_tensor", p)
                if t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                key = st.data_ptr()
                if st.nbytes() and key not in self._live and key not in seen:
                    seen.add(key)
                    total += st.nbytes()
        return total


PHASES = ("build", "inner calls", "root call", "init", "forward", "backward")


class _Phases:
    """Per phase: peak growth over the built model's level of live tensor bytes and of RSS (the
    RSS peak is reset at each phase's start, so each phase's peak is its own)."""

    def __init__(self, live: LiveBytes, base_rss: int) -> None:
        self.live, self.base_rss, self.rows = live, base_rss, {}

    def phase(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.live.peak = self.live._total()
            _reset_peak_rss()
            yield
            self.rows[name] = dict(live=self.live.peak, rss=max(_peak_rss(), _rss()) - self.base_rss,
                                   live_end=self.live._total(), rss_end=_rss() - self.base_rss)

        return cm()


def _run(runtime: str, device: str, num_layers: int, dim: int, rule: str):
    def fn():
        torch.manual_seed(0)
        before = _rss()
        _reset_peak_rss()
        with torch.device(device):
            model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(num_layers)])
        build_peak = _peak_rss() - before
        built_live = sum(p.numel() * p.element_size() for p in model.parameters()) if device != "meta" else 0
        base_rss = _rss()
        _reset_peak_rss()
        with _Live() as live:
            if device == "meta":
                live.model = model
            ph = _Phases(live, base_rss)
            if runtime == "ours":
                kw = dict(blocks=muon_rule()) if rule == "muon" else {}
                with ph.phase("inner calls"):
                    for layer in model:
                        fsdp_optim.fully_shard(layer, **kw)
                with ph.phase("root call"):
                    fsdp_optim.fully_shard(model, **kw)
                with ph.phase("init"):
                    if device == "meta":
                        fsdp_optim.init_weights(model)
            else:
                from torch.distributed.fsdp import fully_shard

                with ph.phase("inner calls"):
                    for layer in model:
                        fully_shard(layer)
                with ph.phase("root call"):
                    fully_shard(model)
                with ph.phase("init"):
                    if device == "meta":
                        model.to_empty(device="cpu")
                        for m in model:
                            m.reset_parameters()
            with ph.phase("forward"):
                loss = model(torch.ones(4, dim)).sum()
            with ph.phase("backward"):
                loss.backward()
        rows = dict(build=dict(live=built_live, rss=build_peak, live_end=0, rss_end=base_rss - before), **ph.rows)
        peak_live = max(r["live"] for r in ph.rows.values())
        peak_rss = max(r["rss"] for r in ph.rows.values())
        return peak_live, peak_rss, rows

    return fn


def _grad_bucket_mib(num_layers: int, dim: int) -> float:
    return dim * dim * 4 / MIB  # one layer's gradient (one bucket per layer)


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
    grad_mib = _grad_bucket_mib(args.num_layers, args.dim)
    rows, phases = [], []
    print(f"model: {args.num_layers} x Linear({args.dim}, {args.dim}) fp32 = {model_mib:.0f} MiB, one bucket's "
          f"gradient {grad_mib:.0f} MiB; peak growth of the busiest rank over the built model, live tensor bytes | "
          "RSS (MALLOC_MMAP_THRESHOLD_=131072); bound: RSS <= 1.10 x FSDP2 + one bucket's gradient")
    print(f"{'W':>2} {'built':>5} {'rule':>7} | {'ours live':>9} {'FSDP2':>7} {'ratio':>6} | "
          f"{'ours RSS':>8} {'FSDP2':>7} {'ratio':>6} {'bound':>7} ok")
    for w in args.world_sizes:
        for device in ("meta", "cpu"):
            fsdp2 = run_distributed(_run("fsdp2", device, args.num_layers, args.dim, "default"), world_size=w, timeout=900)
            for rule in ("default", "muon"):
                ours = run_distributed(_run("ours", device, args.num_layers, args.dim, rule), world_size=w, timeout=900)
                res = {
                    name: (max(o[0] for o in out) / MIB, max(o[1] for o in out) / MIB)
                    for name, out in (("ours", ours), ("fsdp2", fsdp2))
                }
                bound = 1.10 * res["fsdp2"][1] + grad_mib
                row = dict(
                    world_size=w, built=device, rule=rule, model_mib=model_mib, grad_bucket_mib=grad_mib,
                    ours_live_mib=res["ours"][0], fsdp2_live_mib=res["fsdp2"][0],
                    live_ratio=res["ours"][0] / res["fsdp2"][0],
                    ours_rss_mib=res["ours"][1], fsdp2_rss_mib=res["fsdp2"][1],
                    rss_ratio=res["ours"][1] / max(res["fsdp2"][1], 1e-9), rss_bound_mib=bound,
                    within_bound=res["ours"][1] <= bound,
                )
                rows.append(row)
                print(f"{w:>2} {device:>5} {rule:>7} | {row['ours_live_mib']:>9.0f} {row['fsdp2_live_mib']:>7.0f} "
                      f"{row['live_ratio']:>6.2f} | {row['ours_rss_mib']:>8.0f} {row['fsdp2_rss_mib']:>7.0f} "
                      f"{row['rss_ratio']:>6.2f} {bound:>7.0f} {'yes' if row['within_bound'] else 'NO'}")
                for name, out in (("ours", ours), ("fsdp2", fsdp2)):
                    for rank, o in enumerate(out):
                        for ph, v in o[2].items():
                            phases.append(dict(world_size=w, built=device, rule=rule, runtime=name, rank=rank, phase=ph,
                                               **{k: x / MIB for k, x in v.items()}))
    print("\nper rank and phase: peak growth over the built model (build: over the empty process), MiB, "
          "live | RSS, ours / FSDP2")
    print(f"{'W':>2} {'built':>5} {'rule':>7} {'rank':>4} | " + " | ".join(f"{p:>17}" for p in PHASES))
    for w in args.world_sizes:
        for device in ("meta", "cpu"):
            for rule in ("default", "muon"):
                for rank in range(w):
                    cells = []
                    for p in PHASES:
                        get = {x["runtime"]: x for x in phases if (x["world_size"], x["built"], x["rule"], x["rank"],
                                                                   x["phase"]) == (w, device, rule, rank, p)}
                        o, f = get["ours"], get["fsdp2"]
                        cells.append(f"{o['live']:>3.0f}/{f['live']:<3.0f} {o['rss']:>4.0f}/{f['rss']:<4.0f}")
                    print(f"{w:>2} {device:>5} {rule:>7} {rank:>4} | " + " | ".join(cells))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "setup_memory.json").write_text(json.dumps(dict(config=vars(args), rows=rows, phases=phases), indent=1))
    print(f"wrote {dest / 'setup_memory.json'}")


if __name__ == "__main__":
    main()
