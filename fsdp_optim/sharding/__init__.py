"""Sharding core: block specs, RaggedShard layouts, the planner and DistributedBuffer."""

from ._blocks import BlockKind, BlockRule, BlockSpec, default_rule, elements, expert, heads, rows, whole
from ._plan import BucketPlan, Layout, Placement, Plan, PlanConfig, TensorSpec
from ._ragged import RaggedShard, block_aligned_splits, chunk_bounds, from_dtensor, to_dtensor

__all__ = [
    "BlockKind",
    "BlockRule",
    "BlockSpec",
    "BucketPlan",
    "Layout",
    "Placement",
    "Plan",
    "PlanConfig",
    "RaggedShard",
    "TensorSpec",
    "block_aligned_splits",
    "chunk_bounds",
    "default_rule",
    "elements",
    "expert",
    "from_dtensor",
    "heads",
    "rows",
    "to_dtensor",
    "whole",
]
