import pytest
import torch

from fsdp_optim._testing import run_distributed


@pytest.fixture
def dist_run():
    """``dist_run(fn, world_size=W)``: run ``fn`` on W forked gloo ranks, results in rank order."""
    return run_distributed


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
