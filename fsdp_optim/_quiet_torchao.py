"""Drop torchao's import-time "Failed to load <CUDA extension>.so" warnings on a CPU-only torch.

torchao ships CUDA-only kernels (``_C_mxfp8``, ``_C_cutlass_90a``) and logs a warning for each one it
cannot load; on a CPU build of torch (``torch.version.cuda is None``) none of them can load and none is
used by fsdp_optim (AdamW8bit uses torchao's pure-PyTorch quantization), so the lines are noise. A
filter on the ``torchao`` logger drops exactly those records, only on CPU builds; everything else
torchao logs passes. Installed when ``fsdp_optim`` is imported, which does not import torchao.
"""

from __future__ import annotations

import logging

import torch

__all__: list[str] = []


class _DropCudaExtensionFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Failed to load ") and ".so" in msg)


if torch.version.cuda is None and torch.version.hip is None:
    _logger = logging.getLogger("torchao")
    if not any(isinstance(f, _DropCudaExtensionFailures) for f in _logger.filters):
        _logger.addFilter(_DropCudaExtensionFailures())
