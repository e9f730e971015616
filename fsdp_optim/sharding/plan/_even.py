"""The even layout of one bucket: ``W`` segments of one size ``S``, blocks whole wherever the padding allows.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from ._work import count_packing
from ._geom import _fill_gap, _Geom, _quantum
from ._plan import PlanConfig, TensorSpec

__all__ = ["_EvenResult", "_plan_even"]


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



def _pack_even(geoms: list[_Geom], order: list[int], seg: int, world_size: int) -> list[int] | None:
    """Offsets of the tensors packed into ``world_size`` segments of ``seg`` elements, or None."""
    count_packing()
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
