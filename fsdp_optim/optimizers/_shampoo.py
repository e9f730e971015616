"""Blocked Shampoo on shards: every preconditioner block's factors live on one rank.

Follows facebookresearch/optimizers' ``DistributedShampoo`` (arXiv:2309.06497) by default: the same
blocking, defaults, grafting, epsilon and bias-correction definitions (files cited below; no code
copied). docs/shampoo.md lists the defaults and the few documented differences.

[Note: Shampoo blocks]
Blocks are defined on the *global* tensor, never on a shard, so they are the same for every
world size and plan. As in ``distributed_shampoo/distributor/shampoo_distributor.py``
(``_merge_and_block_with_params``), a tensor is viewed with ``merge_small_dims(shape, k)``
(``k = max_preconditioner_dim``; size-1 dims dropped, then trailing dims merged while their product
stays <= k; ``distributed_shampoo/utils/shampoo_utils.py``) and that view is cut into ``k``-chunks
along *every* dim (``multi_dim_split``), blocks ordered lexicographically by chunk index. A block
of order ``N`` (its number of dims) has one factor per dim ``i``: ``F_i = contraction of G with
itself over all other dims`` (``G G^T`` and ``G^T G`` for a matrix, ``g g^T`` for a vector) and
is preconditioned as ``G x_0 F_0^{-1/2N} x_1 ... x_{N-1} F_{N-1}^{-1/2N}`` (matrix: ``L^{-1/4} G
R^{-1/4}``; vector: ``L^{-1/2} g``). ``exponent_override = p`` uses ``-1/p`` for every factor.

A *strip* is one ``k``-chunk of the merged dim 0 (all its blocks): it is contiguous in the flat
tensor, so the planner keeps strips whole (``Shampoo.rule``) and a rank holds whole blocks, unless
the balance needs a strip cut on rows ([Note: Shampoo split strips]). With
``Shampoo.rule(per_expert=True)`` (opt-in) a 3-D ``[E, r, c]`` weight is E tensors ``[r, c]``, each
merged and blocked as above.

[Note: Shampoo step]
Per step ``t`` (1-based) and block, with DistributedShampoo's definitions
(``distributed_shampoo/distributed_shampoo.py`` ``_compute_search_directions``):
0. every local gradient is checked first: a non-finite one raises ``FloatingPointError`` naming
   the parameter, before any state changes;
1. factors from the raw gradient: ``F <- beta2 F + (1 - beta2) outer`` (``beta2 == 1``: ``F + outer``,
   AdaGrad-like), in ``factor_matrix_dtype``; the grafting state from the raw gradient
   (``preconditioner/adagrad_preconditioner_list.py``): Adam ``v <- gb2 v + (1 - gb2) g^2``,
   always bias-corrected by ``1 - gb2^t``; RMSprop the same, never bias-corrected; AdaGrad
   ``v <- v + g^2``;
2. inverse roots at ``t == start_preconditioning_step`` and at ``t > start`` with
   ``t % precondition_frequency == 0``, from ``A = F / (1 - beta2^t)`` (``use_bias_correction`` and
   ``beta2 < 1``; else ``F``): ``w, Q = eigh(A + eps I)``; if ``min(w) < eps`` every eigenvalue is
   shifted: ``w <- w - min(w) + eps`` (``preconditioner/matrix_functions.py``,
   ``matrix_inverse_root_from_eigendecomposition``, ``PerturbationConfig``); root ``Q w^{-1/p} Q^T``
   stored in fp32. Inverse roots start as identity matrices;
3. filtered gradient ``m <- beta1 m + (1 - beta1) g``, ``gbar = m / (1 - beta1^t)``
   (``use_bias_correction``; ``beta1 == 0``: ``gbar = g``);
4. before ``start_preconditioning_step`` the search direction is the grafting direction
   ``gbar / (sqrt(vhat) + grafting_epsilon)`` (no grafting: Shampoo with the identity roots, i.e.
   ``gbar``); from then on ``P`` (step 2's roots applied to ``gbar``), with grafting rescaled per
   block to ``||graft_block|| / (||P|| + 1e-16)``;
5. decoupled weight decay ``D <- D + weight_decay * param``; momentum ``M <- mu M + D``,
   ``D <- M`` (or ``D + mu M``, Nesterov) (DistributedShampoo's ``ClassicMomentumConfig`` with
   ``dampening = 0``); ``param <- param - lr D``.

Why ``eigh`` runs in float64 (DistributedShampoo runs it in ``factor_matrix_dtype``): fp32 ``eigh``
has an absolute eigenvalue error of about ``1e-7 lambda_max``, far above the default
``epsilon = 1e-12``, so small eigenvalues (whose ``-1/p`` powers dominate the root) would be noise.
But float64 ``eigh`` only recovers what the factor holds: with the default fp32 factors and
``beta2 < 1`` the EMA itself rounds each entry to ~``1e-7 lambda_max`` every step, so eigenvalues
below that are already noise before ``eigh`` sees them, and with a tiny epsilon the update still
differs from a float64 reference (measured against DistributedShampoo run in float64 after 8 steps
with ``epsilon = 1e-12``: up to 0.99 of the update on rank-deficient blocks with fp32 factors, at
most 9e-2 with float64 ones; with ``epsilon = 0.1`` both agree to <= 1.6e-5). Use
``factor_matrix_dtype=torch.float64`` (the factors and their EMA in float64, as DistributedShampoo's
option of the same name) when small eigenvalues matter; then ours equals DistributedShampoo with
``factor_matrix_dtype=torch.float64`` on well-conditioned blocks (fp32 rounding in the update); on
rank-deficient ones with a tiny epsilon they differ, because DistributedShampoo forms the outer
products in fp32 and only accumulates them in float64, and ours forms them in float64 too
(docs/shampoo.md, "Documented differences"). The cost is amortized over ``precondition_frequency`` steps.

[Note: batched Shampoo]
With ``batched=True`` (the default for CUDA parameters) a step runs in phases over a parameter group: per-element work per parameter
(grafting state, filtered gradient); then, per block *shape*, the blocks of every parameter stacked
into one ``[B, *shape]`` tensor: outer products by ``bmm``, the factor EMA as two foreach ops over
all factors, ``eigh`` and the root's matmuls on ``[B, n, n]`` stacks, preconditioning by ``bmm`` and
the grafting norms by one batched ``vector_norm``; then the update per parameter. Which blocks share
a batch depends on the world size, so bitwise W-invariance needs a kernel whose result for one
matrix does not depend on its batch-mates, the batch size or its place in the stack. On CPU the
stacks go through ``_linalg`` (LAPACK ``syevd`` and BLAS per matrix; a stack whose matrices are not
64-byte aligned, or a product with a small dim, one matrix at a time: [Note: alignment-independent
kernels]), and the W = 1..4 and batch-mate tests check it. On CUDA, batched
``eigh`` of matrices up to 32 x 32 uses a batched Jacobi solver for batches > 1 but ``syevd`` for
one matrix, so a block alone in its batch can round differently from the same block batched at
another world size: use ``batched=False`` where bitwise W-invariance on GPUs matters (it is also
what the batched path is measured against). Batched and looped runs agree to fp32 rounding, not
bitwise (``bmm`` vs ``mm`` kernels).

Every per-block computation runs on contiguous copies of the block, with the same ops whatever
the shard, and the per-element ones are element-wise, so a sharded run equals the single-process
run bitwise. Without split strips (or TP-split blocks: [Note: preconditioner blocks under tensor
parallelism]) the step issues no collectives.

[Note: Shampoo split strips]
With ``PlanConfig(balance="auto")`` (``Shampoo.rule`` declares ``splits_blocks``) the planner may cut
a strip across ranks on rows of the merged view (the plan records it: ``LocalShard.split``; any row of
dim 0 is one, a merged row being a product of trailing dims). Such a *split strip*:
- has its factors (every block's ``factor_matrices`` and ``inv_factor_matrices``) on one *owner*, the
  rank holding its first element. A rank's factors are the strips whose first element it holds
  (``_ParamPlan.strips``: the whole ones in its range, then at most one split one, ``owned``), a
  contiguous range of the global flat factor vector in strip order, so ``state_shards`` and
  checkpoints are unchanged and reshard across world sizes and plans;
- keeps its per-element state and work (step 1's grafting state, 3, the grafting direction, 5) on the
  ranks holding the elements;
- is exchanged per step over its shard group, all split parameters of the optimizer together, every
  rank taking part (empty pieces included): one ``all_to_all_single`` out carries each piece's raw
  gradient (fp32: the factors), and from ``start_preconditioning_step`` on its filtered gradient
  (unless ``betas[0] == 0``: then it is the raw one) and grafting direction (with grafting)
  (``_Ctx.fields``); the owner assembles the strip into a ``_Unit`` and runs steps 1 (factors), 2
  and 4 on it with the functions a whole strip's blocks go through (``_step_unit`` /
  ``_step_units_batched``), so the same bits; one ``all_to_all_single`` back returns the search
  direction's pieces (empty before ``start_preconditioning_step``, where each rank's direction is its
  own grafting direction). Each rank then applies step 5 to its pieces, element-wise.
The piece lists are planned at the first step (``_plan_exchange``: sends ordered by owner, receives by
source rank, both then by parameter and strip) and again when a split parameter's dtype or device
changes; a step sums the sizes from them (the fields depend on ``t``, equal on every rank). Bytes: a
strip of ``N`` elements, ``N_o`` on its owner, moves ``4 (N - N_o)`` per field out and, from the
start on, ``4 (N - N_o)`` back. The non-finite check is agreed first (one ``all_reduce`` of a flag
per parameter over each such shard group), so every rank raises before any exchange. A split
parameter must have a gradient on every rank of its group or on none.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..sharding.contract import BlockRule, LocalShard, RaggedDTensor
from ._base import range_pieces, StateShard, apply_update, checked_param_info, local_tensor, per_element, require_spec, state_range
from ._linalg import aligned, bmm, eigh
from ._preconditioner import (
    BlockPreconditioner, Grafting, factor_ema_, graft_rescale_, grafting_direction, outer, outer_batched, square_view,
    update_grafting_,
)
from ._rules import shampoo_rule
from ._strips import BlockGeometry, shampoo_blocks, tp_keeps_blocks
from ._tp_runs import RUNS_TAKE, TPRun, TPRunExchange, plan_tp_run, run_bounds, tp_runs_fit

__all__ = ["Shampoo", "Grafting", "shampoo_blocks", "matrix_inverse_root"]

_GRAFTING_BETA2_DEFAULT = {Grafting.ADAM: 0.999, Grafting.RMSPROP: 0.99}  # shampoo_types.py defaults


class _Block(NamedTuple):
    shape: tuple[int, ...]
    index: tuple[slice, ...]
    """The block in its unit's view (this rank's ``[rows, *dims[1:]]`` piece, or an owned split strip)."""
    factor: int
    """Offset of the block's first factor in this rank's flat factor state."""


class _StripPiece(NamedTuple):
    """This rank's part of a split strip: ``n`` elements at ``local`` of its flat piece, whose
    strip's factors live on ``owner``."""

    strip: int
    local: int
    n: int
    owner: int


class _OwnedStrip(NamedTuple):
    """A split strip whose first element (hence whose factors) this rank holds."""

    strip: int
    shape: tuple[int, ...]
    """``(rows, *dims[1:])``: the strip's view."""
    blocks: tuple[_Block, ...]
    """Its blocks, indexed in that view, with their factors in this rank's flat factor state."""
    pieces: tuple[tuple[int, int, int], ...]
    """``(rank, a, b)``: every rank's part ``[a, b)`` of the strip (strip-local flat offsets)."""


class _ParamPlan(NamedTuple):
    name: str
    info: LocalShard
    geom: BlockGeometry
    strips: tuple[int, int]
    """The strips ``[s0, s1)`` whose first element this rank holds: their factors live here."""
    blocks: tuple[_Block, ...]
    """The blocks of the strips lying wholly in this rank's range, indexed in its local view."""
    owned: _OwnedStrip | None = None
    """The last of ``strips`` when it ends past this rank's range (a split strip)."""
    pieces: tuple[_StripPiece, ...] = ()
    """This rank's parts of split strips (at most two: the first and the last strip it touches)."""
    cut: bool = False
    """Some rank boundary falls inside a strip of this parameter (on any rank)."""
    run: TPRun | None = None
    """A tensor-parallel cut splits its blocks: the run of global strips this TP rank owns ([Note:
    preconditioner blocks under tensor parallelism]); ``blocks`` is then empty."""
    run_blocks: tuple[_Block, ...] = ()
    """The run's blocks, indexed in its ``TPRun.shape`` view, with their factors here."""

    @property
    def local_shape(self) -> tuple[int, ...]:
        g = self.geom
        return (self.info.local_numel // g.cols if g.cols else 0, *g.dims[1:])


class _Unit(NamedTuple):
    """Blocks stepped together with their data ([Note: Shampoo step] 1, 2 and 4): the strips lying
    wholly in a rank's piece of a parameter, or one split strip its owner assembled."""

    shape: tuple[int, ...]
    """The view of the flat data below that ``blocks`` index."""
    blocks: tuple[_Block, ...]
    state: dict[str, Tensor]
    """The parameter's state (``factor_matrices``, ``inv_factor_matrices``)."""
    order: int
    t: int
    roots: bool
    """Whether the inverse roots are recomputed this step."""
    bc2: float
    """The factors' bias correction ``1 - beta2^t`` (1 without)."""
    g: Tensor
    """The raw gradient, flat, fp32."""
    gbar: Tensor
    """The filtered gradient (bias-corrected)."""
    graft_dir: Tensor | None
    direction: Tensor
    """The search direction, filled from ``start_preconditioning_step`` on."""


class _Ctx(NamedTuple):
    """One parameter's step in progress (``Shampoo._begin``)."""

    p: Tensor
    plan: _ParamPlan
    state: dict[str, Tensor]
    t: int
    g: Tensor
    """The local gradient, flat, fp32."""
    gbar: Tensor
    """The filtered gradient (bias-corrected)."""
    graft_dir: Tensor | None
    roots: bool
    """Whether the inverse roots are recomputed this step."""
    bc2: float
    """The factors' bias correction ``1 - beta2^t`` (1 without)."""
    direction: Tensor
    """The search direction, filled by the step (the grafting one before ``start_preconditioning_step``)."""
    precondition: bool
    """``t >= start_preconditioning_step``: Shampoo's direction (else the grafting one)."""

    def unit(self) -> _Unit:
        """The strips lying wholly in this rank's piece."""
        return _Unit(self.plan.local_shape, self.plan.blocks, self.state, self.plan.geom.order, self.t, self.roots,
                     self.bc2, self.g, self.gbar, self.graft_dir, self.direction)  # fmt: skip

    def fields(self) -> tuple[str, ...]:
        """What a piece of a split strip carries to its owner this step ([Note: Shampoo split strips])."""
        if not self.precondition:
            return ("g",)
        return ("g",) + (("gbar",) if self.gbar is not self.g else ()) + (("graft_dir",) if self.graft_dir is not None else ())


class _Send(NamedTuple):
    param: Tensor
    local: int
    n: int
    owner: int


class _Recv(NamedTuple):
    param: Tensor
    owned: int
    """Index into ``_Exchange.owned``."""
    a: int
    """Offset of the piece in the strip."""
    n: int
    source: int


class _Exchange(NamedTuple):
    """The split strips of one shard group: one all_to_all_single pair per step. Out: ``sends``
    ordered by owner, then (parameter, strip); in: ``recvs`` ordered by source rank, then (parameter,
    strip), the senders' order; back: the same orders reversed in role. Per step each piece carries
    ``n`` elements per field of ``_Ctx.fields`` out and ``n`` back (from ``start_preconditioning_step``
    on), so the sizes are summed per step from these lists."""

    group: Any
    world_size: int
    device: torch.device
    sends: tuple[_Send, ...]
    recvs: tuple[_Recv, ...]
    owned: tuple[tuple[Tensor, _OwnedStrip], ...]
    params: tuple[tuple[Tensor, torch.dtype, torch.device], ...]
    """The split parameters with the dtype and device the exchange was planned for."""


def _plan_param(name: str, info: LocalShard, geom: BlockGeometry) -> _ParamPlan:
    if info.numel == 0:
        return _ParamPlan(name, info, geom, (0, 0), ())
    start, end, bounds, cols = info.start, info.end, info.layout.bounds, geom.cols
    s0, s1 = geom.strip_at(start), geom.strip_at(end)
    blocks, owned, off = [], None, 0
    for i in range(s0, s1):
        row0 = geom.strip_start_row(i)
        whole_here = geom.strip_end(i) <= end
        sb = []
        for shape, index in geom.strip_blocks(i, row0 - start // cols if whole_here else 0):
            sb.append(_Block(shape, index, off))
            off += sum(n * n for n in shape)
        if whole_here:
            blocks.extend(sb)
        else:  # the last strip, cut by the next rank boundary
            shape = (geom.strip_rows(i), *geom.dims[1:])
            owned = _OwnedStrip(i, shape, tuple(sb), range_pieces(bounds, row0 * cols, math.prod(shape)))
    pieces = []
    if start < end:
        for i in sorted({geom.strip_containing(start), geom.strip_containing(end - 1)}):
            a, b = geom.strip_start_row(i) * cols, geom.strip_end(i)
            if a < start or b > end:
                lo, hi = max(a, start), min(b, end)
                pieces.append(_StripPiece(i, lo - start, hi - lo, bisect.bisect_right(bounds, a) - 1))
    cut = info.split and not all(geom.is_strip_boundary(b) for b in bounds)
    return _ParamPlan(name, info, geom, (s0, s1), tuple(blocks), owned, tuple(pieces), cut)


def _plan_run(name: str, info: LocalShard, geom: BlockGeometry, k: int, shift: int) -> _ParamPlan:
    """A TP-split parameter's plan: its run's blocks, factors in the run's order."""
    run = plan_tp_run(info, k, shift=shift)
    blocks, off = [], 0
    for shape, index in run.geom.local_blocks(run.start, run.start + run.numel):
        blocks.append(_Block(shape, index, off))
        off += sum(n * n for n in shape)
    return _ParamPlan(name, info, geom, (0, 0), (), run=run, run_blocks=tuple(blocks))


def _factor_views(flat: Tensor, b: _Block) -> list[Tensor]:
    out, off = [], b.factor
    for n in b.shape:
        out.append(square_view(flat, off, n))
        off += n * n
    return out


def _precondition(g: Tensor, roots: list[Tensor]) -> Tensor:
    """``g x_0 roots[0] x_1 roots[1] ...`` (each root symmetric), on aligned operands (the roots are
    views into flat state: [Note: alignment-independent kernels])."""
    g, roots = aligned(g), [aligned(r) for r in roots]
    if g.ndim == 1:
        return roots[0] @ g
    if g.ndim == 2:
        return roots[0] @ g @ roots[1]
    for r in roots:  # contract dim 0, append the new dim last: after N steps the dims are back in order
        g = torch.tensordot(g, r, dims=([0], [0]))
    return g


def _precondition_batched(x: Tensor, roots: list[Tensor]) -> Tensor:
    """``_precondition`` of every ``x[i]`` of a ``[B, *shape]`` stack with the roots stacked per dim."""
    if x.ndim == 2:
        return bmm(roots[0], x.unsqueeze(-1)).squeeze(-1)
    if x.ndim == 3:
        return bmm(bmm(roots[0], x), roots[1])
    return torch.stack(
        [_precondition(xi, [r[i] for r in roots]) for i, xi in enumerate(x.unbind(0))]
    )


def matrix_inverse_root(a: Tensor, root: float, epsilon: float) -> Tensor:
    """``A^{-1/root}`` of a symmetric matrix with DistributedShampoo's epsilon: ``w, Q = eigh(A +
    epsilon I)`` in float64, then if ``min(w) < epsilon`` every eigenvalue is shifted by
    ``epsilon - min(w)`` (``w - min(w) + epsilon``). Returns fp32 (the stored roots' dtype)."""
    n = a.shape[-1]
    a64 = a.double() + epsilon * torch.eye(n, dtype=torch.float64, device=a.device)
    w, q = eigh(a64)
    lam_min = w.min(dim=-1, keepdim=True).values
    w = torch.where(lam_min < epsilon, (w - lam_min) + epsilon, w)
    scaled = q * w.pow(-1.0 / root).unsqueeze(-2)
    return (bmm(scaled, q.mT) if a.ndim == 3 else scaled @ q.mT).float()


# ---- the optimizer ----------------------------------------------------------------------
def _resolve_hyperparameters(hp: dict[str, Any], *, where: str, stacklevel: int) -> dict[str, Any]:
    """Check one group's hyperparameters (``ValueError`` naming the value and the fix, prefixed by
    ``where``) and fill the derived defaults: ``grafting`` as its enum value, ``grafting_beta2``
    (None: 0.999 Adam, 0.99 RMSprop; ignored, with a warning, by AdaGrad and without grafting), ``start_preconditioning_step``
    (None: the frequency). Pure but for the warning."""
    lr, betas = hp["lr"], tuple(hp["betas"])
    if not lr >= 0.0:
        raise ValueError(f"Shampoo: {where}lr must be >= 0, got {lr}")
    if len(betas) != 2 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] <= 1.0):
        raise ValueError(f"Shampoo: {where}betas must be in [0, 1) x [0, 1], got {betas}")
    grafting = hp["grafting"]
    try:
        graft = grafting if isinstance(grafting, Grafting) else Grafting(grafting or "none")
    except ValueError:
        raise ValueError(
            f"Shampoo: {where}grafting must be None, 'adam', 'rmsprop' or 'adagrad', got {grafting!r}"
        ) from None
    gb2 = hp["grafting_beta2"]
    if gb2 is None:
        gb2 = _GRAFTING_BETA2_DEFAULT.get(graft, 1.0)
    if graft in (Grafting.ADAM, Grafting.RMSPROP) and not 0.0 < gb2 < 1.0:
        raise ValueError(
            f"Shampoo: {where}grafting_beta2 must be in (0, 1) for {graft.value} grafting, got {gb2}; for a "
            "sum of squared gradients use grafting='adagrad' (DistributedShampoo's Adam grafting with beta2=1 "
            "never updates its second moment)"
        )
    if graft is Grafting.ADAGRAD and gb2 != 1.0:
        warnings.warn(f"Shampoo: {where}grafting_beta2={gb2} is ignored by AdaGrad grafting", stacklevel=stacklevel)
        gb2 = 1.0
    if graft is Grafting.NONE and hp["grafting_beta2"] is not None:
        warnings.warn(
            f"Shampoo: {where}grafting_beta2={gb2} is ignored without grafting (grafting=None); for Adam grafting "
            "pass grafting='adam' (or 'rmsprop') with it",
            stacklevel=stacklevel,
        )
    if graft is Grafting.NONE:
        gb2 = 1.0
    if not hp["epsilon"] > 0.0 or not hp["grafting_epsilon"] > 0.0:
        raise ValueError(
            f"Shampoo: {where}epsilon and grafting_epsilon must be > 0, got {hp['epsilon']}, {hp['grafting_epsilon']}"
        )
    if not 0.0 <= hp["momentum"] < 1.0:
        raise ValueError(f"Shampoo: {where}momentum must be in [0, 1), got {hp['momentum']}")
    if not hp["weight_decay"] >= 0.0:
        raise ValueError(f"Shampoo: {where}weight_decay must be >= 0, got {hp['weight_decay']}")
    if hp["max_preconditioner_dim"] < 1:
        raise ValueError(f"Shampoo: {where}max_preconditioner_dim must be >= 1, got {hp['max_preconditioner_dim']}")
    freq, start = hp["precondition_frequency"], hp["start_preconditioning_step"]
    if freq < 1:
        raise ValueError(f"Shampoo: {where}precondition_frequency must be >= 1, got {freq}")
    if start is None:
        start = freq  # DistributedShampoo's default (-1)
    if start < freq:
        raise ValueError(
            f"Shampoo: {where}start_preconditioning_step ({start}) must be >= precondition_frequency ({freq}), "
            "as DistributedShampoo requires: the first roots are computed at start_preconditioning_step; pass "
            "start_preconditioning_step=None to use the frequency"
        )
    if hp["exponent_override"] < 0:
        raise ValueError(
            f"Shampoo: {where}exponent_override must be >= 0 (0: the default root), got {hp['exponent_override']}"
        )
    if hp["factor_matrix_dtype"] not in (torch.float32, torch.float64):
        raise ValueError(
            f"Shampoo: {where}factor_matrix_dtype must be torch.float32 or torch.float64, got {hp['factor_matrix_dtype']}"
        )
    return dict(hp, betas=betas, grafting=graft.value, grafting_beta2=gb2, start_preconditioning_step=start)


class Shampoo(BlockPreconditioner):
    """Blocked Shampoo on sharded or plain parameters, DistributedShampoo's algorithm and defaults.

    Shard with ``Shampoo.blocks`` (``Shampoo.rule(max_preconditioner_dim=1024)``) or
    ``Shampoo.rule(max_preconditioner_dim=k)`` with the same ``k`` as here: a rank boundary inside a
    strip raises ``ValueError`` unless the plan recorded the split (then it must fall on a row of the
    merged view; [Note: Shampoo split strips]). Blocks are the same for every world size, so a
    sharded run equals the single-process run. Plain (unsharded) parameters get their spec from ``blocks`` (default:
    ``Shampoo.rule`` with the group's ``max_preconditioner_dim``).

    ``betas``: (beta1 of the filtered gradient, 0 to disable; beta2 of the factor EMA, 1 for an
    AdaGrad-like sum). ``epsilon``: the factors' damping (see [Note: Shampoo step]).
    ``precondition_frequency`` / ``start_preconditioning_step`` (default: the frequency; must be
    ``>=`` it, as DistributedShampoo requires): when inverse roots are recomputed and from which step
    Shampoo's direction replaces the grafting one. ``exponent_override``: the root ``p`` of
    ``factor^{-1/p}`` (0: ``2 * order``). ``grafting``: ``None`` (DistributedShampoo's default),
    ``"adam"``, ``"rmsprop"`` or ``"adagrad"``, with ``grafting_beta2`` (default 0.999 Adam, 0.99
    RMSprop; Adam/RMSprop need ``< 1``: use ``"adagrad"`` for a sum; ignored, with a warning, without
    grafting) and ``grafting_epsilon``.
    ``factor_matrix_dtype``: ``torch.float32`` or ``torch.float64`` factors. ``batched``: the factor EMA with
    foreach ops and the outer products, ``eigh`` and preconditioning matmuls batched over same-shape
    blocks of a parameter group (see [Note: batched Shampoo]); ``False``: one block at a time (the
    reference mode); ``None`` (default): batched for CUDA parameters, one block at a time on CPU
    (where batching measured slower: the stacked blocks fall out of cache, and there are no kernel
    launches to save).
    """

    _name = "Shampoo"
    blocks = staticmethod(shampoo_rule(1024))

    @classmethod
    def rule(cls, *, max_preconditioner_dim: int = 1024, per_expert: bool = False) -> BlockRule:
        """The block rule for ``fully_shard``: strips of the merged shape (see ``shampoo_rule``);
        ``per_expert`` (opt-in) makes each expert of a 3-D ``[E, r, c]`` weight its own tensor."""
        return shampoo_rule(max_preconditioner_dim, per_expert=per_expert)

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = None,
        exponent_override: float = 0,
        use_bias_correction: bool = True,
        grafting: str | Grafting | None = None,
        grafting_beta2: float | None = None,
        grafting_epsilon: float = 1e-10,
        factor_matrix_dtype: torch.dtype = torch.float32,
        blocks: BlockRule | None = None,
        batched: bool | None = None,
    ) -> None:
        raw = dict(
            lr=lr, betas=tuple(betas), epsilon=epsilon, momentum=momentum, nesterov=nesterov,
            weight_decay=weight_decay, max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency, start_preconditioning_step=start_preconditioning_step,
            exponent_override=exponent_override, use_bias_correction=use_bias_correction,
            grafting=grafting, grafting_beta2=grafting_beta2, grafting_epsilon=grafting_epsilon,
            factor_matrix_dtype=factor_matrix_dtype,
        )  # fmt: skip
        resolved = _resolve_hyperparameters(raw, where="", stacklevel=3)
        # Defaults keep what the caller left unset (None) so that a group setting ``grafting`` or
        # ``precondition_frequency`` gets its own derived default (add_param_group resolves each group).
        ignored = resolved["grafting"] in (Grafting.ADAGRAD.value, Grafting.NONE.value)  # warned once, above
        defaults = dict(resolved, start_preconditioning_step=start_preconditioning_step,
                        grafting_beta2=None if ignored else grafting_beta2)  # fmt: skip
        self._rule = blocks
        self._exchanges: tuple[_Exchange, ...] | None = None
        super().__init__(params, defaults, batched=batched)
        if blocks is not None and self._plans and all(isinstance(t, RaggedDTensor) for t in self._plans):
            warnings.warn("Shampoo: blocks= is ignored: every parameter is sharded and its recorded spec is used",
                          stacklevel=2)  # fmt: skip

    # ---- groups and state ---------------------------------------------------------------
    def _resolve_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        """The group's hyperparameters checked and resolved as the constructor's (a group that sets
        ``grafting`` gets that grafting's ``grafting_beta2`` default, one that sets
        ``precondition_frequency`` its own ``start_preconditioning_step``)."""
        hp = {k: param_group.get(k, v) for k, v in self.defaults.items()}
        if "grafting" in param_group and "grafting_beta2" not in param_group:
            hp["grafting_beta2"] = None  # the group's own grafting's default, not the constructor's
        if "precondition_frequency" in param_group and "start_preconditioning_step" not in param_group:
            hp["start_preconditioning_step"] = None
        where = f"parameter group {len(self.param_groups)}: "
        return {**param_group, **_resolve_hyperparameters(hp, where=where, stacklevel=4)}

    def _plan_group(self, group: dict[str, Any]) -> None:
        k = group["max_preconditioner_dim"]
        names = group.get("param_names", [None] * len(group["params"]))
        for name, p in zip(names, group["params"]):
            info = checked_param_info(
                p, self._rule or shampoo_rule(k), optimizer="Shampoo", name=name or "", whole_blocks=True,
                blocks=f"Shampoo.rule(max_preconditioner_dim={k})",
                tp_assembles=lambda i: tp_keeps_blocks(i, k) or tp_runs_fit(i, k), tp_supported=RUNS_TAKE,
            )  # fmt: skip
            geom = shampoo_blocks(info.shape, k, info.spec)
            if info.split:  # the plan recorded split strips: cut on rows of the merged view only
                ok = info.numel == 0 or all(b % geom.cols == 0 for b in info.layout.bounds)
                need = f"split strips cut on rows of its merged shape {geom.dims}"
            else:
                ok = info.numel == 0 or all(geom.is_strip_boundary(b) for b in info.layout.bounds)
                need = (f"whole strips of {k} slices of dim 0 of its merged shape {geom.dims} on one rank (or a "
                        "plan that records the split)")  # fmt: skip
            require_spec(info, ok, optimizer="Shampoo", need=need, blocks=f"Shampoo.rule(max_preconditioner_dim={k})")
            label = name or info.fqn or f"<param of shape {tuple(info.shape)}>"
            if info.tp is not None and not tp_keeps_blocks(info, k):  # assembled in runs over TP
                plan = _plan_run(label, info, geom, k, self._run_shift())
            else:
                plan = _plan_param(label, info, geom)
            self._plans[p] = plan
            self._init_state(p, plan, group)
        self._exchanges = None  # re-planned at the next step

    def _init_state(self, p: Tensor, plan: _ParamPlan, group: dict[str, Any]) -> None:
        s0, s1 = plan.strips
        f32 = dict(dtype=torch.float32, device=p.device)
        state = self.state[p]
        state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
        n = plan.geom.factor_numel(s0, s1) if plan.run is None else plan.run.geom.factor_numel(*plan.run.strips)
        state.setdefault("factor_matrices", torch.zeros(n, dtype=group["factor_matrix_dtype"], device=p.device))
        if "inv_factor_matrices" not in state:
            inv = torch.zeros(n, **f32)
            owned = plan.owned.blocks if plan.owned is not None else ()
            for b in (*plan.blocks, *owned, *plan.run_blocks):  # identity roots until the first computation (as DistributedShampoo)
                for v in _factor_views(inv, b):
                    v.fill_diagonal_(1.0)
            state["inv_factor_matrices"] = inv
        if group["grafting"] != Grafting.NONE.value:
            state.setdefault("grafting_state", torch.zeros(local_tensor(p).numel(), **f32))
        if group["betas"][0] > 0:
            state.setdefault("filtered_grad", torch.zeros(local_tensor(p).numel(), **f32))
        if group["momentum"] > 0:
            state.setdefault("momentum_buffer", torch.zeros(local_tensor(p).numel(), **f32))

    def state_shards(self, p: Tensor) -> dict[str, StateShard]:
        """Per-element keys: the parameter's range; factor keys: this rank's blocks' factors, flattened
        and concatenated in global block order (strip-major, then the other dims' chunks), each
        block's factors in dim order (a TP-split parameter's: its run's, over the (dp, tp) cells)."""
        plan = self._plans[p]
        info, geom = plan.info, plan.geom
        elem = per_element(info)
        if plan.run is not None:  # the global factor vector over the (dp, tp) cells
            bounds = run_bounds(plan.run, lambda i: plan.run.geom.factor_numel(0, i))
            fac = StateShard(bounds[-1], bounds[plan.run.cell], bounds[plan.run.cell + 1], bounds, mesh=plan.run.mesh)
        else:
            fac = state_range(info, lambda b: geom.factor_numel(0, geom.strip_at(b)))
        out = {"factor_matrices": fac, "inv_factor_matrices": fac}
        for key in ("grafting_state", "filtered_grad", "momentum_buffer"):
            if key in self.state[p]:
                out[key] = elem
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but state keeps its saved dtype (torch casts floating state to the parameter's
        dtype, which for bf16 parameters would round the factors)."""
        keep: dict[Tensor, dict[str, Tensor]] = {}
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved["params"], group["params"]):
                st = state_dict["state"].get(pid, {})
                keep[p] = {
                    k: v for k, v in st.items()
                    if k != "step" and isinstance(v, Tensor) and v.dtype in (torch.float32, torch.float64)
                }  # fmt: skip
        super().load_state_dict(state_dict)
        for p, st in keep.items():
            for k, v in st.items():
                self.state[p][k] = v.to(device=p.device, copy=True)

    # ---- step -------------------------------------------------------------------------
    def _batched_default(self, params: list[Tensor]) -> bool:
        return any(p.is_cuda for p in params)

    def _begin(self, p: Tensor, group: dict[str, Any]) -> _Ctx:
        """Per-element work of one parameter: step count, grafting state, filtered gradient, grafting
        direction ([Note: Shampoo step] 1, 3 and 4's grafting)."""
        plan, state = self._plans[p], self.state[p]
        beta1 = group["betas"][0]
        graft, gb2 = Grafting(group["grafting"]), group["grafting_beta2"]
        state["step"] += 1
        t = int(state["step"].item())
        g = local_tensor(p.grad).reshape(-1).float()
        if graft is not Grafting.NONE:
            update_grafting_(state["grafting_state"], g, graft, gb2)
        if beta1 > 0:
            m = state["filtered_grad"]
            m.lerp_(g, 1 - beta1)
            gbar = m / (1 - beta1**t) if group["use_bias_correction"] else m
        else:
            gbar = g
        graft_dir = None
        if graft is not Grafting.NONE:
            graft_dir = grafting_direction(gbar, state["grafting_state"], graft, gb2, t, group["grafting_epsilon"])
        start, freq = group["start_preconditioning_step"], group["precondition_frequency"]
        beta2 = group["betas"][1]
        bc2 = 1 - beta2**t if group["use_bias_correction"] and beta2 < 1.0 else 1.0
        if t < start:
            d = graft_dir if graft_dir is not None else gbar.clone()
        else:
            d = torch.empty_like(g)
        return _Ctx(p, plan, state, t, g, gbar, graft_dir, t == start or (t > start and t % freq == 0), bc2, d, t >= start)

    def _finish(self, c: _Ctx, group: dict[str, Any]) -> None:
        """Weight decay, momentum and the update ([Note: Shampoo step] 5)."""
        d, flat = c.direction, local_tensor(c.p).view(-1)
        if group["weight_decay"] != 0:
            d = d.add(flat, alpha=group["weight_decay"])
        mu = group["momentum"]
        if mu > 0:
            buf = c.state["momentum_buffer"]
            buf.mul_(mu).add_(d)
            d = d.add(buf, alpha=mu) if group["nesterov"] else buf
        apply_update(flat, d, group["lr"])

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        c = self._begin(p, group)
        self._step_unit(c.unit(), group)
        self._finish(c, group)

    def _step_unit(self, u: _Unit, group: dict[str, Any]) -> None:
        """[Note: Shampoo step] 1 (factors), 2 and 4 of a unit's blocks, one block at a time."""
        fdt = group["factor_matrix_dtype"]
        gv = u.g.view(u.shape)
        for b in u.blocks:  # 1. factors (raw gradient), one block's outer products at a time
            gb = gv[b.index].to(fdt).contiguous()  # float64 factors: the outer products in float64 too
            factor_ema_(_factor_views(u.state["factor_matrices"], b), [outer(gb, d) for d in range(gb.ndim)],
                        group["betas"][1])  # fmt: skip
        if u.roots:  # 2. inverse roots
            root = group["exponent_override"] or 2 * u.order
            factors, inv = u.state["factor_matrices"], u.state["inv_factor_matrices"]
            for b in u.blocks:
                for f, r in zip(_factor_views(factors, b), _factor_views(inv, b)):
                    r.copy_(matrix_inverse_root(f / u.bc2, root, group["epsilon"]))
        if u.t >= group["start_preconditioning_step"]:  # 4. Shampoo's direction, grafted per block
            dv, gbarv = u.direction.view(u.shape), u.gbar.view(u.shape)
            graftv = u.graft_dir.view(u.shape) if u.graft_dir is not None else None
            for b in u.blocks:
                pre = _precondition(gbarv[b.index].contiguous(), _factor_views(u.state["inv_factor_matrices"], b))
                if graftv is not None:
                    pre = graft_rescale_(pre.unsqueeze(0), graftv[b.index].contiguous().unsqueeze(0))[0]
                dv[b.index] = pre

    def _step_group_batched(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """One step of every parameter of ``group`` with block work batched per block shape."""
        ctx = [self._begin(p, group) for p in params]
        self._step_units_batched([c.unit() for c in ctx], group)
        for c in ctx:
            self._finish(c, group)

    def _step_units_batched(self, units: list[_Unit], group: dict[str, Any]) -> None:
        """[Note: Shampoo step] 1, 2 and 4 of every unit's blocks, batched per block shape."""
        start, fdt = group["start_preconditioning_step"], group["factor_matrix_dtype"]
        by_shape: dict[tuple[int, ...], list[tuple[_Unit, _Block]]] = {}
        fv: dict[tuple[int, int], list[Tensor]] = {}  # (unit, factor offset) -> factor views
        iv: dict[tuple[int, int], list[Tensor]] = {}  # ... -> inverse-root views
        for u in units:
            for b in u.blocks:
                by_shape.setdefault(b.shape, []).append((u, b))
                fv[id(u), b.factor] = _factor_views(u.state["factor_matrices"], b)
                iv[id(u), b.factor] = _factor_views(u.state["inv_factor_matrices"], b)

        def stack(key: str, items: list[tuple[_Unit, _Block]]) -> Tensor:
            return torch.stack([getattr(u, key).view(u.shape)[b.index] for u, b in items])

        # factors: batched outer products, then one foreach EMA over every factor of the group
        views, outers = [], []
        for shape, items in by_shape.items():
            gs = stack("g", items).to(fdt)
            for dim in range(len(shape)):
                outers.extend(outer_batched(gs, dim).unbind(0))
                views.extend(fv[id(u), b.factor][dim] for u, b in items)
        factor_ema_(views, outers, group["betas"][1])

        for shape, items in by_shape.items():
            order = len(shape)
            root = group["exponent_override"] or 2 * order
            # inverse roots: one batched eigh per factor dim
            sel = [(u, b) for u, b in items if u.roots]
            for dim in range(order) if sel else ():
                fs = torch.stack([fv[id(u), b.factor][dim] / u.bc2 for u, b in sel])
                out = [iv[id(u), b.factor][dim] for u, b in sel]
                torch._foreach_copy_(out, list(matrix_inverse_root(fs, root, group["epsilon"]).unbind(0)))
            # preconditioning (and grafting norms) batched
            sel = [(u, b) for u, b in items if u.t >= start]
            if not sel:
                continue
            rs = [torch.stack([iv[id(u), b.factor][dim] for u, b in sel]) for dim in range(order)]
            pre = _precondition_batched(stack("gbar", sel), rs)
            if group["grafting"] != Grafting.NONE.value:
                graft_rescale_(pre, stack("graft_dir", sel))
            for i, (u, b) in enumerate(sel):
                u.direction.view(u.shape)[b.index] = pre[i]

    # ---- split strips ([Note: Shampoo split strips]) -----------------------------------------
    def _step_all(self, todo: list[tuple[Tensor, dict[str, Any]]], batched: bool) -> None:
        """As the base class's, with one exchange pair per shard group holding split strips: every
        split parameter's per-element work first, then the pieces out to the strips' owners, the block
        work (local and owned strips), the direction pieces back, and the update."""
        exchanges, runs = self._split_exchanges(), self._run_exchanges()
        if not exchanges and not runs:
            return super()._step_all(todo, batched)
        split = {p for ex in exchanges for p, _, _ in ex.params} | {p for ex in runs for p, _ in ex.runs}
        group_of = {p: g for p, g in todo}
        ctx: dict[Tensor, _Ctx] = {}
        for p, group in todo:
            if batched or p in split:
                ctx[p] = self._begin(p, group)
            else:  # not split, one at a time: only its transients alive
                self._step_param(p, group)
        owned = [self._exchange_out(ex, ctx) for ex in exchanges]
        run_units = [self._runs_out(ex, ctx) for ex in runs]
        if batched:
            for group in self.param_groups:
                units = [ctx[p].unit() for p in group["params"] if p in ctx]
                units += [u for ex, us in zip(exchanges, owned) for (p, _), u in zip(ex.owned, us)
                          if u is not None and group_of[p] is group]  # fmt: skip
                units += [u for us in run_units for p, u in us.items() if group_of[p] is group]
                if units:
                    self._step_units_batched(units, group)
        else:
            for p, c in ctx.items():
                self._step_unit(c.unit(), group_of[p])
            for ex, us in zip(exchanges, owned):
                for (p, _), u in zip(ex.owned, us):
                    if u is not None:
                        self._step_unit(u, group_of[p])
            for us in run_units:
                for p, u in us.items():
                    self._step_unit(u, group_of[p])
        for ex, us in zip(exchanges, owned):
            self._exchange_back(ex, ctx, us)
        for ex, us in zip(runs, run_units):  # from start_preconditioning_step on: each rank's part of the direction
            pre = [p for p in us if ctx[p].precondition]
            if pre:  # (the same on every TP rank: the same step counts)
                ex.scatter({p: us[p].direction for p in pre}, {p: ctx[p].direction for p in pre})
        for p, c in ctx.items():
            self._finish(c, group_of[p])

    # ---- runs of TP-split parameters ([Note: preconditioner blocks under tensor parallelism]) ----
    def _runs_out(self, ex: TPRunExchange, ctx: dict[Tensor, _Ctx]) -> dict[Tensor, _Unit]:
        """The first all_to_all_single of ``ex``: every rank's part of each run with the fields of
        ``_Ctx.fields``; returns the unit of this rank's run of each parameter with a gradient."""
        got = ex.gather({p: [getattr(ctx[p], key) for key in ctx[p].fields()] for p, _ in ex.runs if p in ctx})
        units = {}
        for p, run in ex.runs:
            if p in got:
                c = ctx[p]
                data = dict(zip(c.fields(), got[p]))
                g = data["g"]
                direction = torch.empty_like(g) if c.precondition else g
                units[p] = _Unit(run.shape, c.plan.run_blocks, c.state, run.geom.order, c.t, c.roots, c.bc2, g,
                                 data.get("gbar", g), data.get("graft_dir"), direction)  # fmt: skip
        return units

    def _split_exchanges(self) -> tuple[_Exchange, ...]:
        """The exchanges of split strips, planned at the first step and again when a split
        parameter's dtype or device changed (every rank sees the same split parameters: all re-plan)."""
        if self._exchanges is None or any(
            p.dtype != d or p.device != dev for ex in self._exchanges for p, d, dev in ex.params
        ):
            by_group: dict[Any, list[Tensor]] = {}
            for group in self.param_groups:
                for p in group["params"]:
                    plan = self._plans[p]
                    if plan.cut and plan.info.world_size > 1:
                        by_group.setdefault((plan.info.mesh, plan.info.mesh_dim), []).append(p)
            self._exchanges = tuple(self._plan_exchange(ps) for ps in by_group.values())
        return self._exchanges

    def _plan_exchange(self, params: list[Tensor]) -> _Exchange:
        """One shard group's exchange: this rank's pieces to their owners, and the pieces of the split
        strips it owns from every rank, both in (rank, parameter, strip) order."""
        info0 = self._plans[params[0]].info
        w = info0.world_size
        group, g = info0.exchange_group()
        sends, recvs, owned = [], [], []
        for i, p in enumerate(params):
            plan = self._plans[p]
            if plan.info.world_size != w:
                raise ValueError(
                    f"Shampoo: {plan.name} is sharded over {plan.info.world_size} ranks and {self._plans[params[0]].name} "
                    f"over {w} in the same process group; one group has one world size"
                )
            # (owners and sources by their rank in the group: the order of a collective's buffers)
            sends.extend(((g[x.owner], i, x.strip), _Send(p, x.local, x.n, g[x.owner])) for x in plan.pieces)
            if plan.owned is not None:
                j = len(owned)
                owned.append((p, plan.owned))
                recvs.extend(((g[q], i, plan.owned.strip), _Recv(p, j, a, b - a, g[q])) for q, a, b in plan.owned.pieces)
        return _Exchange(
            group, w, params[0].device, tuple(x for _, x in sorted(sends, key=lambda t: t[0])),
            tuple(x for _, x in sorted(recvs, key=lambda t: t[0])), tuple(owned),
            tuple((p, p.dtype, p.device) for p in params),
        )  # fmt: skip

    def _exchange_out(self, ex: _Exchange, ctx: dict[Tensor, _Ctx]) -> list[_Unit | None]:
        """First all_to_all_single: each piece's fields (``_Ctx.fields``: the raw gradient, from
        ``start_preconditioning_step`` on also the filtered gradient and the grafting direction, fp32)
        to its strip's owner. Returns one unit per owned strip, assembled (None: no gradient)."""
        send_sizes, recv_sizes = [0] * ex.world_size, [0] * ex.world_size
        for s in ex.sends:
            if s.param in ctx:
                send_sizes[s.owner] += len(ctx[s.param].fields()) * s.n
        for r in ex.recvs:
            if r.param in ctx:
                recv_sizes[r.source] += len(ctx[r.param].fields()) * r.n
        send = torch.empty(sum(send_sizes), dtype=torch.float32, device=ex.device)
        at = 0
        for s in ex.sends:
            c = ctx.get(s.param)
            for key in c.fields() if c is not None else ():
                send[at : at + s.n].copy_(getattr(c, key)[s.local : s.local + s.n])
                at += s.n
        recv = torch.empty(sum(recv_sizes), dtype=torch.float32, device=ex.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=ex.group)
        units: list[_Unit | None] = []
        for p, os in ex.owned:
            c = ctx.get(p)
            if c is None:
                units.append(None)
                continue
            numel, f32 = math.prod(os.shape), dict(dtype=torch.float32, device=ex.device)
            data = {key: torch.empty(numel, **f32) for key in c.fields()}
            g = data["g"]
            gbar = data.get("gbar", g)  # beta1 == 0 (or before start: unused): the raw gradient
            direction = torch.empty(numel, **f32) if c.precondition else g
            units.append(_Unit(os.shape, os.blocks, c.state, c.plan.geom.order, c.t, c.roots, c.bc2, g, gbar,
                               data.get("graft_dir"), direction))  # fmt: skip
        at = 0
        for r in ex.recvs:
            u = units[r.owned]
            if u is None:
                continue
            for key in ctx[r.param].fields():
                getattr(u, key)[r.a : r.a + r.n].copy_(recv[at : at + r.n])
                at += r.n
        return units

    def _exchange_back(self, ex: _Exchange, ctx: dict[Tensor, _Ctx], units: list[_Unit | None]) -> None:
        """Second all_to_all_single (from ``start_preconditioning_step`` on: the owners' search
        direction pieces, fp32, into each rank's direction; before it, every piece is empty)."""
        send_sizes, recv_sizes = [0] * ex.world_size, [0] * ex.world_size
        for r in ex.recvs:
            if r.param in ctx and ctx[r.param].precondition:
                send_sizes[r.source] += r.n
        for s in ex.sends:
            if s.param in ctx and ctx[s.param].precondition:
                recv_sizes[s.owner] += s.n
        back = torch.empty(sum(send_sizes), dtype=torch.float32, device=ex.device)
        at = 0
        for r in ex.recvs:
            if r.param in ctx and ctx[r.param].precondition:
                back[at : at + r.n].copy_(units[r.owned].direction[r.a : r.a + r.n])
                at += r.n
        mine = torch.empty(sum(recv_sizes), dtype=torch.float32, device=ex.device)
        dist.all_to_all_single(mine, back, recv_sizes, send_sizes, group=ex.group)
        at = 0
        for s in ex.sends:
            c = ctx.get(s.param)
            if c is not None and c.precondition:
                c.direction[s.local : s.local + s.n].copy_(mine[at : at + s.n])
                at += s.n

    def _agreeing_groups(self) -> list[Any]:
        """As the base class's, and each shard group holding split strips."""
        return [ex.group for ex in self._split_exchanges()] + super()._agreeing_groups()
