"""Tensor-parallel parameters under ``fully_shard``: what a TP DTensor brings, and the (dp, tp) mesh.

[Note: FSDP x TP]
``parallelize_module(model, mesh["tp"], plan)`` leaves each parallelized parameter a torch
``DTensor`` on the 1-D TP mesh (``Shard(0)`` for ``ColwiseParallel``'s weight, ``Shard(1)`` for
``RowwiseParallel``'s, ``Replicate()`` for ``SequenceParallel``'s norms); its local tensor is this
TP rank's slice. ``fully_shard(block, mesh=mesh["dp"])`` then shards that *TP-local tensor* over the
data-parallel ranks exactly as it shards a plain parameter: the planner sees the TP-local shapes,
the buffers hold TP-local pieces, all-gathers and reduce-scatters stay on the data-parallel group.
Every TP rank plans identical TP-local shapes (a TP dim must divide evenly: checked, with the
parameter named), so the plan, and hence the data-parallel owner of every block, is the same on
every TP rank (agreed at setup over the TP group: a mismatch raises everywhere). So the TP shards of
one matrix sit on the same data-parallel coordinate of every TP rank: an optimizer that needs the
whole matrix (Muon) assembles it inside one TP group, never across data-parallel ranks.

What torch sees:
- the sharded parameter: a ``RaggedDTensor`` of the *global* shape on the (dp, tp) mesh (HSDP x TP:
  (replicate, shard, tp)) with placements ``(RaggedShard(layout of the TP-local shape), Shard(d))``
  (or ``Replicate()`` on tp). The order is the TP shard first, then the ragged range of it (what
  FSDP2 writes as ``_StridedShard`` for ``Shard(0)`` on both): this rank's local piece is the flat
  range ``[bounds[r], bounds[r + 1])`` of the row-major flattened TP-local tensor. Reductions are
  ``Partial`` on every dim that shards (ragged and ``Shard``), ``full_tensor()`` gathers both, DCP
  writes N-D boxes offset by the TP slice;
- while gathered, the modules hold the unsharded parameter as torch's ``DTensor`` on the TP mesh
  with the original placement (a view of the gathered buffer), so the TP plan's forward runs
  unchanged; its gradient (a ``Partial`` one, for a ``Replicate()`` weight under sequence
  parallelism, is first reduced over TP as FSDP2 does) is copied into the reduction buffer as a
  TP-local tensor.
The mesh is built from the two groups (``DeviceMesh.from_group``): the grid is learned from the
TP group (each TP rank's data-parallel ranks), which also checks the two meshes tile one grid.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .plan import BlockSpec

__all__ = ["TensorParallel", "has_tp", "join_meshes", "tensor_parallel_of", "tp_cuts_blocks", "tp_local_shape", "tp_offsets", "tp_slice", "tp_state_mesh"]


class TensorParallel(NamedTuple):
    """What a TP ``DTensor`` parameter brings to ``fully_shard``: its TP mesh and placement."""

    mesh: DeviceMesh
    """The 1-D TP mesh."""
    placement: Placement
    """``Shard(d)`` (d >= 0) or ``Replicate()``."""
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    @property
    def dim(self) -> int | None:
        """The tensor dim TP shards, or ``None`` (replicated over TP)."""
        return self.placement.dim if isinstance(self.placement, Shard) else None


def _where(fqn: str, p: DTensor) -> str:
    return f"parameter {fqn} (shape {tuple(p.shape)}, placements {tuple(p.placements)}, mesh {p.device_mesh})"


def tensor_parallel_of(p: torch.Tensor, fqn: str) -> TensorParallel | None:
    """``p``'s TP layout if it is a torch ``DTensor`` (``parallelize_module``'s), else ``None``.
    Raises naming the parameter, its shape and mesh for layouts ``fully_shard`` does not take."""
    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"fully_shard: {_where(fqn, p)} lives on a {mesh.ndim}-D mesh; tensor-parallel parameters must be on the "
            "1-D TP mesh (parallelize_module(model, mesh['tp'], plan)), and fully_shard takes the data-parallel mesh "
            "(mesh['dp'], or mesh['dp_replicate', 'dp_shard'] for HSDP)"
        )
    (pl,) = p.placements
    if type(pl) is Shard:
        d = pl.dim % p.ndim
        n = mesh.size()
        if p.shape[d] % n:
            raise ValueError(
                f"fully_shard: {_where(fqn, p)}: dim {d} (size {p.shape[d]}) does not divide by the TP size {n}; every "
                "TP rank must hold the same TP-local shape (so every TP rank plans the same layout). Choose a TP size "
                "that divides it (heads and hidden sizes by tp), or leave this module out of the TP plan"
            )
        local = list(p.shape)
        local[d] //= n
        return TensorParallel(mesh, Shard(d), tuple(p.shape), tuple(local))
    if type(pl) is Replicate:
        return TensorParallel(mesh, Replicate(), tuple(p.shape), tuple(p.shape))
    raise ValueError(
        f"fully_shard: {_where(fqn, p)}: placement {pl} is not taken; a tensor-parallel parameter must be Shard(d) "
        "or Replicate() on the TP mesh (torch's ColwiseParallel / RowwiseParallel / SequenceParallel give these)"
    )


# ---- index arithmetic (pure) ----------------------------------------------------------------------
def tp_local_shape(shape: tuple[int, ...], placements, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape after the ``Shard`` placements (even division, checked by ``tensor_parallel_of``)."""
    out = list(shape)
    for pl, n in zip(placements, mesh_shape):
        if type(pl) is Shard:
            out[pl.dim] //= n
    return tuple(out)


def tp_offsets(shape: tuple[int, ...], placements, mesh_shape: tuple[int, ...], coord) -> tuple[int, ...]:
    """Where this rank's TP-local tensor starts in the global tensor, per dim."""
    off = [0] * len(shape)
    local = tp_local_shape(shape, placements, mesh_shape)
    for pl, c in zip(placements, coord):
        if type(pl) is Shard:
            off[pl.dim] += c * local[pl.dim]
    return tuple(off)


def tp_slice(full: torch.Tensor, placements, mesh_shape: tuple[int, ...], coord) -> torch.Tensor:
    """This rank's TP-local part of the global tensor ``full`` (a view)."""
    local = tp_local_shape(tuple(full.shape), placements, mesh_shape)
    off = tp_offsets(tuple(full.shape), placements, mesh_shape, coord)
    out = full
    for d, (o, n) in enumerate(zip(off, local)):
        if n != full.shape[d]:
            out = out.narrow(d, o, n)
    return out


def tp_cuts_blocks(
    global_spec: BlockSpec, global_shape: tuple[int, ...], local_spec: BlockSpec, local_shape: tuple[int, ...],
    dim: int, size: int, *, fqn: str = "",
) -> bool:
    """Whether the TP cut (``size`` shards along tensor ``dim``) splits one of the optimizer's blocks of
    the global tensor (``global_spec``). Element blocks never count: element-wise state, and
    quantization blocks formed on the TP-local tensor (as torchao on a TP shard). A cut on a dim > 0
    splits every row-spanning block; a cut on dim 0 at flat ``t * local_numel`` splits a block unless
    each cut falls on a block boundary, and then the TP-local spec must give the same blocks as the
    global one there (else the block rule disagrees with itself: raised)."""
    from .plan import BlockKind

    if size == 1 or global_spec.kind is BlockKind.ELEMENTS:
        return False
    if dim != 0:
        return True
    n = math.prod(local_shape)
    if not all(global_spec.is_boundary(global_shape, t * n) for t in range(1, size)):
        return True
    local_starts = set(local_spec.block_starts(local_shape)) if n else {0}
    global_in_first = {s for s in global_spec.block_starts(global_shape) if s <= n}
    if local_starts != global_in_first:
        raise ValueError(
            f"fully_shard: the block rule gives the tensor-parallel parameter {fqn} {global_spec} blocks at its "
            f"global shape {global_shape} but {local_spec} at its TP-local shape {local_shape}, which are not the "
            "same blocks; a rule must derive blocks the TP cut keeps whole from what it is given (e.g. "
            "Muon.rule(head_dims=...) per head)"
        )
    return False


def has_tp(placements) -> bool:
    return any(type(p) is Shard for p in placements)


# ---- the (dp, tp) mesh ----------------------------------------------------------------------------
def join_meshes(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, dp_grids: list[list]) -> DeviceMesh:
    """The mesh ``dp_mesh``'s dims + the TP dim. ``dp_grids[t]``: the data-parallel mesh (its rank
    tensor, as a list) of TP rank ``t`` of this rank's TP group, learned over that group. Raises if
    the two meshes do not tile one grid (TP rank ``t`` of every data-parallel coordinate's TP group
    must be the ``t``-th entry there)."""
    grid = torch.stack([torch.tensor(g) for g in dp_grids], dim=-1)  # [..dp dims.., tp]
    tp_ranks = tp_mesh.mesh.tolist()
    coord = dp_mesh.get_coordinate()
    mine = grid[tuple(coord)].tolist()
    if mine != tp_ranks:
        raise ValueError(
            f"fully_shard: the data-parallel mesh {dp_mesh} and the TP mesh {tp_mesh} of the parameters do not tile "
            f"one grid (this rank's TP group is {tp_ranks}, but the TP ranks' data-parallel meshes give {mine}); build "
            "both from one mesh: mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), then "
            "parallelize_module(model, mesh['tp'], plan) and fully_shard(block, mesh=mesh['dp'])"
        )
    names = tuple(dp_mesh.mesh_dim_names or (f"dp{i}" for i in range(dp_mesh.ndim)))
    tp_name = (tp_mesh.mesh_dim_names or ("tp",))[0]
    if tp_name in names:
        tp_name = "tp"
    groups = [dp_mesh.get_group(i) for i in range(dp_mesh.ndim)] + [tp_mesh.get_group(0)]
    return DeviceMesh.from_group(groups, dp_mesh.device_type, mesh=grid, mesh_dim_names=(*names, tp_name))


_STATE_MESHES: dict[tuple, DeviceMesh] = {}


def tp_state_mesh(mesh: DeviceMesh, ragged_dim: int, tp_dim: int) -> DeviceMesh:
    """``mesh`` with its data-parallel shard dim ``ragged_dim`` and its TP dim ``tp_dim`` merged into one
    dim of (shard coordinate, TP coordinate) cells in that order (the other dims, HSDP's replicate one,
    kept): the mesh of optimizer state that TP ranks own in runs of a tensor's global per-block vector
    ([Note: preconditioner blocks under tensor parallelism] in optimizers/_tp_runs.py). Made once per
    mesh: each rank makes the process group of its own cells (``use_local_synchronization``, the world
    group where the cells are the whole world), so the call is collective over those cells only."""
    if tp_dim != ragged_dim + 1:
        raise ValueError(f"tp_state_mesh: the TP dim {tp_dim} must follow the shard dim {ragged_dim} on {mesh}")
    key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), ragged_dim, id(mesh.get_group(ragged_dim)))
    out = _STATE_MESHES.get(key)
    if out is not None:
        return out
    if tp_dim != mesh.ndim - 1:
        raise ValueError(f"tp_state_mesh: the TP dim {tp_dim} must be the last of {mesh}")
    shape = list(mesh.mesh.shape)
    merged = mesh.mesh.reshape(*shape[:ragged_dim], shape[ragged_dim] * shape[tp_dim])
    mine = merged[tuple(mesh.get_coordinate()[:ragged_dim])]  # this rank's cells (a 1-D tensor of ranks)
    cells = mine.tolist()
    if sorted(cells) == list(range(dist.get_world_size())):
        group = dist.group.WORLD
    else:
        group = dist.new_group(sorted(cells), use_local_synchronization=True)
    groups = [mesh.get_group(i) for i in range(ragged_dim)] + [group]
    names = tuple(mesh.mesh_dim_names or ())
    dim_names = (*names[:ragged_dim], f"{names[ragged_dim]}_{names[tp_dim]}") if names else None
    out = DeviceMesh.from_group(groups, mesh.device_type, mesh=merged, mesh_dim_names=dim_names)
    _STATE_MESHES[key] = out
    return out
