"""Sharded optimizers that run whole-block work on each rank's block-aligned shard."""

from ._rules import adamw8bit_rule, adamw_rule, is_embedding_or_head, muon_rule, shampoo_rule

__all__ = ["adamw_rule", "adamw8bit_rule", "muon_rule", "shampoo_rule", "is_embedding_or_head"]
