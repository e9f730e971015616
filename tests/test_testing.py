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

    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="boom on rank one") as info:
        run_distributed(fn, world_size=2, timeout=30)
    assert "Traceback" in str(info.value)
    assert time.monotonic() - t0 < 20


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
