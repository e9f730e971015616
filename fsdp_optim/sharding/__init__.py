"""Sharding core: block specs, RaggedShard layouts, the planner and DistributedBuffer."""

from ._blocks import BlockKind, BlockRule, BlockSpec, default_rule, elements, expert, heads, rows, whole
from ._buffer import CollectiveHandle, DistributedBuffer
from ._float8 import Float8AllGather, dequantize_blockwise, quantize_blockwise
from ._plan import BucketPlan, Layout, Placement, Plan, PlanConfig, TensorSpec
from ._planner import PlanStats, plan_model, tensor_cost
from ._ragged import RaggedShard, block_aligned_splits, chunk_bounds, from_dtensor, to_dtensor

__all__ = [
    "BlockKind",
    "BlockRule",
    "BlockSpec",
    "BucketPlan",
    "CollectiveHandle",
    "DistributedBuffer",
    "Float8AllGather",
    "Layout",
    "Placement",
    "Plan",
    "PlanConfig",
    "PlanStats",
    "RaggedShard",
    "TensorSpec",
    "block_aligned_splits",
    "chunk_bounds",
    "default_rule",
    "dequantize_blockwise",
    "elements",
    "expert",
    "from_dtensor",
    "heads",
    "plan_model",
    "quantize_blockwise",
    "rows",
    "tensor_cost",
    "to_dtensor",
    "whole",
]
