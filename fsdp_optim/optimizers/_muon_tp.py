"""Muon on tensor-parallel matrices: one Newton–Schulz per matrix, assembled inside its TP group.

[Note: Muon under tensor parallelism]
Under FSDP x TP (``fully_shard`` over ``parallelize_module``'s parameters, [Note: FSDP x TP]) a
2-D weight that TP splits along dim 0 (``ColwiseParallel``) or dim 1 (``RowwiseParallel``) is, on
each TP rank, a ``[m / T, n]`` or ``[m, n / T]`` TP-local matrix, which the data-parallel plan keeps
whole on one data-parallel coordinate, the *same* coordinate on every TP rank (every TP rank plans
identical TP-local shapes). Newton–Schulz needs the whole ``[m, n]`` matrix, so per step and TP
group:

1. every TP-sharded matrix gets one *home* TP rank, fixed at construction by a longest-first
   assignment on Newton–Schulz flops over the T ranks (the same list on every TP rank of the group:
   the plan is the same), so the homes spread the compute evenly;
2. one ``all_to_all_single`` over the TP group sends each rank's slice of each momentum-updated
   gradient (bf16: the cast Newton–Schulz starts with, so exact) to its home; the home concatenates
   the T slices along the TP dim in TP order: bit for bit the bf16 matrix torch.optim.Muon
   orthogonalizes; it runs Newton–Schulz once (batched with its other matrices of the same shape);
3. a second ``all_to_all_single`` sends each rank its slice of the result, which it adds to its
   TP-local parameter with the lr adjusted for the *global* ``[m, n]`` (fp32 / fp64: ``add`` rounds
   each element alone, so a slice gets the whole matrix's bits). Low-precision parameters travel
   with their (weight-decayed) values as in [Note: Muon on shards]: the home runs torch.optim.Muon's
   ``add_`` on the assembled whole parameter and returns the new values.

No TP rank repeats another's Newton–Schulz (Megatron's "duplicated" mode runs it on every TP rank),
no data-parallel rank takes part (the matrix is whole on its data-parallel coordinate), and both
exchanges travel only inside one TP group. A step with no TP-sharded matrix issues nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..sharding.contract import LocalShard, local_tensor

__all__ = ["TPExchange", "TPHomed", "plan_tp_exchange", "tp_assembles", "tp_exchange_out", "tp_receive_back", "tp_write_back"]


def tp_assembles(info: LocalShard) -> bool:
    """Muon assembles this TP-cut parameter: a 2-D ``whole()`` matrix split along dim 0 or 1, kept whole
    on its data-parallel coordinate."""
    tp = info.tp
    return (
        tp is not None
        and len(tp.global_shape) == 2
        and tp.blocks.is_matrix
        and tp.blocks.row_splits is None
        and info.spec.is_matrix
        and info.spec.row_splits is None
        and not info.split
        and tp.dim in (0, 1)
    )


class TPSend(NamedTuple):
    """This rank's TP slice (its whole TP-local matrix, ``n`` elements) of a TP-sharded matrix: out at
    ``at`` of the send buffer (then, ``with_param``, its parameter values), back at ``back_at``."""

    param: Tensor
    n: int
    rows: int
    cols: int
    with_param: bool
    at: int
    back_at: int


class TPHomed(NamedTuple):
    """A TP-sharded matrix this rank orthogonalizes: its slices arrive at ``pieces[t] = (at, back_at)``
    (TP coordinate ``t``), each ``local_shape``, concatenated along ``dim``."""

    param: Tensor
    rows: int
    cols: int
    dim: int
    local_shape: tuple[int, ...]
    with_param: bool
    pieces: tuple[tuple[int, int], ...]


class TPExchange(NamedTuple):
    """One ``all_to_all_single`` pair per step over one TP ``group`` (sizes in group-rank order)."""

    group: dist.ProcessGroup
    device: torch.device
    sends: tuple[TPSend, ...]
    send_sizes: tuple[int, ...]
    recv_sizes: tuple[int, ...]
    back_send_sizes: tuple[int, ...]
    back_recv_sizes: tuple[int, ...]
    homed: tuple[TPHomed, ...]
    dtypes: tuple[tuple[Tensor, torch.dtype], ...]


def plan_tp_exchange(
    items: Sequence[tuple[Tensor, LocalShard]], homes: Sequence[int], low_precision: Callable[[torch.dtype], bool]
) -> TPExchange:
    """The exchange of TP-sharded matrices ``items`` (this rank's, in the optimizer's order: the same on
    every TP rank of the group) with home TP coordinates ``homes``."""
    tp0 = items[0][1].tp
    size, me = tp0.size, tp0.rank
    g = tp0.group_ranks()  # g[t]: group rank of TP coordinate t
    low = [low_precision(p.dtype) for p, _ in items]
    for (p, info), lo in zip(items, low):
        if lo and p.element_size() != 2:
            raise ValueError(
                f"Muon: {info.fqn or '<unnamed>'} is a TP-sharded matrix of dtype {p.dtype}; such matrices need fp32, "
                "fp64, bf16 or fp16 parameters (low-precision slices travel in 2-byte slots)"
            )
    sends, send_sizes, back_recv_sizes, at, back_at = [], [0] * size, [0] * size, 0, 0
    for j in sorted(range(len(items)), key=lambda j: (g[homes[j]], j)):
        p, info = items[j]
        n, k = info.local_numel, 1 + low[j]
        rows, cols = info.tp.global_shape
        sends.append(TPSend(p, n, rows, cols, low[j], at, back_at))
        send_sizes[g[homes[j]]] += k * n
        back_recv_sizes[g[homes[j]]] += n
        at, back_at = at + k * n, back_at + n
    mine = [j for j in range(len(items)) if homes[j] == me]
    recv_sizes, back_send_sizes, at, back_at = [0] * size, [0] * size, 0, 0
    pieces: dict[int, dict[int, tuple[int, int]]] = {j: {} for j in mine}
    for gt, t in sorted((g[t], t) for t in range(size)):
        for j in mine:
            n, k = items[j][1].local_numel, 1 + low[j]
            pieces[j][t] = (at, back_at)
            recv_sizes[gt] += k * n
            back_send_sizes[gt] += n
            at, back_at = at + k * n, back_at + n
    homed = []
    for j in mine:
        p, info = items[j]
        rows, cols = info.tp.global_shape
        homed.append(TPHomed(p, rows, cols, info.tp.dim, tuple(info.shape), low[j], tuple(pieces[j][t] for t in range(size))))
    return TPExchange(
        tp0.group, items[0][0].device, tuple(sends), tuple(send_sizes), tuple(recv_sizes), tuple(back_send_sizes),
        tuple(back_recv_sizes), tuple(homed), tuple((p, p.dtype) for p, _ in items),
    )  # fmt: skip


def tp_exchange_out(ex: TPExchange, updates: dict[Tensor, Any]) -> list[tuple[TPHomed, Tensor, Tensor | None]]:
    """First all_to_all: my slices to their homes. Returns, per matrix I home, ``(homed, [1, rows, cols]
    bf16 matrix, [rows, cols] parameter or None)``."""
    send = torch.empty(sum(ex.send_sizes), dtype=torch.bfloat16, device=ex.device)
    for s in ex.sends:
        u = updates.get(s.param)
        piece = send[s.at : s.at + s.n]
        if u is None:  # no gradient here: take part in the exchange, contribute zeros
            piece.zero_()
        else:
            piece.copy_(u.piece(0, s.n))
        if s.with_param:
            send[s.at + s.n : s.at + 2 * s.n].view(s.param.dtype).copy_(local_tensor(s.param).view(-1)[: s.n])
    recv = torch.empty(sum(ex.recv_sizes), dtype=torch.bfloat16, device=ex.device)
    dist.all_to_all_single(recv, send, list(ex.recv_sizes), list(ex.send_sizes), group=ex.group)
    out = []
    for h in ex.homed:
        n = len_of(h.local_shape)
        full = torch.cat([recv[a : a + n].view(h.local_shape) for a, _ in h.pieces], dim=h.dim)
        param = None
        if h.with_param:
            param = torch.cat([recv[a + n : a + 2 * n].view(h.param.dtype).view(h.local_shape) for a, _ in h.pieces], dim=h.dim)
        out.append((h, full.view(1, h.rows, h.cols), param))
    return out


def tp_write_back(h: TPHomed, res: Tensor, param: Tensor | None, alpha: float, back: Tensor) -> None:
    """At the home: each TP coordinate's slice of ``NS(matrix)`` (or, low precision, of the parameter
    after torch.optim.Muon's ``add_`` on the whole matrix) into the send-back buffer."""
    if param is not None:
        param.add_(res[0], alpha=alpha)
        src = param
    else:
        src = res[0]
    n = len_of(h.local_shape)
    for (_, b), part in zip(h.pieces, src.chunk(len(h.pieces), dim=h.dim)):
        back[b : b + n].view(src.dtype).view(h.local_shape).copy_(part)


def tp_receive_back(ex: TPExchange, back: Tensor, updates: dict[Tensor, Any], alpha_of: Callable[[TPSend], float]) -> None:
    """Second all_to_all: my slice of each result, added with the matrix's lr (or new values, copied)."""
    mine = torch.empty(sum(ex.back_recv_sizes), dtype=torch.bfloat16, device=ex.device)
    dist.all_to_all_single(mine, back, list(ex.back_recv_sizes), list(ex.back_send_sizes), group=ex.group)
    adds: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for s in ex.sends:
        if s.param not in updates:
            continue
        dst = local_tensor(s.param).view(-1)[: s.n]
        got = mine[s.back_at : s.back_at + s.n]
        if s.with_param:
            dst.copy_(got.view(dst.dtype))
            continue
        dsts, srcs = adds.setdefault(alpha_of(s), ([], []))
        dsts.append(dst)
        srcs.append(got)
    for alpha, (dsts, srcs) in adds.items():
        torch._foreach_add_(dsts, srcs, alpha=alpha)


def len_of(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
