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
the training loop (with eval, metrics and checkpoints), and the loss plot.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import math
import os
import re
import resource
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # config, data, model live next to this file
from config import DEFAULT_LR, Config, check_ranges, load_config, to_dict  # noqa: E402
from data import Sampler, TokenWindows, build_tokenizer, fingerprint, load_tokens, val_batches  # noqa: E402
from model import build_model, max_seq_len, max_seq_len_key, model_vocab, num_params  # noqa: E402

# Peak dense bf16 TFLOP/s per device, for MFU (vendor datasheets: NVIDIA H100/H200 SXM 989, A100 312,
# B200 2250, L4 121; AMD MI300X 1307). CPU: 0.1 per rank, the order of one AVX2 core's FMA peak
# (2 FMA units x 8 fp32 lanes x 2 FLOPs x ~3 GHz), a nominal figure; set log.peak_tflops for yours.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0, "L4": 121.0, "MI300X": 1307.0}
CPU_PEAK_TFLOPS = 0.1


# ---------------------------------------------------------------------------------------------
# The runtime switch: our fully_shard / optimizers / checkpoints, or PyTorch FSDP2 + torch optimizers
# + DCP. Everything backend-specific is in these few functions.
# ---------------------------------------------------------------------------------------------
# optim.name -> the class in fsdp_optim.optimizers. "torch.<Name>": torch.optim.<Name> (a per-tensor
# optimizer) stepped whole on the rank that owns each tensor, by WholeTensorOptimizer.
TORCH_PER_TENSOR = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                    "Rprop", "SGD")
OPTIMIZERS = {
    "adamw": "AdamW", "adamw4bit": "AdamW4bit", "adamw8bit": "AdamW8bit", "muon": "Muon", "shampoo": "Shampoo",
    "soap": "SOAP", **{f"torch.{name}": "WholeTensorOptimizer" for name in TORCH_PER_TENSOR},
}  # fmt: skip
FP8_TILES = ("128x128", "1x128")  # train.fp8_all_gather / --fp8-allgather tiles (fsdp_optim.Float8AllGather)


def pick_backend(cfg: Config) -> str:
    if cfg.train.backend in ("fsdp_optim", "torch"):
        return cfg.train.backend
    if cfg.train.backend != "auto":
        raise ValueError(f"train.backend must be auto, fsdp_optim or torch, got {cfg.train.backend!r}")
    import fsdp_optim
    import fsdp_optim.optimizers as ours

    ready = all(hasattr(fsdp_optim, f) for f in ("fully_shard", "clip_grad_norm_", "save_checkpoint", "load_checkpoint"))
    return "fsdp_optim" if ready and hasattr(ours, OPTIMIZERS.get(cfg.optim.name, "")) else "torch"


def shard_model(
    model: torch.nn.Module,
    backend: str,
    opt_name: str,
    param_dtype: torch.dtype,
    fp8_all_gather: str = "off",
    max_preconditioner_dim: int = 1024,
    ep: int = 1,
) -> None:
    """Shard each decoder layer, then the root (embeddings, final norm, head), FSDP2-style, with the
    optimizer's block rule (Shampoo's follows ``optim.max_preconditioner_dim``).
    ``fp8_all_gather``: ``off`` or a tile (``128x128``, ``1x128``) for the block-wise FP8 all-gather.
    ``ep`` > 1 (MoE, fsdp_optim backend): first each layer's experts are split whole over groups of
    ``ep`` ranks (``expert_parallel``) and each rank's slice sharded over the ranks holding the same
    experts (docs/expert-parallel.md); ``ep`` = 1 leaves them in their layer, sharded with it."""
    if backend == "fsdp_optim":
        import fsdp_optim
        from fsdp_optim import optimizers

        blocks = getattr(optimizers, OPTIMIZERS[opt_name]).blocks
        if opt_name == "shampoo":
            blocks = optimizers.Shampoo.rule(max_preconditioner_dim=max_preconditioner_dim)
        mp = None
        if param_dtype != torch.float32:
            mp = fsdp_optim.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        fp8 = None if fp8_all_gather == "off" else fsdp_optim.Float8AllGather(tile=fp8_all_gather)
        if ep > 1:
            from fsdp_optim.sharding import expert_parallel, expert_parallel_groups

            groups = expert_parallel_groups(ep)
            for layer in model.layers:  # the experts' own fully_shard comes before their layer's
                experts = layer.feed_forward.experts
                expert_parallel(experts, group=groups.ep)
                fsdp_optim.fully_shard(experts, mesh=groups.replicas, blocks=blocks, mp_policy=mp, fp8_all_gather=fp8)
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, blocks=blocks, mp_policy=mp, fp8_all_gather=fp8)
        fsdp_optim.fully_shard(model, blocks=blocks, mp_policy=mp, fp8_all_gather=fp8)
    else:
        if ep > 1:  # (resolve_config refuses it first; this guards direct callers)
            raise ValueError(f"parallel.ep = {ep} needs the fsdp_optim backend (train.backend); set parallel.ep=1")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)


def init_sharded(model: torch.nn.Module, backend: str, device: torch.device) -> None:
    """Initialize a model built on the meta device and sharded (same values as an unsharded init)."""
    if backend == "fsdp_optim":
        import fsdp_optim

        fsdp_optim.init_weights(model, model.init_module)
    else:
        model.to_empty(device=device)
        model.init_weights()  # FSDP2: on DTensors, so each rank draws its own shards


def build_optimizer(model: torch.nn.Module, cfg: Config, backend: str) -> torch.optim.Optimizer:
    o = cfg.optim
    lr = o.lr if o.lr is not None else DEFAULT_LR.get(o.name, DEFAULT_LR["adamw"])
    adamw_lr = o.adamw_lr if o.adamw_lr is not None else DEFAULT_LR["adamw"]  # (0 is a setting: frozen)
    # Weight decay on matrices only (not norms, biases): nanoGPT's grouping, by the *global* shape
    # (a sharded parameter is a flat 1-D piece, so p.ndim would say 1 for all of them).
    import fsdp_optim

    groups = fsdp_optim.param_groups(model, weight_decay=o.weight_decay)
    if backend == "fsdp_optim":
        from fsdp_optim import optimizers

        if o.name == "adamw":
            return optimizers.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps)
        if o.name in ("adamw8bit", "adamw4bit"):  # compiled on GPUs, eager on CPU (compiling takes minutes there)
            cls = getattr(optimizers, OPTIMIZERS[o.name])
            return cls(groups, lr=lr, betas=o.betas, eps=o.eps, compile=torch.cuda.is_available())
        if o.name == "soap":
            return optimizers.SOAP(
                groups, lr=lr, betas=o.betas, eps=o.eps, precondition_frequency=o.precondition_frequency,
                max_precond_dim=o.max_preconditioner_dim,
            )
        if o.name.startswith("torch."):  # lr, and betas / eps where the class takes them in that form
            cls = getattr(torch.optim, o.name.removeprefix("torch."))
            takes = inspect.signature(cls).parameters  # (Adafactor's eps is a pair: left at its default)
            kw = {k: v for k, v in (("betas", o.betas), ("eps", o.eps))
                  if k in takes and isinstance(v, type(takes[k].default))}
            return optimizers.WholeTensorOptimizer(groups, cls, lr=lr, **kw)
        if o.name == "muon":  # matrices: Muon; embeddings, head, norms: its AdamW fallback (own lr)
            for g in groups:
                g["adamw_weight_decay"] = g["weight_decay"]
            return optimizers.Muon(
                groups, lr=lr, momentum=o.momentum, adamw_lr=adamw_lr, adamw_betas=o.betas,
                adamw_eps=o.eps,
            )
        return optimizers.Shampoo(  # Adam grafting: DistributedShampoo's default is none (docs/shampoo.md)
            groups, lr=lr, betas=o.betas, grafting="adam", grafting_epsilon=o.eps, max_preconditioner_dim=o.max_preconditioner_dim,
            precondition_frequency=o.precondition_frequency,
        )
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps)
    if o.name == "adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, lr=lr, betas=o.betas, eps=o.eps)
    raise ValueError(
        f"optim.name = {o.name!r} needs fsdp_optim.optimizers.{OPTIMIZERS[o.name]} (train.backend = 'fsdp_optim'); "
        "the torch backend (PyTorch FSDP2) runs adamw and adamw8bit"
    )


def clip_grads(model: torch.nn.Module, max_norm: float, backend: str) -> float:
    """Clip to global norm ``max_norm`` (0: no clipping, the norm is still measured); return the norm."""
    max_norm = max_norm if max_norm > 0 else math.inf
    if backend == "fsdp_optim":
        import fsdp_optim

        return float(fsdp_optim.clip_grad_norm_(model.parameters(), max_norm))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def set_logit_recording(model: torch.nn.Module, mode: str | None) -> None:
    """How the recipe's attention layers record each head's max logit: ``"exact"`` (explicit attention,
    the logits QK-clip scales by), ``"measure"`` (SDPA plus a no-grad pass: logging only, no memory
    kept for backward) or ``None`` (a transformers model has none: nothing is recorded)."""
    from model import Attention

    for m in model.modules():
        if isinstance(m, Attention):
            m.record_logits = mode


def qk_clip(model: torch.nn.Module, tau: float, backend: str) -> float | None:
    """After ``optimizer.step()`` of a step whose logits were recorded: the largest attention logit of
    the step over all ranks (before clipping), with QK-clip at ``tau`` applied (0: measure only).
    None for a model without the recipe's attention (kind = hf)."""
    from model import Attention
    from fsdp_optim.optimizers import qk_clip_, recorded_max_logits

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        return None
    if backend == "fsdp_optim":
        return qk_clip_(model, tau=tau if tau > 0 else math.inf).max_logit
    # torch backend: qk_clip_ refuses FSDP2's DTensor weights (resolve_config refuses tau > 0), so measure only.
    recorded = [recorded_max_logits(m) for m in layers]
    top = torch.stack([r.max() for r in recorded]).max()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    for r in recorded:
        r.fill_(float("-inf"))  # a running max per step, as qk_clip_ resets it
    return top.item()


def save_checkpoint(path: Path, model, optimizer, scheduler, extra: dict, backend: str) -> None:
    if backend == "fsdp_optim":
        import fsdp_optim

        fsdp_optim.save_checkpoint(str(path), model=model, optimizer=optimizer, scheduler=scheduler, extra=extra)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        if dist.get_rank() == 0:
            torch.save({"scheduler": scheduler.state_dict(), "extra": extra}, path / "recipe_extra.pt")
    dist.barrier()
    if dist.get_rank() == 0:  # the marker that makes this checkpoint "complete" for --resume
        write_atomic(path / DONE, json.dumps({"step": extra["step"]}))
    dist.barrier()


def load_checkpoint(path: Path, model, optimizer, scheduler, backend: str) -> dict:
    if backend == "fsdp_optim":
        import fsdp_optim

        return fsdp_optim.load_checkpoint(str(path), model=model, optimizer=optimizer, scheduler=scheduler)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = torch.load(path / "recipe_extra.pt", weights_only=True)
    scheduler.load_state_dict(saved["scheduler"])
    return saved["extra"]


def resume_from(path: Path, model, optimizer, scheduler, backend: str) -> dict:
    """``load_checkpoint``, its failures (a missing or corrupt file, other keys) as one ``ValueError``
    line that names the checkpoint and the way out (the loads raise on every rank alike)."""
    try:
        return load_checkpoint(path, model, optimizer, scheduler, backend)
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        why = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"cannot resume from checkpoint {path}: {type(e).__name__}: {why}; delete {path / DONE} to resume from "
            "the previous complete checkpoint instead, or use another --out to start afresh"
        ) from None


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a process killed mid-write) is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


# ---------------------------------------------------------------------------------------------
# Checkpoint folders: OUT/checkpoints/step_<digits>/, complete once rank 0 has written the DONE marker
# (after every rank's files). Anything else there (a killed save's step_N.tmp, a folder without a
# readable marker) is not a checkpoint: never resumed from, counted or pruned.
# ---------------------------------------------------------------------------------------------
DONE = "recipe_done.json"
_warned: set[Path] = set()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and ``os.replace``: a reader (or a kill) never
    sees a torn file, only the old one or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def done_step(ckpt: Path) -> int | None:
    """The step in ``ckpt``'s DONE marker; None if there is none, or it is unreadable (warned once)."""
    marker = ckpt / DONE
    if not marker.is_file():
        return None
    try:
        step = json.loads(marker.read_text())["step"]
        if not isinstance(step, int) or f"step_{step:06d}" != ckpt.name:
            raise ValueError(f"it says step {step!r}, not the folder's")
        return step
    except (OSError, ValueError, KeyError, TypeError) as e:
        if marker not in _warned and _rank() == 0:
            print(f"warning: {marker} is unreadable ({e}); {ckpt.name} counts as incomplete, so the previous "
                  "complete checkpoint (if any) is used", file=sys.stderr, flush=True)
        _warned.add(marker)
        return None


def complete_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the complete checkpoints in ``out``, by step number (step_1000000 after step_999999)."""
    found = []
    for ckpt in (out / "checkpoints").glob("step_*"):
        if re.fullmatch(r"step_\d+", ckpt.name) and ckpt.is_dir() and (step := done_step(ckpt)) is not None:
            found.append((step, ckpt))
    return sorted(found)


def latest_checkpoint(out: Path) -> Path | None:
    done = complete_checkpoints(out)
    return done[-1][1] if done else None


def prune_checkpoints(out: Path, keep: int, saved: Path) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (0: none), never ``saved`` (the one just
    written); anything that is not a complete checkpoint is left alone."""
    for _, old in complete_checkpoints(out)[:-keep]:
        if old != saved:
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
class UsageError(ValueError):
    """A bad command line (argparse's errors, raised instead of printed so that only rank 0 reports)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage and exits on every rank; one line on rank 0 instead
        raise UsageError(f"{message} (python {self.prog} --help lists the flags)")


def hf_convert(model, cfg: Config, tokenizer: object | None = None):
    """``(config, load_hf convert, export_hf convert)`` between the recipe's names and the Hub's; the
    config carries ``tokenizer``'s BOS/EOS ids (unless model.hf_config sets them)."""
    import functools

    from model import from_hf, llama_hf_config, to_hf

    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    if cfg.model.kind == "hf":  # the wrapped transformers model: names behind "hf."
        config = copy.deepcopy(model.hf.config)
        for key, value in (("bos_token_id", bos), ("eos_token_id", eos)):
            if key not in cfg.model.hf_config:
                setattr(config, key, value)
        return (
            config,
            lambda name: (name.removeprefix("hf."), lambda t: t),
            lambda name, t: (name.removeprefix("hf."), t),
        )
    config = llama_hf_config(cfg.model, bos_id=bos, eos_id=eos)
    return config, functools.partial(from_hf, cfg.model), functools.partial(to_hf, cfg.model)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="recipes/pretrain.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config (recipes/configs/*.toml); default: built-in defaults")
    p.add_argument("--out", required=True, help="output folder: metrics.jsonl, loss.png, checkpoints/")
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="optim.name")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument(
        "--fp8-allgather", nargs="?", const="128x128", choices=FP8_TILES, metavar="TILE",
        help="all-gather parameters in block-wise FP8, one scale per TILE (128x128 or 1x128; default 128x128): "
        "train.fp8_all_gather",
    )
    p.add_argument("--export-hf", metavar="DIR", help="at the end, write a transformers from_pretrained directory")
    p.add_argument(
        "--init-from-hf", metavar="DIR",
        help="start from the weights of a transformers safetensors directory (read on rank 0, one bucket at a time)",
    )
    p.add_argument(
        "--check", nargs="?", const=2, type=int, metavar="W",
        help="validate the config, data and model for W ranks (default 2) without training, then exit: "
        "0 ready, 2 invalid, 3 the run in --out is already finished (no torchrun needed; with --export-hf: 0, "
        "torchrun exports it)",
    )
    return p.parse_args(argv)


def check_writable_dir(what: str, path: Path) -> None:
    """``path`` is a directory, or one can be made there: not a file, not under a file, writable."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a directory; give a directory path")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: {parent} is a file, so no directory can be made under it; give another path")
    try:  # (os.access says yes to root even on a read-only file system: try it)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ValueError(
            f"{what} {path}: {parent} is not writable ({e.strerror}); give a path you can write to"
        ) from None


def resolve_config(args: argparse.Namespace) -> Config:
    """The config from --config, --set and the flags, with every check that needs no data or ranks."""
    cfg = load_config(args.config, args.set)
    set_keys = {item.partition("=")[0].strip() for item in args.set}
    for flag, key, value in (("--steps", "train.steps", args.steps), ("--optimizer", "optim.name", args.optimizer),
                             ("--fp8-allgather", "train.fp8_all_gather", args.fp8_allgather)):
        section, name = key.split(".")
        if value is None:
            continue
        if key in set_keys and getattr(getattr(cfg, section), name) != value:
            raise ValueError(
                f"{flag} {value} and --set {key}={getattr(getattr(cfg, section), name)!r} disagree; give only one"
            )
        setattr(getattr(cfg, section), name, value)
    if args.check is not None and args.check < 1:
        raise ValueError(f"--check {args.check}: the number of ranks must be >= 1 (--check alone checks for 2)")
    check_ranges(cfg)
    if cfg.optim.name not in OPTIMIZERS:
        raise ValueError(f"optim.name must be one of {sorted(OPTIMIZERS)}, got {cfg.optim.name!r}")
    if cfg.train.fp8_all_gather not in ("off", *FP8_TILES):
        raise ValueError(
            f"train.fp8_all_gather must be off, {' or '.join(FP8_TILES)}, got {cfg.train.fp8_all_gather!r}"
        )
    if cfg.train.dtype not in ("auto", "bf16", "fp32"):
        raise ValueError(f"train.dtype must be auto, bf16 or fp32, got {cfg.train.dtype!r}")
    for flag, value in (("--export-hf", args.export_hf), ("--init-from-hf", args.init_from_hf)):
        if value is None:
            continue
        if cfg.model.kind not in ("llama", "hf"):
            raise ValueError(f"{flag} supports model.kind = 'llama' or 'hf', not {cfg.model.kind!r}")
        if pick_backend(cfg) != "fsdp_optim":
            raise ValueError(f"{flag} needs the fsdp_optim backend (train.backend)")
    if args.init_from_hf is not None:
        src = Path(args.init_from_hf)
        if not ((src / "model.safetensors.index.json").is_file() or (src / "model.safetensors").is_file()):
            raise ValueError(f"--init-from-hf {src}: no model.safetensors.index.json or model.safetensors there")
    backend = pick_backend(cfg)
    if cfg.train.fp8_all_gather != "off" and backend != "fsdp_optim":
        raise ValueError(
            f"train.fp8_all_gather={cfg.train.fp8_all_gather} (--fp8-allgather) needs the fsdp_optim backend, "
            f"but the backend is {backend}; set train.backend=fsdp_optim or drop --fp8-allgather"
        )
    if backend == "torch" and cfg.optim.name not in ("adamw", "adamw8bit"):
        raise ValueError(
            f"optim.name = {cfg.optim.name!r} needs fsdp_optim.optimizers.{OPTIMIZERS[cfg.optim.name]} "
            "(train.backend = 'fsdp_optim'); the torch backend (PyTorch FSDP2) runs adamw and adamw8bit"
        )
    check_parallel(cfg, backend)
    check_writable_dir("--out", Path(args.out))
    if args.export_hf is not None:
        check_writable_dir("--export-hf", Path(args.export_hf))
        if Path(args.export_hf).resolve() == Path(args.out).resolve():
            raise ValueError(
                f"--export-hf {args.export_hf} is the run folder (--out), whose config.json it would overwrite; "
                f"export to a subfolder, e.g. {Path(args.out) / 'hf'}"
            )
    return cfg


def check_parallel(cfg: Config, backend: str, world: int | None = None) -> None:
    """parallel.ep and optim.qk_clip_tau against the model and backend (and ``world``, the number of
    ranks, when known): one line naming the key and the fix."""
    ep = cfg.parallel.ep
    if ep > 1:
        if cfg.model.kind != "moe":
            raise ValueError(f"parallel.ep = {ep} splits MoE experts, but model.kind = {cfg.model.kind!r} has none; "
                             "set parallel.ep=1")
        if ep > cfg.model.n_experts:
            raise ValueError(f"parallel.ep = {ep} is more than model.n_experts = {cfg.model.n_experts} (each rank of an "
                             "EP group holds whole experts); lower parallel.ep")
        if backend != "fsdp_optim":
            raise ValueError(f"parallel.ep = {ep} needs the fsdp_optim backend, but the backend is {backend}; set "
                             "train.backend=fsdp_optim or parallel.ep=1")
        if cfg.model.meta_init:
            raise ValueError(f"parallel.ep = {ep} with model.meta_init = true is not supported (the sharded init "
                             "sees only this rank's experts); set model.meta_init=false or parallel.ep=1")
        if world is not None and world % ep:
            raise ValueError(f"parallel.ep = {ep} must divide the number of ranks ({world}); choose one of "
                             f"{[d for d in range(1, world + 1) if world % d == 0]}, or run on a multiple of {ep} ranks")
    if cfg.optim.qk_clip_tau > 0:
        if backend != "fsdp_optim":
            raise ValueError(f"optim.qk_clip_tau = {cfg.optim.qk_clip_tau:g} needs the fsdp_optim backend (QK-clip "
                             f"scales our sharded weights), but the backend is {backend}; set train.backend=fsdp_optim "
                             "or optim.qk_clip_tau=0 (max_attn_logit is logged either way)")
        if cfg.model.kind == "hf":
            raise ValueError(f"optim.qk_clip_tau = {cfg.optim.qk_clip_tau:g} needs the recipe's attention "
                             "(model.kind = llama or moe), not a transformers model; set optim.qk_clip_tau=0")


def load_data(cfg: Config, world: int):
    """Tokenizer, token stream and windows; checks the train and held-out splits can feed ``world`` ranks.
    Sets ``cfg.model.vocab_size`` when it is 0 (the tokenizer's)."""
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer.vocab_size
    vocab, key = model_vocab(cfg.model)  # what the embedding table will have (hf_config's, for kind = hf)
    if vocab < tokenizer.vocab_size:
        raise ValueError(
            f"{key} {vocab} < the tokenizer's {tokenizer.vocab_size}; raise it"
            + (" or set 0" if key == "model.vocab_size" else " or remove it (then model.vocab_size is used)")
        )
    tokens = load_tokens(cfg.data.path, tokenizer, cfg.data.token_dtype, vocab_size=vocab, vocab_key=key)
    windows = TokenWindows(tokens, cfg.data.seq_len, cfg.data.val_fraction, where=f"data.path = {cfg.data.path!r}")
    Sampler(windows, cfg.train.batch_size, 0, world, cfg.train.seed)  # raises if the data cannot feed W ranks
    if windows.n_val:  # fail now, not after training: the held-out split must feed every rank
        next(iter(val_batches(windows, cfg.train.batch_size, 0, world, 1)))
    return tokenizer, tokens, windows


def check_seq_len(cfg: Config, model: torch.nn.Module) -> None:
    """data.seq_len fits the model; the error names the key that sets the model's limit."""
    if cfg.data.seq_len > max_seq_len(model):
        raise ValueError(
            f"data.seq_len {cfg.data.seq_len} is longer than the model supports ({max_seq_len(model)}); "
            f"lower data.seq_len or raise {max_seq_len_key(cfg.model)}"
        )


def check_model(cfg: Config) -> None:
    """Build the model on the meta device (no memory) to check its config against the data."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    check_seq_len(cfg, model)


# What a resume may not change: the model and optimizer settings (the checkpoint holds their state; a
# changed key fails to load, or is silently replaced by the saved value, as the saved param groups
# replace lr, betas and weight decay), the backend (the checkpoint's format), and what a data window is
# (the sampler's saved position counts windows). The rest (steps, batch size, grad_accum, world size,
# the LR schedule, clipping, dtype, logging) may change on resume, and so may [parallel] (parallel.ep
# is a layout: checkpoints save at one (ep, W) and load at any other) and optim.qk_clip_tau (applied
# after each step, no state).
RESUME_FIXED = ("model.", "optim.", "data.", "train.seed", "train.backend")
RESUME_FREE = ("model.moe_aux_loss", "model.meta_init", "model.max_seq_len", "optim.qk_clip_tau")


def _resume_keys(d: dict) -> dict:
    """The RESUME_FIXED values of a ``to_dict`` config, train.backend resolved (``auto`` -> its pick)."""
    flat = {f"{s}.{k}": v for s, sub in d.items() for k, v in sub.items()}
    probe = Config()
    probe.train.backend, probe.optim.name = flat["train.backend"], flat["optim.name"]
    flat["train.backend"] = pick_backend(probe)
    return {k: v for k, v in flat.items() if k.startswith(RESUME_FIXED) and k not in RESUME_FREE}


def check_resume_config(out: Path, cfg: Config) -> None:
    """Refuse to resume the run in ``out`` with other RESUME_FIXED settings than its ``config.json``
    (call after ``load_data``, which resolves model.vocab_size, as the saved config has it)."""
    path = out / "config.json"
    try:
        saved = _resume_keys(json.loads(path.read_text()))
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, AttributeError) as e:
        if _rank() == 0:
            print(f"warning: {path} is unreadable ({e}); the settings of the run are not compared", file=sys.stderr)
        return
    now = _resume_keys(json.loads(json.dumps(to_dict(cfg))))  # through JSON: tuples compare as the saved lists
    diff = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k, now[k]) != now[k]]
    if diff:
        raise ValueError(
            f"--out {out} holds a run with other settings: {', '.join(diff)}; a resume cannot change them (its "
            "checkpoint and data position depend on them): set them back, or use another --out for a new run"
        )


def data_identity(tokens) -> dict:
    """What identifies the token stream a run trains on: its length and a hash of its content."""
    return {"tokens": int(tokens.size), "fingerprint": fingerprint(tokens)}


def check_resume_data(out: Path, tokens) -> None:
    """Refuse to resume the run in ``out`` on other data than it started with (``OUT/data.json``): a
    file appended to, or rewritten at the same size, would give the saved data position other windows."""
    path = out / "data.json"
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:  # (a run from before data.json)
        return
    except (OSError, ValueError) as e:
        if _rank() == 0:
            print(f"warning: {path} is unreadable ({e}); the data of the run is not compared", file=sys.stderr)
        return
    now = data_identity(tokens)
    if saved != now:
        what = "its length" if saved.get("tokens") != now["tokens"] else "its content (same length)"
        raise ValueError(
            f"--out {out} holds a run on other data: the token stream of data.path changed in {what} "
            f"({saved.get('tokens')} tokens, fingerprint {saved.get('fingerprint')} -> {now['tokens']} tokens, "
            f"{now['fingerprint']}); a resume would continue at a position in other windows: restore the data, "
            "or use another --out for a new run"
        )


def finished_run(out: Path, cfg: Config) -> str | None:
    """A report line when ``out`` holds a complete checkpoint at or past ``train.steps`` (nothing to train)."""
    complete = complete_checkpoints(out)
    if not complete:
        return None
    done, ckpt = complete[-1]
    if done < cfg.train.steps:
        return None
    last = next((r for r in reversed(read_metrics(out / "metrics.jsonl")) if r["step"] == done), {})
    return (
        f"[pretrain] {out} already holds a finished run: {summary(last, done)}; checkpoint {ckpt}. "
        f"Nothing to train: --resume --steps N (N > {done}) continues it, --export-hf DIR exports it, another "
        "--out starts afresh."
    )


def check_unfinished(out: Path, cfg: Config, resume: bool) -> None:
    """An unfinished run in ``out`` continues only with ``--resume`` (never overwritten silently)."""
    ckpt = latest_checkpoint(out)
    if ckpt is not None and not resume:
        raise ValueError(
            f"{out} already holds checkpoints (latest {ckpt.name}, train.steps {cfg.train.steps}); pass --resume to "
            "continue, or use another --out"
        )


def summary(rec: dict, step: int) -> str:
    """``step S: loss L, held-out H`` rounded to 3 decimals (what the last line of a run says)."""
    text = f"step {step}"
    if "loss" in rec:
        text += f": loss {rec['loss']:.3f}"
    if rec.get("eval_loss") is not None:
        text += f", held-out {rec['eval_loss']:.3f}"
    return text


def without_check(argv: list[str]) -> list[str]:
    """``argv`` without ``--check`` / ``--check W`` / ``--check=W`` (the command that trains)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--check":
            skip = i + 1 < len(argv) and argv[i + 1].isdigit()
        elif not a.startswith("--check="):
            out.append(a)
    return out


def torchrun_command(argv: list[str], nproc: int = 2) -> str:
    """The command that runs this script with ``argv`` on ``nproc`` local ranks."""
    return shlex.join(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "recipes/pretrain.py", *argv])


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
        if _rank() == 0:
            print(interrupted_line(), file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(128 + signal.SIGINT)


def main(argv: list[str] | None = None) -> dict:
    t_start = time.perf_counter()
    args = parse_args(argv)
    cfg = resolve_config(args)
    out = Path(args.out)
    PROGRESS.update(out=out, step=None)
    report = finished_run(out, cfg)
    if report is not None:  # the --set overrides must hold even when nothing is trained
        load_data(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        check_parallel(cfg, pick_backend(cfg), int(os.environ.get("WORLD_SIZE", 1)))
        check_model(cfg)
    if report is not None and _rank() == 0:
        print(report, flush=True)
    if report is not None and args.export_hf is None:  # rerunning a finished job: train nothing (every rank alike)
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
    backend = pick_backend(cfg)
    master = rank == 0

    # ---- data: every rank tokenizes the same stream and takes its own windows ----
    tokenizer, tokens, windows = load_data(cfg, world)
    check_parallel(cfg, backend, world)
    if not finished:  # (on every rank: all raise alike, before any collective)
        check_unfinished(out, cfg, args.resume)
    if latest_checkpoint(out) is not None:
        check_resume_config(out, cfg)
        check_resume_data(out, tokens)
    sampler = Sampler(windows, cfg.train.batch_size, rank, world, cfg.train.seed)

    # ---- model: built whole (same seed on every rank) or on meta, then sharded per layer ----
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta" if cfg.model.meta_init else device):
        model = build_model(cfg.model)
    check_seq_len(cfg, model)
    n_params, n_flop_params = num_params(model), num_params(model, exclude_embedding=True)
    shard_model(
        model, backend, cfg.optim.name, dtype, cfg.train.fp8_all_gather, cfg.optim.max_preconditioner_dim,
        cfg.parallel.ep,
    )
    if cfg.model.meta_init:  # initialize at full shape, one bucket at a time, keeping this rank's piece
        torch.manual_seed(cfg.train.seed)
        init_sharded(model, backend, device)
    if args.init_from_hf is not None and latest_checkpoint(out) is None:  # (a resume loads its checkpoint)
        import fsdp_optim

        fsdp_optim.load_hf(model, args.init_from_hf, convert=hf_convert(model, cfg, tokenizer)[1])

    # ---- optimizer and LR schedule: linear warmup, cosine to min_lr_ratio ----
    optimizer = build_optimizer(model, cfg, backend)
    t = cfg.train

    def lr_factor(step: int) -> float:  # ``step`` optimizer steps done so far
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    # ---- resume: the model, optimizer, schedule, data position and token count of the latest checkpoint ----
    step, tokens_seen = 0, 0
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * cfg.train.grad_accum * world
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
    metrics_path = out / "metrics.jsonl"
    if master and not finished:
        # Drop records past the checkpoint (a killed run's tail); a fresh run starts a fresh file.
        old = read_metrics(metrics_path) if ckpt is not None else []
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in old if r["step"] <= step))
        write_atomic(out / "config.json", json.dumps(to_dict(cfg), indent=2))
        write_atomic(out / "data.json", json.dumps(data_identity(tokens)))
        print(
            f"[pretrain] {cfg.model.kind} model, {n_params / 1e6:.2f}M params; backend {backend}; "
            f"optimizer {cfg.optim.name}; world {world} on {device.type}, {dtype}; "
            f"{len(tokens) / 1e6:.2f}M tokens ({windows.n_train} train / {windows.n_val} held-out windows); "
            + (f"resumed from {ckpt} at step {step}" if ckpt else "from scratch"),
            flush=True,
        )

    # ---- helpers for the loop ----
    peak = cfg.log.peak_tflops or (
        next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name(device)), 0.0)
        if use_cuda else CPU_PEAK_TFLOPS
    )

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
        for x, y in val_batches(windows, cfg.train.batch_size, rank, world, cfg.log.eval_batches):
            total += loss_fn(x, y)[0]
            n += 1
        model.train()
        dist.all_reduce(total)
        return total.item() / (n * world)

    def memory_gb() -> float:
        if use_cuda:
            return torch.cuda.max_memory_allocated(device) / 1e9
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: peak RSS in KiB

    def checkpoint(step: int) -> None:
        path = out / "checkpoints" / f"step_{step:06d}"
        if master and path.exists():
            shutil.rmtree(path)  # an incomplete save of this step from a killed run
        dist.barrier()
        extra = {"step": step, "data": sampler.state_dict(), "tokens": tokens_seen}
        save_checkpoint(path, model, optimizer, scheduler, extra, backend)
        if master and cfg.log.keep_ckpts > 0:
            prune_checkpoints(out, cfg.log.keep_ckpts, saved=path)

    # ---- the training loop ----
    # A progress bar on a terminal; in a redirected log (no terminal), a plain line at each tenth of
    # the run and at each eval instead of carriage-return updates.
    on_terminal = sys.stderr.isatty()
    bar = tqdm(total=t.steps, initial=step, disable=not master or finished or not on_terminal, dynamic_ncols=True,
               desc="pretrain")
    t_last, step_last = time.perf_counter(), step

    def logged(step: int) -> bool:  # a metrics record after optimizer step ``step``
        return step % cfg.log.every == 0 or (bool(cfg.log.eval_every) and step % cfg.log.eval_every == 0) or step == t.steps

    while step < t.steps:
        # Attention logits are recorded where QK-clip needs them (every step, from the attention's own
        # logits) or max_attn_logit is logged (a no-grad measuring pass beside SDPA).
        clipping = cfg.optim.qk_clip_tau > 0
        measure = clipping or logged(step + 1)
        set_logit_recording(model, "exact" if clipping else "measure" if measure else None)
        loss_sum = torch.zeros((), device=device)
        for micro in range(t.grad_accum):
            model.set_requires_gradient_sync(micro == t.grad_accum - 1)  # reduce-scatter once per step
            x, y = sampler.next()
            ce, loss = loss_fn(x, y)
            (loss / t.grad_accum).backward()
            loss_sum += ce.detach()
        grad_norm = clip_grads(model, t.grad_clip, backend)
        lr = float(optimizer.param_groups[0]["lr"])  # torchao keeps lr as a tensor
        optimizer.step()
        max_logit = qk_clip(model, cfg.optim.qk_clip_tau, backend) if measure else None
        set_logit_recording(model, None)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        PROGRESS["step"] = step

        last = step == t.steps
        eval_now = bool(cfg.log.eval_every) and step % cfg.log.eval_every == 0
        if logged(step):
            dist.all_reduce(loss_sum)
            now = time.perf_counter()
            tps = tokens_per_step * (step - step_last) / (now - t_last)
            t_last, step_last = now, step
            rec = {
                "step": step, "loss": loss_sum.item() / (t.grad_accum * world), "lr": lr,
                "grad_norm": grad_norm, "tokens_per_s": tps, "tokens": tokens_seen,
                "mfu": 6 * n_flop_params * tps / (peak * 1e12 * world) if peak else None,
                "mem_gb": memory_gb(), "elapsed_s": now - t_start,
                "max_attn_logit": max_logit,  # largest pre-softmax logit of the step (before any QK-clip)
            }
            if eval_now or last:
                rec["eval_loss"] = evaluate()
            if master:
                with metrics_path.open("a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                bar.set_postfix(
                    loss=f"{rec['loss']:.3f}", tok_s=f"{tps:,.0f}",
                    mfu=f"{100 * rec['mfu']:.1f}%" if rec["mfu"] is not None else "n/a", mem=f"{rec['mem_gb']:.2f}GB",
                )
                if not on_terminal and (step % max(1, t.steps // 10) == 0 or "eval_loss" in rec):
                    held_out = f", held-out {rec['eval_loss']:.3f}" if rec.get("eval_loss") is not None else ""
                    print(f"[pretrain] step {step}/{t.steps}: loss {rec['loss']:.3f}{held_out}, {tps:,.0f} tokens/s",
                          flush=True)
            t_last = time.perf_counter()  # eval and logging are not training time
        bar.update(1)
        if (cfg.log.ckpt_every and step % cfg.log.ckpt_every == 0) or last:
            checkpoint(step)
            t_last = time.perf_counter()
    bar.close()
    if args.export_hf is not None:
        import fsdp_optim

        config, _, to_hub = hf_convert(model, cfg, tokenizer)
        fsdp_optim.export_hf(model, args.export_hf, config=config, convert=to_hub)
        if master:
            print(f"[pretrain] exported a transformers checkpoint to {args.export_hf}"
                  + (f" (from {ckpt})" if finished else ""), flush=True)
    if finished:
        return {"records": read_metrics(metrics_path), "backend": backend, "resumed_from": str(ckpt), "finished": True}

    # ---- the loss curve ----
    records = read_metrics(metrics_path) if master else []
    if master and records:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
        ev = [r for r in records if r.get("eval_loss") is not None]
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out")
        ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=f"{cfg.model.kind}, {cfg.optim.name}, W={world}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=120)
        plt.close(fig)
        first, final = records[0], records[-1]
        last_ckpt = latest_checkpoint(out)
        print(f"[pretrain] wrote {metrics_path}, {out / 'loss.png'}", flush=True)
        print(f"[pretrain] done: {summary(final, final['step'])} (first logged loss {first['loss']:.3f}); "
              f"checkpoint {last_ckpt}", flush=True)
    return {"records": records, "backend": backend, "resumed_from": str(ckpt) if ckpt else None, "finished": False}


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def cli(argv: list[str] | None = None) -> int:
    """The command line: errors as one line on rank 0 and exit code 2; without torchrun, a check and
    the torchrun command to use."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        if args.check is not None or "RANK" not in os.environ:
            cfg = resolve_config(args)  # (refuses --check 0)
            # --check W; without it, the ranks of the torchrun command printed below: 2, or parallel.ep's.
            world = max(2, cfg.parallel.ep) if args.check is None else args.check
            out = Path(args.out)
            report = finished_run(out, cfg)
            if report is None:
                check_unfinished(out, cfg, args.resume)
            tokens = load_data(cfg, world)[1]  # (a finished run too: the --set overrides must hold)
            check_parallel(cfg, pick_backend(cfg), world)
            check_model(cfg)
            if report is not None and args.export_hf is None:
                print(report, flush=True)
                return 3 if args.check is not None else 0
            if latest_checkpoint(out) is not None:
                check_resume_config(out, cfg)
                check_resume_data(out, tokens)
            if args.check is not None:
                what = f" (the run in {out} is finished: torchrun exports it)" if report is not None else ""
                run = torchrun_command(without_check(argv), world)
                print(f"[pretrain] check passed for {world} ranks{what}; run: {run}", flush=True)
                return 0
            print("error: recipes/pretrain.py runs under torchrun (RANK is not set); the config, data and model "
                  f"checks passed. Run:\n  {torchrun_command(argv, world)}", file=sys.stderr, flush=True)
            return 2
        main(argv)
        return 0
    except ValueError as e:  # user errors: one clear line, on rank 0 only (every rank raises the same)
        if _rank() == 0:
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
