"""``check_sharded_equals_unsharded``: an optimizer on sharded parameters against itself unsharded.

The public face is ``fsdp_optim.testing`` (docs/testing.md). The check runs the user's optimizer
``steps`` times on the user's model in three ways, each in forked gloo ranks (``run_distributed``):

1. the reference: the plain (unsharded) model in one process;
2. the noise floor: the same, with inputs that differ only by rounding (below);
3. for each world size and HSDP mesh: the model sharded by ``fully_shard`` (ragged, block-aligned
   layouts from the planner; dims that divide nothing stay uneven), the same gradients.

[Note: the gradients of the check]
Every step's gradients are drawn from one generator seeded with ``seed`` (``torch.randn`` of each
trainable parameter's global shape, in ``named_parameters()`` order of the unsharded model); a
sharded run sets each parameter's ``.grad`` to this rank's piece of the same full tensor
(``sharded_grad``). So the sharded and unsharded runs see the *same bits* of gradient, and any
difference after the steps is the optimizer's own: its arithmetic on pieces, its batching, or a
bug (a local norm where a global one is meant, a reduction over the wrong group). The forward and
backward of the model are ``fully_shard``'s business and not part of this check.

[Note: the measured noise floor]
An optimizer whose step reduces (a norm, a mean) may legitimately sum in another order on shards
than unsharded: the result then differs by rounding, amplified by whatever the optimizer does next
(Newton–Schulz in bf16 amplifies a last-bit change into a bf16 ulp). Rather than guessing a
tolerance, the check measures how far two honest runs drift apart:

- ``floor="perturbed"`` (default): the reference again, with every gradient element moved by one
  ulp in a random direction (``torch.nextafter``), a rounding-sized change of the inputs such as a
  different summation order of the gradient reduction gives; the floor is the largest element-wise
  difference of any parameter between the two runs after ``steps`` steps.
- ``floor="float64"``: the reference in float64 (model and gradients), compared with the float32
  reference; a float32 computation in any order is about as far from exact as the reference is, so
  two float32 orders differ by at most about twice this floor.

``tolerance="measured"`` requires every sharded run within ``floor_multiple`` times the floor (a
floor of 0, an optimizer insensitive to rounding-sized changes, means bitwise); ``"bitwise"``
requires ``torch.equal`` on every parameter (the mode for optimizers whose math allows it:
element-wise ones, and whole-block ones on whole blocks); a number is an absolute bound.

[Note: counting collectives]
``opt.step()`` runs under ``CommDebugMode`` (every c10d collective torch dispatches: all-reduce,
all-gather, reduce-scatter, all-to-all, broadcast, ...) while ``torch.distributed``'s point-to-point
and barrier functions (which it does not see) are wrapped and counted too. The report gives the most
collectives any rank issued in one step; ``max_collectives`` (default 0) bounds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "CollectiveCounts",
    "MeshResult",
    "ShardedCheckReport",
    "check_sharded_equals_unsharded",
    "count_collectives",
]
_WHO = "check_sharded_equals_unsharded"

_TOLERANCES = ("bitwise", "measured")
_FLOORS = ("perturbed", "float64")
_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier")


@dataclasses.dataclass
class CollectiveCounts:
    """What ``count_collectives`` saw: ``by_op`` maps an op name (``c10d.allreduce_``,
    ``torch.distributed.send``, ...) to its count; ``total`` is their sum."""

    by_op: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the collectives this process issues inside the block ([Note: counting collectives])::

        with count_collectives() as seen:
            opt.step()
        assert seen.total == 0, seen.by_op
    """
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    counts = CollectiveCounts()
    saved = {name: getattr(dist, name) for name in _P2P if hasattr(dist, name)}

    def wrap(name: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            key = f"torch.distributed.{name}"
            counts.by_op[key] = counts.by_op.get(key, 0) + 1
            return fn(*args, **kwargs)

        return counted

    mode = CommDebugMode()
    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        with mode:
            yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        for op, n in mode.get_comm_counts().items():
            if n:
                key = str(op)
                counts.by_op[key] = counts.by_op.get(key, 0) + int(n)


@dataclasses.dataclass(frozen=True)
class MeshResult:
    """One sharded run: ``mesh`` is ``(replicate, shard)`` (``(1, W)`` is plain FSDP over W ranks);
    ``max_abs_diff`` the largest element-wise difference from the reference over every parameter,
    reached in ``worst_param``; ``bitwise`` whether every parameter equals the reference exactly;
    ``collectives_per_step`` the most collectives any rank issued in one ``step()``, of the kinds in
    ``collective_ops``; ``cut_params`` how many of the ``num_params`` parameters lay in pieces on two or
    more ranks of the shard group (0: every tensor whole on one rank, as whole-tensor block rules give)."""

    mesh: tuple[int, int]
    max_abs_diff: float
    worst_param: str
    bitwise: bool
    collectives_per_step: int
    collective_ops: tuple[str, ...]
    cut_params: int = 0
    num_params: int = 0

    @property
    def world_size(self) -> int:
        return self.mesh[0] * self.mesh[1]

    @property
    def label(self) -> str:
        r, s = self.mesh
        return f"W={s}" if r == 1 else f"HSDP {r}x{s}"


@dataclasses.dataclass(frozen=True)
class ShardedCheckReport:
    """The figures of one ``check_sharded_equals_unsharded`` call (``str(report)`` is a table).

    ``floor``: the measured noise floor (``floor_method``; ``None`` unless ``tolerance="measured"``);
    ``bound``: the largest difference allowed (0.0 for bitwise); ``results``: one ``MeshResult`` per
    sharded run; ``max_collectives``: the bound on collectives per step (``None``: not bounded)."""

    steps: int
    tolerance: str | float
    floor_method: str | None
    floor: float | None
    floor_param: str | None
    bound: float
    max_collectives: int | None
    results: tuple[MeshResult, ...]

    def failures(self) -> list[str]:
        """One line per run that breaks the bound or the collective limit (empty: the check passed)."""
        out = []
        for r in self.results:
            if self.tolerance == "bitwise" and not r.bitwise:
                out.append(
                    f"{r.label}: not bitwise equal to unsharded: max |diff| {r.max_abs_diff:.3e} in {r.worst_param}"
                )
            elif self.tolerance != "bitwise" and not r.max_abs_diff <= self.bound:
                out.append(
                    f"{r.label}: max |diff| {r.max_abs_diff:.3e} in {r.worst_param} exceeds the bound {self.bound:.3e}"
                    + (f" ({self._bound_text()})" if self.floor is not None else "")
                )
            if self.max_collectives is not None and r.collectives_per_step > self.max_collectives:
                out.append(
                    f"{r.label}: step() issued {r.collectives_per_step} collective(s) in one step "
                    f"({', '.join(r.collective_ops)}); at most {self.max_collectives} allowed"
                )
        return out

    def _bound_text(self) -> str:
        if self.floor:
            return f"{self.bound / self.floor:g} x the {self.floor_method} noise floor {self.floor:.3e}"
        return (
            f"the {self.floor_method} noise floor is 0: the optimizer did not move under rounding-sized changes, "
            "so sharded runs must be bitwise"
        )

    def __str__(self) -> str:
        if self.tolerance == "bitwise":
            head = "tolerance: bitwise"
        elif self.floor is not None:
            head = f"tolerance: measured; bound {self.bound:.3e} = {self._bound_text()} (worst in {self.floor_param})"
        else:
            head = f"tolerance: {self.bound:.3e} (absolute)"
        lines = [f"{self.steps} step(s); {head}; collectives per step allowed: {self.max_collectives}"]
        lines.append(
            f"  {'run':<12} {'max |diff|':>11}  {'bitwise':<7}  {'coll/step':>9}  {'cut':>7}  worst parameter"
        )
        for r in self.results:
            cut = f"{r.cut_params}/{r.num_params}"
            lines.append(
                f"  {r.label:<12} {r.max_abs_diff:>11.3e}  {str(r.bitwise):<7}  {r.collectives_per_step:>9}  "
                f"{cut:>7}  {r.worst_param}" + (f"  [{', '.join(r.collective_ops)}]" if r.collective_ops else "")
            )
        return "\n".join(lines)


def check_sharded_equals_unsharded(
    *,
    make_model: Callable[[], Any],
    make_optimizer: Callable[[Any], Any],
    blocks: Any = None,
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    hsdp: bool | Sequence[tuple[int, int]] = True,
    steps: int = 3,
    tolerance: str | float = "bitwise",
    floor: str = "perturbed",
    floor_multiple: float = 4.0,
    max_collectives: int | None = 0,
    shard: Callable[[Any, Any], Any] | None = None,
    seed: int = 0,
    timeout: float = 300.0,
) -> ShardedCheckReport:
    """Check that an optimizer gives the same parameters sharded (``fully_shard``, W ranks, HSDP) as
    unsharded, and that its ``step()`` issues no collective; return the figures
    (``ShardedCheckReport``) or raise ``AssertionError`` naming each failing run.

    Args:
        make_model: builds the model (an ``nn.Module`` on CPU, float32); called after
            ``torch.manual_seed(seed)`` in every run, so every run starts from the same weights.
        make_optimizer: ``make_optimizer(model)`` builds the optimizer on the model's parameters (pass
            ``model.named_parameters()`` if your optimizer decides by name); called after sharding.
        blocks: the block rule passed to ``fully_shard`` (your optimizer's, e.g. ``Muon.blocks``;
            ``None``: element granularity, plain FSDP).
        world_sizes: plain FSDP runs over these numbers of ranks.
        hsdp: HSDP runs, ``(replicate, shard)`` mesh shapes; ``True`` is ``[(2, 2)]``, ``False`` none.
        steps: optimizer steps per run.
        tolerance: ``"bitwise"`` (every parameter ``torch.equal`` to the reference), ``"measured"``
            (within ``floor_multiple`` times the measured noise floor; see ``floor``) or a number (an
            absolute bound on the element-wise difference).
        floor: how the noise floor is measured (``tolerance="measured"`` only): ``"perturbed"``
            (the reference with every gradient element moved by one ulp) or ``"float64"`` (the
            reference in float64 against float32).
        floor_multiple: the multiple of the floor allowed.
        max_collectives: the most collectives a rank may issue in one ``step()`` (``None``: any).
        shard: ``shard(model, mesh)`` applies ``fully_shard`` as your training script does (per-layer
            calls, then the root); default ``fully_shard(model, mesh=mesh, blocks=blocks)``.
        seed: the seed of the weights and of the gradients.
        timeout: seconds allowed per run (a hang becomes a ``TimeoutError`` naming the ranks).

    The gradients are random and the same bits in every run ([Note: the gradients of the check] in
    ``fsdp_optim/_check_sharded.py``): the difference measured is the optimizer's alone.
    """
    meshes = _check_arguments(
        make_model=make_model, make_optimizer=make_optimizer, world_sizes=world_sizes, hsdp=hsdp, steps=steps,
        tolerance=tolerance, floor=floor, floor_multiple=floor_multiple, max_collectives=max_collectives,
        shard=shard, timeout=timeout,
    )  # fmt: skip
    from ._testing import run_distributed

    measured = tolerance == "measured"

    def reference() -> tuple[dict, Any, str | None]:
        ref = _run_unsharded(make_model, make_optimizer, steps=steps, seed=seed)
        if not measured:
            return ref, None, None
        if floor == "perturbed":
            other = _run_unsharded(make_model, make_optimizer, steps=steps, seed=seed, perturb=True)
        else:
            other = _run_unsharded(make_model, make_optimizer, steps=steps, seed=seed, dtype_double=True)
        diff, worst, _ = _compare(other, ref)
        return ref, diff, worst

    ref, floor_value, floor_param = run_distributed(reference, world_size=1, timeout=timeout)[0]
    if tolerance == "bitwise":
        bound = 0.0
    elif measured:
        bound = floor_multiple * floor_value
    else:
        bound = float(tolerance)

    results = []
    for mesh_shape in meshes:
        outs = run_distributed(
            lambda m=mesh_shape: _run_sharded(make_model, make_optimizer, blocks, shard, m, steps=steps, seed=seed),
            world_size=mesh_shape[0] * mesh_shape[1],
            timeout=timeout,
        )
        results.append(_mesh_result(mesh_shape, outs, ref))
    report = ShardedCheckReport(
        steps=steps, tolerance=tolerance, floor_method=floor if measured else None, floor=floor_value,
        floor_param=floor_param, bound=bound, max_collectives=max_collectives, results=tuple(results),
    )  # fmt: skip
    bad = report.failures()
    if bad:
        raise AssertionError("sharded optimizer check failed:\n  " + "\n  ".join(bad) + "\n" + str(report))
    return report


def _check_arguments(
    *, make_model, make_optimizer, world_sizes, hsdp, steps, tolerance, floor, floor_multiple, max_collectives, shard,
    timeout,
) -> list[tuple[int, int]]:
    """The (replicate, shard) meshes to run, after checking every argument (``ValueError`` naming it)."""
    for name, fn in (("make_model", make_model), ("make_optimizer", make_optimizer)):
        if not callable(fn):
            raise ValueError(f"check_sharded_equals_unsharded: {name} must be callable, got {type(fn).__name__}")
    if shard is not None and not callable(shard):
        raise ValueError(f"check_sharded_equals_unsharded: shard must be callable(model, mesh) or None, got {shard!r}")
    def is_count(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if isinstance(world_sizes, int) or not all(is_count(w) for w in world_sizes):
        raise ValueError(
            f"check_sharded_equals_unsharded: world_sizes must be a sequence of ints >= 1, got {world_sizes!r} "
            "(e.g. world_sizes=(1, 2, 3, 4))"
        )
    if hsdp is True:
        shapes = [(2, 2)]
    elif hsdp is False or hsdp is None:
        shapes = []
    else:
        shapes = list(hsdp)
        if not all(
            isinstance(s, tuple) and len(s) == 2 and all(isinstance(x, int) and x >= 1 for x in s) for s in shapes
        ):
            raise ValueError(
                f"check_sharded_equals_unsharded: hsdp must be True, False or a sequence of (replicate, shard) "
                f"mesh shapes such as [(2, 2)], got {hsdp!r}"
            )
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"check_sharded_equals_unsharded: steps must be an int >= 1, got {steps!r}")
    if isinstance(tolerance, str):
        if tolerance not in _TOLERANCES:
            raise ValueError(
                f"check_sharded_equals_unsharded: tolerance must be 'bitwise', 'measured' or a number >= 0, "
                f"got {tolerance!r}"
            )
    elif isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ValueError(f"{_WHO}: tolerance must be 'bitwise', 'measured' or a number >= 0, got {tolerance!r}")
    if floor not in _FLOORS:
        raise ValueError(f"check_sharded_equals_unsharded: floor must be one of {_FLOORS}, got {floor!r}")
    if not isinstance(floor_multiple, (int, float)) or not floor_multiple >= 1:
        raise ValueError(f"{_WHO}: floor_multiple must be a number >= 1, got {floor_multiple!r}")
    if max_collectives is not None and (not isinstance(max_collectives, int) or max_collectives < 0):
        raise ValueError(f"{_WHO}: max_collectives must be an int >= 0 or None, got {max_collectives!r}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            f"{_WHO}: called in a process that is already a rank of a process group (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}); it starts its own gloo ranks: call it from a plain process (pytest, a "
            "script run with python), not under torchrun"
        )
    if not timeout > 0:
        raise ValueError(f"check_sharded_equals_unsharded: timeout must be > 0 seconds, got {timeout!r}")
    meshes = [(1, w) for w in world_sizes] + shapes
    if not meshes:
        raise ValueError(f"{_WHO}: no sharded run asked for (world_sizes and hsdp are both empty)")
    return meshes


def _gradients(named: list[tuple[str, Any]], *, steps: int, seed: int) -> list[dict[str, Any]]:
    """Every step's full gradients ([Note: the gradients of the check])."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    return [{n: torch.randn(tuple(p.shape), generator=gen) for n, p in named} for _ in range(steps)]


def _trainable(model: Any) -> list[tuple[str, Any]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _build(make_model: Callable[[], Any], seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    model = make_model()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{_WHO}: make_model must return an nn.Module, got {type(model).__name__}")
    if not _trainable(model):
        raise ValueError(f"{_WHO}: the model ({type(model).__name__}) has no trainable parameter")
    return model


def _run_unsharded(
    make_model: Callable[[], Any],
    make_optimizer: Callable[[Any], Any],
    *,
    steps: int,
    seed: int,
    perturb: bool = False,
    dtype_double: bool = False,
) -> dict[str, Any]:
    """The plain model's parameters after ``steps`` steps (float32 on return)."""
    import torch

    model = _build(make_model, seed)
    if dtype_double:
        model = model.double()
    named = _trainable(model)
    grads = _gradients(named, steps=steps, seed=seed)
    opt = make_optimizer(model)
    gen = torch.Generator().manual_seed(seed + 2)
    for gs in grads:
        for n, p in named:
            g = gs[n]
            if perturb:  # one ulp up or down, per element
                up = torch.rand(g.shape, generator=gen) < 0.5
                g = torch.nextafter(g, torch.where(up, math.inf, -math.inf))
            p.grad = g.to(p.dtype)
        opt.step()
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _hsdp_mesh(shape: tuple[int, int]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape[0] == 1:
        return None  # the world
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _run_sharded(
    make_model: Callable[[], Any],
    make_optimizer: Callable[[Any], Any],
    blocks: Any,
    shard: Callable[[Any, Any], Any] | None,
    mesh_shape: tuple[int, int],
    *,
    steps: int,
    seed: int,
) -> tuple[dict[str, Any], list[dict[str, int]], tuple[int, int]]:
    """On each rank: the sharded model's full parameters after ``steps`` steps, the collectives each
    step issued, and how many parameters lay in pieces on several ranks."""
    from ._testing import sharded_grad
    from .sharding import fully_shard
    from .sharding.contract import local_shard

    model = _build(make_model, seed)
    grads = _gradients(_trainable(model), steps=steps, seed=seed)
    mesh = _hsdp_mesh(mesh_shape)
    if shard is None:
        fully_shard(model, mesh=mesh, blocks=blocks)
    else:
        shard(model, mesh)
    named = _trainable(model)
    if {n for n, _ in named} != set(grads[0]):
        raise ValueError(
            "check_sharded_equals_unsharded: the sharded model's trainable parameters "
            f"{sorted({n for n, _ in named} ^ set(grads[0]))} are not the unsharded model's; shard(model, mesh) must "
            "shard the model in place, keeping its parameter names"
        )
    opt = make_optimizer(model)
    counts = []
    for gs in grads:
        for n, p in named:
            p.grad = sharded_grad(p, gs[n])
        with count_collectives() as seen:
            opt.step()
        counts.append(dict(seen.by_op))
    cut = 0
    for _, p in named:
        info = local_shard(p)
        bounds = info.layout.bounds if info is not None else (0,)
        cut += sum(b > a for a, b in zip(bounds, bounds[1:])) > 1
    return {n: _full(p) for n, p in model.named_parameters()}, counts, (cut, len(named))


def _full(p: Any) -> Any:
    from torch.distributed.tensor import DTensor

    t = p.full_tensor() if isinstance(p, DTensor) else p
    return t.detach().float().clone()


def _compare(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, str, bool]:
    """The largest element-wise difference, the parameter holding it, and whether all are equal."""
    import torch

    if got.keys() != want.keys():
        raise AssertionError(f"parameter names differ: {sorted(got.keys() ^ want.keys())}")
    worst, name, equal = 0.0, "-", True
    for k, w in want.items():
        g = got[k]
        if g.shape != w.shape:
            raise AssertionError(f"{k}: shape {tuple(g.shape)} vs the reference's {tuple(w.shape)}")
        same = torch.equal(g, w)
        equal &= same
        d = 0.0 if same else (g - w).abs().nan_to_num(nan=math.inf).max().item()
        if d > worst or (name == "-" and not same):
            worst, name = d, k
    return worst, name, equal


def _mesh_result(mesh_shape: tuple[int, int], outs: list, ref: dict[str, Any]) -> MeshResult:
    import torch

    params0 = outs[0][0]  # (each rank: params, collective counts, (cut, num))
    for rank, (params, *_) in enumerate(outs[1:], 1):
        for k, v in params0.items():
            if not torch.equal(params[k], v):
                raise AssertionError(
                    f"mesh {mesh_shape}: rank {rank} ends with other values of {k} than rank 0 (the ranks' full "
                    "parameters must agree; replicas that drift apart mean the step depends on the rank)"
                )
    diff, worst, equal = _compare(params0, ref)
    per_step = [sum(c.values()) for _, counts, _ in outs for c in counts]
    ops = sorted({op for _, counts, _ in outs for c in counts for op in c})
    cut, num = outs[0][2]
    return MeshResult(
        mesh=mesh_shape, max_abs_diff=diff, worst_param=worst, bitwise=equal,
        collectives_per_step=max(per_step, default=0), collective_ops=tuple(ops), cut_params=cut, num_params=num,
    )  # fmt: skip
