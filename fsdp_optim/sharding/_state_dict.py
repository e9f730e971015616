"""Full (unsharded) state dicts of a model sharded with ``fully_shard``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ._bucket import _Bucket
from ._runtime import buckets_of

__all__ = ["full_state_dict"]


def full_state_dict(module: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """Plain full tensors under ``module``'s own names (as ``module.state_dict()`` of the unsharded
    model: tied parameters under each name, persistent buffers included).

    Collective: every rank of the mesh must call it (one all-gather per bucket holding a parameter of
    ``module``, one bucket at a time). Parameters come back in their master dtype.
    ``rank0_only``: only global rank 0 keeps the tensors; the others return ``{}`` and never hold more
    than one bucket at full size (the one being gathered). ``cpu_offload``: the tensors are copied to
    the CPU as each bucket arrives (else they stay on the mesh's device). As FSDP2's
    ``get_model_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    names: list[tuple[str, torch.Tensor]] = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                names.append((pre + name, p))
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                names.append((pre + name, b))
    wanted = {id(t) for _, t in names}

    def out_of(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu" if cpu_offload else t.device, copy=True)

    full: dict[int, torch.Tensor] = {}
    for b in buckets_of(module):
        ups = b.unsharded if b.unsharded is not None else [None] * len(b.sharded)  # never gathered yet
        ids = [(sp, up) for sp, up in zip(b.sharded, ups) if id(sp) in wanted or id(up) in wanted]
        if not ids:
            continue
        flat = _gather_to_group_rank0(b) if rank0_only else b.gather_full()
        if keep:
            for (sp, up), view in zip(zip(b.sharded, ups), b.full_views(flat)):
                if id(sp) in wanted or id(up) in wanted:
                    full[id(sp)] = out_of(view)
                    if up is not None:
                        full[id(up)] = full[id(sp)]
        del flat
    if not keep:
        return {}
    return {key: full[id(t)] if id(t) in full else out_of(t) for key, t in names}


def _gather_to_group_rank0(b: _Bucket) -> torch.Tensor | None:
    """The bucket's full flat buffer on its shard group's rank 0 (``None`` elsewhere): one ``gather``
    of segments padded to the largest, so the other ranks hold only their own (padded) segment."""
    import torch.distributed as dist

    b.settle()
    buf = b.buffer
    if buf.backend is None or buf.world_size == 1:
        return buf.all_gather()
    size = max(buf.sizes)
    send = torch.zeros(size, dtype=buf.dtype, device=buf.device)
    send[: buf.segment_numel].copy_(buf.segment)
    # Gather to global rank 0 where it is in this group (the rank that keeps the result), else to the
    # group's first rank (another HSDP replica: gathered and dropped).
    try:
        dist.get_group_rank(buf.group or dist.group.WORLD, 0)
        group_rank0 = 0
    except (ValueError, RuntimeError):
        group_rank0 = dist.get_global_rank(buf.group, 0)
    me_first = dist.get_rank() == group_rank0
    pieces = [torch.empty(size, dtype=buf.dtype, device=buf.device) for _ in range(buf.world_size)] if me_first else None
    dist.gather(send, pieces, dst=group_rank0, group=buf.group)
    if not me_first:
        return None
    return torch.cat([piece[:n] for piece, n in zip(pieces, buf.sizes)])
