"""``clip_grad_norm_`` over sharded gradients: one reduction per mesh for the whole model."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_norm"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradient norm of ``parameters`` in place, as ``torch.nn.utils.clip_grad_norm_`` does
    on the unsharded model, and return the total norm as a plain tensor (the same on every rank).

    ``torch.nn.utils.clip_grad_norm_`` itself is right on sharded parameters (their gradients are
    ``RaggedDTensor``s whose norms are ``Partial``, reduced when used) and returns a ``DTensor``; this one
    also: accumulates in fp32 (float64 for fp64 gradients; torch uses the gradients' dtype, so bf16
    gradients give a bf16 norm), takes parameters on several meshes at once (expert-parallel experts
    beside the dense model: one reduction per mesh), and refuses a negative ``max_norm`` (torch accepts it
    and flips the sign of every gradient). Every rank must call it with the same parameter list.

    Tolerance: the total norm equals torch's on the unsharded model to fp32 rounding, not bitwise:
    torch sums each tensor whole, here each rank sums its pieces and the ranks' sums are added, so
    the order of the additions (and the norm's last bits) depends on the world size. Where it
    clips, the gradients are scaled by a coefficient that may differ in its last bit, and training
    carries that on (4 steps of the README's loop: ~4e-7 for AdamW, ~1.5e-3 for Muon, whose bf16
    Newton-Schulz turns last-bit differences into bf16 rounding flips). Runs without clipping, or
    where the norm stays below ``max_norm``, keep the optimizers' bitwise W-invariance.
    """
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    _check_args(max_norm, norm_type)
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    total = total_norm(grads, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault((g.device, g.dtype), []).append(g.detach())
    for (dev, dt), gs in by_dtype.items():
        if foreach is False:
            for g in gs:
                g.mul_(clip_coef.to(device=dev, dtype=dt))
        else:
            torch._foreach_mul_(gs, clip_coef.to(device=dev, dtype=dt))
    return total


def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all of ``grads`` together as one plain tensor (every rank the same): per mesh, the
    foreach norms of its tensors (``Partial``, reduced once), then combined with the plain tensors'."""
    norm_type = float(norm_type)
    inf = norm_type == math.inf
    all_grads = [g for g in grads if g is not None]
    device = all_grads[0].device if all_grads else torch.device("cpu")
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in all_grads) else torch.float32
    parts: list[torch.Tensor] = []
    by_mesh: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    plain: list[torch.Tensor] = []
    for g in all_grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault(id(g.device_mesh), (g.device_mesh, []))[1].append(g)
        else:
            plain.append(g)
    for _, gs in by_mesh.values():
        norms = []
        for (_, _), group in _by_device_dtype(gs).items():
            norms.extend(torch._foreach_norm(group, norm_type, dtype=dtype))
        part = torch.linalg.vector_norm(torch.stack(norms), norm_type)  # (a Partial: reduced once, here)
        parts.append(part.full_tensor().to(device))
    if plain:
        norms = []
        for (_, _), group in _by_device_dtype([g for g in plain if g.numel()]).items():
            norms.extend(n.to(device) for n in torch._foreach_norm(group, norm_type, dtype=dtype))
        if norms:
            parts.append(torch.linalg.vector_norm(torch.stack(norms), norm_type))
    if not parts:
        return torch.zeros((), dtype=dtype, device=device)
    stacked = torch.stack([p.to(dtype) for p in parts])
    return stacked.max() if inf else torch.linalg.vector_norm(stacked, norm_type)


def _by_device_dtype(gs: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in gs:
        out.setdefault((g.device, g.dtype), []).append(g.detach())
    return out


def _check_args(max_norm: float | torch.Tensor, norm_type: float) -> None:
    # torch accepts a negative max_norm: the coefficient turns negative and flips every gradient.
    # (A tensor max_norm is checked where that needs no device sync: on the CPU.)
    if not torch.is_tensor(max_norm) or max_norm.device.type == "cpu":
        value = float(max_norm)
        if not value >= 0:  # (also NaN)
            raise ValueError(
                f"clip_grad_norm_: max_norm must be >= 0 (the largest total gradient norm to keep), got {value}; "
                "a negative max_norm would flip the sign of every gradient. Pass a positive number "
                "(or math.inf not to clip)"
            )
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
