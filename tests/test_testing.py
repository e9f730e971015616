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


def test_overhead_is_small():
    t0 = time.monotonic()
    for _ in range(3):
        run_distributed(lambda: dist.get_rank(), world_size=4)
    assert (time.monotonic() - t0) / 3 < 3.0  # generous: a loaded CI machine; typically ~0.2 s
