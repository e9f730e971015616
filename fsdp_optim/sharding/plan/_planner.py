"""The planner: lay out every bucket of a model so no block crosses a rank boundary.

``plan_model(buckets, world_size=W, config=...)`` returns a :class:`Plan` with one
:class:`BucketPlan` per bucket. Everything here is integer arithmetic on shapes and block
specs (no tensors, no process groups), deterministic on every rank: no hashing, no
randomness, ties broken by input position.

[Note: even layout]
An even bucket is one buffer of ``W * S`` elements, rank ``r`` owns ``[r*S, (r+1)*S)``.
For a candidate ``S`` the tensors are packed greedily, coarsest block first: a tensor that
would cross a rank boundary inside a block is shifted forward to the nearest offset at which
every boundary it crosses is a block boundary, and the gap this opens is filled with
smaller pending tensors (the finest blocks: norms, biases) before padding is left. A
tensor crossing two or more boundaries needs its block size to divide ``S``, so ``S`` is
searched (bisection) on multiples of ``lcm(align, block sizes of tensors larger than
N/W)``, from ``ceil(N/W)`` up. If keeping matrix blocks whole costs more than
``padding_cap`` (padding / parameters of the bucket), matrix tensors are made splittable
on rows, largest block first, until the padding fits under the cap; a cut matrix is
recorded as ``Placement.split``.

[Note: ragged layout and global balance]
Ragged buckets have zero padding and whole blocks only, so a ragged bucket is an order of
its tensors plus ``W + 1`` cut points at block boundaries. Balance is global: the ragged
buckets are concatenated (in bucket order) into one stream and cut into ``W`` contiguous
pieces at block boundaries near the targets ``k * R / W`` (``R`` = ragged bytes; even
buckets add the same ``S`` to every rank, so they do not disturb the balance). Each rank
then owns a contiguous slice of the model. Within a bucket the tensor order is free, and is
chosen so the cuts land near their targets: before each target the gap is filled with the
largest tensors that fit (greedy subset sum), and the tensor that must straddle the target
is the one with a block boundary nearest to it; the cut snaps to that boundary. Every cut is
then off its target by at most half of the straddling block, so per-rank bytes are within one
block of the mean. When blocks approach the mean size (dense models at W >= 256) that bound is
loose, so a second candidate is built: bisection on a per-rank capacity ``C`` in
``[max(mean, largest block), mean + largest block]``, filling ranks in order up to ``C`` (same
ordering rule, cuts snapped down); the candidate with the smaller largest rank wins (ties: the
fixed targets). ``PlanStats.bytes_lower_bound`` (``whole_block_bound`` over the mean, see
[Note: whole-block lower bound] in ``_report``) is the best any whole-block plan can do; the
benchmark reports the gap. Where every bucket is ragged, blocks stay whole and the stream's busiest
rank exceeds ``plan_model``'s step-1 goal ``max(1.02 x bound, 1.05)`` x the mean, a third candidate
drops the one-slice-per-rank stream: each bucket gets its own rank bounds, so an element-wise tensor
can fill the gaps of many ranks ([Note: per-bucket ragged packing] in ``_pour``; at most
``_POUR_PROBES`` capacities, the first at the goal); it is kept if its busiest rank is lower by
``_POUR_GAIN``. Optimizer cost comes second: with the
largest rank's bytes allowed to grow by at most ``_BYTES_SLACK`` (0.5%), a per-rank cost cap is
bisected too (a rank closes when either cap is reached; an empty rank always takes one block),
and the result is kept only if it lowers the largest rank's cost. This matters for Muon on MoE
models, whose dense-MLP matrices cost ~3.5x more per byte than expert matrices.

[Note: auto layout cost model]
Per bucket: EVEN when the even layout keeps every block whole with padding <= ``padding_cap``,
else RAGGED. Why: on NCCL the ring ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` move
``(W-1)/W`` of the buffer per rank at full bandwidth in one launch, while the uneven forms are
``W`` grouped broadcasts (one launch and latency per owner), so even wins while its padding
(extra bytes moved and stored, <= cap) is small. A split matrix costs one extra exchange of that
matrix per optimizer step (about twice its bytes), more than the padding cap allows, so any
bucket that would need a split goes ragged, where no block is cut for padding (only for balance,
below). Gloo (measured, see docs/architecture.md) runs the uneven forms no slower, so the rule never
loses there.

[Note: balance cap]
Whole blocks cannot balance once a block nears a rank's mean bytes (Llama 3 8B, Muon, W = 1024: one
MLP matrix is 7.5 ranks' worth). ``PlanStats.bytes_lower_bound`` says how far whole blocks can get: a
proven lower bound, the larger of ``max_k ceil(k / W) * size_k`` over the blocks sorted by size (the
``k`` largest share ``W`` ranks) and a bin-packing bound (see [Note: whole-block lower bound] in
``_report``). ``plan_model`` then works in three steps, each only when the previous misses:
1. the whole-block plan above; if the busiest rank exceeds ``max(1.02 * bound, 1.05)`` x the mean and
   some bucket is EVEN, the all-ragged whole-block plan too (elementwise embeddings can then fill
   the ranks that big matrices leave light), the better one kept;
2. if the busiest rank is still above ``balance_cap`` (or the bound already is: step 1 skipped),
   ``balance="auto"`` gives ragged buckets row geometries for every matrix (or ``rows(k)`` strip
   tensor: ``BlockSpec.splits_on_rows``) whose largest block
   exceeds ``(cap - 1) / 2`` of the mean (divided by 4 while the cap is missed, 3 tries): the
   ragged balance then cuts those on rows, at most ``W - 1`` cuts, so at most ``W - 1`` split
   blocks, recorded as ``Placement.split`` (Muon, Shampoo: one all_to_all pair per step). Ragged, not
   even: an even segment must be a multiple of every row length a tensor crossing two boundaries
   has (Llama 3 8B at W = 16384: padding 100%), a ragged cut needs only one row;
3. ``balance="whole"`` (optimizers that refuse split blocks) keeps step 1's plan and warns with the
   largest HSDP shard size the bound allows if its plan balances (one plan), else the largest with
   balance guaranteed (largest block <= (cap - 1 - padding_cap) x mean; ``suggest_mesh`` plans and
   prices every shard size).
``Plan.balance_note`` says which happened, with the figures.

[Note: aligned pieces]
Every tensor's piece starts on a ``PlanConfig.piece_align_bytes`` (64 B) boundary of its rank's
segment: GPU vectorized kernels need 16 B and MKL's results on AVX-512 depend on operand alignment
(Shampoo reads aligned copies otherwise). With ``q = 64 / gcd(64, itemsize)`` elements, each tensor
takes ``numel`` rounded up to a multiple of ``q`` (the tail padding belongs to its last block) and is
cut only at multiples of ``lcm(block, q)`` from its start; even segments are multiples of ``q``.
Offsets are then multiples of ``q`` in every layout, and so are all rank bounds, so a piece starts at
0 of its segment (the tensor began on an earlier rank) or at ``offset - rank bound``, a multiple of
``q``. Cost: under ``q - 1`` elements per tensor (ragged buckets now carry that padding too) and
coarser cuts in tensors whose block is not a multiple of ``q``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ._blocks import align_down, align_up
from ._plan import BucketPlan, Layout, Placement, Plan, PlanConfig, TensorSpec
from ._cost import _cost_profile, _cum_cost, _UniformCost, tensor_cost
from ._pour import pour_ragged
from ._ragged import RaggedLayout
from ._report import PlanStats, block_sizes, plan_report, plan_stats, whole_block_bound

__all__ = ["plan_model", "tensor_cost", "PlanStats", "plan_stats", "plan_report"]  # the last three re-exported from _report

# Placements keep their RaggedLayout bounds as plain tuples up to this world size; above it the
# bounds are a lazy view of the bucket's rank bounds (W * num_tensors Python ints would take
# seconds and gigabytes at W = 16384). Both behave the same through indexing and iteration.
_EAGER_BOUNDS_MAX_WORLD = 256

# ---------------------------------------------------------------------------------------
# Block geometry of one tensor (boundaries represented arithmetically)
# ---------------------------------------------------------------------------------------
class _Geom:
    """Where a tensor may be cut: every multiple of ``unit`` (uniform blocks) or the explicit
    ``starts`` (row-split matrices). ``split`` geometries cut matrices on rows."""

    __slots__ = ("numel", "unit", "starts", "max_block", "split")

    def __init__(self, ts: TensorSpec, *, split: bool = False, quantum: int = 1):
        """``quantum`` (elements): the tensor takes ``numel`` rounded up to a multiple of it, and is
        cut only at multiples of it (see [Note: aligned pieces])."""
        shape, spec = ts.shape, ts.spec
        self.split = split
        self.numel = math.prod(shape)
        self.starts: list[int] | None = None
        if split:
            self.unit = max(spec.split_unit(shape), 1)
        elif spec.is_uniform:
            self.unit = spec.unit(shape)
        else:
            self.unit = 0
            self.starts = spec.block_starts(shape)
        if ts.align_rows is not None and self.numel:
            # Also a multiple of ``align_rows`` rows: the common coarsening of the two specs.
            row = math.prod(shape[1:]) if len(shape) >= 1 else 1
            tile = ts.align_rows * row  # (not ``quantum``: the piece alignment below pads by that alone)
            if self.starts is not None:
                self.starts = [s for s in self.starts if s % tile == 0 or s == self.numel]
            elif self.unit < self.numel:
                self.unit = math.lcm(self.unit, tile)
        if quantum > 1 and self.numel:
            span = -(-self.numel // quantum) * quantum
            if self.starts is not None:
                self.starts = [s for s in self.starts if s % quantum == 0 and s < self.numel] + [span]
            else:
                self.unit = span if self.unit >= self.numel else math.lcm(self.unit, quantum)
            self.numel = span  # the padding after the data belongs to the last block
        if self.starts is not None:
            self.max_block = max((b - a for a, b in zip(self.starts, self.starts[1:])), default=0)
        else:
            self.max_block = min(self.unit, self.numel)

    def align_down(self, x: int) -> int:
        """Largest block boundary <= x (0 and numel are boundaries)."""
        return align_down(x, self.numel, self.unit, self.starts)

    def align_up(self, x: int) -> int:
        return align_up(x, self.numel, self.unit, self.starts)

    def is_boundary(self, x: int) -> bool:
        return self.align_down(x) == x

    def crossings_ok(self, offset: int, seg: int) -> bool:
        """Every boundary ``k*seg`` strictly inside ``(offset, offset + numel)`` is a block boundary."""
        end = offset + self.numel
        first = (offset // seg + 1) * seg
        if first >= end:
            return True
        if not self.is_boundary(first - offset):
            return False
        if first + seg >= end:
            return True
        if self.starts is None:
            return seg % self.unit == 0
        b = first + seg
        while b < end:  # explicit blocks: few; fails fast once boundaries outnumber blocks
            if not self.is_boundary(b - offset):
                return False
            b += seg
        return True


# ---------------------------------------------------------------------------------------
# Even layout
# ---------------------------------------------------------------------------------------
def _first_offset(g: _Geom, pos: int, seg: int) -> int | None:
    """Smallest offset >= pos at which ``g`` crosses rank boundaries only between blocks."""
    if g.numel == 0:
        return pos
    nxt = (pos // seg + 1) * seg
    if pos + g.numel <= nxt:
        return pos
    o = nxt - g.align_down(nxt - pos)
    if g.crossings_ok(o, seg):
        return o
    if o != nxt and g.crossings_ok(nxt, seg):
        return nxt
    return None


def _fill_gap(geoms: list[_Geom], pending: list[int], offsets: list[int], pos: int, gap: int, *, skip_empty: bool) -> int:
    """Place the tensors of ``pending`` that fit wholly into ``gap`` elements from ``pos``, in
    ``pending``'s order (largest first: a greedy subset sum); placed ones leave ``pending`` and get their
    ``offsets``. ``skip_empty``: empty tensors are left pending. Returns the position after them."""
    j = 0
    while gap > 0 and j < len(pending):
        k = pending[j]
        n = geoms[k].numel
        if n <= gap and not (skip_empty and n == 0):
            offsets[k] = pos
            pos, gap = pos + n, gap - n
            pending.pop(j)
        else:
            j += 1
    return pos


def _pack_even(geoms: list[_Geom], order: list[int], seg: int, world_size: int) -> list[int] | None:
    """Offsets of the tensors packed into ``world_size`` segments of ``seg`` elements, or None."""
    limit = world_size * seg
    offsets = [0] * len(geoms)
    pending = list(order)  # coarsest first; the tail (finest) fills gaps
    pos = 0
    while pending:
        i = pending.pop(0)
        o = _first_offset(geoms[i], pos, seg)
        if o is None:
            return None
        if o > pos:  # fill the gap with the largest pending tensors that fit entirely
            pos = _fill_gap(geoms, pending, offsets, pos, o - pos, skip_empty=True)
        offsets[i] = o
        pos = o + geoms[i].numel
        if pos > limit:
            return None
    return offsets


def _even_layout(
    geoms: list[_Geom], world_size: int, align: int
) -> tuple[int, list[int]]:
    """Smallest segment size found (see [Note: even layout]) and the tensor offsets."""
    n = sum(g.numel for g in geoms)
    if n == 0:
        return 0, [0] * len(geoms)
    # coarsest block first, then largest, then input order (deterministic)
    order = sorted(range(len(geoms)), key=lambda i: (-geoms[i].max_block, -geoms[i].numel, i))
    lo = max(-(-n // world_size), max(g.max_block for g in geoms), 1)
    step = align
    for g in geoms:
        if g.starts is None and g.numel > lo and g.unit > 1:
            cand = math.lcm(step, g.unit)
            if cand <= n:
                step = cand
    lo_a = -(-lo // align) * align
    # 1) a few sizes just above the lower bound (tensors crossing at most one boundary need no lcm)
    for seg in range(lo_a, lo_a + _SCAN * align, align):
        offs = _pack_even(geoms, order, seg, world_size)
        if offs is not None:
            return seg, offs
    # 2) bisection on multiples of ``step`` (where tensors crossing many boundaries stay aligned)
    lo_k = -(-lo // step)
    hi_k = -(-(n + sum(g.max_block for g in geoms)) // step)  # everything fits in the first segment
    best = (hi_k * step, _pack_even(geoms, order, hi_k * step, world_size))
    if best[1] is None:  # unreachable: at hi no tensor crosses a boundary
        raise AssertionError("even packing failed at its upper bound")
    best = _bisect_seg(geoms, order, world_size, lo_k - 1, hi_k, step, best)
    # 3) bisection on multiples of ``align`` below that (feasibility is not monotone: keep the best found)
    if step != align:
        best = _bisect_seg(geoms, order, world_size, lo_a // align - 1, best[0] // align, align, best)
    return best


_SCAN = 16
"""Even layout: segment sizes tried one by one above the lower bound before bisecting."""


def _bisect_seg(geoms, order, world_size, lo_k: int, hi_k: int, step: int, best):
    """Smallest feasible ``k * step`` in ``(lo_k, hi_k]`` found by bisection (hi_k known feasible)."""
    while hi_k - lo_k > 1:
        mid = (lo_k + hi_k) // 2
        offs = _pack_even(geoms, order, mid * step, world_size)
        if offs is None:
            lo_k = mid
        else:
            hi_k = mid
            if mid * step < best[0]:
                best = (mid * step, offs)
    return best


class _EvenResult(NamedTuple):
    seg: int
    offsets: list[int]
    split: list[bool]  # tensor made splittable (its matrices may be cut on rows)
    padding: int


def _quantum(config: PlanConfig, itemsize: int) -> int:
    """Elements per ``config.piece_align_bytes`` (see [Note: aligned pieces])."""
    return config.piece_align_bytes // math.gcd(config.piece_align_bytes, itemsize)


def _plan_even(specs: Sequence[TensorSpec], world_size: int, config: PlanConfig, *, allow_split: bool) -> _EvenResult:
    n = sum(ts.numel for ts in specs)
    split = [False] * len(specs)
    q = _quantum(config, specs[0].itemsize) if specs else 1
    geoms = [_Geom(ts, quantum=q) for ts in specs]
    align = math.lcm(config.align, q)
    seg, offs = _even_layout(geoms, world_size, align)
    res = _EvenResult(seg, offs, list(split), world_size * seg - n)
    if not allow_split or res.padding <= config.padding_cap * n:
        return res
    # make matrix tensors splittable on rows, largest block first, until under the cap
    sizes = sorted({geoms[i].max_block for i, ts in enumerate(specs) if ts.spec.is_matrix and ts.numel}, reverse=True)
    for th in sizes:
        for i, ts in enumerate(specs):
            if ts.spec.is_matrix and ts.numel and not split[i] and geoms[i].max_block >= th:
                split[i] = True
                geoms[i] = _Geom(ts, split=True, quantum=q)
        seg, offs = _even_layout(geoms, world_size, align)
        cand = _EvenResult(seg, offs, list(split), world_size * seg - n)
        if cand.padding < res.padding:
            res = cand
        if res.padding <= config.padding_cap * n:
            break
    return res


# ---------------------------------------------------------------------------------------
# Ragged layout: order + cuts within a bucket
# ---------------------------------------------------------------------------------------
def _order_and_cut(geoms: list[_Geom], costs: list[float], targets: list[int]) -> tuple[list[int], list[int]]:
    """Order the bucket's tensors and place one cut (a block boundary) per local target.

    Returns ``(offsets, cuts)``; ``cuts`` is non-decreasing and as long as ``targets``.
    See [Note: ragged layout and global balance].
    """
    n = len(geoms)
    offsets = [0] * n
    remaining = sorted(range(n), key=lambda i: (-geoms[i].numel, i))  # largest first
    cuts: list[int] = []
    pos = 0
    ti = 0
    nt = len(targets)
    while ti < nt:
        p = targets[ti]
        pos = _fill_gap(geoms, remaining, offsets, pos, p - pos, skip_empty=False)
        gap = p - pos
        if gap <= 0 or not remaining:  # the prefix hits the target (or the bucket is used up)
            cuts.append(pos)
            ti += 1
            continue
        # the target falls inside the next tensor: take the one with a boundary nearest to it,
        # ties to the cheaper optimizer cost, then input order
        best, best_key = -1, None
        for k in remaining:
            off = p - pos
            d, u = geoms[k].align_down(off), geoms[k].align_up(off)
            key = (min(off - d, u - off), costs[k], k)
            if best_key is None or key < best_key:
                best, best_key = k, key
        remaining.remove(best)
        g = geoms[best]
        offsets[best] = pos
        end = pos + g.numel
        while ti < nt and targets[ti] < end:
            off = targets[ti] - pos
            d, u = g.align_down(off), g.align_up(off)
            c = pos + (d if off - d <= u - off else u)
            cuts.append(max(c, cuts[-1] if cuts else 0))
            ti += 1
        pos = end
    for k in sorted(remaining):  # after the last cut: input order
        offsets[k] = pos
        pos += geoms[k].numel
    return offsets, cuts


_CAP_BISECT_STEPS = 24
"""Ragged balance: bisection steps on the per-rank capacity (stops early at 1/1024 of the mean)."""


_COST_BISECT_STEPS = 12
"""Ragged balance, second objective: bisection steps on the per-rank optimizer cost cap."""
_BYTES_SLACK = 0.005
"""Cost balancing may raise the largest rank's bytes by at most this fraction."""


def _largest_block_cost(prof) -> float:
    if isinstance(prof, _UniformCost):
        return max(prof.full, prof.last) if prof.num_blocks else 0.0
    cum = prof[1]
    return max((b - a for a, b in zip(cum, cum[1:])), default=0.0)


def _max_rank_cost(rag, glob_cuts: list[int], offs_list: list[list[int]], w: int) -> float:
    """Largest per-rank optimizer cost of a ragged assignment."""
    cost = [0.0] * w
    for (s, geoms, _, profs, isz), offs in zip(rag, offs_list):
        for g, prof, o in zip(geoms, profs, offs):
            if g.numel == 0:
                continue
            lo_b, hi_b = s + o * isz, s + (o + g.numel) * isz
            r0 = max(bisect.bisect_right(glob_cuts, lo_b) - 1, 0)
            r1 = min(max(bisect.bisect_left(glob_cuts, hi_b), r0 + 1), w)
            if r1 - r0 > 16:  # a tensor over many ranks: vectorized
                x = np.clip((np.asarray(glob_cuts[r0 : r1 + 1], dtype=np.int64) - lo_b) // isz, 0, g.numel)
                for r, c in enumerate(np.diff(_cum_cost(prof, g.numel, x)).tolist(), start=r0):
                    cost[r] += c
                continue
            prev = 0.0
            for r in range(r0, r1):
                x = min(max((glob_cuts[r + 1] - lo_b) // isz, 0), g.numel)
                cur = _cum1(prof, g.numel, x)
                cost[r] += cur - prev
                prev = cur
    return max(cost) if w else 0.0


def _ragged_fixed_targets(rag, total_b: int, w: int):
    """Cuts near the fixed targets ``k * R / W`` (global byte offsets) and per-bucket offsets."""
    targets = [k * total_b // w for k in range(1, w)]
    glob_cuts = [0] * (w + 1)
    glob_cuts[w] = total_b
    offs_list = []
    k = 0
    for s, geoms, costs, _, isz in rag:
        nb = sum(g.numel for g in geoms) * isz
        k1 = bisect.bisect_left(targets, s + nb, lo=k)
        local = [(t - s + isz // 2) // isz for t in targets[k:k1]]
        offs, cuts = _order_and_cut(geoms, costs, local)
        offs_list.append(offs)
        for j, c in enumerate(cuts):
            glob_cuts[k + j + 1] = s + c * isz
        k = k1
    return glob_cuts, offs_list


def _cum1(prof, numel: int, x: int) -> float:
    """Scalar ``_cum_cost``: optimizer cost of elements ``[0, x)`` of a tensor."""
    if isinstance(prof, _UniformCost):
        if prof.num_blocks == 0:
            return 0.0
        last_start = (prof.num_blocks - 1) * prof.unit
        if x < last_start:
            return x / prof.unit * prof.full
        return (prof.num_blocks - 1) * prof.full + (x - last_start) / (numel - last_start) * prof.last
    starts, cum = prof
    i = bisect.bisect_right(starts, x) - 1
    if i >= len(starts) - 1:
        return cum[-1]
    return cum[i] + (x - starts[i]) / (starts[i + 1] - starts[i]) * (cum[i + 1] - cum[i])


def _fit(g: _Geom, prof, a: int, budget_e: int, budget_c: float) -> int:
    """Largest block boundary ``x >= a`` with ``x - a <= budget_e`` elements and cost(a, x) <= budget_c."""
    x = g.align_down(a + max(budget_e, 0))
    if budget_c == math.inf or x == a:
        return x
    if isinstance(prof, _UniformCost) and g.starts is None:
        if prof.full <= 0:
            return x
        blocks = int(max(budget_c, 0.0) // prof.full)  # the partial last block costs <= a full one
        return min(x, a + blocks * g.unit, g.numel)
    base = _cum1(prof, g.numel, a)
    while x > a and _cum1(prof, g.numel, x) - base > budget_c * (1 + 1e-12):
        x = g.align_down(x - 1)
    return x


def _ragged_capacity(rag, total_b: int, w: int, cap: int, cost_cap: float = math.inf):
    """Fill ranks in order up to ``cap`` bytes and ``cost_cap`` optimizer cost each (cuts snap down
    to block boundaries; a rank takes at least one block; the tensor order per bucket is chosen as
    in ``_order_and_cut``). Returns ``(global cuts, offsets per bucket, largest rank cost)``, or None
    if W ranks do not suffice. (90 lines: one greedy pass whose loop state, the open rank's bytes and
    cost, crosses bucket and tensor boundaries; split up, it would pass that state around for nothing.)"""
    cuts_b: list[int] = []
    offs_list = []
    cur_b, cur_c, max_c = 0, 0.0, 0.0  # bytes and cost of the open rank; largest closed rank cost

    def close(cb: int) -> None:
        nonlocal cur_b, cur_c, max_c
        cuts_b.append(cb)
        max_c = max(max_c, cur_c)
        cur_b, cur_c = 0, 0.0

    for s, geoms, costs, profs, isz in rag:
        offsets = [0] * len(geoms)
        remaining = sorted(range(len(geoms)), key=lambda i: (-geoms[i].numel, i))
        pos = 0
        cap_e = cap // isz
        while remaining:
            if len(cuts_b) >= w - 1:  # the last rank takes the rest
                for k in sorted(remaining):
                    offsets[k] = pos
                    pos += geoms[k].numel
                    cur_b += geoms[k].numel * isz
                    cur_c += costs[k]
                break
            gap_e, gap_c = (cap - cur_b) // isz, cost_cap - cur_c
            j = 0
            while j < len(remaining):  # greedy subset sum: largest whole tensors that fit
                k = remaining[j]
                if geoms[k].numel <= gap_e and costs[k] <= gap_c:
                    offsets[k] = pos
                    pos += geoms[k].numel
                    gap_e -= geoms[k].numel
                    gap_c -= costs[k]
                    cur_b += geoms[k].numel * isz
                    cur_c += costs[k]
                    remaining.pop(j)
                else:
                    j += 1
            if not remaining:
                break
            # the tensor that straddles the cut: its leading blocks fill the rank most
            fits = {k: _fit(geoms[k], profs[k], 0, gap_e, gap_c) for k in remaining}
            best = min(remaining, key=lambda k: (-fits[k], costs[k], k))
            remaining.remove(best)
            g, prof, a = geoms[best], profs[best], fits[best]
            offsets[best] = pos
            if a == 0 and cur_b == 0:  # an empty rank takes one block even above the cost cap
                a = g.align_up(1)
                if a * isz > cap:
                    return None
            cur_c += _cum1(prof, g.numel, a)
            close(s + (pos + a) * isz)
            # the following ranks inside this tensor
            while a < g.numel:
                rest_c = costs[best] - _cum1(prof, g.numel, a)
                if len(cuts_b) >= w - 1 or ((g.numel - a) <= cap_e and rest_c <= cost_cap):
                    cur_b, cur_c = (g.numel - a) * isz, rest_c
                    break
                if g.starts is None and isinstance(prof, _UniformCost):  # arithmetic progression
                    per = cap_e // g.unit
                    if cost_cap != math.inf and prof.full > 0:
                        per = min(per, int(cost_cap // prof.full))
                    step = max(per, 1) * g.unit
                    if step * isz > cap:
                        return None
                    num = min(-(-(g.numel - a) // step) - 1, w - 1 - len(cuts_b))
                    if num > 0:
                        max_c = max(max_c, min(step, g.numel - a) / g.unit * prof.full)
                        cuts_b.extend(range(s + (pos + a + step) * isz, s + (pos + a + (num + 1) * step) * isz, step * isz))
                        a += num * step
                        continue
                x = _fit(g, prof, a, cap_e, cost_cap)
                if x == a:
                    x = g.align_up(a + 1)
                    if (x - a) * isz > cap:
                        return None
                cur_c = _cum1(prof, g.numel, x) - _cum1(prof, g.numel, a)
                close(s + (pos + x) * isz)
                a = x
            pos += g.numel
        offs_list.append(offsets)
    if total_b - (cuts_b[-1] if cuts_b else 0) > cap or cur_c > cost_cap * (1 + 1e-9) and len(cuts_b) >= w - 1:
        return None
    max_c = max(max_c, cur_c)
    cuts_b += [total_b] * (w - 1 - len(cuts_b))
    return [0, *cuts_b, total_b], offs_list, max_c


# ---------------------------------------------------------------------------------------
# Per-tensor bounds (eager tuple, or lazy for huge W)
# ---------------------------------------------------------------------------------------
class _ClippedBounds(Sequence):
    """``clip(rank_bounds[r] - offset, 0, numel)`` for r in 0..W, computed on access."""

    __slots__ = ("_rb", "_offset", "_numel")

    def __init__(self, rank_bounds: tuple[int, ...], offset: int, numel: int):
        self._rb, self._offset, self._numel = rank_bounds, offset, numel

    def __len__(self) -> int:
        return len(self._rb)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(min(max(b - self._offset, 0), self._numel) for b in self._rb[i])
        return min(max(self._rb[i] - self._offset, 0), self._numel)

    def __iter__(self):
        o, n = self._offset, self._numel
        return (min(max(b - o, 0), n) for b in self._rb)

    def __eq__(self, other) -> bool:
        try:
            return tuple(self) == tuple(other)
        except TypeError:
            return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def inner(self) -> list[int]:
        """The distinct values strictly between 0 and numel, ascending (O(log W + count))."""
        rb, o, n = self._rb, self._offset, self._numel
        lo, hi = bisect.bisect_right(rb, o), bisect.bisect_left(rb, o + n)
        return sorted({b - o for b in rb[lo:hi]})

    def __repr__(self) -> str:
        return f"_ClippedBounds(offset={self._offset}, numel={self._numel}, world_size={len(self) - 1})"


def _make_shard(shape: tuple[int, ...], rank_bounds: tuple[int, ...], rb_np: np.ndarray, offset: int) -> RaggedLayout:
    numel = math.prod(shape)
    w = len(rank_bounds) - 1
    if w <= _EAGER_BOUNDS_MAX_WORLD:
        bounds = tuple(np.clip(rb_np - offset, 0, numel).tolist())
    else:
        bounds = _ClippedBounds(rank_bounds, offset, numel)
    # Valid by construction (rank bounds rise from 0 to >= offset + numel: clipped, they rise from 0
    # to numel), so skip RaggedLayout's O(W) validation; BucketPlan.check() re-verifies in the tests.
    shard = object.__new__(RaggedLayout)
    object.__setattr__(shard, "shape", tuple(int(s) for s in shape))
    object.__setattr__(shard, "bounds", bounds)
    return shard


# ---------------------------------------------------------------------------------------
# The model planner
# ---------------------------------------------------------------------------------------
def _validate(buckets, world_size: int, config: PlanConfig) -> list[tuple[str, list[TensorSpec], int]]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(config, PlanConfig):
        raise ValueError(f"config must be a PlanConfig, got {type(config).__name__}")
    out = []
    for bi, bucket in enumerate(buckets):
        try:
            name, specs = bucket
        except (TypeError, ValueError):
            raise ValueError(f"bucket {bi} must be a (name, [TensorSpec, ...]) pair, got {bucket!r}") from None
        specs = list(specs)
        itemsizes = set()
        for ts in specs:
            if not isinstance(ts, TensorSpec):
                raise ValueError(f"bucket {name!r}: expected TensorSpec entries, got {type(ts).__name__}")
            if any((not isinstance(d, int)) or d < 0 for d in ts.shape):
                raise ValueError(f"bucket {name!r}: {ts.name} has an invalid shape {ts.shape}")
            ts.spec.check(ts.shape, ts.name)
            itemsizes.add(ts.itemsize)
        if len(itemsizes) > 1:
            raise ValueError(
                f"bucket {name!r} mixes element sizes {sorted(itemsizes)} (bytes); one bucket is one flat "
                "buffer of one dtype: put tensors of different dtypes in different buckets"
            )
        out.append((str(name), specs, itemsizes.pop() if itemsizes else 4))
    return out


def plan_model(
    buckets: Sequence[tuple[str, Sequence[TensorSpec]]],
    *,
    world_size: int,
    config: PlanConfig = PlanConfig(),
) -> Plan:
    """Lay out every bucket over ``world_size`` ranks, balancing bytes over the whole model.

    ``buckets``: ``(name, tensor specs)`` per communication unit, in execution order.
    Each bucket is EVEN or RAGGED (``config.layout``; ``"auto"`` picks per bucket, see
    [Note: auto layout cost model]); blocks stay whole unless the balance cap needs a split (see
    [Note: balance cap]). Deterministic: the same input gives the same plan on every rank. Every
    returned ``BucketPlan`` passes ``BucketPlan.check()``.
    """
    t0 = time.perf_counter()
    items = _validate(buckets, world_size, config)
    w, hsdp = world_size, None
    param_b = sum(ts.numel * isz for _, specs, isz in items for ts in specs)
    if w == 1 or param_b == 0:
        return Plan(world_size=w, buckets=_layout(items, w, config), config=config, seconds=time.perf_counter() - t0)
    mean, cap = param_b / w, config.balance_cap
    lb = max(1.0, _lower_bound(items, w) / mean)
    can_split = config.balance == "auto" and _has_matrix(items)
    if can_split and lb > cap:  # no whole-block plan can meet the cap: split straight away
        out, note = _split_for_balance(items, w, config, mean, f"whole blocks cannot: lower bound {lb:.3f}")
        return Plan(world_size=w, buckets=out, config=config, seconds=time.perf_counter() - t0, balance_note=note)
    chosen = _choose_layouts(items, w, config)
    goal = int(max(1.02 * lb, 1.05) * mean)  # what step 1 aims for (see [Note: balance cap])
    out = _layout(items, w, config, chosen=chosen, goal=goal)
    ratio = _busiest(out) / mean
    if lb <= cap and ratio > max(1.02 * lb, 1.05) and config.layout == "auto" and any(b.layout is Layout.EVEN for b in out):
        # even buckets add the same bytes to every rank; ragged ones can fill the ranks that whole
        # blocks leave light (elementwise embeddings beside the MLP matrices)
        alt = _layout(items, w, dataclasses.replace(config, layout="ragged"), goal=goal)
        if _busiest(alt) / mean < ratio:
            out, ratio = alt, _busiest(alt) / mean
    if ratio <= cap:
        note = f"whole blocks: busiest rank {ratio:.3f} x the mean (lower bound {lb:.3f}, cap {cap:.2f}), none split"
    elif not can_split:
        shard = hsdp = _balancing_shard_size(items, w, config)
        note = (
            f"whole blocks: busiest rank {ratio:.3f} x the mean, above balance_cap {cap:.2f} (whole-block lower "
            f"bound {lb:.3f}); "
            + (
                f"an HSDP shard size of {shard} (replicate x {w // shard}) balances within the cap "
                f"(fsdp-optim plan --suggest prices every shard size)"
                if shard
                else "no HSDP shard size dividing the world size balances within the cap"
            )
        )
        if config.balance == "whole":
            warnings.warn(f"PlanConfig(balance='whole'): {note}", stacklevel=2)
    else:
        split, note = _split_for_balance(items, w, config, mean, f"whole blocks gave {ratio:.3f} (lower bound {lb:.3f})",
                                         chosen=chosen)  # fmt: skip
        if _busiest(split) < _busiest(out):
            out = split
        else:
            note = f"whole blocks: busiest rank {ratio:.3f} x the mean, above balance_cap {cap:.2f}; splitting did not help"
    return Plan(world_size=w, buckets=out, config=config, seconds=time.perf_counter() - t0, balance_note=note,
                balance_shard_size=hsdp)  # fmt: skip


def _busiest(bucket_plans: Sequence[BucketPlan]) -> int:
    """Bytes of the busiest rank (padding included) over all buckets."""
    tot = np.zeros(bucket_plans[0].world_size if bucket_plans else 1, dtype=np.int64)
    for b in bucket_plans:
        tot += np.diff(np.asarray(b.rank_bounds, dtype=np.int64)) * b.itemsize
    return int(tot.max())


def _has_matrix(items) -> bool:
    return any(ts.spec.splits_on_rows and ts.numel for _, specs, _ in items for ts in specs)


def _sizes(items) -> dict[int, int]:
    """``{block bytes: count}`` of the planner's input (for ``whole_block_bound``)."""
    sizes: dict[int, int] = {}
    for _, specs, isz in items:
        for ts in specs:
            for n, c in block_sizes(ts.shape, ts.spec).items():
                sizes[n * isz] = sizes.get(n * isz, 0) + c
    return sizes


def _lower_bound(items, w: int) -> int:
    """``whole_block_bound`` of the planner's input (bytes)."""
    return whole_block_bound(_sizes(items), w)


def _balancing_shard_size(items, w: int, config: PlanConfig) -> int | None:
    """An HSDP shard size (a divisor ``s < w``: plan over ``s`` ranks, replicate ``w / s`` times) whose
    whole-block plan balances within the cap, or None. The largest divisor that the whole-block bound
    allows is planned (one plan); if it misses, the largest divisor whose balance is guaranteed: the
    ragged fill puts at most the mean plus one largest block on a rank (plus the even buckets'
    padding, at most ``padding_cap``), so ``largest block <= (cap - 1 - padding_cap) x mean`` suffices."""
    param_b = sum(ts.numel * isz for _, specs, isz in items for ts in specs)
    sizes = _sizes(items)
    biggest = max(sizes, default=0)
    divisors = sorted((d for d in range(1, w) if w % d == 0), reverse=True)
    first = next((s for s in divisors if whole_block_bound(sizes, s) * s <= config.balance_cap * param_b), None)
    if first is None:
        return None
    if first == 1 or _busiest(_layout(items, first, config)) * first <= config.balance_cap * param_b:
        return first
    slack = config.balance_cap - 1.0 - config.padding_cap
    return next((s for s in divisors if s < first and biggest * s <= slack * param_b), None)


def _split_for_balance(items, w: int, config: PlanConfig, mean: float, why: str, *, chosen=None):
    """``balance="auto"`` when whole blocks miss the cap: ragged buckets may cut matrix blocks larger
    than a threshold on rows (the threshold divided by 4 until the plan fits the cap, at most
    ``_SPLIT_TRIES`` plans). Returns ``(bucket plans, note)``: the plan with the least busy rank."""
    cap = config.balance_cap
    best, best_ratio = None, math.inf
    threshold = int((cap - 1.0) / 2 * mean)
    for _ in range(_SPLIT_TRIES):
        chosen = chosen or _choose_layouts(items, w, config)
        cand = _layout(items, w, config, split_above=max(threshold, 1), chosen=chosen)
        ratio = _busiest(cand) / mean
        if ratio < best_ratio:
            best, best_ratio = cand, ratio
        if ratio <= cap:
            break
        threshold //= 4
    n_split = sum(len(p.split_matrices()) for b in best for p in b.placements if p.split)
    return best, (
        f"split {n_split} matrix blocks on rows (Muon and Shampoo exchange them: one all_to_all pair per step): busiest rank "
        f"{best_ratio:.3f} x the mean (cap {cap:.2f}); {why}; PlanConfig(balance='whole') keeps blocks whole"
    )


_SPLIT_TRIES = 3
"""Balance cap: split plans tried (threshold on block bytes divided by 4 after each miss)."""


def _layout(items, w: int, config: PlanConfig, *, split_above: int | None = None, chosen=None,
            goal: int = 0) -> tuple[BucketPlan, ...]:
    """The bucket plans: layout per bucket, global ragged balance, materialized placements.
    ``split_above`` (bytes): ragged buckets may cut matrix blocks larger than this on rows.
    ``goal`` (bytes, 0: off): with whole blocks and every bucket ragged, the per-rank bytes the per-bucket
    packing aims for first when the stream packing's busiest rank exceeds it.
    ``chosen``: ``_choose_layouts(items, w, config)`` when already computed (it is pure)."""
    layouts, evens = chosen or _choose_layouts(items, w, config)
    ragged_idx = [i for i, lay in enumerate(layouts) if lay is Layout.RAGGED]
    starts_b, total_b, rag = {}, 0, []
    for i in ragged_idx:  # a bucket spans its tensors' elements, each rounded up to the alignment quantum
        starts_b[i] = total_b
        rag.append(_ragged_item(items[i], total_b, split_above, _quantum(config, items[i][2])))
        total_b += sum(g.numel for g in rag[-1][1]) * items[i][2]
    glob_cuts, offs_list = _balance_ragged(rag, total_b, w)
    glob = np.asarray(glob_cuts, dtype=np.int64)  # non-decreasing within a bucket, buckets in order
    spans = [sum(g.numel for g in r[1]) for r in rag]
    bounds = [np.clip(glob - r[0], 0, span * r[4]) // r[4] for r, span in zip(rag, spans)]
    if split_above is None and goal and len(rag) == len(items):
        # whole blocks, every bucket ragged (plan_model replans all-ragged when a mixed plan misses):
        # the per-bucket packing may balance better
        bounds, offs_list = _pour_if_better(rag, total_b, w, glob_cuts, bounds, offs_list, goal)
    ragged = {i: (offs, [g.split for g in r[1]], rb) for i, offs, r, rb in zip(ragged_idx, offs_list, rag, bounds)}
    out: list[BucketPlan] = []
    for i, (name, specs, isz) in enumerate(items):
        if layouts[i] is Layout.EVEN:
            ev = evens[i]
            rb_np = np.arange(w + 1, dtype=np.int64) * ev.seg
            offsets, splits = ev.offsets, ev.split
        else:
            offsets, splits, rb_np = ragged[i]
        out.append(_materialize(name, specs, isz, layouts[i], rb_np, offsets, splits))
    return tuple(out)


def _choose_layouts(items, w: int, config: PlanConfig) -> tuple[list[Layout], list[_EvenResult | None]]:
    """Per bucket: EVEN or RAGGED (see [Note: auto layout cost model]) and the even packing."""
    layouts: list[Layout] = []
    evens: list[_EvenResult | None] = []
    for _, specs, _ in items:
        if config.layout == "ragged":
            layouts.append(Layout.RAGGED)
            evens.append(None)
            continue
        n = sum(ts.numel for ts in specs)
        if config.layout == "even":
            layouts.append(Layout.EVEN)
            evens.append(_plan_even(specs, w, config, allow_split=True))
            continue
        res = _plan_even(specs, w, config, allow_split=False)
        if res.padding <= config.padding_cap * n:
            layouts.append(Layout.EVEN)
            evens.append(res)
        else:
            layouts.append(Layout.RAGGED)
            evens.append(None)
    return layouts, evens


def _ragged_item(item, start_b: int, split_above: int | None, quantum: int):
    """``(start byte, geometries, costs, cost profiles, itemsize)`` of one ragged bucket; matrix
    tensors whose largest block exceeds ``split_above`` bytes get row geometries (and a cost spread
    evenly over their rows)."""
    _, specs, isz = item
    geoms, profs = [], []
    for ts in specs:
        g = _Geom(ts, quantum=quantum)
        if split_above is not None and ts.spec.splits_on_rows and ts.numel and g.max_block * isz > split_above:
            g = _Geom(ts, split=True, quantum=quantum)
            rows_ = g.numel // g.unit
            c = tensor_cost(ts.shape, ts.spec) / max(rows_, 1)
            profs.append(_UniformCost(g.unit, rows_, c, c))
        else:
            profs.append(_cost_profile(ts.shape, ts.spec))
        geoms.append(g)
    return start_b, geoms, [tensor_cost(ts.shape, ts.spec) for ts in specs], profs, isz


def _balance_ragged(rag, total_b: int, w: int) -> tuple[list[int], list[list[int]]]:
    """Global cuts (bytes) and per-bucket tensor offsets of the ragged buckets: see
    [Note: ragged layout and global balance]."""
    glob_cuts, offs_list = _ragged_fixed_targets(rag, total_b, w)
    if w <= 1 or not rag:
        return glob_cuts, offs_list
    # second candidate: smallest capacity per rank found by bisection (greedy fill, snap down);
    # keep whichever has the smaller largest rank (ties: the fixed targets)
    biggest = max((g.max_block * isz for _, gs, _, _, isz in rag for g in gs), default=0)
    lo, hi = max(-(-total_b // w), biggest), -(-total_b // w) + biggest
    best_max = max(b - a for a, b in zip(glob_cuts, glob_cuts[1:]))
    if best_max > lo:
        hi = min(hi, best_max)
        found = None
        for _ in range(_CAP_BISECT_STEPS):
            if hi - lo <= max(1, total_b // (w * 1024)):
                break
            mid = (lo + hi) // 2
            res = _ragged_capacity(rag, total_b, w, mid)
            if res is None:
                lo = mid
            else:
                hi, found = mid, res
        if found is not None and max(b - a for a, b in zip(found[0], found[0][1:])) < best_max:
            glob_cuts, offs_list = found[0], found[1]
    if _COST_BISECT_STEPS:
        glob_cuts, offs_list = _balance_cost(rag, total_b, w, glob_cuts, offs_list)
    return glob_cuts, offs_list


def _pour_if_better(rag, total_b: int, w: int, glob_cuts, bounds, offs_list, goal: int):
    """The per-bucket packing ([Note: per-bucket ragged packing]) with the smallest capacity found in at
    most ``_POUR_PROBES`` packings (the first at ``goal`` bytes, then bisection), if its busiest rank holds
    clearly fewer bytes than the stream packing's (which balances the optimizer cost too) and, where the
    stream packing already meets ``goal``, a lower largest per-rank optimizer cost; else the stream
    packing's ``(bounds, offsets)``."""
    cur = max(b - a for a, b in zip(glob_cuts, glob_cuts[1:])) if w > 1 and rag else 0
    biggest = max((g.max_block * isz for _, gs, _, _, isz in rag for g in gs), default=0)
    lo = max(-(-total_b // w), biggest)
    hi = int(cur / (1 + _POUR_GAIN))
    if hi <= lo:
        return bounds, offs_list
    lo, found = lo - 1, None
    mid = min(max(goal, lo + 1), hi)
    for _ in range(_POUR_PROBES):
        res = pour_ragged(rag, w, mid)
        if res is None:
            lo = mid
        else:
            hi, found = min(mid, res[2]), res
        if hi - lo <= max(1, total_b // (w * 1024)) or (found is None and mid == hi):
            break
        mid = (lo + hi) // 2 if found is not None or hi - mid <= mid - lo else mid + (hi - mid) // 2
        mid = (lo + hi) // 2 if found is None and mid <= lo else mid
    if found is None:
        return bounds, offs_list
    if cur <= goal and _max_cost_bounds(rag, found[0], found[1], w) >= _max_rank_cost(rag, glob_cuts, offs_list, w):
        return bounds, offs_list  # both meet the goal: the stream's balanced optimizer cost wins
    return list(found[0]), found[1]


def _max_cost_bounds(rag, bounds, offs_list, w: int) -> float:
    """Largest per-rank optimizer cost of ragged buckets laid out by per-bucket rank bounds (elements)."""
    cost = np.zeros(w, dtype=np.float64)
    for (_, geoms, _, profs, _), rb, offs in zip(rag, bounds, offs_list):
        rb = np.asarray(rb, dtype=np.int64)
        for g, prof, o in zip(geoms, profs, offs):
            if g.numel == 0:
                continue
            r0 = max(int(np.searchsorted(rb, o, side="right")) - 1, 0)
            r1 = min(max(int(np.searchsorted(rb, o + g.numel, side="left")), r0 + 1), w)
            x = np.clip(rb[r0 : r1 + 1] - o, 0, g.numel)
            cost[r0:r1] += np.diff(_cum_cost(prof, g.numel, x))
    return float(cost.max()) if w else 0.0


_POUR_PROBES = 3
"""Per-bucket packing: capacities tried per plan (each packing is one pass over the ranks)."""
_POUR_GAIN = 0.005
"""The per-bucket packing is tried, and kept, only where it lowers the busiest rank by this fraction."""


def _balance_cost(rag, total_b: int, w: int, glob_cuts, offs_list):
    """Optimizer cost second: cap each rank's cost too (bisection), inside a small allowance on the
    largest rank's bytes; kept only if it lowers the largest rank's cost."""
    cap_b = int(max(b - a for a, b in zip(glob_cuts, glob_cuts[1:])) * (1 + _BYTES_SLACK))
    cur_c = _max_rank_cost(rag, glob_cuts, offs_list, w)
    total_c = sum(sum(c) for _, _, c, _, _ in rag)
    big_c = max((_largest_block_cost(p) for _, _, _, ps, _ in rag for p in ps), default=0.0)
    lo_c, hi_c, found = max(total_c / w, big_c), cur_c, None
    for _ in range(_COST_BISECT_STEPS if cur_c > 1.01 * lo_c else 0):
        if hi_c - lo_c <= 0.01 * total_c / w:
            break
        mid = (lo_c + hi_c) / 2
        res = _ragged_capacity(rag, total_b, w, cap_b, mid)
        if res is None:
            lo_c = mid
        else:
            hi_c, found = mid, res
    if found is not None and _max_rank_cost(rag, found[0], found[1], w) < cur_c:
        return found[0], found[1]
    return glob_cuts, offs_list


def _materialize(name: str, specs, isz: int, layout: Layout, rb_np: np.ndarray, offsets, splits) -> BucketPlan:
    """One ``BucketPlan`` from its rank bounds and tensor offsets; a splittable matrix is recorded as
    split only if a rank boundary actually cuts one of its blocks."""
    rank_bounds = tuple(rb_np.tolist())
    placements = []
    for j in sorted(range(len(specs)), key=lambda j: (offsets[j], specs[j].numel > 0, j)):
        ts = specs[j]
        shard = _make_shard(tuple(ts.shape), rank_bounds, rb_np, offsets[j])
        cut = bool(splits[j]) and _cuts_a_block(_Geom(ts), offsets[j], rb_np)
        placements.append(
            Placement(name=ts.name, shape=tuple(ts.shape), spec=ts.spec, offset=offsets[j], shard=shard, split=cut)
        )
    return BucketPlan(name=name, layout=layout, placements=tuple(placements), rank_bounds=rank_bounds, itemsize=isz)


def _cuts_a_block(g: _Geom, offset: int, rb_np: np.ndarray) -> bool:
    """Whether a rank bound strictly inside the tensor falls inside one of its (whole) blocks."""
    lo = int(np.searchsorted(rb_np, offset, side="right"))
    hi = int(np.searchsorted(rb_np, offset + g.numel, side="left"))
    return any(not g.is_boundary(x - offset) for x in set(rb_np[lo:hi].tolist()))
