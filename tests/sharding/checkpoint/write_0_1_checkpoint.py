"""Run by ``test_compat.py`` inside a checkout of main 63d901b (fsdp_optim 0.1: flat 1-D parameters with
a ShardInfo attribute): train a TinyTransformer 3 steps with Muon at W = 2, ``save_checkpoint`` it to
``OUT/checkpoint``, and write the full parameters at the save and after one more step to
``OUT/expected.pt``. Usage: ``cd <checkout> && PYTHONPATH=. python write_0_1_checkpoint.py OUT``."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
import fsdp_optim  # noqa: E402
from fsdp_optim._testing import run_distributed  # noqa: E402
from fsdp_optim.optimizers import Muon  # noqa: E402
from tests._models import TinyConfig, TinyTransformer, make_batch  # noqa: E402

if not os.path.abspath(fsdp_optim.__file__).startswith(os.getcwd() + os.sep):
    sys.exit(f"imported fsdp_optim from {fsdp_optim.__file__}, not the checkout in {os.getcwd()}")

OUT = sys.argv[1]
CFG = TinyConfig(vocab_size=61, dim=24, num_heads=2, num_layers=2, mlp_dim=40)


def body():
    torch.manual_seed(0)
    model = TinyTransformer(CFG)
    for layer in model.layers:
        fsdp_optim.fully_shard(layer, blocks=Muon.blocks)
    fsdp_optim.fully_shard(model, blocks=Muon.blocks)
    opt = Muon(fsdp_optim.param_groups(model, weight_decay=0.01), lr=0.02, adamw_lr=3e-3)
    w, r = dist.get_world_size(), dist.get_rank()

    def step(seed):
        x, y = make_batch(batch_size=4, seq_len=8, vocab_size=61, seed=seed)
        n = 4 // w
        loss = F.cross_entropy(model(x[r * n : (r + 1) * n]).flatten(0, 1), y[r * n : (r + 1) * n].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

    for s in range(3):
        step(s)
    fsdp_optim.save_checkpoint(os.path.join(OUT, "checkpoint"), model=model, optimizer=opt, extra={"step": 3})
    before = fsdp_optim.full_state_dict(model)
    step(3)
    after = fsdp_optim.full_state_dict(model)
    if r == 0:
        torch.save({"at_save": before, "after_next_step": after}, os.path.join(OUT, "expected.pt"))
    return True


run_distributed(body, world_size=2)
