"""Shared plumbing of the sharded optimizers: finding each parameter's shard and block spec."""

from __future__ import annotations

import torch

from ..sharding._blocks import BlockRule, BlockSpec
from ..sharding._ragged import RaggedShard
from ..sharding._shard_info import ShardInfo, shard_info

__all__ = ["param_info", "require_spec"]


def param_info(p: torch.Tensor, rule: BlockRule, *, name: str = "") -> ShardInfo:
    """The ``ShardInfo`` of ``p``; for a plain parameter, a one-rank layout holding all of it with
    the spec ``rule`` gives from its shape (names and owner modules are unknown there)."""
    info = shard_info(p)
    if info is not None:
        return info
    shape = tuple(p.shape)
    spec = rule(name, p, None)
    spec.check(shape, name or f"parameter of shape {shape}")
    return ShardInfo(
        fqn=name, shape=shape, spec=spec, layout=RaggedShard(shape, (0, p.numel())), rank=0, group=None
    )


def require_spec(info: ShardInfo, ok: bool, *, optimizer: str, need: str, blocks: str) -> None:
    """Raise the standard error when a parameter's layout breaks what ``optimizer`` needs."""
    if ok:
        return
    raise ValueError(
        f"{optimizer}: parameter {info.fqn or '<unnamed>'} (shape {info.shape}, world size "
        f"{info.world_size}) is sharded with {info.spec} blocks, but {optimizer} needs {need}; "
        f"shard the model with fully_shard(..., blocks={blocks})"
    )


def spec_of(p: torch.Tensor, rule: BlockRule) -> BlockSpec:
    return param_info(p, rule).spec
