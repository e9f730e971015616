"""Written by fsdp_optim at main 63d901b (flat parameters): a checkpoint and what the next step gives."""
import os, sys, torch, torch.distributed as dist, torch.nn.functional as F
sys.path.insert(0, os.getcwd())
import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon
from tests._models import TinyConfig, TinyTransformer, make_batch

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
        loss = F.cross_entropy(model(x[r*n:(r+1)*n]).flatten(0, 1), y[r*n:(r+1)*n].flatten())
        loss.backward(); opt.step(); opt.zero_grad()
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
