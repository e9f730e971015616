"""What the recipe reports: the metrics file, the progress bar (or a line per tenth of the run in a
redirected log), MFU and memory figures, the run's summary line and the loss plot."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

__all__ = ["MetricsLog", "current_rank", "memory_gb", "peak_tflops", "plot_loss", "read_metrics", "summary"]

# Peak dense bf16 TFLOP/s per device, for MFU (vendor datasheets: NVIDIA H100/H200 SXM 989, A100 312,
# B200 2250, L4 121; AMD MI300X 1307). CPU: 0.1 per rank, the order of one AVX2 core's FMA peak
# (2 FMA units x 8 fp32 lanes x 2 FLOPs x ~3 GHz), a nominal figure; set log.peak_tflops for yours.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0, "L4": 121.0, "MI300X": 1307.0}
CPU_PEAK_TFLOPS = 0.1


def current_rank() -> int:
    """This process's rank, before the process group exists too (torchrun's RANK; 0 without torchrun)."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def peak_tflops(configured: float, device: torch.device) -> float:
    """``log.peak_tflops``, else the device's datasheet figure (0: unknown GPU, no MFU)."""
    if configured:
        return configured
    if device.type == "cuda":
        return next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name(device)), 0.0)
    return CPU_PEAK_TFLOPS


def memory_gb(device: torch.device) -> float:
    """Peak memory: allocated on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: peak RSS in KiB


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a process killed mid-write) is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def summary(rec: dict, step: int) -> str:
    """``step S: loss L, held-out H`` rounded to 3 decimals (what the last line of a run says)."""
    text = f"step {step}"
    if "loss" in rec:
        text += f": loss {rec['loss']:.3f}"
    if rec.get("eval_loss") is not None:
        text += f", held-out {rec['eval_loss']:.3f}"
    return text


class MetricsLog:
    """Rank 0's view of the run: ``OUT/metrics.jsonl`` (one JSON object per logged step), a progress bar on
    a terminal, and in a redirected log (no terminal) a plain line at each tenth of the run and at each
    eval instead of carriage-return updates. Inactive (``active=False``) on the other ranks."""

    def __init__(self, path: Path, total: int, initial: int, *, active: bool):
        self.path, self.total, self.active = path, total, active
        self.on_terminal = sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, disable=not active or not self.on_terminal, dynamic_ncols=True,
                        desc="pretrain")

    def start(self, step: int, resumed: bool) -> None:
        """Keep the records up to ``step`` of a resumed run (dropping a killed run's tail); a fresh run
        starts a fresh file."""
        if self.active:
            old = read_metrics(self.path) if resumed else []
            self.path.write_text("".join(json.dumps(r) + "\n" for r in old if r["step"] <= step))

    def write(self, rec: dict) -> None:
        if not self.active:
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        self.bar.set_postfix(
            loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
            mfu=f"{100 * rec['mfu']:.1f}%" if rec["mfu"] is not None else "n/a", mem=f"{rec['mem_gb']:.2f}GB",
        )
        step = rec["step"]
        if not self.on_terminal and (step % max(1, self.total // 10) == 0 or "eval_loss" in rec):
            held_out = f", held-out {rec['eval_loss']:.3f}" if rec.get("eval_loss") is not None else ""
            print(f"[pretrain] step {step}/{self.total}: loss {rec['loss']:.3f}{held_out}, "
                  f"{rec['tokens_per_s']:,.0f} tokens/s", flush=True)

    def advance(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def plot_loss(records: list[dict], path: Path, title: str) -> None:
    """The train and held-out loss curves of ``records`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    ev = [r for r in records if r.get("eval_loss") is not None]
    ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
