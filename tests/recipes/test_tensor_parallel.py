"""Issue #35 item 5 in the recipe: tensor parallelism (``parallel.tp``).

The tiny Llama at W = 4 with (dp 2, tp 2) trains the same model as (dp 4, tp 1) on the same global
batch (train.batch_size is per data-parallel rank: 4 at dp 2 = 2 at dp 4), a checkpoint saved at one
layout resumes at the other, the attention runs on TP-local heads, and bad settings are one line
before any rank starts.
"""

import json

import pytest
import torch

import pretrain
from config import ModelConfig, load_config
from fsdp_optim._testing import DistributedTestError, run_distributed
from model import Attention, rope_tables

from .test_launch import _check
from .test_pretrain import CONFIGS, ROOT, SMALL

# tiny.toml shrunk (test_pretrain's SMALL), AdamW (Muon below), a
# vocabulary that divides by 2 and 4 (the byte tokenizer's 258 does not divide by 4).
BASE = ["--config", str(CONFIGS / "tiny.toml"), *SMALL, "--optimizer", "adamw", "--set", "model.vocab_size=260"]
DP4 = ["--set", "train.batch_size=2"]  # 4 data-parallel ranks x 2 sequences
TP2 = ["--set", "train.batch_size=4", "--set", "parallel.tp=2"]  # 2 data-parallel ranks (TP groups) x 4 sequences
# Measured over 3 steps (recipes/README.md, "Tensor parallelism"): (dp 2, tp 2) vs (dp 4, tp 1) differ by
# <= 3e-7 relative in loss and grad_norm; the noise floor of the same global batch split otherwise at
# dp 4 (batch 1 x grad_accum 2 vs batch 2) is 1e-7 to 3e-7. Both are float summation order.
RTOL = 1e-5


def tp_train(out, *args, steps=3, world_size=4):
    argv = [*BASE, "--steps", str(steps), "--out", str(out), *args]
    return run_distributed(lambda: pretrain.main(argv), world_size=world_size, timeout=300)[0]


def same_losses(a: list[dict], b: list[dict], rtol: float = RTOL, keys=("loss", "grad_norm", "eval_loss")) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for key in keys:
            if x.get(key) is not None and y.get(key) is not None:  # (a run evaluates at its last step)
                assert x[key] == pytest.approx(y[key], rel=rtol), (x["step"], key, x[key], y[key])


def test_tp_in_config_files_and_overrides(tmp_path):
    for name in ("tiny", "llama3-1b", "llama3-8b"):  # the Llama configs carry [parallel] tp with its default
        assert load_config(CONFIGS / f"{name}.toml").parallel.tp == 1
    assert load_config(CONFIGS / "tiny.toml", ["parallel.tp=2"]).parallel.tp == 2
    path = tmp_path / "c.toml"
    path.write_text("[parallel]\ntp = 4\n")
    assert load_config(path).parallel.tp == 4
    with pytest.raises(ValueError, match="config key 'parallel.tp' in --set must be int"):
        load_config(None, ["parallel.tp=1.5"])


def test_attention_runs_on_tp_local_heads():
    # Column slices of wq/wk/wv (whole heads) and the matching row slice of wo, as ColwiseParallel and
    # RowwiseParallel leave them: the two halves' outputs sum to the whole attention's.
    torch.manual_seed(0)
    cfg = ModelConfig(dim=48, n_heads=4, n_kv_heads=2, max_seq_len=16)
    full = Attention(cfg)
    for lin in (full.wq, full.wk, full.wv, full.wo):
        torch.nn.init.normal_(lin.weight, std=0.2)
    x = torch.randn(2, 16, 48)
    cos, sin = rope_tables(12, 16, 10000.0)
    halves = []
    for t in range(2):
        part = Attention(cfg)
        q_rows, kv_rows = slice(t * 24, (t + 1) * 24), slice(t * 12, (t + 1) * 12)
        part.wq.weight.data = full.wq.weight.data[q_rows].clone()
        part.wk.weight.data = full.wk.weight.data[kv_rows].clone()
        part.wv.weight.data = full.wv.weight.data[kv_rows].clone()
        part.wo.weight.data = full.wo.weight.data[:, q_rows].clone()
        halves.append(part(x, cos, sin))
    torch.testing.assert_close(halves[0] + halves[1], full(x, cos, sin), rtol=1e-5, atol=1e-6)


def test_tp2_trains_the_same_model_as_dp4(tmp_path):
    dp4 = tp_train(tmp_path / "dp4", *DP4)["records"]
    tp2 = tp_train(tmp_path / "tp2", *TP2)["records"]
    # the same global batch: 4 x 2 = 2 x 4 sequences of 32 tokens per step
    assert [r["tokens"] for r in tp2] == [r["tokens"] for r in dp4] == [k * 8 * 32 for k in (1, 2, 3)]
    same_losses(tp2, dp4)
    assert tp2[-1]["loss"] < tp2[0]["loss"] and tp2[-1]["max_attn_logit"] > 0
    assert json.loads((tmp_path / "tp2" / "config.json").read_text())["parallel"]["tp"] == 2
    # The noise floor: the same global batch at dp 4 as 1 sequence x 2 micro-steps.
    accum = tp_train(tmp_path / "accum", "--set", "train.batch_size=1", "--set", "train.grad_accum=2")["records"]
    same_losses(accum, dp4, keys=("loss", "grad_norm"))  # (its held-out batch is 1 x 4 windows, not 2 x 4)
    # Muon (each TP-sharded matrix assembled inside its TP group) with QK-clip on TP-local heads: the same
    # model up to last-bit gradient differences through Muon's bf16 Newton-Schulz. Measured over 3 steps:
    # loss 1.8e-5, grad_norm 2.6e-4, max_attn_logit 1.6e-3 relative (the grad_accum split at dp 4: 8e-6,
    # 1.7e-5, 2.8e-3).
    muon = ["--optimizer", "muon", "--set", "optim.qk_clip_tau=0.05"]
    muon_dp4 = tp_train(tmp_path / "muon_dp4", *DP4, *muon)["records"]
    muon_tp2 = tp_train(tmp_path / "muon_tp2", *TP2, *muon)["records"]
    same_losses(muon_tp2, muon_dp4, rtol=1e-4, keys=("loss", "eval_loss"))
    same_losses(muon_tp2, muon_dp4, rtol=1e-3, keys=("grad_norm",))
    same_losses(muon_tp2, muon_dp4, rtol=1e-2, keys=("max_attn_logit",))
    assert muon_tp2[1]["max_attn_logit"] < muon_tp2[0]["max_attn_logit"]  # clipped to tau = 0.05 after step 1
    # torch.optim.NAdam through WholeTensorOptimizer: each TP-split tensor stepped whole at a home TP rank.
    nadam = ["--optimizer", "torch.NAdam"]
    same_losses(tp_train(tmp_path / "nadam_tp2", *TP2, *nadam)["records"],
                tp_train(tmp_path / "nadam_dp4", *DP4, *nadam)["records"])
    # PyTorch FSDP2 + the same TP plan (the side-by-side peer) trains the same model too.
    torch_tp2 = tp_train(tmp_path / "torch", *TP2, "--set", "train.backend=torch")
    assert torch_tp2["backend"] == "torch"
    same_losses(torch_tp2["records"], dp4)


@pytest.mark.parametrize("saved, resumed", [(TP2, DP4), (DP4, TP2)], ids=["tp2-to-dp4", "dp4-to-tp2"])
def test_resume_across_tp_equals_the_uninterrupted_run(tmp_path, check_at, saved, resumed):
    ckpt = ["--set", "log.ckpt_every=2", "--set", "log.keep_ckpts=0"]
    ref = tp_train(tmp_path / "ref", *ckpt, *DP4, steps=4)["records"]
    tp_train(tmp_path / "run", *ckpt, *saved, steps=2)
    rc, out, err = check_at(tmp_path / "run", 4, *ckpt, *resumed, "--resume", "--steps", "4")
    assert rc == 0 and "check passed for 4 ranks" in out, err
    res = tp_train(tmp_path / "run", *ckpt, *resumed, "--resume", steps=4)
    assert res["resumed_from"].endswith("step_000002") and [r["step"] for r in res["records"]] == [1, 2, 3, 4]
    same_losses(res["records"], ref)


@pytest.fixture
def check_at(capsys, monkeypatch):
    """``check_at(out, W, *args)``: the pre-flight ``--check W`` of the TP config (exit code, stdout, stderr)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    return lambda out, world, *args: _check(capsys, *BASE, "--out", str(out), *args, "--check", str(world))


def test_preflight_refuses_bad_tp(tmp_path, check_at):
    out = tmp_path / "run"

    def refused(world, *args, match):
        rc, _, err = check_at(out, world, *args)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith(f"error: {match}"), (args, err)

    refused(3, "--set", "parallel.tp=2", match="parallel.tp = 2 must divide the number of ranks (3); choose one of "
                                               "[1, 3], or run on a multiple of 2 ranks")
    refused(8, "--set", "parallel.tp=8", match="parallel.tp = 8 must divide model.n_heads = 4 (query heads, split over "
                                               "the TP ranks); set parallel.tp to a divisor of it (4), or model.n_heads "
                                               "to a multiple of 8")
    refused(4, "--set", "parallel.tp=4", match="parallel.tp = 4 must divide model.n_kv_heads = 2 (key/value heads")
    kv4 = ["--set", "parallel.tp=4", "--set", "model.n_kv_heads=4"]
    refused(4, *kv4, "--set", "model.ffn_dim=66", match="parallel.tp = 4 must divide model.ffn_dim = 66 (SwiGLU hidden "
                                                       "units, split over the TP ranks); set parallel.tp to a divisor of "
                                                       "it (2), or model.ffn_dim to a multiple of 4")
    refused(4, *kv4, "--set", "model.vocab_size=0", match="parallel.tp = 4 must divide model.vocab_size = 258 "
                                                          "(embedding rows and output columns")
    refused(4, *kv4, "--set", "data.seq_len=30", match="parallel.tp = 4 must divide data.seq_len = 30")
    refused(4, "--set", "parallel.tp=2", "--optimizer", "adamw8bit", "--set", "train.backend=torch",
            match="parallel.tp = 2 with optim.name = 'adamw8bit' is not supported: the torch backend runs tensor "
                  "parallelism with adamw only")
    refused(4, "--set", "parallel.tp=2", "--set", "model.tie_embeddings=true",
            match="parallel.tp = 2 with model.tie_embeddings = true is not supported")
    refused(4, "--set", "parallel.tp=2", "--set", "model.meta_init=true",
            match="parallel.tp = 2 with model.meta_init = true is not supported")
    refused(4, "--set", "parallel.tp=0", match="parallel.tp = 0 is out of range: it must be >= 1")
    moe = ["--set", 'model.kind="moe"', "--set", "model.n_experts=4", "--set", "parallel.tp=2"]
    refused(4, *moe, "--set", "parallel.ep=2", match="parallel.tp = 2 with parallel.ep = 2: EP x TP is not supported")
    refused(4, *moe, match="parallel.tp = 2 needs model.kind = 'llama'")
    assert not out.exists()
    rc, stdout, _ = check_at(out, 4, *TP2)
    assert rc == 0 and "check passed for 4 ranks" in stdout and "--nproc_per_node=4" in stdout
    # Under torchrun (no pre-flight) the ranks refuse too, before any collective.
    with pytest.raises(DistributedTestError, match=r"parallel.tp = 4 must divide the number of ranks \(2\)"):
        tp_train(tmp_path / "t", *kv4, world_size=2)


def _worst(a: list[dict], b: list[dict], key: str) -> float:
    return max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b) if x.get(key) is not None and y.get(key) is not None)


@pytest.mark.parametrize("opt", ["shampoo", "soap", "normuon"])
def test_tp2_trains_the_same_model_as_dp4_with_the_block_optimizers(tmp_path, opt):
    """Shampoo and SOAP (blocks a TP cut splits assembled in runs over the TP ranks) and NorMuon (each
    TP-sharded matrix normalized at its Newton-Schulz home): (dp 2, tp 2) trains the same model as (dp 4,
    tp 1) within the noise floor of last-bit gradient differences, measured in the test as the same global
    batch at dp 4 split into 1 sequence x 2 micro-steps (NorMuon's bf16 Newton-Schulz and SOAP's
    eigenbases amplify such bits). Measured over 3 steps, loss / grad_norm relative, tp 2 (floor): Shampoo
    8.7e-8 (0) / 1.3e-7 (1.2e-7); SOAP 1.1e-4 (8.9e-5) / 1.7e-4 (6.7e-3); NorMuon 8.7e-7 (2.4e-6) / 2.2e-4
    (1.2e-4). Bound: 10 x the floor, at least 1e-5."""
    args = ["--optimizer", opt]
    dp4 = tp_train(tmp_path / "dp4", *DP4, *args)["records"]
    tp2 = tp_train(tmp_path / "tp2", *TP2, *args)["records"]
    accum = tp_train(tmp_path / "accum", "--set", "train.batch_size=1", "--set", "train.grad_accum=2", *args)["records"]
    for key in ("loss", "grad_norm"):
        got, floor = _worst(tp2, dp4, key), _worst(accum, dp4, key)
        print(f"{opt}: {key} relative difference (dp 2, tp 2) vs (dp 4, tp 1): {got:.2g}; floor {floor:.2g}")
        assert got <= max(10 * floor, 1e-5), (key, got, floor)
