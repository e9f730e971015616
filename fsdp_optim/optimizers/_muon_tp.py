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

Optimizers with per-row state (NorMuon: [Note: NorMuon under tensor parallelism]) plan the exchange
with ``row_states`` and ``result_dtype``: each segment then also carries row-state entries, bit for bit
in their own dtype (reinterpreted as 2-byte slots, segments 8-byte aligned), and the results come back
in ``result_dtype`` instead of bf16; still two all-to-alls per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..sharding.contract import LocalShard, local_tensor

__all__ = [
    "RowStateSlots", "TPExchange", "TPHomed", "plan_tp_exchange", "tp_assembles", "tp_exchange_out", "tp_receive_back",
    "tp_write_back",
]  # fmt: skip


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


class RowStateSlots(NamedTuple):
    """Where a matrix's per-row state travels in its segments (slot offsets relative to the segment's
    start; ``dtype``: the state's, reinterpreted bit for bit): ``rows_out`` entries out to the home (a
    ``ColwiseParallel`` slice's own rows; none for ``RowwiseParallel``, whose every TP rank holds all the
    rows and the home uses its own copy), ``rows_back`` entries back (each TP rank's TP-local rows)."""

    dtype: torch.dtype
    out_at: int
    rows_out: int
    back_at: int
    rows_back: int


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
    state: RowStateSlots | None = None


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
    state: RowStateSlots | None = None


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
    result_dtype: torch.dtype = torch.bfloat16
    """What the home sends back for a fp32 / fp64 parameter: Muon's bf16 Newton–Schulz result; NorMuon's
    fp32 normalized one."""


def plan_tp_exchange(
    items: Sequence[tuple[Tensor, LocalShard]],
    homes: Sequence[int],
    low_precision: Callable[[torch.dtype], bool],
    *,
    row_states: Sequence[Tensor | None] | None = None,
    result_dtype: torch.dtype = torch.bfloat16,
) -> TPExchange:
    """The exchange of TP-sharded matrices ``items`` (this rank's, in the optimizer's order: the same on
    every TP rank of the group) with home TP coordinates ``homes``; ``row_states``: per item, its per-row
    state (one entry per TP-local row) that travels with it, or None."""
    tp0 = items[0][1].tp
    size, me = tp0.size, tp0.rank
    g = tp0.group_ranks()  # g[t]: group rank of TP coordinate t
    low = [low_precision(p.dtype) for p, _ in items]
    states = list(row_states) if row_states is not None else [None] * len(items)
    for (p, info), lo, v in zip(items, low, states):
        if lo and p.element_size() != 2:
            raise ValueError(
                f"Muon: {info.fqn or '<unnamed>'} is a TP-sharded matrix of dtype {p.dtype}; such matrices need fp32, "
                "fp64, bf16 or fp16 parameters (low-precision slices travel in 2-byte slots)"
            )
        if v is not None and (v.element_size() not in (2, 4, 8) or v.numel() != info.shape[0]):
            raise ValueError(
                f"Muon: {info.fqn or '<unnamed>'}: its row state ({v.numel()} x {v.dtype}) is not one 2-, 4- or "
                f"8-byte entry per TP-local row ({info.shape[0]})"
            )
    align = 4 if any(v is not None for v in states) else 1  # 8-byte aligned segments: wide views of the buffer

    def up(x: int) -> int:
        return -(-x // align) * align

    def segment(j: int) -> tuple[int, int, RowStateSlots | None]:
        """(out slots, back slots, row-state slots) of item j's segment, the same for every TP slice."""
        n, v = items[j][1].local_numel, states[j]
        out, back = (1 + low[j]) * n, n * (1 if low[j] else result_dtype.itemsize // 2)
        if v is None:
            return up(out), up(back), None
        k, rows_back = v.element_size() // 2, v.numel()
        rows_out = rows_back if items[j][1].tp.dim == 0 else 0
        slots = RowStateSlots(v.dtype, up(out), rows_out, up(back), rows_back)
        return up(slots.out_at + k * rows_out), up(slots.back_at + k * rows_back), slots

    segments = [segment(j) for j in range(len(items))]
    sends, send_sizes, back_recv_sizes, at, back_at = [], [0] * size, [0] * size, 0, 0
    for j in sorted(range(len(items)), key=lambda j: (g[homes[j]], j)):
        p, info = items[j]
        out, back, slots = segments[j]
        rows, cols = info.tp.global_shape
        sends.append(TPSend(p, info.local_numel, rows, cols, low[j], at, back_at, slots))
        send_sizes[g[homes[j]]] += out
        back_recv_sizes[g[homes[j]]] += back
        at, back_at = at + out, back_at + back
    mine = [j for j in range(len(items)) if homes[j] == me]
    recv_sizes, back_send_sizes, at, back_at = [0] * size, [0] * size, 0, 0
    pieces: dict[int, dict[int, tuple[int, int]]] = {j: {} for j in mine}
    for gt, t in sorted((g[t], t) for t in range(size)):
        for j in mine:
            out, back, _ = segments[j]
            pieces[j][t] = (at, back_at)
            recv_sizes[gt] += out
            back_send_sizes[gt] += back
            at, back_at = at + out, back_at + back
    homed = []
    for j in mine:
        p, info = items[j]
        rows, cols = info.tp.global_shape
        homed.append(TPHomed(p, rows, cols, info.tp.dim, tuple(info.shape), low[j], tuple(pieces[j][t] for t in range(size)),
                             segments[j][2]))  # fmt: skip
    return TPExchange(
        tp0.group, items[0][0].device, tuple(sends), tuple(send_sizes), tuple(recv_sizes), tuple(back_send_sizes),
        tuple(back_recv_sizes), tuple(homed), tuple((p, p.dtype) for p, _ in items), result_dtype,
    )  # fmt: skip


def tp_exchange_out(
    ex: TPExchange, updates: dict[Tensor, Any], row_state: Callable[[Tensor], Tensor | None] = lambda p: None
) -> list[tuple[TPHomed, Tensor, Tensor | None, Tensor | None]]:
    """First all_to_all: my slices (and, planned with row states, ``row_state(param)``'s entries) to their
    homes. Returns, per matrix I home, ``(homed, [1, rows, cols] bf16 matrix, [rows, cols] parameter or
    None, the matrix's whole ``[rows]`` row state (a fresh tensor) or None)``."""
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
        if s.state is not None and s.state.rows_out:
            _slots(send, s.at + s.state.out_at, s.state.rows_out, s.state.dtype).copy_(row_state(s.param))
    recv = torch.empty(sum(ex.recv_sizes), dtype=torch.bfloat16, device=ex.device)
    dist.all_to_all_single(recv, send, list(ex.recv_sizes), list(ex.send_sizes), group=ex.group)
    out = []
    for h in ex.homed:
        n = len_of(h.local_shape)
        full = torch.cat([recv[a : a + n].view(h.local_shape) for a, _ in h.pieces], dim=h.dim)
        param = state = None
        if h.with_param:
            param = torch.cat([recv[a + n : a + 2 * n].view(h.param.dtype).view(h.local_shape) for a, _ in h.pieces], dim=h.dim)
        if h.state is not None:  # dim 0: the slices' rows in TP order; dim 1: every rank holds all rows
            st = h.state
            state = (torch.cat([_slots(recv, a + st.out_at, st.rows_out, st.dtype) for a, _ in h.pieces])
                     if st.rows_out else row_state(h.param).clone())  # fmt: skip
        out.append((h, full.view(1, h.rows, h.cols), param, state))
    return out


def tp_write_back(h: TPHomed, res: Tensor, param: Tensor | None, alpha: float, back: Tensor, state: Tensor | None = None) -> None:
    """At the home: each TP coordinate's slice of ``res`` (the orthogonalized matrix, or, low precision,
    the parameter after torch.optim.Muon's ``add_`` on the whole matrix) into the send-back buffer, in its
    own dtype; with row state, each coordinate's rows of the updated ``state`` after it."""
    if param is not None:
        param.add_(res[0], alpha=alpha)
        src = param
    else:
        src = res[0]
    n = len_of(h.local_shape)
    for t, ((_, b), part) in enumerate(zip(h.pieces, src.chunk(len(h.pieces), dim=h.dim))):
        _slots(back, b, n, src.dtype).view(h.local_shape).copy_(part)
        if h.state is not None:
            st = h.state
            rows = state if h.dim == 1 else state[t * st.rows_back : (t + 1) * st.rows_back]
            _slots(back, b + st.back_at, st.rows_back, st.dtype).copy_(rows)


def tp_receive_back(
    ex: TPExchange, back: Tensor, updates: dict[Tensor, Any], alpha_of: Callable[[TPSend], float],
    row_state: Callable[[Tensor], Tensor | None] = lambda p: None,
) -> None:  # fmt: skip
    """Second all_to_all: my slice of each result, added with the matrix's lr (or new values, copied), and
    my rows of its row state, copied."""
    mine = torch.empty(sum(ex.back_recv_sizes), dtype=torch.bfloat16, device=ex.device)
    dist.all_to_all_single(mine, back, list(ex.back_recv_sizes), list(ex.back_send_sizes), group=ex.group)
    adds: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for s in ex.sends:
        if s.param not in updates:
            continue
        if s.state is not None:
            row_state(s.param).copy_(_slots(mine, s.back_at + s.state.back_at, s.state.rows_back, s.state.dtype))
        dst = local_tensor(s.param).view(-1)[: s.n]
        if s.with_param:
            dst.copy_(_slots(mine, s.back_at, s.n, dst.dtype))
            continue
        dsts, srcs = adds.setdefault(alpha_of(s), ([], []))
        dsts.append(dst)
        srcs.append(_slots(mine, s.back_at, s.n, ex.result_dtype))
    for alpha, (dsts, srcs) in adds.items():
        torch._foreach_add_(dsts, srcs, alpha=alpha)


def _slots(buf: Tensor, at: int, n: int, dtype: torch.dtype) -> Tensor:
    """``n`` elements of ``dtype`` at slot ``at`` of the bf16 buffer ``buf``, reinterpreted bit for bit."""
    return buf[at : at + dtype.itemsize // 2 * n].view(dtype)


def len_of(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
