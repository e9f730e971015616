"""The recipe end to end on 2 CPU ranks: each optimizer, MoE, a transformers model, errors, kill and resume."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _checkpointing as ckpts
import pretrain
from _backend import build_optimizer, pick_backend
from config import load_config
from fsdp_optim._testing import DistributedTestError, run_distributed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "pretrain.py"
CONFIGS = ROOT / "recipes" / "configs"
# Tiny dims so a step takes milliseconds; tiny.toml supplies the rest.
SMALL = ["--set", "model.dim=48", "--set", "model.n_layers=2", "--set", "model.n_heads=4", "--set", "model.n_kv_heads=2",
         "--set", "model.ffn_dim=64", "--set", "data.seq_len=32", "--set", "train.batch_size=2",
         "--set", "train.warmup_steps=2", "--set", "log.eval_batches=1"]


def train(out, *args, config="tiny", steps=3, world_size=2):
    argv = ["--config", str(CONFIGS / f"{config}.toml"), "--steps", str(steps), "--out", str(out), *SMALL, *args]
    return run_distributed(lambda: pretrain.main(argv), world_size=world_size, timeout=120)[0]


def backend_for(optimizer: str) -> str:
    return pick_backend(load_config(CONFIGS / "tiny.toml", [f'optim.name="{optimizer}"']))


def check_outputs(out: Path, steps: int) -> list[dict]:
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "mfu", "mem_gb", "grad_norm"} <= set(r)
        assert torch.isfinite(torch.tensor(r["loss"])) and r["tokens_per_s"] > 0
    assert records[-1]["eval_loss"] is not None
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "checkpoints" / f"step_{steps:06d}" / "recipe_done.json").exists()
    return records


@pytest.mark.parametrize(
    "optimizer", ["adamw", "adamw8bit", "muon", "shampoo", "soap", "adamw4bit", "torch.NAdam", "torch.Adafactor"]
)
def test_each_optimizer_trains(tmp_path, optimizer):
    assert backend_for(optimizer) == "fsdp_optim"  # the package is complete: never a silent FSDP2 fallback
    res = train(tmp_path, "--optimizer", optimizer, steps=6)
    records = check_outputs(tmp_path, 6)
    # SOAP skips its first step (it builds the eigenbases); Adafactor at the recipe's lr 3e-3 moves slowly.
    margin = {"soap": 0.1, "torch.Adafactor": 0.01}.get(optimizer, 0.3)
    assert records[-1]["loss"] < records[0]["loss"] - margin, [r["loss"] for r in records]
    assert res["backend"] == backend_for(optimizer)


def test_moe_config(tmp_path):
    assert backend_for("muon") == "fsdp_optim"  # moe-tiny.toml trains with Muon on our runtime
    train(tmp_path, config="moe-tiny")
    check_outputs(tmp_path, 3)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model"]["kind"] == "moe" and cfg["model"]["n_experts"] == 8


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not importable (pip install 'fsdp_optim[hf]')")
def test_transformers_config(tmp_path):
    import transformers  # noqa: F401  (imported once here, before the ranks fork)

    train(tmp_path, "--export-hf", str(tmp_path / "hf"), config="hf-llama-tiny")
    check_outputs(tmp_path, 3)
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (256, 257)  # the byte tokenizer's


def test_grad_accum_equals_big_batch(tmp_path):
    # 2 micro-batches of 2 sequences per rank (no sync on the first) see the same 8 windows per step as
    # one batch of 4 per rank, so the losses match up to float summation order.
    accum = train(tmp_path / "a", "--optimizer", "adamw", "--set", "train.grad_accum=2", steps=3)["records"]
    big = train(tmp_path / "b", "--optimizer", "adamw", "--set", "train.batch_size=4", steps=3)["records"]
    assert [r["tokens"] for r in accum] == [r["tokens"] for r in big] == [k * 2 * 2 * 32 * 2 for k in (1, 2, 3)]
    for a, b in zip(accum, big):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert accum[-1]["loss"] < accum[0]["loss"]


def test_torch_fsdp2_backend(tmp_path):
    # The comparison path: PyTorch FSDP2 + torch.optim.AdamW + DCP, same script (meta init included).
    res = train(tmp_path, "--optimizer", "adamw", "--set", "train.backend=torch", "--set", "model.meta_init=true", steps=3)
    assert res["backend"] == "torch"
    check_outputs(tmp_path, 3)
    res = train(tmp_path, "--optimizer", "adamw", "--set", "train.backend=torch", "--resume", steps=4)
    assert res["resumed_from"].endswith("step_000003") and [r["step"] for r in res["records"]] == [1, 2, 3, 4]


def test_bf16_compute(tmp_path):
    # bf16 gathered parameters and compute, fp32 master weights and reduction (fsdp_optim.MixedPrecisionPolicy)
    res = train(tmp_path, "--set", "train.dtype=bf16", steps=2)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in res["records"])


def test_fp8_allgather(tmp_path):
    # --fp8-allgather: block-wise FP8 parameter all-gather (dim 128: the attention matrices and the
    # embedding are FP8-gathered); the loss tracks the plain run's and a checkpointed run resumes.
    wide = ["--set", "model.dim=128", "--set", "train.dtype=bf16"]
    ref = train(tmp_path / "ref", *wide, steps=4)["records"]
    fp8 = train(tmp_path / "fp8", *wide, "--fp8-allgather", steps=4)["records"]
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["train"]["fp8_all_gather"] == "128x128"
    for a, b in zip(fp8, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=0.02)
    res = train(tmp_path / "fp8", *wide, "--fp8-allgather", "1x128", "--resume", steps=5)
    assert res["resumed_from"].endswith("step_000004") and [r["step"] for r in res["records"]] == [1, 2, 3, 4, 5]
    with pytest.raises(DistributedTestError, match="needs the fsdp_optim backend"):
        train(tmp_path / "t", "--optimizer", "adamw", "--set", "train.backend=torch", "--fp8-allgather", steps=1)
    with pytest.raises(DistributedTestError, match="train.fp8_all_gather must be off, 128x128 or 1x128"):
        train(tmp_path / "u", "--set", 'train.fp8_all_gather="64x64"', steps=1)


def test_clear_errors(tmp_path):
    with pytest.raises(DistributedTestError, match=r"data.seq_len 64 is longer than the model supports \(32\)"):
        train(tmp_path / "a", "--set", "data.seq_len=64", "--set", "model.max_seq_len=32")
    (tmp_path / "small.txt").write_text("x" * 200)
    with pytest.raises(DistributedTestError, match="cannot feed world size 2"):
        train(tmp_path / "b", "--set", f'data.path="{tmp_path / "small.txt"}"', "--set", "train.batch_size=4")
    with pytest.raises(DistributedTestError, match="no data found"):
        train(tmp_path / "c", "--set", f'data.path="{tmp_path / "nothing_here"}"')
    train(tmp_path / "e", steps=1)
    with pytest.raises(DistributedTestError, match=r"already holds checkpoints \(latest step_000001, train.steps 2\); pass --resume"):
        train(tmp_path / "e", steps=2)
    # A finished run is recognised and reported, not retrained and not an error.
    res = train(tmp_path / "e", steps=1)
    assert res["finished"] and [r["step"] for r in res["records"]] == [1]
    # On the command line: one clear line, exit code 2, before any process group is needed.
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "d"), "--set", "model.dimm=8"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "error: unknown config key 'model.dimm' in --set. Did you mean 'dim'" in r.stderr


def _torchrun(out, steps, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
           "--config", str(CONFIGS / "tiny.toml"), "--steps", str(steps), "--out", str(out), *SMALL,
           "--set", "log.ckpt_every=2", "--set", "log.keep_ckpts=0", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_kill_one_rank_then_resume_matches_uninterrupted(tmp_path):
    steps = 12
    ref = tmp_path / "ref"
    train(ref, "--set", "log.ckpt_every=2", "--set", "log.keep_ckpts=0", steps=steps)
    expected = [json.loads(l) for l in (ref / "metrics.jsonl").read_text().splitlines()]

    run = tmp_path / "run"
    proc = _torchrun(run, steps)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # wait until step 3 is logged (checkpoint 2 is complete), then kill -9 rank 1
        if metrics.exists() and sum(1 for _ in metrics.open()) >= 3:
            break
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.01)
    ranks = sorted(_children(proc.pid), key=lambda p: int(
        dict(l.split("=", 1) for l in Path(f"/proc/{p}/environ").read_text().split("\0") if "=" in l).get("RANK", -1)))
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGKILL)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0, log
    done = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
    assert done[-1] < steps, "the run finished before the kill; the test needs a slower step"
    last_ckpt = ckpts.latest_checkpoint(run)
    assert last_ckpt is not None

    # Rerun with --resume (in forked ranks: the same main(), without a second torchrun start-up).
    res = train(run, "--set", "log.ckpt_every=2", "--set", "log.keep_ckpts=0", "--resume", steps=steps)
    got = res["records"]
    assert res["resumed_from"] == str(last_ckpt) and int(last_ckpt.name.split("_")[1]) >= 2
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for a, b in zip(got, expected):  # deterministic: the same numbers, not just close
        assert (a["step"], a["loss"], a["lr"], a["grad_norm"], a.get("eval_loss")) == (
            b["step"], b["loss"], b["lr"], b["grad_norm"], b.get("eval_loss")), (a, b)


def _fake_checkpoint(out: Path, name: str, marker: str | None = None) -> Path:
    """A checkpoint folder with a recipe_done.json marker (``marker``: its text; default a valid one)."""
    path = out / "checkpoints" / name
    path.mkdir(parents=True)
    if name.startswith("step_") and name[5:].isdigit():
        marker = json.dumps({"step": int(name[5:])}) if marker is None else marker
    if marker is not None:
        (path / "recipe_done.json").write_text(marker)
    return path


def test_only_complete_checkpoints_count_in_step_order(tmp_path, capsys):
    for name in ("step_000010", "step_999999", "step_1000000", "step_000020"):
        _fake_checkpoint(tmp_path, name)
    _fake_checkpoint(tmp_path, "step_2000000.tmp", marker='{"step": 2000000}')  # a killed save's folder
    (tmp_path / "checkpoints" / "step_3000000").mkdir()  # no marker: incomplete
    _fake_checkpoint(tmp_path, "step_000030", marker="")  # an empty (torn) marker: incomplete, with a warning
    _fake_checkpoint(tmp_path, "step_000040", marker='{"step": 41}')  # a marker of another step
    done = ckpts.complete_checkpoints(tmp_path)
    assert [p.name for _, p in done] == ["step_000010", "step_000020", "step_999999", "step_1000000"]
    assert ckpts.latest_checkpoint(tmp_path).name == "step_1000000"
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 'checkpoints' / 'step_000030' / 'recipe_done.json'} is unreadable" in err
    assert "step_000030 counts as incomplete" in err and "step_000040/recipe_done.json is unreadable" in err
    # Pruning keeps the newest complete ones, never the one just saved, and leaves the rest alone.
    ckpts.prune_checkpoints(tmp_path, 2, saved=tmp_path / "checkpoints" / "step_000020")
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_000020", "step_000030", "step_000040", "step_1000000", "step_2000000.tmp", "step_3000000",
                    "step_999999"]


def test_finished_run_reads_the_marker_safely(tmp_path):
    cfg = load_config(CONFIGS / "tiny.toml", ["train.steps=5"])
    _fake_checkpoint(tmp_path, "step_000003")
    _fake_checkpoint(tmp_path, "step_000005", marker="")  # unreadable: the run is not finished
    assert ckpts.finished_run(tmp_path, cfg) is None and ckpts.latest_checkpoint(tmp_path).name == "step_000003"


def test_marker_writes_are_atomic(tmp_path, monkeypatch):
    marker = tmp_path / "recipe_done.json"
    ckpts.write_atomic(marker, '{"step": 1}')

    def crash(fd):  # the process dies after writing, before the rename: the old marker is intact
        raise OSError("killed")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        ckpts.write_atomic(marker, '{"step": 2}')
    assert json.loads(marker.read_text()) == {"step": 1}


def test_adamw_lr_zero_is_kept(recwarn):
    from model import build_model

    cfg = load_config(CONFIGS / "tiny.toml", ["optim.adamw_lr=0", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=1",
                                              "model.ffn_dim=16", "model.n_layers=1", "model.vocab_size=20"])
    opt = build_optimizer(build_model(cfg.model), cfg, "fsdp_optim")
    lrs = [opt.adamw_lr(g) for g in opt.param_groups if not g["use_muon"]]
    assert opt.defaults["adamw_lr"] == 0.0 and lrs == [0.0]


def test_leftover_tmp_folder_does_not_prune_the_new_checkpoint(tmp_path):
    # QA's repro: a killed save left step_000050.tmp; with keep_ckpts=1 the checkpoint just written was deleted.
    train(tmp_path, "--set", "log.keep_ckpts=1", steps=2)
    (tmp_path / "checkpoints" / "step_000050.tmp").mkdir()
    res = train(tmp_path, "--set", "log.keep_ckpts=1", "--resume", steps=3)
    assert res["resumed_from"].endswith("step_000002") and [r["step"] for r in res["records"]] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003", "step_000050.tmp"]
    assert ckpts.latest_checkpoint(tmp_path).name == "step_000003"


def test_resume_at_another_world_size_then_a_missing_file(tmp_path):
    # W=2 for 2 steps, resumed at W=1: the token count continues (it never goes backwards), the data
    # position carries over (test_data.py checks the windows).
    args = ("--optimizer", "adamw", "--set", "log.ckpt_every=1")
    train(tmp_path, *args, steps=2)
    res = train(tmp_path, *args, "--resume", steps=3, world_size=1)
    assert [r["tokens"] for r in res["records"]] == [128, 256, 256 + 2 * 32]
    # A checkpoint file gone: a ValueError on every rank (cli's one line, exit 2) naming the checkpoint
    # and the way out, not a FileNotFoundError traceback per rank.
    ckpt = tmp_path / "checkpoints" / "step_000003"
    next(ckpt.glob("*.distcp")).unlink()
    with pytest.raises(DistributedTestError, match=r"ranks with errors: \[0, 1\]") as e:
        train(tmp_path, *args, "--resume", steps=4)
    line = next(l for l in str(e.value).splitlines() if l.startswith("ValueError"))
    assert line.startswith(f"ValueError: cannot resume from checkpoint {ckpt}: FileNotFoundError: checkpoint "), line
    assert line.endswith(f"delete {ckpt / 'recipe_done.json'} to resume from the previous complete checkpoint "
                         "instead, or use another --out to start afresh"), line
    (ckpt / "recipe_done.json").unlink()  # as the error says
    res = train(tmp_path, *args, "--resume", steps=4)
    assert res["resumed_from"].endswith("step_000002") and [r["step"] for r in res["records"]] == [1, 2, 3, 4]


def test_resume_refuses_data_rewritten_at_the_same_size(tmp_path):
    # Under torchrun (no pre-flight): every rank refuses before loading anything.
    data = tmp_path / "data.txt"
    text = "the quick brown fox jumps over the lazy dog. " * 400
    data.write_text(text)
    args = ["--set", f'data.path="{data}"', "--set", "data.val_fraction=0.1"]
    train(tmp_path / "run", *args, steps=1)
    data.write_text(text.replace("fox", "cat"))
    with pytest.raises(DistributedTestError, match=r"holds a run on other data: the token stream of data.path changed "
                                                   r"in its content \(same length\)"):
        train(tmp_path / "run", *args, "--resume", steps=2)
    data.write_text(text)
    assert [r["step"] for r in train(tmp_path / "run", *args, "--resume", steps=2)["records"]] == [1, 2]
