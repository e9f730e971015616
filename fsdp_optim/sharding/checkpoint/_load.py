"""``load_checkpoint``: check a checkpoint against the model and optimizer on every rank, agree on
the verdict, then read the small entries, then the tensors (see [Note: checking a load])."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._dist import agree_on_error, rank_and_world_size
from .._dtensor import RaggedDTensor
from .._dtensor_ops import spec_with_dtype
from ._checksums import check_files, check_listed, verify_checksums, verify_file
from ._entry import every_rank_entered
from ._files import normalize, own_file, read_manifest, resolve_path
from ._serialization import SafeLoadPlanner, SafeReader, from_bytes, root_cause, set_rng_state
from ._state import (
    OwnedState,
    ShardedState,
    StateKind,
    check_keys,
    class_name,
    fmt_keys,
    model_state_dict,
    param_names,
    StatePlace,
    state_kinds,
    state_tensor,
)

__all__ = ["load_checkpoint"]

# [Note: checking a load]
# Every check of a load (keys, shapes, dtypes of optimizer state, optimizer class, param groups, every
# shard file present, long enough and matching its checksum) runs on every rank and the verdict is
# agreed on with one collective, so a bad checkpoint raises on all ranks before anything is read and
# never hangs; a failure inside the read itself (corrupt bytes) raises on all ranks through DCP. The
# small entries (scalars, param groups, scheduler, RNG, ``extra``) are read and decoded before any
# tensor, so a bad one leaves the model and optimizer as they were.


@dataclasses.dataclass
class _LoadPlan:
    """What to load where, built and checked on every rank before anything is read."""

    sd: dict[str, Any] = dataclasses.field(default_factory=dict)
    # lazy optimizers' new state: id(param) -> (param, name, state)
    fresh: dict[int, tuple[torch.Tensor, str, dict[str, Any]]] = dataclasses.field(default_factory=dict)
    # (optimizer.state[p] or fresh state, key, name, device of a fresh step counter)
    scalars: list[tuple[dict[str, Any], str, str, torch.device | None]] = dataclasses.field(default_factory=list)
    # OwnedState: (param, state)
    owned: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = dataclasses.field(default_factory=list)


def read_checkpoint_meta(path: str) -> tuple[dict[str, Any], Metadata]:
    """The manifest and DCP's metadata of the checkpoint at ``path`` (``.metadata`` checksummed first)."""
    manifest = read_manifest(path)
    check_listed(path, manifest)
    own_file(path, ".metadata", entry="the DCP metadata file")
    if manifest.get("checksums") and ".metadata" in manifest["checksums"]:
        verify_file(path, ".metadata", manifest["checksums"][".metadata"])
    try:
        md = SafeReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - a missing or truncated .metadata
        raise ValueError(f"cannot read the DCP metadata file {os.path.join(path, '.metadata')}: {e}") from e
    return manifest, md


def _check_tensor(key: str, md: Any, obj: Any, *, exact_dtype: bool) -> None:
    if not isinstance(md, TensorStorageMetadata):
        if torch.is_tensor(obj):
            raise ValueError(
                f"checkpoint entry {key} is not a tensor, but the target is one of shape {tuple(obj.shape)}"
            )
        return
    if not torch.is_tensor(obj):
        raise ValueError(
            f"checkpoint entry {key} is a tensor of shape {tuple(md.size)}, but the target is {type(obj).__name__}"
        )
    if tuple(md.size) != tuple(obj.size()):
        tp = [n for n, size in (("checkpoint", md.size), ("target", obj.size())) if key.startswith("optim.") and len(size) == 2]
        raise ValueError(
            f"shape mismatch for {key}: the checkpoint has {tuple(md.size)}, the target {tuple(obj.size())}"
            + (
                f"; the {' and the '.join(tp)}'s is per-block optimizer state of a tensor-parallel parameter, one row "
                "per TP rank, which loads only at the same TP size ([Note: per-block state under TP]): load at the "
                "TP size it was saved with, or start this optimizer's state afresh (load the model alone)"
                if tp else ""
            )
        )
    if exact_dtype and md.properties.dtype != obj.dtype:
        raise ValueError(f"dtype mismatch for {key}: the checkpoint has {md.properties.dtype}, the target {obj.dtype}")


def _plan_model(model: nn.Module, saved: dict[str, Any], strict: bool, plan: _LoadPlan) -> None:
    """Targets for the model's entries: every ``model.state_dict()`` entry the checkpoint holds."""
    model_sd = model_state_dict(model)
    saved_model = {k[len("model.") :] for k in saved if k.startswith("model.")}
    missing, unexpected = set(model_sd) - saved_model, saved_model - set(model_sd)
    check_keys(missing, unexpected, strict=strict, what="the checkpoint does not match the model (strict=True)")
    if missing:
        warnings.warn(f"load_checkpoint(strict=False): keeping the current values of {fmt_keys(missing)}")
    plan.sd["model"] = {}
    for k, v in model_sd.items():
        if k in saved_model:
            _check_tensor(f"model.{k}", saved[f"model.{k}"], v, exact_dtype=False)
            plan.sd["model"][k] = v



def _group_differences(here: list[list[str]], saved: list[list[str]]) -> str:
    """Which parameter names differ between the optimizer's groups and the checkpoint's, group by group
    (names under ``model.state_dict()``'s keys: [Note: state-dict names] in ``_state.py``)."""
    out = []
    for i in range(max(len(here), len(saved))):
        a = here[i] if i < len(here) else []
        b = saved[i] if i < len(saved) else []
        only_here, only_saved = set(a) - set(b), set(b) - set(a)
        if only_here or only_saved:
            out.append(
                f"group {i}: "
                + "; ".join(
                    ([f"only in the optimizer: {fmt_keys(only_here, 4)}"] if only_here else [])
                    + ([f"only in the checkpoint: {fmt_keys(only_saved, 4)}"] if only_saved else [])
                )
            )
        elif a != b:
            at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            out.append(f"group {i}: the same names in another order (position {at}: {a[at]} here, {b[at]} saved)")
    if len(here) != len(saved):
        out.append(f"{len(here)} group(s) here, {len(saved)} in the checkpoint")
    return "; ".join(out)


def _check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, manifest: dict[str, Any]) -> dict[int, str]:
    """Refuse another optimizer class or other param groups than the checkpoint's; the parameters' names."""
    saved_cls = manifest.get("optimizer")
    if saved_cls is None:
        raise ValueError("the checkpoint holds no optimizer state; call load_checkpoint without optimizer=")
    if saved_cls != class_name(optimizer):
        raise ValueError(
            f"the checkpoint holds the state of optimizer {saved_cls}; it cannot be loaded into a "
            f"{class_name(optimizer)}"
        )
    names = param_names(model, optimizer)
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if groups != manifest["optim_groups"]:
        raise ValueError(
            "the optimizer's param groups do not match the checkpoint's: "
            f"{[len(g) for g in groups]} parameters per group here, {[len(g) for g in manifest['optim_groups']]} "
            f"in the checkpoint; {_group_differences(groups, manifest['optim_groups'])}; build the optimizer as it "
            "was saved (the same parameters in the same groups and order)"
        )
    if "inner_optimizer" in manifest and not isinstance(optimizer, OwnedState):
        raise AssertionError("an optimizer class name matched a WholeTensorOptimizer checkpoint")
    return names


def _plan_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, str], manifest: dict[str, Any], saved: dict[str, Any],
    strict: bool, plan: _LoadPlan,
) -> None:
    """Targets for the optimizer's state, parameter by parameter (``_plan_param_state``)."""
    schema: dict[str, dict[str, str]] = manifest["optim_schema"]
    plan.sd["optim"] = {"state": {}, "scalars": b"", "param_groups": b""}
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = names[id(p)]
            entry = _plan_param_state(optimizer, g, p, name, schema.get(name, {}), saved, strict, plan)
            if entry:
                plan.sd["optim"]["state"][name] = entry


def _plan_param_state(
    optimizer: torch.optim.Optimizer, g: dict[str, Any], p: torch.Tensor, name: str, saved_keys: dict[str, str],
    saved: dict[str, Any], strict: bool, plan: _LoadPlan,
) -> dict[str, torch.Tensor]:
    """The DCP targets of ``p``'s state (scalars go to ``plan.scalars``; a lazy optimizer's new state to
    ``plan.fresh``), each checked against the checkpoint's metadata."""
    kinds = state_kinds(optimizer, p, name)
    if not kinds and saved_keys and not isinstance(optimizer, ShardedState):
        # A lazy (torch) optimizer before its first step: create the state it would.
        target = _fresh_state(p, name, saved_keys, saved)
        plan.fresh[id(p)] = (p, name, target)
        kinds = {
            k: (kind, _param_layout(p) if kind == StateKind.SHARDED else None) for k, kind in saved_keys.items()
        }
    else:
        target = optimizer.state.get(p, {})
        miss = set(kinds) - set(saved_keys)
        what = f"optimizer state of {name} does not match the checkpoint (strict=True)"
        check_keys(miss, set(saved_keys) - set(kinds), strict=strict, what=what)
        for k in sorted(miss):
            warnings.warn(f"load_checkpoint(strict=False): optimizer state {name}.{k} is not in the checkpoint; kept")
    entry = {}
    for key, (kind, where) in kinds.items():
        if key not in saved_keys:
            continue
        if (saved_keys[key] == StateKind.SCALAR) != (kind == StateKind.SCALAR):  # sharded vs full: same global tensor
            raise ValueError(f"optimizer state {name}.{key} is {saved_keys[key]} in the checkpoint but {kind} here")
        if kind == StateKind.SCALAR:
            # torch keeps step counters on the parameter's device when fused / capturable
            on_device = id(p) in plan.fresh and (g.get("fused") or g.get("capturable"))
            plan.scalars.append((target, key, name, p.device if on_device else None))
            continue
        v = target[key]
        if kind == StateKind.SHARDED and where is not None:
            v = state_tensor(p, v, *where)
        entry[key] = v
        fkey = f"optim.state.{name}.{key}"
        if fkey not in saved:
            raise ValueError(f"checkpoint entry {fkey} is missing (the manifest lists it)")
        _check_tensor(fkey, saved[fkey], v, exact_dtype=True)
    return entry


def _plan_owned(
    optimizer: OwnedState, names: dict[int, str], manifest: dict[str, Any], saved: dict[str, Any], strict: bool,
    plan: _LoadPlan,
) -> None:
    """Targets for the state this rank owns now (``OwnedState``), shaped and typed from DCP's metadata."""
    inner = class_name(optimizer.optim)
    if manifest.get("inner_optimizer") != inner:
        raise ValueError(
            f"the checkpoint holds WholeTensorOptimizer state of {manifest.get('inner_optimizer')}; it cannot be "
            f"loaded into a WholeTensorOptimizer of {inner}"
        )
    schema: dict[str, dict[str, str]] = manifest["optim_schema"]
    plan.sd["optim"] = {"state": {}, "scalars": b"", "param_groups": b""}
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = names[id(p)]
            keys = schema.get(name, {})
            if strict and p.requires_grad and not keys and schema:
                raise ValueError(f"optimizer state of {name} is not in the checkpoint (strict=True)")
            if not keys or not optimizer.owns(p):
                continue
            entry = {}
            for key in keys:
                fkey = f"optim.state.{name}.{key}"
                md = saved.get(fkey)
                if not isinstance(md, TensorStorageMetadata):
                    raise ValueError(f"checkpoint entry {fkey} is missing (the manifest lists it)")
                device = torch.device("cpu") if len(md.size) == 0 else p.device
                entry[key] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
            plan.sd["optim"]["state"][name] = entry
            plan.owned.append((p, entry))


def _param_layout(p: torch.Tensor) -> StatePlace:
    """Where per-element state of ``p`` lies: its own layout, on its mesh."""
    if isinstance(p, RaggedDTensor):
        return StatePlace(tuple(p.shape), tuple(p.ragged.bounds))
    return StatePlace(tuple(p.shape), (0, p.numel()))


def _fresh_state(p: torch.Tensor, name: str, saved_keys: dict[str, str], saved: dict[str, Any]) -> dict[str, Any]:
    """Allocate the state a lazy (torch) optimizer would create, from the checkpoint's schema: per-element
    state of a sharded parameter is a ``RaggedDTensor`` of its layout, as ``torch.zeros_like(p)`` makes it."""
    out: dict[str, Any] = {}
    for key, kind in saved_keys.items():
        md = saved.get(f"optim.state.{name}.{key}")
        if kind == StateKind.SCALAR or not isinstance(md, TensorStorageMetadata):
            out[key] = None  # filled from the scalars blob
            continue
        dtype = md.properties.dtype
        if kind == StateKind.SHARDED and isinstance(p, RaggedDTensor):
            local = torch.zeros(p._local_tensor.numel(), dtype=dtype, device=p._local_tensor.device)
            out[key] = RaggedDTensor._from_local_and_spec(local, spec_with_dtype(p._spec, dtype))
        elif kind == StateKind.SHARDED:
            out[key] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        else:
            out[key] = torch.zeros(md.size, dtype=dtype, device=p.device)
    return out


def _plan_small_entries(
    scheduler: Any | None, manifest: dict[str, Any], saved: dict[str, Any], rank: int, world_size: int,
    plan: _LoadPlan,
) -> None:
    """The byte entries to read: scheduler, ``extra`` and (at the saved world size) this rank's RNG state."""
    if scheduler is not None:
        if not manifest.get("scheduler"):
            raise ValueError("the checkpoint holds no LR scheduler state; call load_checkpoint without scheduler=")
        plan.sd["scheduler"] = b""
    if manifest.get("extra"):
        plan.sd["extra"] = b""
    if manifest["world_size"] == world_size and f"rng.rank{rank}" in saved:
        plan.sd[f"rng.rank{rank}"] = b""
    elif rank == 0 and manifest["world_size"] != world_size:
        warnings.warn(
            f"checkpoint saved at world size {manifest['world_size']}, loading at {world_size}: "
            "RNG states are not restored"
        )


def _plan_load(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None, manifest: dict[str, Any],
    md: Metadata, strict: bool, rank: int, world_size: int,
) -> _LoadPlan:
    """Every target of the load, checked against the manifest and DCP's metadata (no collective)."""
    saved = md.state_dict_metadata
    plan = _LoadPlan()
    _plan_model(model, saved, strict, plan)
    if optimizer is not None:
        names = _check_optimizer(optimizer, model, manifest)
        if isinstance(optimizer, OwnedState):  # see [Note: whole-tensor checkpoints]
            _plan_owned(optimizer, names, manifest, saved, strict, plan)
        else:
            _plan_optimizer(optimizer, names, manifest, saved, strict, plan)
    _plan_small_entries(scheduler, manifest, saved, rank, world_size, plan)
    return plan


def _read_small_entries(path: str, plan: _LoadPlan, no_dist: bool) -> dict[str, Any]:
    """Read and decode the byte entries (a collective); a bad one raises on every rank."""
    blobs: dict[str, Any] = {k: v for k, v in plan.sd.items() if isinstance(v, bytes)}
    if "optim" in plan.sd:
        blobs["optim"] = {"scalars": b"", "param_groups": b""}
    try:
        dcp.load(blobs, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:  # raised on every rank by DCP: name the root cause plainly
        raise ValueError(f"load_checkpoint({path}): {root_cause(e)}") from None
    decoded: dict[str, Any] = {}
    err = None
    try:
        for key, value in blobs.items():
            if key == "optim":
                decoded["optim.param_groups"] = from_bytes(value["param_groups"], "optim.param_groups")
                decoded["optim.scalars"] = from_bytes(value["scalars"], "optim.scalars")
            else:
                decoded[key] = from_bytes(value, key)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        err = e
    agree_on_error(err, what="load_checkpoint")
    return decoded


def _install_optimizer(optimizer: torch.optim.Optimizer, plan: _LoadPlan, decoded: dict[str, Any]) -> None:
    """Hyperparameters, scalars, a lazy optimizer's new state and owned state, after the tensors are read."""
    for g, saved_g in zip(optimizer.param_groups, decoded["optim.param_groups"]):
        # As torch's Optimizer.load_state_dict: the saved group replaces the current one's
        # hyperparameters (keys it lacks are dropped, not kept from the new optimizer), so a group
        # saved by an older version steps as it did then (Muon's AdamW parts without "base_lr" keep
        # their lr in AdamW's units) instead of mixing old values with new keys.
        kept = {k: g[k] for k in ("params", "param_names") if k in g}
        g.clear()
        g.update({k: v for k, v in saved_g.items() if k != "params"})
        g.update(kept)
    scalars = decoded["optim.scalars"]
    for target, key, name, device in plan.scalars:
        v, old = scalars[name][key], target.get(key)
        if torch.is_tensor(v) and (torch.is_tensor(old) or device is not None):
            v = v.to(old.device if torch.is_tensor(old) else device)
        target[key] = v
    for p, _, state in plan.fresh.values():
        optimizer.state[p] = state
    for p, state in plan.owned:
        optimizer.install_state(p, state)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    strict: bool = True,
    timeout: float | None = None,
) -> Any:
    """Load a ``save_checkpoint`` directory into ``model`` (and optimizer, scheduler) at any world
    size and plan; return the saved ``extra`` (``None`` if none). RNG states are restored when
    the world size matches. Errors (missing/unexpected keys under ``strict``, shapes, another
    optimizer, missing, truncated or corrupt files) are raised on every rank before anything is
    loaded (see [Note: checking a load]). Every rank must call it: one that waits more than ``timeout``
    seconds (default: ``FSDP_OPTIM_CHECKPOINT_TIMEOUT``, else 60) for the others raises a ``TimeoutError``
    naming them (see [Note: every rank calls it]).
    """
    path = normalize(path, caller="load_checkpoint")
    every_rank_entered("load_checkpoint", timeout=timeout)
    rank, world_size = rank_and_world_size()
    err, plan = None, None
    try:
        path = resolve_path(path)
        manifest, md = read_checkpoint_meta(path)
        check_files(path, md, manifest)
        verify_checksums(path, manifest, rank, world_size)
        plan = _plan_load(model, optimizer, scheduler, manifest, md, strict, rank, world_size)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        err = e
    agree_on_error(err, what="load_checkpoint")
    if plan is None:
        raise AssertionError("load_checkpoint: no plan after an agreed success")
    no_dist = not dist.is_initialized()
    decoded = _read_small_entries(path, plan, no_dist)
    tensors = {k: v for k, v in plan.sd.items() if k == "model"}
    if "optim" in plan.sd:
        tensors["optim"] = {"state": plan.sd["optim"]["state"]}
    dcp.load(tensors, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=no_dist)
    if optimizer is not None:
        _install_optimizer(optimizer, plan, decoded)
    if scheduler is not None:
        scheduler.load_state_dict(decoded["scheduler"])
    if f"rng.rank{rank}" in decoded:
        set_rng_state(decoded[f"rng.rank{rank}"])
    return decoded.get("extra")
