"""Checkpoints written before sharded parameters became DTensors still load.

``tests/data/checkpoint_63d901b`` was written by fsdp_optim at main 63d901b (flat 1-D parameters
with a ShardInfo attribute; ``make.py`` beside it, run in a checkout of that commit, made it): a
TinyTransformer trained 3 steps with Muon at W = 2, saved with ``save_checkpoint``, and the full
parameters at the save and after one more step (``expected.pt``). Loaded here at W = 2 and 3, the
parameters equal the saved ones bitwise, and the next step at W = 2 equals the old code's next step
bitwise (the optimizer state loaded too; at W = 3 the gradients' reduction order differs: within
the tolerance of the training-parity tests)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon
from tests._models import TinyConfig, TinyTransformer, make_batch

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "checkpoint_63d901b")
CFG = TinyConfig(vocab_size=61, dim=24, num_heads=2, num_layers=2, mlp_dim=40)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_checkpoint_written_by_main_63d901b_loads_and_continues(tmp_path, world_size):
    ck = str(tmp_path / "checkpoint")
    shutil.copytree(os.path.join(DATA, "checkpoint"), ck)
    expected = torch.load(os.path.join(DATA, "expected.pt"), weights_only=True)

    def fn():
        torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
        model = TinyTransformer(CFG)
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, blocks=Muon.blocks)
        fsdp_optim.fully_shard(model, blocks=Muon.blocks)
        opt = Muon(fsdp_optim.param_groups(model, weight_decay=0.01), lr=0.02, adamw_lr=3e-3)
        extra = fsdp_optim.load_checkpoint(ck, model=model, optimizer=opt)
        at_load = fsdp_optim.full_state_dict(model)
        w, r = dist.get_world_size(), dist.get_rank()
        x, y = make_batch(batch_size=12, seq_len=8, vocab_size=61, seed=3)
        if w == 2:  # the old run's batch: 4 rows, 2 per rank
            x, y = x[:4], y[:4]
        n = x.shape[0] // w
        loss = F.cross_entropy(model(x[r * n : (r + 1) * n]).flatten(0, 1), y[r * n : (r + 1) * n].flatten())
        loss.backward()
        opt.step()
        return extra, at_load, fsdp_optim.full_state_dict(model)

    for extra, at_load, after in run_distributed(fn, world_size=world_size):
        assert extra == {"step": 3}
        assert at_load.keys() == expected["at_save"].keys()
        for k, v in expected["at_save"].items():
            assert torch.equal(at_load[k], v), k
        if world_size == 2:
            for k, v in expected["after_next_step"].items():
                assert torch.equal(after[k], v), k
