"""AdamW on sharded params equals torch.optim.AdamW on the full tensors, bitwise, for every W."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from fsdp_optim._testing import make_sharded_param, run_distributed, sharded_grad, train_steps
from fsdp_optim.optimizers import AdamW, adamw_update
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding import elements
from fsdp_optim.sharding.contract import local_tensor

# Shapes that divide nothing (and a few degenerate ones): 1-D, 2-D, 3-D, one element.
SHAPES = [(37, 19), (5,), (1,), (3, 7, 5), (2, 1)]
NUM_STEPS = 4


def random_layout(shape, world_size: int, seed: int, align: int = 1) -> RaggedLayout:
    """Random contiguous ranges, some empty (first rank empty for odd seeds), cut at multiples of ``align``."""
    rng = random.Random(seed)
    numel = torch.Size(shape).numel()
    cuts = sorted(rng.randrange(0, numel + 1) // align * align for _ in range(world_size - 1))
    if seed % 2 and cuts:
        cuts[0] = 0  # rank 0 holds nothing
    return RaggedLayout(tuple(shape), (0, *cuts, numel))


def make_data(shapes, num_steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(num_steps)]
    return params, grads


def reference(params, grads, *, scheduler=None, param_groups=None, **kw):
    """torch.optim.AdamW on the full tensors; returns final params and states."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ps if param_groups is None else param_groups(ps), **kw)
    train_steps(opt, ps, grads, scheduler=scheduler(opt) if scheduler else None)
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]
    return [local_tensor(p).clone() for p in ps], states


def sharded_run(params, grads, layouts, *, scheduler=None, param_groups=None, **kw):
    """Our AdamW on each rank's pieces; returns (rank, local params, local states)."""

    def fn():
        ps = [make_sharded_param(f, spec=elements(1), layout=lay, fqn=f"p{i}") for i, (f, lay) in enumerate(zip(params, layouts))]
        opt = AdamW(ps if param_groups is None else param_groups(ps), **kw)
        train_steps(opt, ps, grads, scheduler=scheduler(opt) if scheduler else None, layouts=layouts)
        return [p.to_local().clone() for p in ps], [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]

    return run_distributed(fn, world_size=layouts[0].world_size)


def assert_equal_to_reference(out, ref, layouts):
    ref_params, ref_states = ref
    for i, lay in enumerate(layouts):
        got = lay.unshard([o[0][i] for o in out])
        assert torch.equal(got, ref_params[i]), f"param {i} (shape {lay.shape}): max diff {(got - ref_params[i]).abs().max()}"
        for key, ref_val in ref_states[i].items():
            if key == "step":
                assert all(torch.equal(o[1][i]["step"], ref_val) for o in out)
                continue
            got = lay.unshard([o[1][i][key] for o in out])
            assert torch.equal(got, ref_val), f"state {key} of param {i} differs"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "hp",
    [
        {},
        dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
        dict(amsgrad=True, maximize=True, weight_decay=0.0),
        dict(foreach=True, amsgrad=True),
        dict(lr=torch.tensor(3e-3), foreach=False),
    ],
    ids=["defaults", "hparams", "amsgrad-maximize", "foreach", "tensor-lr"],
)
def test_matches_torch_adamw(world_size, hp):
    params, grads = make_data(SHAPES, NUM_STEPS)
    layouts = [random_layout(s, world_size, seed=world_size * 10 + i) for i, s in enumerate(SHAPES)]
    ref = reference(params, grads, **hp)
    out = sharded_run(params, grads, layouts, **hp)
    assert_equal_to_reference(out, ref, layouts)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_matches_torch_fused_on_simd_aligned_layouts(world_size):
    # See [Note: bitwise equality and kernel paths]: torch's fused CPU kernel is bitwise only when
    # shard boundaries are multiples of the SIMD width, so cut at multiples of 64 here.
    shapes = [(40, 17), (300,), (3,)]
    params, grads = make_data(shapes, NUM_STEPS)
    layouts = [random_layout(s, world_size, seed=i + 1, align=64) for i, s in enumerate(shapes)]
    ref = reference(params, grads, fused=True)
    out = sharded_run(params, grads, layouts, fused=True)
    assert_equal_to_reference(out, ref, layouts)


@pytest.mark.parametrize("world_size", [1, 3])
def test_lr_scheduler_and_param_groups(world_size):
    params, grads = make_data(SHAPES, 5)
    layouts = [random_layout(s, world_size, seed=i) for i, s in enumerate(SHAPES)]

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-2, "weight_decay": 0.0, "betas": (0.5, 0.9)}]

    def sched(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 2e-2], total_steps=10)

    ref = reference(params, grads, scheduler=sched, param_groups=groups)
    out = sharded_run(params, grads, layouts, scheduler=sched, param_groups=groups)
    assert_equal_to_reference(out, ref, layouts)


def test_plain_parameters_match_torch():
    params, grads = make_data(SHAPES, NUM_STEPS)
    ref = reference(params, grads, weight_decay=0.05)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = AdamW(ps, weight_decay=0.05)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    for p, r in zip(ps, ref[0]):
        assert torch.equal(local_tensor(p).detach(), r)


def test_skips_params_without_grad_like_torch():
    params, grads = make_data([(4, 3), (6,)], 2)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    qs = [torch.nn.Parameter(p.clone()) for p in params]
    ours, theirs = AdamW(ps), torch.optim.AdamW(qs)
    for gs in grads:
        ps[0].grad, qs[0].grad = gs[0].clone(), gs[0].clone()
        ours.step()
        theirs.step()
    assert torch.equal(ps[0].detach(), qs[0].detach())
    assert torch.equal(ps[1].detach(), params[1])
    assert ours.state[ps[1]]["step"].item() == 0.0  # state exists (eager) but was not stepped


@pytest.mark.parametrize("world_size", [3])
def test_state_is_checkpoint_shaped_and_step_is_collective_free(world_size):
    params, grads = make_data(SHAPES, 2)
    layouts = [random_layout(s, world_size, seed=i + 1) for i, s in enumerate(SHAPES)]

    def fn():
        rank = dist.get_rank()
        ps = [make_sharded_param(f, spec=elements(1), layout=lay) for f, lay in zip(params, layouts)]
        opt = AdamW(ps, amsgrad=True)

        def describe():
            sd = opt.state_dict()["state"]
            return {i: {k: (tuple(opt.state_shards(ps[i]).get(k, (None,))[:1]), v.dtype) for k, v in sd[i].items()} for i in sd}

        before = describe()
        shards = [opt.state_shards(p) for p in ps]
        for p, g, lay in zip(ps, grads[0], layouts):
            p.grad = sharded_grad(p, g)
        with CommDebugMode() as comm:
            opt.step()
        step_collectives = comm.get_total_counts()
        with CommDebugMode() as control:  # positive control: the counter sees gloo c10d ops
            dist.all_reduce(torch.ones(1))
        after = describe()
        for p, sh in zip(ps, shards):
            for key, s in sh.items():
                assert opt.state[p][key].numel() == s.end - s.start and opt.state[p][key].is_contiguous()
        return before, after, step_collectives, control.get_total_counts(), [{k: tuple(v) for k, v in sh.items()} for sh in shards]

    out = run_distributed(fn, world_size=world_size)
    for before, after, num_step, num_control, shards in out:
        assert before == after == out[0][0]  # same keys, global sizes and dtypes on every rank, before/after
        assert num_step == 0
        assert num_control == 1
    for i, lay in enumerate(layouts):
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            ranges = [out[r][4][i][key] for r in range(world_size)]
            assert ranges == [(lay.numel, *lay.range(r), lay.bounds, False, None) for r in range(world_size)]


def test_state_dict_round_trip_continues_bitwise():
    params, grads = make_data(SHAPES, 4)
    ref = reference(params, grads)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = AdamW(ps)
    for gs in grads[:2]:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    sd = opt.state_dict()
    opt2 = AdamW(ps)
    opt2.load_state_dict(sd)
    for gs in grads[2:]:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt2.step()
    for p, r in zip(ps, ref[0]):
        assert torch.equal(local_tensor(p).detach(), r)


def test_loads_a_torch_adamw_state_dict():
    params, grads = make_data(SHAPES, 3)
    ref = reference(params, grads)
    qs = [torch.nn.Parameter(p.clone()) for p in params]
    theirs = torch.optim.AdamW(qs)
    for p, g in zip(qs, grads[0]):
        p.grad = g.clone()
    theirs.step()
    ours = AdamW(qs)
    ours.load_state_dict(theirs.state_dict())
    for gs in grads[1:]:
        for p, g in zip(qs, gs):
            p.grad = g.clone()
        ours.step()
    for p, r in zip(qs, ref[0]):
        assert torch.equal(local_tensor(p).detach(), r)


def test_adamw_update_function_equals_torch():
    params, grads = make_data([(9, 4), (0,), (3,)], 3)
    ref = reference(params, grads, lr=1e-2, weight_decay=0.1, amsgrad=True)
    ps = [p.clone() for p in params]
    ms, vs, mx = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    steps = [torch.tensor(0.0) for _ in ps]
    for gs in grads:
        adamw_update(ps, gs, ms, vs, steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                     amsgrad=True, max_exp_avg_sqs=mx)
    for p, r in zip(ps, ref[0]):
        assert torch.equal(p, r)
    with pytest.raises(ValueError, match="max_exp_avg_sqs"):
        adamw_update(ps, grads[0], ms, vs, steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(lr=-1.0), "lr must be"),
        (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
        (dict(eps=-1.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(fused=True, foreach=True), "fused=True and foreach=True"),
        (dict(lr=torch.tensor(1e-3), foreach=True), "tensor lr"),
    ],
)
def test_rejects_bad_hyperparameters(kw, match):
    with pytest.raises(ValueError, match=match):
        AdamW([torch.nn.Parameter(torch.zeros(3))], **kw)


def test_blocks_rule_is_element_wise():
    assert AdamW.blocks("x.weight", torch.zeros(3, 4), None) == elements(1)
