"""SOAP (Vyas et al. 2024, arXiv:2409.11321): Adam in the eigenbasis of Shampoo's preconditioner,
on whole tensors or on Shampoo's blocks, each on one rank.

[Note: SOAP semantics]
Follows the authors' reference ``soap.py`` (github.com/nikhilvyas/SOAP; facts, no code copied).
Per *unit* (a whole tensor with ``block_size=None``, else one Shampoo block) and per dim ``i`` of
size ``<= max_precond_dim`` (1-D units only with ``precondition_1d``; scalars never) a factor
``GG_i`` and an orthonormal basis ``Q_i``; the other dims are left unrotated. ``project(X)`` rotates
every such dim by ``Q_i^T`` (``tensordot`` over dim 0, the dims cycling back into place);
``project_back`` by ``Q_i``. With ``shampoo_beta < 0`` the factors use ``betas[1]``.

- call 1: ``GG_i <- lerp(0, outer_i(G), 1 - shampoo_beta)``, ``Q_i`` = eigenvectors of
  ``GG_i + 1e-30 I`` (``eigh``) in descending eigenvalue order; *no parameter update* and no
  weight decay (the reference never uses the current gradient in its own projection).
- call ``t >= 2`` (Adam step ``s = t - 1``): ``g' = project(G)``; ``m <- beta1 m + (1 - beta1) g'``,
  ``v <- beta2 v + (1 - beta2) g'^2`` (both in the rotated basis); ``N = project_back(m / (sqrt(v)
  + eps))``, optionally ``N / (1e-30 + rms(N))`` (``normalize_grads``: per tensor, or per block with
  ``block_size``); ``p <- p - lr sqrt(1 - beta2^s) / (1 - beta1^s) N`` (``correct_bias``; else
  ``lr``); then ``p <- p - lr wd p``. Then ``m <- project_back(m)``; factors updated with ``G``;
  if ``s % precondition_frequency == 0`` every basis is refreshed by one power iteration + QR:
  order the columns of ``Q_i`` by the estimated eigenvalues ``diag(Q_i^T GG_i Q_i)`` (descending),
  permute ``v`` along dim ``i`` the same way, ``Q_i <- qr(GG_i Q_i).Q``; finally
  ``m <- project(m)`` with the new bases.
- ``merge_dims`` (``block_size=None`` only): the reference's merge (from the *first* dim, while the
  product stays ``<= max_precond_dim``; 4-D ``channels_last`` tensors permuted to NCHW first).

With ``block_size = k`` the units are Shampoo's blocks (``merge_small_dims`` + k-chunks of every
dim, see [Note: Shampoo blocks]); each block is its own SOAP unit, so every rank's blocks are
complete and a sharded run equals the single-process run bitwise. The step issues no collectives
but where a tensor-parallel cut splits units ([Note: preconditioner blocks under tensor parallelism]).
A non-finite gradient raises ``FloatingPointError`` naming the parameters before any state changes
(as Shampoo's: [Note: non-finite gradients]).

Tolerance against the reference: every op above is the same math in fp32, but the order of the
rotations and the ``eigh`` / ``qr`` LAPACK calls on differently laid-out (yet equal) inputs can
round differently; the basis is only defined up to column signs and near-degenerate rotations, so
agreement is at fp32 rounding amplified by the ``1 / (sqrt(v) + eps)`` scaling (see docs/soap.md).

[Note: batched SOAP]
With ``batched=True`` (the default, ``None``) a step runs in phases over a parameter
group, as Shampoo's (see [Note: batched Shampoo]): per parameter the step count and gradient; then
per (unit shape, phase) -- phase: first call, Adam step, Adam step + basis refresh -- the units of
every parameter stacked into ``[B, *shape]``: rotations and outer products by batched matmuls, the
moments updated on the stacks, ``eigh`` / ``argsort`` / ``gather`` / ``qr`` on ``[B, n, n]``
stacks, the factor EMA as one foreach ``lerp`` per batch; then the update per parameter; then the
moments' rotations and the refresh per batch. Per unit these are ``_step_param``'s ops in its
order, with every operand laid out as there (``outer_batched`` mirrors ``tensordot``'s layouts).
On CPU batched equals looped bitwise (tested): LAPACK ``syevd`` / ``geqrf`` and BLAS ``gemm`` run
per matrix, and stacks go through ``_linalg``'s kernels ([Note: alignment-independent kernels]):
a product runs batched only where ATen would hand it to BLAS (``m k n >= 400``; below, its own loop
kernel rounds differently from ``mm``) with no dim below 16 and every matrix of the stack 64-byte
aligned, and ``eigh`` / ``qr`` of a stack whose ``n * n`` is not a multiple of 16 floats run per
matrix; otherwise the looped step's own op runs one matrix at a time on aligned operands. A
degenerate factor (a rank-deficient ``GG``, e.g. a 1-D unit's ``g g^T``) turns such last-bit
differences into different bases, so this matters. Since no CPU result depends on batch-mates,
batched block SOAP sharded equals the single-process run bitwise (W = 1..4 tested). On CUDA the
batched ``eigh`` of small matrices is a different solver from the single-matrix one, so neither
holds there: use ``batched=False`` where bitwise W-invariance on GPUs matters.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..sharding.contract import BlockRule, BlockSpec, LocalShard, elements, whole
from ._strips import tp_keeps_blocks
from ._base import StateShard, apply_update, checked_param_info, local_tensor, per_element, require_spec, state_range
from ._tp_runs import RUNS_TAKE, TPRun, plan_tp_run, run_bounds, tp_runs_fit
from ._linalg import aligned, batched_ok, bmm, eigh, qr_q
from ._preconditioner import BlockPreconditioner, factor_ema_, outer, outer_batched, square_view
from ._rules import shampoo_rule
from ._shampoo import BlockGeometry, shampoo_blocks

__all__ = ["SOAP", "soap_rule", "reference_merge_dims"]


def reference_merge_dims(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """soap.py's ``merge_dims``: from the first dim, merge while the product stays ``<= max_dim``."""
    out: list[int] = []
    cur = 1
    for d in shape:
        if cur * d > max_dim:
            if cur > 1:
                out.append(cur)
                cur = d
            else:
                out.append(d)
                cur = 1
        else:
            cur *= d
    if cur > 1 or not out:
        out.append(cur)
    return tuple(out)


def soap_rule(block_size: int | None = None) -> BlockRule:
    """``block_size=None``: every tensor whole on one rank (``whole()``); ``k``: Shampoo's strips, kept
    whole (unlike Shampoo's rule this one does not declare ``splits_blocks``: SOAP refuses split strips)."""
    if block_size is not None:
        strips = shampoo_rule(block_size)

        def strip_rule(fqn: str, param: Tensor, module: nn.Module | None) -> BlockSpec:
            return strips(fqn, param, module)

        return strip_rule

    def rule(fqn: str, param: Tensor, module: nn.Module | None) -> BlockSpec:
        return elements(1) if param.ndim == 0 else whole()

    return rule


class _Unit(NamedTuple):
    shape: tuple[int, ...]
    """The unit's (merged) shape."""
    to_unit: Callable[[Tensor], Tensor]
    """Local flat tensor -> the unit (a contiguous copy)."""
    store: Callable[[Tensor, Tensor], None]
    """``store(flat, u)``: write the unit back into a local flat tensor."""
    elem: tuple[int, int] | None
    """Whole mode: the unit's flat state is ``[0, numel)`` in unit order; block mode: None (at the
    block's element positions)."""
    factors: tuple[int | None, ...]
    """Offset of each dim's factor in the flat factor state, None if not preconditioned."""


class _Plan(NamedTuple):
    name: str
    info: LocalShard
    units: tuple[_Unit, ...]
    factor_shard: StateShard
    elem_shard: StateShard
    """Where the moments lie (``exp_avg`` / ``exp_avg_sq``): the parameter's range, or its run's."""
    run: TPRun | None = None
    """A TP cut splits its units: the run this TP rank owns, whose state lives here and whose units index
    the run's view ([Note: preconditioner blocks under tensor parallelism])."""


def _check_hyperparameters(hp: dict[str, Any], *, where: str) -> None:
    """``ValueError`` naming an out-of-range hyperparameter of one group (prefixed by ``where``)."""
    betas = tuple(hp["betas"])
    if not hp["lr"] >= 0.0:
        raise ValueError(f"SOAP: {where}lr must be >= 0, got {hp['lr']}")
    if len(betas) != 2 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"SOAP: {where}betas must be in [0, 1), got {betas}")
    if not hp["shampoo_beta"] < 1.0:
        raise ValueError(f"SOAP: {where}shampoo_beta must be < 1 (negative: use betas[1]), got {hp['shampoo_beta']}")
    if not hp["eps"] >= 0.0 or not hp["weight_decay"] >= 0.0:
        raise ValueError(f"SOAP: {where}eps and weight_decay must be >= 0, got {hp['eps']}, {hp['weight_decay']}")
    if hp["precondition_frequency"] < 1 or hp["max_precond_dim"] < 1:
        raise ValueError(
            f"SOAP: {where}precondition_frequency and max_precond_dim must be >= 1, got "
            f"{hp['precondition_frequency']}, {hp['max_precond_dim']}"
        )


class SOAP(BlockPreconditioner):
    """SOAP with the reference ``soap.py``'s signature and semantics (see [Note: SOAP semantics]).

    Shard with ``SOAP.rule(block_size=...)`` for the same ``block_size``: ``None`` keeps each tensor
    whole on one rank (the reference's whole-tensor SOAP; the planner balances whole tensors), ``k``
    keeps Shampoo's ``k``-strips whole (large matrices balance at scale). ``SOAP.blocks`` is the
    whole-tensor rule. ``batched``: the work of a parameter group's same-shape units batched (see
    [Note: batched SOAP]); ``False``: one unit at a time (the reference mode); ``None`` (default):
    batched, on CUDA and on CPU too, unlike Shampoo: on CPU batched equals looped bitwise, and it
    halves the step where per-unit Python overhead dominates (``bench_shampoo.py``, W = 2, 1 thread
    per rank, batched / looped: ``k = 32`` 0.42-0.51x, ``k = 64`` 0.49-0.60x) while costing little
    where it does not (``k = 128``: 0.93-1.10x at W; the recipe's model, ``recipe_step_share.py``,
    two runs: 0.91-0.97x median, 0.94-1.09x averaged over a precondition period).
    """

    _name = "SOAP"
    blocks = staticmethod(soap_rule(None))

    @classmethod
    def rule(cls, *, block_size: int | None = None) -> BlockRule:
        return soap_rule(block_size)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = -1,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        normalize_grads: bool = False,
        data_format: str = "channels_first",
        correct_bias: bool = True,
        block_size: int | None = None,
        batched: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
            precondition_frequency=precondition_frequency, max_precond_dim=max_precond_dim, merge_dims=merge_dims,
            precondition_1d=precondition_1d, normalize_grads=normalize_grads, correct_bias=correct_bias,
        )  # fmt: skip
        _check_hyperparameters(defaults, where="")
        if data_format not in ("channels_first", "channels_last"):
            raise ValueError(f"data_format must be 'channels_first' or 'channels_last', got {data_format!r}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be None or >= 1, got {block_size}")
        if block_size is not None and merge_dims:
            warnings.warn("SOAP: merge_dims is ignored with block_size (blocks use Shampoo's merge_small_dims)",
                          stacklevel=2)  # fmt: skip
        self._data_format = data_format
        self._block_size = block_size
        self._run_grads: dict[Tensor, Tensor] = {}  # during a step: this rank's run of each TP-split gradient
        self._pending: dict[Tensor, tuple[Tensor, float, float]] = {}  # ... and the run's direction to send back
        super().__init__(params, defaults, batched=batched)

    # ---- planning ---------------------------------------------------------------------
    def _preconditioned(self, n: int, order: int, group: dict[str, Any]) -> bool:
        return n <= group["max_precond_dim"] and (order >= 2 or group["precondition_1d"])

    def _unit_factor_numel(self, shape: tuple[int, ...], group: dict[str, Any]) -> int:
        return sum(n * n for n in shape if self._preconditioned(n, len(shape), group))

    def _factor_offsets(self, shape: tuple[int, ...], off: int, group: dict[str, Any]) -> tuple[tuple[int | None, ...], int]:
        out = []
        for n in shape:
            if self._preconditioned(n, len(shape), group):
                out.append(off)
                off += n * n
            else:
                out.append(None)
        return tuple(out), off

    def _resolve_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        _check_hyperparameters({k: param_group.get(k, v) for k, v in self.defaults.items()},
                               where=f"parameter group {len(self.param_groups)}: ")  # fmt: skip
        return param_group

    def _plan_group(self, group: dict[str, Any]) -> None:
        k = self._block_size
        blocks = "SOAP.rule(block_size=None)" if k is None else f"SOAP.rule(block_size={k})"
        names = group.get("param_names", [None] * len(group["params"]))
        for name, p in zip(names, group["params"]):
            info = checked_param_info(p, soap_rule(k), optimizer="SOAP", name=name or "", whole_blocks=True, blocks=blocks,
                                      tp_assembles=lambda i: self._keeps(i) or self._run_k(i, group) is not None,
                                      tp_supported=RUNS_TAKE + ("; merge_dims=True merges dims across the cut" if
                                                                group["merge_dims"] and k is None else ""))  # fmt: skip
            label = name or info.fqn or f"<param of shape {tuple(info.shape)}>"
            if info.tp is not None and not self._keeps(info):
                plan = self._run_plan(label, info, group)
            elif k is None:
                ok = all(b in (0, info.numel) for b in info.layout.bounds)
                require_spec(info, ok, optimizer="SOAP", need="each tensor whole on one rank", blocks=blocks)
                plan = self._whole_plan(label, info, group)
            else:
                geom = shampoo_blocks(info.shape, k, info.spec)
                ok = info.numel == 0 or all(geom.is_strip_boundary(b) for b in info.layout.bounds)
                require_spec(info, ok, optimizer="SOAP", need=f"whole {k}-strips of its merged shape {geom.dims}",
                             blocks=blocks)  # fmt: skip
                plan = self._block_plan(label, info, geom, group)
            self._plans[p] = plan
            st = self.state[p]
            st.setdefault("step", torch.tensor(0.0))
            n_elem = plan.elem_shard.end - plan.elem_shard.start  # (the run's under a TP cut)
            st.setdefault("exp_avg", torch.zeros(n_elem, dtype=torch.float32, device=p.device))
            st.setdefault("exp_avg_sq", torch.zeros(n_elem, dtype=torch.float32, device=p.device))
            n = plan.factor_shard.end - plan.factor_shard.start
            st.setdefault("GG", torch.zeros(n, dtype=torch.float32, device=p.device))
            st.setdefault("Q", torch.zeros(n, dtype=torch.float32, device=p.device))

    # ---- tensor-parallel cuts ([Note: preconditioner blocks under tensor parallelism]) -----------
    def _keeps(self, info: LocalShard) -> bool:
        """Block mode on a TP cut between blocks: each TP rank's blocks are the global ones."""
        return self._block_size is not None and tp_keeps_blocks(info, self._block_size)

    def _run_k(self, info: LocalShard, group: dict[str, Any]) -> int | None:
        """The strip size that assembles the TP-split ``info`` in runs: the block size, or in whole mode
        (``merge_dims=False``) its longest dim, so one strip holds the whole tensor as one unit; ``None``
        where runs cannot (then it is refused)."""
        k = self._block_size
        if k is None:
            if group["merge_dims"] or info.tp is None:
                return None
            k = max(info.tp.global_shape)
        return k if tp_runs_fit(info, k) else None

    def _run_plan(self, name: str, info: LocalShard, group: dict[str, Any]) -> _Plan:
        """A TP-split parameter: the units of this TP rank's run of the global strips, indexing the run's
        view; every state tensor lies over the (dp, tp) cells in global order."""
        run = plan_tp_run(info, self._run_k(info, group), shift=self._run_shift())
        geom = run.geom
        prefix = [0]  # factor elements of the global strips before strip i
        for i in range(geom.num_strips):
            r = geom.strip_rows(i)
            prefix.append(prefix[-1] + sum(self._unit_factor_numel((r, *(n for _, n in t)), group) for t in geom.tail_chunks))
        numel = math.prod(geom.dims)

        def shard(before: Callable[[int], int]) -> StateShard:
            bounds = run_bounds(run, before)
            return StateShard(bounds[-1], bounds[run.cell], bounds[run.cell + 1], bounds, mesh=run.mesh)

        elem = shard(lambda i: geom.strip_start_row(i) * geom.cols if i < geom.num_strips else numel)
        units, off = [], 0
        for shape, index in geom.local_blocks(run.start, run.start + run.numel):
            offs, off = self._factor_offsets(shape, off, group)

            def to_unit(flat: Tensor, index=index) -> Tensor:
                return flat.view(run.shape)[index].contiguous()

            def store(flat: Tensor, u: Tensor, index=index) -> None:
                flat.view(run.shape)[index] = u

            units.append(_Unit(shape, to_unit, store, None, offs))
        return _Plan(name, info, tuple(units), shard(prefix.__getitem__), elem, run)

    def _step_all(self, todo: list[tuple[Tensor, dict[str, Any]]], batched: bool) -> None:
        """As the base class's; parameters assembled in runs over TP first send every rank's part of the
        gradient to each run's owner (one all_to_all_single per TP group), step their runs there, and
        after every step send each rank its part of the direction (a second one), which it applies."""
        runs = self._run_exchanges()
        if not runs:
            return super()._step_all(todo, batched)
        self._run_grads, self._pending = {}, {}
        for ex in runs:
            got = ex.gather({p: [local_tensor(p.grad).reshape(-1).float()] for p, _ in ex.runs if p.grad is not None})
            self._run_grads.update((p, fields[0]) for p, fields in got.items())
        try:
            super()._step_all(todo, batched)
        finally:
            self._run_grads = {}
        pending, self._pending = self._pending, {}
        for ex in runs:  # every TP rank has the same pending set: the same step counts
            mine = {p: pending[p] for p, _ in ex.runs if p in pending}
            if not mine:  # (the first call of every parameter here: no update)
                continue
            into = {p: torch.empty(local_tensor(p).numel(), dtype=torch.float32, device=p.device) for p in mine}
            ex.scatter({p: d for p, (d, _, _) in mine.items()}, into)
            for p, (_, step_size, decay) in mine.items():
                apply_update(local_tensor(p).view(-1), into[p], step_size, decay)

    def _grad(self, p: Tensor) -> Tensor:
        """The gradient the units read: the local one, flat fp32, or this rank's run of it."""
        got = self._run_grads.get(p)
        return got if got is not None else local_tensor(p.grad).reshape(-1).float()

    def _update(self, p: Tensor, direction: Tensor, step_size: float, decay: float) -> None:
        """Apply the direction, or keep a run's for the exchange back (``_step_all``)."""
        if p in self._run_grads:
            self._pending[p] = (direction, step_size, decay)
        else:
            apply_update(local_tensor(p).view(-1), direction, step_size, decay)

    def _whole_plan(self, name: str, info: LocalShard, group: dict[str, Any]) -> _Plan:
        shape = tuple(info.shape)
        numel = math.prod(shape)
        fac_total = self._unit_factor_numel(self._whole_shape(shape, group)[0], group) if numel else 0
        # (the factors live with the tensor's one owner: before it none, from its end all)
        factor_shard = state_range(info, lambda b: fac_total if numel and b >= numel else 0)
        if info.local_numel == 0 or numel == 0:
            return _Plan(name, info, (), factor_shard, per_element(info))
        ushape, to_u, from_u = self._whole_shape(shape, group)
        offs, total = self._factor_offsets(ushape, 0, group)

        def to_unit(flat: Tensor) -> Tensor:
            return to_u(flat).contiguous()

        def store(flat: Tensor, u: Tensor) -> None:
            flat.copy_(from_u(u).reshape(-1))

        return _Plan(name, info, (_Unit(ushape, to_unit, store, (0, numel), offs),), factor_shard, per_element(info))

    def _whole_shape(self, shape: tuple[int, ...], group: dict[str, Any]):
        """The unit shape of a whole tensor and the maps flat <-> unit (reference merge_dims / channels_last)."""
        if len(shape) == 0:  # a scalar: plain Adam (no dims to rotate)
            return (), (lambda f: f.view(())), (lambda u: u)
        if len(shape) == 1 or not group["merge_dims"]:
            return tuple(shape), (lambda f: f.view(shape)), (lambda u: u)
        if self._data_format == "channels_last" and len(shape) == 4:
            perm_shape = (shape[0], shape[3], shape[1], shape[2])
            ushape = reference_merge_dims(perm_shape, group["max_precond_dim"])
            return (ushape, lambda f: f.view(shape).permute(0, 3, 1, 2).reshape(ushape),
                    lambda u: u.reshape(perm_shape).permute(0, 2, 3, 1))  # fmt: skip
        ushape = reference_merge_dims(tuple(shape), group["max_precond_dim"])
        return ushape, (lambda f: f.view(ushape)), (lambda u: u.reshape(shape))

    def _block_plan(self, name: str, info, geom: BlockGeometry, group: dict[str, Any]) -> _Plan:
        if info.numel == 0:
            return _Plan(name, info, (), state_range(info, lambda b: 0), per_element(info))
        tails = geom.tail_chunks

        def strip_numel(i: int) -> int:
            r = geom.strip_rows(i)
            return sum(self._unit_factor_numel((r, *(n for _, n in t)), group) for t in tails)

        prefix = [0]  # factor elements of the strips before strip i
        for i in range(geom.num_strips):
            prefix.append(prefix[-1] + strip_numel(i))
        factor_shard = state_range(info, lambda b: prefix[geom.strip_at(b)])
        local_shape = (info.local_numel // geom.cols, *geom.dims[1:])
        units, off = [], 0
        for shape, index in geom.local_blocks(info.start, info.end):
            offs, off = self._factor_offsets(shape, off, group)

            def to_unit(flat: Tensor, index=index) -> Tensor:
                return flat.view(local_shape)[index].contiguous()

            def store(flat: Tensor, u: Tensor, index=index) -> None:
                flat.view(local_shape)[index] = u

            units.append(_Unit(shape, to_unit, store, None, offs))
        if factor_shard.end - factor_shard.start != off:
            raise AssertionError(f"SOAP: {name}: {off} local factor elements, the state layout says {factor_shard}")
        return _Plan(name, info, tuple(units), factor_shard, per_element(info))

    def state_shards(self, p: Tensor) -> dict[str, StateShard]:
        plan = self._plans[p]
        return {"exp_avg": plan.elem_shard, "exp_avg_sq": plan.elem_shard, "GG": plan.factor_shard,
                "Q": plan.factor_shard}  # fmt: skip

    # ---- step -------------------------------------------------------------------------
    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        plan, st = self._plans[p], self.state[p]
        st["step"] += 1
        t = int(st["step"].item())
        beta1, beta2 = group["betas"]
        sb = group["shampoo_beta"] if group["shampoo_beta"] >= 0 else beta2
        g = self._grad(p)
        gg, qq = st["GG"], st["Q"]
        m_all, v_all = st["exp_avg"], st["exp_avg_sq"]
        if t == 1:
            for u in plan.units:
                gu = u.to_unit(g)
                for dim, (n, off) in enumerate(zip(u.shape, u.factors)):
                    if off is None:
                        continue
                    f = square_view(gg, off, n)
                    factor_ema_([f], [outer(gu, dim)], sb, lerp=True)
                    _, q = torch.linalg.eigh(f + 1e-30 * torch.eye(n, device=f.device))
                    square_view(qq, off, n).copy_(torch.flip(q, [1]))
            return
        s = t - 1
        step_size = group["lr"]
        if group["correct_bias"]:
            step_size = step_size * (1 - beta2**s) ** 0.5 / (1 - beta1**s)
        direction = torch.empty_like(g)
        news = []
        for u in plan.units:
            qs = [None if off is None else square_view(qq, off, n) for n, off in zip(u.shape, u.factors)]
            gu = u.to_unit(g)
            m, v = self._moment(m_all, u), self._moment(v_all, u)
            gp = _rotate(gu, qs, back=False)
            m.mul_(beta1).add_(gp, alpha=1 - beta1)
            v.mul_(beta2).add_(gp.square(), alpha=1 - beta2)
            n_dir = _rotate(m / v.sqrt().add_(group["eps"]), qs, back=True)
            if group["normalize_grads"]:
                n_dir = n_dir / (1e-30 + torch.mean(n_dir**2) ** 0.5)
            u.store(direction, n_dir)
            news.append((u, gu, m, v, qs))
        self._update(p, direction, step_size, group["lr"] * group["weight_decay"])
        for u, gu, m, v, qs in news:
            m = _rotate(m, qs, back=True)
            fs = [(square_view(gg, off, n), d) for d, (n, off) in enumerate(zip(u.shape, u.factors)) if off is not None]
            factor_ema_([f for f, _ in fs], [outer(gu, dim) for _, dim in fs], sb, lerp=True)
            if s % group["precondition_frequency"] == 0:
                for dim, (n, off) in enumerate(zip(u.shape, u.factors)):
                    if off is None:
                        continue
                    out = square_view(qq, off, n)
                    f, o = aligned(square_view(gg, off, n)), aligned(out)
                    est = torch.diag(o.T @ f @ o)
                    idx = torch.argsort(est, descending=True)
                    v = v.index_select(dim, idx)
                    q, _ = torch.linalg.qr(f @ o[:, idx])
                    out.copy_(q)
            m = _rotate(m, [None if off is None else square_view(qq, off, n)
                            for n, off in zip(u.shape, u.factors)], back=False)  # fmt: skip
            self._put_moment(m_all, u, m)
            self._put_moment(v_all, u, v)

    def _step_group_batched(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """One step of every parameter of ``group`` with the unit work batched over units of the same
        shape and phase (see [Note: batched SOAP]); per unit the same ops as ``_step_param``. One function
    (87 lines) on purpose: the phases share the stacks built at its top, and reading it beside
    ``_step_param`` line by line is how its bitwise equality to the looped step is checked."""
        beta1, beta2 = group["betas"]
        sb = group["shampoo_beta"] if group["shampoo_beta"] >= 0 else beta2
        freq = group["precondition_frequency"]
        ctx, batches = [], {}
        for p in params:
            plan, st = self._plans[p], self.state[p]
            st["step"] += 1
            t = int(st["step"].item())
            g = self._grad(p)
            ctx.append((p, plan, st, t, g, torch.empty_like(g)))
            phase = 0 if t == 1 else (2 if (t - 1) % freq == 0 else 1)  # first call / Adam / Adam + refresh
            for u in plan.units:
                batches.setdefault((u.shape, tuple(f is None for f in u.factors), phase), []).append((len(ctx) - 1, u))

        def views(key: str, items: list[tuple[int, _Unit]], dim: int) -> list[Tensor]:
            n = items[0][1].shape[dim]
            return [square_view(ctx[ci][2][key], u.factors[dim], n) for ci, u in items]

        def stacked_q(items: list[tuple[int, _Unit]]) -> list[Tensor | None]:
            factors = items[0][1].factors
            return [None if off is None else torch.stack(views("Q", items, d)) for d, off in enumerate(factors)]

        def factor_ema(items: list[tuple[int, _Unit]], gs: Tensor) -> None:
            fs, outs = [], []
            for d, off in enumerate(items[0][1].factors):
                if off is not None:
                    fs.extend(views("GG", items, d))
                    outs.extend(outer_batched(gs, d).unbind(0))
            factor_ema_(fs, outs, sb, lerp=True)

        post = []
        for (shape, _, phase), items in batches.items():
            gs = torch.stack([u.to_unit(ctx[ci][4]) for ci, u in items])
            if phase == 0:
                factor_ema(items, gs)
                for d, (n, off) in enumerate(zip(shape, items[0][1].factors)):
                    if off is not None:
                        f = torch.stack(views("GG", items, d))
                        _, q = eigh(f + 1e-30 * torch.eye(n, device=f.device))
                        torch._foreach_copy_(views("Q", items, d), list(torch.flip(q, [2]).unbind(0)))
                continue
            qs = stacked_q(items)
            ms = torch.stack([self._moment(ctx[ci][2]["exp_avg"], u) for ci, u in items])
            vs = torch.stack([self._moment(ctx[ci][2]["exp_avg_sq"], u) for ci, u in items])
            gp = _rotate_batched(gs, qs, back=False)
            ms.mul_(beta1).add_(gp, alpha=1 - beta1)
            vs.mul_(beta2).add_(gp.square(), alpha=1 - beta2)
            n_dir = _rotate_batched(ms / vs.sqrt().add_(group["eps"]), qs, back=True)
            if group["normalize_grads"]:
                rms = torch.mean((n_dir**2).reshape(len(items), -1), dim=1) ** 0.5  # per unit (scalars too)
                n_dir = n_dir / (1e-30 + rms.view(-1, *[1] * len(shape)))
            for i, (ci, u) in enumerate(items):
                u.store(ctx[ci][5], n_dir[i])
            post.append((shape, phase, items, gs, ms, vs, qs))

        for p, _, _, t, _, direction in ctx:
            if t == 1:
                continue
            s = t - 1
            step_size = group["lr"]
            if group["correct_bias"]:
                step_size = step_size * (1 - beta2**s) ** 0.5 / (1 - beta1**s)
            self._update(p, direction, step_size, group["lr"] * group["weight_decay"])

        for shape, phase, items, gs, ms, vs, qs in post:
            ms = _rotate_batched(ms, qs, back=True)
            factor_ema(items, gs)
            if phase == 2:
                for d, (n, off) in enumerate(zip(shape, items[0][1].factors)):
                    if off is None:
                        continue
                    f, o = torch.stack(views("GG", items, d)), qs[d]
                    est = torch.diagonal(bmm(bmm(o.mT, f), o), dim1=-2, dim2=-1)
                    idx = torch.argsort(est, dim=-1, descending=True)
                    vs = torch.gather(vs, d + 1, idx.view(-1, *(n if e == d else 1 for e in range(len(shape))))
                                      .expand(vs.shape))  # fmt: skip
                    q = qr_q(bmm(f, torch.gather(o, 2, idx.unsqueeze(1).expand(o.shape))))
                    torch._foreach_copy_(views("Q", items, d), list(q.unbind(0)))
                ms = _rotate_batched(ms, stacked_q(items), back=False)
            else:
                ms = _rotate_batched(ms, qs, back=False)
            for i, (ci, u) in enumerate(items):
                self._put_moment(ctx[ci][2]["exp_avg"], u, ms[i])
                self._put_moment(ctx[ci][2]["exp_avg_sq"], u, vs[i])

    @staticmethod
    def _moment(flat: Tensor, u: _Unit) -> Tensor:
        if u.elem is not None:
            return flat[u.elem[0] : u.elem[1]].view(u.shape).clone()
        return u.to_unit(flat)

    @staticmethod
    def _put_moment(flat: Tensor, u: _Unit, x: Tensor) -> None:
        if u.elem is not None:
            flat[u.elem[0] : u.elem[1]].copy_(x.reshape(-1))
        else:
            u.store(flat, x)


def _rotate_batched(x: Tensor, qs: list[Tensor | None], *, back: bool) -> Tensor:
    """``_rotate`` of every ``x[i]`` of a ``[B, *shape]`` stack with the bases stacked per dim."""
    for q in qs:
        if q is None:
            x = x.movedim(1, -1)
        elif not batched_ok(x[0].numel() // x.shape[1], x.shape[1], q.shape[-1], x):
            x = torch.stack([torch.tensordot(aligned(xi), aligned(qi), dims=([0], [1 if back else 0]))
                             for xi, qi in zip(x.unbind(0), q.unbind(0))])  # fmt: skip
        else:
            x = x.movedim(1, -1)
            shape = x.shape
            x = (x.reshape(shape[0], -1, shape[-1]) @ (q.mT if back else q)).view(shape)
    return x


def _rotate(x: Tensor, qs: list[Tensor | None], *, back: bool) -> Tensor:
    """``project`` (``x x_i Q_i``, contracting Q's rows) or ``project_back`` (its columns) over every
    dim; unrotated dims are cycled to the end so every dim is back in place after ``ndim`` steps."""
    for q in qs:
        if q is None:
            x = x.permute(*range(1, x.ndim), 0)
        else:
            x = torch.tensordot(aligned(x), aligned(q), dims=([0], [1 if back else 0]))
    return x
