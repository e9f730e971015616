"""``RaggedDTensor``: a sharded parameter (its gradient, its optimizer state) as torch sees it: a
``torch.distributed.tensor.DTensor`` of the global shape whose placement on the shard mesh
dimension is ``RaggedShard`` (``_placement.py``), computing its own ops (``_dtensor_ops.py``).

[Note: why a DTensor subclass]
Two routes give a DTensor a placement torch does not have (spiked on torch 2.13; docs/dtensor.md):
(a) a ``Placement`` subclass handed to the stock ``DTensor`` with sharding strategies registered for
it: torch's single-dim strategies build sharded placements only from ``Shard`` / ``_StridedShard``,
the propagator calls the placement's ``is_shard`` / ``is_partial`` / ``==``, and every op without a
strategy for it silently treats the local piece as replicated (``x * 2`` returned a ``Replicate()``
DTensor holding one rank's piece); covering "every other op raises" would mean overriding torch's
whole strategy table; (b) a ``DTensor`` subclass whose ``__torch_dispatch__`` handles the ops that
are exact on flat pieces and refuses the rest (torch 2.13's ``DTensor.__torch_dispatch__`` is
documented for subclasses; the C++ fast path serves only the base class). (b) is what this file is:
``isinstance(p, DTensor)`` holds, ``p.shape`` / ``p.ndim`` are global, ``placements`` /
``device_mesh`` / ``to_local`` / ``full_tensor`` / ``redistribute`` and DCP's hooks are DTensor's
API, and no op can fall through to torch's propagation. The placement itself refuses torch's
propagation queries, so a stock DTensor that somehow holds it fails loudly too.

Conventions: the local tensor is 1-D (this rank's flat range); mesh dimensions other than the
ragged one are ``Replicate()`` (HSDP replicas) or a tensor-parallel ``Shard(d)``, which applies first:
the layout then covers the TP-local tensor ([Note: FSDP x TP]); coordinates along the ragged
dimension are ``bounds`` indices.
Collectives over the ragged dimension use its process group in coordinate order (a mesh whose
coordinate order is not its group's rank order is mapped, see ``_coordinate_order``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from ._dtensor_ops import dispatch
from ._placement import RaggedShard, ragged_dim
from ._tensor_parallel import has_tp, tp_local_shape, tp_offsets, tp_slice
from .plan import RaggedLayout, flat_range_boxes

__all__ = ["RaggedDTensor", "coordinate", "distribute_ragged", "is_ragged", "ragged_spec"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


def ragged_spec(
    mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int], dtype: torch.dtype
) -> DTensorSpec:
    """The ``DTensorSpec`` of a RaggedDTensor: checked (one ``RaggedShard`` whose layout has the
    tensor's shape, or its TP-local shape, and one range per coordinate; the other dims
    ``Replicate()`` or a tensor-parallel ``Shard(d)``, [Note: FSDP x TP])."""
    placements = tuple(placements)
    shape = tuple(int(s) for s in shape)
    if len(placements) != mesh.ndim:
        raise ValueError(f"RaggedDTensor: {len(placements)} placements for a {mesh.ndim}-D mesh {mesh}")
    dim = ragged_dim(placements)
    if dim is None:
        raise ValueError(f"RaggedDTensor: placements {placements} hold no RaggedShard")
    for i, p in enumerate(placements):
        if i != dim and not (type(p) is Replicate or (type(p) is Shard and 0 <= p.dim < len(shape))):
            raise ValueError(
                f"RaggedDTensor: mesh dim {i} has placement {p}; the dims other than the RaggedShard one must be "
                "Replicate() (HSDP replicas) or Shard(d) (tensor parallel, [Note: FSDP x TP])"
            )
    rs = placements[dim]
    local_shape = tp_local_shape(shape, placements, tuple(mesh.shape))
    if rs.shape != local_shape:
        what = "the tensor's shape" if local_shape == shape else "its shape after the tensor-parallel Shard placements"
        raise ValueError(f"RaggedDTensor: RaggedShard layout shape {rs.shape} is not {what} {local_shape}")
    if rs.num_shards != mesh.size(dim):
        raise ValueError(
            f"RaggedDTensor: RaggedShard has {rs.num_shards} ranges but mesh dim {dim} has {mesh.size(dim)} ranks"
        )
    stride = tuple(int(s) for s in torch.empty(shape, device="meta").stride())
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def coordinate(mesh: DeviceMesh, dim: int) -> int:
    """This rank's coordinate on mesh dimension ``dim`` (read from the mesh's layout: no process group
    is asked, so a mesh made without one, as tests emulate a rank with, works too)."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the mesh {mesh}")
    return coord[dim]


def is_ragged(t: Any) -> bool:
    """Whether ``t`` is a ``RaggedDTensor`` (a sharded parameter, its gradient or optimizer state)."""
    return isinstance(t, RaggedDTensor)


class RaggedDTensor(DTensor):
    """A ``DTensor`` whose placement on one mesh dimension is ``RaggedShard``: this rank holds a flat,
    possibly uneven, possibly empty range of the row-major flattened tensor (see
    [Note: RaggedShard placement] and [Note: why a DTensor subclass]).

    Made by ``fully_shard`` for every parameter it shards (its ``.grad`` and torch optimizers'
    state follow), by ``distribute_ragged`` from a tensor, or ``RaggedDTensor.from_local``."""

    @staticmethod
    def _from_local_and_spec(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> RaggedDTensor:
        """No checks (the ops' hot path): ``local`` is this rank's 1-D piece under ``spec``."""
        return RaggedDTensor(local, spec, requires_grad=requires_grad)

    @staticmethod
    def from_local(  # type: ignore[override]
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        shape: Sequence[int] | None = None,
        requires_grad: bool = False,
        **_: Any,
    ) -> RaggedDTensor:
        """This rank's flat piece ``local_tensor`` (any shape, ``numel`` = its range) of a tensor laid out
        by ``placements`` (one ``RaggedShard``) on ``device_mesh``. A view, not a copy, when contiguous."""
        if device_mesh is None or placements is None:
            raise ValueError("RaggedDTensor.from_local needs device_mesh and placements (with one RaggedShard)")
        dim = ragged_dim(placements)
        if dim is None:
            raise ValueError(f"RaggedDTensor.from_local: placements {tuple(placements)} hold no RaggedShard")
        shape = tuple(shape) if shape is not None else placements[dim].shape
        spec = ragged_spec(device_mesh, placements, shape, local_tensor.dtype)
        a, b = placements[dim].range(coordinate(device_mesh, dim))
        if local_tensor.numel() != b - a:
            raise ValueError(
                f"RaggedDTensor.from_local: the local piece has {local_tensor.numel()} elements but the RaggedShard "
                f"gives coordinate {coordinate(device_mesh, dim)} the range [{a}, {b}) of shape {shape}"
            )
        return RaggedDTensor(local_tensor.reshape(-1), spec, requires_grad=requires_grad)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        return dispatch(RaggedDTensor, func, args, kwargs)

    # ---- what this rank holds ----------------------------------------------------------------
    @property
    def ragged(self) -> RaggedShard:
        """The ``RaggedShard`` placement (the layout)."""
        return self._spec.placements[ragged_dim(self._spec.placements)]

    @property
    def ragged_dim(self) -> int:
        """The mesh dimension the tensor is sharded over."""
        return ragged_dim(self._spec.placements)

    @property
    def shard_rank(self) -> int:
        """This rank's coordinate on the ragged mesh dimension (its index into ``ragged.bounds``)."""
        return coordinate(self._spec.mesh, self.ragged_dim)

    @property
    def local_range(self) -> tuple[int, int]:
        """This rank's flat ``[start, end)`` in the row-major flattened tensor."""
        return self.ragged.range(self.shard_rank)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape the ragged layout covers: the global shape, or under tensor parallelism the TP-local
        shape ([Note: FSDP x TP])."""
        return self.ragged.shape

    def _tp_local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local part of a global-shape tensor (itself without tensor parallelism)."""
        spec = self._spec
        if not has_tp(spec.placements):
            return full
        return tp_slice(full, spec.placements, tuple(spec.mesh.shape), spec.mesh.get_coordinate())

    @property
    def data(self) -> RaggedDTensor:  # type: ignore[override]
        """A detached alias (the same local piece), as ``Tensor.data``."""
        return RaggedDTensor(self._local_tensor.detach(), self._spec, requires_grad=False)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``p.data = v`` copies ``v`` into this tensor's local piece in place: a sharded parameter's piece
        is a view of its bucket's segment, which the runtime gathers from, so the object and its storage
        stay (torch's ``set_data`` would change neither the piece nor the segment: a silent no-op).
        ``v``: a ``RaggedDTensor`` of this layout, a DTensor replicated everywhere, or a plain tensor of
        the global shape (this rank's range is taken); its dtype must be this tensor's."""
        if value.dtype != self.dtype:
            raise ValueError(
                f"p.data = <{value.dtype} tensor>: this sharded tensor (shape {tuple(self.shape)}) is {self.dtype}, "
                "and its piece lives in a flat buffer of that dtype; cast the model before fully_shard, or compute "
                "in another dtype with fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...))"
            )
        if isinstance(value, RaggedDTensor):
            if not value.ragged.same_layout(self.ragged):
                raise ValueError(f"p.data = <RaggedDTensor laid out as {value.ragged}>: this tensor is laid out as {self.ragged}")
            local = value._local_tensor
        else:
            if isinstance(value, DTensor):
                if not all(isinstance(pl, Replicate) for pl in value.placements):
                    raise ValueError(
                        f"p.data = <DTensor with placements {value.placements}>: pass a full tensor or one of this layout"
                    )
                value = value.to_local()
            if tuple(value.shape) != tuple(self.shape):
                raise ValueError(
                    f"p.data = <tensor of shape {tuple(value.shape)}>: this sharded tensor's global shape is "
                    f"{tuple(self.shape)} (a plain tensor is taken as the whole tensor: each rank keeps its range)"
                )
            a, b = self.local_range
            local = self._tp_local(value.detach()).reshape(-1)[a:b]
        with torch.no_grad():
            self._local_tensor.copy_(local.reshape(self._local_tensor.shape))

    def __repr__(self) -> str:  # type: ignore[override]
        a, b = self.local_range
        return (
            f"RaggedDTensor(shape={tuple(self.shape)}, dtype={self.dtype}, local=[{a}, {b}), "
            f"placements={self._spec.placements}, mesh={self._spec.mesh})"
        )

    # ---- leaving the placement ---------------------------------------------------------------
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:  # type: ignore[override]
        """This rank's flat piece (1-D): for a parameter, a view of its bucket's segment (no copy)."""
        if not torch.is_grad_enabled() or not self.requires_grad:
            return self._local_tensor
        return _ToLocal.apply(self)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:  # type: ignore[override]
        """The whole tensor on every rank of the ragged mesh dimension (one all-gather)."""
        if torch.is_grad_enabled() and self.requires_grad:
            return _FullTensor.apply(self)
        return _gather(self)

    def redistribute(  # type: ignore[override]
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """To ``Replicate()`` everywhere (a torch DTensor holding the full tensor), ``Shard(0)`` on the ragged
        dimension (torch's row sharding, rows exchanged with one all-to-all), or another ``RaggedShard``
        layout of the same tensor (one all-to-all). The other mesh dimensions stay as they are."""
        mesh = device_mesh if device_mesh is not None else self._spec.mesh
        if mesh != self._spec.mesh:
            raise NotImplementedError(
                f"RaggedDTensor.redistribute to another mesh ({mesh} from {self._spec.mesh}); gather with "
                "full_tensor() and distribute on the new mesh"
            )
        if placements is None:
            raise ValueError("redistribute needs placements")
        placements = tuple(placements)
        x = self if forward_dtype is None else self.to(forward_dtype)
        if placements == self._spec.placements:
            return x
        dim = self.ragged_dim
        others_same = all(p == q for i, (p, q) in enumerate(zip(placements, self._spec.placements)) if i != dim)
        if len(placements) == mesh.ndim and all(isinstance(p, Replicate) for p in placements):
            full = x.full_tensor()
            return DTensor.from_local(full, mesh, placements, run_check=False, shape=self.shape, stride=self.stride())
        target = placements[dim] if len(placements) == mesh.ndim else None
        if has_tp(self._spec.placements):
            raise NotImplementedError(
                f"RaggedDTensor.redistribute from {self._spec.placements} to {placements}: under tensor parallelism only "
                "Replicate() on every mesh dim is supported (full_tensor()); to_local() is this rank's flat piece"
            )
        if others_same and isinstance(target, Shard) and target.dim in (0, -self.ndim):
            rows = RaggedLayout.even_rows(tuple(self.shape), x.ragged.num_shards)
            local = _exchange(x, rows).view(rows.local_shape(self.shard_rank))
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=self.shape, stride=self.stride())
        if others_same and isinstance(target, RaggedShard):
            if target.shape != tuple(self.shape) or target.num_shards != x.ragged.num_shards:
                raise ValueError(f"redistribute: {target} does not lay out this tensor of shape {tuple(self.shape)}")
            local = _exchange(x, target.layout)
            spec = ragged_spec(mesh, placements, self.shape, local.dtype)
            return RaggedDTensor(local, spec, requires_grad=False)
        raise NotImplementedError(
            f"RaggedDTensor.redistribute from {self._spec.placements} to {placements}: supported are Replicate() on "
            "every mesh dim, Shard(0) or another RaggedShard on the ragged dim (the others unchanged)"
        )

    # ---- torch.compile / pickling ------------------------------------------------------------
    # (torch.compile: DTensor's own __tensor_flatten__, which dynamo expects of a DTensor; unflattened
    # back into this class)
    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        placements, meta, shard_order, requires_grad = flatten_spec
        spec = DTensorSpec(
            inner_tensors["device_mesh"], placements, tensor_meta=TensorMeta(outer_size, outer_stride, meta.dtype),
            shard_order=shard_order,
        )  # fmt: skip
        return RaggedDTensor(inner_tensors["_local_tensor"], spec, requires_grad=requires_grad)

    def __reduce_ex__(self, protocol):
        # ``torch.save(model.state_dict())`` of a sharded model: this rank's piece with its layout (the
        # mesh, a process-group handle, is not saved). ``torch.load`` gives a ``RaggedPiece`` that names
        # fsdp_optim.full_state_dict / save_checkpoint on use; nothing else is unpickled.
        rs = self.ragged
        return _rebuild_piece, (self._local_tensor.detach(), tuple(self.shape), tuple(rs.bounds), self.shard_rank)

    def __deepcopy__(self, memo: dict) -> RaggedDTensor:
        out = RaggedDTensor(self._local_tensor.detach().clone(), self._spec, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    # ---- DCP: the N-D boxes this rank's flat range is made of --------------------------------
    def _boxes(self):
        a, b = self.local_range
        boxes = flat_range_boxes(self.local_shape, a, b)
        spec = self._spec
        if not has_tp(spec.placements):
            return boxes
        off = tp_offsets(tuple(self.shape), spec.placements, tuple(spec.mesh.shape), spec.mesh.get_coordinate())
        return [b._replace(offsets=tuple(o + d for o, d in zip(b.offsets, off))) for b in boxes]

    def __create_write_items__(self, fqn: str, object: Any):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self._local_tensor)
        boxes = self._boxes()
        if not boxes and self.numel() == 0:  # an empty tensor: every rank offers the same empty chunk
            return [
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size((0,) * self.ndim)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size((0,) * self.ndim), sizes=self.shape),
                        properties=props,
                        size=self.shape,
                    ),
                )
            ]
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(b.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)),
                    properties=props,
                    size=self.shape,
                ),
            )
            for b in boxes
        ]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in self._boxes()]

    def __get_tensor_shard__(self, index):
        boxes = self._boxes()
        start = self.local_range[0]
        hint = index.index
        if hint is not None and hint < len(boxes) and torch.Size(boxes[hint].offsets) == index.offset:
            b = boxes[hint]
        else:
            found = [b for b in boxes if torch.Size(b.offsets) == index.offset]
            if not found:
                if self.numel() == 0:
                    return self._local_tensor.view(self.shape)
                raise ValueError(f"{index.fqn}: no local chunk at offset {tuple(index.offset or ())}")
            b = found[0]
        a = b.start - start
        return self._local_tensor[a : a + b.numel].view(b.sizes)


# ---- autograd through the local piece / the full tensor --------------------------------------
class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: RaggedDTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = x._spec
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        from ._dtensor_ops import spec_with_dtype

        return RaggedDTensor(grad.reshape(-1), spec_with_dtype(ctx.spec, grad.dtype), requires_grad=False)


class _FullTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: RaggedDTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec, ctx.range, ctx.x = x._spec, x.local_range, x.detach()
        return _gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        from ._dtensor_ops import spec_with_dtype

        a, b = ctx.range
        local = ctx.x._tp_local(grad).reshape(-1)[a:b].clone()
        return RaggedDTensor(local, spec_with_dtype(ctx.spec, grad.dtype), requires_grad=False)


# ---- collectives over the ragged dimension ------------------------------------------------------
def _coordinate_order(mesh: DeviceMesh, dim: int) -> tuple[dist.ProcessGroup, list[int] | None]:
    """The ragged dimension's group and, when its ranks are not in coordinate order (a mesh built from
    a group in another order), ``order[c]`` = the group rank of coordinate ``c``; ``None`` if equal."""
    group = mesh.get_group(dim)
    coord = mesh.get_coordinate()
    idx = [slice(None) if i == dim else c for i, c in enumerate(coord)]
    dim_ranks = mesh.mesh[tuple(idx)].tolist()
    group_ranks = dist.get_process_group_ranks(group)
    if dim_ranks == group_ranks:
        return group, None
    return group, [group_ranks.index(r) for r in dim_ranks]


def _gather(x: RaggedDTensor) -> torch.Tensor:
    """The full tensor from every coordinate's flat piece (one all-gather, padded to the largest piece)."""
    rs, dim = x.ragged, x.ragged_dim
    local = x._local_tensor.reshape(-1)
    w = rs.num_shards
    if has_tp(x._spec.placements):  # the TP-local tensor, then torch's gather over the TP dims
        spec = x._spec
        tp_local = _gather_ragged(x, local, rs, dim, w).view(x.local_shape)
        placements = [Replicate() if i == dim else p for i, p in enumerate(spec.placements)]
        return DTensor.from_local(
            tp_local, spec.mesh, placements, run_check=False, shape=x.shape, stride=x.stride()
        ).full_tensor()
    return _gather_ragged(x, local, rs, dim, w).view(x.shape)


def _gather_ragged(x: RaggedDTensor, local: torch.Tensor, rs: RaggedShard, dim: int, w: int) -> torch.Tensor:
    if w == 1:
        return local.clone()
    group, order = _coordinate_order(x._spec.mesh, dim)
    sizes = [rs.range(c)[1] - rs.range(c)[0] for c in range(w)]
    width = max(sizes)
    send = local.new_zeros(width)
    send[: local.numel()] = local
    out = local.new_empty(w * width)
    if width:
        _all_gather_single(out, send, group=group)
    by_group_rank = out.view(w, width)
    pieces = [by_group_rank[c if order is None else order[c], : sizes[c]] for c in range(w)]
    return torch.cat(pieces) if pieces else local.new_empty(math.prod(x.local_shape))


def _exchange(x: RaggedDTensor, dst: RaggedLayout) -> torch.Tensor:
    """This rank's flat piece under layout ``dst`` (same tensor), moved with one ``all_to_all_single``."""
    src = x.ragged.layout
    me = x.shard_rank
    w = src.world_size
    local = x._local_tensor.reshape(-1)
    s0, s1 = src.range(me)
    d0, d1 = dst.range(me)
    if w == 1:
        return local.clone()
    send = [max(0, min(s1, dst.range(q)[1]) - max(s0, dst.range(q)[0])) for q in range(w)]
    recv = [max(0, min(src.range(q)[1], d1) - max(src.range(q)[0], d0)) for q in range(w)]
    group, order = _coordinate_order(x._spec.mesh, x.ragged_dim)
    if order is not None:  # split lists are indexed by group rank
        inv = [0] * w
        for c, g in enumerate(order):
            inv[g] = c
        send_g, recv_g = [send[inv[g]] for g in range(w)], [recv[inv[g]] for g in range(w)]
        # pieces must be laid out in group-rank order on both sides
        chunks, pos = [], 0
        for c in range(w):
            chunks.append(local[pos : pos + send[c]])
            pos += send[c]
        payload = torch.cat([chunks[inv[g]] for g in range(w)]) if w else local
        out_g = local.new_empty(d1 - d0)
        dist.all_to_all_single(out_g, payload.contiguous(), recv_g, send_g, group=group)
        parts, pos = {}, 0
        for g in range(w):
            parts[inv[g]] = out_g[pos : pos + recv_g[g]]
            pos += recv_g[g]
        return torch.cat([parts[c] for c in range(w)])
    out = local.new_empty(d1 - d0)
    dist.all_to_all_single(out, local.contiguous(), recv, send, group=group)
    return out


def distribute_ragged(tensor: torch.Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement]) -> RaggedDTensor:
    """A ``RaggedDTensor`` laid out by ``placements`` (one ``RaggedShard``, the rest ``Replicate()``) from:

    - a plain tensor of the global shape, the same on every rank: each rank keeps its range (a copy, no
      communication);
    - a torch ``DTensor`` on ``device_mesh`` with ``Replicate()`` or ``Shard(0)`` on the ragged dimension
      (the rest as in ``placements``): rows move to their new owners with one all-to-all;
    - another ``RaggedDTensor``: ``redistribute``.
    """
    placements = tuple(placements)
    dim = ragged_dim(placements)
    if dim is None:
        raise ValueError(f"distribute_ragged: placements {placements} hold no RaggedShard")
    rs = placements[dim]
    if isinstance(tensor, RaggedDTensor):
        return tensor.redistribute(device_mesh, placements)  # type: ignore[return-value]
    if tuple(tensor.shape) != rs.shape:
        raise ValueError(f"distribute_ragged: tensor of shape {tuple(tensor.shape)} for {rs}")
    spec = ragged_spec(device_mesh, placements, rs.shape, tensor.dtype)
    me = coordinate(device_mesh, dim)
    a, b = rs.range(me)
    if isinstance(tensor, DTensor):
        src = tensor.placements[dim]
        if isinstance(src, Replicate):
            local = tensor.to_local().reshape(-1)[a:b].clone()
        elif isinstance(src, Shard) and src.dim in (0, -tensor.ndim):
            rows = RaggedLayout.even_rows(rs.shape, rs.num_shards)
            tmp = RaggedDTensor(
                tensor.to_local().reshape(-1), ragged_spec(device_mesh, _with(placements, dim, RaggedShard(rows)),
                                                           rs.shape, tensor.dtype), requires_grad=False,
            )  # fmt: skip
            local = _exchange(tmp, rs.layout)
        else:
            raise NotImplementedError(f"distribute_ragged from a DTensor with placements {tensor.placements}")
        return RaggedDTensor(local, spec, requires_grad=False)
    local = tensor.detach().reshape(-1)[a:b].clone()
    return RaggedDTensor(local, spec, requires_grad=False)


def _with(placements: tuple, dim: int, p: Placement) -> tuple:
    return tuple(p if i == dim else q for i, q in enumerate(placements))


# ---- pickled pieces --------------------------------------------------------------------------------
class RaggedPiece(torch.Tensor):
    """What ``torch.load`` gives for a pickled ``RaggedDTensor``: one rank's flat piece (``local``) and
    where it lies, shaped as the whole tensor but holding no whole tensor: any op raises, naming
    ``fsdp_optim.full_state_dict(model)`` (for a portable file) and ``save_checkpoint``."""

    local: torch.Tensor
    bounds: tuple[int, ...]
    rank: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: tuple[int, ...], bounds: tuple[int, ...], rank: int) -> RaggedPiece:
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=local.dtype, device=local.device)
        r.local, r.bounds, r.rank = local, tuple(bounds), rank
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(
            f"{func} on a RaggedPiece: one rank's flat piece of a sharded tensor, saved with torch.save(model."
            "state_dict()). For a file any model loads, call fsdp_optim.full_state_dict(model) instead (and "
            "torch.save that); for a sharded checkpoint, fsdp_optim.save_checkpoint or torch.distributed.checkpoint"
        )

    @property
    def local_range(self) -> tuple[int, int]:
        return self.bounds[self.rank], self.bounds[self.rank + 1]

    def __repr__(self) -> str:  # type: ignore[override]
        a, b = self.local_range
        return (
            f"RaggedPiece(shape={tuple(self.shape)}, local=[{a}, {b}) of {math.prod(self.shape)}): one rank's piece of "
            "a sharded tensor saved with torch.save; save fsdp_optim.full_state_dict(model) for whole tensors"
        )


def _rebuild_piece(local: torch.Tensor, shape: tuple, bounds: tuple, rank: int) -> RaggedPiece:
    return RaggedPiece(local, shape, bounds, rank)


torch.serialization.add_safe_globals([_rebuild_piece, RaggedPiece])
