"""Whole-plan statistics and the human-readable report (``Plan.stats()``, ``Plan.report()``).

Reads plans through the ``PlanLike`` protocol (no import of ``_plan``), so ``_plan`` can offer these
as methods without an import cycle.
"""

from __future__ import annotations

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
    """The best any whole-block plan can do, over the mean per-rank parameter bytes, floored at 1:
    ``max_k ceil(k / W) * (k-th largest block)`` (``k`` blocks of at least that size share W ranks;
    ``k = 1``: the largest block), see ``whole_block_bound``."""
    balance_ratio: float
    """Largest rank's stored bytes (padding included) over the mean *parameter* bytes per rank: what
    ``PlanConfig.balance_cap`` bounds (padding counts against the balance)."""
    max_rank_bytes: int
    mean_rank_bytes: float
    plan_seconds: float

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
    """Least possible bytes on the busiest rank of any plan keeping blocks whole.

    ``sizes``: ``{block bytes: count}``. The ``k`` largest blocks sit on ``W`` ranks, so some rank
    holds ``ceil(k / W)`` of them, each at least the ``k``-th largest: the bound is the maximum of
    ``ceil(k / W) * size_k`` over ``k`` (checked at the last block of each size class, where it peaks).
    """
    best, k = 0, 0
    for size in sorted(sizes, reverse=True):
        k += sizes[size]
        best = max(best, -(-k // world_size) * size)
    return best


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
        f"(layout={cfg.layout}, padding_cap={cfg.padding_cap}, align={cfg.align}), planned in {st.plan_seconds:.3f} s",
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
