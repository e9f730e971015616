"""A rank's flat piece of a global tensor as DCP sees a DTensor shard: ``FlatShardTensor`` and the
N-D boxes (``flat_range_boxes``) a flat range of a row-major tensor is made of.

A sharded parameter holds the flat range ``[start, end)`` of its row-major flattened global
tensor on each rank. ``torch.distributed.checkpoint`` (DCP) reshards N-D *chunks* (boxes), and a
flat range of an N-D tensor is a union of at most ``2 * ndim - 1`` boxes, each a contiguous piece
of the range (``flat_range_boxes``). ``FlatShardTensor`` wraps a rank's flat piece so that DCP
sees the global tensor with those boxes as this rank's chunks (the ``__create_write_items__`` /
``__create_chunk_list__`` / ``__get_tensor_shard__`` hooks DCP calls on DTensor): saved, a model
looks exactly like an FSDP2 / DTensor checkpoint of the same model; loaded, DCP reads whatever
boxes of any saved layout overlap this rank's range, straight into the parameter's storage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["Box", "FlatShardTensor", "flat_range_boxes"]

aten = torch.ops.aten


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


class FlatShardTensor(torch.Tensor):
    """This rank's flat piece ``[start, start + n)`` of a global tensor of ``shape``, for DCP.

    ``size()`` is the global shape; the data is the wrapped local piece (not a copy: a DCP load
    writes straight into it). Only checkpoint hooks, ``detach``, ``to_local`` and
    ``full_tensor`` are supported; it is not a general tensor.
    """

    _local: torch.Tensor
    _start: int
    _boxes: tuple[Box, ...]

    @staticmethod
    def __new__(cls, local: torch.Tensor, *, shape: Iterable[int], start: int) -> FlatShardTensor:
        shape = torch.Size(tuple(int(d) for d in shape))
        if not local.is_contiguous():
            raise ValueError(
                f"FlatShardTensor needs a contiguous local piece (a load writes into it in place); "
                f"got strides {local.stride()} for shape {tuple(local.shape)}"
            )
        flat = local.view(-1)
        boxes = tuple(flat_range_boxes(shape, start, start + flat.numel()))
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        r._local = flat
        r._start = int(start)
        r._boxes = boxes
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            (x,) = args
            return FlatShardTensor(x._local.detach(), shape=x.shape, start=x._start)
        if func in (aten.clone.default, aten._to_copy.default):  # .clone(), .to(dtype / device)
            x, *rest = args
            return FlatShardTensor(func(x._local, *rest, **kwargs), shape=x.shape, start=x._start)
        raise NotImplementedError(
            f"{func} is not supported on FlatShardTensor: one rank's flat piece of a global tensor, what a "
            "sharded model's state_dict() holds for DCP. For a plain state dict (torch.save, loading into a "
            "model without fully_shard) call fsdp_optim.full_state_dict(model) instead; for a sharded "
            "checkpoint fsdp_optim.save_checkpoint; on the piece itself, use .to_local() or .full_tensor()"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"FlatShardTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"local=[{self._start}, {self._start + self._local.numel()}))"
        )

    def __deepcopy__(self, memo: dict) -> FlatShardTensor:
        return FlatShardTensor(self._local.clone(), shape=self.shape, start=self._start)

    def __reduce_ex__(self, protocol):
        # This rank's piece only (``torch.load(..., weights_only=False)``); for one portable file
        # use ``fsdp_optim.full_state_dict(model)``.
        return _rebuild_flat_shard, (self._local, tuple(self.shape), self._start)

    # ---- accessors ------------------------------------------------------------------------
    @property
    def local_range(self) -> tuple[int, int]:
        return self._start, self._start + self._local.numel()

    def to_local(self) -> torch.Tensor:
        """The flat local piece (shares storage with the wrapped tensor)."""
        return self._local

    def full_tensor(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The global tensor on every rank (a collective; ranges must tile the tensor)."""
        return _gather_flat(self._local, self._start, math.prod(self.shape), group).view(self.shape)

    # ---- DCP hooks --------------------------------------------------------------------------
    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self._local)
        boxes = self._boxes
        if not boxes and math.prod(self.shape) == 0:
            # An empty global tensor: every rank offers the same empty chunk; DCP keeps one.
            boxes = (Box((0,) * len(self.shape), tuple(self.shape), 0),)
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

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        boxes = self._boxes
        hint = index.index
        if hint is not None and hint < len(boxes) and torch.Size(boxes[hint].offsets) == index.offset:
            b = boxes[hint]
        else:
            found = [b for b in boxes if torch.Size(b.offsets) == index.offset]
            if not found:
                if math.prod(self.shape) == 0:
                    return self._local.view(self.shape)
                raise ValueError(f"{index.fqn}: no local chunk at offset {tuple(index.offset or ())}")
            b = found[0]
        a = b.start - self._start
        return self._local[a : a + b.numel].view(b.sizes)


def _rebuild_flat_shard(local: torch.Tensor, shape: tuple[int, ...], start: int) -> FlatShardTensor:
    return FlatShardTensor(local, shape=shape, start=start)


# A ``torch.save(model.state_dict())`` of a sharded model holds FlatShardTensors. Allowed for
# ``torch.load(weights_only=True)`` (it rebuilds a wrapper from a tensor, a shape and an int: no code),
# so that such a file loads and every use of its pieces names ``fsdp_optim.full_state_dict`` (the
# dispatch error above) instead of torch's refusal of an unknown global.
torch.serialization.add_safe_globals([_rebuild_flat_shard])


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, inp, group=group)


def _gather_flat(local: torch.Tensor, start: int, numel: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's flat piece (ranges must tile ``[0, numel)``) on every rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        assert start == 0 and local.numel() == numel, "a single rank must hold the whole tensor"
        return local.clone()
    w = dist.get_world_size(group)
    meta = torch.tensor([start, local.numel()], dtype=torch.int64, device=local.device)  # NCCL: on device
    metas = torch.empty(2 * w, dtype=torch.int64, device=local.device)
    _all_gather(metas, meta, group)
    metas = metas.view(w, 2).tolist()
    width = max(n for _, n in metas)
    pad = local.new_zeros(width)
    pad[: local.numel()] = local
    out = local.new_empty(w * width)
    if width:
        _all_gather(out, pad, group)
    full = local.new_empty(numel)
    for r, (s, n) in enumerate(metas):
        full[s : s + n] = out[r * width : r * width + n]
    return full
