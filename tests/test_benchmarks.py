"""Smoke tests of the benchmark tooling (no timings): the communication model on one small preset
obeys its identities, the report survives missing and unreadable results, gpu_check's pieces run."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # report.py imports comm_model by name
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


cm = _load("comm_model")


def test_collective_formulas():
    link = cm.LinkConfig(bandwidth_gbps=8.0, alpha_us=1.0)  # 1e9 bytes/s, 1e-6 s
    c = cm.ring_even(link, 4, 1e9)
    assert c.bytes == 3e9 and c.seconds == pytest.approx(3e-6 + 3.0)
    # the array form agrees on an even split and charges the largest segment on an uneven one
    assert cm.ring(link, 4, np.full(4, 1e9)).seconds == pytest.approx(c.seconds)
    assert cm.ring(link, 4, np.array([0.0, 2e9, 1e9, 1e9])).seconds == pytest.approx(3e-6 + 6.0)
    # grouped broadcasts: an even ring's bandwidth term plus one message per non-empty owner
    g = cm.grouped(link, 4, np.array([0.0, 2e9, 1e9, 1e9]))
    assert g.bytes == 4e9 and g.seconds == pytest.approx((3 + 3) * 1e-6 + 4.0)
    assert cm.all_reduce(link, 2, 1e9).seconds == pytest.approx(2e-6 + 1.0)
    assert cm.ring_even(link, 1, 1e9) == cm.Cost()
    assert cm.LinkConfig(latency="log2").steps(1024) == 10


def test_model_step_identities():
    link = cm.LinkConfig()
    w = 8
    r = cm.model_step("llama3-8b", w, link=link)
    ours, b, c = r["ours"], r["fsdp2_muon"], r["gather_scatter"]
    assert r["num_split_blocks"] == 0 and ours["optim"]["collectives"] == 0 and ours["optim"]["seconds"] == 0
    # three collectives per bucket (AG fwd, AG bwd, RS) for every scheme
    assert ours["fsdp"]["collectives"] == b["fsdp"]["collectives"] == c["fsdp"]["collectives"] == 3 * r["num_buckets"]
    # (b): one all-gather per Muon matrix (7 per Llama layer); (c): two all-to-alls per layer bucket
    assert r["num_muon_matrices"] == 7 * 32 and b["optim"]["collectives"] == 7 * 32
    assert c["optim"]["collectives"] == 2 * 32
    # every scheme's FSDP traffic is at least the parameters once per direction at its dtype
    per_param = 2 * link.param_bytes + link.grad_bytes
    lower = (w - 1) / w * per_param * r["param_numel"]
    for s in (ours, b, c):
        assert s["fsdp"]["bytes"] >= lower * (1 - 1e-9)
        assert s["bytes"] == pytest.approx(s["fsdp"]["bytes"] + s["optim"]["bytes"])
        assert s["seconds"] == pytest.approx(s["fsdp"]["seconds"] + s["optim"]["seconds"])
    # (c)'s unpadded flat buckets: exactly (W-1) * ceil(N_b / W) elements per direction and bucket
    assert c["fsdp"]["bytes"] <= (lower + (w - 1) * per_param * r["num_buckets"]) * (1 + 1e-12)
    assert r["time_ratio_fsdp2_muon_over_ours"] == pytest.approx(b["seconds"] / ours["seconds"])
    assert r["ours_other_ragged_model"]["ragged_model"] == "ring-max"
    assert r["ours_other_ragged_model"]["seconds"] >= ours["seconds"]
    # wire formats: auto is never worse than either mode, and equals one of them where all buckets agree
    wire = cm.model_step("gpt-oss-120b", 16384, link=link, layout="ragged")["wire"]
    assert wire["auto"]["seconds"] <= min(wire["grouped"]["seconds"], wire["padded"]["seconds"]) * (1 + 1e-12)
    assert wire["num_padded_buckets"] > 0
    wire8 = r["wire"]
    assert wire8["auto"]["seconds"] == pytest.approx(min(wire8["grouped"]["seconds"], wire8["padded"]["seconds"]))


def test_split_exchange_and_hsdp():
    link = cm.LinkConfig()
    # a forced even layout with no padding allowance splits matrices: two all-to-alls per such bucket
    from fsdp_optim._cli import optimizer_rule
    from fsdp_optim.sharding import PlanConfig
    from fsdp_optim.sharding.plan import plan_model
    from fsdp_optim.sharding.plan import preset_buckets

    plan = plan_model(preset_buckets("llama3-8b", rule=optimizer_rule("muon")), world_size=64,
                      config=PlanConfig(layout="even"))
    split = [bk for bk in plan.buckets if bk.num_split_blocks]
    assert split
    send, recv = cm._split_exchange(split[0])
    assert send.sum() == recv.sum() > 0
    r = cm.model_step("llama3-8b", 64, link=link, layout="even")
    assert r["num_split_blocks"] == plan.stats().num_split_blocks > 0
    assert r["ours"]["optim"]["collectives"] == 2 * len(split) and r["ours"]["optim"]["seconds"] > 0
    # HSDP over the whole world is plain FSDP; replicas add an all-reduce of the gradient shards
    full = cm.model_step("llama3-8b", 16, link=link)
    same = cm.model_step("llama3-8b", 16, link=link, shard_size=16)
    assert same["ours"]["bytes"] == full["ours"]["bytes"] and same["replicas"] == 1
    h = cm.model_step("llama3-8b", 16, link=link, shard_size=8)
    assert h["replicas"] == 2
    ar = h["ours"]["bytes"] - cm.model_step("llama3-8b", 8, link=link)["ours"]["bytes"]
    grad_shard = link.grad_bytes * h["param_numel"] / 8
    assert ar == pytest.approx(2 * (2 - 1) / 2 * grad_shard, rel=0.15)  # ~ its own 1/N of the gradients
    with pytest.raises(ValueError, match="shard-size"):
        cm.model_step("llama3-8b", 12, link=link, shard_size=8)


def test_markdown_and_main(tmp_path, capsys):
    assert cm.main(["--models", "gpt-oss-120b", "--world-sizes", "8", "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "| gpt-oss-120b | 8 |" in out and "400 Gb/s" in out


def test_report_handles_missing_and_broken(tmp_path):
    report = _load("report")
    link = cm.LinkConfig()
    data = {"command": "python benchmarks/comm_model.py --models llama3-8b", "assumptions": vars(link),
            "rows": [cm.model_step("llama3-8b", 8, link=link)]}
    (tmp_path / "comm_model.json").write_text(json.dumps(data))
    (tmp_path / "bench_muon.json").write_text(json.dumps({"unexpected": 1}))
    md = report.build(tmp_path)
    assert "Not run (no `planner_scale.json`)" in md and "Not run (no `gpu_check.json`)" in md
    assert "`bench_muon.json` is present but could not be read" in md
    assert "Command: `python benchmarks/comm_model.py --models llama3-8b`" in md and "| llama3-8b | 8 |" in md


def test_gpu_check_pieces():
    gc = _load("gpu_check")
    assert gc.ns_flops(4, 8, steps=1) == 4 * 16 * 8 + 2 * 64
    cfg = gc.CheckConfig(device="cpu", ns_shapes=[(16, 48)], warmup=0, reps=1)
    [row] = gc.check_newton_schulz(cfg)
    assert row["max_abs_diff"] == 0 and row["ours"]["tflops"] > 0 and math.isfinite(row["ours_over_torch_time"])


def test_gpu_runtime_check_pieces_and_cpu_refusal():
    grc = _load("gpu_runtime_check")
    assert grc.overlapping([(0, 2), (5, 6), (9, 10)], [(1, 3), (5.5, 5.7)]) == 2
    assert grc.overlapping([(0, 1)], [(1, 2)]) == 0  # touching is not overlapping
    if not grc.torch.cuda.is_available():
        assert grc.main() == 2  # says it needs a GPU, runs nothing


def test_step_memory_quick(tmp_path):
    sm = _load("step_memory")
    sm.main(["--quick", "--wraps", "root", "units", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "step_memory.json").read_text())["rows"]
    assert {(r["precision"], r["wrap"], r["runtime"]) for r in rows} == {
        (p, wrap, rt) for p in sm.PRECISIONS for wrap in ("root", "units") for rt in ("fsdp_optim", "fsdp2")
    }
    for r in rows:
        bd = r["breakdown"]
        assert r["peak"] >= r["persistent"] > 0 and sum(bd.values()) == r["peak"]
        assert bd["grads"] == bd["sharded_params"] and bd["optimizer_state"] == 2 * bd["sharded_params"]
        # the floor: persistent state plus what the loss holds, under the peak, above the state
        state = sum(v for k, v in r["live"]["at_forward_backward_peak"].items() if k in ("sharded_params", "optimizer_state"))
        assert state < r["live"]["floor"] <= r["live_peak"]


def test_bench_shampoo_quick(tmp_path):
    """The Shampoo / SOAP benchmark runs (k = 32) and its bitwise checks hold: sharded == single
    process for every side, SOAP batched == looped at W and in one process."""
    bench = _load("bench_shampoo")
    bench.main(["--quick", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench_shampoo.json").read_text())
    assert out["sharded_equals_single_process_bitwise"] == dict.fromkeys(("shampoo", "shampoo looped", "soap", "soap looped"), True)
    assert out["soap_batched_equals_looped_bitwise"] == {"W": True, "1p": True}
    assert all(math.isfinite(v) and v > 0 for v in out["ratios"].values())


def test_bench_orthogonalize_quick(tmp_path):
    """The orthogonalization benchmark runs (dims / 32, W = 2): every method on every set, the FLOP ratios
    of the Gram rows as _orthogonalize.flops counts them, and no collective in a sharded step."""
    bench = _load("bench_orthogonalize")
    bench.main(["--quick", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench_orthogonalize.json").read_text())
    assert set(out["sets"]) == {"llama3-8b", "llama3-8b mlp", "deepseek-v3 experts"}
    assert "| Gram NS bf16 |" in (tmp_path / "bench_orthogonalize.md").read_text()
    for s in out["sets"].values():
        assert [r["method"] for r in s["step"]] == list(bench.METHODS)
        assert all(math.isfinite(r["ms"]) and r["ms"] > 0 for r in s["step"] + s["per_shape"])
        for w in s["sharded"]:
            assert [r["world_size"] for r in w["rows"]] == [2] * len(bench.METHODS)
            assert all(r["collectives_per_step"] == 0 and r["flops_max_over_mean"] < 1.1 for r in w["rows"])
    mlp = {r["method"]: r["flop_ratio"] for r in out["sets"]["llama3-8b mlp"]["step"]}
    assert mlp["torch NS"] == mlp["Polar Express"] == 1 and mlp["Gram NS bf16"] == pytest.approx(0.70, abs=0.01)


def test_orthogonalize_quality_quick(tmp_path):
    """The quality script trains the recipe's model with every method and measures the captured updates:
    the methods that run one polynomial sit next to its exact float64 evaluation."""
    quality = _load("orthogonalize_quality")
    quality.main(["--quick", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "orthogonalize_quality.json").read_text())
    polar = {r["method"]: r for r in out["polar"]}
    assert set(polar) == {*quality.METHODS, "exact torch polynomial", "exact PE polynomial"}
    assert polar["exact torch polynomial"]["off_spectrum"] < 1e-6  # the spectral decomposition is exact there
    for m, exact in (("torch NS", "exact torch polynomial"), ("Gram NS fp16", "exact torch polynomial"),
                     ("Polar Express", "exact PE polynomial")):  # fmt: skip
        assert abs(polar[m]["rel_frobenius"] - polar[exact]["rel_frobenius"]) < 0.05, m
    assert out["loss"]["torch NS"]["held_out_minus_torch_ns"] == [0.0]
    assert all(math.isfinite(v) for r in out["loss"].values() for v in r["held_out_loss"])
    assert "| Gram + PE bf16 |" in (tmp_path / "orthogonalize_quality.md").read_text()


def test_issue27_tables_on_one_preset():
    """planner_scale's default plan table and comm_model --balanced on Llama 3 8B: the cells the
    results files hold, at small W."""
    ps = _load("planner_scale")
    rows = ps.default_table(world_sizes=(64, 1024), models=["llama3-8b"])
    by = {(r["optimizer"], r["world_size"]): r for r in rows}
    assert by[("muon", 1024)]["balance_ratio"] <= 1.10 and by[("muon", 1024)]["num_split_blocks"] > 0
    sh = by[("shampoo", 1024)]  # split strips since Shampoo exchanges them (main: whole, 1.872)
    assert sh["balance"] == "auto" and sh["num_split_blocks"] > 0 and sh["balance_ratio"] <= 1.10
    assert sh["hsdp_shard_size"] is None
    md = "\n".join(ps._table_md(rows))
    assert "| llama3-8b / muon |" in md and "| llama3-8b / shampoo |" in md
    assert "Cells above 1.10: 0 of 4" in md
    cm_rows = cm.balanced_rows(["llama3-8b"], [64], link=cm.LinkConfig(), memory_per_rank=80e9)
    assert [r["mesh"] for r in cm_rows] == ["fsdp", "suggested"] and all(r["memory_fits"] for r in cm_rows)
    for r in cm_rows:  # ours no slower than either peer here, so no reason is named
        assert r["ours"]["seconds"] <= min(r["fsdp2_muon"]["seconds"], r["gather_scatter"]["seconds"]) and not r["why"]
    text = cm.balanced_markdown({"command": "x", "assumptions": vars(cm.LinkConfig()), "memory_per_rank": 80e9,
                                 "rows": cm_rows})  # fmt: skip
    assert "| llama3-8b | 64 | suggested:" in text and "Cells where ours is slower than a peer: 0 of 2" in text


def test_moe_ep_quick(tmp_path):
    """The expert-parallel recipe benchmark runs at W = 4 with ep = 1, 2, 4: the dropless experts compute
    exactly the routed rows (k per token per layer), fewer than the old padded bmm's E x C_max, the
    same total for every ep, and the losses agree."""
    bench = _load("moe_ep")
    out = bench.main(["--quick", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "moe_ep.json").read_text())["rows"]
    assert set(rows) == {"1", "2", "4"}
    routed = out["config"]["tokens_per_step"] * 2 * 2  # top-2, 2 MoE layers
    for r in rows.values():
        assert r["slots_equal_routed_rows"] and r["slots_per_step_total"] == r["routed_rows_per_step"] == routed
        assert r["padded_bmm_slots_per_step_total"] > r["slots_per_step_total"]
        assert r["max_rel_loss_diff_vs_ep1"] < 1e-3 and r["tokens_per_s"] > 0


def test_expert_parallel_rows_on_one_preset():
    """comm_model --ep on gpt-oss-120b at W = 64, ep = 8: the token all-to-alls follow their formula
    and are the same for both EP schemes, none without EP; ours has no optimizer collective where its
    plans split no matrix, and is no slower than either peer (no reason named)."""
    link = cm.LinkConfig()
    tokens = 2**20
    r = cm.ep_step("gpt-oss-120b", 64, link=link, tokens_per_step=tokens, ep=8)
    assert (r["ep"], r["experts_per_rank"], r["expert_replicas"], r["top_k"]) == (8, 16, 8, 4)
    per = tokens / 64 * 4 * 2880 * 2 * 7 / 8  # T x top_k x hidden x bf16 x (ep-1)/ep
    counts = 128 * 8 * 7 / 8
    assert r["ours"]["tokens"]["bytes"] == pytest.approx(36 * (4 * per + counts))
    assert r["ours"]["tokens"] == r["ep_distmuon"]["tokens"] and r["fsdp2_no_ep"]["tokens"]["seconds"] == 0
    assert r["ours"]["tokens"]["collectives"] == 36 * 5
    if r["ours"]["expert_plan"]["num_split_blocks"] == 0 and r["ours"]["dense_plan"]["num_split_blocks"] == 0:
        assert r["ours"]["optim"]["collectives"] == 0 and r["ours"]["optim"]["seconds"] == 0
    assert r["ep_distmuon"]["expert_optim"]["collectives"] == 2 * 36  # two all-to-alls per expert bucket
    assert r["ours"]["seconds"] <= min(r["ep_distmuon"]["seconds"], r["fsdp2_no_ep"]["seconds"]) and not r["why"]
    assert cm._ep_candidates(384, 1024) == [2, 4, 8, 16, 32, 64, 128]
    md = cm.ep_markdown({"command": "x", "assumptions": vars(link), "memory_per_rank": 80e9, "tokens_per_step": tokens,
                         "act_bytes": 2, "rows": [r]})  # fmt: skip
    assert "| gpt-oss-120b | 64 | 16,384 | 4 | 8 (16, 8) |" in md and "slower than a peer: 0 of 1" in md


def test_bench_tp_shampoo_quick(tmp_path):
    """The Shampoo / SOAP under FSDP x TP benchmark runs (k = 12, W = 4 at 1x4, heavyball skipped): ours equals the
    unsharded optimizer with every weight assembled in runs, does each block's preconditioner work once
    (ratio 1 to one process) with two all-to-alls a step; the duplicated scheme does it T times."""
    bench = _load("bench_tp_shampoo")
    bench.main(["--quick", "--no-heavyball", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench_tp_shampoo.json").read_text())
    assert all(c["max_diff_vs_unsharded"] == 0 and c["runs"] == c["weights"] > 0 for c in out["equality"].values())
    for r in out["rows"]:
        if r["step_kind"] == "plain":
            assert r["linalg_calls"] == {"eigh": 0, "qr": 0}
        if r["scheme"] == "fsdp_optim":
            assert r["flops_ratio"] == pytest.approx(1.0) and r["linalg_n3_ratio"] == pytest.approx(1.0)
            assert r["ops_busiest_rank"]["alltoall_base_.default"] == 2
        else:
            assert r["flops_ratio"] == pytest.approx(r["tp"])
            if r["step_kind"] == "refresh":
                assert r["linalg_n3_ratio"] == pytest.approx(r["tp"])
    assert "| duplicated (TP all-gather) | soap | 1x4 | refresh" in (tmp_path / "bench_tp_shampoo.md").read_text()
