"""The recipe's command line and every check that can run before training: flags, config, data and
model, each failure one ``ValueError`` line naming the key (or flag) and the fix. ``preflight`` runs
them all without torchrun (``--check W``, ``scripts/pretrain.sh``)."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from _backend import BACKENDS, FP8_TILES, MUON_FAMILY, OPTIMIZERS, Backend, needs_our_optimizer, pick_backend
from _checkpointing import check_resume_config, check_resume_data, check_unfinished, finished_run, latest_checkpoint
from config import Config, OptimConfig, check_ranges, load_config
from data import Sampler, TokenWindows, build_tokenizer, load_tokens, val_batches
from model import build_model, ffn_hidden, max_seq_len, max_seq_len_key, model_vocab

__all__ = ["UsageError", "check_model", "check_optim_options", "check_parallel", "check_seq_len", "load_data",
           "parse_args", "preflight", "resolve_config", "torchrun_command"]


class UsageError(ValueError):
    """A bad command line (argparse's errors, raised instead of printed so that only rank 0 reports)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage and exits on every rank; one line on rank 0 instead
        raise UsageError(f"{message} (python {self.prog} --help lists the flags)")


def parse_args(argv: list[str] | None, description: str | None = None) -> argparse.Namespace:
    p = _Parser(prog="recipes/pretrain.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    backend = BACKENDS[pick_backend(cfg)]
    for flag, value in (("--export-hf", args.export_hf), ("--init-from-hf", args.init_from_hf)):
        if value is None:
            continue
        if cfg.model.kind not in ("llama", "hf"):
            raise ValueError(f"{flag} supports model.kind = 'llama' or 'hf', not {cfg.model.kind!r}")
        if not backend.hf_io:
            raise ValueError(f"{flag} needs the fsdp_optim backend (train.backend)")
    if args.init_from_hf is not None:
        src = Path(args.init_from_hf)
        if not ((src / "model.safetensors.index.json").is_file() or (src / "model.safetensors").is_file()):
            raise ValueError(f"--init-from-hf {src}: no model.safetensors.index.json or model.safetensors there")
    if cfg.train.fp8_all_gather != "off" and not backend.fp8_all_gather:
        raise ValueError(
            f"train.fp8_all_gather={cfg.train.fp8_all_gather} (--fp8-allgather) needs the fsdp_optim backend, "
            f"but the backend is {backend.name}; set train.backend=fsdp_optim or drop --fp8-allgather"
        )
    check_optim_options(cfg, backend)
    if cfg.optim.name not in backend.optimizers:
        raise ValueError(needs_our_optimizer(cfg.optim.name))
    check_parallel(cfg)
    check_writable_dir("--out", Path(args.out))
    if args.export_hf is not None:
        check_writable_dir("--export-hf", Path(args.export_hf))
        if Path(args.export_hf).resolve() == Path(args.out).resolve():
            raise ValueError(
                f"--export-hf {args.export_hf} is the run folder (--out), whose config.json it would overwrite; "
                f"export to a subfolder, e.g. {Path(args.out) / 'hf'}"
            )
    return cfg


def check_optim_options(cfg: Config, backend: Backend) -> None:
    """The optimizer-specific keys: set away from their defaults only for an optimizer that takes them
    (a setting that would do nothing is an error, not a silent no-op), and only to what ``backend`` runs."""
    o, default = cfg.optim, OptimConfig()
    takes = {"orthogonalize": MUON_FAMILY, "coefficients": MUON_FAMILY, "gram_dtype": MUON_FAMILY,
             "normuon_beta2": ("normuon",), "normuon_eps": ("normuon",)}
    for key, names in takes.items():
        value = getattr(o, key)
        if value != getattr(default, key) and o.name not in names:
            raise ValueError(
                f"optim.{key} = {value!r} is an option of optim.name {' or '.join(names)}, but optim.name = "
                f"{o.name!r}; set optim.name={names[0]} (--optimizer {names[0]}) or leave optim.{key} out"
            )
    if o.gram_dtype != default.gram_dtype and o.orthogonalize != "gram_newton_schulz":
        raise ValueError(
            f"optim.gram_dtype = {o.gram_dtype!r} applies to optim.orthogonalize = 'gram_newton_schulz' only, but "
            f"optim.orthogonalize = {o.orthogonalize!r}; set optim.orthogonalize=gram_newton_schulz or leave "
            "optim.gram_dtype out"
        )
    named = isinstance(o.coefficients, str)  # else a list of (a, b, c): the backend's "list"
    for key, value, shown in (("orthogonalize", o.orthogonalize, o.orthogonalize),
                              ("coefficients", o.coefficients if named else "list", o.coefficients if named
                               else [list(t) for t in o.coefficients])):
        allowed = getattr(backend, key)
        if value not in allowed:
            raise ValueError(
                f"optim.{key} = {shown!r} needs fsdp_optim.optimizers.{OPTIMIZERS[o.name]} (train.backend = "
                f"'fsdp_optim'): the {backend.name} backend runs {' and '.join(backend.optimizers)}, and of optim.{key} "
                f"only {' or '.join(map(repr, allowed))} (what torch.optim.Muon does); set train.backend=fsdp_optim or "
                f"leave optim.{key} out"
            )


def check_parallel(cfg: Config, world: int | None = None) -> None:
    """parallel.ep and optim.qk_clip_tau against the model and backend (and ``world``, the number of
    ranks, when known): one line naming the key and the fix."""
    backend = BACKENDS[pick_backend(cfg)]
    ep = cfg.parallel.ep
    if ep > 1:
        if cfg.model.kind != "moe":
            raise ValueError(f"parallel.ep = {ep} splits MoE experts, but model.kind = {cfg.model.kind!r} has none; "
                             "set parallel.ep=1")
        if ep > cfg.model.n_experts:
            raise ValueError(f"parallel.ep = {ep} is more than model.n_experts = {cfg.model.n_experts} (each rank of an "
                             "EP group holds whole experts); lower parallel.ep")
        if not backend.expert_parallel:
            raise ValueError(f"parallel.ep = {ep} needs the fsdp_optim backend, but the backend is {backend.name}; set "
                             "train.backend=fsdp_optim or parallel.ep=1")
        if cfg.model.meta_init:
            raise ValueError(f"parallel.ep = {ep} with model.meta_init = true is not supported (the sharded init "
                             "sees only this rank's experts); set model.meta_init=false or parallel.ep=1")
        if world is not None and world % ep:
            raise ValueError(f"parallel.ep = {ep} must divide the number of ranks ({world}); choose one of "
                             f"{[d for d in range(1, world + 1) if world % d == 0]}, or run on a multiple of {ep} ranks")
    if cfg.parallel.tp > 1:
        check_tensor_parallel(cfg, backend, world)
    if cfg.optim.qk_clip_tau > 0:
        if not backend.qk_clip:
            raise ValueError(f"optim.qk_clip_tau = {cfg.optim.qk_clip_tau:g} needs the fsdp_optim backend (QK-clip "
                             f"scales our sharded weights), but the backend is {backend.name}; set "
                             "train.backend=fsdp_optim or optim.qk_clip_tau=0 (max_attn_logit is logged either way)")
        if cfg.model.kind == "hf":
            raise ValueError(f"optim.qk_clip_tau = {cfg.optim.qk_clip_tau:g} needs the recipe's attention "
                             "(model.kind = llama or moe), not a transformers model; set optim.qk_clip_tau=0")


def check_tensor_parallel(cfg: Config, backend: Backend, world: int | None = None) -> None:
    """parallel.tp > 1 against the model, the other settings and ``world`` (when known): each error names
    the value, what does not divide (or combine) and the fix."""
    tp, m = cfg.parallel.tp, cfg.model
    if cfg.parallel.ep > 1:
        raise ValueError(f"parallel.tp = {tp} with parallel.ep = {cfg.parallel.ep}: EP x TP is not supported (the TP "
                         "plan covers the dense Llama; experts are not tensor-parallel); set parallel.tp=1 or "
                         "parallel.ep=1")
    if m.kind != "llama":
        raise ValueError(f"parallel.tp = {tp} needs model.kind = 'llama' (the TP plan is the recipe's dense Llama's), "
                         f"not {m.kind!r}; set parallel.tp=1")
    if cfg.optim.name not in backend.tensor_parallel:
        names = [n for n in backend.tensor_parallel if not n.startswith("torch.")]
        names += ["torch.<Name>"] if len(names) < len(backend.tensor_parallel) else []
        raise ValueError(f"parallel.tp = {tp} with optim.name = {cfg.optim.name!r} is not supported: the "
                         f"{backend.name} backend runs tensor parallelism with {', '.join(names)} "
                         f"only; set optim.name={backend.tensor_parallel[0]} (--optimizer "
                         f"{backend.tensor_parallel[0]}) or parallel.tp=1")
    if m.meta_init:
        raise ValueError(f"parallel.tp = {tp} with model.meta_init = true is not supported (the sharded init of the "
                         "TP-local tensors does not give an unsharded init's values); set model.meta_init=false or "
                         "parallel.tp=1")
    if world is not None and world % tp:
        raise ValueError(f"parallel.tp = {tp} must divide the number of ranks ({world}); choose one of "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}, or run on a multiple of {tp} ranks")
    hidden = m.ffn_dim or ffn_hidden(m.dim, m.multiple_of)
    sizes = [("model.n_heads", m.n_heads, "query heads"), ("model.n_kv_heads", m.n_kv_heads or m.n_heads,
             "key/value heads" + ("" if m.n_kv_heads else ", = n_heads when unset")),
             ("model.ffn_dim" if m.ffn_dim else "the FFN hidden size (model.ffn_dim unset: from dim and multiple_of)",
              hidden, "SwiGLU hidden units"),
             ("model.vocab_size", m.vocab_size, "embedding rows and output columns"),
             ("data.seq_len", cfg.data.seq_len, "positions of the sequence-parallel norms")]
    for key, value, what in sizes:
        if value and value % tp:  # (vocab_size 0: the tokenizer's, checked once load_data has set it)
            fit = math.gcd(value, tp)  # the largest tp below that divides both
            raise ValueError(f"parallel.tp = {tp} must divide {key} = {value} ({what}, split over the TP ranks); "
                             f"set parallel.tp to a divisor of it{f' ({fit})' if fit > 1 else ''}, or {key} to a "
                             f"multiple of {tp}")
    if m.tie_embeddings:
        raise ValueError(f"parallel.tp = {tp} with model.tie_embeddings = true is not supported (the embedding and the "
                         "output head are split differently, so the tie would break); set model.tie_embeddings=false "
                         "or parallel.tp=1")


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


def preflight(args: argparse.Namespace, argv: list[str]) -> int:
    """``--check W``, or a run without torchrun: every check for W ranks (without ``--check``: 2, or
    parallel.ep's), then the exit code: 0 ready (with ``--check``), 2 not run under torchrun (the command
    to use is printed), 3 the run in --out is finished (0 without ``--check``)."""
    cfg = resolve_config(args)  # (refuses --check 0)
    world = max(2, cfg.parallel.ep, cfg.parallel.tp) if args.check is None else args.check
    out = Path(args.out)
    report = finished_run(out, cfg)
    if report is None:
        check_unfinished(out, cfg, args.resume)
    check_parallel(cfg, world)  # (parallel.tp must divide world before the data is split over world / tp)
    tokens = load_data(cfg, world // cfg.parallel.tp)[1]  # (a finished run too: the --set overrides must hold)
    check_parallel(cfg, world)  # (again: model.vocab_size is known now)
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
