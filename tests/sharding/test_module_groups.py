"""``fully_shard([m1, m2])``: several modules, one bucket (FSDP2's group form, torchtitan's wrapping of
the final norm and the head). [Note: module groups] in ``fsdp_optim/sharding/_runtime.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_optim
from fsdp_optim.sharding import RaggedDTensor
from fsdp_optim._testing import run_distributed
from fsdp_optim.sharding._fully_shard import _STATE
from tests._models import TinyConfig, TinyTransformer, assert_close_after_adamw, full, make_batch

CFG = TinyConfig(vocab_size=67, dim=20, num_heads=2, num_layers=2, mlp_dim=36)
GLOBAL_BATCH, SEQ, LR, STEPS = 12, 6, 1e-2, 4


def _batch(step: int):
    return make_batch(batch_size=GLOBAL_BATCH, seq_len=SEQ, vocab_size=CFG.vocab_size, seed=300 + step)


def _local(t: torch.Tensor) -> torch.Tensor:
    w, r = dist.get_world_size(), dist.get_rank()
    n = t.shape[0] // w
    return t[r * n : (r + 1) * n]


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _reference(cfg: TinyConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(model, *_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return {k: full(v) for k, v in model.state_dict().items()}


def _torchtitan_wrap(model: TinyTransformer, reshard: bool | None) -> TinyTransformer:
    """torchtitan's wrapping: the embedding, each layer, [norm, output] as one unit, then the root
    (tied embeddings: [embedding, norm, output] as one unit)."""
    if model.cfg.tie_embeddings:
        fsdp_optim.fully_shard([model.embed, model.norm, model.output], reshard_after_forward=reshard)
    else:
        fsdp_optim.fully_shard(model.embed)
        fsdp_optim.fully_shard([model.norm, model.output], reshard_after_forward=reshard)
    for layer in model.layers:
        fsdp_optim.fully_shard(layer)
    fsdp_optim.fully_shard(model)
    return model


@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize(("reshard", "tie"), [(None, False), (False, False), (True, False), (False, True)])
def test_torchtitan_wrapping_trains_like_one_process(world_size, reshard, tie):
    """AdamW over torchtitan's wrapping equals the single-process run (to the sharded-reduction
    tolerance); per step the group is gathered once in forward (not once per module), once more in
    backward only if it is freed after forward, and reduced once (tied: not after the head's backward
    and again after the embedding's)."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    want = _reference(cfg)

    def fn():
        torch.manual_seed(0)
        model = _torchtitan_wrap(TinyTransformer(cfg), reshard)
        group = getattr(model.norm, _STATE).bucket
        assert getattr(model.output, _STATE).bucket is group
        calls = {"all_gather": 0, "reduce_scatter": 0}
        for meth in calls:
            orig = getattr(group.buffer, meth)

            def counted(*a, _orig=orig, _meth=meth, **k):
                calls[_meth] += 1
                return _orig(*a, **k)

            setattr(group.buffer, meth, counted)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        per_step = []
        for step in range(STEPS):
            x, y = (_local(t) for t in _batch(step))
            calls.update(all_gather=0, reduce_scatter=0)
            loss = _loss(model, x, y)
            fwd = calls["all_gather"]
            held = group.gathered is not None and group.gathered.untyped_storage().nbytes() > 0
            loss.backward()
            per_step.append((fwd, calls["all_gather"] - fwd, held, calls["reduce_scatter"]))
            opt.step()
            opt.zero_grad()
        out = fsdp_optim.full_state_dict(model), per_step
        del model, opt
        return out

    kept = reshard is False  # None: an inner bucket, freed after forward
    for got, per_step in run_distributed(fn, world_size=world_size):
        assert_close_after_adamw(got, want, lr=LR)
        assert per_step == [(1, 0 if kept else 1, kept, 1)] * STEPS, per_step


class _TwoHeads(nn.Module):
    """A trunk and a group of [norm, head, aux head]; the auxiliary head runs on some steps only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, with_aux: bool, twice: bool) -> torch.Tensor:
        h = self.norm(torch.relu(self.trunk(x)))
        out = self.head(h).pow(2).mean()
        if twice:  # the head again, after the group's pass completed
            out = out + self.head(0.5 * h).pow(2).mean()
        return out + self.aux(h).pow(2).mean() if with_aux else out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_group_module_that_does_not_run_and_one_that_runs_twice(world_size):
    """The auxiliary head of a group skips some steps (the root's post-forward completes the group:
    freed, and gathered again by the next forward) and the head runs twice in one forward (its second
    call completes the pass and starts another): trained like one process, and no parameter of the
    group is left showing its gathered values after a forward."""
    plan = [(True, False), (False, False), (False, True), (True, True), (False, False)]

    def train(model, local):
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step, (with_aux, twice) in enumerate(plan):
            g = torch.Generator().manual_seed(step)
            model(local(torch.randn(12, 8, generator=g)), with_aux, twice).backward()
            opt.step()
            opt.zero_grad()

    model = _TwoHeads()
    train(model, lambda t: t)
    want = {k: full(v) for k, v in model.state_dict().items()}

    def fn():
        model = _TwoHeads()
        fsdp_optim.fully_shard([model.norm, model.head, model.aux])
        fsdp_optim.fully_shard(model)
        sharded_after = []
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step, (with_aux, twice) in enumerate(plan):
            g = torch.Generator().manual_seed(step)
            loss = model(_local(torch.randn(12, 8, generator=g)), with_aux, twice)
            sharded_after.append(all(isinstance(p, RaggedDTensor) for p in model.head.parameters()))
            loss.backward()
            opt.step()
            opt.zero_grad()
        out = fsdp_optim.full_state_dict(model), sharded_after
        del model, opt
        return out

    for got, sharded_after in run_distributed(fn, world_size=world_size):
        assert all(sharded_after)
        assert_close_after_adamw(got, want, lr=LR)


def test_a_group_as_the_only_call_is_its_own_root():
    """``fully_shard([a, b])`` with no enclosing call: the group is the root; its parameters are
    named as an ``nn.ModuleList`` of the modules would name them; training equals one process."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(5, 7)
            self.b = nn.Linear(7, 3)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    def steps(model, local):
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(3):
            x = local(torch.randn(12, 5, generator=torch.Generator().manual_seed(step)))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    ref = Two()
    steps(ref, lambda t: t)
    want = {k: v.detach() for k, v in ref.state_dict().items()}

    def fn():
        model = Two()
        fsdp_optim.fully_shard([model.a, model.b])
        names = sorted(p._fqn for p in model.parameters())
        steps(model, _local)
        out = fsdp_optim.full_state_dict(model), names
        del model
        return out

    for got, names in run_distributed(fn, world_size=2):
        assert names == ["0.bias", "0.weight", "1.bias", "1.weight"]
        assert_close_after_adamw(got, want, lr=LR)


def test_torchtitan_wrapping_checkpoint_resharded_to_another_world_size(tmp_path):
    """Saved at W = 2 with the group, loaded at W = 3 into a model wrapped per module (no group):
    the next step equals the run that never stopped (checkpoints are per parameter, not per bucket)."""
    path = str(tmp_path / "ckpt")

    def run(world_group: bool, save: bool, load: bool):
        torch.manual_seed(0)
        model = TinyTransformer(CFG)
        if world_group:
            _torchtitan_wrap(model, None)
        else:
            for layer in model.layers:
                fsdp_optim.fully_shard(layer)
            fsdp_optim.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        steps = range(2, 3) if load else range(2) if save else range(3)
        if load:
            fsdp_optim.load_checkpoint(path, model=model, optimizer=opt)
        for step in steps:
            x, y = (_local(t) for t in _batch(step))
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        if save:
            fsdp_optim.save_checkpoint(path, model=model, optimizer=opt)
        out = fsdp_optim.full_state_dict(model)
        del model, opt
        return out

    run_distributed(lambda: run(True, True, False), world_size=2)
    resumed = run_distributed(lambda: run(False, False, True), world_size=3)[0]
    straight = run_distributed(lambda: run(True, False, False), world_size=3)[0]
    for k, v in straight.items():
        torch.testing.assert_close(resumed[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize(
    ("arg", "match"),
    [
        ([], "an empty list"),
        ([nn.Linear(2, 2), "norm"], "a list of Linear, str"),
        ("model", "str"),
    ],
)
def test_bad_module_lists_are_refused_naming_them(arg, match):
    with pytest.raises(ValueError, match=f"fully_shard expects an nn.Module or a non-empty list of them, got {match}"):
        fsdp_optim.fully_shard(arg)


@pytest.mark.usefixtures("one_process_group")
def test_nested_or_repeated_modules_in_a_group_are_refused():
    model = TinyTransformer(CFG)
    with pytest.raises(ValueError, match=r"module 1 of the list \(Attention\) lies inside module 0 \(Block\)"):
        fsdp_optim.fully_shard([model.layers[0], model.layers[0].attn])
    with pytest.raises(ValueError, match=r"module 0 of the list \(RMSNorm\) appears twice"):
        fsdp_optim.fully_shard([model.norm, model.norm])
    fsdp_optim.fully_shard([model.norm, model.output])  # a failed call left nothing behind
    with pytest.raises(ValueError, match="module Linear was already passed to fully_shard"):
        fsdp_optim.fully_shard([model.output, model.embed])
    assert not hasattr(model.embed, _STATE)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_a_group_under_mixed_precision_checkpointing_and_hsdp_equals_separate_calls_bitwise(mesh_shape):
    """bf16 compute with fp32 reduction, activation checkpointing on every layer, FSDP over 2 ranks or
    HSDP 2 x 2: ``[norm, output]`` as one group trains bitwise like the norm in the root and the head
    in its own call (each element is summed over 2 ranks per stage, so the bucket layout cannot
    change its rounding)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    def train(grouped: bool) -> dict[str, torch.Tensor]:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape) :])
        mp = fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        torch.manual_seed(0)
        model = TinyTransformer(dataclasses.replace(CFG, tie_embeddings=False))
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
        fsdp_optim.fully_shard(model.embed, mesh=mesh, mp_policy=mp)
        fsdp_optim.fully_shard([model.norm, model.output] if grouped else model.output, mesh=mesh, mp_policy=mp)
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, mesh=mesh, mp_policy=mp)
        fsdp_optim.fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(3):
            x, y = (_local(t) for t in _batch(step))
            F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
        out = fsdp_optim.full_state_dict(model)
        del model, opt
        return out

    def fn():
        return train(True), train(False)

    for grouped, separate in run_distributed(fn, world_size=len(mesh_shape) * 2):
        assert grouped.keys() == separate.keys()
        for k, v in separate.items():
            assert torch.equal(grouped[k], v), k
