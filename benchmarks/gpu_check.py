"""Single-device optimizer throughput: ours vs torch.optim.Muon's and torchao's kernels.

- Newton–Schulz (5 quintic steps, bf16): ``fsdp_optim.optimizers._muon.newton_schulz`` vs
  ``torch.optim._muon._zeropower_via_newtonschulz`` on the same fp32 matrices; TFLOP/s counts
  ``5 * (4 m^2 n + 2 m^3)`` flops per call (m = min(rows, cols), n = max: ``X Xᵀ``, ``bA + cA²``,
  ``aX + BX``), and the max-abs difference of the two outputs (same ops: expected 0).
- 8-bit AdamW step on one flat parameter: our ``AdamW8bit`` (compiled step) vs
  ``torchao.optim.AdamW8bit``; GB/s counts the bytes a step must touch, 16 per element (fp32
  parameter read + write, fp32 gradient read, two uint8 moments read + write; block scales
  ignored), and the max-abs difference of the parameters after the timed steps.

Timing: ``--warmup`` untimed calls (compilation), then the median of ``--reps`` calls, each
bracketed by device synchronization. On a GPU the sizes are the real ones (4096x4096 and
8192x28672 matrices, 256M elements); without one (or with ``--tiny``) tiny sizes on the CPU, a
smoke run only. Writes ``benchmarks/results/gpu_check.json`` (``--out``).

    bash benchmarks/gpu_check.sh          # or: python benchmarks/gpu_check.py [--tiny] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fsdp_optim.optimizers import AdamW8bit  # noqa: E402
from fsdp_optim.optimizers._muon import DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, newton_schulz  # noqa: E402

_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(kw_only=True)
class CheckConfig:
    device: str = "cuda"
    ns_shapes: list[tuple[int, int]] = field(default_factory=lambda: [(4096, 4096), (8192, 28672)])
    adam_numel: int = 256 * 2**20
    warmup: int = 3
    reps: int = 10
    seed: int = 0


def tiny_config() -> CheckConfig:
    """CPU smoke sizes (seconds, not minutes)."""
    return CheckConfig(device="cpu", ns_shapes=[(128, 128), (128, 448)], adam_numel=2**18, warmup=1, reps=3)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], *, device: str, warmup: int, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ns_flops(rows: int, cols: int, steps: int = DEFAULT_NS_STEPS) -> float:
    m, n = min(rows, cols), max(rows, cols)
    return float(steps * (4 * m * m * n + 2 * m**3))


def check_newton_schulz(cfg: CheckConfig) -> list[dict]:
    from torch.optim._muon import _zeropower_via_newtonschulz

    out = []
    for rows, cols in cfg.ns_shapes:
        g = torch.randn(rows, cols, device=cfg.device, generator=torch.Generator(cfg.device).manual_seed(cfg.seed))
        sides = {
            "ours": lambda: newton_schulz(g),
            "torch.optim.Muon": lambda: _zeropower_via_newtonschulz(g, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, 1e-7),
        }
        row = {"shape": [rows, cols], "flops_per_call": ns_flops(rows, cols)}
        for name, fn in sides.items():
            s = time_fn(fn, device=cfg.device, warmup=cfg.warmup, reps=cfg.reps)
            row[name] = {"median_s": s, "tflops": row["flops_per_call"] / s / 1e12}
        row["max_abs_diff"] = (sides["ours"]().float() - sides["torch.optim.Muon"]().float()).abs().max().item()
        row["ours_over_torch_time"] = row["ours"]["median_s"] / row["torch.optim.Muon"]["median_s"]
        out.append(row)
        del g
    return out


def check_adamw8bit(cfg: CheckConfig) -> dict:
    from torchao.optim import AdamW8bit as TorchaoAdamW8bit

    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    gen = torch.Generator(cfg.device).manual_seed(cfg.seed)
    init = torch.randn(cfg.adam_numel, device=cfg.device, generator=gen)
    grad = torch.randn(cfg.adam_numel, device=cfg.device, generator=gen) * 1e-2
    result = {"numel": cfg.adam_numel, "bytes_per_step": 16 * cfg.adam_numel}
    finals = {}
    makers = {
        "ours": lambda p: AdamW8bit([p], **hp, compile=True),
        "torchao": lambda p: TorchaoAdamW8bit([p], **hp),
    }
    for name, make in makers.items():
        p = torch.nn.Parameter(init.clone())
        p.grad = grad
        opt = make(p)
        s = time_fn(opt.step, device=cfg.device, warmup=cfg.warmup, reps=cfg.reps)
        result[name] = {"median_s": s, "gb_per_s": result["bytes_per_step"] / s / 1e9}
        finals[name] = p.detach().clone()
        del opt, p
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
    result["max_abs_diff_after_steps"] = (finals["ours"] - finals["torchao"]).abs().max().item()
    result["ours_over_torchao_time"] = result["ours"]["median_s"] / result["torchao"]["median_s"]
    return result


def _write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke sizes even if a GPU is present")
    ap.add_argument("--out", default=os.path.join(_RESULTS, "gpu_check.json"))
    args = ap.parse_args(argv)
    cfg = CheckConfig() if torch.cuda.is_available() and not args.tiny else tiny_config()
    t0 = time.perf_counter()
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cfg.device == "cuda" else platform.processor() or platform.machine(),
        "cuda": torch.version.cuda,
        "smoke_run": cfg.device == "cpu",
        "dynamo_disabled": os.environ.get("TORCHDYNAMO_DISABLE") == "1",
    }
    print(f"gpu_check on {env['device']} ({'CPU smoke sizes' if env['smoke_run'] else 'full sizes'})", flush=True)
    ns = check_newton_schulz(cfg)
    for r in ns:
        print(
            f"newton_schulz {r['shape'][0]}x{r['shape'][1]}: ours {r['ours']['tflops']:.2f} TFLOP/s, "
            f"torch.optim.Muon {r['torch.optim.Muon']['tflops']:.2f} TFLOP/s, max|diff| {r['max_abs_diff']:.3g}",
            flush=True,
        )
    data = {
        "command": "bash benchmarks/gpu_check.sh" + (" --tiny" if args.tiny else ""),
        "config": asdict(cfg),
        "env": env,
        "newton_schulz": ns,
        "adamw8bit": None,
    }
    _write(args.out, data)  # a partial result survives if the 8-bit part runs past the time limit
    adam = check_adamw8bit(cfg)
    print(
        f"AdamW8bit {adam['numel']:,} elements: ours {adam['ours']['gb_per_s']:.1f} GB/s, "
        f"torchao {adam['torchao']['gb_per_s']:.1f} GB/s, max|diff| {adam['max_abs_diff_after_steps']:.3g}",
        flush=True,
    )
    data.update(adamw8bit=adam, seconds=time.perf_counter() - t0)
    _write(args.out, data)
    print(f"wrote {args.out} in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
