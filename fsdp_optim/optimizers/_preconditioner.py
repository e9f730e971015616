"""What Shampoo and SOAP share: the per-block factor kernels, grafting, and the step skeleton.

[Note: preconditioner base]
Modelled on facebookresearch/optimizers' ``PreconditionerList`` (``distributed_shampoo/preconditioner/
preconditioner_list.py``: one object per list of blocks with ``update_preconditioners`` and
``precondition``; the optimizer loops parameters, masks non-finite gradients and applies grafting
once). Here ``BlockPreconditioner`` is the optimizer skeleton: ``step`` checks every local gradient
(sparse, complex, non-finite: [Note: non-finite gradients]) before any state changes, then runs
either every parameter alone (``_step_param``: one block at a time, the reference mode) or every
parameter group batched (``_step_group_batched``: same-shape blocks stacked); the subclass says which
(``_batched_default``) and supplies the two step functions and the planning of a group. The kernels
both optimizers apply to a block -- the factors' contraction ``outer`` (and its stacked form), the
factor EMA, the grafting state and direction and the per-block grafting rescale -- live here once,
so the looped and batched paths of either optimizer run the same code per block.

[Note: non-finite gradients]
A NaN or Inf in a gradient would reach ``eigh`` (SOAP: "failed to converge"; Shampoo: NaN roots
forever after). Both optimizers check every local gradient first (one host sync per step) and raise
``FloatingPointError`` naming the parameters, before any state changes, so the step can be retried
or skipped (DistributedShampoo masks such gradients instead; we refuse loudly).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from ._base import discard_last_group, local_tensor, make_dcp_ready, profiled_step
from ._tp_runs import TPRun, TPRunExchange
from ._linalg import aligned, batched_ok

__all__ = [
    "BlockPreconditioner",
    "Grafting",
    "factor_ema_",
    "graft_rescale_",
    "grafting_direction",
    "outer",
    "outer_batched",
    "square_view",
    "update_grafting_",
]

GRAFT_NORM_EPS = 1e-16  # distributed_shampoo.py _precondition_and_grafting adds 1e-16 to the Shampoo norm


# ---- per-block kernels ------------------------------------------------------------------
def square_view(flat: Tensor, offset: int, n: int) -> Tensor:
    """The ``[n, n]`` factor stored at ``offset`` of a flat state tensor (a view)."""
    return flat[offset : offset + n * n].view(n, n)


def outer(g: Tensor, dim: int) -> Tensor:
    """Contraction of ``g`` with itself over every dim but ``dim`` (``G G^T``, ``G^T G``, ``g g^T``),
    on an aligned copy where ``g`` is a misaligned view ([Note: alignment-independent kernels])."""
    g = aligned(g)
    if g.ndim == 1:
        return torch.outer(g, g)
    if g.ndim == 2:
        return g @ g.mT if dim == 0 else g.mT @ g
    other = [d for d in range(g.ndim) if d != dim]
    return torch.tensordot(g, g, dims=(other, other))


def outer_batched(g: Tensor, dim: int) -> Tensor:
    """``outer`` of every ``g[i]`` of a ``[B, *shape]`` stack: ``[B, n, n]``, each matrix's result
    independent of its batch-mates ([Note: alignment-independent kernels]). Batched products use
    ``tensordot``'s operand layouts, so each is the same ``mm`` as ``outer``'s."""
    if g.ndim == 2:
        return g.unsqueeze(-1) * g.unsqueeze(-2)
    other = [d + 1 for d in range(g.ndim - 1) if d != dim]
    b, n = g.shape[0], g.shape[dim + 1]
    if not batched_ok(n, g[0].numel() // max(n, 1), n, g):
        return torch.stack([outer(x, dim) for x in g.unbind(0)])
    return g.permute(0, dim + 1, *other).reshape(b, n, -1) @ g.permute(0, *other, dim + 1).reshape(b, -1, n)


def factor_ema_(factors: list[Tensor], outers: list[Tensor], beta: float, *, lerp: bool = False) -> None:
    """Update factors in place from their new outer products (one foreach op over all of them):
    ``lerp`` (SOAP) ``F.lerp_(outer, 1 - beta)``; else DistributedShampoo's ``F <- beta F + (1 - beta)
    outer``, or ``F + outer`` for ``beta == 1``."""
    if not factors:
        return
    if lerp:
        torch._foreach_lerp_(factors, outers, 1 - beta)
    elif beta == 1.0:
        torch._foreach_add_(factors, outers)
    else:
        torch._foreach_mul_(factors, beta)
        torch._foreach_add_(factors, outers, alpha=1 - beta)


# ---- grafting ---------------------------------------------------------------------------
class Grafting(enum.Enum):
    """The layer-wise step-size method grafted onto Shampoo (DistributedShampoo's ``grafting_config``)."""

    NONE = "none"
    ADAM = "adam"
    """EMA of ``g^2`` with ``(1 - beta2)`` weight, always bias-corrected (``AdamPreconditionerConfig``)."""
    RMSPROP = "rmsprop"
    """EMA of ``g^2`` with ``(1 - beta2)`` weight, no bias correction (``RMSpropPreconditionerConfig``)."""
    ADAGRAD = "adagrad"
    """Sum of ``g^2`` (``AdaGradPreconditionerConfig``)."""


def update_grafting_(v: Tensor, g: Tensor, graft: Grafting, beta2: float) -> None:
    """The grafting state from the raw gradient: AdaGrad ``v + g^2``, else ``beta2 v + (1 - beta2) g^2``."""
    if graft is Grafting.ADAGRAD:
        v.addcmul_(g, g)
    else:
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def grafting_direction(gbar: Tensor, v: Tensor, graft: Grafting, beta2: float, t: int, epsilon: float) -> Tensor:
    """``gbar / (sqrt(vhat) + epsilon)``, ``vhat`` bias-corrected by ``1 - beta2^t`` for Adam only."""
    vhat = v / (1 - beta2**t) if graft is Grafting.ADAM else v
    return gbar / vhat.sqrt().add_(epsilon)


def graft_rescale_(pre: Tensor, graft: Tensor) -> Tensor:
    """Rescale every block of a ``[B, *shape]`` stack of preconditioned blocks in place to its grafting
    block's norm: ``pre * ||graft|| / (||pre|| + 1e-16)``. Returns ``pre``."""
    dims = tuple(range(1, pre.ndim))
    scale = torch.linalg.vector_norm(graft, dim=dims) / torch.linalg.vector_norm(pre, dim=dims).add(GRAFT_NORM_EPS)
    return pre.mul_(scale.view(-1, *([1] * (pre.ndim - 1))))


# ---- the optimizer skeleton ---------------------------------------------------------------
class BlockPreconditioner(torch.optim.Optimizer):
    """Base of the optimizers that precondition whole blocks on each rank (see [Note: preconditioner
    base]). Subclasses set ``_name``, keep a plan per parameter in ``self._plans`` (with ``name`` and
    ``info``, its ``LocalShard``) and implement ``_resolve_group``, ``_plan_group``, ``_step_param``
    and ``_step_group_batched``."""

    _name: ClassVar[str]

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, batched: bool | None) -> None:
        self._plans: dict[Tensor, Any] = {}
        self._batched = batched
        self._runs: tuple[TPRunExchange, ...] | None = None
        super().__init__(params, defaults)
        make_dcp_ready(self)

    # ---- groups ---------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, its hyperparameters checked as the constructor's; a group refused for its
        parameters' layout is taken back out, with the plans and state made for it."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        super().add_param_group(self._resolve_group(param_group))
        try:
            self._plan_group(self.param_groups[-1])
        except BaseException:
            discard_last_group(self, self._plans)
            raise
        finally:
            self._runs = None  # re-planned at the next step

    def _resolve_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        """The group to add: its hyperparameters checked (``ValueError``) and resolved."""
        raise NotImplementedError

    def _plan_group(self, group: dict[str, Any]) -> None:
        """Plan the blocks of the group's parameters and make their state."""
        raise NotImplementedError

    # ---- step -----------------------------------------------------------------------------
    @profiled_step
    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim signature
        """One step on every local block (Shampoo's split strips: one exchange pair per shard group)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p, _ in todo:
            if p.grad.is_sparse or torch.is_complex(p):
                raise RuntimeError(f"{self._name} does not support sparse gradients or complex parameters")
        self._check_finite([p for p, _ in todo])
        batched = self._batched if self._batched is not None else self._batched_default([p for p, _ in todo])
        self._step_all(todo, batched)
        return loss

    def _step_all(self, todo: list[tuple[torch.Tensor, dict[str, Any]]], batched: bool) -> None:
        """Step every ``(parameter, group)`` of ``todo``: one parameter at a time, or per group batched."""
        if not batched:
            for p, group in todo:
                self._step_param(p, group)
            return
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group_batched(params, group)

    def _batched_default(self, params: list[Tensor]) -> bool:
        """The mode of ``batched=None``."""
        return True

    def _run_shift(self) -> int:
        """The next TP-split parameter's index (``plan_tp_run``'s ``shift``), in planning order."""
        return sum(getattr(plan, "run", None) is not None for plan in self._plans.values())

    def _run_exchanges(self) -> tuple[TPRunExchange, ...]:
        """One exchange per TP group holding parameters assembled in runs here (a plan's ``run``,
        [Note: preconditioner blocks under tensor parallelism]), planned at the first step and again
        when such a parameter moved to another device."""
        if self._runs is None or any(p.device != ex.device for ex in self._runs for p, _ in ex.runs):
            by_group: dict[int, list[tuple[Tensor, TPRun]]] = {}
            for group in self.param_groups:
                for p in group["params"]:
                    run = getattr(self._plans[p], "run", None)
                    if run is not None and run.info.local_numel:
                        by_group.setdefault(id(run.info.tp.group), []).append((p, run))
            self._runs = tuple(TPRunExchange(rs) for rs in by_group.values())
        return self._runs

    def _agreeing_groups(self) -> list[Any]:
        """The process groups over which a non-finite gradient is agreed, so that every rank raises alike:
        where TP ranks exchange runs, every rank of their mesh (the TP group would otherwise hang in the
        exchange, the data-parallel ranks step on): the dims of the merged (dp, tp) state mesh, one group
        without HSDP."""
        groups = {}
        for plan in self._plans.values():  # (every rank plans the same runs, held here or not)
            run = getattr(plan, "run", None)
            mesh = run.mesh if run is not None else None
            for d in range(mesh.ndim if mesh is not None else 0):
                if mesh.size(d) > 1:
                    groups.setdefault(id(mesh.get_group(d)), mesh.get_group(d))
        return list(groups.values())

    def _check_finite(self, params: list[Tensor]) -> None:
        """``FloatingPointError`` naming the parameter(s) whose local gradient has a NaN or Inf (one
        host sync per step). Raised before any state changes ([Note: non-finite gradients]). Where
        ranks exchange blocks, the flags are agreed over each such group first (one ``all_reduce``),
        so that every rank raises before any exchange."""
        groups = self._agreeing_groups()
        if groups:
            return self._check_finite_agreed(groups)
        if not params:
            return
        flags = torch.stack([torch.isfinite(local_tensor(p.grad)).all() for p in params]).tolist()
        bad = [self._plans[p] for p, ok in zip(params, flags) if not ok]
        if bad:
            names = ", ".join(f"{b.name} (shape {tuple(b.info.shape)})" for b in bad)
            raise FloatingPointError(
                f"{self._name}: non-finite gradient (NaN or Inf) in {names} on rank {bad[0].info.rank}; no state "
                "was changed. Find its source (loss scale, learning rate, data) or skip this step"
            )

    def _check_finite_agreed(self, groups: list[Any]) -> None:
        allp = [p for g in self.param_groups for p in g["params"]]
        rank = dist.get_rank()
        flags = torch.stack([
            torch.isfinite(local_tensor(p.grad)).all().logical_not() if p.grad is not None else torch.tensor(False, device=p.device)
            for p in allp
        ]).int() * (rank + 1)  # fmt: skip
        for group in groups:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        bad = [(p, r - 1) for p, r in zip(allp, flags.tolist()) if r]
        if bad:
            names = ", ".join(f"{self._plans[p].name} (shape {tuple(self._plans[p].info.shape)}, rank {r})" for p, r in bad)
            raise FloatingPointError(
                f"{self._name}: non-finite gradient (NaN or Inf) in {names}; every rank raises this and no state "
                "was changed. Find its source (loss scale, learning rate, data) or skip this step"
            )

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        """One step of ``p``, one block at a time."""
        raise NotImplementedError

    def _step_group_batched(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """One step of every parameter of ``group``, same-shape blocks batched."""
        raise NotImplementedError
