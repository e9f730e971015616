"""fsdp_optim: FSDP with block-aligned ragged sharding for whole-block optimizers.

The public face: ``fully_shard`` and its settings, checkpoints and state dicts, helpers for user code.
The optimizers are ``fsdp_optim.optimizers``; layouts, plans and the optimizer contract are
``fsdp_optim.sharding`` (its ``plan`` package holds the pure layout math).
"""

from . import _quiet_torchao, sharding  # noqa: F401  (_quiet_torchao: see its docstring)
from ._param_groups import param_groups
from .sharding import (
    Float8AllGather,
    MixedPrecisionPolicy,
    ShardedModule,
    clip_grad_norm_,
    fully_shard,
    init_weights,
    sharded_plan,
    suggest_mesh,
)
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
    "ShardedModule",
    "clip_grad_norm_",
    "export_hf",
    "full_state_dict",
    "fully_shard",
    "init_weights",
    "load_checkpoint",
    "load_full_state_dict",
    "load_hf",
    "param_groups",
    "save_checkpoint",
    "sharded_plan",
    "sharding",
    "suggest_mesh",
]
__version__ = "0.2.0"
