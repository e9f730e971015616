"""The face for parallelizing a model: ``fully_shard`` and its settings, the sharded parameter type,
expert parallelism, and the block rules ``fully_shard(blocks=...)`` takes.

Three audiences, three faces:

- users who shard a model: this module (the everyday names are also in ``fsdp_optim``);
- optimizer authors: ``fsdp_optim.sharding.contract`` (``LocalShard``, ``local_tensor``, the state
  protocols, the hooks the runtime expects);
- planning (layouts at any scale, no process group): ``fsdp_optim.sharding.plan``.

Names this module exported before 0.2.0 that belong to another face still resolve, with a
``DeprecationWarning`` naming their new module. Everything else in this package is private
(``_``-prefixed modules).
"""

import importlib
import warnings

from . import contract, plan
from ._clip import clip_grad_norm_
from ._dtensor import RaggedDTensor, distribute_ragged, is_ragged
from ._expert_parallel import ExpertGroups, ExpertShard, expert_parallel, expert_parallel_groups, expert_shard
from ._float8 import Float8AllGather
from ._fully_shard import ShardedModule, fully_shard, sharded_plan
from ._grouped_mm import grouped_linear
from ._init import init_weights
from ._mixed_precision import MixedPrecisionPolicy
from ._placement import RaggedShard
from .plan import BlockRule, BlockSpec, PlanConfig, default_rule, elements, expert, heads, rows, suggest_mesh, whole

__all__ = [
    "BlockRule",
    "BlockSpec",
    "ExpertGroups",
    "ExpertShard",
    "Float8AllGather",
    "MixedPrecisionPolicy",
    "PlanConfig",
    "RaggedDTensor",
    "RaggedShard",
    "ShardedModule",
    "clip_grad_norm_",
    "contract",
    "default_rule",
    "distribute_ragged",
    "elements",
    "expert",
    "expert_parallel",
    "expert_parallel_groups",
    "expert_shard",
    "fully_shard",
    "grouped_linear",
    "heads",
    "init_weights",
    "is_ragged",
    "plan",
    "rows",
    "sharded_plan",
    "suggest_mesh",
    "whole",
]

# Names exported here before 0.2.0, by the face they moved to. The runtime's internals
# (DistributedBuffer, CollectiveHandle, the FP8 block quantizers) are on no face: they resolve to
# their private modules, with no stability promise.
_MOVED = {
    **dict.fromkeys(
        ("BlockKind", "LocalShard", "OwnedState", "ShardedState", "check_not_replaced", "local_shard",
         "local_tensor", "materialize_all", "merge_small_dims", "register_optimizer_hooks"),
        "fsdp_optim.sharding.contract",
    ),
    **dict.fromkeys(
        ("BucketPlan", "Layout", "MeshCandidate", "MeshSuggestion", "Placement", "Plan", "PlanStats",
         "RaggedLayout", "TensorSpec", "block_aligned_splits", "chunk_bounds", "expert_ranges", "plan_model",
         "tensor_cost"),
        "fsdp_optim.sharding.plan",
    ),
    **dict.fromkeys(("CollectiveHandle", "DistributedBuffer"), "fsdp_optim.sharding._buffer"),
    **dict.fromkeys(("dequantize_blockwise", "quantize_blockwise"), "fsdp_optim.sharding._float8"),
}


def __getattr__(name: str):
    if name in _MOVED:
        home = _MOVED[name]
        what = "is internal (no stability promise)" if home.rsplit(".", 1)[1].startswith("_") else "moved"
        warnings.warn(
            f"fsdp_optim.sharding.{name} {what} since 0.2.0: import it from {home}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'fsdp_optim.sharding' has no attribute {name!r}")
