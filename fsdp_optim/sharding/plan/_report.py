"""Whole-plan statistics and the human-readable report (``Plan.stats()``, ``Plan.report()``).

Reads plans through the ``PlanLike`` protocol (no import of ``_plan``), so ``_plan`` can offer these
as methods without an import cycle.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from ._blocks import BlockSpec
from ._cost import _cost_profile, _cum_cost

__all__ = ["PlanStats", "plan_stats", "plan_report", "whole_block_bound"]


class PlanLike(Protocol):
    """What the statistics read of a ``Plan``."""

    world_size: int
    buckets: Sequence[Any]
    config: Any
    seconds: float
    packings: int


class PlanStats(NamedTuple):
    """Whole-model figures of a plan (see ``fsdp-optim plan``)."""

    world_size: int
    num_buckets: int
    num_even_buckets: int
    num_ragged_buckets: int
    num_tensors: int
    param_numel: int
    padding_ratio: float
    """Padding elements / parameter elements."""
    num_split_blocks: int
    split_bytes_ratio: float
    """Bytes of split matrix blocks / bytes of all matrix blocks (0 without matrix blocks)."""
    bytes_max_over_mean: float
    """Per-rank stored bytes (padding included) over all buckets: max / mean."""
    cost_max_over_mean: float
    """Per-rank optimizer cost (``tensor_cost``) over all buckets: max / mean."""
    bytes_lower_bound: float
    """A proven lower bound on the busiest rank of any whole-block plan, over the mean per-rank parameter
    bytes, floored at 1: ``whole_block_bound`` (the larger of ``max_k ceil(k / W) * (k-th largest
    block)`` and a bin-packing bound, see [Note: whole-block lower bound])."""
    balance_ratio: float
    """Largest rank's stored bytes (padding included) over the mean *parameter* bytes per rank: what
    ``PlanConfig.balance_cap`` bounds (padding counts against the balance)."""
    max_rank_bytes: int
    mean_rank_bytes: float
    plan_seconds: float
    """Wall time of planning: a benchmark figure (``benchmarks/planner_scale.py``), never a test's."""
    plan_packings: int
    """Packings the planner tried (see ``_work``): its work, machine-independent; what tests bound."""

    def as_dict(self) -> dict:
        return dict(self._asdict())


def _per_rank(plan: PlanLike) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """Per-rank bytes and cost arrays, plus per-bucket details (for the report)."""
    w = plan.world_size
    rank_bytes = np.zeros(w, dtype=np.float64)
    rank_cost = np.zeros(w, dtype=np.float64)
    details = []
    for b in plan.buckets:
        rb = np.asarray(b.rank_bounds, dtype=np.int64)
        seg = np.diff(rb)
        rank_bytes += seg * b.itemsize
        bcost = np.zeros(w, dtype=np.float64)
        split_blocks, split_bytes, matrix_bytes = 0, 0, 0
        for p in b.placements:
            numel = p.numel
            mats = p.spec.row_blocks(p.shape)  # matrix blocks and rows(k) strips: what a split may cut
            matrix_bytes += sum(r * c for _, r, c in mats) * b.itemsize
            if numel == 0:
                continue
            r0 = int(np.searchsorted(rb, p.offset, side="right")) - 1
            r1 = int(np.searchsorted(rb, p.offset + numel, side="left"))
            r0, r1 = max(r0, 0), min(max(r1, r0 + 1), w)
            x = np.clip(rb[r0 : r1 + 1] - p.offset, 0, numel)
            cum = _cum_cost(_cost_profile(p.shape, p.spec), numel, x)
            bcost[r0:r1] += np.diff(cum)
            if p.split:
                inner = x[1:-1]
                inner = inner[(inner > 0) & (inner < numel)]
                for off, r, c in mats:
                    if np.any((inner > off) & (inner < off + r * c)):
                        split_blocks += 1
                        split_bytes += r * c * b.itemsize
        rank_cost += bcost
        details.append(
            dict(split_blocks=split_blocks, split_bytes=split_bytes, matrix_bytes=matrix_bytes, seg=seg, cost=bcost)
        )
    return rank_bytes, rank_cost, details


def block_sizes(shape: Sequence[int], spec: BlockSpec) -> dict[int, int]:
    """``{block elements: count}`` of one tensor (pure; uniform specs in O(1))."""
    numel = math.prod(shape)
    if numel == 0:
        return {}
    if spec.is_uniform:
        unit = min(spec.unit(shape), numel)
        full, last = divmod(numel, unit)
        out = {unit: full}
        if last:
            out[last] = out.get(last, 0) + 1
        return out
    starts = spec.block_starts(shape)
    out: dict[int, int] = {}
    for a, b in zip(starts, starts[1:]):
        out[b - a] = out.get(b - a, 0) + 1
    return out


def whole_block_bound(sizes: dict[int, int], world_size: int) -> int:
    """Least possible bytes on the busiest rank of any plan keeping blocks whole (a proven lower bound).

    ``sizes``: ``{block bytes: count}``. The larger of two bounds, see [Note: whole-block lower bound]:
    the counting bound ``max_k ceil(k / W) * size_k`` and the bin-packing bound ``_binpack_bound``.
    """
    if not sizes or world_size < 1:
        return 0
    return max(_counting_bound(sizes, world_size), _binpack_bound(sizes, world_size))


def _counting_bound(sizes: dict[int, int], world_size: int) -> int:
    """``max_k ceil(k / W) * size_k``: the ``k`` largest blocks sit on ``W`` ranks, so some rank holds
    ``ceil(k / W)`` of them, each at least the ``k``-th largest (checked at the last block of each size
    class, where it peaks)."""
    best, k = 0, 0
    for size in sorted(sizes, reverse=True):
        k += sizes[size]
        best = max(best, -(-k // world_size) * size)
    return best


# [Note: whole-block lower bound]
# A whole-block plan puts every block (its bytes: an item) on one rank; padding only adds bytes, so a
# bound on the busiest rank of a padding-free assignment bounds every plan. Element-wise blocks are
# items too (tiny ones); nothing below treats any item as divisible except as noted, so the bound holds
# for every plan of the given blocks.
#
# Capacity test ``_excluded(C)``: true only if no assignment of the items to W ranks keeps every rank at
# or below C bytes. Three proofs, any one suffices:
#   (i) some item is larger than C;
#  (ii) the total exceeds W * C;
# (iii) Martello-Toth L2 with the small items counted as filler: for 0 <= K <= C/2, let
#       N1 = items > C - K, N2 = items in (C/2, C - K], N3 = items in [K, C/2], small = items < K.
#       Two items of N1 u N2 never share a rank (each is > C/2), so they occupy n1 + n2 distinct ranks.
#       A rank holding an N1 item holds nothing of N2 u N3 (N1 > C - K and every N2, N3 item is >= K),
#       so its free room, ``res1 = n1*C - sum(N1)`` in all, takes small items only. The N2 ranks have free
#       room ``res2 = n2*C - sum(N2)``. Whatever of N3 and of the small items does not fit there, at least
#       ``sum(N3) + max(0, sum(small) - res1) - res2`` bytes, needs further ranks of C bytes each, so at
#       least ``n1 + n2 + ceil(max(0, that) / C)`` ranks are used; more than W excludes C.
#       (K = 0 and K = each item size <= C/2 are tried; between item sizes the classes do not change.)
#  (iv) a dual feasible function (Fekete and Schepers): with capacity normalized to 1 and an integer
#       k >= 1, ``u_k(x) = x`` if ``(k+1) x`` is an integer, else ``floor((k+1) x) / k``. On one rank
#       (sum of its x <= 1) the u_k sum to at most 1: let I be its items with ``y = (k+1) x`` integral,
#       J the others. If J is empty the sum is sum(x) <= 1. Else sum_J floor(y) < sum_J y <= k + 1 -
#       sum_I y, and both ends are integers, so sum_J floor(y) <= k - sum_I y, and the u_k sum to at
#       most sum_I y / (k+1) + (k - sum_I y) / k = 1 - sum_I y (1/k - 1/(k+1)) <= 1. Hence W ranks
#       hold items whose u_k sum to at most W: a larger sum over all items excludes C. (Items below
#       C / (k+1) count 0: element-wise blocks, however many, add nothing to this test.) Computed
#       exactly in integers: ``k * sum_I x + C * sum_J floor((k+1) x / C) > W * k * C``.
#  (vi) counting instead of volume: for an item size s <= C/2, a rank holding an item x > C/2 (at most
#       one: two exceed C) has room for at most ``floor((C - x) / s)`` items of s bytes or more besides
#       it, any other rank for at most ``floor(C / s)``; more items in [s, C/2] than that, summed over
#       the ranks (the n_big ranks with a large item, W - n_big without), exclude C. (Llama 3 405B,
#       Shampoo, W = 4096: a rank with a 0.55 x mean block holds at most two 0.17 blocks below 1.058,
#       any other at most six; 17638 such blocks need more than 4096 ranks.)
#   (v) the equality case of (iv) when no item has ``(k+1) x / C`` integral (I empty): call
#       ``floor((k+1) x / C)`` the units of x. A rank holds at most k units (shown in (iv)); if the
#       units of all items sum to exactly ``W * k``, every rank holds exactly k. Then the rank that
#       holds the largest zero-unit item z also holds items worth k units, at least ``B`` bytes, the
#       least bytes of any multiset of item sizes worth exactly k units (a knapsack over the sizes,
#       counts ignored: a relaxation), so ``B + z > C`` excludes C.
# Feasibility is monotone in C (a plan with busiest rank <= C' also has busiest rank <= C for C >= C'),
# so an excluded C proves every plan's busiest rank > C, whatever the test says about other capacities.
# ``_binpack_bound`` bisects C between a proven-excluded value (one below the counting bound or the
# mean) and ``ceil(total / W) + largest item`` (list scheduling reaches it, so it is never excluded) and
# returns one more than the largest excluded C it met: a valid lower bound even if the test were not
# monotone, and within ``total / W / 2**17`` of the bisection's limit.


def _excluded(c: int, desc: list[int], counts: list[int], cnt_pre: list[int], sum_pre: list[int], world_size: int) -> bool:
    """Whether capacity ``c`` is proven infeasible (see [Note: whole-block lower bound]). ``desc``: the
    distinct item sizes, descending; ``cnt_pre`` / ``sum_pre``: prefix counts / byte sums over ``desc``."""
    if desc[0] > c or sum_pre[-1] > world_size * c:
        return True
    neg = [-x for x in desc]

    def n_above(x: float) -> int:  # classes with size > x (a prefix of ``desc``)
        return bisect.bisect_left(neg, -x)

    def n_at_least(x: int) -> int:  # classes with size >= x
        return bisect.bisect_right(neg, -x)

    total = sum_pre[-1]
    i_half = n_above(c / 2)
    for k in [0] + [x for x in desc[i_half:] if x > 0]:
        i1, i3 = n_above(c - k), n_at_least(k) if k > 0 else len(desc)
        n1, s1 = cnt_pre[i1], sum_pre[i1]
        n2, s2 = cnt_pre[i_half] - n1, sum_pre[i_half] - s1
        s3 = sum_pre[i3] - sum_pre[i_half]
        small = total - sum_pre[i3]
        rest = s3 + max(0, small - (n1 * c - s1)) - (n2 * c - s2)
        if n1 + n2 + max(0, -(-rest // c)) > world_size:
            return True
    big = [(x, m) for x, m in zip(desc, counts) if 2 * x > c]  # (vi): items of at least s, counted
    n_big = sum(m for _, m in big)
    n_s = 0  # items in [s, C/2]
    for s_, m in zip(desc, counts):
        if 2 * s_ > c:
            continue
        n_s += m
        if n_s > sum(m_ * ((c - x) // s_) for x, m_ in big) + (world_size - n_big) * (c // s_):
            return True
    for k in range(1, _DFF_MAX_K + 1):  # (iv): sum of u_k over all items > W
        whole_, frac_ = 0, 0  # k * (items with (k+1)x/C integral, bytes) + C * sum floor((k+1)x/C) (others)
        for x, m in zip(desc, counts):
            q, r_ = divmod((k + 1) * x, c)
            if r_ == 0:
                whole_ += k * x * m
            else:
                frac_ += c * q * m
        if whole_ + frac_ > world_size * k * c:
            return True
        if whole_ == 0 and frac_ == world_size * k * c and _full_ranks_excluded(c, k, desc):
            return True
    return False


def _full_ranks_excluded(c: int, k: int, desc: list[int]) -> bool:
    """(v) of [Note: whole-block lower bound]: every rank holds exactly ``k`` units; the cheapest ``k``
    units plus the largest zero-unit item exceed ``c``."""
    units = [((k + 1) * x) // c for x in desc]
    zero = [x for x, q in zip(desc, units) if q == 0]
    if not zero:
        return False
    dp = [0] + [math.inf] * k  # least bytes of items worth exactly u units (unbounded: a relaxation)
    for u in range(1, k + 1):
        dp[u] = min((dp[u - q] + x for x, q in zip(desc, units) if 0 < q <= u), default=math.inf)
    return dp[k] + max(zero) > c


_DFF_MAX_K = 32
"""Bin-packing bound: dual feasible functions ``u_k`` tried, k = 1..this."""


def _binpack_bound(sizes: dict[int, int], world_size: int) -> int:
    """The bin-packing bound of [Note: whole-block lower bound] (bytes)."""
    desc = sorted((s for s in sizes if s > 0 and sizes[s] > 0), reverse=True)
    if not desc:
        return 0
    cnt_pre, sum_pre = [0], [0]
    for s in desc:
        cnt_pre.append(cnt_pre[-1] + sizes[s])
        sum_pre.append(sum_pre[-1] + s * sizes[s])
    mean_up = -(-sum_pre[-1] // world_size)
    lo = max(_counting_bound(sizes, world_size), mean_up) - 1  # proven excluded (or trivially: below both)
    hi = mean_up + desc[0]
    tol = max(1, mean_up >> 17)
    while hi - lo > tol:
        mid = (lo + hi) // 2
        if _excluded(mid, desc, [sizes[x] for x in desc], cnt_pre, sum_pre, world_size):
            lo = mid
        else:
            hi = mid
    return lo + 1


def _ratio(a: np.ndarray) -> float:
    m = float(a.mean()) if a.size else 0.0
    return float(a.max()) / m if m > 0 else 1.0


def plan_stats(plan: PlanLike, *, _per_rank_cache=None) -> PlanStats:
    """Whole-model statistics of ``plan`` (``Plan.stats()``)."""
    rank_bytes, rank_cost, details = _per_rank_cache or _per_rank(plan)
    param = sum(b.param_numel for b in plan.buckets)
    param_bytes = sum(b.param_numel * b.itemsize for b in plan.buckets)
    pad = sum(b.padding for b in plan.buckets)
    sizes: dict[int, int] = {}
    for b in plan.buckets:
        for p in b.placements:
            for n, c in block_sizes(p.shape, p.spec).items():
                sizes[n * b.itemsize] = sizes.get(n * b.itemsize, 0) + c
    bound = whole_block_bound(sizes, plan.world_size)
    mean_param = param_bytes / plan.world_size
    matrix_bytes = sum(d["matrix_bytes"] for d in details)
    return PlanStats(
        world_size=plan.world_size,
        num_buckets=len(plan.buckets),
        num_even_buckets=sum(b.layout.value == "even" for b in plan.buckets),
        num_ragged_buckets=sum(b.layout.value == "ragged" for b in plan.buckets),
        num_tensors=sum(len(b.placements) for b in plan.buckets),
        param_numel=param,
        padding_ratio=pad / param if param else 0.0,
        num_split_blocks=sum(d["split_blocks"] for d in details),
        split_bytes_ratio=sum(d["split_bytes"] for d in details) / matrix_bytes if matrix_bytes else 0.0,
        bytes_max_over_mean=_ratio(rank_bytes),
        cost_max_over_mean=_ratio(rank_cost),
        bytes_lower_bound=max(1.0, bound / mean_param) if mean_param else 1.0,
        balance_ratio=float(rank_bytes.max()) / mean_param if mean_param else 1.0,
        max_rank_bytes=int(rank_bytes.max()) if rank_bytes.size else 0,
        mean_rank_bytes=float(rank_bytes.mean()) if rank_bytes.size else 0.0,
        plan_seconds=plan.seconds,
        plan_packings=plan.packings,
    )


def _fmt_bytes(x: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.1f} {unit}" if unit != "B" else f"{int(x)} B"
        x /= 1024
    return f"{x:.1f} TiB"


def plan_report(plan: PlanLike) -> str:
    """Human-readable report: layout per bucket, padding, split blocks, per-rank balance,
    bytes per collective (``Plan.report()``)."""
    per_rank = _per_rank(plan)
    st = plan_stats(plan, _per_rank_cache=per_rank)
    details = per_rank[2]
    cfg = plan.config
    lines = [
        f"plan: {st.num_buckets} buckets ({st.num_even_buckets} even, {st.num_ragged_buckets} ragged), "
        f"{st.num_tensors} tensors, {st.param_numel:,} parameters, world size {st.world_size} "
        f"(layout={cfg.layout}, padding_cap={cfg.padding_cap}, align={cfg.align}), planned in {st.plan_seconds:.3f} s "
        f"({st.plan_packings} packings)",
        f"{'bucket':<28} {'layout':<6} {'tensors':>7} {'params':>15} {'padding%':>9} {'split':>6} "
        f"{'split bytes':>12} {'seg max/mean':>12} {'cost max/mean':>13} {'bytes/collective':>17}",
    ]
    for b, d in zip(plan.buckets, details):
        seg = d["seg"]
        pad_pct = 100.0 * b.padding / b.param_numel if b.param_numel else 0.0
        lines.append(
            f"{b.name[:28]:<28} {b.layout.value:<6} {len(b.placements):>7} {b.param_numel:>15,} {pad_pct:>9.3f} "
            f"{d['split_blocks']:>6} {_fmt_bytes(d['split_bytes']):>12} {_ratio(seg):>12.3f} "
            f"{_ratio(d['cost']):>13.3f} {_fmt_bytes(b.total_numel * b.itemsize):>17}"
        )
    lines += [
        f"padding: {100 * st.padding_ratio:.3f}% of parameters",
        f"split matrix blocks: {st.num_split_blocks} ({100 * st.split_bytes_ratio:.2f}% of matrix bytes)",
        f"per-rank bytes: max {_fmt_bytes(st.max_rank_bytes)}, mean {_fmt_bytes(st.mean_rank_bytes)}, "
        f"max/mean {st.bytes_max_over_mean:.4f}, max over mean parameter bytes {st.balance_ratio:.4f} "
        f"(whole-block lower bound {st.bytes_lower_bound:.4f}, balance cap {getattr(cfg, 'balance_cap', 1.10):.2f})",
        f"per-rank optimizer cost: max/mean {st.cost_max_over_mean:.4f}",
        "bytes/collective: the gathered bucket (all-gather output / reduce-scatter input), padding included",
    ]
    if getattr(plan, "balance_note", ""):
        lines.append(f"balance: {plan.balance_note}")
    return "\n".join(lines)
