"""Mixed precision for ``fully_shard``: compute dtype of gathered parameters and reduction dtype.

``fully_shard`` also takes PyTorch FSDP2's own policy classes where they mean what ours do
(``as_mp_policy``), and FSDP2's ``offload_policy`` only to refuse CPU offload (``check_offload_policy``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MixedPrecisionPolicy", "as_mp_policy", "check_offload_policy"]

_OURS = "fsdp_optim.MixedPrecisionPolicy"
_TORCHS = "torch.distributed.fsdp.MixedPrecisionPolicy"


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
                raise ValueError(f"{_OURS}.{name} must be a floating-point torch.dtype or None, got {dt!r}")


def as_mp_policy(policy: Any) -> MixedPrecisionPolicy | None:
    """``fully_shard``'s ``mp_policy``: ours, None, or PyTorch FSDP2's ``MixedPrecisionPolicy`` as the
    policy of ours that means the same. FSDP2 reduces in ``param_dtype`` when ``reduce_dtype`` is unset,
    so that is what ours gets (ours would reduce in the master dtype); ``param_dtype``, ``output_dtype``
    and ``cast_forward_inputs`` carry over. A value ours cannot honour is a ``ValueError`` naming the field."""
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    from torch.distributed import fsdp

    if not isinstance(policy, fsdp.MixedPrecisionPolicy):
        raise ValueError(
            f"mp_policy must be a {_OURS}, a {_TORCHS} or None, got {type(policy).__module__}."
            f"{type(policy).__qualname__}"
        )
    known = {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"}
    for f in dataclasses.fields(policy):  # a field a later torch adds: only its default means the same
        value = getattr(policy, f.name)
        if f.name not in known and value != f.default:
            raise ValueError(
                f"mp_policy={_TORCHS}({f.name}={value!r}): {_OURS} has no {f.name}; leave it at its default "
                f"({f.default!r}) or pass a {_OURS}"
            )
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dt = getattr(policy, name)
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise ValueError(
                f"mp_policy={_TORCHS}({name}={dt!r}): fsdp_optim computes, reduces and outputs in floating-point "
                f"dtypes only; use a floating-point dtype (e.g. torch.bfloat16) or None"
            )
    if not isinstance(policy.cast_forward_inputs, bool):
        raise ValueError(
            f"mp_policy={_TORCHS}(cast_forward_inputs={policy.cast_forward_inputs!r}): it must be True or False"
        )
    reduce_dtype = policy.reduce_dtype if policy.reduce_dtype is not None else policy.param_dtype
    return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=reduce_dtype,
                                output_dtype=policy.output_dtype, cast_forward_inputs=policy.cast_forward_inputs)


def check_offload_policy(policy: Any) -> None:
    """``fully_shard``'s ``offload_policy``, accepted for FSDP2 code: None or a plain
    ``torch.distributed.fsdp.OffloadPolicy()`` (no offload). CPU offload is refused: the sharded
    parameters, gradients and optimizer state live on the module's device."""
    from torch.distributed import fsdp

    if policy is None or type(policy) is fsdp.OffloadPolicy:
        return
    if isinstance(policy, fsdp.CPUOffloadPolicy):
        raise ValueError(
            f"offload_policy=torch.distributed.fsdp.CPUOffloadPolicy(pin_memory={policy.pin_memory}): fsdp_optim "
            "does not offload to CPU (the sharded parameters, gradients and optimizer state stay on the module's "
            "device); drop offload_policy, or pass torch.distributed.fsdp.OffloadPolicy() (no offload)"
        )
    raise ValueError(
        "offload_policy must be None or torch.distributed.fsdp.OffloadPolicy() (no offload; CPU offload is not "
        f"supported), got {type(policy).__module__}.{type(policy).__qualname__}"
    )
