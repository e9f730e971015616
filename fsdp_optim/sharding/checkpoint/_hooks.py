"""DCP-ready ``model.state_dict()`` / ``optimizer.state_dict()`` (as FSDP2's DTensors): hooks that
wrap sharded parameters and optimizer state as ``FlatShardTensor`` and take them (or full tensors)
back on load.

Integration: ``fully_shard``'s root call runs ``register_state_dict_hooks(root)``; an optimizer runs
``register_optimizer_hooks(optimizer)`` (e.g. at the end of its ``__init__``). ``save_checkpoint`` /
``load_checkpoint`` need neither.
"""

from __future__ import annotations

import math
import sys
import types
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from .._shard_info import shard_info
from ._flat_shard import FlatShardTensor
from ._state import ShardedState, StateKind, ensure_sharded, state_kinds, wrap_module_state, wrap_param

__all__ = ["install_dcp_ready_hook", "register_optimizer_hooks", "register_state_dict_hooks"]


_HOOKED = "_fsdp_optim_ckpt_hooks"


# [Note: load_state_dict(assign=True) on sharded parameters]
# ``nn.Module.load_state_dict(sd, assign=True)`` replaces each parameter object by the state dict's
# tensor. A sharded parameter is a view into its bucket's flat segment, which the runtime gathers
# from and the reduce-scatter writes into; a new object there is read by no one (the load reported
# success and loaded nothing). So for sharded parameters the root's pre-hook copies this rank's
# range into the runtime's parameter (materializing a meta-built bucket first, as every load does)
# and hands nn.Module that same parameter to assign: the objects, device and dtype stay the
# runtime's (a dtype the state dict would have changed is warned about). Unsharded parameters and
# buffers are assigned as torch does (so a meta-built model's buffers become real).
def register_state_dict_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` return ``FlatShardTensor`` for sharded parameters (DCP-ready, as
    FSDP2's DTensors) and ``module.load_state_dict()`` accept those or full tensors. Idempotent;
    ``fully_shard``'s root calls it."""
    if getattr(module, _HOOKED, False):
        return
    setattr(module, _HOOKED, True)

    def pre_hook(mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        ensure_sharded(mod)

    def post_hook(mod: nn.Module, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if _full_state_requested():  # see [Note: full state dicts through DCP's state_dict API]
            _gather_module_state(mod, sd, prefix)
        else:
            wrap_module_state(mod, sd, prefix)

    def load_pre_hook(mod, sd, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        ensure_sharded(mod)
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        inner = _inner_prefixes(mod)
        for name, p in mod.named_parameters(remove_duplicate=False):
            key = prefix + name
            info = shard_info(p)
            if info is None or key not in sd or name.startswith(inner):
                continue
            v = sd[key]
            shape = tuple(v.shape) if torch.is_tensor(v) else None
            whole = info.global_shape
            span = (info.global_start, info.global_start + info.local_numel)
            if shape is not None and shape != whole and not (whole == () and shape == (1,)):  # (nn.Module's)
                # Compared with the global shape here: nn.Module compares with the local piece's, and a
                # plain tensor of another model that happens to have this rank's flat length would load
                # silently as every rank's piece. (A local piece is only accepted as FlatShardTensor.)
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {torch.Size(v.shape)} from checkpoint, "
                    f"the shape in current model is {torch.Size(whole)}."
                )
                sd[key] = p  # nn.Module copies the parameter onto itself: nothing changes, nothing is missing
                continue
            if isinstance(v, FlatShardTensor):
                if v.local_range != span:
                    error_msgs.append(
                        f"{key}: the FlatShardTensor holds [{v.local_range[0]}, {v.local_range[1]}) but this rank's "
                        f"shard is [{span[0]}, {span[1]}); dcp.load into model.state_dict() to reshard"
                    )
                    continue
                local = v.to_local()
            elif torch.is_tensor(v):
                local = v.detach().reshape(-1)[span[0] : span[1]]  # a full tensor: take this rank's range
            else:
                continue
            if assign:  # see [Note: load_state_dict(assign=True) on sharded parameters]
                if local.dtype != p.dtype:
                    warnings.warn(
                        f"load_state_dict(assign=True): {key} is {local.dtype} in the state dict but the sharded "
                        f"parameter is {p.dtype}; assign=True cannot change a sharded parameter's dtype, the values "
                        f"are copied as {p.dtype} (cast the model before fully_shard to change it)",
                        stacklevel=3,
                    )
                with torch.no_grad():
                    p.copy_(local)
                sd[key] = p  # assigning the parameter to itself: nn.Module keeps the runtime's object
            else:
                sd[key] = local

    module.register_state_dict_pre_hook(pre_hook)
    module.register_state_dict_post_hook(post_hook)
    module.register_load_state_dict_pre_hook(load_pre_hook)


def _inner_prefixes(mod: nn.Module) -> tuple[str, ...]:
    """The name prefixes of ``mod``'s submodules with hooks of their own: a submodule sharded on its own
    first (``fully_shard(layer)``) keeps its hooks, and its keys are left to it (its hooks run on the
    same entries), so each entry is converted once, by the innermost."""
    return tuple(f"{n}." for n, m in mod.named_modules(remove_duplicate=False) if n and getattr(m, _HOOKED, False))


# [Note: full state dicts through DCP's state_dict API]
# ``torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions(
# full_state_dict=True))`` (and ``get_state_dict``) calls ``model.state_dict()`` and gathers the
# DTensors and ShardedTensors in it into full tensors. A FlatShardTensor is neither, so each rank got
# its own flat piece back as if it were the full tensor. torch tells the hook nothing of the options,
# so the state-dict post hook looks for the ``_StateDictInfo`` of an enclosing ``_get_model_state_dict``
# frame of that module: with ``full_state_dict`` set, sharded parameters are returned as full tensors
# (gathered in the shard group, one parameter at a time, in the same order on every rank: every rank
# calls ``get_model_state_dict``, as torch requires), which torch then offloads to the CPU and keeps on
# rank 0 only under ``cpu_offload``, as for FSDP2. ``fsdp_optim.full_state_dict(model)`` does the same
# with less memory (one bucket at a time). tests/sharding/checkpoint/test_full_state.py fails if a torch release
# renames the frame.
_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def _dcp_options(function: str) -> Any:
    """The ``_StateDictInfo`` of an enclosing DCP ``function`` frame (``_get_model_state_dict`` or
    ``_get_optim_state_dict``), or None outside one."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == _DCP_STATE_DICT:
            return frame.f_locals.get("info")
        frame = frame.f_back
    return None


def _full_state_requested() -> bool:
    """Whether this ``state_dict()`` runs inside DCP's ``get_model_state_dict`` with ``full_state_dict=True``."""
    return bool(getattr(_dcp_options("_get_model_state_dict"), "full_state_dict", False))


def _gather_module_state(mod: nn.Module, sd: dict[str, Any], prefix: str) -> None:
    """Replace ``mod``'s sharded parameters in ``sd`` by their full tensors (a collective per parameter;
    those of submodules with their own hooks are theirs, gathered when their hook ran)."""
    inner = _inner_prefixes(mod)
    full: dict[int, torch.Tensor] = {}  # (tied parameters: gathered once)
    for name, p in mod.named_parameters(remove_duplicate=False):
        key, info = prefix + name, shard_info(p)
        if info is None or key not in sd or name.startswith(inner):
            continue
        if id(p) not in full:
            # (expert parallel: the pieces of the whole [E, ...] tensor lie on every rank of the world)
            full[id(p)] = wrap_param(p, info).full_tensor(info.group if info.expert is None else None)
        sd[key] = full[id(p)]


def register_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` DCP-ready: sharded state as ``FlatShardTensor`` (torch's
    id-keyed layout otherwise); ``optimizer.load_state_dict()`` takes it back. A lazy optimizer
    with no state yet gets it from one zero-learning-rate step (as ``torch.distributed.checkpoint.
    state_dict`` does) so that a fresh optimizer's state dict has every key for ``dcp.load``."""
    if getattr(optimizer, _HOOKED, False):
        return
    setattr(optimizer, _HOOKED, True)
    dtypes: dict[tuple[torch.Tensor, str], torch.dtype] = {}

    def pre_hook(opt: torch.optim.Optimizer) -> None:
        if not opt.state and not isinstance(opt, ShardedState):
            _init_lazy_state(opt)

    def post_hook(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        params = [p for g in opt.param_groups for p in g["params"]]
        # [Note: full optimizer state through DCP's state_dict API]
        full = getattr(_dcp_options("_get_optim_state_dict"), "full_state_dict", False)
        if full:
            _check_same_state_everywhere(opt, params, sd)
        new_state = {}
        for i, p in enumerate(params):
            if i not in sd["state"]:
                continue
            kinds = state_kinds(opt, p, f"param {i}")
            entry = dict(sd["state"][i])
            for key, (kind, where) in kinds.items():
                if kind == StateKind.SHARDED:
                    shape, start = where
                    entry[key] = FlatShardTensor(entry[key].detach().reshape(-1), shape=shape, start=start)
                    if full:
                        entry[key] = _whole(entry[key], p)
            new_state[i] = entry
        return {**sd, "state": new_state}

    def unwrap(sd: dict[str, Any]) -> dict[str, Any]:
        dtypes.clear()
        # the saved ids (ints from state_dict(); FQNs from DCP's set_optimizer_state_dict) -> parameters,
        # matched by position in the groups, as torch's load_state_dict does
        saved = sd.get("param_groups", [])
        by_id = {i: p for sg, g in zip(saved, optimizer.param_groups) for i, p in zip(sg["params"], g["params"])}
        new_state = {}
        for i, entry in sd["state"].items():
            e = {}
            for k, v in entry.items():
                if isinstance(v, FlatShardTensor):
                    v = v.to_local()
                elif torch.is_tensor(v) and i in by_id:
                    v = _local_range_of_full(optimizer, by_id[i], i, k, v)
                if torch.is_tensor(v) and i in by_id:
                    dtypes[(by_id[i], k)] = v.dtype
                e[k] = v
            new_state[i] = e
        return {**sd, "state": new_state}

    def load_post_hook(opt: torch.optim.Optimizer) -> None:
        # Optimizer.load_state_dict casts every state tensor to its parameter's dtype; undo that
        # for integer state (8-bit codes): the cast to float and back is exact for 8-bit values.
        for (p, k), dt in dtypes.items():
            st = opt.state.get(p)
            if st is not None and torch.is_tensor(st.get(k)) and st[k].dtype != dt:
                st[k] = st[k].to(dt)
        dtypes.clear()

    optimizer.register_state_dict_pre_hook(pre_hook)
    optimizer.register_state_dict_post_hook(post_hook)
    # Unwrap before the optimizer's own load_state_dict (overrides read the dict before torch's
    # pre-hooks run); a bound method on the instance, so copies of the optimizer rebind it.
    def load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        type(self).load_state_dict(self, unwrap(state_dict))

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    optimizer.register_load_state_dict_post_hook(load_post_hook)


# [Note: full optimizer state through DCP's state_dict API]
# ``get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))`` (and
# ``get_state_dict``) gathers DTensors; a FlatShardTensor is neither a DTensor nor a ShardedTensor, so
# each rank got its own flat pieces back under the parameters' names, as if they were the full state.
# As for the model ([Note: full state dicts through DCP's state_dict API]), the optimizer's state-dict
# post hook finds the ``_StateDictInfo`` of the enclosing ``_get_optim_state_dict`` frame and, with
# ``full_state_dict``, returns each sharded state tensor whole: per-element state in its parameter's
# global shape, per-block state (Shampoo's factors) as its global flat vector, gathered in the
# parameter's shard group (the world for expert-parallel experts), one tensor at a time, in parameter
# order (torch requires every rank to call it). The keys to gather are checked to be the same on every
# rank first (one object all-gather), so a rank without some state raises there instead of hanging.
# Loading such a dict back (``set_optimizer_state_dict(..., full_state_dict=True)``) slices each rank's
# range out of the full tensors in ``unwrap``.
def _spans_ranks(p: torch.Tensor) -> bool:
    info = shard_info(p)
    return info is not None and (info.world_size > 1 or info.expert is not None)


def _whole(piece: FlatShardTensor, p: torch.Tensor) -> torch.Tensor:
    """The whole state tensor of ``piece``: gathered in ``p``'s shard group (the world for experts), or
    the piece itself where ``p`` is not sharded across ranks."""
    if not _spans_ranks(p):
        return piece.to_local().reshape(piece.shape)
    info = shard_info(p)
    return piece.full_tensor(info.group if info.expert is None else None)


def _check_same_state_everywhere(opt: torch.optim.Optimizer, params: list[torch.Tensor], sd: dict[str, Any]) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not any(_spans_ranks(p) for p in params):
        return  # nothing to gather: no collective (a plain model's optimizer, one process)
    mine = [(i, sorted(k for k, (kind, _) in state_kinds(opt, p, f"param {i}").items() if kind == StateKind.SHARDED))
            for i, p in enumerate(params) if i in sd["state"]]  # fmt: skip
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(e != every[0] for e in every):
        bad = next(r for r, e in enumerate(every) if e != every[0])
        raise ValueError(
            f"get_optimizer_state_dict(full_state_dict=True): rank {bad} holds other sharded optimizer state than rank "
            f"0 ({type(opt).__name__}: state exists for {len(every[bad])} vs {len(every[0])} parameters); every rank "
            "must have stepped the same parameters. Take one optimizer step on every rank first, or use "
            "fsdp_optim.save_checkpoint"
        )


def _local_range_of_full(opt: torch.optim.Optimizer, p: torch.Tensor, i: int, key: str, v: torch.Tensor) -> torch.Tensor:
    """A plain tensor given for sharded state ``key`` of ``p``: this rank's local piece as it is, or the
    full state (``get_optimizer_state_dict(full_state_dict=True)``'s) sliced to this rank's range."""
    current = opt.state.get(p, {}).get(key)
    if current is None or not torch.is_tensor(current):
        return v
    kind, where = state_kinds(opt, p, f"param {i}").get(key, (None, None))
    if kind != StateKind.SHARDED:
        return v
    shape, start = where
    n_global, n_local = math.prod(shape), current.numel()
    if v.numel() == n_local:
        return v
    if v.numel() == n_global:
        return v.reshape(-1)[start : start + n_local].view(current.shape)
    info = shard_info(p)
    raise ValueError(
        f"{type(opt).__name__}.load_state_dict: state {key!r} of param {i} (global shape {tuple(info.global_shape) if info else tuple(p.shape)}) "
        f"is a tensor of {v.numel()} elements, neither the full state ({n_global}) nor this rank's piece "
        f"({n_local}, world size {info.world_size if info else 1}); pass the optimizer's own state_dict() or the "
        "full one from get_optimizer_state_dict(..., full_state_dict=True)"
    )


def install_dcp_ready_hook() -> None:
    """Once per process: every optimizer over sharded parameters gets ``register_optimizer_hooks`` at its
    first step (ours register them in ``__init__``), so that ``optimizer.state_dict()`` of a torch
    optimizer is DCP-ready too. Before, a ``torch.optim`` optimizer without the explicit call gave each
    rank's flat pieces as plain tensors under the same keys, which ``dcp.save`` takes for replicated
    values and writes once (one rank's pieces): a silently wrong checkpoint."""
    global _DCP_HOOK_INSTALLED
    if _DCP_HOOK_INSTALLED:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> parameters looked at

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if getattr(opt, _HOOKED, False):
            return
        num_params = sum(len(g["params"]) for g in opt.param_groups)
        if checked.get(opt) == num_params:  # no sharded parameter, no group added since: O(groups) a step
            return
        if any(shard_info(p) is not None for g in opt.param_groups for p in g["params"]):
            register_optimizer_hooks(opt)
        checked[opt] = num_params

    register_optimizer_step_pre_hook(hook)
    _DCP_HOOK_INSTALLED = True


_DCP_HOOK_INSTALLED = False


def _init_lazy_state(opt: torch.optim.Optimizer) -> None:
    """Create a lazy optimizer's state without changing parameters: one step at lr 0 with zero
    gradients, the step counters then reset by the checkpoint that is loaded into it."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None
