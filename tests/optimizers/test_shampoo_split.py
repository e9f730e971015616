"""Shampoo with split strips (a strip cut across ranks on rows of its merged view; [Note: Shampoo
split strips]) equals the single-process Shampoo bitwise, with one all_to_all_single pair per step."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch
import torch.distributed as dist

from fsdp_optim._testing import make_sharded_param, run_distributed, sharded_grad
from fsdp_optim.optimizers import Shampoo
from fsdp_optim.optimizers._shampoo import shampoo_blocks
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding.contract import local_tensor
from tests.optimizers.test_shampoo import K, OPT, SHAPES, _grads, _init, _spec, run_layouts

STEPS = 5
SPLIT = ("w1", "w2", "experts", "bias", "w3", "row", "w4")  # shapes with more than one merged row
CONFIGS = {
    "adam_nesterov_wd": dict(OPT, precondition_frequency=2, start_preconditioning_step=3),
    "none_beta1_0_f64": dict(OPT, betas=(0.0, 0.99), grafting=None, grafting_beta2=None, momentum=0.0,
                             nesterov=False, weight_decay=0.0, factor_matrix_dtype=torch.float64),
    "adagrad_momentum": dict(OPT, grafting="adagrad", grafting_beta2=None, nesterov=False, betas=(0.5, 1.0)),
}  # fmt: skip


def row_layout(shape, spec, world_size: int, seed: int) -> RaggedLayout:
    """Random ranges of ``shape`` cut on rows of the merged view (some empty), at least one boundary
    inside a strip when there is more than one row."""
    geom = shampoo_blocks(tuple(shape), K, spec)
    numel, cols = math.prod(shape), geom.cols
    rows = numel // cols if cols else 0
    rng = random.Random(seed)
    cuts = sorted(rng.randint(0, rows) for _ in range(world_size - 1))
    if rows > 1 and all(geom.is_strip_boundary(c * cols) for c in cuts):
        cuts[-1] = next(r for r in range(1, rows) if not geom.is_strip_boundary(r * cols))  # cut inside a strip
        cuts.sort()
    return RaggedLayout(tuple(shape), (0, *(c * cols for c in cuts), numel))


def run(world_size: int, opt_kw, *, split: bool = True, steps: int = STEPS, seed: int = 0):
    """Params per SHAPES, ``split``: row layouts recorded as split; else one rank (rank 0) holds all."""
    specs = {k: _spec(k, s) for k, s in SHAPES.items()}
    if world_size == 1 or not split:
        layouts = {k: RaggedLayout(s, (0, *[math.prod(s)] * world_size)) for k, s in SHAPES.items()}
    else:
        layouts = {k: row_layout(s, specs[k], world_size, seed + i) for i, (k, s) in enumerate(SHAPES.items())}

    result, state, comms = run_layouts(world_size, layouts, opt_kw=opt_kw, steps=steps, split=split)
    return result, state, comms, layouts


_REF: dict = {}


def reference(name: str, batched: bool):
    if (name, batched) not in _REF:
        _REF[name, batched] = run(1, dict(CONFIGS[name], batched=batched))
    return _REF[name, batched]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_split_strips_equal_single_process_bitwise_with_one_exchange_pair(world_size, batched):
    for i, name in enumerate(CONFIGS):
        ref, ref_state, _, _ = reference(name, batched)
        ours, state, comms, layouts = run(world_size, dict(CONFIGS[name], batched=batched), seed=10 * world_size + i)
        cut = [k for k in SPLIT if not all(shampoo_blocks(SHAPES[k], K, _spec(k, SHAPES[k])).is_strip_boundary(b)
                                           for b in layouts[k].bounds)]  # fmt: skip
        assert len(cut) >= 3, cut  # really split strips
        for k in SHAPES:
            assert torch.equal(ours[k], ref[k]), f"{name} {k}: max |diff| {(ours[k] - ref[k]).abs().max():.3e}"
        assert state.keys() == ref_state.keys()
        for key in ref_state:
            assert torch.equal(state[key], ref_state[key]), (name, key)
        want = {"c10d.alltoall_base_": 2, "c10d.allreduce_": 1}  # the pair, and the agreed finite check
        assert all(c == want for per_rank in comms for c in per_rank), comms


def test_no_split_strip_no_collective():
    """Layouts recorded as split but holding whole strips (all on rank 0): no exchange at all."""
    _, _, comms, _ = run(2, dict(CONFIGS["adam_nesterov_wd"]), split=False, steps=2)
    assert all(c == {} for per_rank in comms for c in per_rank), comms


# ---- fully_shard plans with split strips, checkpoints across world sizes ---------------------------
SPLIT_PLAN = dict(layout="ragged", balance="auto", balance_cap=1.0, piece_align_bytes=1)
MODEL_OPT = dict(OPT, precondition_frequency=2, start_preconditioning_step=2, batched=False)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 23), torch.nn.Tanh(), torch.nn.Linear(23, 7))


def _batch(s: int) -> torch.Tensor:
    return torch.randn(5, 9, generator=torch.Generator().manual_seed(s))


def _train(model, opt, steps) -> None:
    for s in steps:
        model(_batch(s)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _sharded():
    from fsdp_optim import fully_shard
    from fsdp_optim.sharding import PlanConfig

    model = _model()
    fully_shard(model, blocks=Shampoo.rule(max_preconditioner_dim=K), plan_config=PlanConfig(**SPLIT_PLAN))
    return model


def test_fully_shard_plan_splits_strips_and_checkpoint_reshards_w2_to_w4_and_w1(tmp_path):
    """fully_shard's planner (balance="auto", a cap whole strips miss) cuts strips on rows; Shampoo
    takes them; a checkpoint saved at W=2 loads at W=4 (another plan) and W=1 and the next step equals the
    uninterrupted single-process run. (W=4, not 3: fully_shard averages the ranks' equal gradients,
    and ``(g + g + g) / 3`` is not always ``g``.)"""
    import fsdp_optim
    from fsdp_optim.sharding.contract import local_shard

    def uninterrupted():  # in a rank too: the ranks' thread settings decide the gradients' bits
        ref = _model()
        _train(ref, Shampoo(ref.parameters(), **MODEL_OPT), range(3))
        return {n: local_tensor(p).clone() for n, p in ref.named_parameters()}

    (want,) = run_distributed(uninterrupted, world_size=1)

    def save():
        model = _sharded()
        opt = Shampoo(model.parameters(), **MODEL_OPT)
        _train(model, opt, range(2))
        fsdp_optim.save_checkpoint(tmp_path / "ck", model=model, optimizer=opt)
        return [n for n, p in model.named_parameters() if local_shard(p).split]

    def load():
        model = _sharded()
        opt = Shampoo(model.parameters(), **MODEL_OPT)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "checkpoint saved at world size", UserWarning)  # RNG states
            fsdp_optim.load_checkpoint(tmp_path / "ck", model=model, optimizer=opt)
        _train(model, opt, range(2, 3))
        split = [n for n, p in model.named_parameters() if local_shard(p).split]
        return split, {n: (local_shard(p).start, local_tensor(p).clone()) for n, p in model.named_parameters()}

    assert all(run_distributed(save, world_size=2))  # some parameter has split strips at W=2
    for world_size in (4, 1):
        outs = run_distributed(load, world_size=world_size)
        assert bool(outs[0][0]) == (world_size > 1), outs[0][0]  # W=4: split strips again (another plan)
        for n, w in want.items():
            flat = w.reshape(-1)
            for _, got in outs:
                start, piece = got[n]
                assert torch.equal(piece, flat[start : start + piece.numel()]), (world_size, n, start)


# ---- the rule, the planner, refusals -----------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "k"),
    [((11, 9), 4), ((5, 3, 2), 4), ((4, 6), 1024), ((37, 13), 8), ((3, 1, 2, 2), 4), ((9, 300, 4), 1024), ((7,), 4)],
)
def test_planner_cuts_shampoo_strips_on_rows_of_the_merged_view(shape, k):
    """The planner's row unit for a Shampoo spec is a multiple of a row of the merged view, and a
    plan that must cut a strip (balance_cap 1.0, W=3) records it and cuts only there."""
    from fsdp_optim.sharding import PlanConfig
    from fsdp_optim.sharding.plan import TensorSpec, config_for_rules, plan_model

    rule = Shampoo.rule(max_preconditioner_dim=k)
    spec = rule("w", torch.empty(shape), None)
    geom = shampoo_blocks(shape, k, spec)
    assert spec.splits_on_rows and spec.split_unit(shape) % geom.cols == 0
    config = config_for_rules(PlanConfig(layout="ragged", balance_cap=1.0, piece_align_bytes=1), [rule])
    assert config.balance == "auto"
    plan = plan_model([("b", [TensorSpec(name="w", shape=shape, spec=spec)])], world_size=3, config=config)
    (p,) = plan.buckets[0].placements
    assert all(b % geom.cols == 0 for b in p.shard.bounds)
    assert p.split == (not all(geom.is_strip_boundary(b) for b in p.shard.bounds))


def test_soap_strip_rule_keeps_refusing_split_strips():
    from fsdp_optim.optimizers import SOAP
    from fsdp_optim.sharding import PlanConfig
    from fsdp_optim.sharding.plan import config_for_rules

    rule = SOAP.rule(block_size=4)
    assert not getattr(rule, "splits_blocks", False)
    assert config_for_rules(PlanConfig(), [rule]).balance == "whole"
    assert config_for_rules(PlanConfig(), [Shampoo.rule(max_preconditioner_dim=4)]).balance == "auto"
    full = torch.randn(9, 4)

    def fn():
        p = make_sharded_param(full, spec=rule("w", full, None), layout=RaggedLayout((9, 4), (0, 12, 36)), fqn="w",
                               split=True)  # fmt: skip
        with pytest.raises(ValueError, match="SOAP"):
            SOAP([p], block_size=4)
        Shampoo([p], max_preconditioner_dim=4)  # Shampoo takes it (recorded split, on a row)

    run_distributed(fn, world_size=2)


def test_split_strip_cut_off_a_merged_row_is_refused():
    """A recorded split must still fall on rows of the merged view ((3, 5, 2): rows of 10 elements)."""
    full = torch.randn(3, 5, 2)

    def fn():
        spec = Shampoo.rule(max_preconditioner_dim=K)("w", full, None)  # rows(4): one strip, rows of 10
        p = make_sharded_param(full, spec=spec, layout=RaggedLayout((3, 5, 2), (0, 4, 30)), fqn="w", split=True)
        with pytest.raises(ValueError, match=r"split strips cut on rows of its merged shape \(3, 5, 2\)"):
            Shampoo([p], max_preconditioner_dim=K)

    run_distributed(fn, world_size=2)


def test_non_finite_gradient_with_split_strips_raises_on_every_rank_changing_nothing():
    init, specs = _init(), {k: _spec(k, s) for k, s in SHAPES.items()}
    layouts = {k: row_layout(s, specs[k], 3, i) for i, (k, s) in enumerate(SHAPES.items())}
    b = layouts["w1"].bounds
    bad = max(r for r in range(3) if b[r] < b[r + 1])  # a rank holding part of w1

    def fn():
        rank = dist.get_rank()
        params = {k: make_sharded_param(init[k], spec=specs[k], layout=layouts[k], fqn=k, split=True) for k in SHAPES}
        opt = Shampoo(list(params.values()), **CONFIGS["adam_nesterov_wd"])
        g = _grads(0)
        if rank == bad:
            g["w1"].view(-1)[b[bad]] = float("nan")  # its first element
        for k, p in params.items():
            p.grad = sharded_grad(p, g[k])
        before = {k: {key: v.clone() for key, v in opt.state[p].items()} for k, p in params.items()}
        with pytest.raises(FloatingPointError, match=rf"w1 \(shape \(11, 9\), rank {bad}\)"):
            opt.step()
        assert all(torch.equal(v, opt.state[p][key]) for k, p in params.items() for key, v in before[k].items())

    run_distributed(fn, world_size=3)
