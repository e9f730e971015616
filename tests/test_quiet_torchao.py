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


def test_torchao_enum_deprecation_is_dropped_and_nothing_else():
    import enum

    from fsdp_optim._quiet_torchao import _DropTorchaoEnumDeprecation

    msg = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. Calling "
           "register_constant() on Enum subclasses is deprecated and will be an error in a future release.")
    theirs = enum.Enum("KernelPreference", "AUTO")
    theirs.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    mine = enum.Enum("Mine", "A")
    f = _DropTorchaoEnumDeprecation()
    rec = lambda cls: logging.LogRecord("torch.utils._pytree", logging.WARNING, __file__, 1, msg, (cls,), None)  # noqa: E731
    assert not f.filter(rec(theirs))
    assert f.filter(rec(mine))  # another package's enum: its warning stays
    assert f.filter(logging.LogRecord("torch.utils._pytree", logging.WARNING, __file__, 1, "other", None, None))


def test_import_of_torchao_after_fsdp_optim_prints_nothing():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", "import fsdp_optim, torchao, torchao.optim"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
