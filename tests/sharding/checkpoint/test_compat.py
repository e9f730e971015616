"""Checkpoints written before sharded parameters became DTensors still load.

The old checkpoint is written at test time by the old code itself: ``git archive`` of main 63d901b
(fsdp_optim 0.1: flat 1-D parameters with a ShardInfo attribute) from this clone's history, then
``write_0_1_checkpoint.py`` run in it: a TinyTransformer trained 3 steps with Muon at W = 2, saved with
``save_checkpoint``, and the full parameters at the save and after one more step. Loaded here at W = 2
and 3, the parameters equal the saved ones bitwise, and the next step at W = 2 equals the old code's
next step bitwise (the optimizer state loaded too; at W = 3 the gradients' reduction order differs:
within the tolerance of the training-parity tests). A clone without that commit (a shallow one) skips,
saying so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon
from tests._models import TinyConfig, TinyTransformer, make_batch

OLD = "63d901b08aff60c642e5232a820584b49a738953"  # main before the DTensor parameters (fsdp_optim 0.1)
ROOT = Path(__file__).resolve().parents[3]
CFG = TinyConfig(vocab_size=61, dim=24, num_heads=2, num_layers=2, mlp_dim=40)


@pytest.fixture(scope="module")
def old_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint and its expected figures, written by the code of ``OLD`` (checked out from git)."""
    git = shutil.which("git")
    if git is None or subprocess.run([git, "-C", str(ROOT), "cat-file", "-e", f"{OLD}^{{commit}}"],
                                     capture_output=True).returncode:  # fmt: skip
        pytest.skip(f"commit {OLD[:7]} is not in this clone's history (a shallow clone?): no 0.1 code to write "
                    "the old checkpoint with; `git fetch --unshallow` to run this test")
    src, out = tmp_path_factory.mktemp("fsdp_optim_0_1"), tmp_path_factory.mktemp("checkpoint_0_1")
    archive = subprocess.run([git, "-C", str(ROOT), "archive", OLD, "fsdp_optim", "tests/__init__.py", "tests/_models.py"],
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    script = Path(__file__).with_name("write_0_1_checkpoint.py")
    env = {**os.environ, "PYTHONPATH": str(src)}
    run = subprocess.run([sys.executable, str(script), str(out)], cwd=src, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, f"the 0.1 code failed to write its checkpoint:\n{run.stdout}\n{run.stderr}"
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_checkpoint_written_by_main_63d901b_loads_and_continues(tmp_path, world_size, old_checkpoint):
    ck = str(tmp_path / "checkpoint")
    shutil.copytree(old_checkpoint / "checkpoint", ck)
    expected = torch.load(old_checkpoint / "expected.pt", weights_only=True)

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
