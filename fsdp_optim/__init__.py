"""fsdp_optim: FSDP with block-aligned ragged sharding for whole-block optimizers.

The users' face: ``fully_shard`` and its settings, checkpoints and state dicts, helpers for user code.
The optimizers are ``fsdp_optim.optimizers``; ``fsdp_optim.sharding`` parallelizes a model (its
``contract`` module is the optimizer authors' face, its ``plan`` package the pure layout math);
``fsdp_optim.testing`` checks an optimizer sharded against unsharded (docs/testing.md).
"""

from . import _quiet_torchao, sharding, testing  # noqa: F401  (_quiet_torchao: see its docstring)
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
    "testing",
]
__version__ = "0.2.0"
