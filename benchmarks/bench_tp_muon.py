"""Muon under FSDP x TP, measured at W = 4: ours beside PyTorch FSDP2 + TP + ``torch.optim.Muon``.

Both run the same Llama-shaped model (torchtitan's TP plan: wq / wk / wv / w1 / w3 colwise, wo / w2
rowwise) on CPU / gloo at (dp, tp) = (2, 2) and (1, 4), one optimizer step after a backward, and
report per step, for the optimizer step alone (``opt.step()``):

- collectives and bytes each rank sends (every ``c10d`` op issued inside the step, counted by a
  dispatch mode; summed over the ranks, and the busiest rank's);
- Newton–Schulz (and everything else) FLOPs summed over the ranks (``FlopCounterMode`` on each rank),
  divided by one process's ``torch.optim.Muon`` step on the unsharded hidden matrices;
- the step's wall time (median of ``--steps``; CPU, so a sanity figure, not a GPU claim).

Megatron's two TP schemes (duplicated, LayerShardedMuon) are not runnable here: their figures for
the same kind of shapes come from the model, ``benchmarks/comm_model_tp.py``.

    python benchmarks/bench_tp_muon.py            # writes benchmarks/results/bench_tp_muon.{json,md}
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _out import out_dir  # noqa: E402


class _Comm(CommDebugMode):
    """torch's ``CommDebugMode`` (it sees DTensor's collectives too), plus the bytes of each
    collective's input tensors (what this rank sends)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if getattr(func, "namespace", "") in ("c10d", "_c10d_functional", "c10d_functional") and not name.startswith(
            ("wait", "barrier", "monitored")
        ):
            nbytes = 0
            for a in (*args, *(kwargs or {}).values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                        nbytes += t.numel() * t.element_size()
            self.ops.append((name, nbytes))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _config(args):
    from tests._models import TPConfig

    return TPConfig(vocab_size=args.vocab, dim=args.dim, num_heads=args.heads, num_layers=args.layers, ffn_dim=args.ffn)


def _hidden(name: str) -> bool:
    return ".attention.w" in name or ".feed_forward.w" in name


def _measure(opt, steps: int, make_grads) -> dict:
    times, comm, flops = [], None, 0
    for s in range(steps + 1):
        make_grads(s)
        if s == 0:
            mode, fc = _Comm(), FlopCounterMode(display=False)
            with mode, fc:
                opt.step()
            comm, flops = mode.ops, fc.get_total_flops()
            if len(comm) != mode.get_total_counts():  # (a collective seen without its tensors: count it anyway)
                comm = comm + [("other", 0)] * (mode.get_total_counts() - len(comm))
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        opt.zero_grad()
    return {"collectives": len(comm), "bytes": sum(b for _, b in comm), "ops": sorted({n for n, _ in comm}),
            "flops": flops, "seconds": statistics.median(times)}  # fmt: skip


def _rank(kind: str, dp: int, tp: int, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_optim
    from fsdp_optim.optimizers import Muon
    from tests._models import TPTransformer, make_batch, tp_plan

    cfg = _config(args)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TPTransformer(cfg)
    tp_plan(model, mesh["tp"], loss_parallel=False, sequence_parallel=False)
    if kind == "ours":
        rule = Muon.rule(embedding_and_head=["tok_embeddings", "output"])
        for block in model.layers:
            fsdp_optim.fully_shard(block, mesh=mesh["dp"], blocks=rule)
        fsdp_optim.fully_shard(model, mesh=mesh["dp"], blocks=rule)
        hidden = [p for n, p in model.named_parameters() if _hidden(n)]
        opt = Muon([{"params": hidden, "use_muon": True}], lr=0.02)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        hidden = [p for n, p in model.named_parameters() if _hidden(n)]
        opt = torch.optim.Muon(hidden, lr=0.02)
    r = mesh.get_coordinate()[0]

    def grads(step: int) -> None:
        tok, tgt = make_batch(batch_size=2 * dp, seq_len=16, vocab_size=cfg.vocab_size, seed=step)
        F.cross_entropy(model(tok[2 * r : 2 * r + 2]).flatten(0, 1), tgt[2 * r : 2 * r + 2].flatten()).backward()

    return _measure(opt, args.steps, grads)


def _single(args) -> dict:
    from tests._models import TPTransformer, make_batch

    cfg = _config(args)
    torch.manual_seed(0)
    model = TPTransformer(cfg)
    hidden = [p for n, p in model.named_parameters() if _hidden(n)]
    opt = torch.optim.Muon(hidden, lr=0.02)

    def grads(step: int) -> None:
        tok, tgt = make_batch(batch_size=4, seq_len=16, vocab_size=cfg.vocab_size, seed=step)
        F.cross_entropy(model(tok).flatten(0, 1), tgt.flatten()).backward()

    return _measure(opt, args.steps, grads)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 1 step (smoke)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = out_dir(ap, args)
    if args.quick:
        args.dim, args.heads, args.ffn, args.layers, args.vocab, args.steps = 64, 4, 128, 1, 128, 1
    from fsdp_optim._testing import run_distributed

    torch.set_num_threads(1)
    single = _single(args)
    rows = []
    for dp, tp in [(2, 2), (1, 4)]:
        for kind in ("ours", "fsdp2"):
            per_rank = run_distributed(lambda: _rank(kind, dp, tp, args), world_size=dp * tp, timeout=600)
            rows.append({
                "scheme": "fsdp_optim" if kind == "ours" else "FSDP2 + torch.optim.Muon", "dp": dp, "tp": tp,
                "collectives_per_rank": max(r["collectives"] for r in per_rank),
                "bytes_sum": sum(r["bytes"] for r in per_rank), "bytes_max_rank": max(r["bytes"] for r in per_rank),
                "flops_ratio": sum(r["flops"] for r in per_rank) / single["flops"],
                "seconds": max(r["seconds"] for r in per_rank), "ops": sorted({o for r in per_rank for o in r["ops"]}),
            })  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    shapes = {"dim": args.dim, "heads": args.heads, "ffn": args.ffn, "layers": args.layers, "vocab": args.vocab}
    (out / "bench_tp_muon.json").write_text(json.dumps({"model": shapes, "single_flops": single["flops"],
                                                        "single_seconds": single["seconds"], "rows": rows}, indent=1))  # fmt: skip
    lines = [
        f"Muon optimizer step under FSDP x TP, W = 4, CPU / gloo; model {shapes} (hidden matrices: Muon). "
        f"One process's torch.optim.Muon step: {single['flops'] / 1e9:.3f} GFLOP, {single['seconds'] * 1e3:.1f} ms.",
        "",
        "| scheme | dp x tp | collectives / rank | MB sent, sum over ranks | MB, busiest rank | FLOPs / one process | step ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scheme']} | {r['dp']}x{r['tp']} | {r['collectives_per_rank']} | {r['bytes_sum'] / 2**20:.2f} | "
            f"{r['bytes_max_rank'] / 2**20:.2f} | {r['flops_ratio']:.2f} | {r['seconds'] * 1e3:.1f} |"
        )
    (out / "bench_tp_muon.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
