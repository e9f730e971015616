"""Block specs: the smallest piece of a parameter that must stay on one rank.

Every block is a contiguous range of the row-major flattened tensor, so a block spec is
fully described by the sorted element offsets at which blocks start. All arithmetic here
is pure (no tensors, no process groups) and works on shapes alone.

[Note: block kinds]
- ``elements(g)``: groups of ``g`` flat elements; the last block may be partial
  (AdamW: g=1; 8-bit AdamW: g=256, its quantization block).
- ``rows(k)``: groups of ``k`` rows of dim 0; the last block may be partial
  (Shampoo: ``max_preconditioner_dim``; block-wise FP8: 128).
- ``whole()``: the whole tensor is one block (a Muon matrix). With ``row_splits`` the
  tensor is a stack of independent matrices along dim 0 (per-head Muon, fused QKV).
- ``expert()``: a 3-D ``[E, r, c]`` tensor is ``E`` blocks of one ``[r, c]`` matrix each.

``whole`` and ``expert`` blocks are *matrix* blocks: an optimizer treats each as one
matrix. When a planner must cut a matrix block, it cuts it only on a row boundary
(``split_unit``) and records the split; the optimizer then exchanges that matrix.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "BlockKind",
    "BlockSpec",
    "BlockRule",
    "elements",
    "rows",
    "whole",
    "heads",
    "expert",
    "default_rule",
    "merge_small_dims",
    "align_down",
    "align_up",
]


class BlockKind(enum.Enum):
    ELEMENTS = "elements"
    ROWS = "rows"
    WHOLE = "whole"
    EXPERT = "expert"


@dataclass(frozen=True)
class BlockSpec:
    """What must stay together on one rank for one parameter (see [Note: block kinds])."""

    kind: BlockKind
    size: int = 1
    """``g`` for ELEMENTS, ``k`` for ROWS; unused (1) for WHOLE and EXPERT."""
    row_splits: tuple[int, ...] | None = None
    """WHOLE only: the tensor is a stack of matrices with these row counts."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"block size must be >= 1, got {self.size} for {self.kind.value} blocks")
        if self.row_splits is not None:
            if self.kind is not BlockKind.WHOLE:
                raise ValueError("row_splits is only meaningful for whole() matrix blocks")
            if not self.row_splits or any(s < 1 for s in self.row_splits):
                raise ValueError(f"row_splits must be positive row counts, got {self.row_splits}")

    def __str__(self) -> str:
        if self.kind is BlockKind.ELEMENTS:
            return f"elements({self.size})"
        if self.kind is BlockKind.ROWS:
            return f"rows({self.size})"
        if self.kind is BlockKind.EXPERT:
            return "expert()"
        if self.row_splits is not None:
            return f"whole(row_splits={list(self.row_splits)})"
        return "whole()"

    # ---- properties ---------------------------------------------------------------
    @property
    def is_matrix(self) -> bool:
        """Each block is a matrix that an optimizer processes as a unit (Muon)."""
        return self.kind in (BlockKind.WHOLE, BlockKind.EXPERT)

    @property
    def splits_on_rows(self) -> bool:
        """A planner may cut its blocks on rows (``split_unit``) when the balance needs it and every
        optimizer takes split blocks (``PlanConfig.balance="auto"``): matrix blocks (Muon) and
        ``rows(k)`` strips (Shampoo; their row is a multiple of a row of Shampoo's merged view)."""
        return self.is_matrix or self.kind is BlockKind.ROWS

    @property
    def is_uniform(self) -> bool:
        """Blocks are equal-sized (but for a partial last one)."""
        return self.row_splits is None

    # ---- validation ---------------------------------------------------------------
    def check(self, shape: Sequence[int], name: str = "<param>") -> None:
        """Raise ``ValueError`` if this spec cannot describe a tensor of ``shape``."""
        shape = tuple(shape)
        if self.kind is BlockKind.ROWS and len(shape) < 1:
            raise ValueError(f"{name}: rows({self.size}) blocks need a tensor with dim >= 1, got shape {shape}")
        if self.kind is BlockKind.EXPERT and len(shape) != 3:
            raise ValueError(
                f"{name}: expert() blocks need a 3-D [E, r, c] tensor, got shape {shape}; "
                "use whole() for 2-D matrices"
            )
        if self.kind is BlockKind.WHOLE and self.row_splits is not None:
            if len(shape) < 2:
                raise ValueError(f"{name}: whole(row_splits=...) needs a 2-D tensor, got shape {shape}")
            if sum(self.row_splits) != shape[0]:
                raise ValueError(
                    f"{name}: row_splits {list(self.row_splits)} sum to {sum(self.row_splits)} "
                    f"but the parameter has {shape[0]} rows (shape {shape}); pass splits that sum to dim 0"
                )

    # ---- index arithmetic (pure) ----------------------------------------------------
    def unit(self, shape: Sequence[int]) -> int:
        """Elements per (full) block for uniform specs."""
        assert self.is_uniform, "unit() is only defined for uniform block specs"
        numel = math.prod(shape)
        if self.kind is BlockKind.ELEMENTS:
            return self.size
        if self.kind is BlockKind.ROWS:
            return self.size * _row_numel(shape)
        if self.kind is BlockKind.EXPERT:
            return shape[1] * shape[2]
        return max(numel, 1)  # WHOLE

    def num_blocks(self, shape: Sequence[int]) -> int:
        numel = math.prod(shape)
        if numel == 0:
            return 0
        if not self.is_uniform:
            return len(self.row_splits)
        return -(-numel // self.unit(shape))

    def block_starts(self, shape: Sequence[int]) -> list[int]:
        """Element offsets where blocks start, plus ``numel`` at the end (small tensors / tests)."""
        numel = math.prod(shape)
        if not self.is_uniform:
            r = _row_numel(shape)
            out = [0]
            for s in self.row_splits:
                out.append(out[-1] + s * r)
            return out
        u = self.unit(shape)
        return list(range(0, numel, u)) + [numel] if numel else [0]

    def is_boundary(self, shape: Sequence[int], offset: int) -> bool:
        """Whether a rank boundary may fall at flat ``offset`` of this tensor."""
        numel = math.prod(shape)
        if offset <= 0 or offset >= numel:
            return True
        if not self.is_uniform:
            return offset in self.block_starts(shape)
        return offset % self.unit(shape) == 0

    def align_down(self, shape: Sequence[int], offset: int) -> int:
        """Largest block boundary <= ``offset`` (clamped to ``[0, numel]``)."""
        return align_down(offset, math.prod(shape), *self._cuts(shape))

    def align_up(self, shape: Sequence[int], offset: int) -> int:
        """Smallest block boundary >= ``offset`` (clamped to ``[0, numel]``)."""
        return align_up(offset, math.prod(shape), *self._cuts(shape))

    def _cuts(self, shape: Sequence[int]) -> tuple[int, list[int] | None]:
        """``(unit, starts)`` for ``align_down`` / ``align_up``: uniform blocks or explicit starts."""
        if not self.is_uniform:
            return 1, self.block_starts(shape)
        return self.unit(shape), None

    def split_unit(self, shape: Sequence[int]) -> int:
        """Granularity (elements) at which a planner may cut a matrix block or a ``rows(k)`` strip: one
        row (of an expert's matrix; of dim 0 otherwise)."""
        if self.kind is BlockKind.EXPERT:
            return shape[2]
        return _row_numel(shape)

    def row_blocks(self, shape: Sequence[int]) -> list[tuple[int, int, int]]:
        """The blocks a planner may cut on rows (``splits_on_rows``) as ``(flat_offset, rows, cols)``:
        ``matrices`` or the ``rows(k)`` strips; empty for the others."""
        if self.kind is not BlockKind.ROWS:
            return self.matrices(shape)
        n, cols = math.prod(shape), _row_numel(shape)
        if n == 0:
            return []
        return [(r * cols, min(self.size, shape[0] - r), cols) for r in range(0, shape[0], self.size)]

    def matrices(self, shape: Sequence[int]) -> list[tuple[int, int, int]]:
        """Matrix blocks as ``(flat_offset, rows, cols)``; empty for non-matrix specs."""
        if not self.is_matrix or math.prod(shape) == 0:
            return []
        if self.kind is BlockKind.EXPERT:
            e, r, c = shape
            return [(i * r * c, r, c) for i in range(e)]
        if len(shape) < 2:
            return []
        cols = _row_numel(shape)
        if self.row_splits is None:
            return [(0, shape[0], cols)]
        out, off = [], 0
        for s in self.row_splits:
            out.append((off, s, cols))
            off += s * cols
        return out


def merge_small_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """The shape blocked Shampoo (and SOAP with ``merge_dims``) works on: size-1 dims dropped,
    then adjacent dims merged from the last one while their product stays <= ``max_dim``.

    The definition of facebookresearch/optimizers ``distributed_shampoo/utils/shampoo_utils.py``
    ``merge_small_dims`` with its default ``target_tensor_dimensionality=1``: ``()`` and all-ones
    shapes give ``(1,)``, a shape with a 0 gives ``(0,)``; e.g. ``(4, 6), 1024 -> (24,)``,
    ``(2, 40, 40), 1024 -> (80, 40)``, ``(1, 45), 4 -> (45,)``, ``(8, 2048, 512), 1024 ->
    (8, 2048, 512)``. Pure; a reshape of the contiguous tensor (no data moves).
    """
    shape = tuple(shape)
    if 0 in shape:
        return (0,)
    rev = [d for d in reversed(shape) if d != 1] or [1]
    out = [rev[0]]
    for d in rev[1:]:
        if out[-1] * d <= max_dim:
            out[-1] *= d
        else:
            out.append(d)
    return tuple(reversed(out))


def _row_numel(shape: Sequence[int]) -> int:
    return math.prod(shape[1:]) if len(shape) >= 1 else 1


def elements(g: int = 1) -> BlockSpec:
    """Blocks of ``g`` consecutive flat elements (AdamW: 1, 8-bit AdamW: 256)."""
    return BlockSpec(BlockKind.ELEMENTS, g)


def rows(k: int) -> BlockSpec:
    """Blocks of ``k`` rows of dim 0 (Shampoo: max_preconditioner_dim; block-wise FP8: 128)."""
    return BlockSpec(BlockKind.ROWS, k)


def whole(*, row_splits: Sequence[int] | None = None) -> BlockSpec:
    """The whole tensor is one matrix block, or a stack of matrices of ``row_splits`` rows."""
    return BlockSpec(BlockKind.WHOLE, 1, tuple(row_splits) if row_splits is not None else None)


def heads(num_rows: int, head_dim: int) -> BlockSpec:
    """Per-head matrix blocks of an attention projection with ``num_rows`` rows."""
    if head_dim < 1 or num_rows % head_dim:
        raise ValueError(f"head_dim {head_dim} must divide the projection's {num_rows} rows")
    return whole(row_splits=[head_dim] * (num_rows // head_dim))


def expert() -> BlockSpec:
    """One ``[r, c]`` matrix per expert of a 3-D ``[E, r, c]`` weight."""
    return BlockSpec(BlockKind.EXPERT)


BlockRule = Callable[[str, torch.Tensor, nn.Module], BlockSpec]
"""``rule(fqn, param, owner_module) -> BlockSpec``; an optimizer's ``blocks`` attribute."""


def default_rule(fqn: str, param: torch.Tensor, module: nn.Module) -> BlockSpec:
    """Plain FSDP: element granularity."""
    return elements(1)


# ---- block boundaries (pure; shared by BlockSpec and the planner's geometry) ---------------------
def align_down(offset: int, numel: int, unit: int, starts: Sequence[int] | None = None) -> int:
    """Largest block boundary <= ``offset`` of a ``numel``-element tensor whose blocks start at every
    multiple of ``unit`` or, when given, at the sorted ``starts`` (0 and ``numel`` are boundaries)."""
    if offset >= numel:
        return numel
    if offset <= 0:
        return 0
    if starts is None:
        return offset - offset % unit
    return starts[bisect.bisect_right(starts, offset) - 1]


def align_up(offset: int, numel: int, unit: int, starts: Sequence[int] | None = None) -> int:
    """Smallest block boundary >= ``offset`` (see ``align_down``)."""
    if offset >= numel:
        return numel
    down = align_down(offset, numel, unit, starts)
    if down == offset:
        return offset
    if starts is None:
        return min(down + unit, numel)
    return starts[bisect.bisect_right(starts, offset)]
