"""Muon on block-aligned shards: Newton–Schulz on whole local matrices, AdamW for the rest.

[Note: Muon on shards]
Muon's update of a matrix is ``NS(momentum-updated gradient)``, a function of the *whole*
matrix. The spec recorded on each parameter (``RaggedShard.spec`` of its placement) says what a matrix is:
``whole()`` (the parameter), ``whole(row_splits=...)`` (per-head / fused-QKV sub-matrices,
each orthogonalized on its own) and ``expert()`` (``[E, r, c]``: E matrices). Every other
parameter (embeddings, output head, norms, biases: specs that are not matrix blocks), and every
parameter of a group with ``use_muon=False``, goes to the AdamW fallback, which is element-wise
and hence exact on any shard.

Everything but Newton–Schulz is element-wise (momentum ``lerp``, weight decay, the final
``add``), so each rank applies it to its own flat piece, with foreach ops. Newton–Schulz runs
where the matrix is:
- a matrix lying wholly in this rank's range (what ragged plans give every matrix) is
  orthogonalized locally: no communication;
- a matrix the planner had to cut (``RaggedShard.split``; cut on row boundaries) is sent to one
  *owner* rank, orthogonalized there and its pieces sent back: per shard group with split
  matrices exactly one ``all_to_all_single`` pair per step (all buckets together), every rank
  taking part (empty pieces included). Owners are fixed at construction by a longest-first
  assignment on Newton–Schulz flops over all ranks, starting from each rank's whole-matrix load;
  the send/receive layouts are precomputed then, so a step does O(pieces it touches) work.

Both exchanges carry bf16: torch.optim.Muon casts the update to bf16 as the first thing Newton–
Schulz does, and its output is bf16 (``gram_newton_schulz`` reads and returns bf16 too), so the
exchange is exact and the owner orthogonalizes the same bits as for a matrix held whole. What
comes back depends on the parameter's dtype:
- fp32 / fp64: Newton–Schulz's result; each rank adds its piece (``_foreach_add_``). Their ``add``
  rounds each element once whatever the tensors' extent and strides, so a piece gets the whole
  matrix's bits.
- lower precisions (bf16, fp16): the *new parameter values*. torch's CPU ``add_(other, alpha=)`` on
  two such tensors rounds differently in its vectorized body (``float(a) + bf16(alpha) *
  float(b)`` for bf16) and in its scalar code: the tail (the last ``numel % 64`` elements on
  AVX-512, and each thread's chunk end above 32768 elements) and every element of a strided
  ``other`` (Newton–Schulz returns a tall matrix transposed). So an element's rounding depends on
  the extent and strides of the tensors added: a contiguous piece added on its rank got the body's
  rounding where torch.optim.Muon's transposed whole-matrix add used the scalar one, and the
  elements before a rank boundary the tail's where torch used the body's (1 ulp on ~1.5% of a
  split [67, 33] bf16 matrix after 3 steps). So each rank also sends its (already
  weight-decayed) parameter piece, right after its update piece in the same
  ``all_to_all_single`` (bit for bit: 2-byte slots of the bf16 buffer; split matrices of other
  element sizes are a ``ValueError``); the owner runs torch.optim.Muon's ``param.add_(update,
  alpha=-adjusted_lr)`` on the assembled whole ``[rows, cols]`` parameter, with Newton–Schulz's
  result as torch lays it out, and sends back the new values, which each rank copies into its
  piece. Cost: a low-precision split piece travels twice in the first direction (update +
  parameter; the back direction is unchanged). For the same reason local runs of several
  low-precision matrices (experts, sub-matrices) are added matrix by matrix (one
  ``_foreach_add_`` of per-matrix views), as torch.optim.Muon adds each, not as one ``[count,
  rows, cols]`` tensor.
The layouts depend on each split parameter's dtype; they are planned at construction and
re-planned if a dtype changes (every rank sees the same split parameters, so all re-plan).

[Note: batched Newton–Schulz]
By default (``batched=True``) every matrix a rank orthogonalizes in a step (local ones and split
ones it owns) is stacked with the others of the same ``[rows, cols]`` and Newton–Schulz settings,
and each stack runs one batched chain (``baddbmm``; stacks capped at ``_STACK_NUMEL`` elements;
on CPU only matrices of at most ``_CPU_STACK_MAX_NUMEL`` elements are stacked, larger ones run one
at a time, a choice made by shape alone).
Which matrices share a stack depends on which ones a rank owns, hence on W and the plan, so the
result is W-invariant only if a batched matmul gives each matrix the bits it gives it alone. On
the CPUs tested here (AVX-512, torch 2.13, 1 and 2 threads) the batched chain equals
``torch.optim._muon._zeropower_via_newtonschulz`` matrix by matrix, for any stack composition
(tests/optimizers/test_muon.py checks shapes from 1x33 to 300x1100 and stacks of 1..5). A GPU BLAS
may pick a different kernel for a batch (or a batch count) than for one matrix; there, and
wherever bits matter more than speed, ``batched=False`` is the reference mode: each matrix goes
through torch.optim.Muon's own 2-D ops, one at a time, whatever W.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..sharding.contract import BlockRule, LocalShard, RaggedDTensor, expert, whole
from ._adamw import adamw_update
from ._base import range_pieces, StateShard, checked_param_info, local_tensor, make_dcp_ready, per_element, require_spec, profiled_step
from ._homes import assign_owners, ns_cost
from ._muon_tp import TPHomed, plan_tp_exchange, tp_assembles, tp_exchange_out, tp_receive_back, tp_write_back
from ._orthogonalize import DEFAULT_EPS, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, GRAM_DTYPE
from ._orthogonalize import gram_newton_schulz, newton_schulz, resolve
from ._rules import ambiguous_name_guess, muon_rule

__all__ = ["Muon", "newton_schulz", "adjust_lr"]

_STACK_NUMEL = 1 << 25
"""Most elements in one batched Newton–Schulz stack (64 MiB of bf16; the chain's transients are a
few times that). Larger sets of same-shape matrices run as several stacks."""

_CPU_STACK_MAX_NUMEL = 1 << 17
"""On CPU, matrices of more elements run one at a time even when batched: there BLAS is already
efficient per matrix and a bf16 ``baddbmm`` stack measured slower (512x512: 0.74-0.85x; see
benchmarks/bench_muon.py). The choice depends on the shape only, never on W."""


def _stacks_well(rows: int, cols: int, device: torch.device) -> bool:
    """Whether ``[rows, cols]`` matrices are worth stacking on ``device`` (a function of shape only)."""
    return device.type != "cpu" or rows * cols <= _CPU_STACK_MAX_NUMEL


_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn",
              "orthogonalize", "coefficients")
_ADAMW_KEYS = ("adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay")
_ADAMW_GROUP_KEYS = {"lr": "adamw_lr", "betas": "adamw_betas", "eps": "adamw_eps", "weight_decay": "adamw_weight_decay"}
_NONFINITE = ("ignore", "error", "skip")
_GRAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- math (pure) ----------------------------------------------------------------------
def _ns_key(group: dict[str, Any]) -> tuple:
    """A Muon group's orthogonalization settings ``(method, per-iteration (a, b, c), eps)``; a
    ``ValueError`` for bad ones (see [Note: which orthogonalization] in _orthogonalize.py)."""
    # Groups saved before 0.2.0 have neither key and step as they did then: torch's iteration.
    method, coefficients = group.get("orthogonalize", "newton_schulz"), group.get("coefficients", "torch")
    method, sched = resolve(method, coefficients, group["ns_coefficients"], group["ns_steps"])
    return method, sched, group["eps"]


def adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's shape-based learning rate of one ``[rows, cols]`` matrix.

    ``None``/``"original"``: ``lr * sqrt(max(1, rows / cols))`` (Keller Jordan);
    ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(rows, cols))`` (Moonshot, arXiv:2502.16982).
    Per-head and fused-QKV sub-matrices and experts use their own ``[rows, cols]``.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def _decay(params: list[Tensor], factor: float) -> None:
    """``p.mul_(factor)`` for every parameter, as torch.optim.Muon: one foreach call for fp32 / fp64
    parameters; a loop for lower precisions, where the CPU foreach kernel casts the scalar to the
    parameters' dtype first (bf16: 0.998 becomes 0.99609375, twice the decay; below ~0.002 of decay
    it becomes 1.0, none) while ``mul_`` multiplies in fp32 and rounds once."""
    exact = [p for p in params if p.dtype in (torch.float32, torch.float64)]
    if exact:
        torch._foreach_mul_(exact, factor)
    for p in params:
        if p.dtype not in (torch.float32, torch.float64):
            p.mul_(factor)


def _low_precision(dtype: torch.dtype) -> bool:
    """Whether ``add_``'s rounding on ``dtype`` depends on the tensors' extent and strides (every dtype
    but fp32 / fp64; see [Note: Muon on shards]): such matrices are added whole, as torch.optim.Muon adds them."""
    return dtype not in (torch.float32, torch.float64)


# ---- plan of one parameter / one exchange -------------------------------------------------
class _Run(NamedTuple):
    """``count`` consecutive ``[rows, cols]`` matrices at ``local_offset`` of this rank's piece."""

    local_offset: int
    count: int
    rows: int
    cols: int


class _ParamPlan(NamedTuple):
    info: LocalShard
    use_muon: bool
    runs: tuple[_Run, ...]
    """Matrices lying wholly in this rank's piece, grouped for batched Newton–Schulz."""
    split: tuple[tuple[int, int, int], ...]
    """Matrices ``(global_offset, rows, cols)`` cut across ranks."""


class _SendPiece(NamedTuple):
    """This rank's part of a split matrix: ``n`` elements at ``local_offset`` of ``param``'s piece.
    Out: its update at ``at`` of the send buffer, then (``with_param``: low precision) its ``n``
    parameter elements; back: ``n`` elements at ``back_at`` of the receive buffer, Newton–Schulz's
    result to add, or (``with_param``) the new parameter values to copy."""

    param: Tensor
    local_offset: int
    n: int
    rows: int
    cols: int
    with_param: bool
    at: int
    back_at: int


class _Owned(NamedTuple):
    """A split matrix this rank orthogonalizes; ``pieces``: ``(a, n, at, back_at)`` -- the update of
    its elements ``[a, a + n)`` is at ``at`` of the receive buffer (``with_param``: their parameter
    values at ``at + n``), and the result goes back from ``back_at`` of the send-back buffer."""

    param: Tensor
    rows: int
    cols: int
    pieces: tuple[tuple[int, int, int, int], ...]
    with_param: bool


class _Exchange(NamedTuple):
    """One all_to_all_single pair per step over ``group``. Out: ``sends`` (ordered by owner, then
    matrix) with ``send_sizes``; in: ``recv_sizes`` (ordered by source rank, then matrix). The way
    back: the same order, ``back_send_sizes`` / ``back_recv_sizes`` (``n`` per piece; out carries
    ``2 n`` for a low-precision piece). ``dtypes``: the split parameters' dtypes it was planned for."""

    group: dist.ProcessGroup | None
    device: torch.device
    sends: tuple[_SendPiece, ...]
    send_sizes: tuple[int, ...]
    recv_sizes: tuple[int, ...]
    back_send_sizes: tuple[int, ...]
    back_recv_sizes: tuple[int, ...]
    owned: tuple[_Owned, ...]
    dtypes: tuple[tuple[Tensor, torch.dtype], ...]


class _Update(NamedTuple):
    """A Muon parameter's update, computed piece by piece when needed (so the fp32 Nesterov update
    of all parameters never exists at once): ``grad.lerp(buf, momentum)``, or ``buf`` itself."""

    grad: Tensor
    buf: Tensor
    nesterov_momentum: float | None

    def piece(self, lo: int, hi: int) -> Tensor:
        """Flat elements ``[lo, hi)`` of this rank's piece of the update (fp32)."""
        if self.nesterov_momentum is None:
            return self.buf[lo:hi]
        return self.grad[lo:hi].lerp(self.buf[lo:hi], self.nesterov_momentum)  # element-wise: same bits


class _Job(NamedTuple):
    """``count`` ``[rows, cols]`` matrices to orthogonalize with one group's settings."""

    key: tuple
    group: dict
    count: int
    rows: int
    cols: int
    update: _Update | None
    """Local matrices: the parameter's update; they start at ``offset`` of this rank's piece."""
    offset: int
    source: Tensor | None
    """An owned split matrix: the ``[1, rows, cols]`` bf16 matrix assembled from received pieces."""
    dest: Tensor | None
    """Local matrices: the matching ``[count, rows, cols]`` view of the parameter."""
    owned: _Owned | None
    param: Tensor | None = None
    """An owned low-precision split matrix: the ``[rows, cols]`` parameter assembled from received pieces."""
    row_state: Tensor | None = None
    """A homed TP-sharded matrix of an optimizer with per-row state (NorMuon): its assembled ``[rows]`` state."""

    def matrices(self) -> Tensor:
        """The ``[count, rows, cols]`` input to Newton–Schulz."""
        if self.update is None:
            return self.source
        n = self.count * self.rows * self.cols
        return self.update.piece(self.offset, self.offset + n).view(self.count, self.rows, self.cols)

    @property
    def device(self) -> torch.device:
        return (self.source if self.update is None else self.update.buf).device


def _cut(m: tuple[int, int, int], bounds: Sequence[int]) -> bool:
    i = bisect.bisect_right(bounds, m[0])
    return i < len(bounds) - 1 and bounds[i] < m[0] + m[1] * m[2]


def _plan_param(info: LocalShard, *, use_muon: bool) -> _ParamPlan:
    if not use_muon or info.tp is not None:  # (TP-sharded: assembled over TP, [Note: Muon under tensor parallelism])
        return _ParamPlan(info, use_muon, (), ())
    local, split = [], []
    for m in info.spec.matrices(info.shape):
        if _cut(m, info.layout.bounds):
            split.append(m)
        elif info.start <= m[0] and m[0] + m[1] * m[2] <= info.end:
            local.append(m)
    runs: list[_Run] = []
    for off, r, c in local:
        lo = off - info.start
        last = runs[-1] if runs else None
        if last and (last.rows, last.cols) == (r, c) and last.local_offset + last.count * r * c == lo:
            runs[-1] = last._replace(count=last.count + 1)
        else:
            runs.append(_Run(lo, 1, r, c))
    return _ParamPlan(info, True, tuple(runs), tuple(split))


# ---- the optimizer ----------------------------------------------------------------------
def adamw_lr(group: dict[str, Any]) -> float:
    """The lr an AdamW group of ``Muon`` steps with; see [Note: the AdamW fallback's lr follows Muon's].

    [Note: the AdamW fallback's lr follows Muon's]
    ``Muon(params, lr=0.02, adamw_lr=3e-3)`` splits each group into a Muon part and an AdamW part. A
    scheduler that sets absolute values (``OneCycleLR(max_lr=0.02)``, ``CyclicLR``) would set both to
    the same lr, driving AdamW to Muon's. So the AdamW part's ``"lr"`` is in Muon's units (it starts at
    the Muon part's lr, and every scheduler moves the two alike), and it steps with
    ``adamw_lr * lr / base_lr``: exactly ``adamw_lr`` while unscheduled (``lr / base_lr`` is 1.0), and
    the schedule's factor times ``adamw_lr`` otherwise (to the rounding of that factor). Groups
    without ``"base_lr"`` (``use_muon=False`` groups, a Muon lr of 0, older state dicts) use ``"lr"``.
    """
    if "base_lr" not in group:
        return group["lr"]
    return group["adamw_lr"] * (group["lr"] / group["base_lr"])


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices, AdamW for the rest, on sharded or plain parameters.

    Equals ``torch.optim.Muon`` (matrices) + ``torch.optim.AdamW`` (the rest) run unsharded on
    the same gradients. Which parameters are matrices is read from each parameter's block spec
    (see [Note: Muon on shards]); pass ``Muon.blocks`` (or ``Muon.rule(head_dims=...,
    row_splits=..., embedding_and_head=...)``) to ``fully_shard(..., blocks=...)``. Plain
    (unsharded) parameters get their spec from ``blocks``; pass ``model.named_parameters()`` so
    that embeddings and the output head are recognised by name.

    Explicit sets (docs/muon.md): a parameter group with ``use_muon=False`` goes to AdamW whatever
    its shape or name (``lr``, ``betas``, ``eps``, ``weight_decay`` there are AdamW's, defaulting
    to ``adamw_*``), as in Keller Jordan's ``MuonWithAuxAdam``; ``use_muon=True`` asks for
    Newton–Schulz (a plain 2-D / 3-D parameter is then a matrix / experts whatever its name).
    Groups without the flag are split by spec, and a guess from names that looks ambiguous warns.

    Each parameter group is split into a Muon group (``group["use_muon"] is True``: ``lr``,
    ``weight_decay``, ``momentum``, ...) and an AdamW group (``lr`` = ``adamw_lr``, ``betas``,
    ``eps``, ``weight_decay``), so LR schedulers scale both. Defaults are torch.optim.Muon's and
    torch.optim.AdamW's. A group's own ``weight_decay`` is its AdamW part's too unless the group
    also sets ``adamw_weight_decay``: ``Muon(fsdp_optim.param_groups(model, weight_decay=0.1))``
    decays nothing in the no-decay group (norms, biases) and 0.1 elsewhere, as AdamW would; the
    constructor's ``adamw_weight_decay`` applies to groups that set neither.

    ``lr``, ``weight_decay`` (decoupled, ``param *= 1 - lr * wd``), ``momentum``, ``nesterov``,
    ``ns_coefficients``, ``eps``, ``ns_steps``, ``adjust_lr_fn``: as torch.optim.Muon, except that the
    shape-based LR adjustment uses each sub-matrix's shape (a head ``[head_dim, cols]``, a fused-QKV
    part, an expert ``[r, c]``), which is torch.optim.Muon applied to that sub-matrix.
    ``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``: the AdamW fallback.
    An LR scheduler keeps the ratio ``adamw_lr / lr``: the AdamW part of a split group is scheduled
    in Muon's units (its ``"lr"`` starts at ``lr``; ``"adamw_lr"`` and ``"base_lr"`` record the
    ratio) and steps with ``adamw_lr * group["lr"] / base_lr``, so ``OneCycleLR(opt, max_lr=0.02)``
    on ``Muon(lr=0.02, adamw_lr=3e-3)`` peaks AdamW at 3e-3; read it with ``Muon.adamw_lr(group)``.
    A ``use_muon=False`` group's ``lr`` is AdamW's own, as is every AdamW part when ``lr`` is 0.
    ``blocks``: the rule giving plain parameters their spec (default ``Muon.blocks``).
    ``batched``: Newton–Schulz over stacks of same-shape matrices (default); ``False`` is the
    per-matrix reference mode (see [Note: batched Newton–Schulz]).
    ``nonfinite``: what a non-finite gradient does. ``"ignore"`` (default; torch.optim.Muon's
    behaviour, no check, zero collectives); ``"error"``: ``FloatingPointError`` naming the
    parameters on every rank; ``"skip"``: the whole step (AdamW part included) is skipped on every
    rank, with a warning naming them. Both agree across the shard group with one small all_reduce
    per step, before any state changes or split-matrix exchange, so no rank is left waiting.
    ``orthogonalize``: ``"newton_schulz"`` (default, torch.optim.Muon's bits) or ``"gram_newton_schulz"``
    (the same polynomial through the Gram matrix, fewer flops on rectangular matrices, in ``gram_dtype``:
    fp16 by default, as its authors); ``coefficients``: ``"torch"`` (default: ``ns_coefficients`` for
    ``ns_steps`` iterations), ``"polar_express"`` or a list of ``(a, b, c)``, one per iteration. Both
    may be set per group. See [Note: which orthogonalization] in _orthogonalize.py and docs/muon.md.
    """

    blocks = staticmethod(muon_rule())
    adamw_lr = staticmethod(adamw_lr)

    @classmethod
    def rule(
        cls,
        *,
        head_dims: dict[str, int] | None = None,
        row_splits: dict[str, Sequence[int]] | None = None,
        embedding_and_head: Iterable[str] | None = None,
    ) -> BlockRule:
        """The block rule for ``fully_shard``: per-head (``head_dims``) and fused-QKV (``row_splits``)
        sub-matrices by parameter-name suffix; ``embedding_and_head``: the names (or name suffixes)
        left to AdamW, replacing the guess from names; see ``muon_rule``."""
        return muon_rule(head_dims=head_dims, row_splits=row_splits, embedding_and_head=embedding_and_head)

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        blocks: BlockRule | None = None,
        batched: bool = True,
        nonfinite: str = "ignore",
        orthogonalize: str = "newton_schulz",
        coefficients: str | Sequence[tuple[float, float, float]] = "torch",
        gram_dtype: torch.dtype = GRAM_DTYPE,
    ) -> None:
        if not lr >= 0.0 or not adamw_lr >= 0.0:
            raise ValueError(f"learning rates must be >= 0, got lr={lr}, adamw_lr={adamw_lr}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        if not weight_decay >= 0.0 or not adamw_weight_decay >= 0.0:
            raise ValueError(f"weight decays must be >= 0, got {weight_decay}, {adamw_weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
        if not all(0.0 <= b < 1.0 for b in adamw_betas):
            raise ValueError(f"adamw_betas must be in [0, 1), got {adamw_betas}")
        if ns_steps >= 100:
            raise ValueError(f"ns_steps must be < 100, got {ns_steps}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}")
        resolve(orthogonalize, coefficients, ns_coefficients, ns_steps)  # ValueError naming the argument
        if gram_dtype not in _GRAM_DTYPES:
            raise ValueError(f"gram_dtype must be one of {_GRAM_DTYPES}, got {gram_dtype!r}")
        self.gram_dtype = gram_dtype
        self._rule: BlockRule = blocks if blocks is not None else Muon.blocks
        self._plans: dict[Tensor, _ParamPlan] = {}
        self._exchanges: tuple[_Exchange, ...] | None = None
        self._tp_exchanges: tuple | None = None
        self.batched = bool(batched)
        self.nonfinite = nonfinite
        self.num_skipped_steps = 0
        """Steps skipped for non-finite gradients (``nonfinite="skip"``)."""
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay, orthogonalize=orthogonalize,
            coefficients=coefficients if isinstance(coefficients, str) else tuple(map(tuple, coefficients)),
        )  # fmt: skip
        super().__init__(params, defaults)
        self._exchanges, self._tp_exchanges = self._plan_exchanges(), self._plan_tp_exchanges()
        make_dcp_ready(self)

    # ---- groups and state ---------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Split ``param_group`` into its Muon part and its AdamW part (see the class docstring);
        a group with ``use_muon`` is taken as it is."""
        if "use_muon" in param_group:
            self._add_explicit_group(param_group)
            return
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        named = [x if isinstance(x, tuple) else (None, x) for x in params]
        muon, adamw, unexpected, unnamed, ambiguous = [], [], [], 0, []
        guesses = getattr(self._rule, "guesses_names", False)
        for name, p in named:
            info = self._info(p, name)
            (muon if info.spec.is_matrix else adamw).append((name, p) if name is not None else p)
            plain = not isinstance(p, RaggedDTensor)
            unnamed += plain and name is None and info.spec.is_matrix
            if len(info.shape) not in (2, 3):
                continue
            if guesses and info.fqn and ambiguous_name_guess(info.fqn, is_matrix=info.spec.is_matrix):
                ambiguous.append((info.fqn, info.spec.is_matrix))
            elif not plain and not info.spec.is_matrix:  # the rule given here would make it a matrix
                if self._rule(info.fqn, torch.empty(info.shape, device="meta"), None).is_matrix:
                    unexpected.append((info.fqn or f"<shape {info.shape}>", info.spec))
        if any(isinstance(p, RaggedDTensor) and p.ragged.spec.is_matrix for _, p in named):
            unexpected = []  # sharded with a Muon rule: its element-wise specs were decided (nn.Embedding by type)
        if unexpected:
            warnings.warn(
                f"Muon: {len(unexpected)} sharded matrix parameter(s) (e.g. {unexpected[0][0]}, block spec "
                f"{unexpected[0][1]}) were not sharded as whole matrices, so they get the AdamW fallback; shard "
                "with fully_shard(..., blocks=Muon.blocks) to orthogonalize them",
                stacklevel=3,
            )
        if unnamed:
            warnings.warn(
                f"Muon: {unnamed} plain (unsharded) matrix parameter(s) came without names, so embeddings and "
                "the output head cannot be told apart and every matrix gets Newton-Schulz; pass "
                "model.named_parameters() (or shard with fully_shard) to give embeddings and the head AdamW, "
                "or pass them in a group with use_muon=False",
                stacklevel=3,
            )
        if ambiguous:
            desc = ", ".join(f"{n} -> {'Newton-Schulz' if m else 'AdamW'}" for n, m in ambiguous[:4])
            warnings.warn(
                f"Muon: guessed from names only, and the names are ambiguous: {desc}"
                f"{' ...' if len(ambiguous) > 4 else ''}. Say it explicitly: a param group with use_muon=False "
                "(embeddings, output head) / use_muon=True (hidden matrices), or Muon.rule(embedding_and_head=[...])",
                stacklevel=3,
            )
        opts = {k: v for k, v in param_group.items() if k not in ("params", "param_names")}
        get = lambda k: opts.get(k, self.defaults[k])  # noqa: E731
        if "betas" in opts:
            warnings.warn(
                "Muon: 'betas' ignored in a param group without use_muon (Muon has no betas); its AdamW part "
                "takes adamw_betas: set adamw_betas in the group, or pass a use_muon=False group",
                stacklevel=3,
            )
        # A group's weight_decay is its AdamW part's too, unless the group sets adamw_weight_decay, so
        # param_groups(model, weight_decay=...) decays as on AdamW (docs/muon.md, "Weight decay in groups").
        adamw_wd = opts.get("adamw_weight_decay", opts.get("weight_decay", self.defaults["adamw_weight_decay"]))
        if muon or not adamw:
            self._add_split_group({"params": muon, "use_muon": True, **{k: get(k) for k in _MUON_KEYS}})
        if adamw:
            # [Note: the AdamW fallback's lr follows Muon's]: the AdamW part is scheduled in Muon's
            # units (its "lr" starts at the Muon part's), and steps with adamw_lr * lr / base_lr.
            lr = {"lr": get("adamw_lr")}
            if get("lr") > 0:
                lr = {"lr": get("lr"), "adamw_lr": get("adamw_lr"), "base_lr": get("lr")}
            self._add_split_group({
                "params": adamw, "use_muon": False, **lr, "betas": tuple(get("adamw_betas")),
                "eps": get("adamw_eps"), "weight_decay": adamw_wd,
            })  # fmt: skip

    def _add_explicit_group(self, param_group: dict[str, Any]) -> None:
        """A group the user (or a copy of our own groups) marked ``use_muon``: fill its defaults."""
        group = dict(param_group)
        use_muon = group["use_muon"]
        if not isinstance(use_muon, bool):
            raise ValueError(f"Muon: use_muon must be True or False, got {use_muon!r}")
        if use_muon:
            ignored = [k for k in group if k in _ADAMW_KEYS or k == "betas"]
            for k in _MUON_KEYS:
                group.setdefault(k, self.defaults[k])
        elif "base_lr" in group:  # a copy of one of our split AdamW parts: lr in Muon's units
            ignored = []
        else:
            ignored = [k for k in group if k in _MUON_KEYS and k not in _ADAMW_GROUP_KEYS]
            for k, dk in _ADAMW_GROUP_KEYS.items():
                if k in group and dk in group:
                    raise ValueError(f"Muon: a use_muon=False group sets both {k} and {dk}; its {k} is AdamW's, "
                                     f"pass only one")  # fmt: skip
                group[k] = group.pop(dk) if dk in group else group.get(k, self.defaults[dk])
            group["betas"] = tuple(group["betas"])
        if ignored:
            warnings.warn(f"Muon: {sorted(ignored)} ignored in a use_muon={use_muon} group (they configure the "
                          f"{'AdamW' if use_muon else 'Muon'} part)", stacklevel=4)  # fmt: skip
            for k in ignored:
                del group[k]
        self._add_split_group(group)

    def _add_split_group(self, group: dict[str, Any]) -> None:
        super().add_param_group(group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            _ns_key(group)  # ValueError for bad orthogonalization settings in the group
        keep = set(_MUON_KEYS) if group["use_muon"] else {"lr", "betas", "eps", "weight_decay", "adamw_lr", "base_lr"}
        keep |= {"params", "param_names", "use_muon", "initial_lr"}
        for k in [k for k in group if k not in keep and (k in self.defaults)]:
            del group[k]
        names = group.get("param_names", [None] * len(group["params"]))
        for name, p in zip(names, group["params"]):
            info = self._info(p, name)
            if group["use_muon"] and not info.spec.is_matrix:
                info = self._as_matrix(info, plain=not isinstance(p, RaggedDTensor))
            if group["use_muon"]:
                self._check_layout(info)
            self._plans[p] = _plan_param(info, use_muon=group["use_muon"])
            self._init_state(p, group["use_muon"])
        self._exchanges = self._tp_exchanges = None

    def _as_matrix(self, info: LocalShard, *, plain: bool) -> LocalShard:
        """A parameter put in a ``use_muon=True`` group whose spec is not a matrix block."""
        if plain and len(info.shape) in (2, 3):
            spec = whole() if len(info.shape) == 2 else expert()
            return info._replace(spec=spec)
        where = ("it is a plain tensor of that shape" if plain else
                 "fully_shard recorded an element-wise spec (the block rule took it for an embedding, a head, a "
                 "bias or a vector)")  # fmt: skip
        raise ValueError(
            f"Muon: parameter {info.fqn or '<unnamed>'} (shape {info.shape}, {info.spec} blocks, world size "
            f"{info.world_size}) is in a use_muon=True group, but {where}; Newton-Schulz needs a whole matrix: "
            "shard with fully_shard(..., blocks=Muon.rule(embedding_and_head=[...])) naming the real embeddings "
            "and head, or move it to a use_muon=False group"
        )

    def _info(self, p: Tensor, name: str | None) -> LocalShard:
        return checked_param_info(
            p, self._rule, optimizer="Muon", blocks="Muon.blocks", name=name or "", whole_blocks=True,
            tp_assembles=tp_assembles,
        )

    @staticmethod
    def _check_layout(info: LocalShard) -> None:
        spec, layout = info.spec, info.layout
        if not spec.is_matrix:
            return
        if info.split:
            unit = spec.split_unit(info.shape)
            ok = all(b % unit == 0 for b in layout.bounds)
            need = "split matrices cut on row boundaries"
        else:
            ok = layout.is_aligned(spec)
            need = f"every {spec} matrix whole on one rank (or a plan that records the split)"
        require_spec(info, ok, optimizer="Muon", need=need, blocks="Muon.blocks")

    def _init_state(self, p: Tensor, use_muon: bool) -> None:
        state = self.state[p]
        if use_muon:
            state.setdefault("momentum_buffer", torch.zeros_like(local_tensor(p), memory_format=torch.preserve_format))
        else:
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            state.setdefault("exp_avg", torch.zeros_like(local_tensor(p), memory_format=torch.preserve_format))
            state.setdefault("exp_avg_sq", torch.zeros_like(local_tensor(p), memory_format=torch.preserve_format))

    def state_shards(self, p: Tensor) -> dict[str, StateShard]:
        """Every state tensor of ``p`` is per element: this rank's range of the flat parameter."""
        info = self._plans[p].info
        shard = per_element(info)
        if self._plans[p].use_muon:
            return {"momentum_buffer": shard}
        return {"exp_avg": shard, "exp_avg_sq": shard}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._exchanges = self._tp_exchanges = None

    # ---- split-matrix exchange plan -------------------------------------------------------
    def _plan_exchanges(self) -> tuple[_Exchange, ...]:
        """One exchange per shard group holding split matrices; owners balanced over its ranks."""
        params = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
        by_group: dict[Any, list[Tensor]] = {}
        for p in params:
            info = self._plans[p].info
            if info.world_size > 1:
                by_group.setdefault((info.mesh, info.mesh_dim), []).append(p)
        return tuple(ex for ps in by_group.values() if (ex := self._plan_exchange(ps)) is not None)

    def _plan_tp_exchanges(self) -> tuple:
        """One exchange per TP group holding TP-sharded matrices here; homes balanced over its TP ranks
        ([Note: Muon under tensor parallelism])."""
        by_group: dict[Any, list] = {}
        for g in self.param_groups:
            for p in g["params"] if g["use_muon"] else ():
                info = self._plans[p].info
                if info.tp is not None and info.local_numel:
                    by_group.setdefault(id(info.tp.group), []).append((p, info))
        out = []
        for items in by_group.values():
            costs = [ns_cost(*info.tp.global_shape) for _, info in items]
            size = items[0][1].tp.size
            homes = assign_owners(costs, [[1] * size] * len(items), [0] * size)
            row_states = [self._tp_row_state(p) for p, _ in items]
            out.append(plan_tp_exchange(items, homes, _low_precision, row_states=row_states, result_dtype=self._tp_result_dtype))
        return tuple(out)

    _tp_result_dtype = torch.bfloat16  # what a TP home sends back for fp32 / fp64 parameters: Newton-Schulz's result

    def _tp_row_state(self, p: Tensor) -> Tensor | None:
        """Per-row state that travels with a TP-sharded matrix to its home and back (Muon: none)."""
        return None

    def _plan_exchange(self, params: list[Tensor]) -> _Exchange | None:
        splits = [(p, m) for p in params for m in self._plans[p].split]
        if not splits:
            return None
        info0 = self._plans[splits[0][0]].info
        w, me = info0.world_size, info0.rank
        loads = [0] * w
        for p in params:
            info = self._plans[p].info
            if info.world_size != w:
                raise ValueError(
                    f"Muon: {info.fqn or '<unnamed>'} is sharded over {info.world_size} ranks and "
                    f"{info0.fqn or '<unnamed>'} over {w} in the same process group; one group has one world size"
                )
            for m in info.spec.matrices(info.shape):
                if not _cut(m, info.layout.bounds):
                    loads[bisect.bisect_right(info.layout.bounds, m[0]) - 1] += ns_cost(m[1], m[2])
        for p, _ in splits:
            if _low_precision(p.dtype) and p.element_size() != 2:
                raise ValueError(
                    f"Muon: {self._plans[p].info.fqn or '<unnamed>'} is a split matrix of dtype {p.dtype}; split "
                    "matrices need fp32, fp64, bf16 or fp16 parameters (low-precision pieces travel in 2-byte slots)"
                )
        pieces = []  # per split matrix: [(rank, a, b)]
        for p, (off, r, c) in splits:
            pieces.append(range_pieces(self._plans[p].info.layout.bounds, off, r * c))
        costs = [ns_cost(m[1], m[2]) for _, m in splits]
        sizes = []
        for pc in pieces:
            row = [0] * w
            for q, a, b in pc:
                row[q] = b - a
            sizes.append(row)
        owners = assign_owners(costs, sizes, loads)
        low = [_low_precision(p.dtype) for p, _ in splits]  # such a piece travels out with its parameter values
        # out: my pieces, ordered by owner, then matrix (back: the same order, n elements each)
        sends, send_sizes, back_recv_sizes, at, back_at = [], [0] * w, [0] * w, 0, 0
        group, g = info0.exchange_group()  # (sizes and buffers in group-rank order: g[coordinate])
        for j in sorted(range(len(splits)), key=lambda j: (g[owners[j]], j)):
            (p, (off, r, c)), mine = splits[j], [x for x in pieces[j] if x[0] == me]
            if mine:
                _, a, b = mine[0]
                n, k = b - a, 1 + low[j]
                sends.append(_SendPiece(p, off + a - self._plans[p].info.start, n, r, c, low[j], at, back_at))
                send_sizes[g[owners[j]]] += k * n
                back_recv_sizes[g[owners[j]]] += n
                at, back_at = at + k * n, back_at + n
        # in: pieces of the matrices I own, ordered by source rank, then matrix (the senders' order)
        entries = sorted((g[q], j, a, b) for j in range(len(splits)) if owners[j] == me for q, a, b in pieces[j])
        recv_sizes, back_send_sizes, at, back_at, by_matrix = [0] * w, [0] * w, 0, 0, {}
        for q, j, a, b in entries:
            n, k = b - a, 1 + low[j]
            by_matrix.setdefault(j, []).append((a, n, at, back_at))
            recv_sizes[q] += k * n
            back_send_sizes[q] += n
            at, back_at = at + k * n, back_at + n
        owned = tuple(
            _Owned(splits[j][0], splits[j][1][1], splits[j][1][2], tuple(sorted(by_matrix[j])), low[j])
            for j in sorted(by_matrix)
        )
        return _Exchange(
            group, splits[0][0].device, tuple(sends), tuple(send_sizes), tuple(recv_sizes),
            tuple(back_send_sizes), tuple(back_recv_sizes), owned, tuple((p, p.dtype) for p, _ in splits),
        )  # fmt: skip

    # ---- step -------------------------------------------------------------------------
    @profiled_step
    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim signature
        """One step: momentum, Newton–Schulz (local, or one exchange pair per shard group with
        split matrices), decoupled weight decay, shape-scaled update; AdamW for the fallback groups."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._exchanges is None or self._tp_exchanges is None or any(
            p.dtype != d for ex in (*self._exchanges, *self._tp_exchanges) for p, d in ex.dtypes
        ):
            self._exchanges = self._plan_exchanges()  # the same split parameters on every rank: all re-plan
            self._tp_exchanges = self._plan_tp_exchanges()
        if self.nonfinite != "ignore" and self._skip_for_nonfinite():
            return loss
        updates = self._momentum_updates()  # (and the AdamW groups' steps)
        if not updates and not self._exchanges and not self._tp_exchanges:
            return loss
        # as torch.optim.Muon: param *= 1 - lr * wd, then param -= adjusted lr * NS(update); weight decay
        # first (Newton-Schulz reads the updates, not the parameters), so each stack's result is added
        # as soon as it exists and only one stack's transients are alive at a time
        for group in self.param_groups:
            params = [p for p in group["params"] if p in updates] if group["use_muon"] else []
            if params and group["weight_decay"] != 0:  # x * 1.0 == x: skipping it changes no bits
                _decay([local_tensor(p) for p in params], 1 - group["lr"] * group["weight_decay"])
        group_of = {p: g for g in self.param_groups if g["use_muon"] for p in g["params"]}
        jobs = self._local_jobs(updates, group_of)
        for ex in self._exchanges:
            self._exchange_out(ex, updates, group_of, jobs)
        for h, full, param, rs in (x for ex in self._tp_exchanges for x in tp_exchange_out(ex, updates, self._tp_row_state)):
            g = group_of[h.param]
            jobs.append(_Job((h.rows, h.cols, *_ns_key(g)), g, 1, h.rows, h.cols, None, 0, full, None, h, param, rs))
        tp_backs = [torch.empty(sum(ex.back_send_sizes), dtype=torch.bfloat16, device=ex.device) for ex in self._tp_exchanges]
        # owned results (or new values), in the receive order
        backs = [torch.empty(sum(ex.back_send_sizes), dtype=torch.bfloat16, device=ex.device) for ex in self._exchanges]
        back_of = {id(om): back for ex, back in zip(self._exchanges, backs) for om in ex.owned}
        back_of.update((id(h), back) for ex, back in zip(self._tp_exchanges, tp_backs) for h in ex.homed)
        for done in self._orthogonalize(jobs):
            adds: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
            for i, res in done:
                job = jobs[i]
                alpha = -adjust_lr(job.group["lr"], job.group["adjust_lr_fn"], job.rows, job.cols)
                if isinstance(job.owned, TPHomed):  # a TP-sharded matrix: its slices go back to their TP ranks
                    tp_write_back(job.owned, res, job.param, alpha, back_of[id(job.owned)], job.row_state)
                    continue
                if job.owned is not None:  # an owned split matrix: its pieces go back to their ranks
                    if job.param is None:  # fp32 / fp64: the result, each rank adds its piece
                        flat = res.reshape(-1)
                    else:  # low precision: torch.optim.Muon's add on the whole matrix; the new values go back
                        job.param.add_(res[0], alpha=alpha)
                        flat = job.param.view(-1)
                    for a, n, _, at in job.owned.pieces:
                        back_of[id(job.owned)][at : at + n].view(flat.dtype).copy_(flat[a : a + n])
                    continue
                dst, src = adds.setdefault(alpha, ([], []))
                if _low_precision(job.dest.dtype):  # matrix by matrix, as torch.optim.Muon adds them
                    dst.extend(job.dest.unbind(0))
                    src.extend(res.unbind(0))
                else:
                    dst.append(job.dest)
                    src.append(res)
            for alpha, (dst, src) in adds.items():
                torch._foreach_add_(dst, src, alpha=alpha)
        for ex, back in zip(self._exchanges, backs):
            self._receive_back(ex, back, updates, group_of)
        for ex, back in zip(self._tp_exchanges, tp_backs):
            alpha_of = lambda s: -adjust_lr(group_of[s.param]["lr"], group_of[s.param]["adjust_lr_fn"], s.rows, s.cols)  # noqa: E731
            tp_receive_back(ex, back, updates, alpha_of, self._tp_row_state)
        return loss

    def _momentum_updates(self) -> dict[Tensor, _Update]:
        """Momentum for every Muon parameter with a gradient (its update, read by Newton–Schulz); the
        AdamW groups take their whole step here."""
        updates: dict[Tensor, _Update] = {}
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group(group)
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("Muon does not support sparse gradients or complex parameters")
            grads = [local_tensor(p.grad) for p in params]
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            mom = group["momentum"]
            torch._foreach_lerp_(bufs, grads, 1 - mom)
            nesterov = mom if group["nesterov"] else None
            updates.update((p, _Update(g.view(-1), b.view(-1), nesterov)) for p, g, b in zip(params, grads, bufs))
        return updates

    def _receive_back(self, ex: Any, back: Tensor, updates: dict[Tensor, _Update], group_of: dict[Tensor, dict]) -> None:
        """The second exchange of split matrices: each rank gets its pieces of NS(matrix) (added with the
        matrix's lr) or, for low-precision matrices, of the owner's new values (copied)."""
        mine = torch.empty(sum(ex.back_recv_sizes), dtype=torch.bfloat16, device=ex.device)
        dist.all_to_all_single(mine, back, list(ex.back_recv_sizes), list(ex.back_send_sizes), group=ex.group)
        adds: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
        for sp in ex.sends:  # my pieces of NS(split matrix), or of the new parameter values
            if sp.param not in updates:
                continue
            dst = local_tensor(sp.param).view(-1)[sp.local_offset : sp.local_offset + sp.n]
            got = mine[sp.back_at : sp.back_at + sp.n]
            if sp.with_param:
                dst.copy_(got.view(dst.dtype))
                continue
            g = group_of[sp.param]
            alpha = -adjust_lr(g["lr"], g["adjust_lr_fn"], sp.rows, sp.cols)
            dsts, srcs = adds.setdefault(alpha, ([], []))
            dsts.append(dst)
            srcs.append(got)
        for alpha, (dsts, srcs) in adds.items():
            torch._foreach_add_(dsts, srcs, alpha=alpha)

    def _local_jobs(self, updates: dict[Tensor, _Update], group_of: dict[Tensor, dict]) -> list[_Job]:
        """The matrices lying wholly in this rank's pieces (their updates are computed when used)."""
        jobs = []
        for p, upd in updates.items():
            g = group_of[p]
            key = _ns_key(g)
            flat = local_tensor(p).view(-1)
            for run in self._plans[p].runs:
                rc = run.rows * run.cols
                stack = self.batched and _stacks_well(run.rows, run.cols, p.device)
                per = max(1, _STACK_NUMEL // rc) if stack else 1  # else one matrix a job, torch's 2-D ops
                for i in range(0, run.count, per):  # runs longer than a stack: several jobs
                    k = min(per, run.count - i)
                    lo = run.local_offset + i * rc
                    shape = (k, run.rows, run.cols)
                    jobs.append(_Job((run.rows, run.cols, *key), g, k, run.rows, run.cols, upd, lo, None,
                                     flat[lo : lo + k * rc].view(shape), None))  # fmt: skip
        return jobs

    def _orthogonalize(self, jobs: list[_Job]) -> Iterator[list[tuple[int, Tensor]]]:
        """Newton–Schulz of every job, yielded stack by stack as ``[(job index, [count, rows, cols]
        bf16 result)]``. Batched: one
        chain per stack of same-key matrices; otherwise torch.optim.Muon's 2-D ops, matrix by matrix."""
        by_key: dict[tuple, list[int]] = {}
        for i, job in enumerate(jobs):
            if self.batched and _stacks_well(job.rows, job.cols, job.device):
                by_key.setdefault(job.key, []).append(i)
                continue
            if job.count != 1:
                raise AssertionError(f"Muon: a per-matrix job holds {job.count} matrices")
            yield [(i, self._run(job.matrices()[0], job.key).unsqueeze(0))]
        for key, idx in by_key.items():
            rows, cols = key[:2]
            chunk: list[int] = []
            for n, i in enumerate(idx):
                chunk.append(i)
                total = sum(jobs[j].count for j in chunk)
                if n + 1 < len(idx) and (total + jobs[idx[n + 1]].count) * rows * cols <= _STACK_NUMEL:
                    continue
                stack = torch.empty(total, rows, cols, dtype=torch.bfloat16, device=jobs[chunk[0]].device)
                pos = 0
                for j in chunk:
                    stack[pos : pos + jobs[j].count].copy_(jobs[j].matrices())  # the cast NS starts with
                    pos += jobs[j].count
                res = self._run(stack, key)
                del stack
                done, pos = [], 0
                for j in chunk:
                    done.append((j, res[pos : pos + jobs[j].count]))
                    pos += jobs[j].count
                yield done
                chunk = []

    def _run(self, x: Tensor, key: tuple) -> Tensor:
        """Orthogonalize ``x`` with a job key's settings ``(rows, cols, method, coefficients, eps)``."""
        _, _, method, coefficients, eps = key
        if method == "newton_schulz":
            return newton_schulz(x, coefficients=coefficients, eps=eps)
        return gram_newton_schulz(x, coefficients=coefficients, eps=eps, dtype=self.gram_dtype)

    def _exchange_out(
        self, ex: _Exchange, updates: dict[Tensor, _Update], group_of: dict[Tensor, dict], jobs: list[_Job]
    ) -> None:
        """First all_to_all: my pieces of split matrices to their owners (bf16: Newton–Schulz's first
        op is the same cast), low-precision ones followed by the (weight-decayed) parameter piece, bit
        for bit; appends one job per matrix I own, assembled from the pieces."""
        send = torch.empty(sum(ex.send_sizes), dtype=torch.bfloat16, device=ex.device)
        for sp in ex.sends:
            u = updates.get(sp.param)
            lo, hi = sp.local_offset, sp.local_offset + sp.n
            piece = send[sp.at : sp.at + sp.n]
            if u is None:  # no gradient here: take part in the exchange, contribute zeros
                piece.zero_()
            else:
                piece.copy_(u.piece(lo, hi))
            if sp.with_param:
                send[sp.at + sp.n : sp.at + 2 * sp.n].view(sp.param.dtype).copy_(local_tensor(sp.param).view(-1)[lo:hi])
        recv = torch.empty(sum(ex.recv_sizes), dtype=torch.bfloat16, device=ex.device)
        dist.all_to_all_single(recv, send, list(ex.recv_sizes), list(ex.send_sizes), group=ex.group)
        for om in ex.owned:
            full = torch.empty(om.rows * om.cols, dtype=torch.bfloat16, device=ex.device)
            param = torch.empty(om.rows * om.cols, dtype=om.param.dtype, device=ex.device) if om.with_param else None
            for a, n, at, _ in om.pieces:
                full[a : a + n].copy_(recv[at : at + n])
                if param is not None:
                    param[a : a + n].copy_(recv[at + n : at + 2 * n].view(param.dtype))
            g = group_of[om.param]
            key = (om.rows, om.cols, *_ns_key(g))
            jobs.append(_Job(key, g, 1, om.rows, om.cols, None, 0, full.view(1, om.rows, om.cols), None, om,
                             None if param is None else param.view(om.rows, om.cols)))  # fmt: skip

    # ---- non-finite gradients ------------------------------------------------------------
    def _skip_for_nonfinite(self) -> bool:
        """Find parameters with a non-finite gradient, agreed over every shard group (one all_reduce
        of one flag per parameter each), before anything changes; raise or skip on every rank."""
        params = [p for g in self.param_groups for p in g["params"]]
        with_grad = [(i, p) for i, p in enumerate(params) if p.grad is not None and local_tensor(p.grad).numel()]
        device = params[0].device if params else torch.device("cpu")
        flags = torch.zeros(len(params), dtype=torch.int32, device=device)
        if with_grad:
            norms = torch._foreach_norm([local_tensor(p.grad) for _, p in with_grad], float("inf"))  # NaN/inf survive max|g|
            idx = torch.tensor([i for i, _ in with_grad], device=device)
            flags[idx] = (~torch.isfinite(torch.stack(norms))).int()
        rank = dist.get_rank() if dist.is_initialized() else 0
        flags *= rank + 1  # after MAX: the highest rank that saw it
        groups: list[Any] = []  # every mesh dim: the shard group, and TP ranks must skip alike too
        for p in params:
            if isinstance(p, RaggedDTensor):
                mesh = p.device_mesh
                for d in range(mesh.ndim):
                    if mesh.size(d) > 1 and not any(mesh.get_group(d) is g for g in groups):
                        groups.append(mesh.get_group(d))
        for g in groups:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=g)
        bad = [(params[i], r - 1) for i, r in enumerate(flags.tolist()) if r]
        if not bad:
            return False
        names = [self._name(p) for p, _ in bad]
        desc = ", ".join(f"{n} (shape {self._plans[p].info.shape}, rank {r})" for n, (p, r) in zip(names[:4], bad))
        desc += f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        if self.nonfinite == "error":
            raise FloatingPointError(
                f"Muon: non-finite gradient in {desc}; every rank raises this before changing anything. "
                "Pass Muon(..., nonfinite='skip') to skip such steps on every rank, or find the cause "
                "(learning rate, loss scale, data)"
            )
        self.num_skipped_steps += 1
        warnings.warn(f"Muon: step skipped on every rank: non-finite gradient in {desc}", stacklevel=3)
        return True

    def _name(self, p: Tensor) -> str:
        if self._plans[p].info.fqn:
            return self._plans[p].info.fqn
        for g in self.param_groups:
            for i, q in enumerate(g["params"]):
                if q is p:
                    names = g.get("param_names")
                    return names[i] if names else f"<unnamed parameter {i} of group {self.param_groups.index(g)}>"
        return "<unnamed>"

    def _adamw_group(self, group: dict[str, Any]) -> None:
        """The element-wise AdamW fallback: torch.optim.AdamW's math on local pieces (``adamw_update``)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon's AdamW fallback does not support sparse gradients")
            st = self.state[p]
            params.append(local_tensor(p))
            grads.append(local_tensor(p.grad))
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw_update(
            params, grads, exp_avgs, exp_avg_sqs, steps,
            lr=adamw_lr(group), beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
        )  # fmt: skip
