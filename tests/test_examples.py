"""examples/train_minimal.py under torchrun at W=2: it trains, checkpoints, and a second run resumes."""

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


def test_train_minimal_runs_and_resumes(tmp_path):
    r = _torchrun("--out", str(tmp_path), "--steps", "12")
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(v) for v in re.findall(r"step \d+: loss ([\d.]+)", r.stdout)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses
    assert (tmp_path / "checkpoint" / "fsdp_optim.json").exists()
    r2 = _torchrun("--out", str(tmp_path), "--steps", "14")
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert "resumed from" in r2.stdout and "at step 12" in r2.stdout
    assert re.findall(r"step (\d+): loss", r2.stdout) == ["13", "14"]
