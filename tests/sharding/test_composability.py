"""fully_shard with what real training jobs use: activation checkpointing, torch.compile, evaluation
between backward and step, gradient accumulation. Each run equals single-process torch.optim.AdamW
on the global batch (the reference nobody here wrote) within ``assert_close_after_adamw``'s bounds
(gradients reduced over ranks differ from one process's in float32 rounding; W = 3 divides nothing).
torch.compile uses the ``aot_eager`` backend to keep CI time small (inductor on CPU compiles for
tens of seconds per block).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

import fsdp_optim
from fsdp_optim._testing import run_distributed
from tests._models import TinyConfig, TinyTransformer, assert_close_after_adamw, make_batch

CFG = TinyConfig(vocab_size=101, dim=24, num_heads=2, num_layers=2, mlp_dim=40)
GLOBAL_BATCH, SEQ, LR, STEPS = 6, 8, 1e-2, 3


class _CheckpointedBlock(nn.Module):
    """A block whose forward recomputes its two halves in backward (non-reentrant checkpointing
    inside the sharded module)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CFG)


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _batch(step: int, micro: int = 0):
    return make_batch(batch_size=GLOBAL_BATCH, seq_len=SEQ, vocab_size=CFG.vocab_size, seed=100 + 10 * step + micro)


def _normalized(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """State dict keys without the wrappers' prefixes (checkpoint_wrapper, _CheckpointedBlock)."""
    return {k.replace("_checkpoint_wrapped_module.", "").replace(".block.", "."): v.detach().clone() for k, v in sd.items()}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return _normalized(model.state_dict())


def _reference(*, num_micro: int = 1) -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        for micro in range(num_micro):
            x, y = _batch(step, micro)
            (_loss(model, x, y) / num_micro).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def _local(t: torch.Tensor) -> torch.Tensor:
    w, r = dist.get_world_size(), dist.get_rank()
    n = t.shape[0] // w
    return t[r * n : (r + 1) * n]


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return _normalized(fsdp_optim.full_state_dict(model))


def _assert_close(got: dict, want: dict) -> None:
    assert_close_after_adamw(got, want, lr=LR)


def _wrap(model: TinyTransformer, how: str) -> None:
    """Apply ``how`` to every block, then shard blocks and root (the order torchtitan uses)."""
    for i, layer in enumerate(model.layers):
        if how == "checkpoint_wrapper":
            layer = checkpoint_wrapper(layer)
        elif how == "checkpoint_inside":
            layer = _CheckpointedBlock(layer)
        model.layers[i] = layer
        fsdp_optim.fully_shard(layer)
        if how == "compile":
            layer.compile(backend="aot_eager")
    fsdp_optim.fully_shard(model)


def _train(model: nn.Module, *, num_micro: int = 1, eval_between: str | None = None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        for micro in range(num_micro):
            model.set_requires_gradient_sync(micro == num_micro - 1)
            x, y = _batch(step, micro)
            (_loss(model, _local(x), _local(y)) / num_micro).backward()
        if eval_between == "no_grad":
            with torch.no_grad():
                _loss(model, _local(x), _local(y))
        elif eval_between == "grad":
            _loss(model, _local(x), _local(y))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("how", ["checkpoint_wrapper", "checkpoint_inside", "compile"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_blocks_wrapped_then_sharded_train_like_the_reference(how, world_size):
    want = _reference()

    def fn():
        model = _model()
        _wrap(model, how)
        _train(model)
        return _full_params(model)

    for got in run_distributed(fn, world_size=world_size, timeout=240):
        _assert_close(got, want)


@pytest.mark.parametrize("eval_between", ["no_grad", "grad"])
def test_evaluation_between_backward_and_step_with_checkpointing(eval_between):
    want = _reference()

    def fn():
        model = _model()
        _wrap(model, "checkpoint_wrapper")
        _train(model, eval_between=eval_between)
        return _full_params(model)

    for got in run_distributed(fn, world_size=3):
        _assert_close(got, want)


def test_gradient_accumulation_with_checkpointing():
    want = _reference(num_micro=2)

    def fn():
        model = _model()
        _wrap(model, "checkpoint_wrapper")
        _train(model, num_micro=2)
        return _full_params(model)

    for got in run_distributed(fn, world_size=3):
        _assert_close(got, want)


class _ConvAttention(nn.Module):
    """A conv, a BatchNorm and self-attention (``nn.MultiheadAttention`` takes its fused path only
    when ``query is key is value``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.norm = nn.BatchNorm1d(6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.same_inputs: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x)).transpose(1, 2)
        return self.attn(h, h, h, need_weights=False)[0].square().mean()


def _attend(model: _ConvAttention, x: torch.Tensor) -> torch.Tensor:
    def probe(module, args, kwargs):
        q, k, v = args[:3]
        model.same_inputs.append(q is k and k is v)

    handle = model.attn.register_forward_pre_hook(probe, with_kwargs=True)
    try:
        return model(x)
    finally:
        handle.remove()


@pytest.mark.parametrize("mp", [False, True])
def test_one_input_object_stays_one_object(mp):
    # Issue #29: MHA in its own fully_shard call saw three different objects for its one input (the
    # post-backward identity, and casts under mixed precision, made one per position), took the
    # unfused path and ended 3.3e-3 off the unsharded run after 3 AdamW steps.
    policy = fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.float64) if mp else None

    def run(shard: bool):
        model = _ConvAttention().double() if mp else _ConvAttention()
        if shard:
            fsdp_optim.fully_shard(model.attn, mp_policy=policy)
            fsdp_optim.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(STEPS):
            torch.manual_seed(step)
            x = torch.randn(4, 6, 5, dtype=torch.float64 if mp else torch.float32)
            _attend(model, x).backward()
            opt.step()
            opt.zero_grad()
        params = fsdp_optim.full_state_dict(model) if shard else model.state_dict()
        out = {k: v.clone() for k, v in params.items()}, list(model.same_inputs)
        del model, opt
        return out

    def fn():
        return run(shard=True), run(shard=False)

    ((sharded, same), (reference, ref_same)) = run_distributed(fn, world_size=1)[0]
    assert all(same) and all(ref_same), (same, ref_same)
    for k, v in reference.items():
        assert torch.equal(sharded[k], v), (k, (sharded[k] - v).abs().max())
