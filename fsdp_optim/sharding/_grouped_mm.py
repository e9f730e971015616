"""Grouped matmul for experts: one ``x_g @ weight[g].T`` per contiguous token group.

``grouped_linear(x, weight, num_tokens_per_group)`` runs ``torch._grouped_mm`` where the device
supports it (CUDA, compute capability >= 9.0, bf16, 16-byte aligned feature dims), else a loop over
the groups on their contiguous row ranges. Neither path pads: exactly ``x.shape[0]`` token rows go
through the matmul (see [Note: expert compute counts only routed tokens]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["GroupedMMCounter", "count_grouped_mm", "grouped_linear", "grouped_mm_supported"]

# [Note: expert compute counts only routed tokens]
# Dropless expert parallelism hands each rank exactly the rows routed to its experts, sorted by
# local expert; ``grouped_linear`` runs one matmul per group on its own rows (or one grouped kernel
# over the same rows), never a ``[E, capacity, dim]`` padded batch. ``count_grouped_mm()`` counts the
# token rows that went through a grouped matmul (``rows``, one count per call) so a test can check
# the compute equals the routed token count, not ``E * C_max``. Groups with no token cost nothing.

_ACTIVE: list[GroupedMMCounter] = []


@dataclass
class GroupedMMCounter:
    """Token rows and calls seen by ``grouped_linear`` inside ``count_grouped_mm()``."""

    calls: int = 0
    rows: int = 0
    """Token rows multiplied, summed over calls (a SwiGLU expert makes 3 calls per token)."""
    fused_calls: int = 0
    """Calls that ran ``torch._grouped_mm`` (the rest looped over the groups)."""


@contextlib.contextmanager
def count_grouped_mm() -> Iterator[GroupedMMCounter]:
    """Count the work of every ``grouped_linear`` call in this block (this process only)."""
    counter = GroupedMMCounter()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``torch._grouped_mm`` can compute ``x @ weight[g].T``: CUDA with capability >= 9.0, both
    bf16, and feature dims that keep rows 16-byte aligned."""
    if not (x.is_cuda and weight.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    align = 16 // x.element_size()
    return weight.shape[-1] % align == 0 and weight.shape[-2] % align == 0


def _check(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"grouped_linear: x must be [T, in] and weight [G, out, in]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if counts.dim() != 1 or counts.shape[0] != weight.shape[0]:
        raise ValueError(
            f"grouped_linear: num_tokens_per_group must be [G] = [{weight.shape[0]}] (one count per "
            f"group of weight {tuple(weight.shape)}); got {tuple(counts.shape)}"
        )


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, num_tokens_per_group: torch.Tensor) -> torch.Tensor:
    """``[T, in] x [G, out, in] -> [T, out]``: rows of group ``g`` (contiguous, in group order, their
    number in ``num_tokens_per_group[g]``) times ``weight[g].T``. Autograd-correct; groups with no
    rows still receive a zero weight gradient."""
    _check(x, weight, num_tokens_per_group)
    fused = grouped_mm_supported(x, weight)
    for c in _ACTIVE:
        c.calls += 1
        c.rows += x.shape[0]
        c.fused_calls += int(fused)
    if fused:
        offs = torch.cumsum(num_tokens_per_group, 0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    pieces = []
    start = 0
    for g, n in enumerate(num_tokens_per_group.tolist()):
        if n:
            pieces.append(torch.mm(x[start : start + n], weight[g].t()))
        start += n
    if start != x.shape[0]:
        raise ValueError(
            f"grouped_linear: num_tokens_per_group sums to {start} but x has {x.shape[0]} rows"
        )
    if not pieces:
        # An empty matmul keeps ``weight`` in the graph, so its gradient is zeros, not None.
        return torch.mm(x[:0], weight[0].t())
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
