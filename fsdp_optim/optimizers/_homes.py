"""Where a matrix's Newton–Schulz runs: its cost, and a longest-first assignment of owners (pure).

Used by Muon for matrices the data-parallel plan split ([Note: Muon on shards]) and for matrices
tensor parallelism split ([Note: Muon under tensor parallelism]).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["assign_owners", "ns_cost"]


def ns_cost(rows: int, cols: int) -> int:
    """Newton–Schulz flops per iteration of one matrix (``4 m^2 n + 2 m^3``, ``m <= n``)."""
    m, n = min(rows, cols), max(rows, cols)
    return 2 * m * m * (2 * n + m)


def assign_owners(
    costs: Sequence[int], piece_sizes: Sequence[Sequence[int]], initial_loads: Sequence[int]
) -> list[int]:
    """Owner rank per split matrix: longest-first onto the least-loaded rank.

    ``costs[j]``: matrix j's Newton–Schulz cost; ``piece_sizes[j][r]``: elements of it rank r
    holds; ``initial_loads[r]``: the cost of the matrices rank r owns whole. Ties go to the rank
    holding more of the matrix (less traffic), then to the lower rank. Deterministic (pure).
    """
    loads = list(initial_loads)
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        best = min(range(len(loads)), key=lambda r: (loads[r], -piece_sizes[j][r], r))
        owners[j] = best
        loads[best] += costs[j]
    return owners
