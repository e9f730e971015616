"""The recipes' own Llama in Hugging Face's layout: exported, ``LlamaForCausalLM.from_pretrained`` (the
reference nobody here wrote) gives the sharded model's logits; ``--init-from-hf``'s load into a
meta-built sharded model, exported again, round-trips bitwise; the recipe's flags use both."""

from __future__ import annotations

import functools

import pytest
import torch
from config import ModelConfig
from model import Transformer, from_hf, llama_hf_config, to_hf

import fsdp_optim
from fsdp_optim._testing import run_distributed

transformers = pytest.importorskip("transformers")


def _cfg(tied: bool) -> ModelConfig:
    return ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=53, ffn_dim=48, max_seq_len=16,
                       rope_theta=10000.0, tie_embeddings=tied)


def _sharded(cfg: ModelConfig, *, device: str = "cpu", seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
    for layer in model.layers:
        fsdp_optim.fully_shard(layer)
    fsdp_optim.fully_shard(model)
    return model


TOKENS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7]])


@pytest.mark.parametrize("tied", [True, False])
def test_recipe_llama_exports_to_llama_for_causal_lm(tmp_path, tied):
    cfg = _cfg(tied)

    def fn():
        model = _sharded(cfg)
        with torch.no_grad():
            logits = model(TOKENS)
        fsdp_optim.export_hf(model, tmp_path / "hf", config=llama_hf_config(cfg), convert=functools.partial(to_hf, cfg))
        return logits

    logits = run_distributed(fn, world_size=2)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        want = hf(input_ids=TOKENS, use_cache=False).logits.float()
    # Same weights; RMSNorm and RoPE are computed in a different order than transformers' (fp32).
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_init_from_hf_then_export_round_trips_bitwise(tmp_path):
    cfg = _cfg(True)
    convert = functools.partial(to_hf, cfg)

    def export():
        fsdp_optim.export_hf(_sharded(cfg), tmp_path / "a", config=llama_hf_config(cfg), convert=convert)

    def reload():
        model = _sharded(cfg, device="meta")
        fsdp_optim.load_hf(model, tmp_path / "a", convert=functools.partial(from_hf, cfg))
        fsdp_optim.export_hf(model, tmp_path / "b", config=llama_hf_config(cfg), convert=convert)

    run_distributed(export, world_size=2)
    run_distributed(reload, world_size=3)
    from safetensors.torch import load_file

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tensors(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_llama_hf_config_carries_the_tokenizers_bos_and_eos():
    from data import ByteTokenizer

    tok = ByteTokenizer()
    c = llama_hf_config(ModelConfig(vocab_size=258), bos_id=tok.bos_id, eos_id=tok.eos_id)
    assert (c.bos_token_id, c.eos_token_id) == (256, 257)
    assert (llama_hf_config(_cfg(True)).bos_token_id, llama_hf_config(_cfg(True)).eos_token_id) == (None, None)


def test_recipe_flags_export_then_init_from_hf(tmp_path):
    """--export-hf at the end of a run, --init-from-hf at the start of another: the second run starts
    from the first one's weights (its first loss is the first run's next one, far below a fresh start).
    --export-hf on the finished run exports its last checkpoint (the same weights), training nothing."""
    import json

    from .test_pretrain import train

    first = train(tmp_path / "a", "--export-hf", str(tmp_path / "hf"), steps=4)["records"]
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (256, 257)  # the byte tokenizer's, not Llama's 1 and 2
    again = train(tmp_path / "a", "--export-hf", str(tmp_path / "hf2"), steps=4)
    assert again["finished"] and again["resumed_from"].endswith("step_000004")
    assert [r["step"] for r in again["records"]] == [1, 2, 3, 4]
    a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "hf2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    second = train(tmp_path / "b", "--init-from-hf", str(tmp_path / "hf"), steps=1)["records"]
    # The same first batch (a fresh data order): the loaded weights' loss is the trained one's.
    assert second[0]["loss"] < first[0]["loss"] - 0.05, (first, second)
