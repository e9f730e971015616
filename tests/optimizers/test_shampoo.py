"""Shampoo on shards equals the single-process run bitwise, and one block's step equals the
formula computed directly in float64."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from fsdp_optim._testing import DistributedTestError, make_sharded_param, run_distributed
from fsdp_optim.optimizers import Shampoo
from fsdp_optim.optimizers._shampoo import matrix_inverse_root, shampoo_blocks
from fsdp_optim.sharding import RaggedShard, elements, expert, rows
from fsdp_optim.sharding._shard_info import ShardInfo, set_shard_info

K = 4  # max_preconditioner_dim: small, so that shapes below have partial strips and column blocks
SHAPES = {
    "w1": (11, 9),  # strips 4,4,3 x column blocks 4,4,1
    "w2": (5, 3, 2),  # viewed as [5, 6]
    "experts": (3, 5, 6),  # expert(): 3 matrices [5, 6], strips 4,1 each
    "bias": (7,),  # 1-D: blocks of 4, 3 elements, one factor
    "scale": (),  # scalar
    "w3": (2, 13),  # one strip, column blocks 4,4,4,1
}
OPT = dict(
    lr=0.01, betas=(0.9, 0.99), epsilon=1e-12, momentum=0.5, nesterov=True, weight_decay=0.01,
    max_preconditioner_dim=K, precondition_frequency=2, grafting_beta2=0.999, grafting_epsilon=1e-8,
)  # fmt: skip
STEPS = 10


def _spec(name, shape):
    return Shampoo.rule(max_preconditioner_dim=K, per_expert=True)(name, torch.empty(shape), None)


def _init():
    gen = torch.Generator().manual_seed(3)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _grads(step):
    gen = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def strip_layout(shape, spec, world_size, shift: int) -> RaggedShard:
    """Uneven strip-aligned ranges (rank r gets ~ (r + shift) % W + 1 shares; some may be empty)."""
    geom = shampoo_blocks(tuple(shape), K, spec)
    numel = math.prod(shape)
    starts = [geom.strip_start_row(i) * geom.cols for i in range(geom.num_strips)] + [numel]
    weights = [(r + shift) % world_size for r in range(world_size)]  # one rank gets weight 0: empty
    tot = sum(weights) or 1
    acc, bounds = 0, [0]
    for w in weights[:-1]:
        acc += w
        bounds.append(starts[round(geom.num_strips * acc / tot)])
    bounds.append(numel)
    return RaggedShard(tuple(shape), tuple(bounds))


def run(world_size: int, *, count_comms: bool = False, steps: int = STEPS, opt_kw=None):
    init = _init()
    specs = {k: _spec(k, s) for k, s in SHAPES.items()}
    layouts = {k: strip_layout(s, specs[k], world_size, i) for i, (k, s) in enumerate(SHAPES.items())}

    def fn():
        rank = dist.get_rank()
        params = {k: make_sharded_param(init[k], spec=specs[k], layout=layouts[k], fqn=k) for k in SHAPES}
        opt = Shampoo(list(params.values()), **(opt_kw or OPT))
        comms = []
        for s in range(steps):
            g = _grads(s)
            for k, p in params.items():
                p.grad = layouts[k].shard(g[k], rank).clone()
            with CommDebugMode() if count_comms else contextlib.nullcontext() as mode:
                opt.step()
            if count_comms:
                comms.append({str(op): n for op, n in mode.get_comm_counts().items() if n})
        state = {k: {key: (opt.state_shards(p)[key], opt.state[p][key].clone()) for key in opt.state_shards(p)}
                 for k, p in params.items()}  # fmt: skip
        return {k: p.detach().clone() for k, p in params.items()}, state, comms

    outs = run_distributed(fn, world_size=world_size)
    result = {k: layouts[k].unshard([o[0][k] for o in outs]) for k in SHAPES}
    state = {}
    for k in SHAPES:  # assemble each state key's global flat vector from the ranks' StateShards
        for key in outs[0][1][k]:
            gnum = outs[0][1][k][key][0].global_numel
            full = torch.full((gnum,), float("nan"))
            for o in outs:
                sh, t = o[1][k][key]
                assert sh.global_numel == gnum and t.numel() == sh.end - sh.start
                full[sh.start : sh.end] = t.reshape(-1)
            assert not full.isnan().any(), (k, key)  # the ranks' ranges tile the global vector
            state[k, key] = full
    return result, state, [o[2] for o in outs]


@pytest.fixture(scope="module")
def single_process():
    return run(1)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_equals_single_process_bitwise(world_size, single_process):
    ref, ref_state, _ = single_process
    ours, state, comms = run(world_size, count_comms=True)
    for k in SHAPES:
        assert torch.equal(ours[k], ref[k]), f"{k}: max |diff| {(ours[k] - ref[k]).abs().max():.3e}"
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        assert torch.equal(state[key], ref_state[key]), key
    assert all(c == {} for per_rank in comms for c in per_rank), comms  # zero collectives in step()
    moved = {k: (ours[k] - _init()[k]).abs().max().item() for k in SHAPES}
    assert all(v > 1e-3 for v in moved.values()), moved  # every parameter really trained


def test_plain_parameters_equal_the_sharded_w1_run(single_process):
    ref, _, _ = single_process
    init = _init()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
        opt = Shampoo(list(params.values()), **OPT, blocks=Shampoo.rule(max_preconditioner_dim=K, per_expert=True))
        for s in range(STEPS):
            g = _grads(s)
            for k, p in params.items():
                p.grad = g[k].clone()
            opt.step()
    finally:
        torch.set_num_threads(n)
    for k in SHAPES:
        assert torch.equal(params[k].detach(), ref[k]), k


# ---- an independent float64 computation ---------------------------------------------------------
def _inv_root64(a: torch.Tensor, root: float, eps: float) -> torch.Tensor:
    """(a + eps I)^(-1/root) via SVD of the symmetric PSD ``a`` (not eigh, not our code)."""
    u, s, _ = torch.linalg.svd(a)
    return (u * (s + eps) ** (-1.0 / root)) @ u.T


@pytest.mark.parametrize("shape,tol", [((5, 5), 1e-5), ((8, 8), 1e-5), ((6, 5), 1e-3), ((5, 6), 1e-3)])
def test_one_block_step_equals_preconditioned_gradient_in_float64(shape, tol):
    """Step 1, one block: ``L^{-1/4} G R^{-1/4}`` with ``L = G G^T``, ``R = G^T G`` (the bias-corrected
    EMAs), grafted to the norm of Adam's first step ``g / (|g| + eps)``; computed from the SVD of G in
    float64: ``L^{-1/4} G R^{-1/4} = U diag(s (s^2 + eps)^{-1/2}) V^T``.

    Tolerance (of the largest update entry): square blocks 1e-5 (measured <= 2e-6: fp32 factors,
    matmuls and the final ``param - lr * D``). Rectangular blocks 1e-3 (measured <= 1.2e-4): one
    factor is rank-deficient, its fp32 null eigenvalues are rounding noise (~1e-7 of the largest, or
    clamped to 0) and their ``-1/4`` powers (up to ``eps^{-1/4} = 1e3``) amplify the fp32 rounding of
    G's components along them; inherent to fp32 factors, whatever precision ``eigh`` runs in."""
    torch.manual_seed(0)
    g = torch.randn(shape)
    p = torch.nn.Parameter(torch.randn(shape))
    p0 = p.detach().clone()
    eps = 1e-12
    opt = Shampoo([p], lr=0.1, betas=(0.0, 0.95), epsilon=eps, max_preconditioner_dim=8,
                  precondition_frequency=1, start_preconditioning_step=1)  # fmt: skip
    p.grad = g.clone()
    opt.step()
    g64 = g.double()
    u, s, vt = torch.linalg.svd(g64, full_matrices=False)
    pre = (u * (s * (s * s + eps) ** -0.5)) @ vt
    adam = g64 / (g64.abs() + 1e-8)
    want = -0.1 * pre * adam.norm() / pre.norm()
    got = (p.detach() - p0).double()
    assert (got - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("shape,override,eps", [((3,), 0, 1e-4), ((5, 5), 2, 1e-12), ((5, 5), 8, 1e-12)])
def test_one_factor_and_exponent_override_in_float64(shape, override, eps):
    """1-D blocks use ``L^{-1/2} g`` (``L = g g^T``: ``g (|g|^2 + eps)^{-1/2}``); ``exponent_override=p``
    gives ``L^{-1/p} G R^{-1/p} = U diag(s (s^2 + eps)^{-2/p}) V^T``. Grafted, float64, step 1;
    tolerance 1e-5 of the update. The 1-D factor at step 1 is rank 1: its fp32 null eigenvalues are
    rounding noise (~1e-7 of |g|^2) raised to -1/2, so epsilon must dominate that noise (1e-4 here;
    with 1e-12 the direction is 10% off, in any fp32-factor Shampoo)."""
    torch.manual_seed(6)
    g, p = torch.randn(shape), torch.nn.Parameter(torch.randn(shape))
    p0 = p.detach().clone()
    opt = Shampoo([p], lr=0.1, betas=(0.0, 0.95), epsilon=eps, max_preconditioner_dim=8, precondition_frequency=1,
                  start_preconditioning_step=1, exponent_override=override)  # fmt: skip
    p.grad = g.clone()
    opt.step()
    g64 = g.double()
    if g.ndim == 1:
        pre = g64 * (g64.square().sum() + eps) ** -0.5
    else:
        u, sv, vt = torch.linalg.svd(g64)
        pre = (u * (sv * (sv * sv + eps) ** (-2.0 / override))) @ vt
    adam = g64 / (g64.abs() + 1e-8)
    want = -0.1 * pre * adam.norm() / pre.norm()
    got = (p.detach() - p0).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_multi_step_blocks_equal_float64_reference():
    """Three steps on a [6, 5] parameter with k = 4 (blocks 4x4, 4x1, 2x4, 2x1): EMA factors with
    bias correction, filtered gradient, grafting, weight decay and Nesterov momentum, recomputed in
    float64 from the formulas (roots via SVD). Tolerance: 1e-5 of the largest update (measured 5e-7:
    fp32 state over three steps; epsilon = 1e-6 keeps the early rank-deficient factors' null
    directions from amplifying fp32 rounding, see the one-block test)."""
    torch.manual_seed(1)
    shape, k, lr, (b1, b2), gb2, geps, eps, wd, mu = (6, 5), 4, 0.05, (0.9, 0.95), 0.99, 1e-8, 1e-6, 0.1, 0.5
    gs = [torch.randn(shape) for _ in range(3)]
    p = torch.nn.Parameter(torch.randn(shape))
    x = p.detach().double().clone()
    x0 = x.clone()
    opt = Shampoo([p], lr=lr, betas=(b1, b2), epsilon=eps, momentum=mu, nesterov=True, weight_decay=wd,
                  max_preconditioner_dim=k, precondition_frequency=1, start_preconditioning_step=2,
                  grafting_beta2=gb2, grafting_epsilon=geps)  # fmt: skip
    blocks = [(slice(r, r + h), slice(c, c + w)) for r, h in ((0, 4), (4, 2)) for c, w in ((0, 4), (4, 1))]
    L = [torch.zeros(b[0].stop - b[0].start, b[0].stop - b[0].start, dtype=torch.float64) for b in blocks]
    R = [torch.zeros(b[1].stop - b[1].start, b[1].stop - b[1].start, dtype=torch.float64) for b in blocks]
    m = torch.zeros(shape, dtype=torch.float64)
    v = torch.zeros(shape, dtype=torch.float64)
    mom = torch.zeros(shape, dtype=torch.float64)
    for t, g in enumerate(gs, start=1):
        p.grad = g.clone()
        opt.step()
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = gb2 * v + (1 - gb2) * g * g
        gbar = m / (1 - b1**t)
        adam = gbar / ((v / (1 - gb2**t)).sqrt() + geps)
        d = adam.clone()
        for i, (rs, cs) in enumerate(blocks):
            gb = g[rs, cs]
            L[i] = b2 * L[i] + (1 - b2) * gb @ gb.T
            R[i] = b2 * R[i] + (1 - b2) * gb.T @ gb
            if t >= 2:
                bc = 1 - b2**t
                pre = _inv_root64(L[i] / bc, 4, eps) @ gbar[rs, cs] @ _inv_root64(R[i] / bc, 4, eps)
                d[rs, cs] = pre * adam[rs, cs].norm() / (pre.norm() + 1e-16)
        d = d + wd * x
        mom = mu * mom + d
        x = x - lr * (d + mu * mom)
    err = (p.detach().double() - x).abs().max()
    update = (x - x0).abs().max()
    assert err <= 1e-5 * update, (err.item(), update.item())


def test_matrix_inverse_root_against_svd_and_clamps_negative_eigenvalues():
    torch.manual_seed(2)
    a = torch.randn(7, 9)
    spd = (a @ a.T).float()  # full rank
    for root in (2, 4):
        got = matrix_inverse_root(spd, root, 1e-3).double()
        want = _inv_root64(spd.double(), root, 1e-3)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # fp32 result (~6e-8 relative)
    q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))
    d = torch.tensor([-1e-4, 0.0, 1.0, 4.0], dtype=torch.float64)  # a rounding-noise negative eigenvalue
    got = matrix_inverse_root((q * d) @ q.T, 4, 1e-6)
    want = (q * (d.clamp(min=0) + 1e-6) ** -0.25) @ q.T
    assert (got - want).abs().max() <= 1e-10 * want.abs().max()


# ---- geometry, state, errors ------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,spec", [((11, 9), rows(K)), ((7,), rows(K)), ((3, 5, 6), expert()), ((9, 2, 3), rows(K))]
)
def test_block_geometry_tiles_every_element_and_factor(shape, spec):
    """Brute force over every strip-aligned layout on 3 ranks: the local blocks of all ranks cover
    each element exactly once, and the local factor ranges tile the global factor vectors."""
    geom = shampoo_blocks(shape, K, spec)
    numel = math.prod(shape)
    starts = [geom.strip_start_row(i) * geom.cols for i in range(geom.num_strips)]
    total_left = geom.left_numel(0, geom.num_strips)
    for cuts in itertools.combinations_with_replacement(starts + [numel], 2):
        layout = RaggedShard(shape, (0, *cuts, numel))
        seen = torch.zeros(numel, dtype=torch.int32)
        left_ranges = []
        for r in range(3):
            p = torch.nn.Parameter(torch.zeros(layout.local_numel(r)))  # rank r's piece, no group needed
            set_shard_info(p, ShardInfo(fqn="x", shape=shape, spec=spec, layout=layout, rank=r))
            opt = Shampoo([p], max_preconditioner_dim=K)
            plan = opt._plans[p]
            base = layout.bounds[r]
            for b in plan.blocks:
                for i in range(b.rows):
                    s = base + (b.row0 + i) * geom.cols + b.col0
                    seen[s : s + b.cols] += 1
            sh = opt.state_shards(p)
            left_ranges.append((sh["left"].start, sh["left"].end))
            assert sh["left"].global_numel == total_left
            assert opt.state[p]["left"].numel() == sh["left"].end - sh["left"].start
        assert torch.equal(seen, torch.ones(numel, dtype=torch.int32))
        assert left_ranges[0][0] == 0 and left_ranges[-1][1] == total_left
        assert all(a[1] == b[0] for a, b in itertools.pairwise(left_ranges))


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_dict_keys_and_shapes_same_on_every_rank_and_after_step(world_size):
    init = _init()
    specs = {k: _spec(k, s) for k, s in SHAPES.items()}
    layouts = {k: strip_layout(s, specs[k], world_size, i) for i, (k, s) in enumerate(SHAPES.items())}

    def fn():
        params = [make_sharded_param(init[k], spec=specs[k], layout=layouts[k], fqn=k) for k in SHAPES]
        opt = Shampoo(params, **OPT)
        def desc():
            return {i: {k: tuple(v.shape) for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}

        before = desc()
        for p, k in zip(params, SHAPES):
            p.grad = layouts[k].shard(_grads(0)[k], dist.get_rank()).clone()
        opt.step()
        keys = {i: sorted(st) for i, st in opt.state_dict()["state"].items()}
        glob = {i: {k: v.global_numel for k, v in opt.state_shards(p).items()} for i, p in enumerate(params)}
        return before, desc(), keys, glob

    outs = run_distributed(fn, world_size=world_size)
    for before, after, keys, glob in outs:
        assert before == after
        assert keys == outs[0][2] and glob == outs[0][3]


def test_layout_that_cuts_a_strip_raises_naming_the_parameter_and_the_fix():
    full = torch.randn(9, 4)
    layout = RaggedShard((9, 4), (0, 12, 36))  # elements(1)-style cut after row 3: inside a 4-row strip

    def fn():
        p = make_sharded_param(full, spec=elements(1), layout=layout, fqn="layers.0.w")
        Shampoo([p], max_preconditioner_dim=4)

    with pytest.raises(DistributedTestError, match=r"ranks with errors: \[0, 1\]") as e:
        run_distributed(fn, world_size=2)
    assert "layers.0.w" in str(e.value) and "Shampoo.rule(max_preconditioner_dim=4)" in str(e.value)
    ok = make_sharded_param(full, spec=elements(1), layout=RaggedShard((9, 4), (0, 16, 36)), fqn="w")
    Shampoo([ok], max_preconditioner_dim=4)  # strips whole: accepted whatever the recorded spec


def test_grafting_only_before_start_and_lr_scheduler():
    """Before start_preconditioning_step the search direction is the Adam grafting direction, so
    the step is torch.optim.Adam's; an LR scheduler scales it."""
    torch.manual_seed(4)
    g = torch.randn(5, 3)
    p = torch.nn.Parameter(torch.randn(5, 3))
    q = torch.nn.Parameter(p.detach().clone())
    opt = Shampoo([p], lr=0.1, betas=(0.9, 0.999), grafting_beta2=0.999, start_preconditioning_step=3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    ref = torch.optim.Adam([q], lr=0.05, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(2):
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    del sched
    assert torch.allclose(p, q, rtol=0, atol=1e-6)  # the same math, different op order (fp32 rounding)


# ---- end to end with fully_shard ---------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
def test_fully_shard_with_shampoo_rule_equals_single_process(world_size):
    """fully_shard(..., blocks=Shampoo.rule(k)) + Shampoo vs plain Shampoo on the unsharded model;
    every rank sees the same batch, so gradients (and results) are bitwise the single-process ones."""
    from fsdp_optim import fully_shard  # an import error here is a failure, never a skip

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(9, 11), torch.nn.Tanh(), torch.nn.Linear(11, 6))

    def fn():
        model, ref = make(), make()
        rule = Shampoo.rule(max_preconditioner_dim=K)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, blocks=rule)
        fully_shard(model, blocks=rule)
        kw = dict(OPT, precondition_frequency=2)
        opt, opt_ref = Shampoo(model.parameters(), **kw), Shampoo(ref.parameters(), **kw)
        for s in range(5):
            x = torch.randn(5, 9, generator=torch.Generator().manual_seed(s))
            for m, o in ((model, opt), (ref, opt_ref)):
                m(x).square().sum().backward()
                o.step()
                o.zero_grad()
        from fsdp_optim.sharding._shard_info import shard_info

        return [(n, torch.equal(p.detach(), shard_info(p).layout.shard(q.detach(), shard_info(p).rank)))
                for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())]  # fmt: skip

    for per_rank in run_distributed(fn, world_size=world_size):
        assert all(ok for _, ok in per_rank), per_rank


def test_load_state_dict_keeps_fp32_state_for_bf16_params_and_resumes_exactly():
    def make():
        torch.manual_seed(5)
        return torch.nn.Parameter(torch.randn(6, 5).bfloat16())

    kw = dict(max_preconditioner_dim=4, precondition_frequency=2, momentum=0.5)
    grads = [torch.randn(6, 5, generator=torch.Generator().manual_seed(s)).bfloat16() for s in range(5)]
    a = make()
    opt_a = Shampoo([a], **kw)
    for g in grads[:3]:
        a.grad = g.clone()
        opt_a.step()
    b = torch.nn.Parameter(a.detach().clone())
    opt_b = Shampoo([b], **kw)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert all(v.dtype == torch.float32 for k, v in opt_b.state[b].items())
    for g in grads[3:]:
        for p, o in ((a, opt_a), (b, opt_b)):
            p.grad = g.clone()
            o.step()
    assert torch.equal(a, b)
