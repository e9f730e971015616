"""The FSDP x TP Muon model (benchmarks/_comm_tp.py, issue #35 item 2) on the measured size (W = 4) and
Llama 3.1 405B at W = 16384: the identities each scheme's definition implies, and the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import _comm_tp as tp  # noqa: E402
import comm_model_tp as cli  # noqa: E402
from fsdp_optim.optimizers._homes import ns_cost  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {(n, d, t): tp.model_tp(n, d, t) for n, d, t in
            (("tiny", 2, 2), ("llama3-1b", 2, 2), ("llama3-1b", 1, 4), ("llama3.1-405b", 2048, 8))}  # fmt: skip


def test_flop_ratios_and_collectives(rows):
    for (_, d, t), r in rows.items():
        s = r["schemes"]
        assert r["num_matrices"] == 7 * tp.load_model(r["model"]).layers
        # NS once per matrix in ours and LayerShardedMuon; T x for duplicated (all seven are TP-sharded); W x FSDP2
        assert s["ours"]["ns_flops_ratio"] == 1.0 and s["ours"]["ns_flops_total"] == r["single_ns_flops"]
        assert s["megatron_layer_sharded"]["ns_flops_ratio"] == s["megatron_layer_sharded_gtp1"]["ns_flops_ratio"] == 1.0
        assert s["megatron_duplicated"]["ns_flops_ratio"] == t
        assert s["fsdp2_muon"]["ns_flops_ratio"] == d * t
        # two all_to_alls per step for ours whatever the model; one all-gather per matrix (held) for duplicated
        assert s["ours"]["collectives"] == 2
        assert s["fsdp2_muon"]["collectives"] == (2 if d > 1 else 1) * r["num_matrices"]
        if d == 1:  # one dp rank holds every matrix: one all-gather each
            assert s["megatron_duplicated"]["collectives"] == r["num_matrices"]
        assert s["megatron_layer_sharded"]["collectives"] == (2 if d > 1 else 0) + 4
        # FSDP2's all-gathers move at least (W-1)/W of every matrix
        assert s["fsdp2_muon"]["bytes"] >= (d * t - 1) / (d * t) * r["matrix_bytes"] * (1 - 1e-12)


def test_bytes_ours_vs_duplicated(rows):
    for (_, _, t), r in rows.items():
        o, dup = r["schemes"]["ours"], r["schemes"]["megatron_duplicated"]
        # summed over ranks: each matrix crosses the TP group out and back, (T-1)/T of it each way, against
        # T ranks all-gathering (T-1)/T of it: ratio 2/T (equal at T = 2)
        assert o["total_bytes_all_ranks"] / dup["total_bytes_all_ranks"] == pytest.approx(2 / t)
        assert o["total_bytes_all_ranks"] == pytest.approx(2 * (t - 1) / t * r["matrix_bytes"])
        # LayerShardedMuon over dp x tp: (D-1)/D of each matrix crosses dp, (T-1)/T crosses TP, out and back
        d = r["dp"]
        ls = r["schemes"]["megatron_layer_sharded"]["total_bytes_all_ranks"]
        assert ls == pytest.approx(2 * ((d - 1) / d + (t - 1) / t) * r["matrix_bytes"])
    small = rows[("llama3-1b", 1, 4)]["schemes"]
    assert small["ours"]["bytes"] < small["megatron_duplicated"]["bytes"]
    assert small["ours"]["seconds"] < small["megatron_duplicated"]["seconds"]


def test_home_balance(rows):
    for r in rows.values():
        o = r["schemes"]["ours"]  # the least balanced TP group: longest-first's bound, mean + largest item
        assert o["home_flops_max"] <= o["home_flops_mean"] + o["home_largest_item"] * (1 + 1e-12)
    # many matrices per TP group: within 4/3 of the mean (Graham's longest-first bound on OPT >= mean)
    o = rows[("llama3-1b", 1, 4)]["schemes"]["ours"]
    assert o["home_flops_max"] <= 4 / 3 * o["home_flops_mean"]
    rng = np.random.default_rng(0)
    costs = list(rng.integers(1, 1000, size=50))
    where, loads = tp.longest_first(costs, 7)
    assert loads.sum() == sum(costs) and np.bincount(where, weights=costs, minlength=7).tolist() == loads.tolist()
    assert loads.max() <= loads.mean() + max(costs)


def test_shapes_and_flops():
    big = tp.load_model("llama3.1-405b")
    assert (big.hidden, big.layers, big.heads, big.kv_heads, big.vocab) == (16384, 126, 128, 8, 128256)
    assert dict((s, shape) for s, shape, _ in big.matrices)["w1"] == (53248, 16384)
    assert tp.ns_flops(53248, 16384) == 5 * ns_cost(53248, 16384)
    with pytest.raises(ValueError, match="KV heads"):
        tp.model_tp("tiny", 1, 4)  # 2 KV heads do not split over 4


def test_cli(tmp_path, capsys):
    assert cli.main(["--configs", "tiny:2x2", "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "## tiny, dp 2 x tp 2 (W = 4)" in out and "| ours (fsdp_optim) |" in out
    assert cli.main(["--configs", "llama3-1b:1x4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "comm_model_tp.json").read_text())
    assert [(r["dp"], r["tp"]) for r in data["rows"]] == [(1, 4)]
    assert "| FSDP2 + torch.optim.Muon on DTensor (lower bound) |" in (tmp_path / "comm_model_tp.md").read_text()
