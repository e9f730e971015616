"""Where a tensor may be cut: block geometry (boundaries kept arithmetically) and the piece alignment.

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

import math

from ._blocks import align_down, align_up
from ._plan import PlanConfig, TensorSpec

__all__ = ["_Geom", "_fill_gap", "_quantum"]


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


def _quantum(config: PlanConfig, itemsize: int) -> int:
    """Elements per ``config.piece_align_bytes`` (see [Note: aligned pieces])."""
    return config.piece_align_bytes // math.gcd(config.piece_align_bytes, itemsize)


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
