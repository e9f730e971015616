"""Muon on block-aligned shards: Newton–Schulz on whole local matrices, AdamW for the rest.

[Note: Muon on shards]
Muon's update of a matrix is ``NS(momentum-updated gradient)``, a function of the *whole*
matrix. The spec recorded on each parameter (``ShardInfo.spec``) says what a matrix is:
``whole()`` (the parameter), ``whole(row_splits=...)`` (per-head / fused-QKV sub-matrices,
each orthogonalized on its own) and ``expert()`` (``[E, r, c]``: E matrices, one batched
Newton–Schulz). Every other parameter (embeddings, output head, norms, biases: specs that are
not matrix blocks) goes to the AdamW fallback, which is element-wise and hence exact on any shard.

Everything but Newton–Schulz is element-wise (momentum ``lerp``, weight decay, the final
``add``), so each rank applies it to its own flat piece. Newton–Schulz runs where the matrix is:
- a matrix lying wholly in this rank's range (what ragged plans give every matrix) is
  orthogonalized locally: no communication;
- a matrix the planner had to cut (``ShardInfo.split``; cut on row boundaries) is sent to one
  *owner* rank, orthogonalized there and its pieces sent back: per bucket with split matrices
  exactly one ``all_to_all_single`` pair, every rank taking part (empty pieces included), buckets
  in ascending order. Owners are fixed at construction by a longest-first assignment on
  Newton–Schulz flops over all ranks, starting from each rank's whole-matrix load.

Both exchanges carry bf16: torch.optim.Muon casts the update to bf16 as the first thing Newton–
Schulz does, and its output is bf16, so the exchange is exact and a split matrix gets the same bits
as one owned whole. Newton–Schulz here uses the same ops, in the same order and on the same
layouts, as ``torch.optim._muon._zeropower_via_newtonschulz`` (torch 2.13), so a sharded run equals
``torch.optim.Muon`` bitwise on CPU (tested; the batched form for experts / heads uses
``baddbmm``, which matched ``addmm`` per matrix bitwise on the CPUs tested here).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..sharding._blocks import BlockRule
from ..sharding._shard_info import ShardInfo, shard_info
from ._adamw import adamw_update
from ._base import StateShard, checked_param_info, make_dcp_ready, require_spec
from ._rules import is_embedding_or_head, muon_rule

__all__ = ["Muon", "newton_schulz", "adjust_lr"]

# torch.optim._muon (from Keller Jordan's Muon post, https://kellerjordan.github.io/posts/muon/).
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_EPS = 1e-7

_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
_ADAMW_KEYS = ("adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay")


# ---- math (pure) ----------------------------------------------------------------------
def newton_schulz(
    g: Tensor,
    *,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """bf16 quintic Newton–Schulz orthogonalization of a matrix ``[r, c]`` or a batch ``[n, r, c]``.

    The same ops and layouts as torch.optim.Muon (transpose tall matrices, divide by the
    Frobenius norm clamped at ``eps``, ``steps`` iterations of ``X <- aX + (bA + cA^2)X`` with
    ``A = XX^T``), so the same input gives the same bits. ``g`` is not modified.
    """
    if g.ndim not in (2, 3):
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    if steps >= 100:
        raise ValueError(f"ns_steps must be < 100, got {steps}")
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x.div(x.norm().clamp(min=eps))  # out of place: g may already be bf16
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        x = x.div(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


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


def _ns_cost(rows: int, cols: int) -> int:
    """Newton–Schulz flops per iteration of one matrix (``4 m^2 n + 2 m^3``, ``m <= n``)."""
    m, n = min(rows, cols), max(rows, cols)
    return 2 * m * m * (2 * n + m)


def assign_owners(
    costs: Sequence[int], piece_sizes: Sequence[Sequence[int]], initial_loads: Sequence[int]
) -> list[int]:
    """Owner rank per split matrix: longest-first onto the least-loaded rank.

    ``costs[j]``: matrix j's Newton–Schulz cost; ``piece_sizes[j][r]``: elements of it rank r
    holds; ``initial_loads[r]``: the cost of the matrices rank r owns whole. Ties go to the rank
    holding more of the matrix (less traffic), then to the lower rank. Deterministic (pure).
    """
    loads = list(initial_loads)
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        best = min(range(len(loads)), key=lambda r: (loads[r], -piece_sizes[j][r], r))
        owners[j] = best
        loads[best] += costs[j]
    return owners


# ---- plan of one parameter / one bucket ---------------------------------------------------
class _Run(NamedTuple):
    """``count`` consecutive ``[rows, cols]`` matrices at ``local_offset`` of this rank's piece."""

    local_offset: int
    count: int
    rows: int
    cols: int


class _ParamPlan(NamedTuple):
    info: ShardInfo
    use_muon: bool
    runs: tuple[_Run, ...]
    """Matrices lying wholly in this rank's piece, grouped for batched Newton–Schulz."""
    split: tuple[tuple[int, int, int], ...]
    """Matrices ``(global_offset, rows, cols)`` cut across ranks."""


class _SplitMatrix(NamedTuple):
    param: Tensor
    offset: int
    rows: int
    cols: int
    pieces: tuple[tuple[int, int], ...]
    """Per rank ``[a, b)``: the part of the matrix (matrix-local flat offsets) the rank holds."""
    owner: int


class _Exchange(NamedTuple):
    bucket: int
    group: dist.ProcessGroup | None
    matrices: tuple[_SplitMatrix, ...]


def _cut(m: tuple[int, int, int], bounds: Sequence[int]) -> bool:
    return any(m[0] < b < m[0] + m[1] * m[2] for b in bounds[1:-1])


def _plan_param(info: ShardInfo, *, use_muon: bool) -> _ParamPlan:
    if not use_muon:
        return _ParamPlan(info, False, (), ())
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
class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices, AdamW for the rest, on sharded or plain parameters.

    Equals ``torch.optim.Muon`` (matrices) + ``torch.optim.AdamW`` (the rest) run unsharded on
    the same gradients. Which parameters are matrices is read from each parameter's block spec
    (see [Note: Muon on shards]); pass ``Muon.blocks`` (or ``Muon.rule(head_dims=...,
    row_splits=...)``) to ``fully_shard(..., blocks=...)``. Plain (unsharded) parameters get their
    spec from ``blocks``; pass ``model.named_parameters()`` so that embeddings and the output
    head are recognised by name.

    Each parameter group is split into a Muon group (``group["use_muon"] is True``: ``lr``,
    ``weight_decay``, ``momentum``, ...) and an AdamW group (``lr`` = ``adamw_lr``, ``betas``,
    ``eps``, ``weight_decay``), so LR schedulers scale both. Defaults are torch.optim.Muon's and
    torch.optim.AdamW's.

    ``lr``, ``weight_decay`` (decoupled, ``param *= 1 - lr * wd``), ``momentum``, ``nesterov``,
    ``ns_coefficients``, ``eps``, ``ns_steps``, ``adjust_lr_fn``: as torch.optim.Muon, except that the
    shape-based LR adjustment uses each sub-matrix's shape (a head ``[head_dim, cols]``, a fused-QKV
    part, an expert ``[r, c]``), which is torch.optim.Muon applied to that sub-matrix.
    ``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``: the AdamW fallback.
    ``blocks``: the rule giving plain parameters their spec (default ``Muon.blocks``).
    """

    blocks = staticmethod(muon_rule())

    @classmethod
    def rule(
        cls, *, head_dims: dict[str, int] | None = None, row_splits: dict[str, Sequence[int]] | None = None
    ) -> BlockRule:
        """The block rule for ``fully_shard``: per-head (``head_dims``) and fused-QKV (``row_splits``)
        sub-matrices by parameter-name suffix; see ``muon_rule``."""
        return muon_rule(head_dims=head_dims, row_splits=row_splits)

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
        self._rule: BlockRule = blocks if blocks is not None else Muon.blocks
        self._plans: dict[Tensor, _ParamPlan] = {}
        self._exchanges: tuple[_Exchange, ...] | None = None
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay, use_muon=True,
        )  # fmt: skip
        super().__init__(params, defaults)
        if blocks is not None and self._plans and all(shard_info(t) is not None for t in self._plans):
            warnings.warn("Muon: blocks= is ignored: every parameter is sharded and its recorded spec is used",
                          stacklevel=2)  # fmt: skip
        self._exchanges = self._plan_exchanges()
        make_dcp_ready(self)

    # ---- groups and state ---------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Split ``param_group`` into its Muon part and its AdamW part (see the class docstring)."""
        if "use_muon" in param_group:  # an already split group (load_state_dict, copies)
            self._add_split_group(param_group)
            return
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        named = [x if isinstance(x, tuple) else (None, x) for x in params]
        muon, adamw, unexpected, unnamed = [], [], [], 0
        for name, p in named:
            info = self._info(p, name)
            (muon if info.spec.is_matrix else adamw).append((name, p) if name is not None else p)
            unnamed += shard_info(p) is None and name is None and info.spec.is_matrix
            if shard_info(p) is not None and not info.spec.is_matrix and len(info.shape) in (2, 3):
                if not is_embedding_or_head(info.fqn, None):
                    unexpected.append(info.fqn or f"<shape {info.shape}>")
        if unexpected:
            warnings.warn(
                f"Muon: {len(unexpected)} sharded matrix parameter(s) (e.g. {unexpected[0]}) carry element-wise "
                "blocks and get the AdamW fallback; shard with fully_shard(..., blocks=Muon.blocks) to "
                "orthogonalize them",
                stacklevel=3,
            )
        if unnamed:
            warnings.warn(
                f"Muon: {unnamed} plain (unsharded) matrix parameter(s) came without names, so embeddings and "
                "the output head cannot be told apart and every matrix gets Newton-Schulz; pass "
                "model.named_parameters() (or shard with fully_shard) to give embeddings and the head AdamW",
                stacklevel=3,
            )
        opts = {k: v for k, v in param_group.items() if k != "params"}
        get = lambda k: opts.get(k, self.defaults[k])  # noqa: E731
        if muon or not adamw:
            self._add_split_group({"params": muon, "use_muon": True, **{k: get(k) for k in _MUON_KEYS}})
        if adamw:
            self._add_split_group({
                "params": adamw, "use_muon": False, "lr": get("adamw_lr"), "betas": tuple(get("adamw_betas")),
                "eps": get("adamw_eps"), "weight_decay": get("adamw_weight_decay"),
            })  # fmt: skip

    def _add_split_group(self, group: dict[str, Any]) -> None:
        super().add_param_group(group)
        group = self.param_groups[-1]
        keep = set(_MUON_KEYS) if group["use_muon"] else {"lr", "betas", "eps", "weight_decay"}
        keep |= {"params", "param_names", "use_muon", "initial_lr"}
        for k in [k for k in group if k not in keep and (k in self.defaults)]:
            del group[k]
        names = group.get("param_names", [None] * len(group["params"]))
        for name, p in zip(names, group["params"]):
            info = self._info(p, name)
            if group["use_muon"] != info.spec.is_matrix:
                raise ValueError(
                    f"Muon: parameter {info.fqn or '<unnamed>'} with {info.spec} blocks cannot be in a "
                    f"group with use_muon={group['use_muon']}"
                )
            self._check_layout(info)
            self._plans[p] = _plan_param(info, use_muon=group["use_muon"])
            self._init_state(p, group["use_muon"])
        self._exchanges = None

    def _info(self, p: Tensor, name: str | None) -> ShardInfo:
        return checked_param_info(
            p, self._rule, optimizer="Muon", blocks="Muon.blocks", name=name or "", whole_blocks=True
        )

    @staticmethod
    def _check_layout(info: ShardInfo) -> None:
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
            state.setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))
        else:
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            state.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
            state.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))

    def state_shards(self, p: Tensor) -> dict[str, StateShard]:
        """Every state tensor of ``p`` is per element: this rank's range of the flat parameter."""
        info = self._plans[p].info
        shard = StateShard(info.numel, info.start, info.end)
        if self._plans[p].use_muon:
            return {"momentum_buffer": shard}
        return {"exp_avg": shard, "exp_avg_sq": shard}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._exchanges = None

    # ---- split-matrix exchange plan -------------------------------------------------------
    def _plan_exchanges(self) -> tuple[_Exchange, ...]:
        """One exchange per bucket holding split matrices; owners balanced over all ranks."""
        params = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
        splits = [(p, m) for p in params for m in self._plans[p].split]
        if not splits:
            return ()
        w = self._plans[splits[0][0]].info.world_size
        loads = [0] * w
        for p in params:
            info = self._plans[p].info
            if info.world_size != w:
                continue
            for m in info.spec.matrices(info.shape):
                if not _cut(m, info.layout.bounds):
                    owner = next(r for r in range(w) if info.layout.bounds[r + 1] > m[0])
                    loads[owner] += _ns_cost(m[1], m[2])
        pieces = []
        for p, (off, r, c) in splits:
            info = self._plans[p].info
            if info.world_size != w:
                raise ValueError(
                    f"Muon: split matrices of {info.fqn or '<unnamed>'} live on a group of {info.world_size} "
                    f"ranks, others on {w}; all split matrices must share one shard group"
                )
            b = info.layout.bounds
            pieces.append(tuple((min(max(b[q] - off, 0), r * c), min(max(b[q + 1] - off, 0), r * c)) for q in range(w)))
        costs = [_ns_cost(m[1], m[2]) for _, m in splits]
        owners = assign_owners(costs, [[e - s for s, e in pc] for pc in pieces], loads)
        by_bucket: dict[int, list[_SplitMatrix]] = {}
        groups: dict[int, dist.ProcessGroup | None] = {}
        for (p, (off, r, c)), pc, o in zip(splits, pieces, owners):
            info = self._plans[p].info
            by_bucket.setdefault(info.bucket, []).append(_SplitMatrix(p, off, r, c, pc, o))
            groups.setdefault(info.bucket, info.group)
        return tuple(_Exchange(b, groups[b], tuple(by_bucket[b])) for b in sorted(by_bucket))

    # ---- step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim signature
        """One step: momentum, Newton–Schulz (local, or one exchange pair per bucket with split
        matrices), decoupled weight decay, shape-scaled update; AdamW for the fallback groups."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._exchanges is None:
            self._exchanges = self._plan_exchanges()
        group_of: dict[Tensor, dict[str, Any]] = {}
        updates: dict[Tensor, Tensor] = {}
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group(group)
                continue
            mom = group["momentum"]
            for p in group["params"]:
                group_of[p] = group
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("Muon does not support sparse gradients or complex parameters")
                buf = self.state[p]["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                updates[p] = p.grad.lerp(buf, mom) if group["nesterov"] else buf
        split_results = self._exchange_all(updates, group_of)
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            lr, fn = group["lr"], group["adjust_lr_fn"]
            ns = dict(coefficients=group["ns_coefficients"], steps=group["ns_steps"], eps=group["eps"])
            for p in group["params"]:
                if p not in updates:
                    continue
                plan = self._plans[p]
                upd = updates[p].reshape(-1)
                flat = p.view(-1)
                p.mul_(1 - lr * group["weight_decay"])
                for run in plan.runs:
                    n = run.count * run.rows * run.cols
                    g = upd[run.local_offset : run.local_offset + n]
                    g = g.view(run.rows, run.cols) if run.count == 1 else g.view(run.count, run.rows, run.cols)
                    o = newton_schulz(g, **ns)
                    flat[run.local_offset : run.local_offset + n].add_(
                        o.reshape(-1), alpha=-adjust_lr(lr, fn, run.rows, run.cols)
                    )
                for (off, r, c), (a, piece) in split_results.get(p, {}).items():
                    lo = off + a - plan.info.start
                    flat[lo : lo + piece.numel()].add_(piece, alpha=-adjust_lr(lr, fn, r, c))
        return loss

    def _exchange_all(
        self, updates: dict[Tensor, Tensor], group_of: dict[Tensor, dict[str, Any]]
    ) -> dict[Tensor, dict[tuple[int, int, int], tuple[int, Tensor]]]:
        """Newton–Schulz of every split matrix: per bucket one all_to_all_single to the owners and
        one back. Returns, per parameter and split matrix, ``(a, this rank's piece of NS(update))``."""
        out: dict[Tensor, dict[tuple[int, int, int], tuple[int, Tensor]]] = {}
        for ex in self._exchanges:
            info0 = self._plans[ex.matrices[0].param].info
            me, w = info0.rank, info0.world_size
            mine = [sm for sm in ex.matrices if sm.owner == me]
            # 1. my pieces to their owners (bf16: Newton–Schulz's first op is the same cast)
            send, send_sizes = [], [0] * w
            for q in range(w):
                for sm in ex.matrices:
                    if sm.owner != q:
                        continue
                    a, b = sm.pieces[me]
                    if b > a:
                        send.append(self._local_update(sm, a, b, updates))
                        send_sizes[q] += b - a
            recv_sizes = [sum(sm.pieces[q][1] - sm.pieces[q][0] for sm in mine) for q in range(w)]
            recv = torch.empty(sum(recv_sizes), dtype=torch.bfloat16, device=self._device(ex))
            dist.all_to_all_single(recv, self._cat(send, ex), recv_sizes, send_sizes, group=ex.group)
            # 2. assemble and orthogonalize the matrices I own
            parts: dict[int, list[Tensor]] = {i: [] for i in range(len(mine))}
            pos = 0
            for q in range(w):
                for i, sm in enumerate(mine):
                    n = sm.pieces[q][1] - sm.pieces[q][0]
                    if n:
                        parts[i].append(recv[pos : pos + n])
                        pos += n
            results = []
            for i, sm in enumerate(mine):
                g = group_of[sm.param]
                full = torch.cat(parts[i]).view(sm.rows, sm.cols)
                o = newton_schulz(full, coefficients=g["ns_coefficients"], steps=g["ns_steps"], eps=g["eps"])
                results.append(o.reshape(-1))
            # 3. pieces of the results back to the ranks holding them
            send, send_sizes = [], [0] * w
            for q in range(w):
                for i, sm in enumerate(mine):
                    a, b = sm.pieces[q]
                    if b > a:
                        send.append(results[i][a:b])
                        send_sizes[q] += b - a
            recv_sizes = [0] * w
            for sm in ex.matrices:
                a, b = sm.pieces[me]
                recv_sizes[sm.owner] += b - a
            recv = torch.empty(sum(recv_sizes), dtype=torch.bfloat16, device=self._device(ex))
            dist.all_to_all_single(recv, self._cat(send, ex), recv_sizes, send_sizes, group=ex.group)
            offsets = [sum(recv_sizes[:q]) for q in range(w)]
            for sm in ex.matrices:
                a, b = sm.pieces[me]
                if b > a:
                    q = sm.owner
                    piece = recv[offsets[q] : offsets[q] + b - a]
                    out.setdefault(sm.param, {})[(sm.offset, sm.rows, sm.cols)] = (a, piece)
                    offsets[q] += b - a
        return out

    def _local_update(self, sm: _SplitMatrix, a: int, b: int, updates: dict[Tensor, Tensor]) -> Tensor:
        lo = sm.offset + a - self._plans[sm.param].info.start
        u = updates.get(sm.param)
        if u is None:  # no gradient here: take part in the exchange, contribute zeros
            return torch.zeros(b - a, dtype=torch.bfloat16, device=sm.param.device)
        return u.reshape(-1)[lo : lo + b - a].bfloat16()

    def _device(self, ex: _Exchange) -> torch.device:
        return ex.matrices[0].param.device

    def _cat(self, chunks: list[Tensor], ex: _Exchange) -> Tensor:
        if not chunks:
            return torch.empty(0, dtype=torch.bfloat16, device=self._device(ex))
        return torch.cat(chunks)

    def _adamw_group(self, group: dict[str, Any]) -> None:
        """The element-wise AdamW fallback: torch.optim.AdamW's math on local pieces (``adamw_update``)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon's AdamW fallback does not support sparse gradients")
            st = self.state[p]
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw_update(
            params, grads, exp_avgs, exp_avg_sqs, steps,
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
        )  # fmt: skip
