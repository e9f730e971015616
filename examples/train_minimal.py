"""The smallest complete fsdp_optim training script: process group, device, model, fully_shard,
optimizer, loop, checkpoint. Run it with torchrun (CPU: gloo; GPU: NCCL, one process per GPU):

    torchrun --standalone --nproc_per_node=2 examples/train_minimal.py --out runs/minimal

A second run with the same --out resumes from its checkpoint (weights, optimizer, the data
generators), continuing exactly as an uninterrupted run; with --steps at or below the checkpoint's
step it trains nothing and leaves the checkpoint as it is.
"""

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp_optim
from fsdp_optim.optimizers import Muon


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/minimal")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    # 1. Process group and device: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK.
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # 2. Model: the same seed on every rank, so every rank builds the same weights.
    torch.manual_seed(0)
    model = Model().to(device)

    # 3. Shard: one bucket per layer, then the root (embedding, final norm, head), with the
    #    optimizer's block rule so every Muon matrix lands whole on one rank.
    for layer in model.layers:
        fsdp_optim.fully_shard(layer, blocks=Muon.blocks)
    fsdp_optim.fully_shard(model, blocks=Muon.blocks)

    # 4. Optimizer, built after sharding (each parameter is now a DTensor of its full shape, so the
    #    usual "decay matrices, p.ndim >= 2" grouping holds). Muon orthogonalizes the hidden matrices;
    #    the embedding, the head (recognised by module type and name: docs/muon.md) and the norms get
    #    its AdamW fallback.
    groups = fsdp_optim.param_groups(model, weight_decay=0.01)
    for g in groups:
        g["adamw_weight_decay"] = g["weight_decay"]
    optimizer = Muon(groups, lr=0.02, adamw_lr=3e-3)

    # 5. Data: each rank draws its own batches from its own generator. The task: predict the next
    #    byte of a repeating pattern.
    gen = torch.Generator().manual_seed(1000 + rank)

    # 6. Resume if a checkpoint exists (any world size can load the model and optimizer). ``extra``
    #    comes from rank 0, so it holds every rank's generator state (gathered at save time); at
    #    another world size the generators start afresh.
    ckpt = os.path.join(args.out, "checkpoint")
    start = 0
    if os.path.exists(ckpt):
        extra = fsdp_optim.load_checkpoint(ckpt, model=model, optimizer=optimizer)
        start = extra["step"]
        if len(extra.get("generators", [])) == world_size:
            gen.set_state(extra["generators"][rank])
        if rank == 0:
            print(f"resumed from {ckpt} at step {start}", flush=True)
    if start >= args.steps:  # nothing to train; keep the checkpoint (a save would record fewer steps)
        if rank == 0:
            print(f"{ckpt} is at step {start} >= --steps {args.steps}: nothing to train", flush=True)

    # 7. Loop: each rank trains on its own batch; gradients are averaged by the reduce-scatter.
    for step in range(start, args.steps):
        offset = torch.randint(0, 256, (8, 1), generator=gen)
        seq = (offset + torch.arange(33)) % 256
        x, y = seq[:, :-1].to(device), seq[:, 1:].to(device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        fsdp_optim.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # mean over ranks, for the log line
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)

    # 8. Checkpoint: every rank writes its own shards (no gather), plus the step and the generators.
    if args.steps > start:
        generators = [None] * world_size
        dist.all_gather_object(generators, gen.get_state())
        fsdp_optim.save_checkpoint(
            ckpt, model=model, optimizer=optimizer, extra={"step": args.steps, "generators": generators}
        )
        if rank == 0:
            print(f"saved {ckpt}", flush=True)

    # 9. Tear down: the sharded model and optimizer reference the process group (in reference
    #    cycles), so free them before destroying it; left to interpreter exit, the group's
    #    teardown can abort the process.
    del model, optimizer, groups
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13's gloo still aborts about 1 process in 6 at interpreter exit, after everything above
    # is done: with the outputs flushed, skip the interpreter's teardown and exit 0.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
