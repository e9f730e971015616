"""DTensor interoperability of RaggedLayout layouts: ``to_dtensor`` / ``from_dtensor`` (the only part
of the layout code that communicates; the index math is ``plan/_ragged.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .plan import RaggedLayout

__all__ = ["to_dtensor", "from_dtensor"]


def _exchange_rows(
    local: torch.Tensor, src: RaggedLayout, dst: RaggedLayout, rank: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Move row-aligned pieces from layout ``src`` to ``dst`` with one ``all_to_all_single``."""
    w = src.world_size
    send, recv = [], []
    s0, s1 = src.range(rank)
    d0, d1 = dst.range(rank)
    for q in range(w):
        qs0, qs1 = src.range(q)
        qd0, qd1 = dst.range(q)
        send.append(max(0, min(s1, qd1) - max(s0, qd0)))
        recv.append(max(0, min(qs1, d1) - max(qs0, d0)))
    out = local.new_empty(d1 - d0)
    dist.all_to_all_single(out, local.reshape(-1).contiguous(), recv, send, group=group)
    return out


def to_dtensor(local: torch.Tensor, layout: RaggedLayout, mesh) -> "torch.distributed.tensor.DTensor":
    """A DTensor ``Shard(0)`` of the full tensor from this rank's flat ``local`` piece.

    Needs a row-aligned layout; moves rows between ranks (one ``all_to_all_single``) when the
    ragged ranges differ from ``torch.chunk``'s.
    """
    from torch.distributed.tensor import DTensor, Shard

    if not layout.is_row_aligned():
        raise ValueError(
            f"to_dtensor needs row-aligned ranges; layout {list(layout.bounds)} of shape {layout.shape} "
            "cuts a row (shard with rows(1) or coarser blocks)"
        )
    group = mesh.get_group()
    rank = mesh.get_local_rank()
    target = RaggedLayout.even_rows(layout.shape, layout.world_size)
    moved = local if target == layout else _exchange_rows(local, layout, target, rank, group)
    shape = target.local_shape(rank)
    full_stride = torch.empty(layout.shape, device="meta").stride()
    return DTensor.from_local(
        moved.reshape(shape), mesh, [Shard(0)], run_check=False, shape=torch.Size(layout.shape), stride=full_stride
    )


def from_dtensor(dtensor: "torch.distributed.tensor.DTensor", layout: RaggedLayout) -> torch.Tensor:
    """This rank's flat piece under ``layout`` from a DTensor ``Shard(0)`` (inverse of ``to_dtensor``)."""
    from torch.distributed.tensor import Shard

    mesh = dtensor.device_mesh
    if tuple(dtensor.placements) != (Shard(0),):
        raise ValueError(f"from_dtensor needs placements (Shard(0),), got {dtensor.placements}")
    if tuple(dtensor.shape) != layout.shape:
        raise ValueError(f"DTensor shape {tuple(dtensor.shape)} does not match layout shape {layout.shape}")
    rank = mesh.get_local_rank()
    source = RaggedLayout.even_rows(layout.shape, layout.world_size)
    local = dtensor.to_local().reshape(-1)
    if source == layout:
        return local.clone()
    return _exchange_rows(local, source, layout, rank, mesh.get_group())
