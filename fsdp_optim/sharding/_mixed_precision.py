"""Mixed precision for ``fully_shard``: compute dtype of gathered parameters and reduction dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy"]


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Dtypes of one bucket's communication and compute.

    The sharded parameters (the master weights the optimizer updates) always keep the dtype
    the module was built with (fp32 in training). ``param_dtype`` is the dtype of the gathered
    (unsharded) parameters the forward and backward compute with: the local segment is cast once
    and the bucket is all-gathered in that dtype (half the bytes for bf16). ``reduce_dtype`` is
    the dtype in which gradients are accumulated (no-sync micro-batches) and reduce-scattered;
    the result is cast into the master-dtype gradient segment.

    Unlike PyTorch FSDP2 (which reduces in ``param_dtype`` when ``reduce_dtype`` is unset),
    ``reduce_dtype=None`` here means the master dtype: fp32 reduction by default.
    """

    param_dtype: torch.dtype | None = None
    """Compute dtype of gathered parameters; ``None``: the master dtype (no cast)."""
    reduce_dtype: torch.dtype | None = None
    """Gradient accumulation and reduction dtype; ``None``: the master dtype."""
    output_dtype: torch.dtype | None = None
    """Cast floating-point forward outputs of the module to this dtype; ``None``: leave them."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs to ``param_dtype`` (as FSDP2 does)."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = getattr(self, name)
            if dt is not None and (not isinstance(dt, torch.dtype) or not dt.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating-point torch.dtype or None, got {dt!r}")
