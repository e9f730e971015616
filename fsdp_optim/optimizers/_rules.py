"""Block rules of the optimizers: what each needs kept together on one rank.

A rule is ``rule(fqn, param, module) -> BlockSpec`` (``module`` is the parameter's owner, or
``None`` when only names and shapes are known, as in the planner presets). The spec a rule
returns is recorded on the sharded parameter and is the single source of truth for how an
optimizer treats it (e.g. Muon: matrix blocks get Newton-Schulz, the rest AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..sharding._blocks import BlockRule, BlockSpec, elements, expert, merge_small_dims, rows, whole

__all__ = [
    "is_embedding_or_head",
    "adamw_rule",
    "adamw8bit_rule",
    "muon_rule",
    "shampoo_rule",
]

_EMBED_OR_HEAD_TOKENS = frozenset(
    {"embed", "embeds", "embedding", "embeddings", "embed_tokens", "tok_embeddings", "wte", "wpe",
     "lm_head", "output", "head", "unembed", "unembedding", "shared_head"}
)


def is_embedding_or_head(fqn: str, module: nn.Module | None) -> bool:
    """Embedding tables and output heads (Muon leaves them to AdamW, as torch.optim.Muon advises)."""
    if isinstance(module, nn.Embedding):
        return True
    parts = fqn.split(".")
    return any(p in _EMBED_OR_HEAD_TOKENS for p in parts[:-1])


def adamw_rule(fqn: str, param: torch.Tensor, module: nn.Module | None) -> BlockSpec:
    """Element-wise: any split works (plain FSDP)."""
    return elements(1)


def adamw8bit_rule(block_size: int = 256) -> BlockRule:
    """Quantization blocks of ``block_size`` flat elements of the global tensor."""

    def rule(fqn: str, param: torch.Tensor, module: nn.Module | None) -> BlockSpec:
        return elements(block_size)

    return rule


def muon_rule(
    *, head_dims: Mapping[str, int] | None = None, row_splits: Mapping[str, Sequence[int]] | None = None
) -> BlockRule:
    """Whole hidden matrices, one matrix per expert of 3-D weights, element-wise for the rest.

    ``head_dims`` maps a name suffix (e.g. ``"attn.wq.weight"``) to a head dim: that projection is
    orthogonalized per head. ``row_splits`` maps a suffix to row counts (fused QKV).
    """
    head_dims = dict(head_dims or {})
    row_splits = {k: tuple(v) for k, v in (row_splits or {}).items()}

    def rule(fqn: str, param: torch.Tensor, module: nn.Module | None) -> BlockSpec:
        if param.ndim < 2 or is_embedding_or_head(fqn, module) or fqn.endswith("bias"):
            return elements(1)  # torch.optim.Muon: only hidden weight matrices; the rest is AdamW's
        if param.ndim == 3:
            return expert()
        if param.ndim > 3:
            return elements(1)
        for suffix, hd in head_dims.items():
            if fqn.endswith(suffix):
                if param.shape[0] % hd:
                    raise ValueError(
                        f"{fqn}: head_dim {hd} does not divide its {param.shape[0]} rows (shape "
                        f"{tuple(param.shape)}); fix head_dims[{suffix!r}]"
                    )
                return whole(row_splits=[hd] * (param.shape[0] // hd))
        for suffix, splits in row_splits.items():
            if fqn.endswith(suffix):
                return whole(row_splits=splits)
        return whole()

    return rule


def shampoo_rule(max_preconditioner_dim: int = 1024, *, per_expert: bool = False) -> BlockRule:
    """Shampoo's strips: ``k = max_preconditioner_dim`` slices of dim 0 of the merged shape.

    Shampoo blocks the tensor viewed with ``merge_small_dims(shape, k)`` (size-1 dims dropped, small
    dims merged, as facebookresearch/optimizers does; see [Note: Shampoo blocks]); a rank boundary
    may only fall between ``k``-slices of its dim 0. That is ``rows(k)`` when the merged dim 0 is
    the tensor's dim 0 (or the whole tensor is one strip either way), else ``elements(k * rest)``
    (e.g. ``[1, 45]`` -> ``(45,)``: blocks of ``k`` elements). Scalars: ``elements(1)``.

    ``per_expert`` (opt-in, not DistributedShampoo's blocking): a 3-D ``[E, r, c]`` weight gets one
    ``expert()`` block per expert matrix, each merged and blocked on its own, instead of blocking
    the 3-D tensor, whose dim-0 strips for ``E <= k`` make it one block (unbalanceable at scale).
    """
    k = max_preconditioner_dim

    def rule(fqn: str, param: torch.Tensor, module: nn.Module | None) -> BlockSpec:
        shape = tuple(param.shape)
        if per_expert and len(shape) == 3:
            return expert()
        if len(shape) == 0:  # a scalar: one element (rows() needs a dim 0)
            return elements(1)
        numel = math.prod(shape)
        merged = merge_small_dims(shape, k)
        unit_merged, unit_rows = k * math.prod(merged[1:]), k * math.prod(shape[1:])
        if unit_merged == unit_rows or numel <= min(unit_merged, unit_rows):
            return rows(k)
        return elements(unit_merged)

    return rule
