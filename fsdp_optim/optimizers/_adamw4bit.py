"""4-bit AdamW on each rank's local quantization blocks, equal to torchao's AdamW4bit unsharded.

See [Note: quantized state on ragged shards] in ``_quantized_adamw.py``: blocks of 128 elements of
the global flat tensor, two codes per byte (high nibble first, as torchao packs), quantized whenever
the global tensor has >= 4096 elements (a partial final block included), bitwise equal to torchao
where torchao quantizes (Li et al., Memory Efficient Optimizers with 4-bit States, arXiv:2309.01507;
torchao's maps: a signed dynamic tree map and a linear unsigned map without 0).
"""

from __future__ import annotations

from ._quantized_adamw import FORMAT_4BIT, QuantizedAdamW
from ._rules import adamw8bit_rule

__all__ = ["AdamW4bit"]


class AdamW4bit(QuantizedAdamW):
    """torchao's ``AdamW4bit`` on sharded parameters: block-wise 4-bit moments, quantized locally.

    Needs every rank boundary of a quantized tensor on a ``block_size`` (128) boundary of the global
    flat tensor (``AdamW4bit.blocks``). Precision is decided on the global tensor, never the shard,
    so results are the same for every world size. ``compile`` and ``fuse_runs`` as in ``AdamW8bit``.
    ``step()`` issues no collectives.

    Keyword arguments as ``torchao.optim.AdamW4bit``: ``lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=1e-2, amsgrad=False, block_size=128``, plus ``compile=True``, ``fuse_runs=True``.
    """

    _format = FORMAT_4BIT
    _name = "AdamW4bit"
    _default_block_size = 128
    blocks = staticmethod(adamw8bit_rule(128))
