"""``RaggedShard``: the DTensor placement of a sharded parameter's mesh dimension.

[Note: RaggedShard placement]
``RaggedShard(layout, spec)`` on one mesh dimension says: the rank at coordinate ``r`` of that
dimension holds the flat elements ``[bounds[r], bounds[r + 1])`` of the row-major flattened
tensor, ``bounds = layout.bounds`` (a ``plan.RaggedLayout``: contiguous, in coordinate order,
covering the tensor once, possibly empty, possibly uneven). The other mesh dimensions of a
``RaggedDTensor`` are ``Replicate()`` (HSDP's replicas). Its ``to_local()`` is that flat range as a
1-D tensor (for a parameter, a view of its bucket's segment). ``spec`` is the block structure the
planner kept whole (``whole()`` matrices for Muon, ``rows(k)`` strips for Shampoo, ``elements(g)``
quantization blocks...): no rank boundary cuts one of its blocks, except where ``split`` records
that the planner cut matrix blocks on rows for balance.

Placements compare equal when layout, spec and split are equal; two tensors can be combined by a
pointwise op when their layouts (shape and bounds) and meshes are equal.

torch's own sharding propagation does not know this placement: a *stock* ``DTensor`` holding it
(``DTensor.from_local(x, mesh, [RaggedShard(...)])``) would compute ``x * 2`` as if the local piece
were replicated. So the three queries torch's propagation and redistribution make of a placement
(``is_shard`` / ``is_replicate`` / ``is_partial``) raise here, naming the way out: every op a
stock DTensor with this placement attempts fails loudly, while ``RaggedDTensor`` (which never asks
them) handles its own ops (``sharding/_dtensor_ops.py``).
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Placement

from .plan import BlockSpec, RaggedLayout, elements

__all__ = ["RaggedShard", "ragged_dim"]


def _stock_dtensor_error(query: str) -> NotImplementedError:
    return NotImplementedError(
        f"RaggedShard.{query}(): torch's DTensor operators do not know the RaggedShard placement (a rank's "
        "flat, possibly uneven range of the tensor), so a plain torch DTensor must not hold it: it would compute "
        "on the local piece as if it were replicated. Sharded parameters made by fsdp_optim.fully_shard are "
        "RaggedDTensors, which handle their own ops; to make one from a tensor use "
        "fsdp_optim.sharding.distribute_ragged(tensor, device_mesh, placements), and to leave the placement use "
        "t.full_tensor(), t.to_local() or t.redistribute(placements=[Shard(0)] / [Replicate()])"
    )


class RaggedShard(Placement):
    """Rank ``r`` of the mesh dimension holds flat ``[layout.bounds[r], layout.bounds[r + 1])`` of
    the tensor (see [Note: RaggedShard placement]).

    Args:
        layout: the tensor's shape and its ``world_size + 1`` rank bounds (``plan.RaggedLayout``).
        spec: the blocks no rank boundary cuts (default ``elements(1)``: any element boundary).
        split: the planner cut matrix blocks of this tensor on rows (Muon / Shampoo exchange them).
        tp_blocks: under tensor parallelism, the optimizer's blocks of the *global* tensor when the TP
            cut splits them (``layout`` and ``spec`` are the TP-local tensor's; an optimizer that needs
            those blocks whole assembles them over TP or refuses); ``None``: no TP cut splits a block
            ([Note: FSDP x TP]).
    """

    def __init__(
        self, layout: RaggedLayout, spec: BlockSpec | None = None, *, split: bool = False,
        tp_blocks: BlockSpec | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(layout, RaggedLayout):
            raise TypeError(f"RaggedShard takes a RaggedLayout, got {type(layout).__name__}")
        self.layout = layout
        self.spec = spec if spec is not None else elements(1)
        self.split = bool(split)
        self.tp_blocks = tp_blocks

    # ---- what the layout says ----------------------------------------------------------------
    @property
    def bounds(self) -> tuple[int, ...]:
        return self.layout.bounds

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def num_shards(self) -> int:
        return self.layout.world_size

    def range(self, rank: int) -> tuple[int, int]:
        """Flat ``[start, end)`` held by coordinate ``rank`` of the mesh dimension."""
        return self.layout.range(rank)

    def same_layout(self, other: RaggedShard) -> bool:
        """The same elements on the same coordinates (what a pointwise op between two tensors needs)."""
        return self.layout == other.layout

    # ---- Placement protocol ------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RaggedShard)
            and self.layout == other.layout
            and self.spec == other.spec
            and self.split == other.split
            and self.tp_blocks == other.tp_blocks
        )

    def __hash__(self) -> int:
        return hash(("RaggedShard", self.layout, self.spec, self.split, self.tp_blocks))

    def __repr__(self) -> str:
        b = self.layout.bounds
        bounds = list(b) if len(b) <= 9 else f"[{b[0]}, {b[1]}, ..., {b[-2]}, {b[-1]}] ({len(b) - 1} ranks)"
        split = ", split" if self.split else ""
        tp = f", tp_blocks={self.tp_blocks}" if self.tp_blocks is not None else ""
        return f"RaggedShard(shape={self.layout.shape}, bounds={bounds}, spec={self.spec}{split}{tp})"

    __str__ = __repr__

    def __fx_repr__(self):  # pragma: no cover - only torch.fx printing asks
        return repr(self), {}

    def __reduce__(self):
        return (
            _rebuild_ragged_shard, (self.layout.shape, tuple(self.layout.bounds), self.spec, self.split, self.tp_blocks)
        )

    # The queries torch's propagation asks: refused (see [Note: RaggedShard placement]).
    def is_shard(self, dim: int | None = None) -> bool:
        raise _stock_dtensor_error("is_shard")

    def is_replicate(self) -> bool:
        raise _stock_dtensor_error("is_replicate")

    def is_partial(self, reduce_op: str | None = None) -> bool:
        raise _stock_dtensor_error("is_partial")


def _rebuild_ragged_shard(
    shape: tuple[int, ...], bounds: tuple[int, ...], spec: BlockSpec, split: bool, tp_blocks: BlockSpec | None = None
) -> RaggedShard:
    return RaggedShard(RaggedLayout(shape, bounds), spec, split=split, tp_blocks=tp_blocks)


def ragged_dim(placements) -> int | None:
    """The mesh dimension holding the ``RaggedShard`` placement, or ``None``."""
    for i, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            return i
    return None
