"""Sharded optimizers that run whole-block work on each rank's block-aligned shard."""

from ._adamw import AdamW, adamw_update
from ._adamw8bit import AdamW8bit
from ._muon import Muon
from ._rules import adamw8bit_rule, adamw_rule, is_embedding_or_head, muon_rule, shampoo_rule
from ._shampoo import Shampoo
from ._soap import SOAP

__all__ = ["AdamW", "adamw_update", "AdamW8bit", "Muon", "Shampoo", "SOAP", "adamw_rule", "adamw8bit_rule", "muon_rule", "shampoo_rule", "is_embedding_or_head"]
