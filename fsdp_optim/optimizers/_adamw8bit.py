"""8-bit AdamW on each rank's local quantization blocks, equal to torchao's AdamW8bit unsharded.

See [Note: quantized state on ragged shards] in ``_quantized_adamw.py``: blocks of 256 elements of
the global flat tensor, one code per byte, quantized whenever the global tensor has >= 4096
elements (a partial final block included), bitwise equal to torchao where torchao quantizes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ._quantized_adamw import FORMAT_8BIT, QUANTIZE_MIN_NUMEL, QuantizedAdamW, dequantize_blockwise, quantize_blockwise
from ._rules import adamw8bit_rule

__all__ = ["AdamW8bit", "QUANTIZE_MIN_NUMEL", "quantize_blockwise", "dequantize_blockwise"]


class AdamW8bit(QuantizedAdamW):
    """torchao's ``AdamW8bit`` on sharded parameters: block-wise 8-bit moments, quantized locally.

    Needs every rank boundary of a quantized tensor on a ``block_size`` boundary of the global flat
    tensor (``AdamW8bit.blocks``). ``compile=None`` (the default) compiles where the parameters are on
    a GPU and runs eagerly on the CPU (compiling takes minutes there); ``compile=True`` (torchao's
    behavior) runs the step through ``torch.compile``; ``False`` runs it eagerly (no compiler needed; numerics then equal torchao run
    with ``TORCHDYNAMO_DISABLE=1``, not compiled torchao: inductor contracts multiply-adds).
    Compiling builds one graph per distinct span length (seconds each on CPU, first step only): per
    run of adjacent shards with ``fuse_runs=True``, per local shape as torchao with ``False``. ``amsgrad=True`` keeps the running max in 8 bits too (torchao's own step fails on
    an 8-bit max). ``step()`` issues no collectives. ``fuse_runs=True`` steps parameters that lie back
    to back in memory (a ``fully_shard`` bucket's) with one call per run, same bits ([Note: runs]);
    ``False`` makes one call per parameter, as torchao.

    Keyword arguments as ``torchao.optim.AdamW8bit``: ``lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=1e-2, amsgrad=False, block_size=256``, plus ``compile=None``, ``fuse_runs=True``.
    """

    _format = FORMAT_8BIT
    _name = "AdamW8bit"
    _default_block_size = 256
    blocks = staticmethod(adamw8bit_rule(256))

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        compile: bool | None = None,
        **kwargs: Any,
    ) -> None:
        params = list(params)
        if compile is None:  # eager on the CPU, compiled on GPUs (what recipes/README.md says)
            tensors = [p for x in params for p in (x["params"] if isinstance(x, dict) else [x])]
            tensors = [t[1] if isinstance(t, tuple) else t for t in tensors]
            compile = any(torch.is_tensor(t) and t.device.type not in ("cpu", "meta") for t in tensors)
        super().__init__(params, compile=compile, **kwargs)
