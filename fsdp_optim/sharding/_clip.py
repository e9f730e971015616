"""``clip_grad_norm_`` over sharded gradients: one all-reduce for the whole model."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ._dist import is_distributed, same_group
from ._shard_info import shard_info

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradient norm of ``parameters`` in place, as ``torch.nn.utils.clip_grad_norm_`` does
    on the unsharded model, and return the total norm (the same on every rank).

    Sharded parameters contribute their local pieces; the partial sums (``sum |g|^p``, or the max for
    ``inf``) of every rank are combined with ONE all-reduce over their shard group. Plain (unsharded,
    replicated) parameters are counted once, after the reduction. Every rank of the group must call
    it with the same parameter list (ranks whose pieces are empty still join the all-reduce).
    Expert-parallel parameters (``expert_parallel``) add their partial sums over their replicas and
    their EP group (two more all-reduces): each expert element is counted once. Accumulated in fp32 (float64 for fp64 gradients).

    Tolerance: the total norm equals torch's on the unsharded model to fp32 rounding, not bitwise:
    torch sums each tensor whole, here each rank sums its pieces and the ranks' sums are added, so
    the order of the additions (and the norm's last bits) depends on the world size. Where it
    clips, the gradients are scaled by a coefficient that may differ in its last bit, and training
    carries that on (4 steps of the README's loop: ~4e-7 for AdamW, ~1.5e-3 for Muon, whose bf16
    Newton-Schulz turns last-bit differences into bf16 rounding flips). Runs without clipping, or
    where the norm stays below ``max_norm``, keep the optimizers' bitwise W-invariance.

    A negative (or NaN) ``max_norm`` raises a ``ValueError``: torch accepts it and flips the sign of
    every gradient.
    """
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    _check_args(max_norm, norm_type)
    norm_type = float(norm_type)
    experts = [p for p in params if (i := shard_info(p)) is not None and i.expert is not None]
    sharded, plain, group = _by_sharding([p for p in params if not any(p is q for q in experts)])
    grads_ex = [p.grad for p in experts if p.grad is not None]
    grads_sh = [p.grad for p in sharded if p.grad is not None]
    grads_pl = [p.grad for p in plain if p.grad is not None]
    all_grads = grads_ex + grads_sh + grads_pl
    device = all_grads[0].device if all_grads else (params[0].device if params else torch.device("cpu"))
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in all_grads) else torch.float32
    inf = norm_type == math.inf

    total = _partial_norm(grads_sh, norm_type, dtype, device)
    if sharded and is_distributed(group):
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    if experts:
        # Expert-parallel pieces: each element lives on one rank of (its replicas x its EP group).
        part = _partial_norm(grads_ex, norm_type, dtype, device)
        info = shard_info(experts[0])
        for g in (info.group, info.expert.group):
            if is_distributed(g):
                dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=g)
        total = torch.maximum(total, part) if inf else total + part
    rest = _partial_norm(grads_pl, norm_type, dtype, device)
    total = torch.maximum(total, rest) if inf else (total + rest) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in all_grads:
        by_dtype.setdefault((g.device, g.dtype), []).append(g.detach())
    for (dev, dt), gs in by_dtype.items():
        torch._foreach_mul_(gs, clip_coef.to(device=dev, dtype=dt))
    return total


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


def _by_sharding(
    params: list[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor], dist.ProcessGroup | None]:
    """``(sharded, plain, the sharded ones' group)``; sharded parameters of two groups are refused."""
    sharded, plain, group = [], [], None
    for p in params:
        info = shard_info(p)
        if info is None:
            plain.append(p)
            continue
        if sharded and not same_group(group, info.group):
            raise ValueError(
                f"clip_grad_norm_: parameter {info.fqn} is sharded over a different process group than the others; "
                "clip each model's parameters separately"
            )
        group = info.group
        sharded.append(p)
    return sharded, plain, group


def _partial_norm(grads: list[torch.Tensor], norm_type: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` (the max for ``inf``) over ``grads``: one foreach norm per (device, dtype) group,
    accumulated in ``dtype`` (no per-tensor loop; torch.nn.utils.get_total_norm does the same per
    group, in the gradients' own dtype)."""
    inf = norm_type == math.inf
    acc = torch.zeros((), dtype=dtype, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            groups.setdefault((g.device, g.dtype), []).append(g.detach())
    for gs in groups.values():
        norms = torch.stack(torch._foreach_norm(gs, norm_type, dtype=dtype)).to(device)
        acc = torch.maximum(acc, norms.max()) if inf else acc + (norms**norm_type).sum()
    return acc
