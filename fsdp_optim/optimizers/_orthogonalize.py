"""Orthogonalization for Muon: torch's Newton–Schulz, Gram Newton–Schulz, coefficient schedules (pure).

[Note: which orthogonalization]
Muon's update of a matrix ``G`` is an approximation of its polar factor ``U V^T`` (``G = U S V^T``):
``X <- a_k X + (b_k A + c_k A^2) X`` with ``A = X X^T``, ``k = 0 .. steps-1``, from ``X = G / ||G||_F``
(wide orientation: a tall matrix is transposed first and back at the end). Two ways to run it:

- ``newton_schulz``: torch.optim.Muon's iteration, op for op (bf16, same layouts), so the same input
  gives torch's bits; ``4 n^2 m + 2 n^3`` flops per iteration for ``n x m``, ``n <= m``.
- ``gram_newton_schulz`` (Dao AI Lab, gram-newton-schulz 0.1.6): the same polynomial, run on the
  ``n x n`` Gram matrix ``R = X X^T``. Every ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``R_0``,
  so the iteration only needs ``R`` and ``Q``: ``P = a I + b R + c R^2``, ``Q <- Q P``,
  ``R <- P R P``; ``X`` is touched only at the end (``Q X``) and at a *restart* (``X <- Q X``, ``R``
  recomputed from it), which stops the rounding errors of the long ``R`` chain from compounding
  (the authors restart at iteration 2). For ``m = 3.5 n`` (an MLP matrix) that is 56 n^3 flops for 5
  iterations against Newton–Schulz's 80 n^3 (0.70x); a square matrix gains nothing and runs the plain
  iteration, as in the authors' code. ``flops`` gives both counts.

Coefficients: ``"torch"`` is torch.optim.Muon's one ``(a, b, c)`` (Keller Jordan's) repeated
``ns_steps`` times; ``"polar_express"`` is Polar Express's per-iteration set (``POLAR_EXPRESS``); a
list gives one ``(a, b, c)`` per iteration. Measured distance to the exact polar factor and speed:
docs/muon.md ("Which orthogonalization").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_STEPS", "DEFAULT_EPS", "POLAR_EXPRESS", "GRAM_RESTARTS", "GRAM_DTYPE",
    "ORTHOGONALIZE", "COEFFICIENTS", "schedule", "resolve", "newton_schulz", "gram_newton_schulz", "flops",
]  # fmt: skip

Coefficients = tuple[float, float, float]

# torch.optim._muon (from Keller Jordan's Muon post, https://kellerjordan.github.io/posts/muon/).
DEFAULT_NS_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_EPS = 1e-7

# Polar Express (Amsel, Persson, Musco, Gower, arXiv:2505.16932): the minimax-optimal degree-5
# polynomials of iterations 1..5, unscaled, as gram-newton-schulz 0.1.6 (coefficients.py, whose authors
# include Amsel) lists them from the paper. A safety factor s divides them as (a / s, b / s^3, c / s^5):
# s = 1.05 in that package's POLAR_EXPRESS_COEFFICIENTS, which we use; the paper's Algorithm 1 uses
# s = 1.01, as NVIDIA Emerging-Optimizers' "polar_express" set does (muon_utils.py, 4 decimals). Both
# are checked in tests/optimizers/test_orthogonalize.py.
_POLAR_EXPRESS_UNSCALED: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
POLAR_EXPRESS_SAFETY = 1.05
POLAR_EXPRESS: tuple[Coefficients, ...] = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_UNSCALED
)

GRAM_RESTARTS = (2,)
"""Iterations at which Gram Newton–Schulz rebuilds ``X`` and ``R`` (the authors' default)."""
GRAM_DTYPE = torch.float16
"""The dtype the Gram iteration runs in by default: the authors' (fp16 keeps 3 more mantissa bits than
bf16, which the Gram chain needs; see docs/muon.md for the measured distances)."""

ORTHOGONALIZE = ("newton_schulz", "gram_newton_schulz")
COEFFICIENTS = ("torch", "polar_express")


def schedule(coefficients: Coefficients | Sequence[Coefficients], steps: int | None = None) -> tuple[Coefficients, ...]:
    """Per-iteration ``(a, b, c)``: one triple repeated ``steps`` times (torch's form; ``steps``
    defaults to 5), or a sequence of triples as it is (``steps``, if given, must be its length)."""
    seq = tuple(coefficients)
    if len(seq) == 3 and all(isinstance(v, (int, float)) for v in seq):
        steps = DEFAULT_NS_STEPS if steps is None else steps
        if not 0 <= steps < 100:
            raise ValueError(f"ns_steps must be in [0, 100), got {steps}")
        return (tuple(float(v) for v in seq),) * steps  # type: ignore[return-value]
    out = []
    for t in seq:
        t = tuple(t) if isinstance(t, (tuple, list)) else (t,)
        if len(t) != 3 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in t):
            raise ValueError(f"coefficients: each iteration's entry must be three finite numbers (a, b, c), got {t!r}")
        out.append(tuple(float(v) for v in t))
    if not out or len(out) >= 100:
        raise ValueError(f"coefficients: a list needs 1 to 99 iterations' (a, b, c), got {len(out)}")
    if steps is not None and steps != len(out):
        raise ValueError(f"ns_steps={steps} but coefficients give {len(out)} iterations")
    return tuple(out)  # type: ignore[return-value]


def resolve(
    orthogonalize: str, coefficients: str | Sequence[Coefficients], ns_coefficients: Coefficients, ns_steps: int
) -> tuple[str, tuple[Coefficients, ...]]:
    """``(method, per-iteration coefficients)`` of Muon's settings; a ``ValueError`` naming the argument
    and the allowed values for anything else. ``ns_coefficients`` / ``ns_steps`` are torch.optim.Muon's
    and make the ``"torch"`` schedule; a named set or a list gives every iteration itself, so then
    ``ns_coefficients`` must stay torch's default and ``ns_steps`` the default (5) or the list's length."""
    if orthogonalize not in ORTHOGONALIZE:
        raise ValueError(f"orthogonalize must be one of {ORTHOGONALIZE}, got {orthogonalize!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENTS:
            raise ValueError(
                f"coefficients must be one of {COEFFICIENTS} or a list of (a, b, c) per iteration, got {coefficients!r}"
            )
        if coefficients == "torch":
            return orthogonalize, schedule(ns_coefficients, ns_steps)
        sched, given = POLAR_EXPRESS, repr(coefficients)
    elif coefficients is None or not isinstance(coefficients, Sequence):
        raise ValueError(
            f"coefficients must be one of {COEFFICIENTS} or a list of (a, b, c) per iteration, got {coefficients!r}"
        )
    else:
        sched, given = schedule(coefficients), "a list"
    if tuple(ns_coefficients) != DEFAULT_NS_COEFFICIENTS:
        raise ValueError(
            f"ns_coefficients={tuple(ns_coefficients)} applies only with coefficients='torch'; coefficients="
            f"{given} sets every iteration's (a, b, c): pass one of them"
        )
    if ns_steps not in (DEFAULT_NS_STEPS, len(sched)):
        raise ValueError(f"ns_steps={ns_steps} but coefficients give {len(sched)} iterations: leave ns_steps out")
    return orthogonalize, sched


def _addmm(c: Tensor, a: Tensor, b: Tensor, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """``beta c + alpha a @ b`` for matrices (``addmm``) or stacks (``baddbmm``): a one-matrix
    ``baddbmm`` is slower than ``addmm`` in bf16 on CPU (512x512: 0.74-0.85x, see _muon.py)."""
    return (torch.addmm if c.ndim == 2 else torch.baddbmm)(c, a, b, beta=beta, alpha=alpha)


def _iterate(x: Tensor, sched: Sequence[Coefficients]) -> Tensor:
    """The plain iteration on a ``[n, m]`` matrix or a ``[batch, n, m]`` stack (torch.optim.Muon's ops)."""
    for a, b, c in sched:
        gram = x @ x.mT
        poly = _addmm(gram, gram, gram, beta=b, alpha=c)
        x = _addmm(x, poly, x, beta=a)
    return x


def newton_schulz(
    g: Tensor,
    *,
    coefficients: Coefficients | Sequence[Coefficients] = DEFAULT_NS_COEFFICIENTS,
    steps: int | None = None,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """bf16 quintic Newton–Schulz orthogonalization of a matrix ``[r, c]`` or a batch ``[n, r, c]``.

    The same ops and layouts as torch.optim.Muon (transpose tall matrices, divide by the
    Frobenius norm clamped at ``eps``, then ``X <- aX + (bA + cA^2)X`` with ``A = XX^T``), so the same
    input gives the same bits (a batch: see [Note: batched Newton–Schulz] in _muon.py). ``coefficients``:
    one ``(a, b, c)`` for ``steps`` iterations (default 5, torch's form) or one per iteration
    (``schedule``). ``g`` is not modified; the result is bf16.
    """
    if g.ndim not in (2, 3):
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    sched = schedule(coefficients, steps)
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = _iterate(x.div(x.norm().clamp(min=eps)), sched)  # out of place: g may already be bf16
    else:
        x = _iterate(x.div(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)), sched)
    return x.mT if tall else x


def gram_newton_schulz(
    g: Tensor,
    *,
    coefficients: Coefficients | Sequence[Coefficients] = DEFAULT_NS_COEFFICIENTS,
    steps: int | None = None,
    eps: float = DEFAULT_EPS,
    restarts: Sequence[int] = GRAM_RESTARTS,
    dtype: torch.dtype = GRAM_DTYPE,
) -> Tensor:
    """Gram Newton–Schulz (see [Note: which orthogonalization]) of ``[r, c]`` or ``[n, r, c]``; bf16 result.

    Reads ``g`` as bf16 (as ``newton_schulz`` does, so Muon's bf16 exchange of split matrices stays
    exact), normalizes in fp32 (``X / (||X||_F + eps)``, the authors' form) and iterates in ``dtype``
    (default fp16, the authors'), restarting at the iterations in ``restarts`` (not 0); the same
    polynomial as ``newton_schulz`` with the same ``coefficients``. A square matrix runs the plain
    iteration in ``dtype``. Tall matrices are transposed. ``g`` is not modified.
    """
    if g.ndim not in (2, 3):
        raise ValueError(f"gram_newton_schulz needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    sched = schedule(coefficients, steps)
    x = g.to(torch.bfloat16, copy=True)  # a copy: normalized in place below
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    # the fp32 norm of the bf16 values (a 0-dim one for one matrix: the same quotients, half the time)
    f32 = torch.float32
    norm = (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=f32) if x.ndim == 3
            else torch.linalg.vector_norm(x, dtype=f32)) + eps  # fmt: skip
    if dtype == torch.bfloat16:
        x = x.div_(norm)  # float(x) / norm rounded once to bf16: the fp32 quotient's bits, one pass
    else:
        x = (x.float() / norm).to(dtype)
    x = _iterate(x, sched) if x.size(-2) == x.size(-1) else _gram_iterate(x, sched, frozenset(restarts))
    x = x.bfloat16()
    return x.mT if tall else x


def _gram_iterate(x: Tensor, sched: Sequence[Coefficients], restarts: frozenset[int]) -> Tensor:
    """``sched`` on a wide ``[n, m]`` matrix or ``[batch, n, m]`` stack through its ``n x n`` Gram matrix. ``P = a I + Z``
    (``Z = b R + c R^2``) is never rounded on its own: ``Q P = a Q + Q Z`` and ``P R P = a (R P) + Z (R P)``
    with ``R P = a R + R Z`` are each one ``baddbmm`` (one rounding in ``x``'s dtype), which keeps the
    chain about twice as close to exact arithmetic as forming ``P`` first (measured in fp16)."""
    r = x @ x.mT
    q: Tensor | None = None
    for k, (a, b, c) in enumerate(sched):
        if k in restarts and q is not None:  # fold the product so far into X; a fresh, exact R
            x = q @ x
            r = x @ x.mT
            q = None
        z = _addmm(r, r, r, beta=b, alpha=c)
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)  # a I + Z
        else:
            q = _addmm(q, q, z, beta=a)  # polynomials in the same R commute
        if k + 1 < len(sched) and k + 1 not in restarts:
            rp = _addmm(r, r, z, beta=a)  # R P
            r = _addmm(rp, z, rp, beta=a)  # P R P = X_{k+1} X_{k+1}^T
    return x if q is None else q @ x


def flops(method: str, rows: int, cols: int, steps: int, restarts: Sequence[int] = GRAM_RESTARTS) -> int:
    """Matmul flops (2 per multiply-add, general GEMMs) of one ``[rows, cols]`` orthogonalization."""
    n, m = min(rows, cols), max(rows, cols)
    if method == "newton_schulz" or n == m:
        return steps * (4 * n * n * m + 2 * n**3)
    if method != "gram_newton_schulz":
        raise ValueError(f"method must be one of {ORTHOGONALIZE}, got {method!r}")
    wide, small = 2 * n * n * m, 2 * n**3
    total, fresh = wide, True  # R = X X^T
    for k in range(steps):
        if k in restarts and k > 0 and not fresh:
            total += 2 * wide  # X <- Q X, R <- X X^T
            fresh = True
        total += small + (0 if fresh else small)  # R^2, Q P
        fresh = False
        if k + 1 < steps and k + 1 not in restarts:
            total += 2 * small  # P R P
    return total + (wide if steps else 0)  # Q X
