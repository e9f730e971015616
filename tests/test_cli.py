"""``fsdp-optim plan``: JSON figures and the human report, through ``main(argv)``."""

import json

import pytest

from fsdp_optim._cli import main

STATS_KEYS = {
    "padding_ratio", "plan_seconds", "num_split_blocks", "split_bytes_ratio", "bytes_max_over_mean",
    "cost_max_over_mean", "num_buckets", "world_size", "num_even_buckets", "num_ragged_buckets", "bytes_lower_bound",
}


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json(capsys):
    out = _json(capsys, ["plan", "--model", "llama3-8b", "--world-size", "64", "--optimizer", "muon", "--json"])
    assert STATS_KEYS <= set(out)
    assert out["world_size"] == 64 and out["num_buckets"] == 34 and out["model"] == "llama3-8b"
    assert out["num_even_buckets"] + out["num_ragged_buckets"] == 34
    assert out["num_split_blocks"] == 0 and out["bytes_max_over_mean"] <= 1.10


@pytest.mark.parametrize("layout", ["even", "ragged"])
def test_plan_layout_and_bucket_layers(capsys, layout):
    argv = ["plan", "--model", "gpt-oss-120b", "--world-size", "3", "--optimizer", "shampoo", "--json", "--layout", layout]
    out = _json(capsys, [*argv, "--bucket-layers", "4"])
    assert out["num_buckets"] == 2 + 9
    key = "num_even_buckets" if layout == "even" else "num_ragged_buckets"
    assert out[key] == 11
    if layout == "ragged":
        assert out["padding_ratio"] == 0 and out["num_split_blocks"] == 0


def test_plan_padding_cap_controls_splits(capsys):
    argv = ["plan", "--model", "llama3-8b", "--world-size", "64", "--optimizer", "muon", "--layout", "even", "--json"]
    tight = _json(capsys, [*argv, "--padding-cap", "0.02"])
    loose = _json(capsys, [*argv, "--padding-cap", "100"])
    assert tight["num_split_blocks"] > 0 and tight["split_bytes_ratio"] > 0 and tight["padding_ratio"] <= 0.02
    assert loose["num_split_blocks"] == 0 and loose["padding_ratio"] > 0.02


def test_plan_report(capsys):
    assert main(["plan", "--model", "qwen3-235b-a22b", "--world-size", "8", "--optimizer", "adamw8bit"]) == 0
    text = capsys.readouterr().out
    for word in ("embed", "layers.93", "head", "padding", "per-rank bytes", "lower bound", "bytes/collective"):
        assert word in text


@pytest.mark.parametrize("optimizer", ["muon", "shampoo"])
def test_plan_hsdp_shard_size_at_16384_ranks(capsys, optimizer):
    """HSDP at W = 16384 with shard groups of 64: every preset keeps whole Muon matrices / Shampoo
    blocks (no split; padding < 0.1%: measured <= 4e-5) with per-rank bytes max/mean <= 1.10."""
    from fsdp_optim.sharding.plan import preset_names

    for model in preset_names():
        argv = ["plan", "--model", model, "--world-size", "16384", "--shard-size", "64", "--optimizer", optimizer]
        out = _json(capsys, [*argv, "--json"])
        assert STATS_KEYS <= set(out)
        assert (out["world_size"], out["shard_size"], out["num_replicas"]) == (16384, 64, 256)
        assert out["num_split_blocks"] == 0 and out["padding_ratio"] < 1e-3, model
        assert out["bytes_max_over_mean"] <= 1.10, (model, out["bytes_max_over_mean"])


def test_plan_replicas_do_not_change_the_layout(capsys):
    base = ["plan", "--model", "gpt-oss-120b", "--optimizer", "muon", "--json"]
    fsdp = _json(capsys, [*base, "--world-size", "8"])
    hsdp = _json(capsys, [*base, "--world-size", "32", "--shard-size", "8"])
    assert (fsdp["shard_size"], fsdp["num_replicas"]) == (8, 1)
    assert (hsdp["world_size"], hsdp["shard_size"], hsdp["num_replicas"]) == (32, 8, 4)
    skip = {"world_size", "shard_size", "num_replicas", "plan_seconds"}
    assert {k: v for k, v in fsdp.items() if k not in skip} == {k: v for k, v in hsdp.items() if k not in skip}
    assert main([*base[:-1], "--world-size", "32", "--shard-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "4 replicas x shard size 8" in text and "world size 8" in text


def test_plan_errors(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "nope", "--world-size", "8", "--optimizer", "muon"])
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama3-8b", "--world-size", "8", "--optimizer", "sgd"])
    assert main(["plan", "--model", "llama3-8b", "--world-size", "0", "--optimizer", "muon"]) == 2
    assert "--world-size" in capsys.readouterr().err
    bad = ["plan", "--model", "llama3-8b", "--world-size", "100", "--shard-size", "64", "--optimizer", "muon"]
    assert main(bad) == 2
    assert "--shard-size must be a positive divisor of --world-size 100" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])


def test_help_is_plain_text(capsys):
    # --help shows prose, not the module docstring's reStructuredText markup.
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "plan" in text and "Example: fsdp-optim plan --model" in text
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "``" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, value",
    [("--itemsize", "0"), ("--itemsize", "-2"), ("--align", "0"), ("--padding-cap", "-0.5"), ("--padding-cap", "nan"),
     ("--padding-cap", "inf")],  # (inf printed "padding_cap": Infinity, which is not JSON)
)
def test_plan_rejects_bad_numbers_naming_the_flag(capsys, flag, value):
    # (--itemsize 0 / -2 used to print 0 or negative bytes per collective)
    argv = ["plan", "--model", "llama3-8b", "--world-size", "8", "--optimizer", "muon", "--json", flag, value]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"fsdp-optim plan: error: {flag} must be >= ") and value in captured.err


# ---- issue 27: the balance cap and --suggest ------------------------------------------------
def test_plan_default_balances_and_says_how(capsys):
    """main: Llama 3 8B / Muon at W = 1024 gave bytes max/mean 7.619; the default now splits matrices
    on rows (balance 'auto') and the JSON says so; Shampoo too (main: 1.872, strips whole)."""
    argv = ["plan", "--model", "llama3-8b", "--world-size", "1024", "--json"]
    out = _json(capsys, [*argv, "--optimizer", "muon"])
    assert out["balance"] == "auto" and out["balance_cap"] == 1.10
    assert out["bytes_max_over_mean"] <= 1.10 and out["balance_ratio"] <= 1.10 and out["num_split_blocks"] > 0
    assert out["balance_note"].startswith("split ") and "1.10" in out["balance_note"]
    sh = _json(capsys, [*argv, "--optimizer", "shampoo"])
    assert sh["balance"] == "auto" and sh["bytes_max_over_mean"] <= 1.10 and sh["num_split_blocks"] > 0
    assert sh["balance_note"].startswith("split ")


def test_plan_suggest(capsys):
    argv = ["plan", "--model", "llama3-70b", "--world-size", "1024", "--optimizer", "muon", "--suggest",
            "--memory-per-rank", "80GB"]  # fmt: skip
    out = _json(capsys, [*argv, "--json"])
    assert (out["shard_size"], out["num_replicas"]) == (64, 16) and out["max_rank_bytes"] <= 80e9
    by_n = {c["shard_size"]: c for c in out["candidates"]}
    assert set(by_n) == {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}
    assert not by_n[16]["fits"] and by_n[16]["collective_seconds"] is None  # 70.6B x 16 B / 16 > 80 GB
    fitting = [c for c in out["candidates"] if c["fits"]]
    assert min(fitting, key=lambda c: c["collective_seconds"])["shard_size"] == 64
    assert by_n[1024]["collective_seconds"] > 2 * by_n[64]["collective_seconds"]  # pure FSDP: W-1 latencies
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "suggested: 16 replicas x shard size 64" in text and "comm s/step" in text


def test_plan_suggest_errors(capsys):
    base = ["plan", "--model", "llama3-70b", "--world-size", "64", "--optimizer", "muon", "--suggest"]
    assert main(base) == 2
    assert "--suggest needs --memory-per-rank" in capsys.readouterr().err
    for bad in ("0", "-5GB", "80XB", "nan", "lots"):
        assert main([*base, f"--memory-per-rank={bad}"]) == 2
        assert f"--memory-per-rank must be a positive size in bytes (80e9, 80GB or 80GiB), got {bad!r}" in capsys.readouterr().err
    assert main([*base, "--memory-per-rank", "1GB"]) == 2
    assert "fits no HSDP shape or tensor-parallel degree of world size 64" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="--shard-size 8 is ignored with --suggest"):
        assert main([*base, "--memory-per-rank", "80GiB", "--shard-size", "8", "--json"]) == 0
    capsys.readouterr()
    with pytest.warns(UserWarning, match="--memory-per-rank is ignored without --suggest"):
        assert main([*base[:-1], "--memory-per-rank", "80GB", "--json"]) == 0


def test_plan_suggest_searches_expert_parallel_for_moe(capsys):
    """Issue 37: Kimi-K2 at W = 1024 in 80 GB fits no HSDP shape (a layer's 384 experts gathered whole: 221 GB
    even at pure FSDP); before: "fits no HSDP shape". Expert parallelism makes it fit: the table has an ep
    column, and the suggestion names the degree."""
    argv = ["plan", "--model", "kimi-k2", "--world-size", "1024", "--optimizer", "muon", "--suggest",
            "--memory-per-rank", "80GB"]  # fmt: skip
    out = _json(capsys, [*argv, "--json"])
    assert out["ep"] > 1 and out["max_rank_bytes"] <= 80e9 and out["shard_size"] == 1024
    eps = {c["ep"] for c in out["candidates"]}
    assert eps == {1, 2, 4, 8, 16, 32, 64, 128, 256}  # the divisors of 1024 up to its 384 experts
    assert not any(c["fits"] for c in out["candidates"] if c["ep"] == 1)
    fitting = [c for c in out["candidates"] if c["fits"]]
    assert min(fitting, key=lambda c: c["collective_seconds"])["ep"] == out["ep"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"suggested: expert parallel {out['ep']} (each rank's experts sharded over the {1024 // out['ep']} ranks" in text
    assert text.splitlines()[2].split()[:3] == ["ep", "shard", "replicas"]
    # a dense model: no ep column values but 1; more tokens per rank make expert parallelism dearer
    dense = _json(capsys, ["plan", "--model", "llama3-8b", "--world-size", "64", "--optimizer", "muon", "--suggest",
                           "--memory-per-rank", "80GB", "--json"])  # fmt: skip
    assert dense["ep"] == 1 and {c["ep"] for c in dense["candidates"]} == {1}
    more = _json(capsys, [*argv, "--json", "--tokens-per-rank", "65536"])
    by_ep = {c["ep"]: c for c in more["candidates"]}
    assert by_ep[8]["collective_seconds"] > {c["ep"]: c for c in out["candidates"]}[8]["collective_seconds"]
    assert main([*argv, "--tokens-per-rank", "0"]) == 2
    assert "--tokens-per-rank must be a positive number of tokens, got 0" in capsys.readouterr().err


def test_plan_suggest_tries_tensor_parallel_when_no_data_parallel_shape_fits(capsys):
    """Issue 35 item 5: Llama 3 8B at W = 8 in 20 GB fits no HSDP shape (pure FSDP: 16 GB of sharded state
    plus two gathered embedding buckets, 22.4 GB); TP 2 halves the split matrices (and so the gathered
    buckets) on each rank, over 4 data-parallel ranks, and fits. The least fitting tp wins."""
    argv = ["plan", "--model", "llama3-8b", "--world-size", "8", "--optimizer", "muon", "--suggest",
            "--memory-per-rank", "20GB"]  # fmt: skip
    out = _json(capsys, [*argv, "--json"])
    assert (out["tp"], out["num_replicas"], out["shard_size"]) == (2, 1, 4) and out["max_rank_bytes"] <= 20e9
    by = {(c["tp"], c["shard_size"]): c for c in out["candidates"]}
    assert {tp for tp, _ in by} == {1, 2, 4, 8} and not any(c["fits"] for (tp, _), c in by.items() if tp == 1)
    assert by[(2, 4)]["max_rank_bytes"] < by[(1, 8)]["max_rank_bytes"] and by[(4, 2)]["fits"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "suggested: tensor parallel 2 (each block's heads, FFN and the vocabulary split over 2 ranks), 1 replicas x " \
           "shard size 4 over the 4 data-parallel ranks" in text
    assert text.splitlines()[2].split()[-1] == "tp" and "TP's activation collectives are not modeled" in text
    # where a data-parallel shape fits, TP is not tried
    fits = _json(capsys, [*argv[:-1], "80GB", "--json"])
    assert fits["tp"] == 1 and {c["tp"] for c in fits["candidates"]} == {1}
    assert main([*argv[:-1], "1GB"]) == 2
    assert "fits no HSDP shape or tensor-parallel degree of world size 8" in capsys.readouterr().err


def test_plan_reports_shampoo_factor_state(capsys):
    """Shampoo's per-strip factors (not balanced by the plan, which balances parameter bytes) are reported;
    a rule without per-block state reports none."""
    out = _json(capsys, ["plan", "--model", "llama3-8b", "--world-size", "1024", "--optimizer", "shampoo", "--json"])
    assert out["bytes_max_over_mean"] <= 1.10
    assert out["block_state_max_over_mean"] > 1.5 and out["block_state_max_bytes"] >= 2**28
    assert main(["plan", "--model", "llama3-8b", "--world-size", "1024", "--optimizer", "shampoo"]) == 0
    assert "per-block optimizer state (Shampoo's factors" in capsys.readouterr().out
    muon = _json(capsys, ["plan", "--model", "llama3-8b", "--world-size", "64", "--optimizer", "muon", "--json"])
    assert not any(k.startswith("block_state") for k in muon)
