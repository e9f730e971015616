"""The planner: lay out every bucket of a model so no block crosses a rank boundary.

``plan_model(buckets, world_size=W, config=...)`` returns a :class:`Plan` with one
:class:`BucketPlan` per bucket. Everything here is integer arithmetic on shapes and block
specs (no tensors, no process groups), deterministic on every rank: no hashing, no
randomness, ties broken by input position.

The layouts themselves live beside this module: ``_even`` ([Note: even layout]), ``_stream`` ([Note:
ragged layout and global balance]), ``_pour`` ([Note: per-bucket ragged packing]); the block geometry
and [Note: aligned pieces] in ``_geom``. Here: validation, the choice of layout per bucket, the balance
steps, and the materialized placements.

[Note: auto layout cost model]
Per bucket: EVEN when the even layout keeps every block whole with padding <= ``padding_cap``,
else RAGGED. Why: on NCCL the ring ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` move
``(W-1)/W`` of the buffer per rank at full bandwidth in one launch, while the uneven forms are
``W`` grouped broadcasts (one launch and latency per owner), so even wins while its padding
(extra bytes moved and stored, <= cap) is small. A split matrix costs one extra exchange of that
matrix per optimizer step (about twice its bytes), more than the padding cap allows, so any
bucket that would need a split goes ragged, where no block is cut for padding (only for balance,
below). Gloo (measured, see docs/architecture.md) runs the uneven forms no slower, so the rule never
loses there.

[Note: balance cap]
Whole blocks cannot balance once a block nears a rank's mean bytes (Llama 3 8B, Muon, W = 1024: one
MLP matrix is 7.5 ranks' worth). ``PlanStats.bytes_lower_bound`` says how far whole blocks can get: a
proven lower bound, the larger of ``max_k ceil(k / W) * size_k`` over the blocks sorted by size (the
``k`` largest share ``W`` ranks) and a bin-packing bound (see [Note: whole-block lower bound] in
``_report``). ``plan_model`` then works in three steps, each only when the previous misses:
1. the whole-block plan above; if the busiest rank exceeds ``max(1.02 * bound, 1.05)`` x the mean and
   some bucket is EVEN, the all-ragged whole-block plan too (elementwise embeddings can then fill
   the ranks that big matrices leave light), the better one kept;
2. if the busiest rank is still above ``balance_cap`` (or the bound already is: step 1 skipped),
   ``balance="auto"`` gives ragged buckets row geometries for every matrix (or ``rows(k)`` strip
   tensor: ``BlockSpec.splits_on_rows``) whose largest block
   exceeds ``(cap - 1) / 2`` of the mean (divided by 4 while the cap is missed, 3 tries): the
   ragged balance then cuts those on rows, at most ``W - 1`` cuts, so at most ``W - 1`` split
   blocks, recorded as ``Placement.split`` (Muon, Shampoo: one all_to_all pair per step). Ragged, not
   even: an even segment must be a multiple of every row length a tensor crossing two boundaries
   has (Llama 3 8B at W = 16384: padding 100%), a ragged cut needs only one row;
3. ``balance="whole"`` (optimizers that refuse split blocks) keeps step 1's plan and warns with the
   largest HSDP shard size the bound allows if its plan balances (one plan), else the largest with
   balance guaranteed (largest block <= (cap - 1 - padding_cap) x mean; ``suggest_mesh`` plans and
   prices every shard size).
``Plan.balance_note`` says which happened, with the figures.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
import warnings
from collections.abc import Sequence

import numpy as np

from ._even import _EvenResult, _plan_even
from ._geom import _Geom, _quantum
from ._plan import BucketPlan, Layout, Placement, Plan, PlanConfig, TensorSpec
from ._cost import _cost_profile, _cum_cost, _UniformCost, tensor_cost
from ._pour import pour_ragged
from ._ragged import RaggedLayout
from ._report import PlanStats, block_sizes, plan_report, plan_stats, whole_block_bound
from ._stream import _balance_ragged, _max_rank_cost
from ._work import count_packing, counting

__all__ = ["plan_model", "tensor_cost", "PlanStats", "plan_stats", "plan_report"]  # the last three re-exported from _report

# Placements keep their RaggedLayout bounds as plain tuples up to this world size; above it the
# bounds are a lazy view of the bucket's rank bounds (W * num_tensors Python ints would take
# seconds and gigabytes at W = 16384). Both behave the same through indexing and iteration.
_EAGER_BOUNDS_MAX_WORLD = 256


# ---------------------------------------------------------------------------------------
# Per-tensor bounds (eager tuple, or lazy for huge W)
# ---------------------------------------------------------------------------------------
class _ClippedBounds(Sequence):
    """``clip(rank_bounds[r] - offset, 0, numel)`` for r in 0..W, computed on access."""

    __slots__ = ("_rb", "_offset", "_numel")

    def __init__(self, rank_bounds: tuple[int, ...], offset: int, numel: int):
        self._rb, self._offset, self._numel = rank_bounds, offset, numel

    def __len__(self) -> int:
        return len(self._rb)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(min(max(b - self._offset, 0), self._numel) for b in self._rb[i])
        return min(max(self._rb[i] - self._offset, 0), self._numel)

    def __iter__(self):
        o, n = self._offset, self._numel
        return (min(max(b - o, 0), n) for b in self._rb)

    def __eq__(self, other) -> bool:
        try:
            return tuple(self) == tuple(other)
        except TypeError:
            return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def inner(self) -> list[int]:
        """The distinct values strictly between 0 and numel, ascending (O(log W + count))."""
        rb, o, n = self._rb, self._offset, self._numel
        lo, hi = bisect.bisect_right(rb, o), bisect.bisect_left(rb, o + n)
        return sorted({b - o for b in rb[lo:hi]})

    def __repr__(self) -> str:
        return f"_ClippedBounds(offset={self._offset}, numel={self._numel}, world_size={len(self) - 1})"


def _make_shard(shape: tuple[int, ...], rank_bounds: tuple[int, ...], rb_np: np.ndarray, offset: int) -> RaggedLayout:
    numel = math.prod(shape)
    w = len(rank_bounds) - 1
    if w <= _EAGER_BOUNDS_MAX_WORLD:
        bounds = tuple(np.clip(rb_np - offset, 0, numel).tolist())
    else:
        bounds = _ClippedBounds(rank_bounds, offset, numel)
    # Valid by construction (rank bounds rise from 0 to >= offset + numel: clipped, they rise from 0
    # to numel), so skip RaggedLayout's O(W) validation; BucketPlan.check() re-verifies in the tests.
    shard = object.__new__(RaggedLayout)
    object.__setattr__(shard, "shape", tuple(int(s) for s in shape))
    object.__setattr__(shard, "bounds", bounds)
    return shard


# ---------------------------------------------------------------------------------------
# The model planner
# ---------------------------------------------------------------------------------------
def _validate(buckets, world_size: int, config: PlanConfig) -> list[tuple[str, list[TensorSpec], int]]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(config, PlanConfig):
        raise ValueError(f"config must be a PlanConfig, got {type(config).__name__}")
    out = []
    for bi, bucket in enumerate(buckets):
        try:
            name, specs = bucket
        except (TypeError, ValueError):
            raise ValueError(f"bucket {bi} must be a (name, [TensorSpec, ...]) pair, got {bucket!r}") from None
        specs = list(specs)
        itemsizes = set()
        for ts in specs:
            if not isinstance(ts, TensorSpec):
                raise ValueError(f"bucket {name!r}: expected TensorSpec entries, got {type(ts).__name__}")
            if any((not isinstance(d, int)) or d < 0 for d in ts.shape):
                raise ValueError(f"bucket {name!r}: {ts.name} has an invalid shape {ts.shape}")
            ts.spec.check(ts.shape, ts.name)
            itemsizes.add(ts.itemsize)
        if len(itemsizes) > 1:
            raise ValueError(
                f"bucket {name!r} mixes element sizes {sorted(itemsizes)} (bytes); one bucket is one flat "
                "buffer of one dtype: put tensors of different dtypes in different buckets"
            )
        out.append((str(name), specs, itemsizes.pop() if itemsizes else 4))
    return out


def plan_model(
    buckets: Sequence[tuple[str, Sequence[TensorSpec]]],
    *,
    world_size: int,
    config: PlanConfig = PlanConfig(),
) -> Plan:
    """Lay out every bucket over ``world_size`` ranks, balancing bytes over the whole model.

    ``buckets``: ``(name, tensor specs)`` per communication unit, in execution order.
    Each bucket is EVEN or RAGGED (``config.layout``; ``"auto"`` picks per bucket, see
    [Note: auto layout cost model]); blocks stay whole unless the balance cap needs a split (see
    [Note: balance cap]). Deterministic: the same input gives the same plan on every rank. Every
    returned ``BucketPlan`` passes ``BucketPlan.check()``.
    """
    t0 = time.perf_counter()
    items = _validate(buckets, world_size, config)
    with counting() as packings:
        out, note, hsdp = _plan_items(items, world_size, config)
    return Plan(world_size=world_size, buckets=out, config=config, seconds=time.perf_counter() - t0,
                packings=packings[0], balance_note=note, balance_shard_size=hsdp)  # fmt: skip


def _plan_items(items, w: int, config: PlanConfig) -> tuple[tuple[BucketPlan, ...], str, int | None]:
    """``plan_model`` on validated buckets: ``(bucket plans, balance note, HSDP shard size or None)``."""
    param_b = sum(ts.numel * isz for _, specs, isz in items for ts in specs)
    if w == 1 or param_b == 0:
        return _layout(items, w, config), "", None
    mean, cap = param_b / w, config.balance_cap
    lb = max(1.0, _lower_bound(items, w) / mean)
    can_split = config.balance == "auto" and _has_matrix(items)
    if can_split and lb > cap:  # no whole-block plan can meet the cap: split straight away
        out, note = _split_for_balance(items, w, config, mean, f"whole blocks cannot: lower bound {lb:.3f}")
        return out, note, None
    chosen = _choose_layouts(items, w, config)
    goal = int(max(1.02 * lb, 1.05) * mean)  # what step 1 aims for (see [Note: balance cap])
    out = _layout(items, w, config, chosen=chosen, goal=goal)
    ratio = _busiest(out) / mean
    if lb <= cap and ratio > max(1.02 * lb, 1.05) and config.layout == "auto" and any(b.layout is Layout.EVEN for b in out):
        # even buckets add the same bytes to every rank; ragged ones can fill the ranks that whole
        # blocks leave light (elementwise embeddings beside the MLP matrices)
        alt = _layout(items, w, dataclasses.replace(config, layout="ragged"), goal=goal)
        if _busiest(alt) / mean < ratio:
            out, ratio = alt, _busiest(alt) / mean
    hsdp = None
    if ratio <= cap:
        note = f"whole blocks: busiest rank {ratio:.3f} x the mean (lower bound {lb:.3f}, cap {cap:.2f}), none split"
    elif not can_split:
        shard = hsdp = _balancing_shard_size(items, w, config)
        note = (
            f"whole blocks: busiest rank {ratio:.3f} x the mean, above balance_cap {cap:.2f} (whole-block lower "
            f"bound {lb:.3f}); "
            + (
                f"an HSDP shard size of {shard} (replicate x {w // shard}) balances within the cap "
                f"(fsdp-optim plan --suggest prices every shard size)"
                if shard
                else "no HSDP shard size dividing the world size balances within the cap"
            )
        )
        if config.balance == "whole":
            warnings.warn(f"PlanConfig(balance='whole'): {note}", stacklevel=3)
    else:
        split, note = _split_for_balance(items, w, config, mean, f"whole blocks gave {ratio:.3f} (lower bound {lb:.3f})",
                                         chosen=chosen)  # fmt: skip
        if _busiest(split) < _busiest(out):
            out = split
        else:
            note = f"whole blocks: busiest rank {ratio:.3f} x the mean, above balance_cap {cap:.2f}; splitting did not help"
    return out, note, hsdp


def _busiest(bucket_plans: Sequence[BucketPlan]) -> int:
    """Bytes of the busiest rank (padding included) over all buckets."""
    tot = np.zeros(bucket_plans[0].world_size if bucket_plans else 1, dtype=np.int64)
    for b in bucket_plans:
        tot += np.diff(np.asarray(b.rank_bounds, dtype=np.int64)) * b.itemsize
    return int(tot.max())


def _has_matrix(items) -> bool:
    return any(ts.spec.splits_on_rows and ts.numel for _, specs, _ in items for ts in specs)


def _sizes(items) -> dict[int, int]:
    """``{block bytes: count}`` of the planner's input (for ``whole_block_bound``)."""
    sizes: dict[int, int] = {}
    for _, specs, isz in items:
        for ts in specs:
            for n, c in block_sizes(ts.shape, ts.spec).items():
                sizes[n * isz] = sizes.get(n * isz, 0) + c
    return sizes


def _lower_bound(items, w: int) -> int:
    """``whole_block_bound`` of the planner's input (bytes)."""
    return whole_block_bound(_sizes(items), w)


def _balancing_shard_size(items, w: int, config: PlanConfig) -> int | None:
    """An HSDP shard size (a divisor ``s < w``: plan over ``s`` ranks, replicate ``w / s`` times) whose
    whole-block plan balances within the cap, or None. The largest divisor that the whole-block bound
    allows is planned (one plan); if it misses, the largest divisor whose balance is guaranteed: the
    ragged fill puts at most the mean plus one largest block on a rank (plus the even buckets'
    padding, at most ``padding_cap``), so ``largest block <= (cap - 1 - padding_cap) x mean`` suffices."""
    param_b = sum(ts.numel * isz for _, specs, isz in items for ts in specs)
    sizes = _sizes(items)
    biggest = max(sizes, default=0)
    divisors = sorted((d for d in range(1, w) if w % d == 0), reverse=True)
    first = next((s for s in divisors if whole_block_bound(sizes, s) * s <= config.balance_cap * param_b), None)
    if first is None:
        return None
    if first == 1 or _busiest(_layout(items, first, config)) * first <= config.balance_cap * param_b:
        return first
    slack = config.balance_cap - 1.0 - config.padding_cap
    return next((s for s in divisors if s < first and biggest * s <= slack * param_b), None)


def _split_for_balance(items, w: int, config: PlanConfig, mean: float, why: str, *, chosen=None):
    """``balance="auto"`` when whole blocks miss the cap: ragged buckets may cut matrix blocks larger
    than a threshold on rows (the threshold divided by 4 until the plan fits the cap, at most
    ``_SPLIT_TRIES`` plans). Returns ``(bucket plans, note)``: the plan with the least busy rank."""
    cap = config.balance_cap
    best, best_ratio = None, math.inf
    threshold = int((cap - 1.0) / 2 * mean)
    for _ in range(_SPLIT_TRIES):
        chosen = chosen or _choose_layouts(items, w, config)
        cand = _layout(items, w, config, split_above=max(threshold, 1), chosen=chosen)
        ratio = _busiest(cand) / mean
        if ratio < best_ratio:
            best, best_ratio = cand, ratio
        if ratio <= cap:
            break
        threshold //= 4
    n_split = sum(len(p.split_matrices()) for b in best for p in b.placements if p.split)
    return best, (
        f"split {n_split} matrix blocks on rows (Muon and Shampoo exchange them: one all_to_all pair per step): busiest rank "
        f"{best_ratio:.3f} x the mean (cap {cap:.2f}); {why}; PlanConfig(balance='whole') keeps blocks whole"
    )


_SPLIT_TRIES = 3
"""Balance cap: split plans tried (threshold on block bytes divided by 4 after each miss)."""


def _layout(items, w: int, config: PlanConfig, *, split_above: int | None = None, chosen=None,
            goal: int = 0) -> tuple[BucketPlan, ...]:
    """The bucket plans: layout per bucket, global ragged balance, materialized placements.
    ``split_above`` (bytes): ragged buckets may cut matrix blocks larger than this on rows.
    ``goal`` (bytes, 0: off): with whole blocks and every bucket ragged, the per-rank bytes the per-bucket
    packing aims for first when the stream packing's busiest rank exceeds it.
    ``chosen``: ``_choose_layouts(items, w, config)`` when already computed (it is pure)."""
    layouts, evens = chosen or _choose_layouts(items, w, config)
    ragged_idx = [i for i, lay in enumerate(layouts) if lay is Layout.RAGGED]
    starts_b, total_b, rag = {}, 0, []
    for i in ragged_idx:  # a bucket spans its tensors' elements, each rounded up to the alignment quantum
        starts_b[i] = total_b
        rag.append(_ragged_item(items[i], total_b, split_above, _quantum(config, items[i][2])))
        total_b += sum(g.numel for g in rag[-1][1]) * items[i][2]
    glob_cuts, offs_list = _balance_ragged(rag, total_b, w)
    glob = np.asarray(glob_cuts, dtype=np.int64)  # non-decreasing within a bucket, buckets in order
    spans = [sum(g.numel for g in r[1]) for r in rag]
    bounds = [np.clip(glob - r[0], 0, span * r[4]) // r[4] for r, span in zip(rag, spans)]
    if split_above is None and goal and len(rag) == len(items):
        # whole blocks, every bucket ragged (plan_model replans all-ragged when a mixed plan misses):
        # the per-bucket packing may balance better
        bounds, offs_list = _pour_if_better(rag, total_b, w, glob_cuts, bounds, offs_list, goal)
    ragged = {i: (offs, [g.split for g in r[1]], rb) for i, offs, r, rb in zip(ragged_idx, offs_list, rag, bounds)}
    out: list[BucketPlan] = []
    for i, (name, specs, isz) in enumerate(items):
        if layouts[i] is Layout.EVEN:
            ev = evens[i]
            rb_np = np.arange(w + 1, dtype=np.int64) * ev.seg
            offsets, splits = ev.offsets, ev.split
        else:
            offsets, splits, rb_np = ragged[i]
        out.append(_materialize(name, specs, isz, layouts[i], rb_np, offsets, splits))
    return tuple(out)


def _choose_layouts(items, w: int, config: PlanConfig) -> tuple[list[Layout], list[_EvenResult | None]]:
    """Per bucket: EVEN or RAGGED (see [Note: auto layout cost model]) and the even packing."""
    layouts: list[Layout] = []
    evens: list[_EvenResult | None] = []
    for _, specs, _ in items:
        if config.layout == "ragged":
            layouts.append(Layout.RAGGED)
            evens.append(None)
            continue
        n = sum(ts.numel for ts in specs)
        if config.layout == "even":
            layouts.append(Layout.EVEN)
            evens.append(_plan_even(specs, w, config, allow_split=True))
            continue
        res = _plan_even(specs, w, config, allow_split=False)
        if res.padding <= config.padding_cap * n:
            layouts.append(Layout.EVEN)
            evens.append(res)
        else:
            layouts.append(Layout.RAGGED)
            evens.append(None)
    return layouts, evens


def _ragged_item(item, start_b: int, split_above: int | None, quantum: int):
    """``(start byte, geometries, costs, cost profiles, itemsize)`` of one ragged bucket; matrix
    tensors whose largest block exceeds ``split_above`` bytes get row geometries (and a cost spread
    evenly over their rows)."""
    _, specs, isz = item
    geoms, profs = [], []
    for ts in specs:
        g = _Geom(ts, quantum=quantum)
        if split_above is not None and ts.spec.splits_on_rows and ts.numel and g.max_block * isz > split_above:
            g = _Geom(ts, split=True, quantum=quantum)
            rows_ = g.numel // g.unit
            c = tensor_cost(ts.shape, ts.spec) / max(rows_, 1)
            profs.append(_UniformCost(g.unit, rows_, c, c))
        else:
            profs.append(_cost_profile(ts.shape, ts.spec))
        geoms.append(g)
    return start_b, geoms, [tensor_cost(ts.shape, ts.spec) for ts in specs], profs, isz


def _pour_if_better(rag, total_b: int, w: int, glob_cuts, bounds, offs_list, goal: int):
    """The per-bucket packing ([Note: per-bucket ragged packing]) with the smallest capacity found in at
    most ``_POUR_PROBES`` packings (the first at ``goal`` bytes, then bisection), if its busiest rank holds
    clearly fewer bytes than the stream packing's (which balances the optimizer cost too) and, where the
    stream packing already meets ``goal``, a lower largest per-rank optimizer cost; else the stream
    packing's ``(bounds, offsets)``."""
    cur = max(b - a for a, b in zip(glob_cuts, glob_cuts[1:])) if w > 1 and rag else 0
    biggest = max((g.max_block * isz for _, gs, _, _, isz in rag for g in gs), default=0)
    lo = max(-(-total_b // w), biggest)
    hi = int(cur / (1 + _POUR_GAIN))
    if hi <= lo:
        return bounds, offs_list
    lo, found = lo - 1, None
    mid = min(max(goal, lo + 1), hi)
    for _ in range(_POUR_PROBES):
        count_packing()
        res = pour_ragged(rag, w, mid)
        if res is None:
            lo = mid
        else:
            hi, found = min(mid, res[2]), res
        if hi - lo <= max(1, total_b // (w * 1024)) or (found is None and mid == hi):
            break
        mid = (lo + hi) // 2 if found is not None or hi - mid <= mid - lo else mid + (hi - mid) // 2
        mid = (lo + hi) // 2 if found is None and mid <= lo else mid
    if found is None:
        return bounds, offs_list
    if cur <= goal and _max_cost_bounds(rag, found[0], found[1], w) >= _max_rank_cost(rag, glob_cuts, offs_list, w):
        return bounds, offs_list  # both meet the goal: the stream's balanced optimizer cost wins
    return list(found[0]), found[1]


def _max_cost_bounds(rag, bounds, offs_list, w: int) -> float:
    """Largest per-rank optimizer cost of ragged buckets laid out by per-bucket rank bounds (elements)."""
    cost = np.zeros(w, dtype=np.float64)
    for (_, geoms, _, profs, _), rb, offs in zip(rag, bounds, offs_list):
        rb = np.asarray(rb, dtype=np.int64)
        for g, prof, o in zip(geoms, profs, offs):
            if g.numel == 0:
                continue
            r0 = max(int(np.searchsorted(rb, o, side="right")) - 1, 0)
            r1 = min(max(int(np.searchsorted(rb, o + g.numel, side="left")), r0 + 1), w)
            x = np.clip(rb[r0 : r1 + 1] - o, 0, g.numel)
            cost[r0:r1] += np.diff(_cum_cost(prof, g.numel, x))
    return float(cost.max()) if w else 0.0


_POUR_PROBES = 3
"""Per-bucket packing: capacities tried per plan (each packing is one pass over the ranks)."""
_POUR_GAIN = 0.005
"""The per-bucket packing is tried, and kept, only where it lowers the busiest rank by this fraction."""

def _materialize(name: str, specs, isz: int, layout: Layout, rb_np: np.ndarray, offsets, splits) -> BucketPlan:
    """One ``BucketPlan`` from its rank bounds and tensor offsets; a splittable matrix is recorded as
    split only if a rank boundary actually cuts one of its blocks."""
    rank_bounds = tuple(rb_np.tolist())
    placements = []
    for j in sorted(range(len(specs)), key=lambda j: (offsets[j], specs[j].numel > 0, j)):
        ts = specs[j]
        shard = _make_shard(tuple(ts.shape), rank_bounds, rb_np, offsets[j])
        cut = bool(splits[j]) and _cuts_a_block(_Geom(ts), offsets[j], rb_np)
        placements.append(
            Placement(name=ts.name, shape=tuple(ts.shape), spec=ts.spec, offset=offsets[j], shard=shard, split=cut)
        )
    return BucketPlan(name=name, layout=layout, placements=tuple(placements), rank_bounds=rank_bounds, itemsize=isz)


def _cuts_a_block(g: _Geom, offset: int, rb_np: np.ndarray) -> bool:
    """Whether a rank bound strictly inside the tensor falls inside one of its (whole) blocks."""
    lo = int(np.searchsorted(rb_np, offset, side="right"))
    hi = int(np.searchsorted(rb_np, offset + g.numel, side="left"))
    return any(not g.is_boundary(x - offset) for x in set(rb_np[lo:hi].tolist()))
