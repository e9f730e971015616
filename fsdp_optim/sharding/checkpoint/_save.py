"""``save_checkpoint``: collect the model's and optimizer's state, encode it (the small entries as
checked bytes), write it into ``<path>.tmp`` with DCP and publish it in place of ``path``."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from .._dist import agree_on_error, rank_and_world_size
from ._checksums import checksums_of
from ._entry import every_rank_entered
from ._files import (
    FORMAT_VERSION, explain_write_failure, free_bytes, lock_save, normalize, publish, save_refusal, unlock_save,
    write_facts, write_manifest,
)
from ._serialization import numbers_from_numpy, rng_state, root_cause, to_bytes
from ._state import (
    OwnedState,
    class_name,
    gather_owned_schema,
    model_state_dict,
    optim_state,
    owned_optim_state,
    param_groups_by_name,
    param_names,
    torch_names,
)

__all__ = ["save_checkpoint"]


@dataclasses.dataclass
class _Collected:
    """What a save writes, as this rank holds it (tensors are the live ones: nothing is copied)."""

    manifest: dict[str, Any]
    model: dict[str, torch.Tensor]
    optim: dict[str, Any] | None = None  # {"state", "scalars", "param_groups"}, scalars and groups as objects
    owned_schema: dict[str, dict[str, str]] | None = None  # OwnedState: this rank's, merged once agreed
    scheduler: Any = None  # its state_dict()
    extra: Any = None  # rank 0's only
    rng: dict[str, Any] = dataclasses.field(default_factory=dict)


def _collect(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None, extra: Any | None,
    rank: int, world_size: int,
) -> _Collected:
    """This rank's part of the checkpoint and the manifest (no collective, nothing encoded)."""
    sd = model_state_dict(model)
    manifest = {
        "format_version": FORMAT_VERSION,
        "world_size": world_size,
        "model_keys": sorted(sd),
        "optimizer": None,
        "scheduler": scheduler is not None,
        "extra": extra is not None,
    }
    out = _Collected(manifest=manifest, model=sd, rng=rng_state())
    if optimizer is not None:
        names = param_names(model, optimizer)
        if isinstance(optimizer, OwnedState):  # [Note: whole-tensor checkpoints]
            state, scalars, out.owned_schema = owned_optim_state(optimizer, names)
            schema = {}  # (every rank's, gathered once every rank agreed it has its own)
            manifest["inner_optimizer"] = class_name(optimizer.optim)
        else:
            state, scalars, schema = optim_state(optimizer, names)
        groups = numbers_from_numpy(param_groups_by_name(optimizer, names, renames=torch_names(model)))
        out.optim = {"state": state, "scalars": numbers_from_numpy(scalars), "param_groups": groups}
        manifest["optimizer"] = class_name(optimizer)
        manifest["optim_schema"] = schema
        manifest["optim_groups"] = [g["params"] for g in groups]
    if scheduler is not None:
        out.scheduler = numbers_from_numpy(scheduler.state_dict())
    if rank == 0:
        out.extra = extra
    return out


def _encode(c: _Collected, rank: int) -> dict[str, Any]:
    """The DCP state dict: tensors as collected, the small entries as bytes a load accepts (``to_bytes``
    refuses anything else, naming it)."""
    sd: dict[str, Any] = {"model": c.model}
    if c.optim is not None:
        sd["optim"] = {
            "state": c.optim["state"],
            "scalars": to_bytes(c.optim["scalars"], "optim.scalars"),
            "param_groups": to_bytes(c.optim["param_groups"], "optimizer.param_groups"),
        }
    if c.manifest["scheduler"]:
        sd["scheduler"] = to_bytes(c.scheduler, "scheduler.state_dict()")
    if c.extra is not None:
        sd["extra"] = to_bytes(c.extra, "extra")
    sd[f"rng.rank{rank}"] = to_bytes(c.rng, "the RNG state")
    return sd


def _bytes_of(obj: Any) -> int:
    """Bytes of the tensors and byte records in a state dict (its DCP files take more: each item's headers)."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor: this rank's piece
        return local.numel() * local.element_size()
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_bytes_of(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_bytes_of(v) for v in obj)
    return 0


def _prepare(path: str) -> None:
    """Rank 0: refuse a target a save may not replace, and create an empty ``<path>.tmp``."""
    tmp, old = path + ".tmp", path + ".old"
    # [Note: saving onto a symlink]
    # A save renames ``<path>.tmp`` onto ``path``. With ``path`` a link, that would replace the link
    # (the checkpoint it pointed to left behind, the link gone) or, followed, write through it into
    # a folder the user named by another path; an earlier version crashed in ``rmtree`` on it and lost
    # later saves. Neither is what "save to path" means, so the save is refused before anything is
    # written, on every rank, with the two ways out.
    if os.path.islink(path):
        raise ValueError(
            f"save_checkpoint: {path} is a symbolic link (to {os.readlink(path)}); a save replaces the "
            "directory at the path, so it would replace the link, not the checkpoint it points to. Save to "
            f"a real directory (e.g. the target {os.path.realpath(path)}, to overwrite it, or a new one) and "
            "then point the link at it"
        )
    for folder in (path, tmp, old):  # see [Note: what a save replaces]
        why = save_refusal(folder, path)
        if why is not None:
            raise ValueError(why)
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)  # a crashed earlier save (checkpoint files only, checked above)
    os.makedirs(tmp)


def _publish(path: str, manifest: dict[str, Any]) -> None:
    """Rank 0: write the manifest last, then swap ``<path>.tmp`` in (see [Note: atomic publish])."""
    tmp = path + ".tmp"
    write_manifest(tmp, manifest)

    def refusal(folder: str) -> str | None:  # again: entries may have appeared since the checks before writing
        why = save_refusal(folder, path)
        if why is None:
            return None
        return (
            f"{why}. Nothing was replaced; the new checkpoint is complete in {tmp} (rename it once {folder} is "
            "cleared, or save again)"
        )

    publish(tmp, path, refusal=refusal)


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    extra: Any | None = None,
    timeout: float | None = None,
) -> None:
    """Save model, optimizer, scheduler, RNG states and ``extra`` to directory ``path`` (every rank).

    Each rank writes only its own shards (no gather). ``extra`` (e.g. the data position: tensors,
    numbers, strings, lists, tuples and dicts, what ``load_checkpoint`` loads) is taken from rank 0.
    A value a load would refuse (a numpy scalar in ``extra``, a custom class) raises a ``ValueError``
    naming it on every rank before anything is written; numpy scalars in param groups, optimizer
    scalars and scheduler state (an LR from a numpy schedule) are saved as the equal Python numbers.
    Atomic: the checkpoint is written to ``<path>.tmp`` and moved into place after every rank is
    done, replacing a previous checkpoint (see [Note: atomic publish]). Only folders holding nothing
    but checkpoint files are replaced or removed (``path``, a leftover ``<path>.tmp`` / ``<path>.old``):
    anything else there is refused with a ``ValueError`` on every rank before anything is written
    (see [Note: what a save replaces]); so is a second save to ``path`` while one is in progress.
    Every rank must call it: one that waits more than ``timeout`` seconds (default: the
    ``FSDP_OPTIM_CHECKPOINT_TIMEOUT`` environment variable, else 60) for the others raises a
    ``TimeoutError`` naming them (see [Note: every rank calls it]).
    """
    path = normalize(path, caller="save_checkpoint")
    every_rank_entered("save_checkpoint", timeout=timeout)
    lock: list[int] = []  # rank 0's lock on the path, released however the save ends
    try:
        _save(path, model, optimizer, scheduler, extra, lock)
    finally:
        if lock:
            unlock_save(path, lock[0])


def _save(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None, extra: Any | None,
    lock: list[int],
) -> None:
    """``save_checkpoint``'s steps: collect and encode, agree, write with DCP, checksum, publish; each
    fallible step agreed on by every rank."""
    rank, world_size = rank_and_world_size()
    tmp = path + ".tmp"
    err, collected, sd, size = None, None, None, 0
    try:
        collected = _collect(model, optimizer, scheduler, extra, rank, world_size)
        sd = _encode(collected, rank)
        size = _bytes_of(sd)
        if rank == 0:
            lock.append(lock_save(path))
            _prepare(path)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        err = e
    try:  # a collective: the temp dir exists before anyone writes; every rank's bytes (for a write's error)
        sizes = agree_on_error(err, what="save_checkpoint", payload=size)
    except Exception:
        if rank == 0 and err is None:
            shutil.rmtree(tmp, ignore_errors=True)  # another rank refused: leave nothing behind
        raise
    manifest = collected.manifest
    if collected.owned_schema is not None:  # a collective: after the agreement, so every rank joins it
        manifest["optim_schema"] = gather_owned_schema(collected.owned_schema)
    # A collective; .metadata is written when it returns. DCP raises on every rank if any rank fails.
    free = free_bytes(tmp)
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not dist.is_initialized())
    except CheckpointException as e:
        # What every rank saw of the failed write (a collective: every rank is here), before the removal.
        facts = agree_on_error(None, what="save_checkpoint", payload=write_facts(tmp, free))
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        why = explain_write_failure(root_cause(e), os.path.dirname(tmp) or ".", facts, tensor_bytes=sum(sizes))
        raise ValueError(
            f"save_checkpoint({path}): writing {tmp} failed: {why}; the previous checkpoint at {path} (if any) is "
            "untouched"
        ) from None
    err, sums = None, None
    try:
        sums = checksums_of(tmp, rank, world_size)
    except Exception as e:  # noqa: BLE001
        err = e
    agree_on_error(err, what="save_checkpoint")
    err = None
    if rank == 0:
        try:
            _publish(path, {**manifest, "checksums": sums})
        except Exception as e:  # noqa: BLE001
            err = e
    agree_on_error(err, what="save_checkpoint")
