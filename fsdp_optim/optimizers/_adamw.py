"""AdamW on each rank's local shards: element-wise, so any layout works and no rank talks.

The math is ``torch.optim.adam.adam`` with ``decoupled_weight_decay=True`` -- the functional that
``torch.optim.AdamW`` itself calls -- applied to the local flat pieces, so a sharded run equals
``torch.optim.AdamW`` on the full tensors for every world size and layout.

[Note: bitwise equality and kernel paths]
The single-tensor and foreach paths (``torch.optim.AdamW``'s defaults on CPU and CUDA) compute each
element with the same operations whatever the tensor's length or offset, so sharded == unsharded
bitwise. torch's fused CPU kernel (``torch._fused_adamw_``) runs a vectorized body and a scalar
tail that round ``exp_avg_sq`` differently (measured here: 1 ulp), so with ``fused=True`` results
are bitwise only when every shard boundary is a multiple of the SIMD width (64 elements covers
AVX-512 fp32); at other offsets they agree to an ulp of ``exp_avg_sq``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import _get_scalar_dtype

from ._base import StateShard, check_adam_hparams, checked_param_info, local_tensor, make_dcp_ready, param_info, per_element, profiled_step
from ._rules import adamw_rule

__all__ = ["AdamW", "adamw_update"]


def adamw_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float | Tensor,
    beta1: float | Tensor,
    beta2: float | Tensor,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    amsgrad: bool = False,
    max_exp_avg_sqs: Sequence[Tensor] | None = None,
    foreach: bool | None = None,
    fused: bool | None = None,
    capturable: bool = False,
) -> None:
    """One AdamW step, in place, on lists of local tensors (any shapes, empty allowed).

    Exactly ``torch.optim.AdamW``'s math (it calls the same functional): ``steps`` are 0-d tensors
    incremented here; ``foreach``/``fused`` ``None`` pick torch's default for the device. For
    Muon's AdamW fallback and any optimizer that needs element-wise AdamW on shards.
    """
    if amsgrad and (max_exp_avg_sqs is None or len(max_exp_avg_sqs) != len(params)):
        raise ValueError("amsgrad=True needs max_exp_avg_sqs, one per parameter")
    if not params:
        return
    _torch_adam(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(max_exp_avg_sqs) if amsgrad else [],
        list(steps),
        foreach=foreach,
        capturable=capturable,
        differentiable=False,
        fused=fused,
        grad_scale=None,
        found_inf=None,
        has_complex=any(torch.is_complex(p) for p in params),
        decoupled_weight_decay=True,
        amsgrad=amsgrad,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
    )


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` on sharded parameters (and plain ones), state sharded like the params.

    Element-wise, so any block spec and layout is accepted (``AdamW.blocks`` shards at element
    granularity). State is created eagerly (checkpoint-shaped; see ``StateShard``); ``step()``
    issues no collectives.
    """

    blocks = staticmethod(adamw_rule)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
    ) -> None:
        check_adam_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if isinstance(lr, Tensor) and foreach and not capturable:
            raise ValueError("lr: a tensor lr needs foreach=False or capturable=True (as torch.optim.AdamW)")
        if fused and foreach:
            raise ValueError("fused=True and foreach=True cannot be set together; pick one")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            capturable=capturable,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)
        self._state_ready = True
        make_dcp_ready(self)

    # ---- state ------------------------------------------------------------------------
    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        # element-wise: every spec and layout is fine
        info = checked_param_info(p, self.blocks, optimizer="AdamW", blocks="AdamW.blocks")
        if group["fused"] and not (p.is_floating_point() and p.device.type in ("cpu", "cuda", "mps", "xpu")):
            raise ValueError(
                f"AdamW: fused=True needs floating-point parameters on a supported device; "
                f"{info.fqn or '<unnamed>'} is {p.dtype} on {p.device}"
            )
        state = self.state[p]
        if state:
            return
        # Same placement of ``step`` as torch.optim.Adam._init_group (CPU scalar unless fused/capturable).
        if group["capturable"] or group["fused"]:
            state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
        else:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        local = local_tensor(p)  # (state is this rank's flat piece: no DTensor dispatch in the step)
        state["exp_avg"] = torch.zeros_like(local, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(local, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(local, memory_format=torch.preserve_format)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_state_ready", False):  # __init__ creates the first groups' state itself
            group = self.param_groups[-1]
            for p in group["params"]:
                self._init_state(p, group)

    def state_shards(self, p: Tensor) -> dict[str, StateShard]:
        """Per-element state: this rank's range of the parameter (see ``StateShard``)."""
        s = per_element(param_info(p, self.blocks))
        return {k: s for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in self.state[p]}

    # ---- step -------------------------------------------------------------------------
    @profiled_step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:  # e.g. after load_state_dict of a state without this parameter
                    self._init_state(p, group)
                params.append(local_tensor(p))
                grads.append(local_tensor(p.grad))
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if group["amsgrad"]:
                    max_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            beta1, beta2 = group["betas"]
            adamw_update(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                maximize=group["maximize"],
                amsgrad=group["amsgrad"],
                max_exp_avg_sqs=max_sqs,
                foreach=group["foreach"],
                fused=group["fused"],
                capturable=group["capturable"],
            )
        return loss
