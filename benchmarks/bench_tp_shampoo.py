"""Shampoo and SOAP under FSDP x TP, measured at W = 4: ours beside the "duplicated" scheme and heavyball.

The model is a Llama-shaped ``TPTransformer`` (torchtitan's TP plan: wq / wk / wv / w1 / w3 / output
colwise, wo / w2 / tok_embeddings rowwise) whose TP cut goes through the preconditioner blocks (k = 80
does not divide any TP-local width or row count: 128 / 64, 384 / 192, 256 / 128), on CPU / gloo at
(dp, tp) = (2, 2) and (1, 4). The optimizer takes every 2-D weight (all TP-split; the RMSNorm weights,
replicated over TP, are left out of every side). Per optimizer step (``opt.step()`` alone), in steady
state, for one step where the inverse roots (Shampoo) / eigenbases (SOAP) are refreshed and one where
they are not:

- collectives per rank and bytes *sent* (each c10d op seen by a dispatch mode; bytes that leave the
  rank: an all-to-all's input less its own slice, an all-gather's input times (group size - 1));
  summed over the ranks, and the busiest rank's;
- preconditioner work summed over the ranks / one process running the same optimizer unsharded on the
  same model: ``aten._linalg_eigh`` and ``aten.linalg_qr`` calls and their sum of n^3 (a dispatch
  mode), and matmul FLOPs (``FlopCounterMode``); ~1.00x means nothing is duplicated;
- step wall time (median over steps of that kind, slowest rank; CPU: a sanity figure only).

Schemes:

- ``fsdp_optim``: ``fsdp_optim.fully_shard`` over the dp dim of TP-planned blocks, our ``Shampoo`` /
  ``SOAP(block_size=k)``: each TP-split weight's strips in T runs, two all-to-alls in the TP group
  ([Note: preconditioner blocks under tensor parallelism]);
- ``duplicated`` (implemented here, a few lines; the scheme Megatron calls "duplicated" for Muon): the
  TP-planned model without FSDP; the weights are dealt out whole over the dp ranks (weight i to dp rank
  i mod dp, as a distributed optimizer would); each TP rank all-gathers the TP-local gradients of its
  weights over the TP group, runs our unsharded optimizer on a full copy of each, keeps its own slice;
- ``heavyball``: ``heavyball.SOAP`` (3.2.1, ``compile_mode = None``: eager) on PyTorch FSDP2
  (``fully_shard``) over ``parallelize_module`` DTensor parameters, the same model: with its default
  ``split=False`` (the exception is recorded as the finding), and with ``split=True`` (every dim cut in
  chunks of ``max_precond_dim = k``: its nearest to our k x k blocks), measured like the others, at
  (1, 4) also on TP alone; its result against unsharded heavyball fed the same gradients, and how far
  its parameters moved. Skipped with a note when heavyball is not installed (it is not a dependency:
  ``pip install --no-deps heavyball==3.2.1``) or with ``--no-heavyball``.

    python benchmarks/bench_tp_shampoo.py         # writes benchmarks/results/bench_tp_shampoo.{json,md}
"""

from __future__ import annotations

import argparse
from collections import Counter
import copy
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _out import out_dir  # noqa: E402

COMMAND = "python benchmarks/bench_tp_shampoo.py"
FREQ = 2  # precondition_frequency: refresh every other step
LAYOUTS = ((2, 2), (1, 4))


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else 0


def _pg(v):
    try:
        g = v if isinstance(v, dist.ProcessGroup) else dist.ProcessGroup.unbox(v)
        return g.size(), g.rank()
    except Exception:  # noqa: BLE001
        return None


class _Comm(CommDebugMode):
    """torch's ``CommDebugMode`` plus, per collective, the bytes that leave this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if getattr(func, "namespace", "") in ("c10d", "_c10d_functional", "c10d_functional") and not name.startswith(
            ("wait", "barrier", "monitored", "_wrap_tensor_autograd")
        ):
            a = dict(zip([x.name for x in func._schema.arguments], args))
            a.update(kwargs or {})
            pg = next((_pg(v) for v in a.values() if _pg(v) is not None), None)
            size = a.get("group_size") or (pg[0] if pg else 1)
            if "alltoall" in name:
                inp, splits = a["input"], list(a.get("input_split_sizes") or [])
                own = (splits[pg[1]] if splits else inp.shape[0] // size) * (inp[0].numel() if inp.dim() > 1 else 1)
                sent = (inp.numel() - own) * inp.element_size()
            elif "allgather" in name or "all_gather" in name:
                inp = a.get("input_tensor", a.get("input_tensors", a.get("input")))
                sent = sum(_nbytes(t) for t in (inp if isinstance(inp, (list, tuple)) else [inp])) * (size - 1)
            else:  # anything else: its tensor inputs, once
                sent = sum(_nbytes(t) for v in a.values() for t in (v if isinstance(v, (list, tuple)) else [v]))
            self.ops.append((name, sent))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Linalg(TorchDispatchMode):
    """Counts ``eigh`` / ``qr`` calls (each matrix of a batch one call) and their sum of n^3."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"eigh": 0, "qr": 0}
        self.n3 = {"eigh": 0, "qr": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key = {"_linalg_eigh": "eigh", "linalg_qr": "qr"}.get(func._schema.name.split("::")[-1])
        if key is not None:
            a = args[0]
            batch = math.prod(a.shape[:-2])
            self.calls[key] += batch
            self.n3[key] += batch * a.shape[-1] * a.shape[-2] * min(a.shape[-2:])
        return func(*args, **(kwargs or {}))


def _config(args):
    from tests._models import TPConfig

    return TPConfig(vocab_size=args.vocab, dim=args.dim, num_heads=args.heads, num_layers=args.layers, ffn_dim=args.ffn)


def _weights(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if "norm" not in n]


def _make(name: str, k: int, params):
    from fsdp_optim.optimizers import SOAP, Shampoo

    if name == "shampoo":
        return Shampoo(params, lr=1e-2, max_preconditioner_dim=k, precondition_frequency=FREQ,
                       start_preconditioning_step=FREQ, momentum=0.5)  # fmt: skip
    return SOAP(params, lr=1e-2, block_size=k, precondition_frequency=FREQ)


def _rule(name: str, k: int):
    from fsdp_optim.optimizers import SOAP, Shampoo

    return Shampoo.rule(max_preconditioner_dim=k) if name == "shampoo" else SOAP.rule(block_size=k)


def _measure(step, grads, zero, warmup: int, steps: int) -> dict:
    """``warmup`` steps, then two counted steps (linalg, FLOPs, collectives), then ``steps`` timed ones;
    each counted / timed step is labelled by whether it ran eigh / qr (``refresh``) or not."""
    counted, times = {}, {m: [] for m in range(FREQ)}
    for s in range(warmup + 2 + steps):
        grads(s)
        if warmup <= s < warmup + 2:
            comm, fc, la = _Comm(), FlopCounterMode(display=False), _Linalg()
            with comm, fc, la:
                step()
            kind = "refresh" if sum(la.calls.values()) else "plain"
            counted[kind] = {"step": s + 1, "collectives": len(comm.ops), "bytes": sum(b for _, b in comm.ops),
                             "ops": dict(Counter(n for n, _ in comm.ops)), "flops": fc.get_total_flops(),
                             "linalg_calls": dict(la.calls), "linalg_n3": dict(la.n3)}  # fmt: skip
        elif s >= warmup + 2:
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            times[(s + 1) % FREQ].append(dt)
        else:
            step()
        zero()
    parity = {c["step"] % FREQ: kind for kind, c in counted.items()}  # timed steps by the counted ones' parity
    times = {parity.get(m): ts for m, ts in times.items()}
    for kind, c in counted.items():
        c["seconds"] = statistics.median(times[kind]) if times[kind] else float("nan")
    return counted


def _grads_fn(model, cfg, dp: int, r: int, seq: int = 16):
    from tests._models import make_batch

    def grads(step: int) -> None:
        tok, tgt = make_batch(batch_size=2 * dp, seq_len=seq, vocab_size=cfg.vocab_size, seed=step)
        F.cross_entropy(model(tok[2 * r : 2 * r + 2]).flatten(0, 1), tgt[2 * r : 2 * r + 2].flatten()).backward()

    return grads


def _ours(name: str, dp: int, tp: int, args) -> dict:
    import fsdp_optim
    from torch.distributed.device_mesh import init_device_mesh

    from tests._models import TPTransformer, tp_plan

    cfg = _config(args)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TPTransformer(cfg)
    ref = copy.deepcopy(model)
    tp_plan(model, mesh["tp"], loss_parallel=False, sequence_parallel=False)
    rule = _rule(name, args.k)
    for block in model.layers:
        fsdp_optim.fully_shard(block, mesh=mesh["dp"], blocks=rule)
    fsdp_optim.fully_shard(model, mesh=mesh["dp"], blocks=rule)
    weights = _weights(model)
    opt = _make(name, args.k, [p for _, p in weights])
    runs = sorted(n for n, p in weights if opt._plans[p].run is not None)
    out = _measure(opt.step, _grads_fn(model, cfg, dp, mesh.get_coordinate()[0]), opt.zero_grad, args.warmup, args.steps)
    # equality with the unsharded optimizer fed the same (gathered) gradients, over a fresh pair
    torch.manual_seed(0)
    model2 = TPTransformer(cfg)
    tp_plan(model2, mesh["tp"], loss_parallel=False, sequence_parallel=False)
    for block in model2.layers:
        fsdp_optim.fully_shard(block, mesh=mesh["dp"], blocks=rule)
    fsdp_optim.fully_shard(model2, mesh=mesh["dp"], blocks=rule)
    opt2 = _make(name, args.k, [p for _, p in _weights(model2)])
    ropt = _make(name, args.k, [p for _, p in _weights(ref)])
    grads = _grads_fn(model2, cfg, dp, mesh.get_coordinate()[0])
    diff, moved, ref_moved = _against_unsharded(model2, ref, opt2, ropt, grads, args.check_steps)
    return {"counted": out, "runs": runs, "num_weights": len(weights), "max_diff_vs_unsharded": diff,
            "max_moved": moved, "unsharded_max_moved": ref_moved}


def _against_unsharded(model, ref, opt, ropt, grads, steps: int) -> tuple[float, float, float]:
    """``steps`` steps of the sharded ``opt`` and of ``ropt`` on the unsharded ``ref`` fed its gathered
    gradients: (max |param diff|, max |param change| sharded, the same unsharded)."""
    sharded = dict(model.named_parameters())
    before = {n: sharded[n].full_tensor().clone() for n, _ in _weights(ref)}
    r0 = {n: p.detach().clone() for n, p in _weights(ref)}
    for s in range(steps):
        grads(s)
        for n, p in _weights(ref):
            p.grad = sharded[n].grad.full_tensor().clone()
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    diff = max((sharded[n].full_tensor() - p).abs().max().item() for n, p in _weights(ref))
    moved = max((sharded[n].full_tensor() - before[n]).abs().max().item() for n, _ in _weights(ref))
    return diff, moved, max((p.detach() - r0[n]).abs().max().item() for n, p in _weights(ref))


def _duplicated(name: str, dp: int, tp: int, args) -> dict:
    """Megatron's "duplicated" scheme, here: gather each TP-split gradient over TP, step a full copy."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests._models import TPTransformer, tp_plan

    cfg = _config(args)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    d = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    model = TPTransformer(cfg)
    tp_plan(model, mesh["tp"], loss_parallel=False, sequence_parallel=False)
    mine = [p for i, (_, p) in enumerate(_weights(model)) if i % dp == d]  # whole weights dealt over dp
    full = [torch.nn.Parameter(p.full_tensor()) for p in mine]  # a full local copy of each
    opt = _make(name, args.k, full)
    group = mesh["tp"].get_group()

    @torch.no_grad()
    def step() -> None:
        for p, f in zip(mine, full):
            # (the embedding's gradient comes back Replicate: take this rank's slice, no collective)
            g = p.grad.redistribute(p.device_mesh, p.placements).to_local().contiguous()
            dim = p.placements[0].dim
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g, group=group)
            f.grad = torch.cat(parts, dim)
        opt.step()
        for p, f in zip(mine, full):
            p.to_local().copy_(f.detach().chunk(tp, p.placements[0].dim)[mesh.get_coordinate()[1]])

    def zero() -> None:
        model.zero_grad()
        opt.zero_grad()

    return {"counted": _measure(step, _grads_fn(model, cfg, dp, d), zero, args.warmup, args.steps)}


def _hb_make(params, args, split: bool = True):
    import heavyball

    heavyball.utils.compile_mode = None  # eager on CPU (its default compiles every step function)
    # split=True: every dim cut in chunks of max_precond_dim, heavyball's nearest to k x k blocks
    return heavyball.SOAP(params, lr=1e-2, precondition_frequency=FREQ, max_precond_dim=args.k, split=split)


def _heavyball(dp: int, tp: int, args, fsdp: bool, split: bool = True) -> dict:
    """heavyball.SOAP on PyTorch FSDP2 over TP (DTensor parameters); ``fsdp=False``: TP alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests._models import TPTransformer, tp_plan

    cfg = _config(args)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))

    def build():
        torch.manual_seed(0)
        model = TPTransformer(cfg)
        ref = copy.deepcopy(model)
        tp_plan(model, mesh["tp"], loss_parallel=False, sequence_parallel=False)
        if fsdp:
            for block in model.layers:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        return model, ref

    model, _ = build()
    opt = _hb_make([p for _, p in _weights(model)], args, split)
    grads = _grads_fn(model, cfg, dp, mesh.get_coordinate()[0])
    try:
        counted = _measure(opt.step, grads, opt.zero_grad, args.warmup, args.steps)
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                "where": traceback.format_exc().strip().splitlines()[-3:-1]}  # fmt: skip
    model2, ref = build()
    opt2, ropt = _hb_make([p for _, p in _weights(model2)], args), _hb_make([p for _, p in _weights(ref)], args)
    grads = _grads_fn(model2, cfg, dp, mesh.get_coordinate()[0])
    diff, moved, ref_moved = _against_unsharded(model2, ref, opt2, ropt, grads, args.check_steps)
    return {"counted": counted, "max_diff_vs_unsharded": diff, "max_moved": moved, "unsharded_max_moved": ref_moved}


def _single(name: str, args) -> dict:
    """One process, the same optimizer unsharded on the same model."""
    from tests._models import TPTransformer

    cfg = _config(args)
    torch.manual_seed(0)
    model = TPTransformer(cfg)
    if name == "heavyball":
        opt = _hb_make([p for _, p in _weights(model)], args)
    else:
        opt = _make(name, args.k, [p for _, p in _weights(model)])
    return _measure(opt.step, _grads_fn(model, cfg, 2, 0, 16), opt.zero_grad, args.warmup, args.steps)


def _row(scheme: str, name: str, dp: int, tp: int, per_rank: list[dict], single: dict, kind: str) -> dict:
    cs = [r["counted"][kind] for r in per_rank]
    ref = single[kind]

    def ratio(a, b):
        return a / b if b else (1.0 if a == b else float("inf"))

    return {
        "scheme": scheme, "optimizer": name, "dp": dp, "tp": tp, "step_kind": kind, "step": cs[0]["step"],
        "collectives_per_rank": max(c["collectives"] for c in cs),
        "ops_busiest_rank": max((c["ops"] for c in cs), key=lambda o: sum(o.values())),
        "bytes_sum": sum(c["bytes"] for c in cs), "bytes_max_rank": max(c["bytes"] for c in cs),
        "linalg_calls": {k: sum(c["linalg_calls"][k] for c in cs) for k in ("eigh", "qr")},
        "linalg_n3_ratio": ratio(sum(sum(c["linalg_n3"].values()) for c in cs), sum(ref["linalg_n3"].values())),
        "flops_ratio": ratio(sum(c["flops"] for c in cs), ref["flops"]),
        "seconds": max(c["seconds"] for c in cs),
    }  # fmt: skip


def _hb_runs(fn, world_size: int) -> list[dict]:
    """heavyball's ranks; a rank that dies (seen once: SIGSEGV at 2x2) is recorded as its error."""
    from fsdp_optim._testing import run_distributed

    try:
        return run_distributed(fn, world_size=world_size, timeout=600)
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        first = str(e).splitlines()
        return [{"error": f"{type(e).__name__}: " + " ".join(first[:2]), "where": None}]


def _ops(ops: dict) -> str:
    return " + ".join(f"{v} {k.split('.')[0].strip('_')}" for k, v in sorted(ops.items()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--k", type=int, default=80, help="max_preconditioner_dim / block_size")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the two counted ones")
    ap.add_argument("--steps", type=int, default=4, help="timed steps after the counted ones")
    ap.add_argument("--check-steps", type=int, default=3, help="steps of the equality check vs unsharded")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (k = 12), few steps (smoke)")
    ap.add_argument("--no-heavyball", action="store_true", help="skip heavyball even when installed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = out_dir(ap, args)
    if args.quick:
        args.dim, args.heads, args.ffn, args.layers, args.vocab, args.k = 32, 4, 64, 1, 128, 12
        args.steps, args.check_steps = 1, 2
    from fsdp_optim._testing import run_distributed

    torch.set_num_threads(1)
    try:
        import heavyball  # noqa: F401

        have_hb = not args.no_heavyball
    except ImportError:
        have_hb = False
        print("heavyball not installed: its rows are skipped (pip install --no-deps heavyball==3.2.1)")
    names = ("shampoo", "soap")
    single = {n: _single(n, args) for n in names}
    rows, checks, heavy = [], {}, {}
    for dp, tp in LAYOUTS[-1:] if args.quick else LAYOUTS:  # (the smoke test: 1x4 only)
        for name in names:
            ours = run_distributed(lambda: _ours(name, dp, tp, args), world_size=dp * tp, timeout=600)
            dup = run_distributed(lambda: _duplicated(name, dp, tp, args), world_size=dp * tp, timeout=600)
            checks[f"{name} {dp}x{tp}"] = {"runs": len(ours[0]["runs"]), "weights": ours[0]["num_weights"],
                                           "max_diff_vs_unsharded": max(r["max_diff_vs_unsharded"] for r in ours),
                                           "max_moved": ours[0]["max_moved"]}  # fmt: skip
            for kind in ("refresh", "plain"):
                rows.append(_row("fsdp_optim", name, dp, tp, ours, single[name], kind))
                rows.append(_row("duplicated (TP all-gather)", name, dp, tp, dup, single[name], kind))
        if have_hb:
            for fsdp in (True, False) if dp == 1 else (True,):  # default split=False: the outcome only, not timed
                hb = _hb_runs(lambda: _heavyball(dp, tp, args, fsdp, split=False), dp * tp)
                errors = sorted({r["error"] for r in hb if "error" in r})
                label = f"{dp}x{tp} split=False (default)" + ("" if fsdp else ", TP only, no FSDP2")
                heavy[label] = {"error": errors[0], "where": hb[0].get("where")} if errors else {
                    "max_diff_vs_unsharded": max(r["max_diff_vs_unsharded"] for r in hb), "max_moved": hb[0]["max_moved"],
                    "unsharded_max_moved": hb[0]["unsharded_max_moved"], "note": "not timed"}  # fmt: skip
            for fsdp in (True, False) if dp == 1 else (True,):  # TP alone: the layout FSDP2 over dp = 1 would give
                label = f"{dp}x{tp} split=True" + ("" if fsdp else ", TP only, no FSDP2")
                hb = _hb_runs(lambda: _heavyball(dp, tp, args, fsdp), dp * tp)
                errors = sorted({r["error"] for r in hb if "error" in r})
                if errors:
                    heavy[label] = {"error": errors[0], "where": hb[0].get("where")}
                    continue
                heavy[label] = {k: hb[0][k] for k in ("max_moved", "unsharded_max_moved")}
                heavy[label]["max_diff_vs_unsharded"] = max(r["max_diff_vs_unsharded"] for r in hb)
                if "heavyball" not in single:
                    single["heavyball"] = _single("heavyball", args)
                scheme = ("FSDP2 + TP + " if fsdp else "TP (no FSDP2) + ") + "heavyball.SOAP(split=True)"
                if heavy[label]["max_moved"] == 0:
                    scheme += " [never changes the parameters]"
                for kind in ("refresh", "plain"):
                    if kind in hb[0]["counted"] and kind in single["heavyball"]:
                        rows.append(_row(scheme, "soap (heavyball)", dp, tp, hb, single["heavyball"], kind))
    out.mkdir(parents=True, exist_ok=True)
    shapes = {"dim": args.dim, "heads": args.heads, "ffn": args.ffn, "layers": args.layers, "vocab": args.vocab, "k": args.k}
    data = {"command": COMMAND + (" --quick" if args.quick else ""), "model": shapes, "precondition_frequency": FREQ,
            "single": single, "equality": checks, "heavyball": heavy if have_hb else "not installed", "rows": rows}  # fmt: skip
    (out / "bench_tp_shampoo.json").write_text(json.dumps(data, indent=1))
    lines = [
        f"Shampoo / SOAP optimizer step under FSDP x TP, W = 4, CPU / gloo (2 shared cores); model {shapes}: every "
        f"2-D weight under the optimizer, TP-cut through its k x k blocks; precondition_frequency {FREQ}. "
        f"Per `opt.step()` after {args.warmup} warm-up steps: `refresh` = the step that recomputes inverse roots "
        f"(Shampoo) / eigenbases (SOAP), `plain` = the one that does not. Ratios: summed over the ranks / one "
        f"process running the same optimizer unsharded on the same model. Bytes: what leaves each rank (an "
        f"all-to-all's input less its own slice, an all-gather's input x (group size - 1)). Ours: two all-to-alls "
        f"in the TP group plus the non-finite-gradient flag's all_reduce (one, over the merged (dp, tp) ranks); the "
        f"duplicated scheme (written in this script) skips that check and all-gathers each weight's gradient "
        f"separately; the RMSNorm weights (replicated over TP) are under no optimizer. Step ms: CPU, a sanity "
        f"figure (median, slowest rank). Command: `{data['command']}`.",
        "",
        "| scheme | optimizer | dp x tp | step | collectives / rank (busiest) | MB sent, sum | MB, busiest rank | eigh + qr calls (sum) | n^3 / one process | matmul FLOPs / one process | step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lc = r["linalg_calls"]
        lines.append(
            f"| {r['scheme']} | {r['optimizer']} | {r['dp']}x{r['tp']} | {r['step_kind']} ({r['step']}) | "
            f"{r['collectives_per_rank']} ({_ops(r['ops_busiest_rank'])}) | {r['bytes_sum'] / 2**20:.3f} | {r['bytes_max_rank'] / 2**20:.3f} | "
            f"{lc['eigh']} + {lc['qr']} | {r['linalg_n3_ratio']:.2f} | {r['flops_ratio']:.2f} | {r['seconds'] * 1e3:.1f} |"
        )
    lines += ["", "One process (unsharded) per step: " + "; ".join(
        f"{n} {k}: {v['linalg_calls']['eigh']} eigh + {v['linalg_calls']['qr']} qr, {v['flops'] / 1e9:.3f} GFLOP, "
        f"{v['seconds'] * 1e3:.1f} ms" for n, s in single.items() for k, v in s.items())]  # fmt: skip
    lines += ["", "fsdp_optim vs the unsharded optimizer fed the same gradients (max |param diff| after "
              f"{args.check_steps} steps; TP-split weights assembled in runs / weights): " + "; ".join(
                  f"{k}: {v['max_diff_vs_unsharded']:.3g} ({v['runs']}/{v['weights']}; max |param change| {v['max_moved']:.3g})"
                  for k, v in checks.items())]  # fmt: skip
    if have_hb:
        lines += ["", "heavyball 3.2.1 SOAP on FSDP2 + TP: " + "; ".join(
            f"{k}: " + (f"fails: `{v['error']}`" if "error" in v else
                       f"runs; after {args.check_steps} steps max |param diff| vs unsharded heavyball fed the same gradients "
                       f"{v['max_diff_vs_unsharded']:.3g}, max |param change| {v['max_moved']:.3g} "
                       f"(unsharded: {v.get('unsharded_max_moved', float('nan')):.3g})") for k, v in heavy.items())]
    else:
        lines += ["", "heavyball: not installed (or --no-heavyball), skipped."]
    (out / "bench_tp_shampoo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return data


if __name__ == "__main__":
    main()
