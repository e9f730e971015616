"""``_linalg``: a matrix's product or decomposition does not depend on where it lies in memory or on
its batch-mates ([Note: alignment-independent kernels]). On CPUs whose MKL kernels round by address
(AVX-512) the plain torch calls fail these; elsewhere both pass."""

from __future__ import annotations

import pytest
import torch

from fsdp_optim.optimizers._linalg import aligned, batched_ok, bmm, eigh, qr_q


def last_param_after(make_optimizer, shape: tuple[int, ...], num_params: int, *, steps: int = 4) -> torch.Tensor:
    """The last of ``num_params`` same-shape parameters after ``steps`` steps of
    ``make_optimizer(params)``; its initial value and gradients do not depend on ``num_params``, so a
    whole-block optimizer gives the same result alone and as a later batch-mate."""
    torch.manual_seed(0)
    mine_init = torch.randn(shape)
    ps = [torch.nn.Parameter(torch.randn(shape)) for _ in range(num_params - 1)] + [torch.nn.Parameter(mine_init)]
    opt = make_optimizer(ps)
    mates, mine = torch.Generator().manual_seed(2), torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps[:-1]:
            p.grad = torch.randn(shape, generator=mates)
        ps[-1].grad = torch.randn(shape, generator=mine)
        opt.step()
    return ps[-1].detach()


def _at(t: torch.Tensor, offset: int) -> torch.Tensor:
    """``t``'s values in a view ``offset`` elements into a larger buffer (same strides)."""
    buf = torch.zeros(t.numel() + 16, dtype=t.dtype)
    view = buf[offset : offset + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def test_aligned_copies_only_a_misaligned_view_and_keeps_values_and_strides():
    t = torch.randn(5, 7)
    assert aligned(t) is t
    moved = _at(t, 3)
    out = aligned(moved)
    assert out is not moved and out.data_ptr() % 64 == 0 and out.stride() == moved.stride()
    assert torch.equal(out, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [5, 37, 48, 131])
def test_a_stack_decomposes_each_matrix_as_if_alone(n, dtype):
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(3, n, n, generator=gen, dtype=dtype)
    f = a @ a.mT
    w, q = eigh(f)
    for i in range(3):
        wi, qi = torch.linalg.eigh(f[i].clone())
        assert torch.equal(w[i], wi) and torch.equal(q[i], qi), i
        assert torch.equal(qr_q(f)[i], torch.linalg.qr(f[i].clone())[0]), i


@pytest.mark.parametrize("mkn", [(1, 600, 600), (37, 37, 4), (131, 37, 37), (64, 64, 64), (3, 5, 7)])
def test_a_stacked_product_equals_each_matrix_alone_wherever_it_lies(mkn):
    m, k, n = mkn
    gen = torch.Generator().manual_seed(m * k + n)
    a, b = torch.randn(3, m, k, generator=gen), torch.randn(3, n, k, generator=gen).mT  # b: a transposed view
    out = bmm(a, b)
    for i in range(3):
        ref = a[i].clone() @ b[i].mT.clone().mT
        assert torch.equal(out[i], ref), i
        assert torch.equal(bmm(_at(a[i], 1).unsqueeze(0), b[i].unsqueeze(0))[0], ref), i


def test_batched_ok_names_the_cases_that_run_per_matrix():
    x = torch.empty(0)
    assert batched_ok(64, 64, 64, x)
    assert not batched_ok(37, 37, 37, x)  # 37 * 37 floats: later matrices misaligned
    assert not batched_ok(64, 64, 8, x)  # a small dim
    assert not batched_ok(4, 5, 6, x)  # ATen's own loop kernel
