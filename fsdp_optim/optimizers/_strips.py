"""Shampoo's block geometry (pure): how a tensor is merged, cut into strips and blocks, and how
large each strip's factors are. Shared by ``Shampoo``, SOAP and the planner-facing rule
(``shampoo_rule``'s per-strip state, which ``suggest_mesh`` prices); see [Note: Shampoo blocks] in
``_shampoo.py``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..sharding.contract import BlockKind, BlockSpec, merge_small_dims

__all__ = ["BlockGeometry", "shampoo_blocks", "tp_keeps_blocks"]


class BlockGeometry(NamedTuple):
    """How one parameter is blocked (see [Note: Shampoo blocks]): ``num_matrices`` stacked tensors
    of the merged shape ``dims``, each cut into ``k``-strips of ``dims[0]`` and each strip into
    ``k``-chunks of the other dims."""

    num_matrices: int
    dims: tuple[int, ...]
    """The merged shape of each stacked tensor (``merge_small_dims``)."""
    k: int

    @property
    def rows(self) -> int:
        return self.dims[0]

    @property
    def cols(self) -> int:
        """Elements per unit of dim 0 (1 for a 1-D merged shape)."""
        return math.prod(self.dims[1:])

    @property
    def order(self) -> int:
        return len(self.dims)

    @property
    def strips_per_matrix(self) -> int:
        return -(-self.rows // self.k)

    @property
    def num_strips(self) -> int:
        return self.num_matrices * self.strips_per_matrix

    def strip_rows(self, i: int) -> int:
        return min(self.k, self.rows - (i % self.strips_per_matrix) * self.k)

    def strip_start_row(self, i: int) -> int:
        """First row of strip ``i`` in the stacked ``[num_matrices * rows, cols]`` view."""
        spm = self.strips_per_matrix
        return (i // spm) * self.rows + (i % spm) * self.k

    def strip_at(self, offset: int) -> int:
        """Index of the strip starting at flat ``offset`` (``num_strips`` at the end)."""
        mat = self.rows * self.cols
        if offset >= self.num_matrices * mat:
            return self.num_strips
        e, rem = divmod(offset, mat)
        return e * self.strips_per_matrix + -(-rem // (self.k * self.cols))

    def strip_end(self, i: int) -> int:
        """Flat end of strip ``i`` (its start is ``strip_start_row(i) * cols``)."""
        return (self.strip_start_row(i) + self.strip_rows(i)) * self.cols

    def strip_containing(self, offset: int) -> int:
        """Index of the strip holding flat element ``offset`` (``offset < numel``)."""
        e, rem = divmod(offset, self.rows * self.cols)
        return e * self.strips_per_matrix + rem // (self.k * self.cols)

    def is_strip_boundary(self, offset: int) -> bool:
        mat = self.rows * self.cols
        return offset >= self.num_matrices * mat or (offset % mat) % (self.k * self.cols) == 0

    @property
    def tail_chunks(self) -> list[tuple[tuple[int, int], ...]]:
        """The blocks of one strip as ``((start, size), ...)`` chunks of ``dims[1:]``, in order."""
        per_dim = [[(s, min(self.k, d - s)) for s in range(0, d, self.k)] for d in self.dims[1:]]
        return list(itertools.product(*per_dim))

    def strip_factor_numel(self, r: int) -> int:
        """Elements of the factors of all blocks of a strip with ``r`` rows."""
        tails = self.tail_chunks
        return len(tails) * r * r + sum(sum(n * n for _, n in t) for t in tails)

    def factor_numel(self, s0: int, s1: int) -> int:
        """Elements of the factors of strips ``[s0, s1)`` (all blocks, each its factors in dim order)."""
        return sum(self.strip_factor_numel(self.strip_rows(i)) for i in range(s0, s1))

    def local_blocks(self, start: int, end: int) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
        """``(shape, index)`` of every block of the strips held by a shard of flat range ``[start, end)``
        (whole strips), in global block order, ``index`` into its local ``[rows, *dims[1:]]`` view."""
        row_base = start // self.cols
        for i in range(self.strip_at(start), self.strip_at(end)):
            yield from self.strip_blocks(i, self.strip_start_row(i) - row_base)

    def strip_blocks(self, i: int, row0: int) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
        """``(shape, index)`` of every block of strip ``i``, in order, ``index`` into a ``[rows, *dims[1:]]``
        view in which the strip starts at row ``row0``."""
        r = self.strip_rows(i)
        for t in self.tail_chunks:
            yield (r, *(n for _, n in t)), (slice(row0, row0 + r), *(slice(s, s + n) for s, n in t))


def shampoo_blocks(shape: tuple[int, ...], k: int, spec: BlockSpec | None = None) -> BlockGeometry:
    """The block geometry of a tensor of global ``shape`` with ``max_preconditioner_dim = k``:
    ``expert()`` 3-D tensors are E tensors ``[r, c]``; others one tensor, both merged with
    ``merge_small_dims``."""
    if spec is not None and spec.kind is BlockKind.EXPERT and len(shape) == 3:
        return BlockGeometry(shape[0], merge_small_dims(shape[1:], k), k)
    return BlockGeometry(1, merge_small_dims(shape, k), k)


def tp_keeps_blocks(info: Any, k: int) -> bool:
    """A 2-D parameter whose TP cut splits its ``rows(k)`` strips along dim 1 still keeps every ``[k, k]``
    preconditioner block whole when the TP-local width is a multiple of ``k`` (and neither shape is
    merged): each TP rank's strips hold exactly the global blocks of its columns, so Shampoo (and SOAP's
    block mode) on the TP-local tensor is the same on the global one ([Note: FSDP x TP])."""
    tp = info.tp
    if len(tp.global_shape) != 2 or tp.dim != 1:
        return False
    merged = shampoo_blocks(tp.global_shape, k, tp.blocks).dims, shampoo_blocks(info.shape, k, info.spec).dims
    if merged != (tuple(tp.global_shape), tuple(info.shape)):
        return False
    return info.shape[1] % k == 0
