"""One-GPU check of the fully_shard runtime (streams on), for the day a GPU is lent (< 2 minutes).

On one CUDA device, an NCCL process group of one rank (the same code path as W ranks: side streams,
async collectives, record_stream):

- a recipe-sized training step of ``tests/_models.TinyTransformer`` (bf16 compute, fp32 reduction),
  ours and PyTorch FSDP2 from the same weights: first-step losses side by side;
- overlap: in a CUDA profiler trace of our step, the kernels issued under ``fsdp_optim::all_gather``
  ranges run on a stream other than the compute kernels', and whether any of them overlaps a compute
  kernel in time (the gather of bucket i+1 during bucket i's compute);
- peak CUDA memory of one step (``torch.cuda.max_memory_allocated``), ours vs FSDP2.

At W = 1 an all-gather is a copy, so overlap can be small; what this proves is that the stream code
runs and orders correctly on a real device. Writes ``benchmarks/results/gpu_runtime_check.json``.

    python benchmarks/gpu_runtime_check.py        # needs CUDA; exits 2 with a message without it
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fsdp_optim  # noqa: E402
from tests._models import TinyConfig, TinyTransformer, make_batch  # noqa: E402

_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def overlapping(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> int:
    """How many intervals of ``a`` overlap some interval of ``b`` (pure; ``(start, end)`` pairs)."""
    b = sorted(b)
    count = 0
    for s, e in a:
        if any(bs < e and s < be for bs, be in b):
            count += 1
    return count


def _kernels_under(prof, prefix: str) -> tuple[list, list]:
    """(kernels launched inside ranges named ``prefix...``, all other kernels) as FunctionEvents."""
    events = prof.events()
    ranges = [e for e in events if e.name.startswith(prefix)]
    inside, outside = [], []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        launch = e.time_range.start
        (inside if any(r.time_range.start <= launch <= r.time_range.end for r in ranges) else outside).append(e)
    return inside, outside


def _step(model, opt, x, y) -> float:
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_runtime_check: no CUDA device; this check needs one GPU (nothing was run)", file=sys.stderr)
        return 2
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        cfg = TinyConfig(vocab_size=8192, dim=512, num_heads=8, num_layers=6, mlp_dim=2048, tie_embeddings=False)
        torch.manual_seed(0)
        full = {k: v.cuda() for k, v in TinyTransformer(cfg).state_dict().items()}
        x, y = (t.cuda() for t in make_batch(batch_size=8, seq_len=256, vocab_size=cfg.vocab_size, seed=0))
        out = {"device": torch.cuda.get_device_name(0)}
        for runtime in ("fsdp_optim", "fsdp2"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            with torch.device("cuda"):
                model = TinyTransformer(cfg)
            model.load_state_dict(full)
            if runtime == "fsdp_optim":
                mp = fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for layer in model.layers:
                    fsdp_optim.fully_shard(layer, mp_policy=mp)
                fsdp_optim.fully_shard(model, mp_policy=mp)
            else:
                mp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for layer in model.layers:
                    fsdp2_fully_shard(layer, mp_policy=mp)
                fsdp2_fully_shard(model, mp_policy=mp)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            first = _step(model, opt, x, y)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                _step(model, opt, x, y)
                torch.cuda.synchronize()
            row = {"first_loss": first, "peak_cuda_bytes": torch.cuda.max_memory_allocated()}
            if runtime == "fsdp_optim":
                gathers, compute = _kernels_under(prof, "fsdp_optim::all_gather(")
                row["gather_kernels"] = len(gathers)
                row["gather_streams"] = sorted({getattr(e, "stream", -1) for e in gathers})
                row["compute_streams"] = sorted({getattr(e, "stream", -1) for e in compute})[:8]
                row["gathers_overlapping_compute"] = overlapping(
                    [(e.time_range.start, e.time_range.end) for e in gathers],
                    [(e.time_range.start, e.time_range.end) for e in compute],
                )
            out[runtime] = row
            del model, opt
        out["loss_diff"] = abs(out["fsdp_optim"]["first_loss"] - out["fsdp2"]["first_loss"])
        out["peak_ratio_ours_over_fsdp2"] = out["fsdp_optim"]["peak_cuda_bytes"] / out["fsdp2"]["peak_cuda_bytes"]
        dist.destroy_process_group()
    print(json.dumps(out, indent=1))
    os.makedirs(_RESULTS, exist_ok=True)
    with open(os.path.join(_RESULTS, "gpu_runtime_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
