import pytest
import torch

from fsdp_optim._testing import run_distributed


def _warm_up_imports() -> None:
    """Run one optimizer step in the parent so forked ranks inherit the ~200 modules it imports
    lazily (about 10 s per forked group otherwise)."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    torch.optim.AdamW([p]).step()


# Ranks run with one intra-op thread each (fsdp_optim._testing); references computed in this process
# must run the same kernels, since CPU BLAS results can depend on the thread count (seen on a machine
# with 2 physical cores: a W=1 run and its single-process reference differed in the 7th digit).
torch.set_num_threads(1)
_warm_up_imports()


@pytest.fixture
def dist_run():
    """``dist_run(fn, world_size=W)``: run ``fn`` on W forked gloo ranks, results in rank order."""
    return run_distributed


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_process_group():
    """A single-process gloo group for the test (a sharded parameter is a DTensor, which needs a process
    group even for one rank), destroyed afterwards so later tests start without one."""
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()
