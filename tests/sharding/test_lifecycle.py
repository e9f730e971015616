"""The runtime off the happy path: what users do between passes, and the guards against silent errors.

Each parity test compares with single-process ``torch.optim.AdamW`` on the global batch (the
reference nobody here wrote); W = 3 divides nothing in the tiny model. Each of these failed on the
main branch before the fixes (issue 12 items 2-6): wrong parameters, a deferred reduction, a world
of one, zero updates, drifting ranks, or a hang.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp_optim
from fsdp_optim._testing import DistributedTestError, run_distributed
from fsdp_optim.optimizers import AdamW
from tests._models import TinyConfig, TinyTransformer, assert_close_after_adamw, make_batch

CFG = TinyConfig(vocab_size=101, dim=24, num_heads=2, num_layers=2, mlp_dim=40)
GLOBAL_BATCH, SEQ, LR = 6, 8, 1e-2


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CFG)


def _shard(model: nn.Module) -> nn.Module:
    for layer in model.layers:
        fsdp_optim.fully_shard(layer)
    fsdp_optim.fully_shard(model)
    return model


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _batch(step: int):
    return make_batch(batch_size=GLOBAL_BATCH, seq_len=SEQ, vocab_size=CFG.vocab_size, seed=100 + step)


def _reference(num_steps: int) -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(num_steps):
        x, y = _batch(step)
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    w, r = dist.get_world_size(), dist.get_rank()
    n = t.shape[0] // w
    return t[r * n : (r + 1) * n]


def _assert_close(got: dict, want: dict) -> None:
    assert_close_after_adamw(got, want, lr=LR)


@pytest.mark.parametrize("eval_mode", ["no_grad", "grad_enabled", "grad_enabled_kept"])
def test_evaluation_forward_between_backward_and_step_trains_like_the_reference(eval_mode):
    """A validation forward between backward and step, with or without ``torch.no_grad()``: the next
    forward must use the stepped parameters (on main, a grad-enabled one left the root bucket
    gathered with the pre-step values: parameters 1.1% off after 5 steps)."""
    num_steps = 4
    want = _reference(num_steps)

    def fn():
        model = _shard(_model())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        kept = []
        for step in range(num_steps):
            x, y = _batch(step)
            _loss(model, _local(x), _local(y)).backward()
            if eval_mode == "no_grad":
                with torch.no_grad():
                    _loss(model, _local(x), _local(y))
            else:
                val = _loss(model, _local(x), _local(y))  # graph dropped here, or kept one step
                if eval_mode == "grad_enabled_kept":
                    kept = [val]
            opt.step()
            opt.zero_grad()
        del kept
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=3):
        _assert_close(got, want)


def test_a_dropped_graph_does_not_defer_the_next_backwards_reductions():
    """After a grad-enabled forward whose graph is dropped, the next backward still reduces each layer
    as soon as its backward is done (on main every reduce-scatter waited for the end of backward)."""

    def fn():
        model = _shard(_model())
        x, y = _batch(0)
        _loss(model, _local(x), _local(y))  # dropped: no backward
        order = []
        for name, m in model.named_modules():
            st = getattr(m, "_fsdp_optim_state", None)
            if st is not None and st.bucket is not None:
                b = st.bucket
                orig = b.post_backward

                def logged(_orig=orig, _name=name or "<root>"):
                    order.append((_name, b.runtime.callback_queued and _in_final_callback[0]))
                    return _orig()

                b.post_backward = logged
        _in_final_callback = [False]
        rt = model._fsdp_optim_state.runtime
        orig_final = rt.final_callback

        def final():
            _in_final_callback[0] = True
            try:
                orig_final()
            finally:
                _in_final_callback[0] = False

        rt.final_callback = final
        _loss(model, _local(x), _local(y)).backward()
        return order

    for order in run_distributed(fn, world_size=2):
        layers = [deferred for name, deferred in order if name.startswith("layers.")]
        assert layers == [False, False], order  # both layers reduced during backward, not at its end


def test_fully_shard_under_torchrun_without_a_process_group_raises():
    def fn():
        # What torchrun sets, without init_process_group (the group of the harness is destroyed first).
        dist.destroy_process_group()
        os.environ["WORLD_SIZE"] = "2"
        try:
            with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*init_process_group"):
                fsdp_optim.fully_shard(_model())
        finally:
            os.environ["WORLD_SIZE"] = "1"
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return True

    assert run_distributed(fn, world_size=1) == [True]


@pytest.mark.parametrize("optimizer", ["torch", "ours"])
def test_optimizer_built_before_the_root_call_raises_at_its_first_step(optimizer):
    """An optimizer built between the layer calls and the root call holds replaced parameters (on main
    every update was 0.0, silently)."""

    def fn():
        model = _model()
        for layer in model.layers:
            fsdp_optim.fully_shard(layer)
        opt = torch.optim.AdamW(model.parameters(), lr=LR) if optimizer == "torch" else AdamW(model.parameters(), lr=LR)
        fsdp_optim.fully_shard(model)
        x, y = _batch(0)
        _loss(model, _local(x), _local(y)).backward()
        with pytest.raises(ValueError, match=r"fully_shard replaced.*after the outermost fully_shard"):
            opt.step()
        # Built after the root: fine.
        torch.optim.AdamW(model.parameters(), lr=LR).step()
        return True

    assert run_distributed(fn, world_size=2) == [True, True]


def test_ours_built_from_parameters_replaced_earlier_raises_at_construction():
    model = _model()
    params = list(model.parameters())
    _shard(model)
    with pytest.raises(ValueError, match="fully_shard replaced"):
        AdamW(params, lr=LR)


def test_forgotten_root_call_warns_naming_the_unmanaged_parameters():
    """Layers sharded but not the root: embeddings and head are never averaged (on main the ranks
    drifted apart without a word)."""

    def fn():
        model = _model()
        for layer in model.layers:
            fsdp_optim.fully_shard(layer)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        x, y = _batch(0)
        _loss(model, _local(x), _local(y)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        return [str(w.message) for w in caught]

    for msgs in run_distributed(fn, world_size=2):
        assert any("not managed by fully_shard" in m and "(101, 24)" in m for m in msgs), msgs


def test_debug_mode_names_a_rank_that_skips_backward_instead_of_hanging():
    """FSDP_OPTIM_DEBUG=1: ranks agree on each collective first; a rank that skips backward makes
    every rank raise, naming what each was about to do (without it, every rank hangs)."""

    def fn():
        os.environ["FSDP_OPTIM_DEBUG"] = "1"
        model = _shard(_model())
        x, y = _batch(0)
        loss = _loss(model, _local(x), _local(y))
        if dist.get_rank() == 0:
            loss.backward()
        _loss(model, _local(x), _local(y))  # rank 1 goes on to the next forward
        return True

    with pytest.raises(DistributedTestError, match=r"ranks disagree on the next collective.*rank 0: all_gather.*rank 1: all_gather"):
        run_distributed(fn, world_size=2, timeout=60)


def test_debug_mode_agrees_on_a_normal_step_and_changes_nothing():
    want = _reference(2)

    def fn():
        os.environ["FSDP_OPTIM_DEBUG"] = "1"
        model = _shard(_model())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(2):
            x, y = _batch(step)
            _loss(model, _local(x), _local(y)).backward()
            opt.step()
            opt.zero_grad()
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=3):
        _assert_close(got, want)
