"""RaggedLayout: the layout of one tensor over the ranks of a shard group.

Rank ``r`` holds elements ``[bounds[r], bounds[r + 1])`` of the row-major flattened
tensor. Ranges are contiguous, in rank order, cover the tensor exactly once, may be empty
and (when a block spec is given) start and end on block boundaries. Pure index math: the DTensor
interop that communicates is ``sharding/_dtensor.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._blocks import BlockSpec

__all__ = [
    "Box",
    "RaggedLayout",
    "flat_range_boxes",
    "chunk_bounds",
    "block_aligned_splits",
]


@dataclass(frozen=True)
class RaggedLayout:
    """Per-rank contiguous element ranges of one tensor (see module docstring)."""

    shape: tuple[int, ...]
    bounds: tuple[int, ...]
    """``world_size + 1`` non-decreasing flat offsets from 0 to numel."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "bounds", tuple(int(b) for b in self.bounds))
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or b[-1] != self.numel or any(x > y for x, y in itertools.pairwise(b)):
            raise ValueError(
                f"RaggedLayout bounds {list(b)} must rise from 0 to numel={self.numel} (shape {self.shape})"
            )

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def from_sizes(cls, shape: Sequence[int], sizes: Sequence[int]) -> RaggedLayout:
        return cls(tuple(shape), tuple(itertools.accumulate(sizes, initial=0)))

    @classmethod
    def even_rows(cls, shape: Sequence[int], world_size: int) -> RaggedLayout:
        """The layout of DTensor ``Shard(0)`` (``torch.chunk`` of dim 0)."""
        shape = tuple(shape)
        row = math.prod(shape[1:]) if shape else 1
        return cls(shape, tuple(r * row for r in chunk_bounds(shape[0] if shape else 1, world_size)))

    # ---- queries ------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def world_size(self) -> int:
        return len(self.bounds) - 1

    def range(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]

    def local_numel(self, rank: int) -> int:
        return self.bounds[rank + 1] - self.bounds[rank]

    def owners(self) -> list[int]:
        """Ranks holding at least one element."""
        return [r for r in range(self.world_size) if self.local_numel(r) > 0]

    def is_aligned(self, spec: BlockSpec) -> bool:
        return all(spec.is_boundary(self.shape, b) for b in self.bounds)

    def check(self, spec: BlockSpec, name: str = "<param>") -> None:
        """Raise ``ValueError`` naming the parameter if a rank boundary cuts a block."""
        for r, b in enumerate(self.bounds[1:-1], start=1):
            if not spec.is_boundary(self.shape, b):
                raise ValueError(
                    f"{name} (shape {self.shape}): the boundary between ranks {r - 1} and {r} "
                    f"at element {b} cuts a {spec} block (world size {self.world_size})"
                )

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    def is_row_aligned(self) -> bool:
        rn = self.row_numel
        return rn > 0 and all(b % rn == 0 for b in self.bounds)

    def row_range(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of rank ``rank``; only for row-aligned layouts."""
        if not self.is_row_aligned():
            raise ValueError(f"layout {list(self.bounds)} of shape {self.shape} is not row-aligned")
        rn = self.row_numel
        return self.bounds[rank] // rn, self.bounds[rank + 1] // rn

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """``(rows, *shape[1:])`` for row-aligned layouts, else ``(numel,)``."""
        if self.shape and self.is_row_aligned():
            s, e = self.row_range(rank)
            return (e - s, *self.shape[1:])
        return (self.local_numel(rank),)

    # ---- tensors ------------------------------------------------------------------
    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s flat piece of ``full`` (a view when ``full`` is contiguous)."""
        self._check_full(full)
        s, e = self.range(rank)
        return full.reshape(-1)[s:e]

    def unshard(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate every rank's flat piece back into the full tensor."""
        if len(locals_) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} pieces, got {len(locals_)}")
        for r, t in enumerate(locals_):
            if t.numel() != self.local_numel(r):
                raise ValueError(
                    f"rank {r} piece has {t.numel()} elements; the layout gives it {self.local_numel(r)}"
                )
        return torch.cat([t.reshape(-1) for t in locals_]).reshape(self.shape)

    def _check_full(self, full: torch.Tensor) -> None:
        if tuple(full.shape) != self.shape:
            raise ValueError(f"tensor of shape {tuple(full.shape)} does not match layout shape {self.shape}")


# ---- pure helpers -----------------------------------------------------------------
def chunk_bounds(n: int, world_size: int) -> list[int]:
    """``torch.chunk`` boundaries of ``n`` items over ``world_size`` ranks (trailing ranks may be empty)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    c = -(-n // world_size) if n else 0
    return [min(r * c, n) for r in range(world_size + 1)]


def block_aligned_splits(shape: Sequence[int], spec: BlockSpec, world_size: int) -> Iterator[RaggedLayout]:
    """Every block-aligned layout of ``shape`` over ``world_size`` ranks (brute force; small shapes)."""
    starts = spec.block_starts(shape)
    numel = math.prod(shape)
    inner = starts[:-1] if numel else []
    for cuts in itertools.combinations_with_replacement(inner + [numel], world_size - 1):
        yield RaggedLayout(tuple(shape), (0, *cuts, numel))


# ---- flat ranges as N-D boxes (what DCP reshards) ---------------------------------
class Box(NamedTuple):
    """An N-D chunk of a tensor whose elements are the flat range ``[start, start + numel)``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def _boxes(shape: tuple[int, ...], s: int, e: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes ``(offsets, sizes)`` covering flat ``[s, e)`` of ``shape`` in order; ``0 <= s < e <= numel``."""
    if len(shape) == 1:
        return [((s,), (e - s,))]
    inner = shape[1:]
    row = math.prod(inner)
    r0, c0 = divmod(s, row)
    r1, c1 = divmod(e, row)

    def in_row(r: int, a: int, b: int):
        return [((r, *o), (1, *z)) for o, z in _boxes(inner, a, b)]

    if r0 == r1:  # inside one row
        return in_row(r0, c0, c1)
    out = []
    if c0:
        out += in_row(r0, c0, row)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *([0] * len(inner))), (r1 - r0, *inner)))
    if c1:
        out += in_row(r1, 0, c1)
    return out


def flat_range_boxes(shape: Iterable[int], start: int, end: int) -> list[Box]:
    """The N-D boxes (in flat order, each a contiguous sub-range) that make up flat ``[start, end)``.

    At most ``2 * ndim - 1`` boxes; none for an empty range; one ``()``-box for a 0-dim tensor.
    """
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of shape {shape} ({numel} elements)")
    if start == end:
        return []
    if not shape:
        return [Box((), (), 0)]
    out, pos = [], start
    for offsets, sizes in _boxes(shape, start, end):
        out.append(Box(offsets, sizes, pos))
        pos += math.prod(sizes)
    assert pos == end
    return out
