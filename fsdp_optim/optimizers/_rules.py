"""Block rules of the optimizers: what each needs kept together on one rank.

A rule is ``rule(fqn, param, module) -> BlockSpec`` (``module`` is the parameter's owner, or
``None`` when only names and shapes are known, as in the planner presets). The spec a rule
returns is recorded on the sharded parameter and is the single source of truth for how an
optimizer treats it (e.g. Muon: matrix blocks get Newton-Schulz, the rest AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from ..sharding.contract import BlockRule, BlockSpec, elements, expert, merge_small_dims, rows, whole
from ._strips import shampoo_blocks

__all__ = [
    "is_embedding_or_head",
    "ambiguous_name_guess",
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


_HEAD_LIKE_MODULES = frozenset({"out", "output_layer", "classifier", "score", "logits", "readout", "fc_out", "decoder"})


def ambiguous_name_guess(fqn: str, *, is_matrix: bool) -> bool:
    """Whether the name-based guess of ``is_embedding_or_head`` is doubtful for ``fqn``.

    Doubtful: a token of an embedding/head matched inside a repeated block (a numeric path part
    before it, e.g. ``layers.0.attention.output.dense.weight``: probably a hidden layer), or a
    matrix whose owning module has a head-like name the tokens do not cover (``out``,
    ``classifier``, ``score``, ...: probably an output head that will get Newton-Schulz).
    """
    parts = fqn.split(".")
    if is_matrix:
        return len(parts) >= 2 and parts[-2] in _HEAD_LIKE_MODULES and not any(q.isdigit() for q in parts[:-2])
    for i, q in enumerate(parts[:-1]):
        if q in _EMBED_OR_HEAD_TOKENS:
            return any(x.isdigit() for x in parts[:i])
    return False


def _matches(fqn: str, names: frozenset[str]) -> bool:
    """``fqn`` equals a name, or ends with it on a ``.`` boundary (``"out"`` matches ``out.weight``)."""
    parts = fqn.split(".")
    return any(".".join(parts[i:j]) in names for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)
               if j == len(parts) or j == len(parts) - 1)  # fmt: skip


def adamw_rule(fqn: str, param: torch.Tensor, module: nn.Module | None) -> BlockSpec:
    """Element-wise: any split works (plain FSDP)."""
    return elements(1)


adamw_rule.splits_blocks = True  # type: ignore[attr-defined]  # element-wise: any cut is fine (PlanConfig.balance)


def adamw8bit_rule(block_size: int = 256) -> BlockRule:
    """Quantization blocks of ``block_size`` flat elements of the global tensor."""

    def rule(fqn: str, param: torch.Tensor, module: nn.Module | None) -> BlockSpec:
        return elements(block_size)

    rule.splits_blocks = True  # type: ignore[attr-defined]  # element-wise blocks: no matrix to split
    return rule


def muon_rule(
    *,
    head_dims: Mapping[str, int] | None = None,
    row_splits: Mapping[str, Sequence[int]] | None = None,
    embedding_and_head: Iterable[str] | None = None,
) -> BlockRule:
    """Whole hidden matrices, one matrix per expert of 3-D weights, element-wise for the rest.

    ``head_dims`` maps a name suffix (e.g. ``"attn.wq.weight"``) to a head dim: that projection is
    orthogonalized per head. ``row_splits`` maps a suffix to row counts (fused QKV).
    ``embedding_and_head``: the parameters left to AdamW, by name (``"out.weight"``) or module name
    (``"out"``, matching ``out.weight`` and ``out.bias``), given explicitly: the guess from names
    (``is_embedding_or_head``) is then off; ``nn.Embedding`` modules are still recognised by type.
    """
    head_dims = dict(head_dims or {})
    row_splits = {k: tuple(v) for k, v in (row_splits or {}).items()}
    if isinstance(embedding_and_head, str):
        raise ValueError(f"embedding_and_head must be a collection of names, got the string {embedding_and_head!r}")
    explicit = None if embedding_and_head is None else frozenset(embedding_and_head)

    def is_adamw(fqn: str, module: nn.Module | None) -> bool:
        if explicit is None:
            return is_embedding_or_head(fqn, module)
        return isinstance(module, nn.Embedding) or _matches(fqn, explicit)

    def rule(fqn: str, param: torch.Tensor, module: nn.Module | None) -> BlockSpec:
        if param.ndim < 2 or is_adamw(fqn, module) or fqn.endswith("bias"):
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

    rule.guesses_names = explicit is None  # type: ignore[attr-defined]  # read by Muon's warnings
    rule.splits_blocks = True  # type: ignore[attr-defined]  # Muon exchanges split matrices (PlanConfig.balance)
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

    The rule declares ``splits_blocks``: Shampoo exchanges strips the planner cut for balance
    (``PlanConfig(balance="auto")``; [Note: Shampoo split strips]). A planner cuts ``rows(k)`` strips
    on rows of dim 0 and ``expert()`` matrices on rows of ``c`` elements (``BlockSpec.split_unit``),
    both rows of the merged view as well (a merged row is a product of trailing dims);
    ``elements(k * rest)`` strips are never cut. SOAP's strip rule wraps this one without the flag.
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

    def block_state_bytes(shape: Sequence[int], spec: BlockSpec) -> list[tuple[int, int]]:
        """Per strip ``(flat offset of its first element, bytes)``: its blocks' factors and inverse roots
        (fp32, the default ``factor_matrix_dtype``), which live on the rank holding that element."""
        g = shampoo_blocks(tuple(shape), k, spec)
        return [(g.strip_start_row(i) * g.cols, 8 * g.factor_numel(i, i + 1)) for i in range(g.num_strips)]

    rule.splits_blocks = True  # type: ignore[attr-defined]  # Shampoo exchanges split strips (PlanConfig.balance)
    rule.block_state_bytes = block_state_bytes  # type: ignore[attr-defined]  # priced by suggest_mesh
    # Bytes per element of a split strip off its owner, out and back per step, at the default settings
    # (betas[0] > 0, no grafting: raw and filtered gradients out, the direction back; fp32).
    rule.exchange_bytes = (8, 4)  # type: ignore[attr-defined]
    return rule
