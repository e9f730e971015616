"""fsdp_optim: FSDP with block-aligned ragged sharding for whole-block optimizers."""

from . import sharding

__all__ = ["sharding"]
__version__ = "0.1.0"
