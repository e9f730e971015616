"""The stream packing of the ragged buckets: concatenated in bucket order, cut into ``W`` contiguous
pieces at block boundaries, bytes balanced first and optimizer cost second.

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
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from ._work import count_packing
from ._cost import _cum_cost, _UniformCost
from ._geom import _fill_gap, _Geom

__all__ = ["_balance_ragged", "_max_rank_cost"]


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
    count_packing()
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
    count_packing()
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
