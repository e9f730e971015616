"""Checking that every rank entered a checkpoint call, within a bounded time (see [Note: every rank
calls it])."""

from __future__ import annotations

import itertools
import os
from datetime import timedelta

import torch.distributed as dist

from .._dist import is_distributed, rank_and_world_size

__all__ = ["TIMEOUT_ENV", "every_rank_entered"]

TIMEOUT_ENV = "FSDP_OPTIM_CHECKPOINT_TIMEOUT"
_DEFAULT_TIMEOUT_S = 60.0
_calls = itertools.count()

# [Note: every rank calls it]
# ``save_checkpoint`` and ``load_checkpoint`` are collectives: a rank that calls one while another
# rank does not (``if rank == 0: save_checkpoint(...)``) waits in its first collective until the
# process group's timeout (30 minutes by default, and a save would leave ``<path>.tmp`` behind). So
# each call first checks, through the process group's store, that every rank entered the same call:
# each rank sets ``fsdp_optim/entered/<n>/<rank>`` to the call's name (``n`` counts this process's
# calls) and waits for every rank's key, at most ``timeout`` seconds (``timeout=``, else the
# ``FSDP_OPTIM_CHECKPOINT_TIMEOUT`` environment variable, else 60). A rank that waited in vain
# raises a ``TimeoutError`` naming the missing ranks and the rule before it has written or read
# anything; ranks that entered another call (a load against a save) raise a ``ValueError`` naming
# both. The store works for every backend (a gloo ``monitored_barrier`` would not on NCCL). Each
# call removes this rank's key of its previous call, which every rank has passed by then (the
# previous call's collectives completed). After such an error the ranks' call counts differ: the
# job is broken (as after any collective called by some ranks only) and should be restarted.


def _timeout_s(timeout: float | None) -> float:
    """``timeout``, else the environment variable's, else the default; refused unless positive."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        try:
            timeout = float(raw) if raw else _DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r}: pass a positive number of seconds")
    return float(timeout)


def every_rank_entered(what: str, *, timeout: float | None) -> None:
    """Return once every rank of the world has entered ``what``; raise on this rank after ``timeout``
    seconds otherwise (see [Note: every rank calls it]). Nothing to check without a process group."""
    seconds = _timeout_s(timeout)
    if not is_distributed():
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world_size = rank_and_world_size()
    n = next(_calls)
    if n:
        store.delete_key(f"fsdp_optim/entered/{n - 1}/{rank}")
    keys = [f"fsdp_optim/entered/{n}/{r}" for r in range(world_size)]
    store.set(keys[rank], what)
    try:
        store.wait(keys, timedelta(seconds=seconds))
    except Exception:  # noqa: BLE001 - DistStoreError (a timeout): say who is missing
        missing = [r for r in range(world_size) if not store.check([keys[r]])]
        raise TimeoutError(
            f"{what}: rank(s) {missing} of {world_size} did not call {what} within {seconds:g} s; every rank must "
            f"call it (a collective), or the others wait for them (raise the limit with timeout= or "
            f"{TIMEOUT_ENV} if they are only slow)"
        ) from None
    calls = {r: store.get(k).decode() for r, k in enumerate(keys)}
    other = next(((r, c) for r, c in calls.items() if c != what), None)
    if other is not None:
        raise ValueError(
            f"{what}: rank {other[0]} of {world_size} called {other[1]} meanwhile; every rank must call the same "
            "checkpoint function, in the same order"
        )
