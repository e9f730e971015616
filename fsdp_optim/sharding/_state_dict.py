"""Full (unsharded) state dicts of a model sharded with ``fully_shard``."""

from __future__ import annotations

import torch
from torch import nn

from ._fully_shard import _Bucket, _runtimes_under, _runtime_of

__all__ = ["full_state_dict"]


def _relevant_buckets(module: nn.Module) -> list[_Bucket]:
    rts = _runtimes_under(module) or [_runtime_of(module)]
    return [b for rt in rts for b in rt.buckets]


def full_state_dict(module: nn.Module, *, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Plain full tensors under ``module``'s own names (as ``module.state_dict()`` of the unsharded
    model: tied parameters under each name, persistent buffers included), on every rank.

    Collective: every rank of the mesh must call it (one all-gather per bucket holding a
    parameter of ``module``). Parameters come back in their master dtype, copied to ``device``.
    """
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
    full: dict[int, torch.Tensor] = {}
    for b in _relevant_buckets(module):
        ups = b.unsharded if b.unsharded is not None else [None] * len(b.sharded)  # never gathered yet
        ids = [(sp, up) for sp, up in zip(b.sharded, ups) if id(sp) in wanted or id(up) in wanted]
        if not ids:
            continue
        b.wait_reduces()
        flat = b.buffer.all_gather()
        for (sp, up), view in zip(zip(b.sharded, ups), b.buffer.full_views(flat)):
            if id(sp) in wanted or id(up) in wanted:
                full[id(sp)] = full[id(up)] = view.detach().to(device, copy=True)
    out: dict[str, torch.Tensor] = {}
    for key, t in names:
        out[key] = full[id(t)] if id(t) in full else t.detach().to(device, copy=True)
    return out
