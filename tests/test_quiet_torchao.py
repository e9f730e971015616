"""Importing fsdp_optim then torchao on a CPU-only torch prints no "Failed to load <CUDA .so>" lines."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_optim._quiet_torchao import _DropCudaExtensionFailures

ROOT = Path(__file__).resolve().parents[1]


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("torchao", logging.WARNING, __file__, 1, msg, None, None)


def test_filter_drops_only_extension_failures():
    f = _DropCudaExtensionFailures()
    assert not f.filter(_record("Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"))
    assert f.filter(_record("Failed to load config"))
    assert f.filter(_record("something else torchao says"))


@pytest.mark.skipif(torch.version.cuda is not None, reason="the filter is installed on CPU-only torch builds only")
def test_import_is_quiet_on_cpu_torch():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", "import fsdp_optim, torchao, fsdp_optim.optimizers"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "Failed to load" not in r.stderr, r.stderr
