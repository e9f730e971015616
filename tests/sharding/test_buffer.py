"""DistributedBuffer on W = 1..4 gloo ranks, both layouts, against the unsharded tensors.

Every check is bitwise: gathers copy bits, and the reductions sum integer-valued floats small
enough (|x| <= 2**10 per rank) that every partial sum is exact in fp32 and bf16's 8-bit mantissa
is not involved (bf16 cases use |x| <= 64), so the result does not depend on the reduction order.
Buckets are built here with two small layout helpers (``_even_plan`` pads between tensors so no
block crosses a multiple of S; ``_ragged_plan`` cuts at given block boundaries) and with the
planner's ``plan_model`` for both layouts.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from fsdp_optim._testing import run_distributed
from fsdp_optim.sharding import BlockSpec, PlanConfig, elements, expert, rows, whole
from fsdp_optim.sharding.plan import BucketPlan, Layout, Placement, RaggedLayout, TensorSpec, plan_model
from fsdp_optim.sharding._buffer import CollectiveHandle, DistributedBuffer

WORLD_SIZES = [1, 2, 3, 4]

# Shapes that divide nothing (primes, odd row counts, a partial last elements(4) block).
TENSORS: list[tuple[str, tuple[int, ...], BlockSpec]] = [
    ("w", (7, 5), whole()),
    ("b", (13,), elements(1)),
    ("s", (11, 3), rows(2)),
    ("e", (3, 5, 7), expert()),
    ("q", (9, 7), elements(4)),
    ("h", (6, 2), whole(row_splits=[1, 3, 2])),
]


# ---- bucket plans without the planner -------------------------------------------------------
def _placements(tensors, offsets, bounds) -> tuple[Placement, ...]:
    out = []
    for (name, shape, spec), off in zip(tensors, offsets):
        n = math.prod(shape)
        tb = tuple(min(max(b - off, 0), n) for b in bounds)
        out.append(Placement(name=name, shape=shape, spec=spec, offset=off, shard=RaggedLayout(shape, tb)))
    return tuple(out)


def _even_plan(tensors, world_size: int, name: str = "even") -> BucketPlan:
    """Smallest uniform S for which packing the tensors in order, padding up to the next multiple
    of S whenever a block would cross one, fits in W * S."""
    total = sum(math.prod(s) for _, s, _ in tensors)
    s_ = max(1, -(-total // world_size))
    while True:
        off, offsets, ok = 0, [], True
        for _, shape, spec in tensors:
            starts = spec.block_starts(shape)
            # shift the tensor until none of its blocks crosses a multiple of S
            while True:
                bad = next(
                    (off + a for a, b in zip(starts, starts[1:]) if (off + a) // s_ != (off + b - 1) // s_), None
                )
                if bad is None:
                    break
                if max(b - a for a, b in zip(starts, starts[1:])) > s_ or off > world_size * s_:
                    ok = False
                    break
                off = (bad // s_ + 1) * s_ - (bad - off)
            if not ok:
                break
            offsets.append(off)
            off += math.prod(shape)
        if ok and off <= world_size * s_:
            bounds = tuple(r * s_ for r in range(world_size + 1))
            plan = BucketPlan(name=name, layout=Layout.EVEN, placements=_placements(tensors, offsets, bounds),
                              rank_bounds=bounds)
            plan.check()
            return plan
        s_ += 1


def _ragged_plan(tensors, world_size: int, seed: int, name: str = "ragged") -> BucketPlan:
    """Tensors packed with no padding, cut at W - 1 random global block boundaries (repeats
    allowed: empty ranks)."""
    offsets, cuts, off = [], {0}, 0
    for _, shape, spec in tensors:
        offsets.append(off)
        cuts.update(off + b for b in spec.block_starts(shape))
        off += math.prod(shape)
    rng = random.Random(seed)
    inner = sorted(rng.choice(sorted(cuts)) for _ in range(world_size - 1))
    if world_size >= 3 and seed % 2 == 0:
        inner[0] = 0  # rank 0 empty: broadcasts must skip it
    bounds = (0, *inner, off)
    plan = BucketPlan(name=name, layout=Layout.RAGGED, placements=_placements(tensors, offsets, bounds),
                      rank_bounds=bounds)
    plan.check()
    return plan


def _plans(world_size: int) -> list[BucketPlan]:
    plans = [
        _even_plan(TENSORS, world_size),
        _even_plan(TENSORS[:2], world_size, "even_small"),
        _ragged_plan(TENSORS, world_size, seed=0),
        _ragged_plan(TENSORS, world_size, seed=1),
        _ragged_plan(TENSORS[3:4], world_size, seed=3, name="one_tensor"),  # W > number of blocks at W=4
    ]
    rng = random.Random(world_size)
    for seed in range(4, 10):  # random subsets and orders of the tensors, random cuts
        sub = rng.sample(TENSORS, rng.randint(1, len(TENSORS)))
        plans.append(_ragged_plan(sub, world_size, seed=seed, name=f"ragged{seed}"))
        if seed % 3 == 0:
            plans.append(_even_plan(sub, world_size, name=f"even{seed}"))
    plans += _planner_plans(world_size)
    return plans


def _planner_plans(world_size: int) -> list[BucketPlan]:
    """Plans from the planner for both layouts (two buckets, balanced over the model)."""
    buckets = [(f"planned{i}", [TensorSpec(name=n, shape=s, spec=sp) for n, s, sp in TENSORS[i::2]]) for i in range(2)]
    out = []
    for layout in ("even", "ragged"):
        plan = plan_model(buckets, world_size=world_size, config=PlanConfig(layout=layout))
        out += list(plan.buckets)
    return out


def _full_tensors(plan: BucketPlan, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-64, 65, p.shape, generator=g).to(dtype) for p in plan.placements]


def _load(buf: DistributedBuffer, fulls) -> None:
    """Fill the segment through the local views (what fully_shard does at init)."""
    rank = buf.rank
    for v, p, f in zip(buf.local_views(), buf.plan.placements, fulls):
        v.copy_(p.shard.shard(f, rank))


def _padding_mask(plan: BucketPlan) -> torch.Tensor:
    """True where the bucket's global flat buffer holds no tensor element."""
    mask = torch.ones(plan.total_numel, dtype=torch.bool)
    for p in plan.placements:
        mask[p.offset : p.offset + p.numel] = False
    return mask


def _counts(cm: CommDebugMode) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}


def _expected_gather_counts(buf: DistributedBuffer) -> dict[str, int]:
    if buf.is_even:
        return {"_allgather_base_": 1}
    return {"broadcast_": len(buf.owners)}


def _expected_reduce_counts(buf: DistributedBuffer) -> dict[str, int]:
    return {"_reduce_scatter_base_": 1} if buf.is_even else {"reduce_scatter_": 1}


# ---- the Must-show -------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_is_bitwise_and_one_collective(world_size):
    def fn():
        seen = []
        for i, plan in enumerate(_plans(world_size)):
            buf = DistributedBuffer(plan)
            fulls = _full_tensors(plan, seed=i)
            _load(buf, fulls)
            # zero copy: every local view lies inside the segment's storage
            base = buf.segment.untyped_storage().data_ptr()
            assert all(v.untyped_storage().data_ptr() == base for v in buf.local_views())
            with CommDebugMode() as cm:
                full = buf.all_gather()
            assert _counts(cm) == _expected_gather_counts(buf), (plan.name, _counts(cm))
            assert full.shape == (plan.total_numel,)
            for v, f, p in zip(buf.full_views(full), fulls, plan.placements):
                assert torch.equal(v, f), (plan.name, p.name)
            mask = _padding_mask(plan)
            assert torch.equal(full[mask], torch.zeros(int(mask.sum()))), "padding must be zero"
            seen.append((plan.name, plan.layout.value, buf.is_even, len(buf.owners)))
        return seen

    out = run_distributed(fn, world_size=world_size)
    assert all(o == out[0] for o in out)
    if world_size >= 3:  # the sweep covers uneven buckets with an empty rank
        assert any(not even and owners < world_size for _, _, even, owners in out[0])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_is_exact_and_one_collective(world_size, op):
    red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}[op]

    def grads(plan, rank):
        g = torch.Generator().manual_seed(1000 + rank)
        return torch.randint(-(2**10), 2**10 + 1, (plan.total_numel,), generator=g).float()

    def fn():
        rank = dist.get_rank()
        for plan in _plans(world_size):
            buf = DistributedBuffer(plan)
            full_grad = grads(plan, rank)
            pad = _padding_mask(plan)
            full_grad[pad] = float("nan")  # garbage in the caller's padding must not leak
            with CommDebugMode() as cm:
                got = buf.reduce_scatter(full_grad, op=red)
            assert _counts(cm) == _expected_reduce_counts(buf), (plan.name, _counts(cm))
            assert got is buf.grad_segment
            want = sum(grads(plan, r) for r in range(world_size))
            if op == "avg":
                want = want / world_size  # exact integer sum, then one rounding of the division
            want[pad] = 0
            want = want[slice(*plan.segment(rank))]
            assert torch.equal(got, want), plan.name
            # the gradient shards are views into the gradient segment, exactly the summed tensors' ranges
            for v, p in zip(buf.local_views(buf.grad_segment), plan.placements):
                s, e = p.shard.range(rank)
                assert torch.equal(v, want[p.offset + s - plan.segment(rank)[0] :][: e - s])
            # accumulation (gradient accumulation with sync): the reduced range is added to ``out``
            buf.reduce_scatter(full_grad, op=red, accumulate=True)
            assert torch.equal(buf.grad_segment, want * 2), plan.name
        return True

    run_distributed(fn, world_size=world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_consumed_even_reduce_on_gloo_is_an_in_place_all_reduce_with_the_same_bits(world_size):
    # [Note: even reduce-scatter on gloo]: real-valued gradients (the order of the sums matters), so
    # equal bits mean the same summation as gloo's own reduce_scatter_single, not just the same sum.
    from torch.profiler import ProfilerActivity, profile

    def fn():
        rank = dist.get_rank()
        checked = 0
        for plan in _plans(world_size) + _planner_plans(world_size):
            buf = DistributedBuffer(plan)
            if not buf.is_even or plan.total_numel == 0:
                continue
            g = torch.randn(plan.total_numel, generator=torch.Generator().manual_seed(rank))
            g[_padding_mask(plan)] = float("nan")
            want = torch.empty(buf.segment_numel)
            dist.reduce_scatter_tensor(want, g.clone())  # gloo's own reduce-scatter, the reference
            want.div_(world_size)
            want[_padding_mask(plan)[slice(*plan.segment(rank))]] = 0
            for consume in (False, True):
                flat = g.clone()
                with CommDebugMode() as cm, profile(activities=[ProfilerActivity.CPU]) as prof:
                    got = buf.reduce_scatter(flat, op=dist.ReduceOp.AVG, consume=consume)
                assert torch.equal(got, want), (plan.name, consume)
                clones = [e for e in prof.events() if e.name == "aten::clone"]
                if consume:  # one in-place all-reduce, no copy of the whole bucket
                    assert _counts(cm) == {"allreduce_": 1}, _counts(cm)
                    assert not clones, plan.name
                else:  # the caller's tensor is left alone
                    assert _counts(cm) == {"_reduce_scatter_base_": 1}, _counts(cm)
                    assert torch.equal(flat.nan_to_num(7.0), g.nan_to_num(7.0))
            checked += 1
        assert checked
        return checked

    run_distributed(fn, world_size=world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_async_handles_two_buckets_wait_later(world_size):
    def fn():
        rank = dist.get_rank()
        plans = [_even_plan(TENSORS, world_size, "a"), _ragged_plan(TENSORS, world_size, seed=0, name="b")]
        bufs = [DistributedBuffer(p) for p in plans]
        fulls = [_full_tensors(p, seed=7 + i) for i, p in enumerate(plans)]
        for b, f in zip(bufs, fulls):
            _load(b, f)
        handles = [b.all_gather(async_op=True) for b in bufs]
        assert all(isinstance(h, CollectiveHandle) for h in handles)
        # full_grad = (rank + 1) * gathered params -> reduced = W (W + 1) / 2 * params (exact)
        outs = [h.wait() for h in reversed(handles)][::-1]
        assert handles[0].wait() is outs[0]  # idempotent
        rs = [b.reduce_scatter(o * (rank + 1), async_op=True) for b, o in zip(bufs, outs)]
        got = [h.wait() for h in reversed(rs)][::-1]
        assert rs[1].wait() is got[1] and rs[1].is_completed()
        k = world_size * (world_size + 1) // 2
        for b, f, o, g in zip(bufs, fulls, outs, got):
            for v, ref in zip(b.full_views(o), f):
                assert torch.equal(v, ref)
            assert torch.equal(g, b.segment * k)
        return True

    run_distributed(fn, world_size=world_size)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_mixed_precision_accumulate_and_gather_modes(world_size):
    """bf16 gather of an fp32 master, an fp32 reduction into a bf16 grad segment, accumulation,
    and every uneven all-gather mode (the broadcast group and all_to_all_single)."""

    def fn():
        rank = dist.get_rank()
        plan = _ragged_plan(TENSORS, world_size, seed=0)
        fulls = _full_tensors(plan, seed=3)  # |x| <= 64: exact in bf16
        for mode in ("broadcast", "all_to_all"):
            buf = DistributedBuffer(plan, uneven_gather=mode)
            _load(buf, fulls)
            out = buf.new_full()  # fp32 compute buffer from a bf16 gather
            with CommDebugMode() as cm:
                got = buf.all_gather(src=buf.segment.to(torch.bfloat16), out=out)
            assert got is out and got.dtype == torch.float32
            if not buf.is_even:
                want = {"broadcast": {"broadcast_": len(buf.owners)}, "all_to_all": {"alltoall_base_": 1}}[mode]
                assert _counts(cm) == want, _counts(cm)
            for v, f in zip(buf.full_views(got), fulls):
                assert torch.equal(v, f)
        # fp32 reduction of bf16 grads, stored in a bf16 gradient segment, accumulated twice
        buf = DistributedBuffer(plan, dtype=torch.bfloat16)
        _load(buf, fulls)
        full = buf.all_gather()
        assert full.dtype == torch.bfloat16
        gseg = buf.alloc_grad_segment()
        for _ in range(2):
            buf.reduce_scatter(full.float(), accumulate=True)
        assert buf.grad_segment is gseg and gseg.dtype == torch.bfloat16
        # exact in bf16: W * x is an integer of magnitude <= 4 * 64 = 256 (<= 8 significant bits),
        # and doubling it adds no bits, so both accumulation steps round nothing.
        assert torch.equal(gseg.float(), buf.segment.float() * 2 * world_size)
        buf.free_grad_segment()
        assert buf.grad_segment is None
        return rank

    assert run_distributed(fn, world_size=world_size) == list(range(world_size))


def test_world_size_one_without_a_process_group():
    plan = _ragged_plan(TENSORS, 1, seed=0)
    buf = DistributedBuffer(plan)
    fulls = _full_tensors(plan, seed=5)
    _load(buf, fulls)
    full = buf.all_gather()
    assert all(torch.equal(v, f) for v, f in zip(buf.full_views(full), fulls))
    h = buf.reduce_scatter(full * 2, async_op=True)
    assert torch.equal(h.wait(), buf.segment * 2)


def test_user_errors_name_the_problem():
    plan = _even_plan(TENSORS, 2)
    with pytest.raises(ValueError, match="planned for world size 2 but no process group is initialized"):
        DistributedBuffer(plan)
    plan1 = _even_plan(TENSORS, 1)
    buf = DistributedBuffer(plan1)
    with pytest.raises(ValueError, match=r"full_grad must be a flat contiguous tensor of \d+ elements"):
        buf.reduce_scatter(torch.zeros(3))
    with pytest.raises(ValueError, match="src must be a flat contiguous tensor"):
        buf.all_gather(src=torch.zeros(plan1.total_numel + 1))
    with pytest.raises(ValueError, match="out must be a flat contiguous tensor"):
        buf.all_gather(out=torch.zeros(2 * plan1.total_numel)[::2])
    with pytest.raises(ValueError, match="uneven_gather must be one of"):
        DistributedBuffer(plan1, uneven_gather="ring")


def test_helpers_cover_padding_and_empty_ranks():
    """The local plan helpers produce what the tests claim: padded even buckets, empty ranks."""
    assert any(_even_plan(TENSORS, w).padding > 0 for w in WORLD_SIZES)
    sizes = _ragged_plan(TENSORS, 4, seed=0).segment_sizes
    assert 0 in sizes and len(set(sizes)) > 1
    assert 0 in _ragged_plan(TENSORS[3:4], 4, seed=3).segment_sizes  # 3 experts on 4 ranks


def test_subgroups_use_group_ranks():
    """Two shard groups of 2 inside W = 4 (HSDP's inner groups): ranks, broadcast roots and
    segments are group-local; each group gathers and reduces only its own members."""

    def fn():
        rank = dist.get_rank()
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = groups[rank // 2]
        plan = _ragged_plan(TENSORS, 2, seed=1)  # uneven: the broadcast group
        buf = DistributedBuffer(plan, group=mine)
        assert buf.rank == rank % 2 and not buf.is_even
        fulls = [f * (1 + rank // 2) for f in _full_tensors(plan, seed=11)]  # the groups differ
        _load(buf, fulls)
        full = buf.all_gather()
        assert all(torch.equal(v, f) for v, f in zip(buf.full_views(full), fulls))
        got = buf.reduce_scatter(full * (rank + 1))
        k = (1 + 2) if rank < 2 else (3 + 4)
        assert torch.equal(got, buf.segment * k)
        # an empty bucket (nothing planned into it) moves nothing and returns empty buffers
        empty = DistributedBuffer(BucketPlan(name="empty", layout=Layout.EVEN, placements=(), rank_bounds=(0, 0, 0)),
                                  group=mine)
        with CommDebugMode() as cm:
            assert empty.all_gather().numel() == 0 and empty.reduce_scatter(empty.new_full()).numel() == 0
        assert _counts(cm) == {}
        return True

    run_distributed(fn, world_size=4)


def test_device_mismatch_is_a_user_error():
    buf = DistributedBuffer(_even_plan(TENSORS, 1))
    with pytest.raises(ValueError, match="is on meta but the buffer lives on cpu"):
        buf.all_gather(out=torch.empty(buf.total_numel, device="meta"))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reduce_scatter_owners_matches_the_flat_reduce_scatter(world_size):
    """``reduce_scatter_owners`` ([Note: per-owner reduction under mixed precision]) on every plan (even,
    ragged, empty ranks): bf16 gradients (some missing) cast to fp32 per owner segment, premultiplied,
    averaged, written or added into ``out``; against ``reduce_scatter`` of the fp32 flat buffer: bitwise at
    W <= 2, close at W >= 3 (gloo's reduce may sum in another order). The gradient list is consumed."""

    def fn():
        r = dist.get_rank()
        out = []
        for plan in _plans(world_size):
            buf = DistributedBuffer(plan)
            torch.manual_seed(10 + r)
            grads = [None if i == 1 else torch.randn(p.shape).to(torch.bfloat16) for i, p in enumerate(plan.placements)]
            flat = buf.new_full(torch.float32)
            for v, g in zip(buf.full_views(flat), grads):
                if g is not None:
                    v.copy_(g)
            flat.mul_(0.5)
            base = torch.randn(buf.segment_numel)
            want_w = buf.reduce_scatter(flat.clone(), out=torch.empty(buf.segment_numel), op=dist.ReduceOp.AVG)
            want_a = buf.reduce_scatter(flat.clone(), out=base.clone(), op=dist.ReduceOp.AVG, accumulate=True)
            held = list(grads)
            got_w = buf.reduce_scatter_owners(
                held, dtype=torch.float32, out=torch.empty(buf.segment_numel), op=dist.ReduceOp.AVG, scale=0.5
            ).wait()
            assert all(g is None for g in held), plan.name
            got_a = buf.reduce_scatter_owners(
                list(grads), dtype=torch.float32, out=base.clone(), op=dist.ReduceOp.AVG, scale=0.5, accumulate=True
            ).wait()
            out.append((plan.name, want_w, got_w, want_a, got_a))
        return out

    for rank_out in run_distributed(fn, world_size=world_size):
        for name, want_w, got_w, want_a, got_a in rank_out:
            for want, got in ((want_w, got_w), (want_a, got_a)):
                if world_size <= 2:
                    assert torch.equal(got, want), name
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
