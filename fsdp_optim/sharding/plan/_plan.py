"""Plan data model: what the planner decides for every bucket and tensor.

A bucket is laid out in one *global* flat buffer; rank ``r`` stores the segment
``[rank_bounds[r], rank_bounds[r + 1])`` of it. Tensors sit at ``offset`` in that buffer,
contiguous, with padding only between tensors. From the two follows each tensor's
``RaggedLayout`` (its own per-rank element ranges).

- EVEN buckets: ``rank_bounds[r] == r * S`` (one ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor``), padding where a block would otherwise cross a rank boundary.
- RAGGED buckets: segments of any size (some empty), zero padding, uneven collectives.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ._blocks import BlockSpec, default_rule
from ._ragged import RaggedLayout
from ._report import plan_report, plan_stats

__all__ = ["Layout", "TensorSpec", "Placement", "BucketPlan", "Plan", "PlanConfig", "LocalPiece", "config_for_rules"]


class Layout(enum.Enum):
    EVEN = "even"
    RAGGED = "ragged"


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Planner input for one tensor of a bucket."""

    name: str
    shape: tuple[int, ...]
    spec: BlockSpec
    itemsize: int = 4
    align_rows: int | None = None
    """If set, rank boundaries inside this tensor must also fall on multiples of this many rows of
    dim 0 (block-wise FP8 all-gather: the tile height, 128 or 1), on top of ``spec``'s block
    boundaries. ``spec`` stays what the optimizer sees; see [Note: FP8 all-gather invariant] in
    ``_float8.py``. ``None``: no extra constraint."""

    def __post_init__(self) -> None:
        if self.align_rows is not None and (not isinstance(self.align_rows, int) or self.align_rows < 1):
            raise ValueError(
                f"TensorSpec.align_rows must be None or an int >= 1, got {self.align_rows!r} for {self.name}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """Knobs of the planner (see docs/architecture.md, Planner, and [Note: balance cap] in ``_planner.py``).

    Which optimizers accept split blocks (``Placement.split``): Muon (matrix blocks) and Shampoo
    (``rows(k)`` strips) do (one ``all_to_all`` pair per step exchanges them). SOAP and
    ``WholeTensorOptimizer`` refuse a rank boundary inside their blocks: plan them with
    ``balance="whole"`` (their plans
    then keep every block whole and warn when the cap is missed, naming the HSDP shard size that
    would balance). Element-wise optimizers (AdamW, 8-bit AdamW) have no matrix blocks to split.
    """

    layout: str = "auto"
    """``"even"``, ``"ragged"`` or ``"auto"`` (the cost model picks per bucket)."""
    padding_cap: float = 0.02
    """Even layout: largest padding (fraction of the bucket) tolerated to keep matrix blocks whole;
    beyond it a matrix block is split on rows and recorded."""
    align: int = 1
    """Even layout: the per-rank segment size S is a multiple of this many elements."""
    wire: str = "auto"
    """Ragged buckets on the wire: ``"grouped"`` (per-owner list collectives), ``"padded"`` (one
    tensor collective over segments padded to the largest) or ``"auto"`` (the cheaper by the
    alpha-beta model on NCCL, grouped elsewhere; see [Note: wire format] in ``_wire.py``)."""
    balance: str = "auto"
    """``"auto"``: when whole blocks leave the busiest rank above ``balance_cap`` times the mean,
    matrix blocks and ``rows(k)`` strips are cut on rows where the balance needs it (Muon, Shampoo; see the class docstring).
    ``"whole"``: never cut a block for balance; warn when the cap is missed, naming the HSDP shard
    size that would balance."""
    piece_align_bytes: int = 64
    """Every tensor's local piece starts at a multiple of this many bytes of its rank's segment (and
    even segments are multiples of it): GPU vectorized kernels need 16 B, MKL's results on AVX-512
    depend on operand alignment. Costs padding after each tensor (ragged buckets too); 1 turns it
    off (the layout before issue 27). See [Note: aligned pieces] in ``_geom.py``."""
    balance_cap: float = 1.10
    """Largest rank's stored bytes (padding included) over the mean parameter bytes per rank that
    the plan may reach before ``balance="auto"`` splits blocks."""

    def __post_init__(self) -> None:
        if self.layout not in ("even", "ragged", "auto"):
            raise ValueError(f"layout must be 'even', 'ragged' or 'auto', got {self.layout!r}")
        if not 0.0 <= self.padding_cap:
            raise ValueError(f"padding_cap must be >= 0, got {self.padding_cap}")
        if self.align < 1:
            raise ValueError(f"align must be >= 1, got {self.align}")
        if self.wire not in ("auto", "grouped", "padded"):
            raise ValueError(f"wire must be 'auto', 'grouped' or 'padded', got {self.wire!r}")
        if isinstance(self.piece_align_bytes, bool) or not isinstance(self.piece_align_bytes, int) or self.piece_align_bytes < 1:
            raise ValueError(
                f"piece_align_bytes must be an int >= 1 (64: cache lines, 16: GPU vector loads, 1: no alignment), "
                f"got {self.piece_align_bytes!r}"
            )
        if self.balance not in ("auto", "whole"):
            raise ValueError(
                f"balance must be 'auto' (split matrix blocks where whole ones miss balance_cap) or 'whole' "
                f"(never split for balance), got {self.balance!r}"
            )
        if not (isinstance(self.balance_cap, (int, float)) and math.isfinite(self.balance_cap) and self.balance_cap >= 1.0):
            raise ValueError(
                f"balance_cap must be a finite number >= 1.0 (largest rank's bytes over the mean; 1.10 allows 10%), "
                f"got {self.balance_cap!r}"
            )


class LocalPiece(tuple):
    """``(index, seg_offset, start, end)``: tensor ``index`` of the bucket has its elements
    ``[start, end)`` at ``seg_offset`` in this rank's segment (a NamedTuple-like tuple)."""

    __slots__ = ()

    def __new__(cls, index: int, seg_offset: int, start: int, end: int):
        return tuple.__new__(cls, (index, seg_offset, start, end))

    index = property(lambda self: self[0])
    seg_offset = property(lambda self: self[1])
    start = property(lambda self: self[2])
    end = property(lambda self: self[3])


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one tensor sits in its bucket."""

    name: str
    shape: tuple[int, ...]
    spec: BlockSpec
    offset: int
    """Start of the tensor in the bucket's global flat buffer."""
    shard: RaggedLayout
    """This tensor's per-rank element ranges."""
    split: bool = False
    """A matrix block of this tensor was cut across ranks (the optimizer exchanges it)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def split_matrices(self) -> list[tuple[int, int, int]]:
        """The matrix blocks (or ``rows(k)`` strips) ``(flat_offset, rows, cols)`` that some rank boundary cuts."""
        if not self.split:
            return []
        bounds = self.shard.bounds
        n = self.numel
        # the distinct rank bounds strictly inside the tensor (lazy bounds answer without O(W) work)
        inner = bounds.inner() if hasattr(bounds, "inner") else sorted({b for b in bounds if 0 < b < n})
        out = []
        for m in self.spec.row_blocks(self.shape):
            i = bisect.bisect_right(inner, m[0])
            if i < len(inner) and inner[i] < m[0] + m[1] * m[2]:
                out.append(m)
        return out


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """The layout of one bucket (one communication unit)."""

    name: str
    layout: Layout
    placements: tuple[Placement, ...]
    rank_bounds: tuple[int, ...]
    itemsize: int = 4

    @property
    def world_size(self) -> int:
        return len(self.rank_bounds) - 1

    @property
    def total_numel(self) -> int:
        """Elements of the global flat buffer, padding included."""
        return self.rank_bounds[-1]

    @property
    def param_numel(self) -> int:
        return sum(p.numel for p in self.placements)

    @property
    def padding(self) -> int:
        return self.total_numel - self.param_numel

    def segment(self, rank: int) -> tuple[int, int]:
        return self.rank_bounds[rank], self.rank_bounds[rank + 1]

    def segment_numel(self, rank: int) -> int:
        return self.rank_bounds[rank + 1] - self.rank_bounds[rank]

    @property
    def segment_sizes(self) -> list[int]:
        return [self.segment_numel(r) for r in range(self.world_size)]

    def local_pieces(self, rank: int) -> list[LocalPiece]:
        """The tensors (or parts) stored in ``rank``'s segment."""
        s0, _ = self.segment(rank)
        out = []
        for i, p in enumerate(self.placements):
            a, b = p.shard.range(rank)
            if b > a:
                out.append(LocalPiece(i, p.offset + a - s0, a, b))
        return out

    @property
    def num_split_blocks(self) -> int:
        return sum(len(p.split_matrices()) for p in self.placements)

    def check(self) -> None:
        """Internal invariants (asserts: a violation is a planner bug, not a user error)."""
        w = self.world_size
        assert self.rank_bounds[0] == 0 and all(
            a <= b for a, b in zip(self.rank_bounds, self.rank_bounds[1:])
        ), self.rank_bounds
        if self.layout is Layout.EVEN:
            s = self.rank_bounds[1]
            assert all(self.rank_bounds[r] == r * s for r in range(w + 1)), "even bucket with uneven segments"
        else:  # ragged: padding only to round each tensor up to the alignment quantum
            assert 0 <= self.padding < max(len(self.placements), 1) * 64, "ragged bucket with padding beyond alignment"
        end = 0
        for p in self.placements:
            assert p.offset >= end, f"{p.name} overlaps the previous tensor"
            end = p.offset + p.numel
            assert end <= self.total_numel
            for r in range(w + 1):
                want = min(max(self.rank_bounds[r] - p.offset, 0), p.numel)
                assert p.shard.bounds[r] == want, (p.name, r, p.shard.bounds, want)
            if not p.split:
                assert p.shard.is_aligned(p.spec), f"{p.name}: a rank boundary cuts a {p.spec} block"
            else:
                assert p.spec.splits_on_rows
                assert all(b % p.spec.split_unit(p.shape) == 0 for b in p.shard.bounds), p.name


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The plan of a whole model: one ``BucketPlan`` per bucket, balanced over all of them."""

    world_size: int
    buckets: tuple[BucketPlan, ...]
    config: PlanConfig = field(default_factory=PlanConfig)
    seconds: float = field(default=0.0, compare=False)
    """Wall time of planning (not part of equality: equal plans may take different times)."""
    packings: int = field(default=0, compare=False)
    """Packings tried while planning (``_work``): the planner's work, counted, the same on every machine."""
    balance_note: str = ""
    """One line on the balance choice (whole blocks kept, or blocks split and why, with the figures);
    what ``fully_shard`` logs. Empty for a one-rank plan."""
    balance_shard_size: int | None = None
    """Whole blocks above the cap without a split (``balance="whole"``, or no matrix blocks): the
    largest HSDP shard size found whose whole-block plan balances within the cap; None otherwise."""

    def stats(self):
        """Whole-model figures (padding, splits, per-rank bytes and cost balance): a ``PlanStats``."""
        return plan_stats(self)

    def report(self) -> str:
        """Layout per bucket, padding %, split blocks and their bytes, per-rank bytes and cost
        max/mean, bytes per collective."""
        return plan_report(self)


def config_for_rules(config: PlanConfig, rules: Iterable[Callable]) -> PlanConfig:
    """``config`` with ``balance="auto"`` kept only where every block rule says its optimizer takes
    blocks split across ranks (``rule.splits_blocks``: Muon's and Shampoo's) or has no blocks to split
    (the default element rule): SOAP, ``WholeTensorOptimizer`` and unknown rules get ``"whole"``,
    since a split would be refused at the optimizer's first step (the planner warns instead when whole
    blocks miss the cap, naming the HSDP shard size that would balance)."""
    if config.balance == "auto" and not all(getattr(r, "splits_blocks", False) or r is default_rule for r in rules):
        return dataclasses.replace(config, balance="whole")
    return config
