"""How a bucket's uneven segments travel: grouped per-owner collectives or one padded collective.

[Note: wire format]
An EVEN bucket moves with one tensor collective (``all_gather_into_tensor`` /
``reduce_scatter_tensor``): nothing to choose. A RAGGED bucket's segments differ in size, and there
are two ways to move them:

* ``GROUPED``: one broadcast / reduce per non-empty segment (``DistributedBuffer``'s per-owner
  groups; gloo: its list ``reduce_scatter``). Bytes: every segment once. Latency: one pipeline per owner when the
  operations serialize, ``owners * steps(W) * alpha`` — quadratic in W when every rank owns a piece.
* ``PADDED``: every segment padded to the bucket's largest, one ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` of ``W * max`` elements through a staging buffer (copy-in / copy-out of
  the ragged layout, padding zero so sums and averages are exact). Latency: one ring,
  ``steps(W) * alpha``. Bytes: ``(W - 1) * max`` on the busiest link instead of ``total - min``.

The model (an alpha-beta estimate, the same as ``benchmarks/comm_model.py``'s) picks the cheaper
per bucket, ties to ``PADDED``: grouped wins when segments are very unequal and W is small, padded
when W is large (latency) or the segments are nearly even (no bandwidth lost). Defaults: alpha =
5 us per message step, 400 Gb/s per GPU per direction (one 400G InfiniBand NIC per GPU, as in the
communication model; NCCL's own tuning tables use latencies of a few microseconds per step).
Off NCCL the list forms cost nothing (gloo's uneven forms took 0.2-0.9x the even ones' time,
[Note: one collective per bucket per direction]), so ``"auto"`` keeps ``GROUPED`` there. The
all-gathers of both modes give the same bits (a copy); the reductions too at W <= 2 (the padding
adds exact zeros), while at W >= 3 gloo's tensor and list reduce-scatters add the ranks in
different orders (last-bit differences; NCCL's algorithms differ again), so the mode, like W, is
part of what makes a reduction's bits (tests/sharding/test_wire.py). Staging costs one extra ``W * max`` buffer
while a padded collective is in flight.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "WireMode",
    "LinkModel",
    "WIRE_CHOICES",
    "grouped_seconds",
    "padded_seconds",
    "choose_wire_mode",
    "all_reduce_seconds",
    "all_to_all_seconds",
    "split_exchange",
]

WIRE_CHOICES = ("auto", "grouped", "padded")


class WireMode(enum.Enum):
    """How a RAGGED bucket's collectives move its uneven segments (see [Note: wire format])."""

    GROUPED = "grouped"
    PADDED = "padded"


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """Alpha-beta constants of one link (defaults: an NCCL-class 400 Gb/s NIC per GPU)."""

    alpha_s: float = 5e-6
    """Latency per message step, seconds."""
    bytes_per_s: float = 400e9 / 8
    """Bandwidth per direction, bytes per second."""


def _steps(world_size: int) -> int:
    return max(world_size - 1, 0)


def grouped_seconds(sizes: Sequence[int], *, element_size: int, link: LinkModel = LinkModel()) -> float:
    """One grouped collective of per-rank segments ``sizes`` (elements): a pipeline per owner when
    the operations serialize, every segment but the smallest on the busiest link."""
    w = len(sizes)
    if w <= 1 or not any(sizes):
        return 0.0
    owners = sum(1 for n in sizes if n > 0)
    moved = (sum(sizes) - min(sizes)) * element_size
    return owners * _steps(w) * link.alpha_s + moved / link.bytes_per_s


def padded_seconds(sizes: Sequence[int], *, element_size: int, link: LinkModel = LinkModel()) -> float:
    """One ring collective of ``W`` segments padded to the largest."""
    w = len(sizes)
    if w <= 1 or not any(sizes):
        return 0.0
    return _steps(w) * link.alpha_s + _steps(w) * max(sizes) * element_size / link.bytes_per_s


def choose_wire_mode(
    sizes: Sequence[int],
    *,
    element_size: int,
    wire: str = "auto",
    backend: str | None = "nccl",
    link: LinkModel = LinkModel(),
) -> WireMode:
    """The mode one bucket uses: ``wire`` when forced (``"grouped"`` / ``"padded"``); ``"auto"``: the
    cheaper by the model on NCCL (ties: padded), ``GROUPED`` on other backends. Pure: every rank
    decides the same from the plan."""
    if wire not in WIRE_CHOICES:
        raise ValueError(f"wire must be one of {WIRE_CHOICES}, got {wire!r}")
    if wire != "auto":
        return WireMode(wire)
    if backend is None or "nccl" not in backend or len(set(sizes)) <= 1:
        return WireMode.GROUPED
    grouped = grouped_seconds(sizes, element_size=element_size, link=link)
    padded = padded_seconds(sizes, element_size=element_size, link=link)
    return WireMode.PADDED if padded <= grouped or math.isclose(padded, grouped) else WireMode.GROUPED


def all_reduce_seconds(numel: float, world_size: int, *, element_size: int, link: LinkModel = LinkModel()) -> float:
    """Ring all-reduce of ``numel`` elements over ``world_size`` ranks (HSDP's replica reduction): a
    reduce-scatter and an all-gather of ``numel / W`` per rank, each ``padded_seconds`` of even segments."""
    if world_size <= 1 or numel <= 0:
        return 0.0
    even = [numel / world_size] * world_size
    return 2 * padded_seconds(even, element_size=element_size, link=link)


def all_to_all_seconds(send: Sequence[float], recv: Sequence[float], *, element_size: int, link: LinkModel = LinkModel()) -> float:
    """One all-to-all with per-rank element counts sent / received: ``steps(W)`` latencies and the
    busiest rank's bytes (as ``benchmarks/comm_model.py`` costs it)."""
    w = len(send)
    if w <= 1:
        return 0.0
    busiest = max(max(a, b) for a, b in zip(send, recv))
    return _steps(w) * link.alpha_s + busiest * element_size / link.bytes_per_s


def split_exchange(bucket) -> tuple[list[int], list[int]]:
    """Elements each rank sends / receives to gather a bucket's split matrices to their owners (the
    rank holding the largest piece; Muon sends the update back the same way). Pure, on a ``BucketPlan``."""
    w = bucket.world_size
    send, recv = [0] * w, [0] * w
    rb = bucket.rank_bounds
    for p in bucket.placements:
        for off, r, c in p.split_matrices():
            a, b = p.offset + off, p.offset + off + r * c
            lo, hi = bisect.bisect_right(rb, a) - 1, bisect.bisect_left(rb, b)
            pieces = [(min(rb[k + 1], b) - max(rb[k], a), k) for k in range(lo, hi)]
            owner = max(pieces, key=lambda t: (t[0], -t[1]))[1]
            for n, k in pieces:
                if k != owner and n > 0:
                    send[k] += n
                    recv[owner] += n
    return send, recv
