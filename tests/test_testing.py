"""The multi-rank harness itself: results, errors with tracebacks, no hangs."""

import time

import pytest
import torch
import torch.distributed as dist

from fsdp_optim._testing import DistributedTestError, run_distributed


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_in_rank_order(world_size):
    def fn():
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        return dist.get_rank(), t.item()

    out = run_distributed(fn, world_size=world_size)
    total = world_size * (world_size + 1) / 2
    assert out == [(r, total) for r in range(world_size)]


def test_error_surfaces_with_traceback_and_does_not_hang():
    def fn():
        if dist.get_rank() == 1:
            raise ValueError("boom on rank one")
        dist.barrier()  # rank 0 waits for rank 1, which never comes

    # a hang would end in the harness's TimeoutError after 30 s, not this error: no duration asserted
    with pytest.raises(DistributedTestError, match="boom on rank one") as info:
        run_distributed(fn, world_size=2, timeout=30)
    assert "Traceback" in str(info.value)


def test_timeout_kills_the_group():
    def fn():
        time.sleep(60)

    with pytest.raises(TimeoutError, match="ranks still running"):
        run_distributed(fn, world_size=2, timeout=1.0)


def test_groups_back_to_back():
    """Fresh groups one after another (each test makes its own); the overhead (~0.1 s per 4-rank
    group here) is a benchmark figure, not asserted."""
    for _ in range(3):
        assert run_distributed(lambda: dist.get_rank(), world_size=4) == [0, 1, 2, 3]


def test_live_bytes_counts_allocations_frees_and_resizes():
    from fsdp_optim._testing import LiveBytes

    before = torch.zeros(10_000)  # made outside the block: not counted
    with LiveBytes() as m:
        a = torch.zeros(1000)  # 4,000 B
        b = torch.ones(2000)  # 8,000 B; peak 12,000 here
        del a
        c = b[:10].clone()  # 40 B
        d = torch.zeros(1 << 16)  # 262,144 B, then shrunk in place to nothing
        peak_with_d = m._total()
        d.untyped_storage().resize_(0)
        e = before + 1  # an op's output is counted: 40,000 B
        del e
    assert peak_with_d == 8000 + 40 + (1 << 18)
    assert m.peak == peak_with_d
    assert m.current == 8000 + 40
