"""Model: MoE equals a per-token loop, GQA/RoPE shapes, real Llama 3 sizes, transformers models."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from config import ModelConfig, load_config
from model import MoE, build_model, num_params

from .test_config import CONFIGS


def tiny(**kw) -> ModelConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_dim=48, max_seq_len=16, n_experts=4)
    return ModelConfig(**(base | kw))


def test_moe_equals_per_token_loop():
    torch.manual_seed(0)
    moe = MoE(8, 12, n_experts=5, top_k=2)  # (a router and moe.experts: w1, w3 [E, hidden, dim], w2 [E, dim, hidden])
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 7, 8)
    out = moe(x).reshape(-1, 8)
    xs = x.reshape(-1, 8)
    w, e = moe.router(xs).softmax(-1).topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.stack([
        sum(w[t, j] * moe.experts.w2[e[t, j]] @ (F.silu(moe.experts.w1[e[t, j]] @ xs[t]) * (moe.experts.w3[e[t, j]] @ xs[t])) for j in range(2))
        for t in range(len(xs))
    ])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert moe.experts.w1.shape == (5, 12, 8) and moe.experts.w2.shape == (5, 8, 12)
    assert moe.aux_loss.item() > 0
    torch.nn.init.zeros_(moe.router.weight)  # uniform router probabilities: E * sum_e f_e / E = 1 exactly
    moe(x)
    assert moe.aux_loss.item() == pytest.approx(1.0)


@pytest.mark.parametrize("kind, tie", [("llama", False), ("llama", True), ("moe", True)])
def test_forward_backward_and_causality(kind, tie):
    torch.manual_seed(0)
    m = build_model(tiny(kind=kind, tie_embeddings=tie))
    x = torch.randint(0, 50, (2, 16))
    logits = m(x)
    assert logits.shape == (2, 16, 50)
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 50  # future tokens must not change earlier logits
    torch.testing.assert_close(m(x2)[:, :10], logits[:, :10])
    (F.cross_entropy(logits.flatten(0, 1), x.flatten()) + m.aux_loss()).backward()
    assert all(p.grad is not None for p in m.parameters())
    assert (m.output.weight is m.tok_embeddings.weight) == tie
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_real_llama3_sizes_on_meta():
    # published: Llama 3.2 1B = 1.24B, Llama 3.1 8B = 8.03B parameters
    for name, expected in [("llama3-1b", 1.236e9), ("llama3-8b", 8.030e9)]:
        cfg = load_config(next(p for p in CONFIGS if p.stem == name))
        with torch.device("meta"):
            m = build_model(cfg.model)
        assert math.isclose(num_params(m), expected, rel_tol=2e-3), (name, num_params(m))
    moe = load_config(next(p for p in CONFIGS if p.stem == "moe-tiny"))
    moe.model.vocab_size = 258
    with torch.device("meta"):
        m = build_model(moe.model)
    assert m.layers[0].feed_forward.experts.w1.shape == (8, 256, 128)


def test_bad_heads():
    with pytest.raises(ValueError, match="n_kv_heads"):
        build_model(tiny(n_kv_heads=3))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_model_by_config():
    cfg = tiny(kind="hf", hf_config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    m = build_model(cfg)
    assert m.layers is m.hf.model.layers and len(m.layers) == 2
    assert m(torch.randint(0, 50, (2, 8))).shape == (2, 8, 50)
    with pytest.raises(ValueError, match="model_type"):
        build_model(tiny(kind="hf"))


def test_transformers_missing_says_how_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "transformers":
            raise ImportError("no transformers")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ValueError, match=r"pip install 'fsdp_optim\[hf\]'"):
        build_model(tiny(kind="hf", hf_config={"model_type": "llama"}))
