"""fsdp_optim: FSDP with block-aligned ragged sharding for whole-block optimizers."""

from . import _quiet_torchao, sharding  # noqa: F401  (_quiet_torchao: see its docstring)
from ._param_groups import global_shape, param_groups
from .sharding._clip import clip_grad_norm_
from .sharding._float8 import Float8AllGather
from .sharding._fully_shard import ShardedModule, fully_shard, sharded_plan
from .sharding._init import init_weights
from .sharding._mixed_precision import MixedPrecisionPolicy
from .sharding._shard_info import ShardInfo, shard_info
from .sharding.checkpoint import (
    export_hf,
    full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    load_hf,
    save_checkpoint,
)

__all__ = [
    "Float8AllGather",
    "MixedPrecisionPolicy",
    "ShardInfo",
    "ShardedModule",
    "clip_grad_norm_",
    "export_hf",
    "full_state_dict",
    "fully_shard",
    "global_shape",
    "init_weights",
    "load_checkpoint",
    "load_full_state_dict",
    "load_hf",
    "param_groups",
    "save_checkpoint",
    "shard_info",
    "sharded_plan",
    "sharding",
]
__version__ = "0.1.0"
