"""Sharded optimizers that run whole-block work on each rank's block-aligned shard."""

from ._adamw import AdamW, adamw_update
from ._adamw4bit import AdamW4bit
from ._adamw8bit import AdamW8bit
from ._muon import Muon
from ._normuon import NorMuon
from ._qk_clip import ClipStats, attention_with_max_logits, measure_max_logits, qk_clip_, record_max_logits, recorded_max_logits
from ._rules import adamw8bit_rule, adamw_rule, is_embedding_or_head, muon_rule, shampoo_rule
from ._shampoo import Shampoo
from ._soap import SOAP
from ._whole_tensor import WholeTensorOptimizer, whole_tensor_rule

__all__ = [
    "AdamW",
    "AdamW4bit",
    "AdamW8bit",
    "ClipStats",
    "Muon",
    "NorMuon",
    "SOAP",
    "Shampoo",
    "WholeTensorOptimizer",
    "adamw8bit_rule",
    "adamw_rule",
    "adamw_update",
    "attention_with_max_logits",
    "is_embedding_or_head",
    "muon_rule",
    "measure_max_logits",
    "qk_clip_",
    "record_max_logits",
    "recorded_max_logits",
    "shampoo_rule",
    "whole_tensor_rule",
]
