"""Matrix products and decompositions whose result for one matrix does not depend on where it lies.

[Note: alignment-independent kernels]
On CPU, MKL rounds some kernels by the *addresses* of their operands, not only their values
(seen on an AVX-512 CPU, torch 2.13's MKL 2024.2):

- products with a dim below ~12 (matrix-vector-like: ``[1, 600] x [600, 600]``, ``[37, 37] x [37,
  4]``) give other last bits when an operand starts at a float offset that is not a multiple of 4;
- batched ``eigh`` and ``qr`` copy a ``[B, n, n]`` stack into one buffer and call LAPACK on each
  matrix in place, so for ``n * n`` not a multiple of 16 floats every matrix after the first sits
  at a misaligned address and rounds differently from the same matrix decomposed alone.

Whole-block optimizers stack blocks whose batch-mates depend on the world size, and read factors
as views into flat state at arbitrary offsets, so on such CPUs a block's result would depend on W,
on its position in a stack, and on the sizes of the factors before it. With rank-deficient factors
(a tall matrix's ``G G^T``, a vector's ``g g^T``) the eigenbasis of the null space is decided by
rounding, and the difference grows to O(lr) in the update. Hence: every CPU product reads
64-byte-aligned operands (``aligned``: a copy where a view is not), and a stack runs batched only
where each of its matrices is aligned and no dim is small; otherwise one matrix at a time. CUDA
kernels are left as they are (their batched solvers differ anyway; see the optimizers' notes).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["aligned", "batched_ok", "bmm", "eigh", "qr_q"]

_ALIGN_BYTES = 64
SMALL_DIM = 16
"""A product with a dim below this (MKL's address-dependent small kernels, ~12 seen) runs per matrix."""


def aligned(t: Tensor) -> Tensor:
    """``t``, or a copy with the same strides at a fresh (64-byte aligned) address when ``t`` is a
    view elsewhere (a factor in flat state, a stack's later matrix). CUDA tensors are returned as is."""
    if t.is_cuda or t.data_ptr() % _ALIGN_BYTES == 0:
        return t
    return t.clone()


def _whole_lines(numel: int, t: Tensor) -> bool:
    return (numel * t.element_size()) % _ALIGN_BYTES == 0


def batched_ok(m: int, k: int, n: int, x: Tensor) -> bool:
    """Whether a ``[B, m, k] x [B, k, n]`` product of contiguous stacks (or their ``mT``) may run
    batched and still equal each matrix's own product bitwise on CPU: not small (ATen's CPU ``bmm``
    multiplies ``m k n < 400`` in its own loop kernel, not BLAS), no dim below ``SMALL_DIM``, and every
    operand's and the output's matrices on 64-byte boundaries. Always true on CUDA."""
    if x.is_cuda:
        return True
    return (
        m * k * n >= 400
        and min(m, k, n) >= SMALL_DIM
        and all(_whole_lines(a * b, x) for a, b in ((m, k), (k, n), (m, n)))
    )


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` on ``[B, m, k] x [B, k, n]`` stacks, each matrix bitwise its own aligned ``@`` on CPU."""
    if batched_ok(a.shape[-2], a.shape[-1], b.shape[-1], a):
        return a @ b
    return torch.stack([aligned(x) @ aligned(y) for x, y in zip(a.unbind(0), b.unbind(0))])


def _decompose_batched(a: Tensor) -> bool:
    return a.ndim == 2 or a.is_cuda or _whole_lines(a.shape[-1] * a.shape[-2], a)


def eigh(a: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of a matrix or a ``[B, n, n]`` stack, each matrix as if alone on CPU."""
    if _decompose_batched(a):
        return torch.linalg.eigh(a)
    pairs = [torch.linalg.eigh(x) for x in a.unbind(0)]
    return torch.stack([w for w, _ in pairs]), torch.stack([q for _, q in pairs])


def qr_q(a: Tensor) -> Tensor:
    """The ``Q`` of ``torch.linalg.qr`` of a matrix or a ``[B, n, n]`` stack, each as if alone on CPU."""
    if _decompose_batched(a):
        return torch.linalg.qr(a)[0]
    return torch.stack([torch.linalg.qr(x)[0] for x in a.unbind(0)])
