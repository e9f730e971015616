"""Benchmarks write committed results only from a full run; --quick / partial runs go to runs/bench-quick/."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_out_dir_convention(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        from _out import RESULTS, SCRATCH, out_dir
    finally:
        sys.path.remove(str(BENCH))
    assert RESULTS == BENCH / "results" and SCRATCH == ROOT / "runs" / "bench-quick"
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shard-size", type=int, default=None)
    ap.add_argument("--out", default=None)
    assert out_dir(ap, ap.parse_args([])) == RESULTS
    assert out_dir(ap, ap.parse_args(["--quick"])) == SCRATCH
    assert out_dir(ap, ap.parse_args(["--reps", "3"])) == SCRATCH  # partial
    assert out_dir(ap, ap.parse_args(["--shard-size", "64"]), keep=("shard_size",)) == RESULTS
    assert out_dir(ap, ap.parse_args(["--quick", "--out", str(tmp_path)])) == tmp_path
    assert "runs/" in (ROOT / ".gitignore").read_text().split()


def test_planner_scale_quick_never_touches_results(tmp_path, monkeypatch):
    # The quick grid writes where --out says (default runs/bench-quick/), never benchmarks/results/.
    ps = _load("planner_scale")
    before = {p.name: p.stat().st_mtime_ns for p in (BENCH / "results").iterdir()}
    monkeypatch.setattr(ps, "run", lambda *a, **k: {"rows": [], "largest_balanced": {}})
    monkeypatch.setattr(ps, "_md", lambda data, command: f"command: {command}\n")
    monkeypatch.setattr(ps, "_plot", lambda data, path: path.write_bytes(b"png"))
    assert ps.main(["--quick", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "planner_scale.json").exists() and "--quick" in (tmp_path / "planner_scale.md").read_text()
    assert {p.name: p.stat().st_mtime_ns for p in (BENCH / "results").iterdir()} == before
