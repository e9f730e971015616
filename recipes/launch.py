"""torchrun, quiet on Ctrl-C: what scripts/pretrain.sh launches the recipe with.

    python recipes/launch.py --standalone --nproc_per_node=2 recipes/pretrain.py --config ... --out ...

Takes torchrun's arguments and runs ``torch.distributed.run``. On Ctrl-C (SIGINT) or SIGTERM,
torchrun forwards the signal to the ranks, waits for them, and raises ``SignalException``, a
traceback and exit code 1; here it exits with 128 + the signal (130 for Ctrl-C) and prints nothing
more: rank 0 of the recipe has printed where it stopped (see [Note: Ctrl-C] in pretrain.py).
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun

__all__ = ["launch"]


def launch(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; the exit code (128 + the signal when one stopped it)."""
    # torchrun's agent logs "Received 2 death signal, shutting down workers" as a warning (its loggers
    # have their own levels, from LOGLEVEL): keep its errors only.
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    try:
        torchrun(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(launch())
