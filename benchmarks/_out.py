"""Where a benchmark writes: committed results only from a full run.

Convention (every script here): ``--out DIR`` wins; otherwise a full run (every flag at its default,
apart from those naming a separate committed result such as ``--shard-size``) writes
``benchmarks/results/``, and a ``--quick`` or partial run (any other flag changed) writes
``runs/bench-quick/`` (gitignored), so a smoke run never overwrites the committed figures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCRATCH = ROOT / "runs" / "bench-quick"


def out_dir(parser: argparse.ArgumentParser, args: argparse.Namespace, *, keep: tuple[str, ...] = ()) -> Path:
    """``args.out`` if given; ``RESULTS`` for a full run; ``SCRATCH`` when any flag (other than ``out``,
    ``keep``) differs from its default."""
    if getattr(args, "out", None):
        return Path(args.out)
    defaults = vars(parser.parse_args([]))
    partial = [k for k, v in vars(args).items() if k not in ("out", *keep) and defaults.get(k) != v]
    return SCRATCH if partial else RESULTS
