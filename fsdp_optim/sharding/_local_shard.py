"""``LocalShard``: what an optimizer reads of one tensor, from the tensor itself.

A sharded parameter is a ``RaggedDTensor`` (``_dtensor.py``): its placement holds the layout and
the block spec, its mesh the shard group and this rank's coordinate. ``local_shard(p)`` reads
them into one small value for optimizer code (which works on ``p.to_local()``, this rank's flat
piece: no DTensor dispatch inside a step). A plain tensor is one rank holding all of it (its spec
from the optimizer's block rule). Nothing is stored on the tensor but what ``fully_shard`` gave it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ._dtensor import RaggedDTensor, coordinate
from ._tensor_parallel import tp_state_mesh
from .plan import BlockRule, BlockSpec, RaggedLayout

__all__ = ["LocalShard", "TensorParallelCut", "local_shard", "local_tensor"]


class TensorParallelCut(NamedTuple):
    """A TP-local tensor whose optimizer blocks span TP ranks ([Note: FSDP x TP] in _tensor_parallel.py):
    it is shard ``rank`` of ``size`` along tensor ``dim`` of a ``global_shape`` tensor whose blocks are
    ``blocks``; the TP ranks are mesh dim ``mesh_dim`` of the tensor's mesh."""

    mesh: DeviceMesh
    mesh_dim: int
    dim: int
    size: int
    rank: int
    global_shape: tuple[int, ...]
    blocks: BlockSpec

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.mesh_dim)

    def group_ranks(self) -> tuple[int, ...]:
        """Each TP coordinate's rank in ``group`` (buffers of a collective go in group-rank order)."""
        coord = self.mesh.get_coordinate()
        ranks = self.mesh.mesh[tuple(slice(None) if i == self.mesh_dim else c for i, c in enumerate(coord))].tolist()
        group_ranks = dist.get_process_group_ranks(self.group)
        return tuple(group_ranks.index(r) for r in ranks)


class LocalShard(NamedTuple):
    """One tensor's layout as this rank sees it: the global shape, the blocks kept whole, every
    rank's flat range, and which range is this rank's."""

    fqn: str
    """The parameter's name from its root (``""`` where unknown: a plain tensor, a gradient, state)."""
    shape: tuple[int, ...]
    """The shape the layout covers: the global shape (the TP-local one under tensor parallelism)."""
    spec: BlockSpec
    layout: RaggedLayout
    """Every rank's flat ``[start, end)`` (``layout.bounds``) over the shard group."""
    rank: int
    """This rank's coordinate in the shard group (its index into ``layout.bounds``)."""
    mesh: DeviceMesh | None = None
    mesh_dim: int = 0
    split: bool = False
    """The planner cut matrix blocks of this tensor on rows (see ``Placement.split``)."""
    tp: TensorParallelCut | None = None
    """Under tensor parallelism, where the TP cut splits the optimizer's blocks of the global tensor
    (``None``: no TP, or a TP cut that keeps every block whole: the TP-local tensor is then a tensor of
    its own for the optimizer). ``shape``, ``spec`` and ``layout`` are the TP-local tensor's."""

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The shard group (``None``: one rank holds all), for reductions over it."""
        if self.mesh is None or self.world_size == 1:
            return None
        return self.mesh.get_group(self.mesh_dim)

    def exchange_group(self) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
        """The shard group for an exchange addressed by coordinate (split matrices and strips), and each
        coordinate's rank in that group (the identity but for a mesh ordered otherwise than its group,
        as an expert-parallel weight's): split sizes and buffers of a collective go in group-rank order."""
        group = self.group
        if group is None:
            return None, tuple(range(self.world_size))
        coord = self.mesh.get_coordinate()
        dim_ranks = self.mesh.mesh[tuple(slice(None) if i == self.mesh_dim else c for i, c in enumerate(coord))]
        group_ranks = dist.get_process_group_ranks(group)
        return group, tuple(group_ranks.index(r) for r in dim_ranks.tolist())

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
    def local_numel(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_whole(self) -> bool:
        """This rank holds the entire tensor (one rank, or a layout that gave it all)."""
        return self.local_numel == self.numel

    def local_view(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (this rank's piece) as ``(rows, *shape[1:])`` when row-aligned, else flat."""
        if self.layout.is_row_aligned() and self.shape:
            return flat.view(self.layout.local_shape(self.rank))
        return flat

    def tp_state_mesh(self) -> DeviceMesh:
        """Under a TP cut (``tp``): the mesh of state the TP ranks own in runs of the tensor's global
        vector, the shard and TP dims merged into one of (shard, TP) cells (``tp_state_mesh``)."""
        if self.tp is None or self.mesh is None:
            raise ValueError(f"{self.fqn or 'this tensor'} has no tensor-parallel cut: its state lies on its own mesh")
        return tp_state_mesh(self.mesh, self.mesh_dim, self.tp.mesh_dim)

    def owned_matrices(self) -> list[tuple[int, int, int]]:
        """Matrix blocks ``(global_flat_offset, rows, cols)`` lying wholly in this rank's range."""
        return [m for m in self.spec.matrices(self.shape) if self.start <= m[0] and m[0] + m[1] * m[2] <= self.end]

    @classmethod
    def whole(cls, shape: tuple[int, ...], spec: BlockSpec, *, fqn: str = "") -> LocalShard:
        """A tensor held whole by one rank (a plain parameter)."""
        return cls(fqn=fqn, shape=tuple(shape), spec=spec, layout=RaggedLayout(tuple(shape), (0, math.prod(shape))), rank=0)


def local_shard(p: torch.Tensor, rule: BlockRule | None = None, *, name: str = "") -> LocalShard | None:
    """``p``'s ``LocalShard``: read from a ``RaggedDTensor``'s placement and mesh; for a plain tensor,
    one rank holding all of it with the spec ``rule`` gives (``None`` without a rule)."""
    if isinstance(p, RaggedDTensor):
        rs = p.ragged
        dim = p.ragged_dim
        mesh = p.device_mesh
        return LocalShard(
            fqn=getattr(p, "_fqn", "") or name, shape=rs.shape, spec=rs.spec, layout=rs.layout,
            rank=coordinate(mesh, dim), mesh=mesh, mesh_dim=dim, split=rs.split, tp=_tp_cut(p, rs),
        )  # fmt: skip
    if rule is None:
        return None
    spec = rule(name, p, None)
    return LocalShard.whole(tuple(p.shape), spec, fqn=name)


def _tp_cut(p: RaggedDTensor, rs) -> TensorParallelCut | None:
    if rs.tp_blocks is None:
        return None
    mesh = p.device_mesh
    (mesh_dim, pl), = [(i, q) for i, q in enumerate(p.placements) if type(q) is Shard]
    return TensorParallelCut(
        mesh, mesh_dim, pl.dim, mesh.size(mesh_dim), coordinate(mesh, mesh_dim), tuple(p.shape), rs.tp_blocks
    )


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's flat piece of a ``RaggedDTensor`` (no copy), a plain tensor as it is."""
    if isinstance(t, RaggedDTensor):
        return t._local_tensor
    return t
