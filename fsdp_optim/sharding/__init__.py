"""The sharding package's face: what users and the optimizers import.

- layout math (re-exported from ``plan``): block specs and rules, RaggedLayout, the plan and planner;
- the runtime: ``fully_shard``, ``expert_parallel`` (experts split whole over an EP group), ``ShardInfo`` / ``shard_info`` (a sharded parameter's piece), mixed
  precision, FP8 all-gather, ``DistributedBuffer``, gradient clipping, initialization;
- the optimizer contract (for optimizer authors): ``materialize_all``, ``check_not_replaced``,
  ``register_optimizer_hooks``, ``ShardedState`` / ``OwnedState``.

Everything else in this package is private (``_``-prefixed modules).
"""

from ._buffer import CollectiveHandle, DistributedBuffer
from ._clip import clip_grad_norm_
from ._dtensor import RaggedDTensor, distribute_ragged, is_ragged
from ._placement import RaggedShard
from ._expert_parallel import ExpertGroups, ExpertShard, expert_parallel, expert_parallel_groups, expert_shard
from ._float8 import Float8AllGather, dequantize_blockwise, quantize_blockwise
from ._fully_shard import ShardedModule, fully_shard, sharded_plan
from ._grouped_mm import grouped_linear
from ._init import init_weights
from ._mixed_precision import MixedPrecisionPolicy
from ._runtime import materialize_all
from ._local_shard import LocalShard, local_shard, local_tensor
from ._replaced import check_not_replaced
from .checkpoint import OwnedState, ShardedState, register_optimizer_hooks
from .plan import (
    BlockKind,
    BlockRule,
    BlockSpec,
    BucketPlan,
    Layout,
    Placement,
    Plan,
    PlanConfig,
    PlanStats,
    RaggedLayout,
    TensorSpec,
    block_aligned_splits,
    chunk_bounds,
    default_rule,
    elements,
    expert,
    heads,
    merge_small_dims,
    MeshCandidate,
    MeshSuggestion,
    plan_model,
    suggest_mesh,
    expert_ranges,
    rows,
    tensor_cost,
    whole,
)

__all__ = [
    "BlockKind",
    "BlockRule",
    "BlockSpec",
    "BucketPlan",
    "CollectiveHandle",
    "DistributedBuffer",
    "ExpertGroups",
    "ExpertShard",
    "Float8AllGather",
    "Layout",
    "MeshCandidate",
    "MeshSuggestion",
    "MixedPrecisionPolicy",
    "OwnedState",
    "Placement",
    "Plan",
    "PlanConfig",
    "PlanStats",
    "RaggedLayout",
    "LocalShard",
    "ShardedState",
    "ShardedModule",
    "TensorSpec",
    "block_aligned_splits",
    "check_not_replaced",
    "chunk_bounds",
    "clip_grad_norm_",
    "default_rule",
    "dequantize_blockwise",
    "elements",
    "expert",
    "expert_parallel",
    "expert_parallel_groups",
    "expert_ranges",
    "expert_shard",
    "distribute_ragged",
    "is_ragged",
    "RaggedDTensor",
    "RaggedShard",
    "grouped_linear",
    "fully_shard",
    "heads",
    "init_weights",
    "materialize_all",
    "merge_small_dims",
    "plan_model",
    "quantize_blockwise",
    "register_optimizer_hooks",
    "rows",
    "local_shard",
    "local_tensor",
    "sharded_plan",
    "tensor_cost",
    "suggest_mesh",
    "whole",
]
