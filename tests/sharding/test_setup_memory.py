"""Setup never holds the whole model: peak live tensor bytes during fully_shard calls is about one
shard plus a few buckets, for meta- and CPU-built models and nested calls (counted with
``fsdp_optim._testing.LiveBytes``, a dispatch-mode counter of live storages, not RSS).

On the main branch before issue 12, the root call gathered every absorbed bucket to full tensors at
once, so the peak was above the whole model on every rank whatever W.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_optim
from fsdp_optim._testing import LiveBytes, run_distributed

NUM_LAYERS, DIM = 12, 96  # 12 buckets of 96 x 97 fp32 elements (dims that divide nothing at W=3)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM, bias=False)
        self.groups = nn.ModuleList(nn.ModuleList(_Block() for _ in range(NUM_LAYERS // 3)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for g in self.groups:
            for b in g:
                x = b(x)
        return x


def _model(device: str) -> _Stack:
    torch.manual_seed(0)
    with torch.device(device):
        return _Stack()


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("nesting", ["layers_then_root", "layers_then_groups_then_root"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_setup_peak_is_one_shard_plus_a_few_buckets(device, nesting, world_size):
    model_bytes = (DIM * DIM + NUM_LAYERS * (DIM * DIM + DIM)) * 4
    bucket_bytes = (DIM * DIM + DIM) * 4

    def fn():
        model = _model(device)
        with LiveBytes() as m:
            for g in model.groups:
                for b in g:
                    fsdp_optim.fully_shard(b)
                if nesting == "layers_then_groups_then_root":
                    fsdp_optim.fully_shard(g)
            fsdp_optim.fully_shard(model)
        shard = sum(p.numel() * p.element_size() for p in model.parameters())
        if device == "meta":
            fsdp_optim.init_weights(model)
        out = model(torch.ones(2, DIM)).sum()  # it trains: the setup left a working model
        out.backward()
        return m.peak, m.current, shard

    for peak, current, shard in run_distributed(fn, world_size=world_size):
        assert shard <= model_bytes / world_size + 2 * bucket_bytes
        # One shard (the new segments) plus the absorbed bucket being moved, its send and receive
        # buffers and the new bucket's gathered buffer (allocated once, then freed).
        assert peak <= shard + 4 * bucket_bytes, (peak, shard, model_bytes)
        assert peak < model_bytes  # never the whole model
        assert current <= shard + bucket_bytes  # what stays after setup: the shard


def test_absorbed_values_are_moved_exactly():
    """CPU-built: the values after the root call equal the unsharded model's, bitwise, at W=3
    (pieces moved rank to rank from the inner calls' plans into the root's)."""

    def fn():
        model = _model("cpu")
        want = {k: v.clone() for k, v in model.state_dict().items()}
        for g in model.groups:
            for b in g:
                fsdp_optim.fully_shard(b)
            fsdp_optim.fully_shard(g)
        fsdp_optim.fully_shard(model)
        got = fsdp_optim.full_state_dict(model)
        return all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()

    assert run_distributed(fn, world_size=3) == [True] * 3
