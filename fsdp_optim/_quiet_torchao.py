"""Drop torchao's import-time noise: "Failed to load <CUDA extension>.so" on a CPU-only torch, and
torch's deprecation of ``register_constant`` on torchao's own enums.

torchao ships CUDA-only kernels (``_C_mxfp8``, ``_C_cutlass_90a``) and logs a warning for each one it
cannot load; on a CPU build of torch (``torch.version.cuda is None``) none of them can load and none is
used by fsdp_optim (AdamW8bit uses torchao's pure-PyTorch quantization), so the lines are noise. A
filter on the ``torchao`` logger drops exactly those records, only on CPU builds; everything else
torchao logs passes. Installed when ``fsdp_optim`` is imported, which does not import torchao.

torch 2.13 logs "<enum 'KernelPreference'> is an Enum subclass ... register_constant() on Enum
subclasses is deprecated" (``torch.utils._pytree``) when torchao 0.18 registers its enums, on every
rank that imports torchao (AdamW8bit / AdamW4bit do, at their first step). It is torchao's call to
fix, not the user's: a filter on that logger drops that warning for enums defined in torchao only.
"""

from __future__ import annotations

import logging

import torch

__all__: list[str] = []


class _DropCudaExtensionFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Failed to load ") and ".so" in msg)


class _DropTorchaoEnumDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        cls = args[0] if args else None
        from_torchao = isinstance(cls, type) and getattr(cls, "__module__", "").split(".")[0] == "torchao"
        return not (from_torchao and "register_constant() on Enum subclasses is deprecated" in str(record.msg))


_pytree_logger = logging.getLogger("torch.utils._pytree")
if not any(isinstance(f, _DropTorchaoEnumDeprecation) for f in _pytree_logger.filters):
    _pytree_logger.addFilter(_DropTorchaoEnumDeprecation())

if torch.version.cuda is None and torch.version.hip is None:
    _logger = logging.getLogger("torchao")
    if not any(isinstance(f, _DropCudaExtensionFailures) for f in _logger.filters):
        _logger.addFilter(_DropCudaExtensionFailures())
