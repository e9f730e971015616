import pytest
import torch

from fsdp_optim._testing import run_distributed


def _warm_up_imports() -> None:
    """Run one optimizer step in the parent so forked ranks inherit the ~200 modules it imports
    lazily (about 10 s per forked group otherwise)."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    torch.optim.AdamW([p]).step()


_warm_up_imports()


@pytest.fixture
def dist_run():
    """``dist_run(fn, world_size=W)``: run ``fn`` on W forked gloo ranks, results in rank order."""
    return run_distributed


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
