"""Hugging Face in and out: ``export_hf`` writes what ``transformers``' ``from_pretrained`` loads (the
reference nobody here wrote), with the sharded model's logits, and ``load_hf`` into a meta-built
sharded model round-trips bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_optim
from fsdp_optim._testing import run_distributed

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _config(tied: bool):
    return transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )


def _sharded(cfg, *, device: str = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    for layer in model.model.layers:
        fsdp_optim.fully_shard(layer)
    fsdp_optim.fully_shard(model)
    return model


TOKENS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


@pytest.mark.parametrize("tied", [True, False])
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, tied):
    cfg = _config(tied)

    def fn():
        model = _sharded(cfg)
        with torch.no_grad():
            logits = model(input_ids=TOKENS, use_cache=False).logits
        fsdp_optim.export_hf(model, tmp_path / "hf")
        return logits

    logits = run_distributed(fn, world_size=2)[0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    with torch.no_grad():
        want = loaded(input_ids=TOKENS, use_cache=False).logits
    assert torch.equal(logits, want)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


def test_load_hf_into_a_meta_built_sharded_model_round_trips_bitwise(tmp_path):
    cfg = _config(True)

    def export():
        fsdp_optim.export_hf(_sharded(cfg, seed=0), tmp_path / "a")

    def reload():
        model = _sharded(cfg, device="meta")
        fsdp_optim.load_hf(model, tmp_path / "a")
        fsdp_optim.export_hf(model, tmp_path / "b")
        return dist.get_rank()

    run_distributed(export, world_size=2)
    run_distributed(reload, world_size=3)
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if "rotary" not in k)


def test_load_hf_from_a_missing_directory_raises_on_every_rank(tmp_path):
    def fn():
        model = _sharded(_config(True))
        with pytest.raises(ValueError, match=r"rank 0 cannot read the checkpoint: FileNotFoundError"):
            fsdp_optim.load_hf(model, tmp_path / "nowhere")
        return True

    assert run_distributed(fn, world_size=2, timeout=60) == [True, True]


def test_export_hf_write_error_on_rank_0_raises_on_every_rank(tmp_path):
    """Rank 0 cannot write (here: the target is a file, as a full disk or a read-only mount would
    fail): every rank raises the same error instead of waiting for rank 0 at the next bucket."""
    target = tmp_path / "a_file"
    target.write_text("not a directory")

    def fn():
        model = _sharded(_config(False))
        with pytest.raises(ValueError, match=r"export_hf: writing .* failed on rank 0: FileExistsError"):
            fsdp_optim.export_hf(model, target)
        return True

    assert run_distributed(fn, world_size=2, timeout=60) == [True, True]
