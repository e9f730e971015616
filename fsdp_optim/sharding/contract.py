"""The face for optimizer authors: what a sharded optimizer needs from the sharding runtime.

An optimizer over ``fully_shard``'s parameters reads each parameter's layout from the parameter
(``local_shard(p)`` -> ``LocalShard``: global shape, block spec, every rank's bounds, this rank's
coordinate, the shard group; under tensor parallelism the TP-local tensor's, and ``LocalShard.tp``
where the TP cut splits the optimizer's blocks), computes on ``local_tensor(p)`` / ``p.to_local()`` (no DTensor dispatch
inside a step), declares the blocks it needs whole as a ``BlockRule`` (the planner keeps them on one
rank), and makes its state checkpoint-shaped through the ``ShardedState`` / ``OwnedState`` protocols.
``materialize_all`` / ``check_not_replaced`` / ``register_optimizer_hooks`` are the three calls the
runtime expects around a step and a state dict. ``fsdp_optim.optimizers`` is written against this
module and ``fsdp_optim.sharding.plan`` only.

Users who parallelize a model import ``fsdp_optim.sharding``; planning tools import
``fsdp_optim.sharding.plan``.
"""

from ._dtensor import RaggedDTensor, is_ragged
from ._local_shard import LocalShard, TensorParallelCut, local_shard, local_tensor
from ._replaced import check_not_replaced
from ._runtime import materialize_all
from .checkpoint import OwnedState, ShardedState, register_optimizer_hooks
from .plan import BlockKind, BlockRule, BlockSpec, elements, expert, heads, merge_small_dims, rows, whole

__all__ = [
    "BlockKind",
    "BlockRule",
    "BlockSpec",
    "LocalShard",
    "OwnedState",
    "RaggedDTensor",
    "ShardedState",
    "TensorParallelCut",
    "check_not_replaced",
    "elements",
    "expert",
    "heads",
    "is_ragged",
    "local_shard",
    "local_tensor",
    "materialize_all",
    "merge_small_dims",
    "register_optimizer_hooks",
    "rows",
    "whole",
]
