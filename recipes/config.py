"""Pretraining config: dataclasses filled from a TOML file plus ``--set section.key=value`` overrides.

Every key of the TOML file and every override must name a field below; anything else is a
``ValueError`` naming the key, where it came from, and the valid keys (with a close match).
Override values are parsed as TOML values (``--set model.dim=128``, ``--set train.dtype=bf16``,
``--set data.path='"/data/*.txt"'``); a value that is not valid TOML is taken as a plain string.
"""

from __future__ import annotations

import dataclasses
import difflib
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
    """A text file, a folder of .txt/.md files, a glob, or a .bin token file; "" = the embedded corpus."""
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
    """adamw, adamw8bit, muon or shampoo."""
    lr: float | None = None
    """None: the optimizer's default (see DEFAULT_LR)."""
    adamw_lr: float | None = None
    """Muon only: lr of the AdamW fallback (embeddings, head, norms); None: 3e-3."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.95
    """Muon momentum."""
    max_preconditioner_dim: int = 1024
    """Shampoo block rows."""
    precondition_frequency: int = 10
    """Shampoo: steps between inverse-root recomputations."""


DEFAULT_LR = {"adamw": 3e-3, "adamw8bit": 3e-3, "muon": 0.02, "shampoo": 3e-3}


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8
    """Sequences per rank per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step (global batch = batch_size * grad_accum * world size)."""
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
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _unknown(key: str, valid: list[str], where: str) -> ValueError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], [v.rsplit(".", 1)[-1] for v in valid], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown config key {key!r} in {where}.{hint} Valid keys: {', '.join(valid)}")


def _coerce(value: Any, f: dataclasses.Field, key: str, where: str) -> Any:
    """Check a TOML value against the field's type (ints are accepted for floats)."""
    typ = str(f.type)
    if "tuple" in typ and isinstance(value, list):
        return tuple(value)
    if "dict" in typ:
        if not isinstance(value, dict):
            raise ValueError(f"config key {key!r} in {where} must be a table, got {value!r}")
        return value
    if typ.startswith("float") and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if "None" in typ and isinstance(value, str) and value.lower() == "none":
        return None
    base = typ.split(" |")[0]
    expected = {"int": int, "float": (int, float), "bool": bool, "str": str}.get(base)
    if expected is not None and (not isinstance(value, expected) or (base == "int" and isinstance(value, bool))):
        raise ValueError(f"config key {key!r} in {where} must be {base}, got {value!r} ({type(value).__name__})")
    return value


def _apply(cfg: Config, key: str, value: Any, where: str) -> None:
    section, _, name = key.partition(".")
    sections = _fields(cfg)
    if section not in sections:
        raise _unknown(key, [f"[{s}]" for s in sections], where)
    sub = getattr(cfg, section)
    fields = _fields(sub)
    if not name or name not in fields:
        raise _unknown(key, [f"{section}.{n}" for n in fields], where)
    setattr(sub, name, _coerce(value, fields[name], key, where))


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """A ``Config`` from TOML ``path`` (None: defaults) with ``section.key=value`` overrides applied."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist; see recipes/configs/ for the shipped ones")
        with path.open("rb") as fh:
            data = tomllib.load(fh)
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
