"""Initialize a sharded (e.g. meta-device built) model at full shapes, keeping each rank's piece."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._bucket import _Bucket
from ._runtime import buckets_of

__all__ = ["init_weights"]


def _default_init(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def init_weights(module: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Run ``init_fn(m)`` (default: ``m.reset_parameters()``) for every ``m`` in ``module.modules()``
    order, with ``m``'s own parameters presented at their global shape, and keep this rank's piece.

    [Note: sharded initialization]
    ``init_fn(m)`` must initialize only ``m``'s own (direct) parameters and buffers, as
    ``nn.Module.reset_parameters`` does; it sees them as full tensors holding the current values
    (each bucket is all-gathered once, so a partial re-initialization keeps the rest), on the mesh's
    device, under ``torch.no_grad()``. Meta buffers are materialized (uninitialized) first.
    Collective: every rank calls it, with the same RNG state, so every rank computes the same full
    tensors; the result equals the same ``init_fn`` order on the unsharded model, bitwise.
    Memory: one bucket at full size at a time (the root's bucket is held from its first module to
    its last).
    """
    init_fn = init_fn or _default_init
    buckets = buckets_of(module)
    owner: dict[int, tuple[_Bucket, int]] = {}
    for b in buckets:
        for i, sp in enumerate(b.sharded):
            owner[id(sp)] = (b, i)
    mods = list(module.modules())
    last_use: dict[int, int] = {}
    for k, m in enumerate(mods):
        for p in m._parameters.values():
            if p is not None and id(p) in owner:
                last_use[id(owner[id(p)][0])] = k
    device = buckets[0].buffer.device if buckets else torch.device("cpu")
    gathered: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for k, m in enumerate(mods):
            for name, v in list(m._buffers.items()):
                if v is not None and v.device.type == "meta":
                    m._buffers[name] = torch.empty_like(v, device=device)
            mine = []
            for name, p in list(m._parameters.items()):
                if p is None or id(p) not in owner:
                    continue
                b, i = owner[id(p)]
                if id(b) not in gathered:
                    gathered[id(b)] = b.full_views(b.gather_full())
                full = gathered[id(b)][i]
                m._parameters[name] = nn.Parameter(full, requires_grad=p.requires_grad)
                mine.append((name, p, b, i))
            init_fn(m)
            for name, p, b, i in mine:
                new = m._parameters[name]
                full = gathered[id(b)][i]
                if new is not None and new.data_ptr() != full.data_ptr():
                    full.copy_(new.detach().reshape(full.shape))
                info_range = b.plan.placements[i].shard.range(b.rank)
                p._local_tensor.copy_(full.reshape(-1)[info_range[0] : info_range[1]])
                m._parameters[name] = p
            for bid, kk in list(last_use.items()):
                if kk == k:
                    gathered.pop(bid, None)
