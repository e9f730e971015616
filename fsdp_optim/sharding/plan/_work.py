"""The planner's work, counted: how many packings a plan tried.

A packing is one pass that lays out tensors for one candidate: an even segment size tried for one
bucket (``_even``), the ragged stream cut at its fixed targets or filled up to one capacity
(``_stream``), one per-bucket pouring (``_pour``). Each pass is linear in the tensors it places and
the ranks it cuts, so the count times the model's size is the planner's cost, the same on every
machine: ``PlanStats.plan_packings``, which the tests bound (they assert no wall-clock time;
``benchmarks/planner_scale.py`` reports the seconds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["count_packing", "counting"]

_COUNT: ContextVar[list[int] | None] = ContextVar("fsdp_optim_plan_packings", default=None)


def count_packing(n: int = 1) -> None:
    """Count ``n`` packings against the plan being made (no-op outside ``counting``)."""
    count = _COUNT.get()
    if count is not None:
        count[0] += n


@contextlib.contextmanager
def counting() -> Iterator[list[int]]:
    """Count the packings tried inside the block: ``with counting() as n: ...; n[0]``."""
    count = [0]
    token = _COUNT.set(count)
    try:
        yield count
    finally:
        _COUNT.reset(token)
