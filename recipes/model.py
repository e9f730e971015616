"""A Llama-3-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) and its MoE variant.

``Transformer.layers`` is an ``nn.ModuleList`` so the recipe can shard layer by layer. The MoE
feed-forward is a router plus an ``experts`` module with 3-D ``[E, r, c]`` weights (one matrix per
expert, which is what Muon's ``expert()`` blocks keep whole), applied dropless with a grouped matmul
over the routed tokens; the recipe may split the experts over ranks (``parallel.ep``).
``Attention.record_logits`` records each head's max logit (for MuonClip's QK-clip and the
``max_attn_logit`` metric): ``"exact"`` computes attention explicitly from the logits it records,
``"measure"`` keeps SDPA and measures the maxima in a no-grad pass that keeps nothing for backward.
``build_model`` also makes a Hugging Face ``transformers`` model from a config (no download).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from config import ModelConfig
from fsdp_optim.optimizers import attention_with_max_logits, measure_max_logits
from fsdp_optim.sharding import grouped_linear


def ffn_hidden(dim: int, multiple_of: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, rounded up to ``multiple_of``."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of each head by the position's angle; x is [B, H, T, D]."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        if cfg.dim % cfg.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.dim ({cfg.dim}) must be a multiple of model.n_heads ({cfg.n_heads}), and n_heads a "
                f"multiple of model.n_kv_heads ({self.n_kv_heads})"
            )
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.wo.is_out_proj = True  # residual-branch output: smaller init (see Transformer.init_module)
        self.record_logits: str | None = None
        """``"exact"``: explicit attention (O(T^2) memory) recording each head's max logit from its own
        logits (QK-clip); ``"measure"``: SDPA plus a no-grad pass over query chunks (logging only)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Split the projections into heads: [batch, time, heads * head_dim] -> [batch, heads, time, head_dim].
        # The number of heads comes from the shapes (d = head_dim): under tensor parallelism (parallel.tp)
        # wq, wk, wv hold this rank's n_heads / tp and n_kv_heads / tp heads, whole.
        q = rearrange(self.wq(x), "b t (h d) -> b h t d", d=self.head_dim)
        k = rearrange(self.wk(x), "b t (h d) -> b h t d", d=self.head_dim)
        v = rearrange(self.wv(x), "b t (h d) -> b h t d", d=self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.record_logits == "exact":  # the same attention, explicitly, keeping each head's max logit
            y = attention_with_max_logits(self, q, k, v, causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
            if self.record_logits == "measure":
                measure_max_logits(self, q, k, causal=True)
        return self.wo(rearrange(y, "b h t d -> b t (h d)"))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w2.is_out_proj = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """E SwiGLU experts, ``w1, w3: [E, hidden, dim]`` and ``w2: [E, dim, hidden]``, meeting the
    experts-module contract of ``fsdp_optim.sharding.expert_parallel``: ``forward(x, counts)`` takes
    tokens sorted by expert (``counts[e]`` rows of expert e, contiguous) and returns their outputs
    in the same order. ``grouped_linear`` multiplies each expert's rows only: no padding."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        h = F.silu(grouped_linear(x, self.w1, num_tokens_per_expert)) * grouped_linear(x, self.w3, num_tokens_per_expert)
        return grouped_linear(h, self.w2, num_tokens_per_expert)


class MoE(nn.Module):
    """A top-k router and ``experts`` (``Experts``), dropless.

    Each token's k (token, expert) assignments are sorted stably by expert, the experts run on exactly
    those rows with the per-expert counts (under expert parallelism the ``experts`` module sends the
    rows to their owners and back: the same computation, other ranks), the outputs are put back in
    assignment order and combined with the router's renormalized top-k weights. ``aux_loss`` is the
    Switch Transformer load-balancing term E * sum_e(fraction of routed tokens_e * mean router
    probability_e) (Fedus et al. 2021, eq. 4).
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"model.top_k ({top_k}) must be between 1 and model.n_experts ({n_experts})")
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(dim, hidden, n_experts)
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, dim]
        probs = self.router(x).float().softmax(-1)  # [N, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [N, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat = experts.flatten()  # [N*k]: assignment a -> token a // k
        counts = torch.bincount(flat, minlength=self.n_experts)
        self.aux_loss = self.n_experts * (counts.float() / flat.numel() * probs.mean(0)).sum()

        order = flat.argsort(stable=True)  # assignments grouped by expert, token order kept within each
        y = self.experts(x[order // self.top_k], counts)  # [N*k, dim], in sorted order
        out = torch.empty_like(y).index_copy(0, order, y)  # back to assignment order
        out = (out.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(1)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        hidden = cfg.ffn_dim or ffn_hidden(cfg.dim, cfg.multiple_of)
        if cfg.kind == "moe":
            self.feed_forward = MoE(cfg.dim, cfg.moe_ffn_dim or hidden, cfg.n_experts, cfg.top_k)
        else:
            self.feed_forward = FeedForward(cfg.dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # torch's default inits draw from the RNG; discard them so init_weights() starts from the caller's
        # RNG state, as fsdp_optim.init_weights does after a meta-device build (same values either way).
        with torch.random.fork_rng(devices=[]):
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not any(p.is_meta for p in self.parameters()):  # on meta: init after sharding (model.meta_init)
            self.init_weights()

    @torch.no_grad()
    def init_module(self, m: nn.Module) -> None:
        """Initialize ``m``'s own parameters and buffers: Normal(0, 0.02), output projections (attention
        ``wo``, SwiGLU ``w2``) scaled by 1/sqrt(2 * n_layers) as in GPT-2, norms 1, RoPE tables.

        Per module, so ``fsdp_optim.init_weights(model, model.init_module)`` can run it on a sharded,
        meta-built model at full shapes (and gets the same values as an unsharded init)."""
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        if m is self:
            cos, sin = rope_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, Experts):
            nn.init.normal_(m.w1, std=std)
            nn.init.normal_(m.w3, std=std)
            nn.init.normal_(m.w2, std=out_std)
        elif isinstance(m, nn.Linear) and not (m is self.output and self.cfg.tie_embeddings):
            nn.init.normal_(m.weight, std=out_std if getattr(m, "is_out_proj", False) else std)

    def init_weights(self) -> None:
        for m in self.modules():
            self.init_module(m)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).float()

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the MoE layers' load-balancing losses of the last forward (0 for dense models)."""
        return sum((l.feed_forward.aux_loss for l in self.layers if isinstance(l.feed_forward, MoE)), 0.0)


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind the same interface: ``layers``, ``forward -> logits``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        try:
            import transformers
        except ImportError as e:
            raise ValueError(
                "model.kind = 'hf' needs Hugging Face transformers: pip install 'fsdp_optim[hf]'"
            ) from e
        kwargs = dict(cfg.hf_config)
        model_type = kwargs.pop("model_type", None)
        if not model_type:
            raise ValueError("model.hf_config must name a model_type, e.g. model.hf_config = {model_type = 'llama', ...}")
        kwargs.setdefault("vocab_size", cfg.vocab_size)
        kwargs.setdefault("max_position_embeddings", cfg.max_seq_len)
        kwargs.setdefault("tie_word_embeddings", cfg.tie_embeddings)
        hf_cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
        if cfg.meta_init:
            raise ValueError("model.meta_init is not supported for model.kind = 'hf'; set it false")
        self.cfg = cfg
        self.hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
        self.max_seq_len = hf_cfg.max_position_embeddings
        # The decoder blocks: model.model.layers for Llama/Qwen/Mistral-style models.
        self.layers = getattr(getattr(self.hf, "model", self.hf), "layers", None)
        if self.layers is None:
            raise ValueError(f"transformers model_type {model_type!r} has no .model.layers to shard per layer")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's max_position_embeddings {self.max_seq_len}")
        return self.hf(input_ids=tokens, use_cache=False).logits.float()

    def aux_loss(self) -> float:
        return 0.0


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.kind in ("llama", "moe"):
        return Transformer(cfg)
    if cfg.kind == "hf":
        return HFCausalLM(cfg)
    raise ValueError(f"model.kind must be 'llama', 'moe' or 'hf', got {cfg.kind!r}")


def max_seq_len(model: nn.Module) -> int:
    return model.max_seq_len if isinstance(model, HFCausalLM) else model.cfg.max_seq_len


def max_seq_len_key(cfg: ModelConfig) -> str:
    """The config key that sets the model's longest sequence (what an error tells the user to raise)."""
    if cfg.kind == "hf" and "max_position_embeddings" in cfg.hf_config:
        return "model.hf_config.max_position_embeddings"
    return "model.max_seq_len"


def model_vocab(cfg: ModelConfig) -> tuple[int, str]:
    """The model's vocabulary size and the config key that sets it (``hf_config`` wins for kind = hf)."""
    if cfg.kind == "hf" and "vocab_size" in cfg.hf_config:
        return int(cfg.hf_config["vocab_size"]), "model.hf_config.vocab_size"
    return cfg.vocab_size, "model.vocab_size"


def num_params(model: nn.Module, *, exclude_embedding: bool = False) -> int:
    """Parameter count (tied weights once); with ``exclude_embedding``, minus the input embedding table
    (a lookup, no matmul FLOPs; an untied output head is kept)."""
    seen, n = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embedding and ("tok_embeddings" in name or "embed_tokens" in name):
            if not (isinstance(model, Transformer) and model.cfg.tie_embeddings):
                continue
        n += p.numel()
    return n


# ---- Hugging Face layout of the dense Llama --------------------------------------------------------
# Names map one to one onto transformers' LlamaForCausalLM. RoPE differs in layout only: ours rotates
# interleaved pairs (x[2i], x[2i+1]) of each head, transformers' rotate_half rotates (x[i], x[i+d/2])
# with the same frequencies, so each head's rows of wq and wk are permuted: HF row j < d/2 is our
# row 2j, HF row j + d/2 our row 2j + 1 (the permutation transformers' own Llama conversion applies
# to Meta's checkpoints).
_HF_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_HF_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _rope_heads(cfg: ModelConfig, suffix: str) -> int | None:
    if suffix == "attention.wq.weight":
        return cfg.n_heads
    if suffix == "attention.wk.weight":
        return cfg.n_kv_heads or cfg.n_heads
    return None


def hf_name(cfg: ModelConfig, name: str) -> str:
    """The transformers name of one of ours (others, e.g. the RoPE tables, are not in HF files)."""
    if name in _HF_TOP:
        return _HF_TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _HF_NAMES:
        return f"model.layers.{parts[1]}.{_HF_NAMES[parts[2]]}"
    return name


def to_hf(cfg: ModelConfig, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """``export_hf``'s ``convert`` for the dense Llama: (our name, tensor) -> (HF name, HF layout)."""
    heads = _rope_heads(cfg, name.split(".", 2)[-1]) if name.startswith("layers.") else None
    if heads is not None:
        t = rearrange(t, "(h d two) c -> (h two d) c", h=heads, two=2)
    return hf_name(cfg, name), t


def from_hf(cfg: ModelConfig, name: str):
    """``load_hf``'s ``convert``: our name -> (HF name, HF layout -> ours)."""
    heads = _rope_heads(cfg, name.split(".", 2)[-1]) if name.startswith("layers.") else None
    if heads is None:
        return hf_name(cfg, name), lambda t: t
    return hf_name(cfg, name), lambda t: rearrange(t, "(h two d) c -> (h d two) c", h=heads, two=2)


def llama_hf_config(cfg: ModelConfig, bos_id: int | None = None, eos_id: int | None = None):
    """The transformers ``LlamaConfig`` of the dense Llama (for ``export_hf``), with the tokenizer's
    ``bos_id`` / ``eos_id`` (None: none; LlamaConfig's own defaults, 1 and 2, are not the byte
    tokenizer's 256 and 257, so ``generate`` would stop at the wrong token)."""
    import transformers

    if cfg.kind != "llama":
        raise ValueError(f"Hugging Face export/import supports model.kind = 'llama' or 'hf', not {cfg.kind!r}")
    return transformers.LlamaConfig(
        bos_token_id=bos_id, eos_token_id=eos_id,
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
        intermediate_size=cfg.ffn_dim or ffn_hidden(cfg.dim, cfg.multiple_of), rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu", attention_bias=False, mlp_bias=False,
    )


def hf_convert(model: nn.Module, cfg: ModelConfig, tokenizer: object | None = None):
    """``(config, load_hf convert, export_hf convert)`` between the recipe's names and the Hub's; the
    config carries ``tokenizer``'s BOS/EOS ids (unless model.hf_config sets them)."""
    import copy
    import functools

    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    if cfg.kind == "hf":  # the wrapped transformers model: names behind "hf."
        config = copy.deepcopy(model.hf.config)
        for key, value in (("bos_token_id", bos), ("eos_token_id", eos)):
            if key not in cfg.hf_config:
                setattr(config, key, value)
        return (
            config,
            lambda name: (name.removeprefix("hf."), lambda t: t),
            lambda name, t: (name.removeprefix("hf."), t),
        )
    config = llama_hf_config(cfg, bos_id=bos, eos_id=eos)
    return config, functools.partial(from_hf, cfg), functools.partial(to_hf, cfg)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The recipe's attention modules (none in a transformers model)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def set_logit_recording(layers: list[Attention], mode: str | None) -> None:
    """How the attention ``layers`` record each head's max logit: ``"exact"`` (explicit attention, the
    logits QK-clip scales by), ``"measure"`` (SDPA plus a no-grad pass: logging only, no memory kept for
    backward) or ``None`` (nothing recorded)."""
    for m in layers:
        m.record_logits = mode
