"""Testing tools for optimizer authors: is my optimizer the same sharded as unsharded? (docs/testing.md)

- ``check_sharded_equals_unsharded(make_model=..., make_optimizer=..., blocks=...)``: your optimizer on
  your model sharded by ``fully_shard`` (W = 1..4, HSDP) against the plain model, bitwise or within a
  measured noise floor, and the collectives its ``step()`` issues; returns a ``ShardedCheckReport``
  or raises ``AssertionError`` naming each failing run.
- ``count_collectives()``: a context manager counting the collectives issued inside it.
- ``run_distributed(fn, world_size=W)``: call ``fn`` on W forked gloo ranks on this machine, results
  in rank order (``DistributedTestError`` carries a failing rank's traceback).
- ``make_sharded_param``, ``sharded_grad``, ``emulated_mesh``: a sharded parameter without a model,
  a full gradient as a sharded parameter's gradient, every rank of a collective-free step in one process.

Like ``torch.testing``, this module is public API; its implementation lives in private modules.
"""

from ._check_sharded import (
    CollectiveCounts,
    MeshResult,
    ShardedCheckReport,
    check_sharded_equals_unsharded,
    count_collectives,
)
from ._testing import DistributedTestError, emulated_mesh, make_sharded_param, run_distributed, sharded_grad

__all__ = [
    "CollectiveCounts",
    "DistributedTestError",
    "MeshResult",
    "ShardedCheckReport",
    "check_sharded_equals_unsharded",
    "count_collectives",
    "emulated_mesh",
    "make_sharded_param",
    "run_distributed",
    "sharded_grad",
]
