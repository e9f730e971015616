"""Layout math: block specs, RaggedLayout ranges, the plan, the planner, its cost model, reports and
model presets, and the wire model of ragged collectives. Pure functions on shapes: nothing here touches a process group or a device, so a plan
for 16K ranks is computed (and tested) on one CPU."""

from ._blocks import BlockKind, BlockRule, BlockSpec, default_rule, elements, expert, heads, merge_small_dims, rows, whole
from ._plan import BucketPlan, Layout, LocalPiece, Placement, Plan, PlanConfig, TensorSpec, config_for_rules
from ._planner import plan_model
from ._cost import tensor_cost
from ._experts import expert_ranges, token_splits
from ._presets import PRESETS, ModelPreset, preset_buckets, preset_names, preset_shapes
from ._ragged import Box, RaggedLayout, block_aligned_splits, chunk_bounds, flat_range_boxes
from ._report import PlanStats
from ._wire import (
    WIRE_CHOICES,
    LinkModel,
    WireMode,
    all_reduce_seconds,
    all_to_all_seconds,
    choose_wire_mode,
    grouped_seconds,
    padded_seconds,
    split_exchange,
)
from ._suggest import MeshCandidate, MeshSuggestion, block_state_per_rank, module_buckets, suggest_mesh

__all__ = [
    "BlockKind",
    "Box",
    "block_state_per_rank",
    "BlockRule",
    "BlockSpec",
    "BucketPlan",
    "LinkModel",
    "MeshCandidate",
    "MeshSuggestion",
    "Layout",
    "LocalPiece",
    "ModelPreset",
    "PRESETS",
    "Placement",
    "Plan",
    "PlanConfig",
    "PlanStats",
    "RaggedLayout",
    "TensorSpec",
    "WIRE_CHOICES",
    "WireMode",
    "all_reduce_seconds",
    "all_to_all_seconds",
    "block_aligned_splits",
    "flat_range_boxes",
    "choose_wire_mode",
    "chunk_bounds",
    "config_for_rules",
    "default_rule",
    "elements",
    "expert",
    "expert_ranges",
    "grouped_seconds",
    "heads",
    "merge_small_dims",
    "module_buckets",
    "padded_seconds",
    "plan_model",
    "preset_buckets",
    "preset_names",
    "preset_shapes",
    "rows",
    "split_exchange",
    "suggest_mesh",
    "tensor_cost",
    "token_splits",
    "whole",
]
