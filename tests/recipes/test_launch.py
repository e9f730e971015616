"""The recipe as a user launches it: without torchrun, with a bad config under torchrun, rerun through
scripts/pretrain.sh, and on two torchrun agents (a 2-node rendezvous on one machine)."""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "recipes/pretrain.py"
TINY = ["--config", "recipes/configs/tiny.toml"]
# Tiny dims so a step takes milliseconds (as in test_pretrain.py).
SMALL = ["--set", "model.dim=48", "--set", "model.n_layers=2", "--set", "model.n_heads=4", "--set", "model.n_kv_heads=2",
         "--set", "model.ffn_dim=64", "--set", "data.seq_len=32", "--set", "train.batch_size=2",
         "--set", "train.warmup_steps=2", "--set", "log.eval_batches=1"]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
           PYTHONUNBUFFERED="1")


def _run(cmd: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or ENV, cwd=ROOT)


def _torchrun(*args: str, launcher: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *(launcher or ["--standalone", "--nproc_per_node=2"]),
            SCRIPT, *args]


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_without_torchrun_prints_the_command(tmp_path):
    args = [*TINY, "--out", str(tmp_path / "a b"), "--steps", "3"]
    r = _run([sys.executable, SCRIPT, *args])
    assert r.returncode == 2, r.stderr
    assert "runs under torchrun (RANK is not set)" in r.stderr
    expected = f"torchrun --standalone --nproc_per_node=2 recipes/pretrain.py {' '.join(TINY)} --out '{tmp_path / 'a b'}' --steps 3"
    assert expected in r.stderr, r.stderr
    assert not (tmp_path / "a b").exists()  # nothing written


def test_check_validates_before_any_rank(tmp_path, capsys, monkeypatch):
    # The check (what scripts/pretrain.sh runs before torchrun), in-process: pretrain.cli is the __main__.
    import pretrain

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    out = ["--out", str(tmp_path)]
    assert pretrain.cli([*TINY, *out, "--check", "2"]) == 0
    assert "check passed for 2 ranks" in capsys.readouterr().out
    for bad, match in [
        (["--set", "model.dimm=8"], "error: unknown config key 'model.dimm' in --set. Did you mean 'dim'"),
        (["--optimizer", "sgd"], "error: argument --optimizer: invalid choice: 'sgd'"),
        (["--stepz", "3"], "error: unrecognized arguments: --stepz 3"),
        (["--set", "model.max_seq_len=64"], "error: data.seq_len 128 is longer than the model supports (64)"),
        (["--set", "train.batch_size=100000"], "error: the data cannot feed world size 2"),
        (["--set", "train.dtype=fp16"], "error: train.dtype must be auto, bf16 or fp32, got 'fp16'"),
        (["--optimizer", "muon", "--set", "train.backend=torch"], "error: optim.name = 'muon' needs fsdp_optim"),
    ]:
        assert pretrain.cli([*TINY, *out, *bad, "--check", "2"]) == 2, bad
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith(match), (bad, err)
    assert not list(tmp_path.iterdir())
    # An unfinished run is never trained over without --resume; the check says so before any rank starts.
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000001" / "recipe_done.json").write_text('{"step": 1}')
    assert pretrain.cli([*TINY, *out, "--check", "2"]) == 2
    assert "already holds checkpoints (latest step_000001, train.steps 100); pass --resume" in capsys.readouterr().err
    assert pretrain.cli([*TINY, *out, "--resume", "--check", "2"]) == 0


def test_torchrun_config_error_is_one_line_on_rank_0(tmp_path):
    r = _run(_torchrun(*TINY, "--out", str(tmp_path), "--set", "model.dimm=8"))
    assert r.returncode != 0
    errors = _error_lines(r.stdout + r.stderr)
    assert len(errors) == 1 and "unknown config key 'model.dimm'" in errors[0], r.stdout + r.stderr
    assert "exitcode  : 2" in r.stderr  # the rank's exit code, as torchrun reports it


def test_pretrain_sh_reruns(tmp_path):
    # The README's main job, twice: the second run recognises the finished run (exit 0, no training).
    env = dict(ENV, OUT=str(tmp_path / "run"), PYTHON=sys.executable)
    first = _run(["bash", "scripts/pretrain.sh", "--steps", "2", *SMALL], env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    last = first.stdout.strip().splitlines()[-1]
    assert last.startswith("[pretrain] done: step 2: loss ") and last.endswith(f"checkpoint {tmp_path / 'run'}/checkpoints/step_000002")
    loss = last.split("loss ")[1].split(",")[0]
    assert len(loss.split(".")[1]) == 3  # rounded
    again = _run(["bash", "scripts/pretrain.sh", "--steps", "2", *SMALL], env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already holds a finished run: step 2: loss " in again.stdout and "step_000002" in again.stdout
    assert [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    bad = _run(["bash", "scripts/pretrain.sh", "--set", "model.dimm=8"], env=dict(env, OUT=str(tmp_path / "bad")))
    assert bad.returncode == 2 and len(_error_lines(bad.stderr)) == 1 and "Traceback" not in bad.stderr, bad.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_node_launch_equals_one_node(tmp_path):
    # Two torchrun agents rendezvous over c10d on localhost as 2 nodes x 2 ranks; the losses must equal
    # a single 4-rank launch bit for bit (same global ranks, same data, same collectives).
    args = [*TINY, *SMALL, "--steps", "2", "--set", "log.eval_batches=1"]
    single = _run(_torchrun(*args, "--out", str(tmp_path / "single"), launcher=["--standalone", "--nproc_per_node=4"]))
    assert single.returncode == 0, single.stdout + single.stderr
    port = _free_port()
    multi = ["--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
             "--rdzv-id=fsdp-optim-test"]
    agents = [subprocess.Popen(_torchrun(*args, "--out", str(tmp_path / "multi"), launcher=multi), cwd=ROOT, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], logs

    def records(name):
        return [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    one, two = records("single"), records("multi")
    assert [r["step"] for r in one] == [1, 2]
    assert [(r["loss"], r["grad_norm"], r.get("eval_loss")) for r in two] == [
        (r["loss"], r["grad_norm"], r.get("eval_loss")) for r in one]
    assert "world 4" in "".join(logs)


def _check(capsys, *args: str) -> tuple[int, str, str]:
    """``--check`` in-process (what scripts/pretrain.sh runs first): exit code, stdout, stderr."""
    import pretrain

    rc = pretrain.cli([*args, "--check", "2"] if "--check" not in args else list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _refused(capsys, args: list[str], match: str) -> None:
    rc, _, err = _check(capsys, *args)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith(f"error: {match}"), (args, err)


def test_check_refuses_out_of_range_values(tmp_path, capsys, monkeypatch):
    # Values the type check accepts but that crash every rank later (ZeroDivisionError) or silently train
    # something else (a negative grad_clip flips the gradients): refused with the key, value and range.
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    out = [*TINY, "--out", str(tmp_path / "run")]
    for bad, match in [
        ("train.grad_clip=-1", "train.grad_clip = -1.0 is out of range: it must be >= 0 (0: no clipping)"),
        ("train.min_lr_ratio=2", "train.min_lr_ratio = 2.0 is out of range: it must be in [0, 1]"),
        ("optim.adamw_lr=-1", "optim.adamw_lr = -1.0 is out of range"),
        ("optim.weight_decay=-1", "optim.weight_decay = -1.0 is out of range"),
        ("train.batch_size=0", "train.batch_size = 0 is out of range: it must be >= 1"),
        ("data.seq_len=0", "data.seq_len = 0 is out of range"),
        ("train.grad_accum=0", "train.grad_accum = 0 is out of range"),
        ("log.every=0", "log.every = 0 is out of range"),
        ("model.dim=0", "model.dim = 0 is out of range"),
        ("model.n_layers=-2", "model.n_layers = -2 is out of range"),
        ("data.val_fraction=-0.1", "data.val_fraction = -0.1 is out of range"),
        ("optim.betas=0.9", "config key 'optim.betas' in --set must be a list of 2 floats"),
        ("optim.betas=[0.9]", "config key 'optim.betas' in --set must be a list of 2 floats"),
    ]:
        _refused(capsys, [*out, "--set", bad], match)
    assert not (tmp_path / "run").exists()


def test_check_names_the_file_or_key_at_fault(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "bad.toml").write_text("[train]\nsteps = 3\n[train]\n")
    (tmp_path / "odd.bin").write_bytes(b"\1\2\3")
    import numpy as np

    np.array([1, 2, 300] * 2000, np.uint16).tofile(tmp_path / "ids.bin")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 " * 3000)
    out = [*TINY, "--out", str(tmp_path / "run")]
    for args, match in [
        (["--check", "0"], "--check 0: the number of ranks must be >= 1"),
        (["--steps", "3", "--set", "train.steps=4"], "--steps 3 and --set train.steps=4 disagree; give only one"),
        (["--config", str(tmp_path / "bad.toml")], f"config file '{tmp_path / 'bad.toml'}' is not valid TOML"),
        (["--set", "optim.name=sgd", "--export-hf", str(tmp_path / "hf")], "optim.name must be one of"),
        (["--export-hf", str(afile / "hf")], f"--export-hf {afile / 'hf'}: {afile} is a file"),
        (["--export-hf", str(afile)], f"--export-hf {afile} is a file, not a directory"),
        (["--export-hf", str(tmp_path / "run")], f"--export-hf {tmp_path / 'run'} is the run folder (--out)"),
        (["--set", f'data.path="{tmp_path / "odd.bin"}"'], f"data file '{tmp_path / 'odd.bin'}' has 3 bytes, not a multiple"),
        (["--set", f'data.path="{tmp_path / "ids.bin"}"'], f"data file '{tmp_path / 'ids.bin'}' holds token id 300, but"),
        (["--set", f'data.path="{tmp_path / "latin1.txt"}"'],
         f"data file '{tmp_path / 'latin1.txt'}' is not UTF-8 text: byte 3"),
        (["--config", "recipes/configs/hf-llama-tiny.toml", "--set", 'model.hf_config={model_type="llama", vocab_size=100}'],
         "model.hf_config.vocab_size 100 < the tokenizer's 258"),
    ]:
        _refused(capsys, [*out, *args], match)
    _refused(capsys, [*TINY, "--out", str(afile / "run")], f"--out {afile / 'run'}: {afile} is a file")
    if importlib.util.find_spec("transformers") is not None:  # the limit set in hf_config is named as the key to raise
        hf = ["--config", "recipes/configs/hf-llama-tiny.toml", "--set", 'model.hf_config={model_type="llama", '
              'hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64}']
        _refused(capsys, [*out, *hf], "data.seq_len 128 is longer than the model supports (64); lower data.seq_len or "
                                      "raise model.hf_config.max_position_embeddings")


def _fake_run(tmp_path: Path, *args: str, step: int) -> Path:
    """A run folder as the recipe leaves it: config.json (resolved as main writes it) and a complete checkpoint."""
    import _checks
    from config import to_dict

    out = tmp_path / "run"
    cfg = _checks.resolve_config(_checks.parse_args([*TINY, "--out", str(out), *args]))
    _checks.load_data(cfg, 2)
    (out / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (out / "checkpoints" / f"step_{step:06d}" / "recipe_done.json").write_text(json.dumps({"step": step}))
    (out / "config.json").write_text(json.dumps(to_dict(cfg)))
    return out


def test_check_refuses_a_resume_with_other_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    out = [*TINY, "--out", str(_fake_run(tmp_path, step=5)), "--resume"]
    assert _check(capsys, *out)[0] == 0
    assert _check(capsys, *out, "--set", "train.batch_size=4", "--steps", "200")[0] == 0  # these may change
    for args, match in [
        (["--set", "model.dim=96", "--optimizer", "adamw"],
         "model.dim 192 -> 96, optim.name 'muon' -> 'adamw'; a resume cannot"),
        (["--set", "train.seed=1"], "train.seed 0 -> 1"),
        (["--set", "data.seq_len=64"], "data.seq_len 128 -> 64"),
        (["--optimizer", "adamw", "--set", "train.backend=torch"],
         "optim.name 'muon' -> 'adamw', train.backend 'fsdp_optim' -> 'torch'"),
    ]:
        rc, _, err = _check(capsys, *out, *args)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert f"holds a run with other settings: {match}" in err and "use another --out for a new run" in err, err


def test_check_of_a_finished_run_with_export_hf(tmp_path, capsys, monkeypatch):
    # A finished run is reported (exit 3) unless --export-hf asks for its export: then torchrun has work.
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    out = [*TINY, "--out", str(_fake_run(tmp_path, step=100))]
    rc, stdout, _ = _check(capsys, *out)
    assert rc == 3 and "already holds a finished run" in stdout and "--export-hf DIR exports it" in stdout
    rc, stdout, _ = _check(capsys, *out, "--export-hf", str(tmp_path / "hf"))
    assert rc == 0 and "is finished: torchrun exports it" in stdout, stdout


def test_pretrain_sh_refuses_nproc_0(tmp_path):
    r = _run(["bash", "scripts/pretrain.sh"], env=dict(ENV, OUT=str(tmp_path / "run"), NPROC="0", PYTHON=sys.executable))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: NPROC=0: the number of ranks must be a whole number >= 1, e.g. NPROC=2"


def test_check_passed_prints_the_command_that_trains(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    args = [*TINY, "--out", str(tmp_path / "run"), "--steps", "3"]
    rc, stdout, _ = _check(capsys, *args)
    assert rc == 0 and "--check" not in stdout, stdout
    assert stdout.strip().endswith(f"run: torchrun --standalone --nproc_per_node=2 recipes/pretrain.py {' '.join(args)}")
    import pretrain

    assert pretrain.cli([*args, "--check=3"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"--nproc_per_node=3 recipes/pretrain.py {' '.join(args)}")


def test_check_validates_set_even_when_the_run_is_finished(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    out = [*TINY, "--out", str(_fake_run(tmp_path, step=100))]
    assert _check(capsys, *out)[0] == 3
    _refused(capsys, [*out, "--set", "model.max_seq_len=64"], "data.seq_len 128 is longer than the model supports (64)")
    _refused(capsys, [*out, "--set", f'data.path="{tmp_path / "nothing"}"'], f"data.path = '{tmp_path / 'nothing'}': no data")


def test_check_refuses_an_unwritable_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    if os.geteuid() == 0:  # root writes through permission bits: a place no file can be made
        parent = Path("/proc")
    else:
        parent = tmp_path / "ro"
        parent.mkdir()
        parent.chmod(0o555)
    _refused(capsys, [*TINY, "--out", str(parent / "run")], f"--out {parent / 'run'}: {parent} is not writable")


def _data_run(tmp_path: Path, capsys) -> tuple[Path, list[str]]:
    """A data file and a run on it (as the recipe leaves it, with data.json)."""
    import _checkpointing
    import _checks

    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    args = ["--set", f'data.path="{data}"', "--set", "data.seq_len=32", "--set", "data.val_fraction=0.1", "--resume"]
    out = _fake_run(tmp_path, *args[:-1], step=5)
    cfg = _checks.resolve_config(_checks.parse_args([*TINY, "--out", str(out), *args]))
    (out / "data.json").write_text(json.dumps(_checkpointing.data_identity(_checks.load_data(cfg, 2)[1])))
    assert _check(capsys, *TINY, "--out", str(out), *args)[0] == 0
    return data, [*TINY, "--out", str(out), *args]


def test_check_refuses_data_rewritten_at_the_same_size_or_appended(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RANK", raising=False)
    data, args = _data_run(tmp_path, capsys)
    out = args[args.index("--out") + 1]
    text = data.read_text()
    data.write_text(text.replace("fox", "cat"))  # same size, other content
    _refused(capsys, args, f"--out {out} holds a run on other data: the token stream of data.path changed in its "
                           "content (same length)")
    data.write_text(text + "and more. " * 50)
    _refused(capsys, args, f"--out {out} holds a run on other data: the token stream of data.path changed in its length")
    data.write_text(text)
    assert _check(capsys, *args)[0] == 0


def _wait_for_steps(metrics: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and sum(1 for _ in metrics.open()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{metrics}: fewer than {n} steps in {timeout} s")


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    # Ctrl-C reaches the whole foreground process group: the launcher (scripts/pretrain.sh execs it)
    # and the ranks. One line names where the run stopped and what a rerun resumes; no traceback.
    env = dict(ENV, OUT=str(tmp_path / "run"), PYTHON=sys.executable)
    cmd = ["bash", "scripts/pretrain.sh", "--steps", "100000", *SMALL, "--set", "log.ckpt_every=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    _wait_for_steps(tmp_path / "run" / "metrics.jsonl", 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr and "death signal" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and re.fullmatch(
        rf"\[pretrain\] interrupted at step \d+; rerun resumes from {tmp_path / 'run'}/checkpoints/step_\d+", lines[0]
    ), stderr
    assert "\r" not in stdout + stderr  # no progress bar in a log (stderr is not a terminal)
