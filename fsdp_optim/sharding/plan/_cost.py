"""The optimizer cost model the planner balances: estimated flops of one step per tensor (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ._blocks import BlockKind, BlockSpec

__all__ = ["tensor_cost"]

_NS_STEPS = 5
"""Newton-Schulz iterations of torch.optim.Muon (its default ``ns_steps``)."""


def _ns_cost(rows: int, cols: int) -> float:
    """Flops of Newton-Schulz on a ``rows x cols`` matrix: per step ``A = X Xᵀ`` (2m²n),
    ``B = bA + cA²`` (2m³), ``X = aX + BX`` (2m²n) with ``m = min``, ``n = max``
    (the quintic iteration of torch.optim.Muon)."""
    m, n = min(rows, cols), max(rows, cols)
    return float(_NS_STEPS * (4 * m * m * n + 2 * m**3))


def _shampoo_block_cost(br: int, bc: int) -> float:
    """One Shampoo block ``br x bc``: factor updates and preconditioning (4·br·bc·(br+bc))
    plus the eigendecompositions of both factors (br³ + bc³); 1-D: one factor."""
    if bc <= 1:
        return float(4 * br * br + br**3)
    return float(4 * br * bc * (br + bc) + br**3 + bc**3)


def _shampoo_strip_cost(strip_rows: int, cols: int, k: int) -> float:
    """A strip of ``strip_rows`` (<= k) rows, blocked into columns of at most ``k``."""
    if cols <= 1:
        return _shampoo_block_cost(strip_rows, 1)
    full, last = divmod(cols, k)
    c = full * _shampoo_block_cost(strip_rows, k)
    if last:
        c += _shampoo_block_cost(strip_rows, last)
    return c


class _UniformCost(NamedTuple):
    """Per-block costs of a tensor with equal blocks of ``unit`` elements but a partial last one."""

    unit: int
    num_blocks: int
    full: float
    last: float


def _cost_profile(shape: Sequence[int], spec: BlockSpec) -> _UniformCost | tuple[list[int], list[float]]:
    """The tensor's cost as blocks: uniform (unit, count, cost of a full and of the last block),
    or explicit ``(block_starts, cumulative_costs)`` for matrices stacked by ``row_splits``."""
    shape = tuple(shape)
    numel = math.prod(shape)
    if numel == 0:
        return _UniformCost(1, 0, 0.0, 0.0)
    cols = math.prod(shape[1:]) if len(shape) >= 1 else 1
    if spec.kind is BlockKind.ELEMENTS:
        return _UniformCost(1, numel, 1.0, 1.0)
    if spec.kind is BlockKind.ROWS:
        k = spec.size
        rows_ = shape[0] if shape else 1
        nb, last_rows = -(-rows_ // k), rows_ % k or k
        return _UniformCost(k * cols, nb, _shampoo_strip_cost(k, cols, k), _shampoo_strip_cost(last_rows, cols, k))
    if spec.kind is BlockKind.EXPERT:
        e, r, c = shape
        ns = _ns_cost(r, c)
        return _UniformCost(r * c, e, ns, ns)
    mats = spec.matrices(shape)  # WHOLE
    if not mats:  # not a 2-D matrix: element-wise treatment
        return _UniformCost(1, numel, 1.0, 1.0)
    if spec.row_splits is None:
        ns = _ns_cost(shape[0], cols)
        return _UniformCost(numel, 1, ns, ns)
    starts = [m[0] for m in mats] + [numel]
    cum = [0.0]
    for _, r, c in mats:
        cum.append(cum[-1] + _ns_cost(r, c))
    return starts, cum


def tensor_cost(shape: Sequence[int], spec: BlockSpec) -> float:
    """Estimated optimizer work (flops) of one step on a tensor of ``shape`` with blocks ``spec``.

    Matrix blocks (Muon): Newton-Schulz, ~rows·cols·min(rows, cols) per matrix; ``rows(k)``
    strips (Shampoo): per block of at most k x k, the eigendecompositions (k³) plus the factor
    and preconditioning matmuls; element-wise (AdamW, 8-bit AdamW): numel. Used to balance and
    report per-rank optimizer cost; only ratios between ranks matter.
    """
    prof = _cost_profile(shape, spec)
    if isinstance(prof, _UniformCost):
        if prof.num_blocks == 0:
            return 0.0
        return (prof.num_blocks - 1) * prof.full + prof.last
    return prof[1][-1]


def _cum_cost(prof, numel: int, x: np.ndarray) -> np.ndarray:
    """Cost of elements ``[0, x)`` of a tensor (vectorized; linear inside a block, which only
    matters for split matrices: their cost is shared by rows held)."""
    x = x.astype(np.float64)
    if isinstance(prof, _UniformCost):
        if prof.num_blocks == 0:
            return np.zeros_like(x)
        last_start = (prof.num_blocks - 1) * prof.unit
        last_len = numel - last_start
        head = x / prof.unit * prof.full
        tail = (prof.num_blocks - 1) * prof.full + (x - last_start) / last_len * prof.last
        return np.where(x < last_start, head, tail)
    starts, cum = prof
    return np.interp(x, starts, cum)
