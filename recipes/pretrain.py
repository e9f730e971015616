"""Pretrain a Llama-style (or MoE, or Hugging Face) language model with FSDP sharding.

    torchrun --nproc_per_node=2 recipes/pretrain.py --config recipes/configs/tiny.toml --out runs/tiny
    torchrun --nproc_per_node=2 recipes/pretrain.py --config recipes/configs/tiny.toml --out runs/tiny --resume
    torchrun ... --optimizer muon --steps 50 --set model.dim=128 --set train.batch_size=4

    python recipes/pretrain.py --config recipes/configs/tiny.toml --out runs/tiny --check 2   # validate only

Writes OUT/metrics.jsonl (one JSON object per logged step), OUT/loss.png, OUT/config.json and
OUT/checkpoints/step_NNNNNN/. Run without torchrun, the script checks the config, data and model
and prints the torchrun command to use. A finished run in OUT is reported (exit 0), not retrained
(with --export-hf, its last checkpoint is exported). ``--set section.key=value`` overrides any config
key (see config.py).
The script reads top to bottom: config, process group, data, model, sharding, optimizer, resume,
the training loop (with eval, metrics and checkpoints), and the loss plot. What is not the training
story lives in the recipe's modules beside it: ``_checks`` (flags, config and every start-up check),
``_backend`` (fsdp_optim or PyTorch FSDP2: sharding, optimizer, clipping, QK-clip, checkpoint format,
one table), ``_checkpointing`` (the run folder and its checkpoints), ``_logging`` (metrics, progress,
the loss plot); ``config``, ``data`` and ``model`` as before.
"""

# ruff: noqa: E402
from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

# The recipes' own requirements, beyond the library's (pyproject.toml's [recipes] extra): one line if one
# is missing, before the imports below need them (hence the file-wide E402 above).
_MISSING = [m for m in ("einops", "tqdm", "matplotlib") if importlib.util.find_spec(m) is None]
if _MISSING:
    print(f"error: the recipes need {', '.join(_MISSING)} (not requirements of the fsdp_optim library): "
          "pip install -e '.[recipes]'", file=sys.stderr)
    sys.exit(2)

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_optim
# The recipe's modules sit next to this file and are imported by name (as nanoGPT's train.py imports
# model.py): Python puts a script's folder first on sys.path (python/torchrun recipes/pretrain.py).
from _backend import BACKENDS, build_optimizer, describe_optimizer, pick_backend
from _checkpointing import (
    check_resume_config, check_resume_data, check_unfinished, data_identity, finished_run, latest_checkpoint,
    resume_from, save_checkpoint, write_atomic,
)
from _checks import check_model, check_parallel, check_seq_len, load_data, parse_args, preflight, resolve_config
from _tensor_parallel import data_parallel_rank, local, loss_context
from _logging import MetricsLog, current_rank, memory_gb, peak_tflops, plot_loss, read_metrics, summary
from config import to_dict
from data import Sampler, val_batches
from model import attention_layers, build_model, hf_convert, num_params, set_logit_recording


def main(argv: list[str] | None = None) -> dict:
    """Train (under torchrun); ``{"records", "backend", "resumed_from", "finished"}`` for the tests."""
    t_start = time.perf_counter()
    args = parse_args(argv, __doc__)
    cfg = resolve_config(args)
    out = Path(args.out)
    PROGRESS.update(out=out, step=None)
    report = finished_run(out, cfg)
    if report is not None:  # the --set overrides must hold even when nothing is trained
        world_env = int(os.environ.get("WORLD_SIZE", 1))
        check_parallel(cfg, world_env)
        load_data(cfg, world_env // cfg.parallel.tp)
        check_parallel(cfg, world_env)
        check_model(cfg)
        if current_rank() == 0:
            print(report, flush=True)
        if args.export_hf is None:  # rerunning a finished job: train nothing (every rank alike)
            return {"records": read_metrics(out / "metrics.jsonl"), "backend": pick_backend(cfg), "resumed_from": None,
                    "finished": True}
    finished = report is not None  # and --export-hf: load its last checkpoint, export it, train nothing

    # ---- process group and device ----
    use_cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if cfg.train.dtype == "auto":
        dtype = torch.bfloat16 if use_cuda and torch.cuda.is_bf16_supported() else torch.float32
    else:
        dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
    backend = BACKENDS[pick_backend(cfg)]  # fsdp_optim, or PyTorch FSDP2 (see _backend)
    master = rank == 0

    # ---- data: every rank tokenizes the same stream; each data-parallel rank takes its own windows ----
    # (parallel.tp > 1: the tp ranks of a TP group are one data-parallel rank and read the same batch)
    check_parallel(cfg, world)
    dp_rank, dp_world = data_parallel_rank(rank, world, cfg.parallel.tp)
    tokenizer, tokens, windows = load_data(cfg, dp_world)
    check_parallel(cfg, world)  # (again, now that model.vocab_size is known)
    if not finished:  # (on every rank: all raise alike, before any collective)
        check_unfinished(out, cfg, args.resume)
    if latest_checkpoint(out) is not None:
        check_resume_config(out, cfg)
        check_resume_data(out, tokens)
    sampler = Sampler(windows, cfg.train.batch_size, dp_rank, dp_world, cfg.train.seed)

    # ---- model: built whole (same seed on every rank) or on meta, then sharded per layer ----
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta" if cfg.model.meta_init else device):
        model = build_model(cfg.model)
    check_seq_len(cfg, model)
    n_params, n_flop_params = num_params(model), num_params(model, exclude_embedding=True)
    backend.shard(model, cfg.optim.name, dtype, cfg.train.fp8_all_gather, cfg.optim.max_preconditioner_dim,
                  cfg.parallel.ep, cfg.parallel.tp)
    if cfg.model.meta_init:  # initialize at full shape, one bucket at a time, keeping this rank's piece
        torch.manual_seed(cfg.train.seed)
        backend.init_sharded(model, device)
    if args.init_from_hf is not None and latest_checkpoint(out) is None:  # (a resume loads its checkpoint)
        fsdp_optim.load_hf(model, args.init_from_hf, convert=hf_convert(model, cfg.model, tokenizer)[1])
    attention = attention_layers(model)  # where max_attn_logit is measured and QK-clip applies

    # ---- optimizer and LR schedule: linear warmup, cosine to min_lr_ratio ----
    optimizer = build_optimizer(model, cfg, backend.name)
    t = cfg.train

    def lr_factor(step: int) -> float:  # ``step`` optimizer steps done so far
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    # ---- resume: the model, optimizer, schedule, data position and token count of the latest checkpoint ----
    step, tokens_seen = 0, 0
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * cfg.train.grad_accum * dp_world
    if master:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        extra = resume_from(ckpt, model, optimizer, scheduler, backend)
        step = int(extra["step"])
        sampler.load_state_dict(extra["data"])  # a position in windows: right at any batch size and world size
        tokens_seen = int(extra.get("tokens", step * tokens_per_step))  # (older checkpoints: same batch assumed)
    PROGRESS["step"] = step
    if master and not finished:
        write_atomic(out / "config.json", json.dumps(to_dict(cfg), indent=2))
        write_atomic(out / "data.json", json.dumps(data_identity(tokens)))
        print(
            f"[pretrain] {cfg.model.kind} model, {n_params / 1e6:.2f}M params; backend {backend.name}; "
            f"optimizer {describe_optimizer(cfg)}; world {world} on {device.type}, {dtype}; "
            f"{len(tokens) / 1e6:.2f}M tokens ({windows.n_train} train / {windows.n_val} held-out windows); "
            + (f"resumed from {ckpt} at step {step}" if ckpt else "from scratch"),
            flush=True,
        )
    log = MetricsLog(out / "metrics.jsonl", t.steps, step, active=master and not finished)  # rank 0's
    log.start(step, resumed=ckpt is not None)  # a resumed run keeps its records up to the checkpoint

    # ---- the loss and the held-out evaluation ----
    peak = peak_tflops(cfg.log.peak_tflops, device)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(x.to(device))
        ce = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten())
        return ce, ce + cfg.model.moe_aux_loss * model.aux_loss()

    @torch.no_grad()
    def evaluate() -> float | None:
        if windows.n_val == 0:
            return None
        model.eval()
        total, n = torch.zeros((), device=device), 0
        for x, y in val_batches(windows, cfg.train.batch_size, dp_rank, dp_world, cfg.log.eval_batches):
            with loss_context(model):
                total += local(loss_fn(x, y)[0])
            n += 1
        model.train()
        dist.all_reduce(total)  # (over every rank: the tp ranks of a TP group hold the same loss)
        return total.item() / (n * world)

    def logged(step: int) -> bool:  # a metrics record after optimizer step ``step``
        return step % cfg.log.every == 0 or (bool(cfg.log.eval_every) and step % cfg.log.eval_every == 0) or step == t.steps

    # ---- the training loop ----
    t_last, step_last = time.perf_counter(), step
    while step < t.steps:
        # Attention logits are recorded where QK-clip needs them (every step, from the attention's own
        # logits) or max_attn_logit is logged (a no-grad measuring pass beside SDPA).
        clipping = cfg.optim.qk_clip_tau > 0
        measure = clipping or logged(step + 1)
        set_logit_recording(attention, "exact" if clipping else "measure" if measure else None)
        loss_sum = torch.zeros((), device=device)
        for micro in range(t.grad_accum):
            model.set_requires_gradient_sync(micro == t.grad_accum - 1)  # reduce-scatter once per step
            x, y = sampler.next()
            with loss_context(model):  # parallel.tp > 1: the cross-entropy of vocabulary-sharded logits
                ce, loss = loss_fn(x, y)
                (loss / t.grad_accum).backward()
            loss_sum += local(ce.detach())
        grad_norm = backend.clip_grads(model, t.grad_clip)
        lr = float(optimizer.param_groups[0]["lr"])  # torchao keeps lr as a tensor
        optimizer.step()
        max_logit = backend.max_logit(model, attention, cfg.optim.qk_clip_tau) if measure and attention else None
        set_logit_recording(attention, None)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        PROGRESS["step"] = step

        last = step == t.steps
        if logged(step):
            dist.all_reduce(loss_sum)
            now = time.perf_counter()
            tps = tokens_per_step * (step - step_last) / (now - t_last)
            t_last, step_last = now, step
            rec = {
                "step": step, "loss": loss_sum.item() / (t.grad_accum * world), "lr": lr,
                "grad_norm": grad_norm, "tokens_per_s": tps, "tokens": tokens_seen,
                "mfu": 6 * n_flop_params * tps / (peak * 1e12 * world) if peak else None,
                "mem_gb": memory_gb(device), "elapsed_s": now - t_start,
                "max_attn_logit": max_logit,  # largest pre-softmax logit of the step (before any QK-clip)
            }
            if (bool(cfg.log.eval_every) and step % cfg.log.eval_every == 0) or last:
                rec["eval_loss"] = evaluate()
            log.write(rec)
            t_last = time.perf_counter()  # eval and logging are not training time
        log.advance()
        if (cfg.log.ckpt_every and step % cfg.log.ckpt_every == 0) or last:
            extra = {"step": step, "data": sampler.state_dict(), "tokens": tokens_seen}
            save_checkpoint(out, step, model, optimizer, scheduler, extra, backend, cfg.log.keep_ckpts)
            t_last = time.perf_counter()
    log.close()

    # ---- a Hugging Face export, the loss curve and the last line ----
    if args.export_hf is not None:
        config, _, to_hub = hf_convert(model, cfg.model, tokenizer)
        fsdp_optim.export_hf(model, args.export_hf, config=config, convert=to_hub)
        if master:
            print(f"[pretrain] exported a transformers checkpoint to {args.export_hf}"
                  + (f" (from {ckpt})" if finished else ""), flush=True)
    if finished:
        return {"records": read_metrics(log.path), "backend": backend.name, "resumed_from": str(ckpt), "finished": True}
    records = read_metrics(log.path) if master else []
    if master and records:
        plot_loss(records, out / "loss.png", title=f"{cfg.model.kind}, {describe_optimizer(cfg)}, W={world}")
        first, final = records[0], records[-1]
        print(f"[pretrain] wrote {log.path}, {out / 'loss.png'}", flush=True)
        print(f"[pretrain] done: {summary(final, final['step'])} (first logged loss {first['loss']:.3f}); "
              f"checkpoint {latest_checkpoint(out)}", flush=True)
    return {"records": records, "backend": backend.name, "resumed_from": str(ckpt) if ckpt else None, "finished": False}


# [Note: Ctrl-C]
# Ctrl-C sends SIGINT to the launcher and every rank (one process group). torchrun turns it into a
# SignalException traceback and exit 1, and a rank unwinding through KeyboardInterrupt may sit in a
# collective its peers have left. So under torchrun each rank exits at once from a SIGINT handler
# (``on_interrupt``), rank 0 first printing one line (the step reached, the checkpoint a rerun resumes
# from; checkpoints are written atomically, so a save cut short is ignored), with exit code 130;
# scripts/pretrain.sh launches through recipes/launch.py, which exits 130 without the traceback.
PROGRESS: dict = {"out": None, "step": None}  # what on_interrupt reports


def interrupted_line() -> str:
    out, step = PROGRESS["out"], PROGRESS["step"]
    where = "before the first step" if step is None else f"at step {step}"
    ckpt = latest_checkpoint(out) if out is not None else None
    then = f"rerun resumes from {ckpt}" if ckpt is not None else "no checkpoint yet: a rerun starts afresh"
    return f"[pretrain] interrupted {where}; {then}"


def on_interrupt(signum: int, frame) -> None:
    """SIGINT under torchrun: one line on rank 0, exit 130 now (see [Note: Ctrl-C])."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher forwards a second SIGINT
    try:
        if current_rank() == 0:
            print(interrupted_line(), file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(128 + signal.SIGINT)


def cli(argv: list[str] | None = None) -> int:
    """The command line: errors as one line on rank 0 and exit code 2; without torchrun (or with
    ``--check W``), the checks and the torchrun command to use (``_checks.preflight``)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv, __doc__)
        if args.check is not None or "RANK" not in os.environ:
            return preflight(args, argv)
        main(argv)
        return 0
    except ValueError as e:  # user errors: one clear line, on rank 0 only (every rank raises the same)
        if current_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            # torchrun kills the other ranks as soon as one exits: let rank 0 print (and exit) first.
            time.sleep(3.0)
        return 2
    finally:
        if dist.is_initialized():
            gc.collect()  # free the sharded model (it references the group) before destroying the group
            dist.destroy_process_group()


if __name__ == "__main__":
    under_torchrun = "RANK" in os.environ
    if under_torchrun:
        signal.signal(signal.SIGINT, on_interrupt)
    try:
        code = cli()
    except KeyboardInterrupt:  # Ctrl-C in the check before torchrun (scripts/pretrain.sh): no traceback
        print("[pretrain] interrupted before training", file=sys.stderr, flush=True)
        code = 128 + signal.SIGINT
    if under_torchrun:
        # [Note: exit after teardown]: torch 2.13's gloo aborts about 1 process in 6 at interpreter
        # exit, after the work is done and reported (the model, optimizer and process group are
        # already freed and destroyed by cli). Skip the interpreter's teardown once the outputs are
        # flushed, so a finished rank exits with its own code, not SIGABRT.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
