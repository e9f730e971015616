"""``param_groups``: the nanoGPT weight-decay grouping (matrices decay, vectors do not) in one call.

A sharded parameter is a DTensor of the global shape, so ``p.ndim`` is the unsharded one and the
usual ``p.dim() >= 2`` test works as written; this helper is that test, packaged.
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["param_groups"]


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Two optimizer param groups: parameters with >= 2 dims (matrices, embeddings, 3-D expert
    stacks) get ``weight_decay``; the rest (norm weights, biases, scalars) get 0.

    Frozen parameters (``requires_grad=False``) are left out; tied parameters appear once; an empty
    group is dropped. Pass the result to any optimizer: ``AdamW(param_groups(model, weight_decay=0.1),
    lr=3e-4)``. ``Muon`` applies each group's ``weight_decay`` to its AdamW part too (norms, biases: 0;
    embeddings, head: ``weight_decay``).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"param_groups: model must be an nn.Module, got {type(model).__name__}")
    if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"param_groups: weight_decay must be a finite number >= 0, got {weight_decay!r}")
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
