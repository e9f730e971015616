"""Parameter shapes for user code: ``global_shape`` and the weight-decay ``param_groups``.

After ``fully_shard`` every managed parameter is this rank's flat 1-D piece, so ``p.ndim == 1`` and
``p.shape`` is a local length for *every* parameter. The common rule "decay matrices, not vectors"
(nanoGPT's ``configure_optimizers``: ``p.dim() >= 2``) then silently decays nothing. These helpers
look at the global shape recorded with the shard (``shard_info(p).shape``) instead; on plain tensors
and on PyTorch FSDP2's DTensors (whose ``shape`` is already global) they read ``p.shape``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .sharding import shard_info

__all__ = ["global_shape", "param_groups"]


def global_shape(p: torch.Tensor) -> torch.Size:
    """The full (unsharded) shape of ``p``: a sharded parameter's recorded shape, else ``p.shape``."""
    info = shard_info(p)
    return torch.Size(info.shape) if info is not None else p.shape


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Two optimizer param groups by *global* shape: parameters with >= 2 dims (matrices, embeddings,
    3-D expert stacks) get ``weight_decay``; the rest (norm weights, biases, scalars) get 0.

    The nanoGPT grouping, correct on sharded models. Frozen parameters (``requires_grad=False``) are
    left out; tied parameters appear once; an empty group is dropped. Pass the result to any
    optimizer: ``AdamW(param_groups(model, weight_decay=0.1), lr=3e-4)``. ``Muon`` applies each
    group's ``weight_decay`` to its AdamW part too (norms, biases: 0; embeddings, head: ``weight_decay``).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"param_groups: model must be an nn.Module, got {type(model).__name__}")
    if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"param_groups: weight_decay must be a finite number >= 0, got {weight_decay!r}")
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if len(global_shape(p)) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
