"""fsdp_optim.fully_shard + torch.optim.AdamW vs PyTorch FSDP2 + torch.optim.AdamW, side by side.

One launch, W ranks (default 2; gloo on CPU, forked here, or under ``torchrun``), the same model
(tests/_models.TinyTransformer at a larger size, untied, fp32), the same weights and the same data.
The two runtimes alternate step by step (the order flips every step), each with its own model and
optimizer, both with ``reshard_after_forward=True`` and per-layer buckets plus the root.

Measured per rank, reported as the max over ranks (the slowest rank sets the pace):
- step time: forward+backward and optimizer step (+ zero_grad) separately, median after warm-up;
- memory: bytes of live CPU tensors, from the PyTorch profiler's allocation trace
  (``profile_memory=True``: every allocation and free of the CPU allocator, summed in order).
  After the timed steps, each runtime in turn is built again from scratch inside one profiler
  window that also covers two training steps (the profiler sees no free of a block allocated
  before its window, so the window must start before the runtime allocates anything).
  ``persistent``: live bytes after setup (build, shard, load weights, optimizer, one step to create
  its state, ``zero_grad(set_to_none=True)``, GC): parameters, optimizer state, runtime buffers.
  ``peak``: the highest live bytes during the second step (activations, gathered parameters,
  unsharded gradients, reduction buffers included). The input batch and the full weights both
  runtimes copy from were allocated before the window and are in neither figure. Seen on gloo:
  in either runtime a rank sometimes counts one root-bucket-sized buffer (24 MiB at the default
  size) more, which no other rank or run shows; so the figures are printed per rank, and both the
  max and the min over ranks are compared. The cause: the profiler records no free made on another
  thread, and gloo's worker threads often drop a finished collective's buffers. ``step_memory.py``
  measures peak RSS instead and is the memory comparison to quote.

Usage: ``python benchmarks/bench_fsdp_adamw.py [--world-size 2] [--steps 10] ...``; prints the
figures and ratios (ours / FSDP2) and writes benchmarks/results/bench_fsdp_adamw.json (a run with any
flag changed: runs/bench-quick/bench_fsdp_adamw.json; ``--out DIR`` chooses the folder).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import fsdp_optim  # noqa: E402
from tests._models import TinyConfig, TinyTransformer, make_batch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _out import out_dir  # noqa: E402


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/ for the full run, "
                    "runs/bench-quick/ when any flag is changed)")
    args = ap.parse_args(argv)
    args.out_file = str(out_dir(ap, args, keep=("out_file",)) / "bench_fsdp_adamw.json")
    return args


def _cfg(a) -> TinyConfig:
    return TinyConfig(
        vocab_size=a.vocab, dim=a.dim, num_heads=a.heads, num_layers=a.layers, mlp_dim=a.mlp,
        tie_embeddings=False, frozen=False,
    )


class _MemTrace:
    """Live CPU bytes from the profiler's allocation events (see the module docstring).
    ``mark()`` records a point; after exit ``live_at(i)`` is the live bytes at mark ``i`` and
    ``peak_between(i, j)`` the highest live bytes between marks ``i`` and ``j``."""

    def mark(self) -> None:
        # A tiny tagged allocation: its address is found in the trace afterwards.
        t = torch.empty(self._TAG_NUMEL + len(self._marks))
        self._marks.append(t.data_ptr())
        self._keep.append(t)

    _TAG_NUMEL = 7919

    def __enter__(self):
        self._marks: list[int] = []
        self._keep: list[torch.Tensor] = []
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            self._prof.export_chrome_trace(f.name)
            with open(f.name) as fh:
                trace = json.load(fh)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        mem = sorted(
            (e["ts"], e["args"].get("Ev Idx", 0), e["args"]["Bytes"], e["args"].get("Addr"))
            for e in events
            if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0
        )
        live = peak = 0
        self._curve, self._mark_pos = [], []
        marks = list(self._marks)
        for _, _, b, addr in mem:
            live += b
            peak = max(peak, live)
            self._curve.append(live)
            if marks and addr == marks[0] and b == (self._TAG_NUMEL + len(self._mark_pos)) * 4:
                self._mark_pos.append(len(self._curve) - 1)
                marks.pop(0)
        assert not marks, "a mark was not found in the profiler trace"
        self.end, self.peak = live, peak
        self._keep = []
        return False

    def live_at(self, i: int) -> int:
        return self._curve[self._mark_pos[i]]

    def peak_between(self, i: int, j: int) -> int:
        return max(self._curve[self._mark_pos[i] : self._mark_pos[j] + 1])


def _settle() -> None:
    """Let gloo's worker threads drop finished collectives (they hold their tensors until then;
    without this a rank may count one bucket-sized buffer more, in either runtime), then GC."""
    dist.barrier()
    time.sleep(0.2)
    gc.collect()


def _build_ours(cfg, full_sd, rank):
    model = TinyTransformer(cfg)
    for layer in model.layers:
        fsdp_optim.fully_shard(layer)
    fsdp_optim.fully_shard(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = full_sd[name]  # (a full tensor: each rank keeps its range)
    return model


def _build_fsdp2(cfg, full_sd, mesh):
    from torch.distributed.fsdp import fully_shard

    model = TinyTransformer(cfg)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            rank = mesh.get_local_rank()
            chunk = full_sd[name].chunk(mesh.size(), dim=0)
            if rank < len(chunk):
                local.copy_(chunk[rank][: local.shape[0]])
    return model


def _run(a):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(a.threads)
    w, r = dist.get_world_size(), dist.get_rank()
    cfg = _cfg(a)
    torch.manual_seed(0)
    full_sd = {k: v.detach().clone() for k, v in TinyTransformer(cfg).state_dict().items()}
    mesh = init_device_mesh("cpu", (w,))
    data = [make_batch(batch_size=a.batch * w, seq_len=a.seq, vocab_size=a.vocab, seed=s) for s in range(4)]
    data = [(x[r * a.batch : (r + 1) * a.batch], y[r * a.batch : (r + 1) * a.batch]) for x, y in data]

    def step(model, opt, i, times=None):
        x, y = data[i % len(data)]
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if times is not None:
            times["fwd_bwd"].append(t1 - t0)
            times["optim"].append(t2 - t1)
        return loss.item()

    runs = {}
    builders = {"fsdp_optim": lambda: _build_ours(cfg, full_sd, r), "fsdp2": lambda: _build_fsdp2(cfg, full_sd, mesh)}
    for name, build in builders.items():
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        runs[name] = {"model": model, "opt": opt, "first_loss": step(model, opt, 0)}
    times = {n: {"fwd_bwd": [], "optim": []} for n in runs}
    names = list(runs)
    for i in range(a.warmup + a.steps):
        order = names if i % 2 == 0 else names[::-1]
        for n in order:
            step(runs[n]["model"], runs[n]["opt"], i + 1, times[n] if i >= a.warmup else None)
    out = {}
    for n in names:
        out[n] = {
            "fwd_bwd_s": statistics.median(times[n]["fwd_bwd"]),
            "optim_s": statistics.median(times[n]["optim"]),
            "first_loss": runs[n]["first_loss"],
        }
    runs.clear()
    for n in names:  # memory: one runtime at a time, from scratch, inside one profiler window
        gc.collect()
        with _MemTrace() as mt:
            model = builders[n]()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            step(model, opt, 0)
            _settle()
            mt.mark()
            step(model, opt, 1)
            mt.mark()
            del model, opt
            gc.collect()
        out[n]["persistent_bytes"] = mt.live_at(0)
        out[n]["peak_bytes"] = mt.peak_between(0, 1)
    return out


def main(argv=None) -> None:
    a = _parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, _run(a))
        if dist.get_rank() != 0:
            return
        a.world_size = dist.get_world_size()
    else:
        from fsdp_optim._testing import run_distributed

        results = run_distributed(lambda: _run(a), world_size=a.world_size, timeout=3600)
    names = list(results[0])
    summary = {}
    for n in names:
        summary[n] = {k: max(res[n][k] for res in results) for k in results[0][n]}
        summary[n]["step_s"] = summary[n]["fwd_bwd_s"] + summary[n]["optim_s"]
    ours, peer = summary["fsdp_optim"], summary["fsdp2"]
    ratios = {k: ours[k] / peer[k] for k in ("fwd_bwd_s", "optim_s", "step_s", "persistent_bytes", "peak_bytes")}
    mem_min = {n: {k: min(res[n][k] for res in results) for k in ("persistent_bytes", "peak_bytes")} for n in names}
    ratios_min = {k: mem_min["fsdp_optim"][k] / mem_min["fsdp2"][k] for k in ("persistent_bytes", "peak_bytes")}
    n_params = sum(v.numel() for v in TinyTransformer(_cfg(a)).state_dict().values())
    print(f"model: {n_params / 1e6:.2f}M params, W={a.world_size}, {a.batch}x{a.seq} tokens per rank, "
          f"{a.steps} timed steps after {a.warmup} warm-up, alternating; max over ranks")
    print(f"{'':12s}{'fwd+bwd ms':>12s}{'optim ms':>10s}{'step ms':>10s}{'persist MB':>12s}{'peak MB':>10s}{'loss0':>10s}")
    for n in names:
        s = summary[n]
        print(f"{n:12s}{s['fwd_bwd_s'] * 1e3:12.1f}{s['optim_s'] * 1e3:10.1f}{s['step_s'] * 1e3:10.1f}"
              f"{s['persistent_bytes'] / 2**20:12.2f}{s['peak_bytes'] / 2**20:10.2f}{s['first_loss']:10.4f}")
    print("ratio ours/FSDP2: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print("memory per rank (MiB, persistent/peak): " + "; ".join(
        f"rank {r}: " + ", ".join(f"{n} {res[n]['persistent_bytes'] / 2**20:.2f}/{res[n]['peak_bytes'] / 2**20:.2f}" for n in names)
        for r, res in enumerate(results)))
    print("memory ratio ours/FSDP2, min over ranks: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios_min.items()))
    record = {
        "config": {k: v for k, v in vars(a).items() if k not in ("out", "out_file")},
        "num_params": n_params,
        "per_rank": results,
        "summary_max_over_ranks": summary,
        "ratio_ours_over_fsdp2": ratios,
        "memory_min_over_ranks": mem_min,
        "memory_ratio_min_over_ranks": ratios_min,
        "memory_measure": "live CPU tensor bytes from torch.profiler allocation events (profile_memory=True)",
        "torch": torch.__version__,
    }
    os.makedirs(os.path.dirname(a.out_file), exist_ok=True)
    with open(a.out_file, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {a.out_file}")


if __name__ == "__main__":
    main()
