"""Shape tables of public models (no weights) for planning at scale: ``fsdp-optim plan``.

Every weight's name (Hugging Face naming) and shape is generated from the model's config
dims below; nothing is read at run time. Dims are those of the official configs (Meta
llama-models ``sku_list.py``; Qwen/Qwen3-235B-A22B ``config.json``; deepseek-ai/DeepSeek-V3
``inference/configs/config_671B.json``; moonshotai/Kimi-K2 ``config.json``; openai/gpt-oss
``gpt_oss/torch/model.py``), as collected with sources in the repository's test data ``tests/data/model_shapes.json``,
which ``tests/sharding/test_presets.py`` checks every preset against.

Routed experts are stacked per layer into one 3-D ``[E, rows, cols]`` tensor per projection
(``mlp.experts.gate_proj.weight`` etc.), as torchtitan's grouped experts and gpt-oss store them.
Under Muon these get ``expert()`` blocks, one ``[rows, cols]`` matrix per expert: the blocks are
identical to the per-expert 2-D matrices of the checkpoints, and stacking keeps Kimi-K2's ~70K
expert tensors down to three per layer.

Buckets: the embedding, one bucket per ``bucket_layers`` transformer layers, and the head with
the final norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._blocks import BlockSpec
from ._plan import TensorSpec

__all__ = ["ModelPreset", "PRESETS", "preset_names", "preset_shapes", "preset_buckets"]

Shape = tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """Architecture dims of one decoder-only transformer (enough to list every weight)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128
    intermediate_size: int = 0
    """Dense MLP width (dense layers only)."""
    attention: str = "gqa"
    """``"gqa"`` (q/k/v/o projections) or ``"mla"`` (DeepSeek multi-head latent attention)."""
    qk_norm: bool = False
    attention_bias: bool = False
    attention_sinks: bool = False
    # MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    """Routed experts per token (the router's top-k; gpt-oss: ``experts_per_token``): EP's token traffic."""
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    num_dense_layers: int = 0
    """The first ``num_dense_layers`` layers use the dense MLP (DeepSeek ``first_k_dense_replace``)."""
    router: str = "plain"
    """``"plain"`` (``mlp.gate.weight``), ``"correction_bias"`` (+ ``e_score_correction_bias``,
    DeepSeek/Kimi) or ``"gpt_oss"`` (``mlp.router.weight`` + bias, fused gate_up experts with biases)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in [
        # Llama 3.1 (Meta llama-models sku_list.py; intermediate size by the FeedForward rule)
        ModelPreset(name="llama3-8b", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                    num_kv_heads=8, intermediate_size=14336),
        ModelPreset(name="llama3-70b", vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                    num_kv_heads=8, intermediate_size=28672),
        ModelPreset(name="llama3-405b", vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128,
                    num_kv_heads=8, intermediate_size=53248),
        # Qwen3-235B-A22B (config.json): every layer MoE, qk-norm, 128 experts of width 1536
        ModelPreset(name="qwen3-235b-a22b", vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64,
                    num_kv_heads=4, qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536),
        # DeepSeek-V3 (config_671B.json). The multi-token-prediction module (HF model.layers.61, 11.6B
        # unique parameters) is NOT included: the published 671B and total_params_computed in
        # model_shapes.json count the main model only.
        ModelPreset(name="deepseek-v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
                    num_kv_heads=128, intermediate_size=18432, attention="mla", q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
                    num_dense_layers=3,
                    router="correction_bias"),
        # gpt-oss-120b (gpt_oss/torch/model.py ModelConfig; HF GptOss names): biases, sinks, fused experts
        ModelPreset(name="gpt-oss-120b", vocab_size=201088, hidden_size=2880, num_layers=36, num_heads=64,
                    num_kv_heads=8, head_dim=64, attention_bias=True, attention_sinks=True, num_experts=128,
                    num_experts_per_tok=4, moe_intermediate_size=2880, router="gpt_oss"),
        # Kimi-K2 (config.json; DeepseekV3 architecture): 384 experts, 64 heads, 1 dense layer, no MTP
        ModelPreset(name="kimi-k2", vocab_size=163840, hidden_size=7168, num_layers=61, num_heads=64,
                    num_kv_heads=64, intermediate_size=18432, attention="mla", q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
                    num_dense_layers=1,
                    router="correction_bias"),
    ]
}


def preset_names() -> list[str]:
    return list(PRESETS)


def _get(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def _attention(m: ModelPreset) -> list[tuple[str, Shape]]:
    h = m.hidden_size
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        return [
            ("self_attn.q_a_proj.weight", (m.q_lora_rank, h)),
            ("self_attn.q_a_layernorm.weight", (m.q_lora_rank,)),
            ("self_attn.q_b_proj.weight", (m.num_heads * qk, m.q_lora_rank)),
            ("self_attn.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h)),
            ("self_attn.kv_a_layernorm.weight", (m.kv_lora_rank,)),
            ("self_attn.kv_b_proj.weight", (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
            ("self_attn.o_proj.weight", (h, m.num_heads * m.v_head_dim)),
        ]
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    out: list[tuple[str, Shape]] = []
    for proj, rows_ in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append((f"self_attn.{proj}.weight", (rows_, h)))
        if m.attention_bias:
            out.append((f"self_attn.{proj}.bias", (rows_,)))
    out.append(("self_attn.o_proj.weight", (h, q)))
    if m.attention_bias:
        out.append(("self_attn.o_proj.bias", (h,)))
    if m.qk_norm:
        out += [("self_attn.q_norm.weight", (m.head_dim,)), ("self_attn.k_norm.weight", (m.head_dim,))]
    if m.attention_sinks:
        out.append(("self_attn.sinks", (m.num_heads,)))
    return out


def _mlp(m: ModelPreset, layer: int) -> list[tuple[str, Shape]]:
    h = m.hidden_size
    if not m.is_moe or layer < m.num_dense_layers:
        i = m.intermediate_size
        return [("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)), ("mlp.down_proj.weight", (h, i))]
    e, i = m.num_experts, m.moe_intermediate_size
    if m.router == "gpt_oss":  # HF GptOss: gate_up_proj [E, hidden, 2*inter], down_proj [E, inter, hidden]
        return [
            ("mlp.router.weight", (e, h)),
            ("mlp.router.bias", (e,)),
            ("mlp.experts.gate_up_proj", (e, h, 2 * i)),
            ("mlp.experts.gate_up_proj_bias", (e, 2 * i)),
            ("mlp.experts.down_proj", (e, i, h)),
            ("mlp.experts.down_proj_bias", (e, h)),
        ]
    out: list[tuple[str, Shape]] = [("mlp.gate.weight", (e, h))]
    if m.router == "correction_bias":
        out.append(("mlp.gate.e_score_correction_bias", (e,)))
    out += [
        ("mlp.experts.gate_proj.weight", (e, i, h)),
        ("mlp.experts.up_proj.weight", (e, i, h)),
        ("mlp.experts.down_proj.weight", (e, h, i)),
    ]
    if m.num_shared_experts:
        s = m.num_shared_experts * i
        out += [
            ("mlp.shared_experts.gate_proj.weight", (s, h)),
            ("mlp.shared_experts.up_proj.weight", (s, h)),
            ("mlp.shared_experts.down_proj.weight", (h, s)),
        ]
    return out


def _layer(m: ModelPreset, layer: int) -> list[tuple[str, Shape]]:
    h = m.hidden_size
    names = [("input_layernorm.weight", (h,)), *_attention(m), ("post_attention_layernorm.weight", (h,)), *_mlp(m, layer)]
    return [(f"model.layers.{layer}.{n}", s) for n, s in names]


def preset_shapes(name: str, *, bucket_layers: int = 1) -> list[tuple[str, list[tuple[str, Shape]]]]:
    """``(bucket_name, [(fqn, shape), ...])`` per bucket: embedding, layers in groups of
    ``bucket_layers``, head with the final norm."""
    m = _get(name)
    if bucket_layers < 1:
        raise ValueError(f"bucket_layers must be >= 1, got {bucket_layers}")
    buckets: list[tuple[str, list[tuple[str, Shape]]]] = [
        ("embed", [("model.embed_tokens.weight", (m.vocab_size, m.hidden_size))])
    ]
    for first in range(0, m.num_layers, bucket_layers):
        last = min(first + bucket_layers, m.num_layers) - 1
        label = f"layers.{first}" if first == last else f"layers.{first}-{last}"
        buckets.append((label, [t for layer in range(first, last + 1) for t in _layer(m, layer)]))
    buckets.append(("head", [("model.norm.weight", (m.hidden_size,)), ("lm_head.weight", (m.vocab_size, m.hidden_size))]))
    return buckets


def preset_buckets(
    name: str,
    *,
    rule: Callable[[str, torch.Tensor, object], BlockSpec],
    bucket_layers: int = 1,
    itemsize: int = 4,
) -> list[tuple[str, list[TensorSpec]]]:
    """Planner input for preset ``name``: each weight's block spec from an optimizer's block
    ``rule`` (called with a meta tensor of the weight's shape and ``module=None``)."""
    out = []
    for bname, tensors in preset_shapes(name, bucket_layers=bucket_layers):
        specs = [
            TensorSpec(name=fqn, shape=shape, spec=rule(fqn, torch.empty(shape, device="meta"), None), itemsize=itemsize)
            for fqn, shape in tensors
        ]
        out.append((bname, specs))
    return out
