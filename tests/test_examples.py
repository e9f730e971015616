"""examples/train_minimal.py under torchrun at W=2: it trains, checkpoints, and a second run resumes
exactly where an uninterrupted run would be; a rerun with fewer --steps leaves the checkpoint alone."""

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "examples" / "train_minimal.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


def _losses(r: subprocess.CompletedProcess) -> dict[int, str]:
    assert r.returncode == 0, r.stdout + r.stderr
    return {int(s): loss for s, loss in re.findall(r"step (\d+): loss ([\d.]+)", r.stdout)}


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_train_minimal_runs_and_resumes(tmp_path):
    whole = _losses(_torchrun("--out", str(tmp_path / "whole"), "--steps", "12"))
    assert list(whole) == list(range(1, 13)) and float(whole[12]) < float(whole[1]) - 0.5, whole
    ckpt = tmp_path / "run" / "checkpoint"
    first = _losses(_torchrun("--out", str(tmp_path / "run"), "--steps", "6"))
    assert (ckpt / "fsdp_optim.json").exists()
    r = _torchrun("--out", str(tmp_path / "run"), "--steps", "12")
    assert "resumed from" in r.stdout and "at step 6" in r.stdout
    # The same losses (printed to 4 decimals) as the uninterrupted run: weights, optimizer and data
    # generators all continue where they were.
    assert first | _losses(r) == whole
    # Fewer --steps than the checkpoint's: nothing trained, the step-12 checkpoint kept as it is.
    before = _digest(ckpt)
    r = _torchrun("--out", str(tmp_path / "run"), "--steps", "3")
    assert _losses(r) == {} and "at step 12 >= --steps 3: nothing to train" in r.stdout, r.stdout
    assert _digest(ckpt) == before
