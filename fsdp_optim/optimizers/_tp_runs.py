"""Shampoo's and SOAP's blocks that a tensor-parallel cut splits, assembled inside one TP group.

[Note: preconditioner blocks under tensor parallelism]
Shampoo's blocks (and block SOAP's units) are ``[k, k]`` chunks of *global* strips, ``k`` rows of the
global tensor ([Note: Shampoo blocks]). A TP cut through them (``RowwiseParallel`` with a TP-local
width that ``k`` does not divide; ``ColwiseParallel`` with TP-local rows that ``k`` does not divide)
leaves each block's pieces on several TP ranks. They are assembled inside the TP group, never across
data-parallel ranks:

- a cut on dim 1: the TP-local ``[R, C / T]`` tensor has the global rows, so its planned strips
  (``rows(k)``) are the global strips, on the same data-parallel coordinate of every TP rank (the
  plans are identical): the TP group of coordinate ``d`` holds global strips ``[a_d, b_d)``, each
  split by columns over its ``T`` ranks;
- a cut on dim 0: a global strip spans TP-local tensors, so ``fully_shard`` plans such a TP-local
  tensor ``whole()`` (``_setup``): the TP group of its data-parallel coordinate holds all of it.

The strips a TP group holds are divided into ``T`` contiguous *runs* of (nearly) equal count, run
``t`` *owned* by TP rank ``t``: the per-block state of its blocks lives there (for SOAP every state
tensor: its moments live in the blocks' eigenbases). Per step one ``all_to_all_single`` over the TP
group sends every rank's part of each run (its rows of the run with all its TP-local columns: one
contiguous range of its flat piece) to the run's owner, carrying the fields the step needs (fp32);
the owner concatenates the ``T`` parts along the TP dim, in TP order (the global rows, bit for bit),
and runs the same block work as on a whole strip; a second ``all_to_all_single`` returns each rank
its part of the result. The work is spread over the TP ranks (``T`` runs per tensor) and no TP rank
repeats another's.

State layout: run ``t``'s per-block state is a contiguous range of the tensor's *global* per-block
vector (strips in order), so the runs lay that vector out over the (data-parallel coordinate, TP
rank) cells in that order: one ragged dim on the merged mesh (``LocalShard.tp_state_mesh``), HSDP's replicate
dim replicated (``StateShard.mesh``). Checkpoints hold the same global vector as an unsharded or
TP-free run does: they load across TP sizes, data-parallel layouts and without TP.

Only tensors whose merged shape ([Note: Shampoo blocks]) is their own 2-D (or 1-D, cut on dim 0)
shape are assembled this way (TP weights and biases); others are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..sharding.contract import LocalShard
from ._strips import BlockGeometry, shampoo_blocks

__all__ = ["RUNS_TAKE", "TPRun", "TPRunExchange", "plan_tp_run", "run_bounds", "tp_runs_fit"]


RUNS_TAKE = (
    "it assembles TP-split 2-D weights, and 1-D weights cut on dim 0, whose shape merge_small_dims keeps; this one's "
    "merged shape is not its own (dims whose product is at most k are merged: a smaller k keeps them)"
)
"""What ``tp_runs_fit`` takes, for the refusal of the rest (``tp_cut_error``'s ``supported``)."""


class TPRun(NamedTuple):
    """One TP-split tensor's runs as this rank sees them."""

    info: LocalShard
    geom: BlockGeometry
    """The *global* tensor's blocking."""
    strips: tuple[int, int]
    """The global strips ``[s0, s1)`` of this TP rank's run."""
    rows: tuple[int, int]
    """Their rows ``[r0, r1)`` of the global tensor."""
    sends: tuple[tuple[int, int], ...]
    """Per TP coordinate ``t``: ``[a, b)`` of this rank's flat piece that lies in ``t``'s run."""
    parts: tuple[tuple[int, int], ...]
    """Per TP coordinate ``r``: ``(rows, cols)`` of ``r``'s part of this rank's run."""
    cells: tuple[tuple[int, int], ...]
    """Every (data-parallel coordinate, TP coordinate) cell's global strips ``[s0, s1)``, in that order."""
    mesh: DeviceMesh
    """The merged (dp, tp) state mesh (``LocalShard.tp_state_mesh``)."""
    cell: int
    """This rank's cell."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The run's view: ``(rows, *dims[1:])`` of the global tensor."""
        return (self.rows[1] - self.rows[0], *self.geom.dims[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def start(self) -> int:
        """The run's first element in the global flat tensor."""
        return self.rows[0] * self.geom.cols


def tp_runs_fit(info: LocalShard, k: int) -> bool:
    """The TP-split ``info`` can be assembled in runs: a 2-D tensor (or 1-D, cut on dim 0) whose merged
    shape is its own, with its TP-local piece laid out as the note needs."""
    tp = info.tp
    if tp is None or tp.dim not in (0, 1) or len(tp.global_shape) not in (1, 2) or (tp.dim == 1 and len(tp.global_shape) != 2):
        return False
    if shampoo_blocks(tp.global_shape, k, tp.blocks).dims != tuple(tp.global_shape):
        return False
    if tp.dim == 0:  # planned whole (_setup): all of it on one data-parallel coordinate
        return info.local_numel in (0, info.numel)
    # a cut on dim 1: the data-parallel bounds fall on global strips (rows(k) of the TP-local rows, or a TP-local
    # tensor small enough to merge, hence of one strip, kept whole)
    cols = info.shape[1]
    return all(b % (k * cols) == 0 or b == info.numel for b in info.layout.bounds)


def plan_tp_run(info: LocalShard, k: int, *, shift: int = 0) -> TPRun:
    """This rank's ``TPRun`` of the TP-split ``info`` (``tp_runs_fit``), with ``Shampoo.rule(k)``'s
    global blocking: every cell's strips, its own run, what it sends and receives. ``shift`` (the
    tensor's index among an optimizer's TP-split ones, the same on every rank) turns which TP ranks
    get the larger runs, so tensors of fewer strips than TP ranks spread over them."""
    tp = info.tp
    geom = shampoo_blocks(tp.global_shape, k, tp.blocks)
    T, cols = tp.size, geom.cols
    cells = []
    for q in range(info.world_size):
        r0, r1 = _held_rows(info, q)
        a, b = geom.strip_at(r0 * cols), geom.strip_at(r1 * cols)
        cells.extend((a + ((b - a) * t + shift % T) // T, a + ((b - a) * (t + 1) + shift % T) // T) for t in range(T))

    def rows_of(s: tuple[int, int]) -> tuple[int, int]:
        start = geom.strip_start_row(s[0]) if s[0] < geom.num_strips else geom.rows
        return (start, start) if s[0] == s[1] else (start, geom.strip_start_row(s[1] - 1) + geom.strip_rows(s[1] - 1))

    me = info.rank * T + tp.rank
    mine = rows_of(cells[me])
    local_cols = info.shape[1] if len(info.shape) == 2 else 1
    sends, parts = [], []
    for t in range(T):
        t0, t1 = rows_of(cells[info.rank * T + t])
        if tp.dim == 1:  # my columns of t's rows; t's run has my rows x each rank's columns
            base = info.start // local_cols
            sends.append(((t0 - base) * local_cols, (t1 - base) * local_cols))
            parts.append((mine[1] - mine[0], local_cols))
        else:  # my TP-local rows [t L, (t + 1) L) of the global ones
            L = info.shape[0]
            lo, hi = max(t0, tp.rank * L), min(t1, (tp.rank + 1) * L)
            sends.append(((lo - tp.rank * L) * local_cols, (hi - tp.rank * L) * local_cols) if lo < hi else (0, 0))
            lo, hi = max(mine[0], t * L), min(mine[1], (t + 1) * L)
            parts.append((max(hi - lo, 0), local_cols))
    return TPRun(info, geom, cells[me], mine, tuple(sends), tuple(parts), tuple(cells), info.tp_state_mesh(), me)


def _held_rows(info: LocalShard, q: int) -> tuple[int, int]:
    a, b = info.layout.bounds[q], info.layout.bounds[q + 1]
    if info.tp.dim == 1:
        cols = info.shape[1]
        return a // cols, b // cols
    rows, n = info.tp.global_shape[0], info.numel
    if a < b:  # (planned whole: this coordinate holds all of it)
        return 0, rows
    return (0, 0) if a == 0 and n else (rows, rows)


def run_bounds(run: TPRun, before: Callable[[int], int]) -> tuple[int, ...]:
    """Every cell's start in a global per-strip vector whose strip ``s`` starts at ``before(s)``, then
    its length: the ``StateShard.bounds`` of state the runs own."""
    return tuple(before(s0) for s0, _ in run.cells) + (before(run.geom.num_strips),)


class TPRunExchange:
    """The runs of one TP group: one ``all_to_all_single`` out (``gather``) and one back (``scatter``)
    per step, for every TP-split tensor of an optimizer that this group holds. Buffers go in the
    group's rank order, then tensor order, then field order; sizes come from the plans (every TP rank
    of the group has the same list of tensors, and the same fields per tensor each step)."""

    def __init__(self, runs: Sequence[tuple[Tensor, TPRun]]) -> None:
        self.runs = tuple(runs)
        tp = self.runs[0][1].info.tp
        self.group = tp.group
        self.rank_of = tp.group_ranks()  # each TP coordinate's rank in the group: split sizes go by it
        self.order = sorted(range(tp.size), key=lambda t: self.rank_of[t])  # TP coordinates in group-rank order
        self.size = tp.size
        self.device = self.runs[0][0].device

    def gather(self, fields: dict[Tensor, Sequence[Tensor]]) -> dict[Tensor, list[Tensor]]:
        """``fields[p]``: flat fp32 tensors of this rank's piece of ``p`` (the same count on every TP
        rank). Returns, per such ``p``, the fields of this rank's run, assembled (flat, fp32)."""
        send_sizes, recv_sizes, pieces = [0] * self.size, [0] * self.size, []
        for t in self.order:
            for p, run in self.runs:
                a, b = run.sends[t]
                for f in fields.get(p, ()):
                    pieces.append(f[a:b])
                    send_sizes[self.rank_of[t]] += b - a
        for r in self.order:
            for p, run in self.runs:
                recv_sizes[self.rank_of[r]] += len(fields.get(p, ())) * math.prod(run.parts[r])
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32, device=self.device)
        recv = torch.empty(sum(recv_sizes), dtype=torch.float32, device=self.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)
        got = {p: [[None] * self.size for _ in fs] for p, fs in fields.items()}  # [field][TP coordinate]
        at = 0
        for r in self.order:
            for p, run in self.runs:
                n = math.prod(run.parts[r])
                for parts in got.get(p, ()):
                    parts[r] = recv[at : at + n].view(run.parts[r])
                    at += n
        out = {}
        for p, run in self.runs:
            if p in got:
                dim = 1 if run.info.tp.dim == 1 else 0
                out[p] = [torch.cat(parts, dim=dim).reshape(-1) for parts in got[p]]
        return out

    def scatter(self, results: dict[Tensor, Tensor], into: dict[Tensor, Tensor]) -> None:
        """``results[p]``: the flat fp32 result of this rank's run of ``p``; every rank receives its part
        of each run of ``p`` into ``into[p]`` (its flat piece). ``p`` in neither dict carries nothing (the
        set is the same on every TP rank of the group)."""
        send_sizes, recv_sizes, pieces = [0] * self.size, [0] * self.size, []
        split = {p: _parts(results[p], run) for p, run in self.runs if p in results}
        for r in self.order:
            for p, run in self.runs:
                if p in split:
                    pieces.append(split[p][r].reshape(-1))
                    send_sizes[self.rank_of[r]] += pieces[-1].numel()
        for t in self.order:
            for p, run in self.runs:
                if p in into:
                    a, b = run.sends[t]
                    recv_sizes[self.rank_of[t]] += b - a
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32, device=self.device)
        recv = torch.empty(sum(recv_sizes), dtype=torch.float32, device=self.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)
        at = 0
        for t in self.order:
            for p, run in self.runs:
                if p in into:
                    a, b = run.sends[t]
                    into[p][a:b].copy_(recv[at : at + b - a])
                    at += b - a


def _parts(result: Tensor, run: TPRun) -> tuple[Tensor, ...]:
    """The run's result cut into each TP coordinate's part (its columns, or its rows), in TP order."""
    view = result.view(run.shape[0], run.geom.cols)
    if run.info.tp.dim == 1:
        return view.split(run.parts[0][1], dim=1)
    return view.split([rows for rows, _ in run.parts], dim=0)
