"""Shared plumbing of the sharded optimizers: finding each parameter's shard and block spec."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# ShardedState: re-exported, the checkpoint contract lives with the checkpoints
from ..sharding.contract import (
    BlockRule,
    BlockSpec,
    LocalShard,
    RaggedDTensor,
    ShardedState,
    check_not_replaced,
    local_shard,
    local_tensor,
    materialize_all,
)

__all__ = ["range_pieces", "param_info", "checked_param_info", "require_spec", "check_adam_hparams", "make_dcp_ready", "StateShard", "ShardedState", "apply_update", "discard_last_group", "local_tensor", "per_element", "state_range"]


def range_pieces(bounds: Sequence[int], offset: int, numel: int) -> tuple[tuple[int, int, int], ...]:
    """``(rank, a, b)`` for every rank holding a non-empty part ``[a, b)`` (offsets local to the range)
    of the flat range ``[offset, offset + numel)`` under rank ``bounds``; O(log W + ranks spanned).
    (A split matrix's or strip's pieces: Muon and Shampoo exchange them.)"""
    out = []
    q = bisect.bisect_right(bounds, offset) - 1
    while q < len(bounds) - 1 and bounds[q] < offset + numel:
        a, b = max(bounds[q], offset) - offset, min(bounds[q + 1], offset + numel) - offset
        if b > a:
            out.append((q, a, b))
        q += 1
    return tuple(out)


class StateShard(NamedTuple):
    """Where one optimizer-state tensor of one parameter lies in its global flat form.

    [Note: checkpoint-shaped optimizer state]
    Every sharded state tensor of a parameter (``optimizer.state[p][key]``) is this rank's
    contiguous piece ``[start, end)`` of a *global flat state vector* of ``global_numel``
    elements whose order follows the parameter's global block order, so it is identical for
    every world size and plan: per-element state (AdamW moments, Muon momentum, 8-bit codes)
    is simply the parameter's own flat range; per-block state (8-bit scales: one per 256-block;
    Shampoo factors: each block's factor flattened, blocks in global order) is the range of
    this rank's blocks. The local tensor may have any shape but must have ``end - start``
    elements and be contiguous (checkpoints read it with ``reshape(-1)``). Keys not listed by
    ``state_shards`` (e.g. ``step``) are replicated: equal on every rank. State is created
    eagerly in ``__init__`` so that keys and shapes are the same before and after the first
    step (a checkpoint can be loaded into a fresh optimizer). ``bounds`` holds every shard rank's
    range (``state_range`` computes it from the parameter's rank bounds), so the state is a
    ``RaggedDTensor`` on the parameter's mesh in ``state_dict()`` without any communication.
    """

    global_numel: int
    start: int
    end: int
    bounds: tuple[int, ...] | None = None
    """Every shard rank's start in the global vector, then ``global_numel`` (``world_size + 1`` values):
    the layout checkpoints and ``state_dict()`` give the state (a ``RaggedDTensor``). ``None`` only for
    a parameter held whole by one rank."""
    rows: bool = False
    """One entry per row (dim-0 slice) of the parameter's (TP-local) shape, ``bounds`` over its rows
    (NorMuon's second moments): checkpointed as a vector of the *global* rows, so it loads across TP
    sizes: split over TP as the rows are (a cut on dim 0), else a copy on every TP rank."""
    mesh: DeviceMesh | None = None
    """Where ``bounds`` are not over the parameter's shard ranks: the mesh whose ragged dim they lay
    the state over (state that TP ranks own in runs of the global vector, ``LocalShard.tp_state_mesh``: one range
    per (shard coordinate, TP coordinate) cell, [Note: preconditioner blocks under tensor parallelism])."""


def profiled_step(step: Callable) -> Callable:
    """Decorate an optimizer's ``step``: a ``fsdp_optim::optimizer_step(<class>)`` profiler range, after
    ``check_layouts`` (the layouts its plans were made for are still the parameters')."""

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        check_layouts(self)
        with torch.profiler.record_function(f"fsdp_optim::optimizer_step({type(self).__name__})"):
            return step(self, *args, **kwargs)

    return wrapper


_LAYOUTS = "_fsdp_optim_planned_layouts"


def record_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Remember each sharded parameter's spec as the optimizer planned (and made state) for it."""
    seen = getattr(optimizer, _LAYOUTS, None)
    if seen is None:
        seen = {}
        setattr(optimizer, _LAYOUTS, seen)
    for g in optimizer.param_groups:
        for p in g["params"]:
            if isinstance(p, RaggedDTensor) and p not in seen:
                seen[p] = p._spec


def check_layouts(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` if a sharded parameter was laid out again since the optimizer planned for it.

    A root ``fully_shard`` call re-lays out the parameters of the inner calls it absorbs *in place*
    (the same objects), so an optimizer built between the inner calls and the root holds live
    parameters: torch's, which make state at their first step, train them; ours made their per-block
    plans and state for the inner layout, which a step would then apply to other elements. One identity
    comparison per parameter and step."""
    record_layouts(optimizer)  # (parameters added since: planned for their current layout)
    seen = getattr(optimizer, _LAYOUTS)
    for p, spec in seen.items():
        if p._spec is not spec:
            name = getattr(p, "_fqn", "") or "<unnamed>"
            raise ValueError(
                f"{type(optimizer).__name__}: parameter {name} (shape {tuple(p.shape)}) was laid out again by a later "
                f"fully_shard call (now {p.ragged}) after the optimizer planned its state; build the optimizer after "
                "the outermost fully_shard call (the root), from model.parameters()"
            )


def state_range(info: LocalShard, state_before: Callable[[int], int]) -> StateShard:
    """The ``StateShard`` of a global state vector laid out by ``info``'s rank bounds:
    ``state_before(b)`` is the number of state elements of the blocks that start before flat parameter
    offset ``b`` (per-element state: ``b`` itself; one scale per 256-block: ``ceil(b / 256)``)."""
    bounds = tuple(int(state_before(b)) for b in info.layout.bounds)
    return StateShard(bounds[-1], bounds[info.rank], bounds[info.rank + 1], bounds)


def per_element(info: LocalShard) -> StateShard:
    """The ``StateShard`` of state with one element per parameter element: the parameter's own range."""
    return StateShard(info.numel, info.start, info.end, tuple(info.layout.bounds))


def param_info(p: torch.Tensor, rule: BlockRule, *, name: str = "") -> LocalShard:
    """The ``LocalShard`` of ``p`` (read from the ``RaggedDTensor``); for a plain parameter, one rank
    holding all of it with the spec ``rule`` gives from its shape (names and owner modules are unknown there)."""
    if isinstance(p, RaggedDTensor):
        if p.numel() > 0 and p._local_tensor.untyped_storage().nbytes() == 0 and p._local_tensor.numel() > 0:
            materialize_all()  # a lazy (meta-built, unused) bucket: the optimizer's state is made from real values
        return local_shard(p, name=name)
    check_not_replaced([p], owner="the optimizer")
    shape = tuple(p.shape)
    spec = rule(name, p, None)
    spec.check(shape, name or f"parameter of shape {shape}")
    return LocalShard.whole(shape, spec, fqn=name)


def checked_param_info(
    p: torch.Tensor, rule: BlockRule, *, optimizer: str, blocks: str, name: str = "", whole_blocks: bool = False,
    tp_assembles: Callable[[LocalShard], bool] | None = None, tp_supported: str = "",
) -> LocalShard:
    """``param_info`` plus the checks every optimizer makes: the local piece has the size its layout
    gives this rank; with ``whole_blocks`` (optimizers that view blocks as matrices) also no DTensor of
    torch's placements and no non-contiguous plain parameter. A tensor-parallel parameter whose TP cut
    splits the optimizer's blocks (``LocalShard.tp``) is refused unless ``tp_assembles(info)`` says the
    optimizer assembles such blocks over TP exactly (else ``tp_supported`` says what it does assemble)."""
    if whole_blocks and isinstance(p, DTensor) and not isinstance(p, RaggedDTensor):
        raise ValueError(
            f"{optimizer}: parameter {name or '<unnamed>'} is a DTensor with placements {p.placements} (PyTorch "
            f"FSDP2 / TP); shard the model with fsdp_optim's fully_shard(..., blocks={blocks}) or pass plain tensors"
        )
    info = param_info(p, rule, name=name)
    if info.local_numel != local_tensor(p).numel():
        raise ValueError(
            f"{optimizer}: parameter {info.fqn or '<unnamed>'} holds {local_tensor(p).numel()} elements but its layout "
            f"gives rank {info.rank} {info.local_numel} (shape {info.shape}, world size {info.world_size})"
        )
    if info.tp is not None and not (tp_assembles is not None and tp_assembles(info)):
        raise tp_cut_error(info, optimizer=optimizer, supported=tp_supported)
    if whole_blocks and not isinstance(p, RaggedDTensor) and not p.is_contiguous():
        raise ValueError(f"{optimizer}: plain parameter {name or '<unnamed>'} (shape {info.shape}) must be contiguous")
    return info


def tp_cut_error(info: LocalShard, *, optimizer: str, supported: str = "") -> ValueError:
    """The refusal of a tensor-parallel parameter whose TP cut splits blocks ``optimizer`` needs whole."""
    tp = info.tp
    return ValueError(
        f"{optimizer}: parameter {info.fqn or '<unnamed>'} (global shape {tp.global_shape}) is tensor-parallel, "
        f"split along dim {tp.dim} over {tp.size} TP ranks (TP-local shape {info.shape}, mesh {tp.mesh}), which "
        f"cuts the {tp.blocks} blocks {optimizer} needs whole, and {optimizer} has no exact way to assemble them"
        + (f" ({supported})" if supported else "")
        + ". Leave this module out of the TP plan (or use a plan whose cut keeps the blocks whole, e.g. per-head "
        "blocks with ColwiseParallel), use Muon for 2-D matrices (it assembles each TP-sharded matrix inside its TP "
        "group), or an element-wise optimizer (AdamW) for this parameter"
    )


def require_spec(info: LocalShard, ok: bool, *, optimizer: str, need: str, blocks: str) -> None:
    """Raise the standard error when a parameter's layout breaks what ``optimizer`` needs."""
    if ok:
        return
    raise ValueError(
        f"{optimizer}: parameter {info.fqn or '<unnamed>'} (shape {info.shape}, world size "
        f"{info.world_size}) is sharded with {info.spec} blocks, but {optimizer} needs {need}; "
        f"shard the model with fully_shard(..., blocks={blocks})"
    )


def check_adam_hparams(*, lr: float | torch.Tensor, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """``ValueError`` for out-of-range Adam hyperparameters (the checks torch.optim.AdamW makes)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"lr: a tensor lr must have 1 element, got shape {tuple(lr.shape)}")
    if not 0.0 <= float(lr):
        raise ValueError(f"lr must be >= 0, got {float(lr)}")
    if not 0.0 <= eps:
        raise ValueError(f"eps must be >= 0, got {eps}")
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {float(b)}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def apply_update(flat: torch.Tensor, direction: torch.Tensor, step_size: float, decay: float = 0.0) -> None:
    """``flat -= step_size * direction``, then ``flat -= decay * flat`` (SOAP's decoupled decay on the
    updated parameter), with an fp32 ``direction``.

    [Note: low-precision updates]
    fp32 / fp64 parameters take the ops as written. Lower precisions are updated in fp32 and rounded
    once: torch's CPU ``add_(other, alpha=)`` with both operands bf16 rounds ``alpha`` to bf16 in its
    vectorized body but not in its scalar tail (the last ``numel % 64`` elements, on AVX-512, and
    each thread's chunk's end), so on a shard the elements before a rank boundary would round
    differently from the same elements of the whole tensor (1 bf16 ulp, seen at 3 of 11137
    elements), and a sharded run would depend on W. The fp32 kernels are the same for every element.
    """
    if flat.dtype in (torch.float32, torch.float64):
        flat.add_(direction.to(flat.dtype), alpha=-step_size)
        if decay:
            flat.add_(flat, alpha=-decay)
        return
    x = flat.float().add_(direction, alpha=-step_size)
    if decay:
        x.add_(x, alpha=-decay)
    flat.copy_(x)


def discard_last_group(optimizer: torch.optim.Optimizer, plans: dict[torch.Tensor, Any]) -> None:
    """Undo ``add_param_group``'s append when checking its parameters raised: the group, and the plans
    and state made for its parameters, go, so a refused group leaves the optimizer as it was."""
    group = optimizer.param_groups.pop()
    for p in group["params"]:
        plans.pop(p, None)
        optimizer.state.pop(p, None)


def make_dcp_ready(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` / ``load_state_dict()`` DCP-ready when any parameter is
    sharded (sharded state as ``RaggedDTensor`` s of its global form, as FSDP2 does with DTensor),
    so ``torch.distributed.checkpoint`` save/load on them directly reshards across world sizes."""
    from ..sharding.contract import register_optimizer_hooks

    record_layouts(optimizer)
    if any(isinstance(p, RaggedDTensor) for g in optimizer.param_groups for p in g["params"]):
        register_optimizer_hooks(optimizer)


def spec_of(p: torch.Tensor, rule: BlockRule) -> BlockSpec:
    return param_info(p, rule).spec
