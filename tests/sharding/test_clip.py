"""clip_grad_norm_'s foreach path on plain tensors: equal to torch.nn.utils.clip_grad_norm_ (the
reference) for every norm type, with mixed dtypes and empty gradients; the sharded, multi-rank
form is tested against a single process in test_fully_shard.py and test_hsdp.py."""

import math

import pytest
import torch

import fsdp_optim


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_plain_tensors_match_torch(norm_type):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (3, 2, 2)] + ([(0,)] if norm_type != math.inf else [])  # (torch's inf norm refuses empty)
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for a, b in zip(ours, ref):
        a.grad = torch.randn(a.shape, generator=g) * 3
        b.grad = a.grad.clone()
    total = fsdp_optim.clip_grad_norm_(ours, 1.0, norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type, foreach=False)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_bf16_gradients_are_accumulated_in_float32():
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.zeros(5))
    p.grad = torch.randn(4096, generator=g).to(torch.bfloat16)
    q.grad = torch.randn(5, generator=g)
    want = torch.cat([p.grad.float(), q.grad]).norm()
    total = fsdp_optim.clip_grad_norm_([p, q], 1e9)
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("max_norm", [-1.0, -1e-9, math.nan, torch.tensor(-2.0)])
def test_negative_max_norm_raises_and_leaves_the_gradients(max_norm):
    # torch accepts it and flips the sign of every gradient; training would silently diverge.
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    with pytest.raises(ValueError, match=r"clip_grad_norm_: max_norm must be >= 0 .*got (-|nan).*Pass a positive"):
        fsdp_optim.clip_grad_norm_([p], max_norm)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0, 0.0]))


def test_zero_max_norm_and_norm_type_checks_are_unchanged():
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    p.grad, q.grad = torch.tensor([3.0, 4.0, 0.0]), torch.tensor([3.0, 4.0, 0.0])
    torch.testing.assert_close(fsdp_optim.clip_grad_norm_([p], 0), torch.nn.utils.clip_grad_norm_([q], 0))
    assert torch.equal(p.grad, q.grad)
    for bad in (0.0, -2.0, math.nan):
        with pytest.raises(ValueError, match="norm_type must be positive or inf"):
            fsdp_optim.clip_grad_norm_([p], 1.0, bad)
