"""Pretraining config: dataclasses filled from a TOML file plus ``--set section.key=value`` overrides.

Every key of the TOML file and every override must name a field below; anything else is a
``ValueError`` naming the key, where it came from, and the valid keys (with a close match).
Keys with a fixed set of values (``CHOICES``: ``optim.orthogonalize``, ``optim.coefficients``, which may also
be a list of ``[a, b, c]``, ``optim.gram_dtype``) are checked as they are read, naming the key, the value and
the allowed ones. Override values are parsed as TOML values (``--set model.dim=128``, ``--set train.dtype=bf16``,
``--set data.path='"/data/*.txt"'``); a value that is not valid TOML is taken as a plain string.
``check_ranges`` refuses numbers outside each key's range (``RANGES``), naming the key, the value and
the range; ``pretrain.py`` calls it once the command-line flags are applied.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
try:
    import tomllib
except ImportError:  # Python 3.10: the tomli backport (a dependency there, see pyproject.toml)
    import tomli as tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(kw_only=True)
class ModelConfig:
    kind: str = "llama"
    """llama (dense), moe (Llama with top-k routed experts), or hf (a transformers model by config)."""
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None
    """Grouped-query attention: key/value heads (None: n_heads, i.e. plain multi-head)."""
    vocab_size: int = 0
    """0: the tokenizer's vocabulary size."""
    ffn_dim: int | None = None
    """SwiGLU hidden size (None: Llama's rule, 8/3*dim rounded up to multiple_of)."""
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    n_experts: int = 8
    top_k: int = 2
    moe_ffn_dim: int | None = None
    """Hidden size of one expert (None: ffn_dim)."""
    moe_aux_loss: float = 0.01
    """Load-balancing loss weight (Switch Transformer's fraction * probability form)."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """kind = hf: kwargs of ``transformers.AutoConfig.for_model`` (must include ``model_type``)."""
    meta_init: bool = False
    """Build on the meta device, shard, then initialize (models too big for one rank's memory)."""


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""
    """A text file, a folder of .txt/.md files, a glob, or a .bin token file; "" = the recipes' corpus (recipes/corpus/corpus.txt)."""
    tokenizer: str = "byte"
    """byte (256 byte values + BOS/EOS, no download) or a local tokenizer.json path."""
    token_dtype: str = "uint16"
    """Element type of .bin token files: uint16 or uint32."""
    seq_len: int = 256
    val_fraction: float = 0.02
    """Tail of the token stream held out for eval loss."""


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"
    """adamw, adamw4bit, adamw8bit, muon, normuon, shampoo, soap, or torch.<Name> (torch.optim.<Name>, a
    per-tensor optimizer such as NAdam or Adafactor, through WholeTensorOptimizer; see _backend.TORCH_PER_TENSOR)."""
    lr: float | None = None
    """None: the optimizer's default (see DEFAULT_LR)."""
    adamw_lr: float | None = None
    """Muon only: lr of the AdamW fallback (embeddings, head, norms); None: 3e-3."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.95
    """Muon momentum (NorMuon's too)."""
    orthogonalize: str = "newton_schulz"
    """Muon / NorMuon: newton_schulz (torch.optim.Muon's) or gram_newton_schulz (the same polynomial through
    the Gram matrix; docs/muon.md, "Which orthogonalization")."""
    coefficients: str | tuple[tuple[float, float, float], ...] = "torch"
    """Muon / NorMuon: torch (torch.optim.Muon's (a, b, c), 5 times), polar_express (Polar Express's 5
    polynomials), or a list of [a, b, c], one per iteration."""
    gram_dtype: str = "fp16"
    """Muon / NorMuon with orthogonalize = gram_newton_schulz: fp16 (the authors'), bf16 (the fast one on
    CPUs, less accurate) or fp32."""
    normuon_beta2: float = 0.95
    """NorMuon: decay of the per-row second moment of the orthogonalized update (its beta2)."""
    normuon_eps: float = 1e-10
    """NorMuon: added to sqrt(v) and to the rescale's norm (its norm_eps)."""
    max_preconditioner_dim: int = 1024
    """Shampoo block rows; SOAP's max_precond_dim."""
    precondition_frequency: int = 10
    """Shampoo: steps between inverse-root recomputations; SOAP: between eigenbasis updates."""
    qk_clip_tau: float = 0.0
    """MuonClip's QK-clip (docs/muonclip.md): after each step, scale down the query/key rows of every
    attention head whose max pre-softmax logit exceeded tau (0: off). The max logit is logged either way."""


DEFAULT_LR = {"adamw": 3e-3, "adamw4bit": 3e-3, "adamw8bit": 3e-3, "muon": 0.02, "normuon": 0.02, "shampoo": 3e-3,
              "soap": 3e-3}
"""Default lr per optim.name; any other (torch.<Name>) gets 3e-3."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8
    """Sequences per data-parallel rank per micro-step (per rank without parallel.tp; with it, per TP group:
    the tp ranks of a group read the same batch)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step (global batch = batch_size * grad_accum * world size / parallel.tp)."""
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at the last step."""
    grad_clip: float = 1.0
    """Max global grad norm (0: no clipping)."""
    dtype: str = "auto"
    """Compute dtype: auto (bf16 on CUDA with bf16 support, else fp32), bf16 or fp32."""
    seed: int = 0
    fp8_all_gather: str = "off"
    """Block-wise FP8 parameter all-gather (backend fsdp_optim): off, 128x128 or 1x128 (tiles with one
    fp32 scale each; ``--fp8-allgather [TILE]``). Master weights and gradients are unchanged."""
    backend: str = "auto"
    """fsdp_optim (our fully_shard, optimizers, checkpoints), torch (PyTorch FSDP2 + torch/torchao
    optimizers + DCP: adamw and adamw8bit only), or auto (fsdp_optim when installed pieces allow)."""


@dataclass(kw_only=True)
class LogConfig:
    every: int = 1
    """Steps between metrics records (and progress-bar updates)."""
    eval_every: int = 0
    """Steps between held-out evaluations (0: only at the end)."""
    eval_batches: int = 4
    ckpt_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    keep_ckpts: int = 2
    """Checkpoints kept on disk (oldest removed first; 0 keeps all)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU (0: from the table in pretrain.py)."""


@dataclass(kw_only=True)
class ParallelConfig:
    ep: int = 1
    """Expert parallelism (model.kind = moe): each group of ep ranks splits the experts of every MoE
    layer whole, tokens travel to their experts' owners (docs/expert-parallel.md); must divide the
    number of ranks. 1: plain FSDP. A layout, not a model setting: a resume may change it."""
    tp: int = 1
    """Tensor parallelism (model.kind = llama, backend fsdp_optim or torch): each group of tp consecutive
    ranks splits every block's attention heads and SwiGLU hidden units, the vocabulary of the embedding
    and the output head, and the sequence between them (torchtitan's Llama plan with sequence
    parallelism: recipes/_tensor_parallel.py); the W / tp groups are the data-parallel ranks, which
    shard the TP-local tensors (fully_shard over mesh["dp"]). tp must divide the number of ranks, and
    n_heads, n_kv_heads, the FFN hidden size, the vocabulary size and data.seq_len must divide by tp
    (dim = n_heads x head_dim then does too). Each TP group reads one batch: train.batch_size is per
    data-parallel rank. 1: no TP. A layout: a resume may change it."""


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _unknown(key: str, valid: list[str], where: str) -> ValueError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], [v.rsplit(".", 1)[-1] for v in valid], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown config key {key!r} in {where}.{hint} Valid keys: {', '.join(valid)}")


_SCALARS = {"int": int, "float": (int, float), "bool": bool, "str": str}


def _coerce_scalar(value: Any, base: str, key: str, where: str) -> Any:
    """``value`` as a ``base`` (int, float, bool, str; ints are accepted for floats, bools are not numbers)."""
    expected = _SCALARS.get(base)
    is_bool_as_number = base in ("int", "float") and isinstance(value, bool)
    if expected is not None and (not isinstance(value, expected) or is_bool_as_number):
        raise ValueError(f"config key {key!r} in {where} must be {base}, got {value!r} ({type(value).__name__})")
    return float(value) if base == "float" else value


def _coerce(value: Any, f: dataclasses.Field, key: str, where: str) -> Any:
    """Check a TOML value against the field's type (ints are accepted for floats)."""
    typ = str(f.type)
    if typ.startswith("tuple["):  # e.g. tuple[float, float]: a TOML array of exactly that many of them
        kinds = [k.strip() for k in typ[len("tuple["):-1].split(",")]
        example = ", ".join(repr(v) for v in f.default) if isinstance(f.default, tuple) else ""
        if not isinstance(value, list) or len(value) != len(kinds):
            raise ValueError(
                f"config key {key!r} in {where} must be a list of {len(kinds)} {' and '.join(sorted(set(kinds)))}s, "
                f"e.g. [{example}], got {value!r}"
            )
        return tuple(_coerce_scalar(v, k, f"{key}[{i}]", where) for i, (v, k) in enumerate(zip(value, kinds)))
    if "dict" in typ:
        if not isinstance(value, dict):
            raise ValueError(f"config key {key!r} in {where} must be a table, got {value!r}")
        return value
    if "None" in typ and isinstance(value, str) and value.lower() == "none":
        return None
    return _coerce_scalar(value, typ.split(" |")[0], key, where)


# Keys with a fixed set of values, checked as they are read (load_config: before anything else runs).
# The orthogonalization names are fsdp_optim.optimizers.Muon's (tests/recipes/test_orthogonalize_options.py
# checks that they still are).
ORTHOGONALIZE = ("newton_schulz", "gram_newton_schulz")
COEFFICIENTS = ("torch", "polar_express")
GRAM_DTYPES = ("fp16", "bf16", "fp32")
CHOICES: dict[str, tuple[str, ...]] = {
    "optim.orthogonalize": ORTHOGONALIZE, "optim.coefficients": COEFFICIENTS, "optim.gram_dtype": GRAM_DTYPES,
}
_COEFFICIENTS_EXAMPLE = "[[3.4445, -4.775, 2.0315], [3.4445, -4.775, 2.0315]]"


def _allowed(key: str, value: Any, where: str) -> ValueError:
    more = f", or a list of [a, b, c] per iteration, e.g. {_COEFFICIENTS_EXAMPLE}" if key == "optim.coefficients" else ""
    return ValueError(
        f"{key} = {value!r} in {where} is not allowed: it must be one of {', '.join(map(repr, CHOICES[key]))}{more}"
    )


def _coerce_coefficients(value: Any, key: str, where: str) -> str | tuple[tuple[float, float, float], ...]:
    """optim.coefficients: a name of ``COEFFICIENTS``, or 1 to 99 triples of finite numbers (as Muon takes them)."""
    if isinstance(value, str):
        if value not in COEFFICIENTS:
            raise _allowed(key, value, where)
        return value
    triples = isinstance(value, list) and 0 < len(value) < 100 and all(
        isinstance(t, list) and len(t) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in t)
        for t in value
    )
    if not triples:
        raise _allowed(key, value, where)
    return tuple(tuple(float(v) for v in t) for t in value)


def _apply(cfg: Config, key: str, value: Any, where: str) -> None:
    section, _, name = key.partition(".")
    sections = _fields(cfg)
    if section not in sections:
        raise _unknown(key, [f"[{s}]" for s in sections], where)
    sub = getattr(cfg, section)
    fields = _fields(sub)
    if not name or name not in fields:
        raise _unknown(key, [f"{section}.{n}" for n in fields], where)
    if key == "optim.coefficients":
        value = _coerce_coefficients(value, key, where)
    else:
        value = _coerce(value, fields[name], key, where)
        if key in CHOICES and value not in CHOICES[key]:
            raise _allowed(key, value, where)
    setattr(sub, name, value)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """A ``Config`` from TOML ``path`` (None: defaults) with ``section.key=value`` overrides applied."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist; see recipes/configs/ for the shipped ones")
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except UnicodeDecodeError as e:
            raise ValueError(
                f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                "save it as UTF-8"
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}; fix the file") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise _unknown(section, [f"[{s}]" for s in _fields(cfg)], str(path))
            for name, value in table.items():
                _apply(cfg, f"{section}.{name}", value, str(path))
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"override {item!r} must look like section.key=value, e.g. model.dim=128")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        _apply(cfg, key.strip(), value, "--set")
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


@dataclass(frozen=True)
class Range:
    """An allowed interval for a number: ``lo``/``hi`` (None: unbounded), each end closed unless ``*_open``."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v: float) -> bool:  # written so that NaN is never inside
        above = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        below = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return bool(above and below) and math.isfinite(v)

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


POSITIVE, NON_NEGATIVE, UNIT = Range(1), Range(0), Range(0, 1)
# Every number a run uses, and its allowed values (None is always allowed where the type has it).
# A value outside would crash a rank later or silently train something else (a negative grad_clip
# flips the gradients, a min_lr_ratio > 1 makes the lr grow), so check_ranges refuses it up front.
RANGES: dict[str, Range] = {
    "model.dim": POSITIVE, "model.n_layers": POSITIVE, "model.n_heads": POSITIVE, "model.n_kv_heads": POSITIVE,
    "model.vocab_size": NON_NEGATIVE, "model.ffn_dim": POSITIVE, "model.multiple_of": POSITIVE,
    "model.norm_eps": Range(0, lo_open=True), "model.rope_theta": Range(0, lo_open=True),
    "model.max_seq_len": POSITIVE, "model.n_experts": POSITIVE, "model.top_k": POSITIVE,
    "model.moe_ffn_dim": POSITIVE, "model.moe_aux_loss": NON_NEGATIVE,
    "data.seq_len": POSITIVE, "data.val_fraction": Range(0, 1, hi_open=True),
    "optim.lr": NON_NEGATIVE, "optim.adamw_lr": NON_NEGATIVE, "optim.betas": Range(0, 1, hi_open=True),
    "optim.eps": NON_NEGATIVE, "optim.weight_decay": NON_NEGATIVE, "optim.momentum": Range(0, 1, hi_open=True),
    "optim.normuon_beta2": Range(0, 1, hi_open=True), "optim.normuon_eps": NON_NEGATIVE,
    "optim.max_preconditioner_dim": POSITIVE, "optim.precondition_frequency": POSITIVE, "optim.qk_clip_tau": NON_NEGATIVE,
    "train.steps": POSITIVE, "train.batch_size": POSITIVE, "train.grad_accum": POSITIVE,
    "train.warmup_steps": NON_NEGATIVE, "train.min_lr_ratio": UNIT, "train.grad_clip": NON_NEGATIVE,
    "log.every": POSITIVE, "log.eval_every": NON_NEGATIVE, "log.eval_batches": POSITIVE,
    "log.ckpt_every": NON_NEGATIVE, "log.keep_ckpts": NON_NEGATIVE, "log.peak_tflops": NON_NEGATIVE,
    "parallel.ep": POSITIVE, "parallel.tp": POSITIVE,
}
_MEANING = {  # what the special values of a range mean, for the error message
    "train.grad_clip": "0: no clipping", "log.eval_every": "0: only at the end", "log.ckpt_every": "0: only at the end",
    "log.keep_ckpts": "0: keep all", "model.vocab_size": "0: the tokenizer's", "data.val_fraction": "0: no held-out split",
    "log.peak_tflops": "0: from the table in pretrain.py", "optim.qk_clip_tau": "0: off",
}


def check_ranges(cfg: Config) -> None:
    """Raise a ``ValueError`` naming the first key of ``RANGES`` whose value is outside its range."""
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        for v in value if isinstance(value, tuple) else (value,):
            if v is not None and v not in allowed:
                meaning = f" ({_MEANING[key]})" if key in _MEANING else ""
                raise ValueError(
                    f"{key} = {value!r} is out of range: it must be {allowed}{meaning}; change it in the config "
                    "file or with --set"
                )
