"""State-dict hooks of sharded models and of fsdp_optim's optimizers.

A sharded parameter is a ``RaggedDTensor``, so ``model.state_dict()`` is DCP-ready as it is (as
FSDP2's DTensors), and torch's ``get_model_state_dict(..., full_state_dict=True)`` gathers it
through ``RaggedDTensor.redistribute``; torch's optimizers make their state from the parameters
(``RaggedDTensor`` s too). What remains here:

- ``register_state_dict_hooks(module)`` (``fully_shard``'s calls): reshard a bucket left gathered
  before ``state_dict()``; let ``load_state_dict`` take full (unsharded) tensors and keep the
  runtime's parameter objects under ``assign=True``;
- ``register_optimizer_hooks(optimizer)`` (fsdp_optim's optimizers, at construction): they keep
  their state as flat local pieces (no DTensor dispatch in a step), so ``state_dict()`` presents the
  sharded keys as ``RaggedDTensor`` s of their global state vectors (``StateShard``) and
  ``load_state_dict`` takes those, or the full tensors ``get_optimizer_state_dict(full_state_dict=True)``
  gives, back.
"""

from __future__ import annotations

import math
import types
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .._dtensor import RaggedDTensor
from ._state import ShardedState, StateKind, ensure_sharded, local_piece, state_kinds, state_tensor, torch_names

__all__ = ["register_optimizer_hooks", "register_state_dict_hooks"]


_HOOKED = "_fsdp_optim_ckpt_hooks"


# [Note: load_state_dict(assign=True) on sharded parameters]
# ``nn.Module.load_state_dict(sd, assign=True)`` replaces each parameter object by the state dict's
# tensor. A sharded parameter views its bucket's flat segment, which the runtime gathers from and
# the reduce-scatter writes into; a new object there is read by no one (the load reported success
# and loaded nothing). So for sharded parameters the root's pre-hook copies this rank's range into
# the runtime's parameter (materializing a meta-built bucket first, as every load does) and hands
# nn.Module that same parameter to assign: the objects, device and dtype stay the runtime's (a dtype
# the state dict would have changed is warned about). Unsharded parameters and buffers are assigned
# as torch does (so a meta-built model's buffers become real).
def register_state_dict_hooks(module: nn.Module) -> None:
    """Reshard before ``module.state_dict()``; let ``module.load_state_dict()`` take full tensors, this
    layout's ``RaggedDTensor`` s or replicated DTensors for sharded parameters. Idempotent."""
    if getattr(module, _HOOKED, False):
        return
    setattr(module, _HOOKED, True)

    def pre_hook(mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        ensure_sharded(mod)

    def load_pre_hook(mod, sd, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        ensure_sharded(mod)
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        inner = _inner_prefixes(mod)
        keys = None
        # Attribute paths (nn.Module's walk: a wrapper such as checkpoint_wrapper overrides
        # named_parameters to drop its own component); the key is the path where a renaming hook of a
        # module at or above this one already ran, else the state-dict key ([Note: state-dict names]).
        for name, p in nn.Module.named_parameters(mod, remove_duplicate=False):
            if not isinstance(p, RaggedDTensor) or name.startswith(inner):
                continue
            key = prefix + name
            if key not in sd:
                keys = torch_names(mod) if keys is None else keys
                key = prefix + keys.get(name, name)
                if key not in sd:
                    continue
            v = sd[key]
            if not torch.is_tensor(v):
                continue
            whole = tuple(p.shape)
            shape = tuple(v.shape)
            if shape != whole and not (whole == () and shape == (1,)):  # (nn.Module's)
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {torch.Size(v.shape)} from checkpoint, "
                    f"the shape in current model is {torch.Size(whole)}."
                )
                sd[key] = p  # nn.Module copies the parameter onto itself: nothing changes, nothing is missing
                continue
            try:
                local = _local_piece(p, v)
            except ValueError as e:
                error_msgs.append(f"{key}: {e}")
                sd[key] = p
                continue
            if assign and local.dtype != p.dtype:  # see [Note: load_state_dict(assign=True) on sharded parameters]
                warnings.warn(
                    f"load_state_dict(assign=True): {key} is {local.dtype} in the state dict but the sharded "
                    f"parameter is {p.dtype}; assign=True cannot change a sharded parameter's dtype, the values "
                    f"are copied as {p.dtype} (cast the model before fully_shard to change it)",
                    stacklevel=3,
                )
            with torch.no_grad():
                p._local_tensor.copy_(local)
            sd[key] = p  # the runtime's object: nn.Module copies it onto itself (or assigns it) unchanged

    module.register_state_dict_pre_hook(pre_hook)
    module.register_load_state_dict_pre_hook(load_pre_hook)


def _local_piece(p: RaggedDTensor, v: torch.Tensor) -> torch.Tensor:
    """This rank's flat piece of ``v`` for the sharded parameter ``p``: ``v``'s own piece when it is a
    ``RaggedDTensor`` of ``p``'s layout, this rank's range of a full tensor (plain, or a replicated
    DTensor). Other layouts need a collective: ``dcp.load`` reshards them."""
    a, b = p.local_range
    if isinstance(v, RaggedDTensor):
        if not v.ragged.same_layout(p.ragged) or v.device_mesh != p.device_mesh:
            raise ValueError(
                f"the state dict's RaggedDTensor is laid out as {v.ragged} but this model's parameter as {p.ragged}; "
                "dcp.load into model.state_dict() reshards between layouts"
            )
        return v._local_tensor
    if isinstance(v, DTensor):
        if not all(isinstance(pl, Replicate) for pl in v.placements):
            raise ValueError(
                f"the state dict holds a DTensor with placements {v.placements}; dcp.load into model.state_dict() "
                "reshards it, or pass full tensors (DTensor.full_tensor())"
            )
        v = v.to_local()
    return v.detach().reshape(-1)[a:b]


def _inner_prefixes(mod: nn.Module) -> tuple[str, ...]:
    """The name prefixes of ``mod``'s submodules with hooks of their own: a submodule sharded on its own
    first (``fully_shard(layer)``) keeps its hooks, and its keys are left to it (its hooks run on the
    same entries), so each entry is converted once, by the innermost."""
    return tuple(f"{n}." for n, m in mod.named_modules(remove_duplicate=False) if n and getattr(m, _HOOKED, False))


def register_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` DCP-ready: sharded state (``ShardedState.state_shards``) as
    ``RaggedDTensor`` s of its global state vectors; ``optimizer.load_state_dict()`` takes them (or full
    tensors) back. A lazy optimizer with no state yet gets it from one zero-learning-rate step (as
    ``torch.distributed.checkpoint.state_dict`` does) so that a fresh optimizer's state dict has every
    key for ``dcp.load``."""
    if getattr(optimizer, _HOOKED, False):
        return
    setattr(optimizer, _HOOKED, True)
    dtypes: dict[tuple[torch.Tensor, str], torch.dtype] = {}

    def pre_hook(opt: torch.optim.Optimizer) -> None:
        if not opt.state and not isinstance(opt, ShardedState):
            _init_lazy_state(opt)

    def post_hook(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        params = [p for g in opt.param_groups for p in g["params"]]
        new_state = {}
        for i, p in enumerate(params):
            if i not in sd["state"]:
                continue
            kinds = state_kinds(opt, p, f"param {i}")
            entry = dict(sd["state"][i])
            for key, (kind, where) in kinds.items():
                if kind == StateKind.SHARDED:
                    entry[key] = state_tensor(p, entry[key].detach(), *where)
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
                if torch.is_tensor(v) and i in by_id:
                    v = _local_state(optimizer, by_id[i], i, k, v)
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


def _local_state(opt: torch.optim.Optimizer, p: torch.Tensor, i: int, key: str, v: torch.Tensor) -> torch.Tensor:
    """A state tensor given for ``key`` of ``p``, as the optimizer keeps it: this rank's flat piece of a
    ``RaggedDTensor`` of this layout, the range of a full tensor (``get_optimizer_state_dict(
    full_state_dict=True)``'s), a local piece as it is."""
    current = opt.state.get(p, {}).get(key)
    if isinstance(current, RaggedDTensor):  # a torch optimizer's state: a DTensor as the state dict's
        return v
    kind, where = state_kinds(opt, p, f"param {i}").get(key, (None, None))
    if isinstance(v, DTensor) and all(isinstance(pl, Replicate) for pl in v.placements):
        v = v.to_local()
    if kind != StateKind.SHARDED or current is None or not torch.is_tensor(current):
        return v._local_tensor if isinstance(v, RaggedDTensor) else v
    shape, bounds = where.shape, where.bounds
    if isinstance(v, RaggedDTensor):
        if tuple(v.ragged.bounds) != tuple(bounds) or tuple(v.shape) != tuple(shape):
            raise ValueError(
                f"{type(opt).__name__}.load_state_dict: state {key!r} of param {i} is laid out as {v.ragged}, this "
                f"optimizer's as bounds {list(bounds)} of shape {tuple(shape)}; dcp.load reshards between layouts"
            )
        return v._local_tensor.view(current.shape)
    n_global, n_local = math.prod(shape), current.numel()
    if v.numel() == n_global and (n_global != n_local or tuple(v.shape) == tuple(shape)):
        return local_piece(p, v, where).view(current.shape)  # (a full tensor: this rank's piece of it)
    if v.numel() == n_local:
        return v.reshape(current.shape)
    raise ValueError(
        f"{type(opt).__name__}.load_state_dict: state {key!r} of param {i} (shape {tuple(p.shape)}) is a tensor of "
        f"{v.numel()} elements, neither the full state ({n_global}) nor this rank's piece ({n_local}); pass the "
        "optimizer's own state_dict() or the full one from get_optimizer_state_dict(..., full_state_dict=True)"
    )


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
