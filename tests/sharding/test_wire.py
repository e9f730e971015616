"""The padded wire format ([Note: wire format] in ``sharding/_wire.py``): both modes of a ragged bucket give
the same bits on gloo at W = 1..4 (3 divides nothing), fp32 and bf16, with empty segments, casts and
accumulation, for the all-gather at every W and the reduction at W <= 2 (at W >= 3 gloo's tensor and list
reduce-scatters add the ranks in different orders: equal to the last bit of a 3-term sum); the cost model's choice follows its formulas; a whole training run in padded mode equals
the grouped one and the single-process reference.

At W = 3 and 4 every mode's reduction (grouped, padded, per-owner reduces; even and ragged buckets, an
empty rank; SUM, AVG, accumulated) also equals exactly (``torch.equal``) the plain sum / average over
ranks computed in the test, on integer-valued gradients whose every partial sum is exact; and an all-ones
average is exactly 1, which fails if the average divides by anything but the group size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.sharding.plan import BucketPlan, Layout, Placement, RaggedLayout
from fsdp_optim.sharding._buffer import DistributedBuffer
from fsdp_optim.sharding import elements
from fsdp_optim.sharding.plan import LinkModel, WireMode, choose_wire_mode, grouped_seconds, padded_seconds
from tests._models import TinyConfig, TinyTransformer, assert_close_after_adamw, make_batch


def _three_tensors(bounds: tuple[int, ...], layout: Layout, name: str) -> BucketPlan:
    """A bucket of three tensors (42 elements) cut at the global ``bounds``."""
    placements, offset = [], 0
    for i, shape in enumerate(_SHAPES):
        numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        local = tuple(min(max(b - offset, 0), numel) for b in bounds)
        placements.append(Placement(name=f"t{i}", shape=shape, spec=elements(1), offset=offset,
                                    shard=RaggedLayout(shape, local), split=False))  # fmt: skip
        offset += numel
    return BucketPlan(name=name, layout=layout, placements=tuple(placements), rank_bounds=tuple(bounds), itemsize=4)


_SHAPES = [(7, 3), (5,), (4, 4)]


def _ragged_plan(world_size: int, sizes: list[int]) -> BucketPlan:
    """One ragged bucket of three tensors cut at the given per-rank segment sizes (some may be 0)."""
    assert sum(sizes) == 42
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return _three_tensors(tuple(bounds), Layout.RAGGED, "b")


SIZES = {1: [42], 2: [30, 12], 3: [0, 29, 13], 4: [11, 0, 25, 6]}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_equals_grouped_bitwise(world_size, dtype):
    def fn():
        out = {}
        plan = _ragged_plan(world_size, SIZES[world_size])
        for mode in (*WireMode, "owners"):  # "owners": one reduce per non-empty segment (NCCL's default)
            buf = DistributedBuffer(plan, dtype=torch.float32, wire=WireMode.GROUPED if mode == "owners" else mode,
                                    uneven_reduce="reduce" if mode == "owners" else "reduce_scatter")  # fmt: skip
            g = torch.Generator().manual_seed(dist.get_rank())
            buf.segment.copy_(torch.randn(buf.segment_numel, generator=g))
            full = buf.all_gather(src=buf.segment.to(dtype))
            grad = torch.randn(buf.total_numel, generator=g).to(dtype)
            avg = buf.reduce_scatter(grad, out=torch.empty(buf.segment_numel, dtype=dtype), op=dist.ReduceOp.AVG)
            acc = torch.ones(buf.segment_numel)  # an fp32 segment the bf16/fp32 reduction adds into
            buf.reduce_scatter(grad, out=acc, op=dist.ReduceOp.SUM, accumulate=True)
            h = buf.all_gather(async_op=True)
            out[mode] = (full, avg, acc, h.wait())
        return out

    for out in run_distributed(fn, world_size=world_size):
        for what, a, b in [
            x for other in (WireMode.PADDED, "owners")
            for x in zip(("all_gather", "avg", "accumulate", "async all_gather"), out[WireMode.GROUPED], out[other])
        ]:  # fmt: skip
            assert a.dtype == b.dtype
            if "gather" in what or world_size <= 2:
                assert torch.equal(a, b), (what, (a - b).abs().max())
            else:  # gloo's reduce_scatter_tensor / reduce sum 3+ ranks in another order than its list form
                bf16 = dtype == torch.bfloat16  # (a last-bit difference of terms of size ~3)
                torch.testing.assert_close(a, b, rtol=2**-7 if bf16 else 1e-6, atol=2**-6 if bf16 else 1e-6)


def test_cost_model_and_choice():
    link = LinkModel(alpha_s=5e-6, bytes_per_s=50e9)
    even = [100] * 8
    assert choose_wire_mode(even, element_size=4) is WireMode.GROUPED  # even: one tensor collective anyway
    assert padded_seconds(even, element_size=4, link=link) == pytest.approx(7 * 5e-6 + 7 * 400 / 50e9)
    assert grouped_seconds(even, element_size=4, link=link) == pytest.approx(8 * 7 * 5e-6 + 700 * 4 / 50e9)
    # Many owners at large W: latency dominates, padded wins.
    sizes = [1000 + (r % 3) for r in range(1024)]
    assert choose_wire_mode(sizes, element_size=2) is WireMode.PADDED
    # One huge segment among 8 ranks: padding would send it 7 times (a bandwidth-bound transfer).
    skewed = [10**9] + [10**6] * 7
    assert grouped_seconds(skewed, element_size=2) < padded_seconds(skewed, element_size=2)
    assert choose_wire_mode(skewed, element_size=2) is WireMode.GROUPED
    assert choose_wire_mode(sizes, element_size=2, backend="gloo") is WireMode.GROUPED  # gloo: list forms
    assert choose_wire_mode(skewed, element_size=2, wire="padded", backend="gloo") is WireMode.PADDED
    with pytest.raises(ValueError, match="wire must be one of"):
        choose_wire_mode(sizes, element_size=2, wire="fast")


@pytest.mark.parametrize("world_size", [3])
def test_training_in_padded_mode_equals_grouped_and_the_reference(world_size):
    cfg = TinyConfig(vocab_size=101, dim=24, num_heads=2, num_layers=2, mlp_dim=40)
    lr, steps = 1e-2, 3

    def batch(step):
        return make_batch(batch_size=6, seq_len=8, vocab_size=cfg.vocab_size, seed=100 + step)

    torch.manual_seed(0)
    ref = TinyTransformer(cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    for step in range(steps):
        x, y = batch(step)
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    want = ref.state_dict()

    def fn(wire):
        def run():
            torch.manual_seed(0)
            model = TinyTransformer(cfg)
            config = fsdp_optim.sharding.PlanConfig(layout="ragged", wire=wire)
            for layer in model.layers:
                fsdp_optim.fully_shard(layer)
            fsdp_optim.fully_shard(model, plan_config=config)
            modes = {b.buffer.wire for b in model._fsdp_optim_state.runtime.buckets}
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            r, n = dist.get_rank(), 6 // world_size
            for step in range(steps):
                x, y = batch(step)
                F.cross_entropy(model(x[r * n : (r + 1) * n]).flatten(0, 1), y[r * n : (r + 1) * n].flatten()).backward()
                opt.step()
                opt.zero_grad()
            return modes, fsdp_optim.full_state_dict(model)

        return run

    grouped = run_distributed(fn("grouped"), world_size=world_size)
    padded = run_distributed(fn("padded"), world_size=world_size)
    for (gm, g), (pm, p) in zip(grouped, padded):
        assert gm == {WireMode.GROUPED} and pm == {WireMode.PADDED}
        assert_close_after_adamw(p, g, lr=lr)  # (reduction order differs at W = 3, see above)
        assert_close_after_adamw(p, want, lr=lr)


def test_owner_reduces_skip_empty_segments_and_keep_the_input():
    """Per-owner reduces: one per non-empty segment (W = 4 with an empty rank: 3), the caller's
    gradient untouched unless it gives it up (``consume=True``)."""
    from torch.distributed.tensor.debug import CommDebugMode

    def fn():
        buf = DistributedBuffer(_ragged_plan(4, SIZES[4]), uneven_reduce="reduce")
        grad = torch.randn(buf.total_numel, generator=torch.Generator().manual_seed(dist.get_rank()))
        before = grad.clone()
        with CommDebugMode() as cm:
            got = buf.reduce_scatter(grad, out=torch.empty(buf.segment_numel))
        kept = torch.equal(grad, before)
        consumed = buf.reduce_scatter(grad, out=torch.empty(buf.segment_numel), consume=True)
        return sum(cm.get_comm_counts().values()), kept, torch.equal(got, consumed)

    for count, kept, same in run_distributed(fn, world_size=4):
        assert count == 3 and kept and same


# ---- exact reductions at W >= 3 against the plain sum / average -----------------------------
# Integer-valued gradients, |x| <= 8 per rank: every partial sum of W <= 4 terms is an integer of
# magnitude <= 32, exact in fp32 and in bf16 (8 significant bits), so the reduction order (which gloo's
# tensor and list forms do differently at W >= 3, see test_padded_equals_grouped_bitwise) cannot change
# a bit, and every mode must equal the plain sum over ranks computed here. The average is that exact
# sum divided once by W: computed here in float64 and cast to the dtype (n / 3 never lies on a
# rounding midpoint, so the double rounding of float64 -> dtype equals one correctly rounded division).
NONEMPTY_SIZES = {3: [20, 9, 13], 4: [11, 10, 15, 6]}


def _even_bucket(world_size: int) -> BucketPlan:
    """The same three tensors in an even bucket: W segments of ceil(42 / W) elements, padding at the end."""
    seg = -(-42 // world_size)
    return _three_tensors(tuple(r * seg for r in range(world_size + 1)), Layout.EVEN, "even")


def _buckets(world_size: int) -> dict[str, BucketPlan]:
    return {
        "ragged_empty_rank": _ragged_plan(world_size, SIZES[world_size]),
        "ragged": _ragged_plan(world_size, NONEMPTY_SIZES[world_size]),
        "even": _even_bucket(world_size),
    }


def _padding(plan: BucketPlan) -> torch.Tensor:
    """True where the bucket's global flat buffer holds no tensor element."""
    pad = torch.ones(plan.total_numel, dtype=torch.bool)
    for p in plan.placements:
        pad[p.offset : p.offset + p.numel] = False
    return pad


def _int_grad(numel: int, rank: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def _wire_buffers(plan: BucketPlan):
    for mode in (WireMode.GROUPED, WireMode.PADDED, "owners"):
        yield getattr(mode, "value", mode), DistributedBuffer(
            plan, dtype=torch.float32, wire=WireMode.GROUPED if mode == "owners" else mode,
            uneven_reduce="reduce" if mode == "owners" else "reduce_scatter",
        )  # fmt: skip


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reductions_equal_the_plain_sum_and_average_exactly(world_size, dtype):
    """Every wire mode (grouped list reduce-scatter, padded tensor reduce-scatter, per-owner reduces),
    even and ragged buckets (with and without an empty rank), SUM and AVG, plain and accumulated into
    an fp32 segment: ``torch.equal`` with the sum / average over ranks computed here."""

    def fn():
        rank, out = dist.get_rank(), {}
        for seed, (bname, plan) in enumerate(_buckets(world_size).items()):
            pad = _padding(plan)
            for mode, buf in _wire_buffers(plan):
                grad = _int_grad(plan.total_numel, rank, seed, dtype)
                grad[pad] = float("nan")  # the caller's padding must not leak into the result
                got = {}
                for op in ("sum", "avg"):
                    red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG
                    got[op] = buf.reduce_scatter(grad.clone(), out=torch.empty(buf.segment_numel, dtype=dtype), op=red)
                    acc = torch.ones(buf.segment_numel)  # fp32 segment the reduction adds into
                    got[op + "_acc"] = buf.reduce_scatter(grad.clone(), out=acc, op=red, accumulate=True)
                out[bname, mode] = got, plan.segment(rank)
        return out

    results = run_distributed(fn, world_size=world_size)
    for seed, (bname, plan) in enumerate(_buckets(world_size).items()):
        total = sum(_int_grad(plan.total_numel, r, seed, torch.float64) for r in range(world_size))
        total[_padding(plan)] = 0  # the segment's padding reads zero
        want_full = {"sum": total.to(dtype), "avg": (total / world_size).to(dtype)}
        for rank, out in enumerate(results):
            for mode in ("grouped", "padded", "owners"):
                got, (a, b) = out[bname, mode]
                for op in ("sum", "avg"):
                    want = want_full[op][a:b]
                    assert got[op].dtype == dtype and torch.equal(got[op], want), (bname, mode, op, rank)
                    acc = torch.ones(b - a) + want.float()
                    acc[_padding(plan)[a:b]] = 0  # padding is zeroed after the add too
                    assert torch.equal(got[op + "_acc"], acc), (bname, mode, op, "accumulate", rank)


@pytest.mark.parametrize("world_size", [3, 4])
def test_the_average_divides_by_the_group_size_in_every_mode(world_size):
    """Every rank sends all ones: the average is exactly 1 everywhere, whichever ranks own a segment.
    Dividing by the number of owning ranks (2 of 3 at W = 3, 3 of 4 at W = 4: a rank is empty) gives
    1.5 or 1.33; not dividing gives W."""

    def fn():
        out = {}
        for bname, plan in _buckets(world_size).items():
            for mode, buf in _wire_buffers(plan):
                got = buf.reduce_scatter(torch.ones(plan.total_numel), op=dist.ReduceOp.AVG)
                a, b = plan.segment(dist.get_rank())
                out[bname, mode] = got, ~_padding(plan)[a:b], len(buf.owners)
        return out

    results = run_distributed(fn, world_size=world_size)
    assert results[0]["ragged_empty_rank", "grouped"][2] == world_size - 1  # one rank owns nothing
    for out in results:
        for (bname, mode), (got, real, _) in out.items():
            assert torch.equal(got[real], torch.ones(int(real.sum()))), (bname, mode, got)
            assert not got[~real].any(), (bname, mode, got)
