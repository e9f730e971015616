"""HSDP of the dense part together with expert parallelism (4 ranks: replicate 2 x shard 2; also 2 x 1).

The dense part is sharded over a 2-D ``(replicate, shard)`` mesh; the experts are split whole over
an EP group (``expert_parallel``) and each local slice FSDP-sharded over the ranks holding the same
experts (their own root). The reference nobody here wrote: the same network in one process on the
global batch with ``torch.optim.AdamW``; each rank trains on its quarter of the batch. Also: Muon on
the experts and the dense matrices steps with no collective, ``clip_grad_norm_`` counts every element
once (torch's norm on the single-process model), and a checkpoint saved under HSDP + EP loads at
plain FSDP + EP and the reverse, bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon
from fsdp_optim.testing import count_collectives
from fsdp_optim.sharding import expert_parallel, expert_parallel_groups
from tests.sharding.test_expert_parallel_fsdp import LR, ROWS, STEPS, _batch, _Net, _reference

WORLD = 4
MESH = (2, 2)


def _shard(model: _Net, ep: int, *, hsdp: bool = True, blocks=None, mesh_shape=MESH) -> None:
    groups = expert_parallel_groups(ep)
    expert_parallel(model.experts, group=groups.ep)
    fsdp_optim.fully_shard(model.experts, mesh=groups.replicas, blocks=blocks)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if hsdp else None
    fsdp_optim.fully_shard(model, mesh=mesh, blocks=blocks)


def _quarter(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch (a quarter at W = 4)."""
    x, y = _batch(step)
    world, rank = dist.get_world_size(), dist.get_rank()
    n = ROWS // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _train(model, opt, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = _quarter(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


# Measured (torch 2.13 CPU, 2026-12-06; pytest -s prints it): max |diff| of the parameters after 3
# AdamW steps at lr 1e-2 at most 3.0e-7 over every (mesh, ep, E) below, losses within 9.0e-8 relative
# (the gradient reductions' order). Tolerance as test_expert_parallel_fsdp's: rtol 1e-5, atol 1e-6.
# AdamW hardly sees a wrong gradient scale (a wrong divide factor): the clipping test below does.
@pytest.mark.parametrize("num_experts", [8, 6])
@pytest.mark.parametrize(("mesh_shape", "ep"), [((2, 2), 1), ((2, 2), 2), ((2, 2), 4), ((2, 1), 2)])
def test_hsdp_with_expert_parallel_trains_as_one_process(mesh_shape, ep, num_experts):
    reference, ref_losses = _reference(num_experts)

    def fn():
        model = _Net(num_experts)
        _shard(model, ep, mesh_shape=mesh_shape)
        dense = model.inp.weight
        assert tuple(dense.device_mesh.shape) == mesh_shape  # the dense part is HSDP
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = _train(model, opt, range(STEPS))
        return fsdp_optim.full_state_dict(model), losses

    ranks = run_distributed(fn, world_size=mesh_shape[0] * mesh_shape[1])
    for params, losses in ranks[1:]:  # every rank (both replicas) ends with the same model
        assert losses == ranks[0][1]
        assert all(torch.equal(params[k], v) for k, v in ranks[0][0].items())
    params, losses = ranks[0]
    assert set(params) == set(reference)
    worst = max((params[k] - v).abs().max().item() for k, v in reference.items())
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    print(f"HSDP {mesh_shape} + ep={ep}, E={num_experts}: max |param diff| {worst:.1e}, loss rel. diff {loss_diff:.1e}")
    for k, v in reference.items():
        torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=k)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def test_hsdp_with_expert_parallel_muon_step_is_collective_free_and_clips_like_torch():
    """E = 8 over ep = 2: 4 local experts over the 2 ranks holding them, whole (with E = 6 the planner
    splits one of 3 local experts on rows, and Muon does its one exchange pair, with or without HSDP)."""
    ref = _Net(8)
    x, y = _batch(0)
    F.mse_loss(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)

    def fn():
        model = _Net(8)
        _shard(model, 2, blocks=Muon.blocks)
        opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=LR)
        xq, yq = _quarter(0)
        F.mse_loss(model(xq), yq).backward()
        total = fsdp_optim.clip_grad_norm_(model.parameters(), 1e-3)
        with count_collectives() as seen:
            opt.step()
        return total, seen.total

    for total, num_collectives in run_distributed(fn, world_size=WORLD):
        torch.testing.assert_close(total, want, rtol=1e-5, atol=0)
        assert num_collectives == 0


@pytest.mark.parametrize("save_hsdp", [True, False], ids=["hsdp_to_fsdp", "fsdp_to_hsdp"])
def test_checkpoints_move_between_hsdp_and_fsdp_with_expert_parallel(tmp_path, save_hsdp):
    """Two Muon steps, saved under one mesh, loaded under the other: the loaded model is the saved one
    bitwise, and the next step matches the uninterrupted run to the reductions' rounding."""
    path = str(tmp_path / "ck")

    def run(*, hsdp: bool, load: bool, save: bool, steps: range):
        def fn():
            model = _Net(6)
            _shard(model, 2, hsdp=hsdp, blocks=Muon.blocks)
            opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=LR)
            if load:
                fsdp_optim.load_checkpoint(path, model=model, optimizer=opt)
            loaded = fsdp_optim.full_state_dict(model)
            _train(model, opt, steps)
            if save:
                fsdp_optim.save_checkpoint(path, model=model, optimizer=opt)
            return loaded, fsdp_optim.full_state_dict(model)

        return run_distributed(fn, world_size=WORLD)

    straight = run(hsdp=save_hsdp, load=False, save=False, steps=range(3))[0][1]
    saved = run(hsdp=save_hsdp, load=False, save=True, steps=range(2))[0][1]
    for loaded, after in run(hsdp=not save_hsdp, load=True, save=False, steps=range(2, 3)):
        assert set(loaded) == set(saved)
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())
        for k, v in straight.items():
            torch.testing.assert_close(after[k], v, rtol=1e-4, atol=1e-5, msg=k)
