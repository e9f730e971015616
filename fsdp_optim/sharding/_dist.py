"""Process-group helpers every layer shares: agreeing on an error across ranks, comparing groups,
and the device a backend computes on. One implementation each (see [Note: agreeing on errors])."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["agree_on_error", "backend_device", "is_distributed", "rank_and_world_size", "same_group"]

# [Note: agreeing on errors]
# A user error found on one rank must raise on every rank, or the others wait forever in the next
# collective. Every entry point that can fail on some ranks only (validation, reading files, a save)
# ends its fallible part with ``agree_on_error``: one ``all_gather_object`` of each rank's verdict.
# The failing rank re-raises its own exception (traceback intact); every other rank raises the same
# class naming the first failing rank and its message. A payload rides along (a plan fingerprint,
# say) so callers can compare ranks without a second collective.
_RERAISE = (ValueError, FileNotFoundError, KeyError, TypeError, RuntimeError, OSError, TimeoutError)


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """A process group is initialized and ``group`` (default: the world) has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_and_world_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def agree_on_error(
    err: BaseException | None, *, group: dist.ProcessGroup | None = None, what: str = "", payload: Any = None
) -> list[Any]:
    """Raise on every rank of ``group`` if any rank passed an error; otherwise every rank's ``payload``.

    One collective (none without a process group, where ``err`` is raised as is). ``what`` names the
    operation in the message the other ranks raise: ``"<what> failed on rank r of W: <Type>: <msg>"``.
    """
    if not is_distributed(group):
        if err is not None:
            raise err
        return [payload]
    mine = None if err is None else (type(err).__name__, str(err))
    verdicts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, (mine, payload), group=group)
    failed = [(r, v[0]) for r, v in enumerate(verdicts) if v[0] is not None]
    if not failed:
        return [v[1] for v in verdicts]
    if err is not None:
        raise err
    r, (type_name, msg) = failed[0]
    cls = next((c for c in _RERAISE if c.__name__ == type_name), RuntimeError)
    prefix = f"{what} failed on " if what else ""
    raise cls(f"{prefix}rank {r} of {len(verdicts)}: {type_name}: {msg}")


def same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    """``a`` and ``b`` are the same group (``None`` meaning the world group)."""
    if a is b:
        return True
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return (a if a is not None else world) is (b if b is not None else world)


def backend_device(group_or_backend: dist.ProcessGroup | str | None) -> torch.device:
    """The device a backend's collectives run on: this process's current CUDA device for NCCL, else CPU."""
    backend = group_or_backend
    if isinstance(group_or_backend, dist.ProcessGroup):
        backend = str(dist.get_backend(group_or_backend))
    if backend is not None and "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
