"""ShardInfo: what a sharded parameter knows about itself.

After ``fully_shard`` every managed parameter is an ``nn.Parameter`` whose data is this rank's
*flat* (1-D) piece of the global tensor, a view into the bucket's segment; its ``.grad`` is the
matching flat view into the gradient segment. ``shard_info(p)`` returns the metadata below, or
``None`` for a plain (unsharded) parameter, which optimizers treat as a full tensor.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._expert_parallel import ExpertShard
from .plan import BlockSpec, Placement, RaggedLayout

__all__ = ["ShardInfo", "shard_info", "set_shard_info", "mark_replaced", "was_replaced", "replacement_of", "check_not_replaced"]

_ATTR = "_fsdp_optim_shard"
_REPLACED = "_fsdp_optim_replaced_by"
_REPLACEMENT = "_fsdp_optim_replacement"
_ORIGINALS = "_fsdp_optim_replaced_originals"  # weak references to the objects a parameter replaced


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """Metadata of one sharded parameter on one rank: its ``Placement`` in the plan (name, global
    shape, block spec, ragged ranges, split; the same on every rank) and this rank's view of it."""

    placement: Placement
    """Where the tensor sits in its bucket (``sharding.plan``): name, shape, spec, ranges, split."""
    rank: int
    """This rank's index in the shard group."""
    group: dist.ProcessGroup | None = None
    """The shard group (``None``: the default group)."""
    bucket: int = 0
    """Index of the bucket (communication unit) the parameter lives in."""
    expert: ExpertShard | None = None
    """Expert parallelism: the experts this rank's slice holds. ``shape``, ``layout`` and ``group``
    then describe the local slice ``[E_local, ...]`` sharded over the ranks holding the same experts;
    ``global_shape`` / ``global_start`` place this rank's piece in the whole ``[E, ...]`` tensor."""

    @classmethod
    def of(
        cls,
        *,
        fqn: str,
        shape: tuple[int, ...],
        spec: BlockSpec,
        layout: RaggedLayout,
        rank: int,
        group: dist.ProcessGroup | None = None,
        bucket: int = 0,
        split: bool = False,
        expert: ExpertShard | None = None,
    ) -> ShardInfo:
        """A ``ShardInfo`` from its fields (a tensor alone in its bucket, at offset 0)."""
        placement = Placement(name=fqn, shape=tuple(shape), spec=spec, offset=0, shard=layout, split=split)
        return cls(placement=placement, rank=rank, group=group, bucket=bucket, expert=expert)

    @property
    def fqn(self) -> str:
        """Fully-qualified name from the root module (first name for tied parameters)."""
        return self.placement.name

    @property
    def shape(self) -> tuple[int, ...]:
        """Global shape (of the local slice of experts under expert parallelism)."""
        return self.placement.shape

    @property
    def spec(self) -> BlockSpec:
        return self.placement.spec

    @property
    def layout(self) -> RaggedLayout:
        return self.placement.shard

    @property
    def split(self) -> bool:
        """A matrix block of this parameter is cut across ranks (see ``Placement.split``)."""
        return self.placement.split

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def start(self) -> int:
        return self.layout.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.layout.bounds[self.rank + 1]

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (``shape`` unless expert parallel)."""
        return self.shape if self.expert is None else self.expert.global_shape

    @property
    def global_start(self) -> int:
        """Where this rank's piece starts in the whole tensor, row-major flat (``start`` unless expert
        parallel: the local slice begins at expert ``first_expert``)."""
        if self.expert is None:
            return self.start
        return self.expert.first_expert * math.prod(self.shape[1:]) + self.start

    @property
    def local_numel(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_whole(self) -> bool:
        """This rank holds the entire tensor (W = 1, or a ragged plan gave it all)."""
        return self.local_numel == self.numel

    def local_view(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (this rank's piece) as ``(rows, *shape[1:])`` when row-aligned, else flat."""
        if self.layout.is_row_aligned() and self.shape:
            return flat.view(self.layout.local_shape(self.rank))
        return flat

    def owned_matrices(self) -> list[tuple[int, int, int]]:
        """Matrix blocks ``(global_flat_offset, rows, cols)`` lying wholly in this rank's range."""
        return [m for m in self.spec.matrices(self.shape) if self.start <= m[0] and m[0] + m[1] * m[2] <= self.end]


def shard_info(p: torch.Tensor) -> ShardInfo | None:
    """The ``ShardInfo`` of a sharded parameter, ``None`` for a plain one."""
    return getattr(p, _ATTR, None)


def set_shard_info(p: torch.Tensor, info: ShardInfo | None) -> None:
    setattr(p, _ATTR, info)


def mark_replaced(p: object, fqn: str, *, replacement: torch.Tensor | None = None) -> None:
    """Mark a parameter object that ``fully_shard`` replaced (an optimizer holding it trains nothing),
    and, when given, the parameter that replaced it (a weak reference; see ``replacement_of``).

    The name is the newest call's: an inner call names parameters from its own module (``0.weight``),
    and the root that absorbs it renames them from the root (``layers.0.0.weight``), here and on
    every earlier object it replaced (weak back-references), so errors name them unambiguously. A
    later mark without a replacement (an absorbed bucket's release) keeps the name already given."""
    if not isinstance(p, torch.Tensor):
        return
    try:
        if replacement is None and getattr(p, _REPLACED, None) is not None:
            return
        earlier = [o for o in (ref() for ref in getattr(p, _ORIGINALS, ())) if o is not None]
        for o in earlier:
            setattr(o, _REPLACED, fqn)
        setattr(p, _REPLACED, fqn)
        if replacement is not None:
            setattr(p, _REPLACEMENT, weakref.ref(replacement))
            setattr(replacement, _ORIGINALS, [weakref.ref(o) for o in (*earlier, p)])
    except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - tensors that refuse attributes
        pass


def was_replaced(p: torch.Tensor) -> bool:
    """Whether ``fully_shard`` replaced the parameter object ``p``."""
    return getattr(p, _REPLACED, None) is not None


def replacement_of(p: torch.Tensor) -> torch.Tensor | None:
    """The live parameter that (through any number of ``fully_shard`` calls) replaced ``p``; ``None``
    if ``p`` was not replaced or its replacement is gone. Used to keep a parameter shared with a
    module outside an inner ``fully_shard`` call tied (that module still holds the original)."""
    if not was_replaced(p):
        return None
    cur = p
    while was_replaced(cur):
        ref = getattr(cur, _REPLACEMENT, None)
        nxt = ref() if ref is not None else None
        if nxt is None:
            return None
        cur = nxt
    return cur


def check_not_replaced(params: Iterable[torch.Tensor], *, owner: str) -> None:
    """``ValueError`` if any of ``params`` is a parameter object that ``fully_shard`` replaced."""
    for p in params:
        fqn = getattr(p, _REPLACED, None)
        if fqn is not None:
            raise ValueError(
                f"{owner} holds parameter {fqn or '<unnamed>'} (shape {tuple(p.shape)}) that fully_shard replaced "
                "with a sharded parameter: it would never be updated. Build the optimizer after the outermost "
                "fully_shard call (the root), from model.parameters()"
            )
