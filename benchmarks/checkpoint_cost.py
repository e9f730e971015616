"""Checkpoint cost: checksum throughput on this machine, and save / load wall time of the recipe's
`tiny` Llama with Muon at W=2 (gloo), median of 7 (what the integrity checks add is the difference
from a run of the code before them).

    python benchmarks/checkpoint_cost.py
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
from config import load_config  # noqa: E402
from model import build_model  # noqa: E402

import fsdp_optim  # noqa: E402
from fsdp_optim._testing import run_distributed  # noqa: E402
from fsdp_optim.optimizers import Muon  # noqa: E402


def _throughput() -> dict[str, float]:
    data = os.urandom(256 << 20)
    out = {}
    for name, fn in (("crc32", zlib.crc32), ("blake2b", lambda d: hashlib.blake2b(d).digest()),
                     ("sha256", lambda d: hashlib.sha256(d).digest())):
        t = time.perf_counter()
        fn(data)
        out[f"{name}_MBps"] = 256 * 2**20 / 1e6 / (time.perf_counter() - t)
    return out


def _save_load():
    cfg = load_config(ROOT / "recipes" / "configs" / "tiny.toml", ["model.vocab_size=512"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    for layer in model.layers:
        fsdp_optim.fully_shard(layer, blocks=Muon.blocks)
    fsdp_optim.fully_shard(model, blocks=Muon.blocks)
    opt = Muon(model.parameters(), lr=0.02)
    model(torch.zeros(2, 16, dtype=torch.long)).sum().backward()
    opt.step()
    obj = [tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(obj)
    saves, loads = [], []
    for i in range(7):
        path = f"{obj[0]}/c{i}"
        torch.distributed.barrier()
        t = time.perf_counter()
        fsdp_optim.save_checkpoint(path, model=model, optimizer=opt)
        saves.append(time.perf_counter() - t)
        torch.distributed.barrier()
        t = time.perf_counter()
        fsdp_optim.load_checkpoint(path, model=model, optimizer=opt)
        loads.append(time.perf_counter() - t)
    size = sum(os.path.getsize(f"{obj[0]}/c0/{f}") for f in os.listdir(f"{obj[0]}/c0"))
    return dict(save_s=statistics.median(saves), load_s=statistics.median(loads), checkpoint_bytes=size)


if __name__ == "__main__":
    row = {**_throughput(), **run_distributed(_save_load, world_size=2)[0]}
    print(json.dumps(row, indent=1))
