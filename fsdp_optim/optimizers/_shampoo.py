"""Blocked Shampoo on block-aligned shards: every preconditioner block lives on one rank.

[Note: Shampoo blocks]
Blocks are defined on the *global* tensor, never on a shard, so they are the same for every
world size and plan. A parameter is viewed as a matrix ``[R, C]`` (``R = shape[0]``,
``C = prod(shape[1:])``); its rows are cut into strips of ``k = max_preconditioner_dim`` rows
(the ``rows(k)`` block spec, which the planner keeps whole) and each strip into ``k``-column
blocks (the last strip / column block may be smaller). A block ``G`` (``r x c``) has a left factor
``L`` (``r x r``, EMA of ``G G^T``) and a right factor ``R`` (``c x c``, EMA of ``G^T G``) and is
preconditioned as ``L^{-1/4} G R^{-1/4}``. 1-D tensors (and scalars) are cut into ``k``-element
blocks with one factor (``L``, EMA of ``g g^T``) and ``L^{-1/2} g``. A 3-D weight sharded with
``expert()`` blocks (``Shampoo.rule(per_expert=True)``) is E matrices ``[r, c]``, each blocked as
above. ``exponent_override`` replaces the root (4 for two factors, 2 for one; facebookresearch/
optimizers' ``inv_root_override``).

[Note: Shampoo step]
Per step ``t`` (1-based) and block, modelled on facebookresearch/optimizers' DistributedShampoo
(arXiv:2309.06497; not tested against it, which is not installed here: the tests check W-invariance
and a float64 re-derivation of these formulas):
1. factors from the raw gradient: ``L <- beta2 L + (1 - beta2) G G^T`` (``beta2 == 1``: a sum);
   Adam grafting state ``v <- gb2 v + (1 - gb2) g^2``;
2. inverse roots at ``t == start_preconditioning_step`` and at ``t > start`` with
   ``t % precondition_frequency == 0``: ``(L / (1 - beta2^t) + eps I)^{-1/root}`` by ``eigh``
   in float64 (eigenvalues clamped at 0, then ``+ epsilon``); stored in fp32;
3. filtered gradient ``m <- beta1 m + (1 - beta1) g``, ``gbar = m / (1 - beta1^t)`` (beta1 > 0);
4. grafting direction ``A = gbar / (sqrt(v / (1 - gb2^t)) + grafting_epsilon)``; before
   ``start_preconditioning_step`` the search direction is ``A``; from then on it is
   ``P = L^{-1/4} gbar R^{-1/4}`` rescaled to ``||A_block|| / (||P|| + 1e-16)`` per block;
5. decoupled weight decay ``D <- D + weight_decay * param``; momentum ``M <- mu M + D``,
   ``D <- M`` (or ``D + mu M``, Nesterov); ``param <- param - lr D``.

Why float64 for ``eigh``: the EMA of ``G G^T`` is rank-deficient early in training and its
eigenvalues span many orders of magnitude; fp32 ``eigh`` has an absolute eigenvalue error of about
``1e-7 * lambda_max``, far above the default ``epsilon = 1e-12``, so small eigenvalues (whose
``-1/4`` powers dominate the root) would be noise. float64 brings that to ``~1e-16 lambda_max``.
The cost is amortized over ``precondition_frequency`` steps; factors and roots stay fp32.

Every per-block computation runs on contiguous copies of the block, with the same ops whatever
the shard, and the per-element ones are element-wise, so a sharded run equals the single-process
run bitwise. The step issues no collectives.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..sharding._blocks import BlockKind, BlockRule, BlockSpec
from ..sharding._shard_info import ShardInfo, shard_info
from ._base import StateShard, checked_param_info, make_dcp_ready, require_spec
from ._rules import shampoo_rule

__all__ = ["Shampoo", "shampoo_blocks", "matrix_inverse_root"]

_GRAFT_NORM_EPS = 1e-16  # facebookresearch/optimizers adds 1e-16 to the Shampoo norm when grafting


# ---- block geometry (pure) ----------------------------------------------------------------
class BlockGeometry(NamedTuple):
    """How one parameter is blocked (see [Note: Shampoo blocks]): ``num_matrices`` stacked
    ``[rows, cols]`` matrices, each cut into ``k``-row strips and each strip into ``k``-column blocks."""

    num_matrices: int
    rows: int
    """Rows of each matrix (1-D tensors: their number of elements)."""
    cols: int
    """Columns (1-D tensors: 1)."""
    k: int
    one_factor: bool
    """1-D tensors (and scalars): only a left factor."""

    @property
    def strips_per_matrix(self) -> int:
        return -(-self.rows // self.k)

    @property
    def num_strips(self) -> int:
        return self.num_matrices * self.strips_per_matrix

    def strip_rows(self, i: int) -> int:
        return min(self.k, self.rows - (i % self.strips_per_matrix) * self.k)

    def strip_start_row(self, i: int) -> int:
        """First row of strip ``i`` in the stacked ``[num_matrices * rows, cols]`` view."""
        spm = self.strips_per_matrix
        return (i // spm) * self.rows + (i % spm) * self.k

    def strip_at(self, offset: int) -> int:
        """Index of the strip starting at flat ``offset`` (``num_strips`` at the end)."""
        mat = self.rows * self.cols
        if offset >= self.num_matrices * mat:
            return self.num_strips
        e, rem = divmod(offset, mat)
        return e * self.strips_per_matrix + -(-rem // (self.k * self.cols))

    def is_strip_boundary(self, offset: int) -> bool:
        mat = self.rows * self.cols
        return offset >= self.num_matrices * mat or (offset % mat) % (self.k * self.cols) == 0

    @property
    def col_widths(self) -> list[int]:
        if self.one_factor:
            return [1]
        return [min(self.k, self.cols - j * self.k) for j in range(-(-self.cols // self.k))]

    def left_numel(self, s0: int, s1: int) -> int:
        """Elements of the left factors of strips ``[s0, s1)`` (one ``r x r`` factor per block)."""
        nb = len(self.col_widths)
        return sum(nb * self.strip_rows(i) ** 2 for i in range(s0, s1))

    def right_numel(self, s0: int, s1: int) -> int:
        return 0 if self.one_factor else (s1 - s0) * sum(c * c for c in self.col_widths)


def shampoo_blocks(shape: tuple[int, ...], k: int, spec: BlockSpec | None = None) -> BlockGeometry:
    """The block geometry of a tensor of global ``shape`` with ``max_preconditioner_dim = k``:
    ``expert()`` 3-D tensors are E matrices ``[r, c]``; others one matrix ``[shape[0], rest]``."""
    if spec is not None and spec.kind is BlockKind.EXPERT and len(shape) == 3:
        return BlockGeometry(shape[0], shape[1], shape[2], k, False)
    if len(shape) <= 1:
        return BlockGeometry(1, math.prod(shape), 1, k, True)
    return BlockGeometry(1, shape[0], math.prod(shape[1:]), k, False)


class _Block(NamedTuple):
    row0: int
    """First row in this rank's local ``[rows, cols]`` view."""
    rows: int
    col0: int
    cols: int
    left: int
    """Offset of the block's left factor in this rank's flat left-factor state."""
    right: int


class _ParamPlan(NamedTuple):
    info: ShardInfo
    geom: BlockGeometry
    strips: tuple[int, int]
    """This rank's strips ``[s0, s1)``."""
    blocks: tuple[_Block, ...]

    @property
    def local_rows(self) -> int:
        return self.info.local_numel // self.geom.cols if self.geom.cols else 0


def _plan_param(info: ShardInfo, geom: BlockGeometry) -> _ParamPlan:
    if info.numel == 0:
        return _ParamPlan(info, geom, (0, 0), ())
    s0, s1 = geom.strip_at(info.start), geom.strip_at(info.end)
    row_base = info.start // geom.cols
    blocks, left, right = [], 0, 0
    for i in range(s0, s1):
        r, row0 = geom.strip_rows(i), geom.strip_start_row(i) - row_base
        col0 = 0
        for w in geom.col_widths:
            blocks.append(_Block(row0, r, col0, w, left, right))
            left += r * r
            right += 0 if geom.one_factor else w * w
            col0 += w
    return _ParamPlan(info, geom, (s0, s1), tuple(blocks))


def matrix_inverse_root(a: Tensor, root: float, epsilon: float) -> Tensor:
    """``(a + epsilon I)^{-1/root}`` of a symmetric PSD matrix via float64 ``eigh``; negative
    eigenvalues (rounding) are clamped to 0 before ``epsilon`` is added. Returns ``a.dtype``."""
    w, q = torch.linalg.eigh(a.double())
    w = w.clamp(min=0.0).add(epsilon).pow(-1.0 / root)
    return ((q * w) @ q.mT).to(a.dtype)


# ---- the optimizer ----------------------------------------------------------------------
class Shampoo(torch.optim.Optimizer):
    """Blocked Shampoo with Adam grafting on sharded or plain parameters (see the notes above).

    Shard with ``Shampoo.blocks`` (``rows(1024)``) or ``Shampoo.rule(max_preconditioner_dim=k)``
    with the same ``k`` as here: a rank boundary inside a ``k``-row strip raises ``ValueError``.
    Blocks are the same for every world size, so a sharded run equals the single-process run.
    Plain (unsharded) parameters get their spec from ``blocks`` (default: ``Shampoo.rule`` with
    the group's ``max_preconditioner_dim``).

    ``betas``: (beta1 of the filtered gradient, 0 to disable; beta2 of the factor EMA, 1 for a
    sum). ``epsilon``: added to the factors' eigenvalues. ``precondition_frequency`` /
    ``start_preconditioning_step`` (default: the frequency): when inverse roots are recomputed
    and from which step the Shampoo direction replaces the Adam grafting direction.
    ``exponent_override``: the root ``p`` of ``factor^{-1/p}`` (0: 4 for matrices, 2 for 1-D).
    ``grafting_beta2`` / ``grafting_epsilon``: the Adam grafting's second moment. Defaults follow
    facebookresearch/optimizers' README example of Shampoo grafting from AdamW.
    """

    blocks = staticmethod(shampoo_rule(1024))

    @classmethod
    def rule(cls, *, max_preconditioner_dim: int = 1024, per_expert: bool = True) -> BlockRule:
        """The block rule for ``fully_shard``: ``rows(max_preconditioner_dim)`` strips; with
        ``per_expert`` 3-D ``[E, r, c]`` weights are E matrices, each blocked on its own."""
        return shampoo_rule(max_preconditioner_dim, per_expert=per_expert)

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = None,
        exponent_override: float = 0,
        use_bias_correction: bool = True,
        grafting_beta2: float = 0.999,
        grafting_epsilon: float = 1e-8,
        blocks: BlockRule | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 < betas[1] <= 1.0):
            raise ValueError(f"betas must be in [0, 1) x (0, 1], got {betas}")
        if not 0.0 < grafting_beta2 <= 1.0:
            raise ValueError(f"grafting_beta2 must be in (0, 1], got {grafting_beta2}")
        if not epsilon > 0.0 or not grafting_epsilon > 0.0:
            raise ValueError(f"epsilon and grafting_epsilon must be > 0, got {epsilon}, {grafting_epsilon}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if max_preconditioner_dim < 1:
            raise ValueError(f"max_preconditioner_dim must be >= 1, got {max_preconditioner_dim}")
        if precondition_frequency < 1:
            raise ValueError(f"precondition_frequency must be >= 1, got {precondition_frequency}")
        if start_preconditioning_step is None:
            start_preconditioning_step = precondition_frequency  # facebookresearch/optimizers' default (-1)
        if start_preconditioning_step < 1:
            raise ValueError(f"start_preconditioning_step must be >= 1, got {start_preconditioning_step}")
        if exponent_override < 0:
            raise ValueError(f"exponent_override must be >= 0 (0: the default root), got {exponent_override}")
        self._plans: dict[Tensor, _ParamPlan] = {}
        self._rule = blocks
        defaults = dict(
            lr=lr, betas=tuple(betas), epsilon=epsilon, momentum=momentum, nesterov=nesterov,
            weight_decay=weight_decay, max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency, start_preconditioning_step=start_preconditioning_step,
            exponent_override=exponent_override, use_bias_correction=use_bias_correction,
            grafting_beta2=grafting_beta2, grafting_epsilon=grafting_epsilon,
        )  # fmt: skip
        super().__init__(params, defaults)
        if blocks is not None and self._plans and all(shard_info(t) is not None for t in self._plans):
            warnings.warn("Shampoo: blocks= is ignored: every parameter is sharded and its recorded spec is used",
                          stacklevel=2)  # fmt: skip
        make_dcp_ready(self)

    # ---- groups and state ---------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        k = group["max_preconditioner_dim"]
        names = group.get("param_names", [None] * len(group["params"]))
        for name, p in zip(names, group["params"]):
            info = checked_param_info(
                p, self._rule or shampoo_rule(k), optimizer="Shampoo", name=name or "", whole_blocks=True,
                blocks=f"Shampoo.rule(max_preconditioner_dim={k})",
            )  # fmt: skip
            geom = shampoo_blocks(info.shape, k, info.spec)
            ok = info.numel == 0 or all(geom.is_strip_boundary(b) for b in info.layout.bounds)
            require_spec(
                info, ok, optimizer="Shampoo", need=f"whole {k}-row strips on one rank",
                blocks=f"Shampoo.rule(max_preconditioner_dim={k})",
            )  # fmt: skip
            plan = _plan_param(info, geom)
            self._plans[p] = plan
            self._init_state(p, plan, group)

    def _init_state(self, p: Tensor, plan: _ParamPlan, group: dict[str, Any]) -> None:
        s0, s1 = plan.strips
        f32 = dict(dtype=torch.float32, device=p.device)
        state = self.state[p]
        state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
        nl = plan.geom.left_numel(s0, s1)
        state.setdefault("left", torch.zeros(nl, **f32))
        state.setdefault("left_inv_root", torch.zeros(nl, **f32))
        if not plan.geom.one_factor:
            nr = plan.geom.right_numel(s0, s1)
            state.setdefault("right", torch.zeros(nr, **f32))
            state.setdefault("right_inv_root", torch.zeros(nr, **f32))
        state.setdefault("grafting_exp_avg_sq", torch.zeros(p.numel(), **f32))
        if group["betas"][0] > 0:
            state.setdefault("exp_avg", torch.zeros(p.numel(), **f32))
        if group["momentum"] > 0:
            state.setdefault("momentum_buffer", torch.zeros(p.numel(), **f32))

    def state_shards(self, p: Tensor) -> dict[str, StateShard]:
        """Per-element keys: the parameter's range; factor keys: this rank's blocks' factors, flattened
        and concatenated in global block order (strip-major, then column block)."""
        plan = self._plans[p]
        info, geom = plan.info, plan.geom
        s0, s1 = plan.strips
        n = geom.num_strips
        elem = StateShard(info.numel, info.start, info.end)
        left = StateShard(geom.left_numel(0, n), geom.left_numel(0, s0), geom.left_numel(0, s1))
        out = {"left": left, "left_inv_root": left, "grafting_exp_avg_sq": elem}
        if not geom.one_factor:
            right = StateShard(geom.right_numel(0, n), geom.right_numel(0, s0), geom.right_numel(0, s1))
            out |= {"right": right, "right_inv_root": right}
        for key in ("exp_avg", "momentum_buffer"):
            if key in self.state[p]:
                out[key] = elem
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but state stays fp32 (torch casts floating state to the parameter's dtype,
        which for bf16 parameters would round the factors)."""
        fp32: dict[Tensor, dict[str, Tensor]] = {}
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved["params"], group["params"]):
                st = state_dict["state"].get(pid, {})
                fp32[p] = {
                    k: v for k, v in st.items() if k != "step" and isinstance(v, Tensor) and v.dtype == torch.float32
                }
        super().load_state_dict(state_dict)
        for p, st in fp32.items():
            for k, v in st.items():
                self.state[p][k] = v.to(device=p.device, copy=True)

    # ---- step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim signature
        """One Shampoo step on every local block (see [Note: Shampoo step]); no communication."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("Shampoo does not support sparse gradients or complex parameters")
                self._step_param(p, group)
        return loss

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        plan, state = self._plans[p], self.state[p]
        geom = plan.geom
        beta1, beta2 = group["betas"]
        gb2, bias = group["grafting_beta2"], group["use_bias_correction"]
        state["step"] += 1
        t = int(state["step"].item())
        g = p.grad.reshape(-1).float()
        rows, cols = plan.local_rows, geom.cols

        # 1. factors (raw gradient) and Adam grafting state
        g2 = g.view(rows, cols)
        left, right = state["left"], state.get("right")
        for b in plan.blocks:
            gb = g2[b.row0 : b.row0 + b.rows, b.col0 : b.col0 + b.cols].contiguous()
            _ema_(left[b.left : b.left + b.rows**2].view(b.rows, b.rows), gb @ gb.mT, beta2)
            if not geom.one_factor:
                _ema_(right[b.right : b.right + b.cols**2].view(b.cols, b.cols), gb.mT @ gb, beta2)
        v = state["grafting_exp_avg_sq"]
        if gb2 == 1.0:
            v.addcmul_(g, g)
        else:
            v.mul_(gb2).addcmul_(g, g, value=1 - gb2)

        # 2. inverse roots
        start, freq = group["start_preconditioning_step"], group["precondition_frequency"]
        if t == start or (t > start and t % freq == 0):
            self._inverse_roots(plan, state, group, t)

        # 3. filtered gradient
        if beta1 > 0:
            m = state["exp_avg"]
            m.lerp_(g, 1 - beta1)
            gbar = m / (1 - beta1**t) if bias else m
        else:
            gbar = g

        # 4. grafting direction; Shampoo direction grafted to its per-block norm
        vhat = v / (1 - gb2**t) if bias and gb2 < 1.0 else v
        graft = gbar / vhat.sqrt().add_(group["grafting_epsilon"])
        if t < start:
            d = graft
        else:
            d = torch.empty_like(g)
            d2, gbar2, graft2 = d.view(rows, cols), gbar.view(rows, cols), graft.view(rows, cols)
            li, ri = state["left_inv_root"], state.get("right_inv_root")
            for b in plan.blocks:
                sl = (slice(b.row0, b.row0 + b.rows), slice(b.col0, b.col0 + b.cols))
                pre = li[b.left : b.left + b.rows**2].view(b.rows, b.rows) @ gbar2[sl].contiguous()
                if not geom.one_factor:
                    pre = pre @ ri[b.right : b.right + b.cols**2].view(b.cols, b.cols)
                scale = graft2[sl].contiguous().norm() / pre.norm().add(_GRAFT_NORM_EPS)
                d2[sl] = pre.mul_(scale)

        # 5. weight decay, momentum, update
        flat = p.view(-1)
        if group["weight_decay"] != 0:
            d = d.add(flat, alpha=group["weight_decay"])
        mu = group["momentum"]
        if mu > 0:
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(d)
            d = d.add(buf, alpha=mu) if group["nesterov"] else buf
        flat.add_(d.to(flat.dtype), alpha=-group["lr"])

    def _inverse_roots(self, plan: _ParamPlan, state: dict[str, Tensor], group: dict[str, Any], t: int) -> None:
        beta2, eps = group["betas"][1], group["epsilon"]
        bc2 = 1 - beta2**t if group["use_bias_correction"] and beta2 < 1.0 else 1.0
        root = group["exponent_override"] or (2 if plan.geom.one_factor else 4)
        pairs = [("left", "left_inv_root", lambda b: (b.left, b.rows))]
        if not plan.geom.one_factor:
            pairs.append(("right", "right_inv_root", lambda b: (b.right, b.cols)))
        for key, inv_key, where in pairs:
            for b in plan.blocks:
                off, n = where(b)
                factor = state[key][off : off + n * n].view(n, n)
                state[inv_key][off : off + n * n].view(n, n).copy_(matrix_inverse_root(factor / bc2, root, eps))


def _ema_(factor: Tensor, outer: Tensor, beta2: float) -> None:
    if beta2 == 1.0:
        factor.add_(outer)
    else:
        factor.mul_(beta2).add_(outer, alpha=1 - beta2)
