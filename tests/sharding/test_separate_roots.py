"""A root sharded over another process group stays its own root under the enclosing call ([Note: separate
roots], the layout expert parallelism uses), and set_gradient_divide_factor replaces the average. Both
against single-process torch.optim.AdamW (the reference nobody here wrote)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_optim
from fsdp_optim.sharding.contract import local_shard
from fsdp_optim._testing import run_distributed
from tests._models import full

LR, STEPS = 1e-2, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 11), nn.Sequential(nn.Linear(11, 13), nn.Tanh()), nn.Linear(13, 5))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, 7, generator=torch.Generator().manual_seed(step))


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        model(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: full(v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_root_over_another_group_is_not_absorbed(world_size):
    # Every rank computes the whole batch (replicated data), so the middle module, sharded over a group of
    # one rank, needs no reduction across ranks: the run equals one process if (and only if) the enclosing
    # root leaves it alone (its own plan, hooks and group) and averages the rest over the world.
    reference = _reference()

    def fn():
        rank, world = dist.get_rank(), dist.get_world_size()
        alone = [dist.new_group([r]) for r in range(world)][rank]
        model = _model()
        fsdp_optim.fully_shard(model[1], mesh=alone)
        model[1]._fsdp_optim_state.separate_root = True  # (what expert_parallel's experts ask for)
        fsdp_optim.fully_shard(model)
        inner = local_shard(model[1][0].weight)
        outer = local_shard(model[0].weight)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(STEPS):
            model(_batch(step)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out = fsdp_optim.full_state_dict(model), inner.world_size, outer.world_size
        del model, opt
        return out

    for sd, inner_world, outer_world in run_distributed(fn, world_size=world_size):
        assert (inner_world, outer_world) == (1, world_size)
        for k, v in reference.items():
            torch.testing.assert_close(sd[k], v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_gradient_divide_factor(factor):
    # Gradients of the per-rank mean losses, summed over 2 ranks and divided by `factor`.
    def fn():
        model = _model()
        fsdp_optim.fully_shard(model)
        model.set_gradient_divide_factor(factor)
        x = _batch(dist.get_rank())
        model(x).square().mean().backward()
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        del model
        return grads

    ranks = run_distributed(fn, world_size=2)
    ref = _model()
    total = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(2):
        ref.zero_grad()
        ref(_batch(r)).square().mean().backward()
        for n, p in ref.named_parameters():
            total[n] += p.grad
    for r, grads in enumerate(ranks):
        for n, p in ref.named_parameters():
            info_range = grads[n]
            want = (total[n] / factor).reshape(-1)
            start = sum(g[n].numel() for g in ranks[:r])
            torch.testing.assert_close(info_range, want[start : start + info_range.numel()], rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("one_process_group")
def test_gradient_divide_factor_refuses_nonsense():
    model = _model()
    fsdp_optim.fully_shard(model)
    with pytest.raises(ValueError, match="factor must be a positive number"):
        model.set_gradient_divide_factor(0)
