"""Which EP rank owns which experts, and how many routed rows go to each (pure index arithmetic for
``sharding/_expert_parallel.py``)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["expert_ranges", "token_splits"]


def expert_ranges(num_experts: int, ep_size: int) -> list[range]:
    """Global expert ids owned by each of ``ep_size`` ranks: contiguous, sizes differ by at most one,
    larger first (6 over 4 -> 2/2/1/1). Every rank owns at least one expert."""
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if num_experts < ep_size:
        raise ValueError(
            f"num_experts={num_experts} < ep_size={ep_size}: every EP rank must own at least one whole "
            f"expert; use an EP group of at most {num_experts} ranks (or more experts)"
        )
    base, extra = divmod(num_experts, ep_size)
    out, start = [], 0
    for r in range(ep_size):
        n = base + (r < extra)
        out.append(range(start, start + n))
        start += n
    return out


def token_splits(num_tokens_per_expert: Sequence[int], ranges: Sequence[range]) -> list[int]:
    """Rows sent to each rank: the caller's per-expert counts summed over each rank's experts."""
    return [sum(num_tokens_per_expert[e] for e in r) for r in ranges]
