"""SOAP: whole-tensor SOAP equals an independent float64 reimplementation of the algorithm (written
here from the paper and the reference's documented semantics, not copied); block SOAP on shards
equals the single-process run bitwise for W = 1..4 with zero collectives; state reshards 2 -> 3."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from fsdp_optim._testing import DistributedTestError, make_sharded_param, run_distributed, seeded_tensors, sharded_grad
from fsdp_optim.optimizers import SOAP
from fsdp_optim.optimizers._preconditioner import outer as _outer
from fsdp_optim.optimizers._soap import _rotate, reference_merge_dims
from fsdp_optim.optimizers._shampoo import shampoo_blocks
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding import elements, whole
from fsdp_optim.sharding.contract import local_tensor
from tests.optimizers.test_linalg import last_param_after
from tests.optimizers.test_shampoo import _split64, assert_step_refused_changing_nothing


# ---- an independent float64 SOAP (Vyas et al. 2024, Algorithm 1 + the reference's schedule) -------
def _paper_rotate(x, qs, *, back):
    """``Q_L^T X Q_R`` (``back``: ``Q_L X Q_R^T``) of a vector or matrix; a ``None`` basis is the identity."""
    qs = [torch.eye(n, dtype=torch.float64) if q is None else q for q, n in zip(qs, x.shape)]
    if x.ndim == 1:
        return qs[0] @ x if back else qs[0].T @ x
    return qs[0] @ x @ qs[1].T if back else qs[0].T @ x @ qs[1]


def _paper_outers(g):
    return [torch.outer(g, g)] if g.ndim == 1 else [g @ g.T, g.T @ g]


def _paper_soap(x0, grads, *, lr, betas, eps, wd, freq, max_dim, block=None, normalize=False, correct_bias=True,
                precondition_1d=False):  # fmt: skip
    """SOAP on a vector or matrix, float64, explicit left/right matrices. Schedule of the authors'
    reference (documented in docs/soap.md): step 1 only builds the factors and their eigenbases (no
    update); Adam moments live in the rotated basis; the first moment is rotated back and forth
    around every factor update; every ``freq`` Adam steps the bases are refreshed by one power
    iteration + QR with the columns (and the second moment) sorted by estimated eigenvalue; a dim
    larger than ``max_dim`` is not rotated (identity), nor a vector's without ``precondition_1d``.
    ``block = k``: every k-chunk of every dim (a tensor whose merged shape is its shape) is its own
    SOAP tensor; ``normalize``: the direction divided by its RMS (per tensor or block); without
    ``correct_bias`` the step size is ``lr``."""
    b1, b2 = betas
    x = x0.double().clone()
    units = (lambda t: [t]) if block is None else (lambda t: _split64(t, block))  # noqa: E731 - views
    st = []
    for u in units(x):
        rot = [n <= max_dim and (u.ndim == 2 or precondition_1d) for n in u.shape]
        st.append(dict(rot=rot, F=[None] * u.ndim, Q=[None] * u.ndim, m=torch.zeros_like(u), v=torch.zeros_like(u)))

    def eig_desc(a):
        _, q = torch.linalg.eigh(a)
        return q.flip(1)

    for t, g in enumerate(grads, start=1):
        g = g.double()
        if t == 1:
            for s_, gu in zip(st, units(g)):
                s_["F"] = [(1 - b2) * o for o in _paper_outers(gu)]
                s_["Q"] = [eig_desc(f) if r else None for f, r in zip(s_["F"], s_["rot"])]
            continue
        s = t - 1
        d = torch.zeros_like(x)
        for s_, gu, du in zip(st, units(g), units(d)):
            gp = _paper_rotate(gu, s_["Q"], back=False)
            s_["m"] = b1 * s_["m"] + (1 - b1) * gp
            s_["v"] = b2 * s_["v"] + (1 - b2) * gp * gp
            n = _paper_rotate(s_["m"] / (s_["v"].sqrt() + eps), s_["Q"], back=True)
            du.copy_(n / (1e-30 + n.square().mean().sqrt()) if normalize else n)
        x = x - (lr * math.sqrt(1 - b2**s) / (1 - b1**s) if correct_bias else lr) * d
        x = x - lr * wd * x
        for s_, gu in zip(st, units(g)):
            m = _paper_rotate(s_["m"], s_["Q"], back=True)  # back to the original space
            s_["F"] = [b2 * f + (1 - b2) * o for f, o in zip(s_["F"], _paper_outers(gu))]
            if s % freq == 0:
                for i, (f, q) in enumerate(zip(s_["F"], s_["Q"])):
                    if q is not None:
                        idx = torch.argsort(torch.diag(q.T @ f @ q), descending=True)
                        s_["v"], s_["Q"][i] = s_["v"].index_select(i, idx), torch.linalg.qr(f @ q[:, idx]).Q
            s_["m"] = _paper_rotate(m, s_["Q"], back=False)
    return x


@pytest.mark.parametrize("shape,max_dim", [((8, 8), 10000), ((6, 6), 10000), ((12, 4), 8), ((5, 7), 6)])
def test_whole_tensor_soap_equals_independent_float64_soap(shape, max_dim):
    """12 steps, frequency 3 (four QR refreshes). Tolerance 1e-4 of the update (measured <= 5.3e-6):
    ours runs in fp32 (as the reference), so eigh/QR bases and the Adam scaling ``1 / (sqrt(v) +
    eps)`` carry fp32 rounding; full-rank factors keep every rotated direction well above eps."""
    gen = torch.Generator().manual_seed(shape[0] * 10 + shape[1])
    x0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(12)]
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, precondition_frequency=3, max_precond_dim=max_dim)
    want = _paper_soap(x0, grads, lr=0.01, betas=(0.9, 0.95), eps=1e-8, wd=0.1, freq=3, max_dim=max_dim)
    p = torch.nn.Parameter(x0.clone())
    opt = SOAP([p], **kw)
    for i, g in enumerate(grads):
        p.grad = g.clone()
        opt.step()
        if i == 0:
            assert torch.equal(local_tensor(p).detach(), x0)  # step 1 builds the bases only
    err = (local_tensor(p).detach().double() - want).abs().max() / (want - x0.double()).abs().max()
    assert err <= 1e-4, err.item()


# (shape, our options, the transcription's): shapes whose merged shape is their shape, and whose
# factors are full rank after the first step (square blocks; 2-element vectors), so every basis is
# defined (up to column signs, which the update does not see)
SOAP_OPTIONS = {
    "blocks": ((8, 8), dict(block_size=4), dict(block=4)),
    "blocks, normalize_grads": ((8, 8), dict(block_size=4, normalize_grads=True), dict(block=4, normalize=True)),
    "normalize_grads": ((6, 6), dict(normalize_grads=True), dict(normalize=True)),
    "correct_bias=False": ((6, 6), dict(correct_bias=False), dict(correct_bias=False)),
    "precondition_1d": ((2,), dict(precondition_1d=True), dict(precondition_1d=True)),
    "1-D blocks, precondition_1d": ((6,), dict(block_size=2, precondition_1d=True), dict(block=2, precondition_1d=True)),
}
_OFF = dict(block=None, normalize=False, correct_bias=True, precondition_1d=False)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("case", SOAP_OPTIONS)
def test_options_equal_independent_float64_soap(case, batched):
    """Block mode, ``normalize_grads``, ``precondition_1d`` and ``correct_bias=False``, looped and
    batched, against the float64 transcription: 10 steps, frequency 2. Tolerance 1e-4 of the update
    (measured <= 6e-6); each option moves the result by > 0.19 of the update, so a path that
    ignores it fails."""
    shape, ours, theirs = SOAP_OPTIONS[case]
    gen = torch.Generator().manual_seed(len(case))
    x0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(10)]
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, wd=0.1, freq=2, max_dim=10000)
    want = _paper_soap(x0, grads, **kw, **theirs)
    p = torch.nn.Parameter(x0.clone())
    opt = SOAP([p], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, precondition_frequency=2,
               batched=batched, **ours)  # fmt: skip
    for g in grads:
        p.grad = g.clone()
        opt.step()
    scale = (want - x0.double()).abs().max()
    assert (local_tensor(p).detach().double() - want).abs().max() / scale <= 1e-4
    for name in theirs:  # the test can tell each option
        other = _paper_soap(x0, grads, **kw, **{**theirs, name: _OFF[name]})
        assert (other - want).abs().max() / scale > 1e-2, name


def test_one_d_and_scalars_are_adam_unless_precondition_1d():
    """Unrotated tensors: SOAP is Adam (bias-corrected step size lr sqrt(1 - b2^s) / (1 - b1^s)) on
    steps 2.. (step 1 only initializes): equal to torch.optim.Adam fed the gradients from step 2."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(7,), ()]:
        x0 = torch.randn(shape, generator=gen)
        grads = [torch.randn(shape, generator=gen) for _ in range(6)]
        p, q = torch.nn.Parameter(x0.clone()), torch.nn.Parameter(x0.clone())
        opt = SOAP([p], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
        ref = torch.optim.Adam([q], lr=0.01, betas=(0.9, 0.95), eps=1e-8)
        for i, g in enumerate(grads):
            p.grad = g.clone()
            opt.step()
            if i:
                q.grad = g.clone()
                ref.step()
        assert torch.allclose(p, q, rtol=0, atol=1e-6)  # same math, different op order
    p = torch.nn.Parameter(torch.randn(7))
    opt = SOAP([p], precondition_1d=True)
    assert opt.state[p]["Q"].numel() == 49


def test_reference_merge_dims():
    """The reference's merge: from the first dim, merge while the product stays <= max_precond_dim."""
    assert reference_merge_dims((3, 4, 5, 2), 12) == (12, 10)
    assert reference_merge_dims((2, 3, 4), 10000) == (24,)
    assert reference_merge_dims((20000, 3), 10000) == (20000, 3)
    assert reference_merge_dims((1, 1), 4) == (1,)


# ---- block SOAP on shards -----------------------------------------------------------------------
K = 4
SHAPES = {"w1": (11, 9), "w2": (5, 3, 2), "bias": (7,), "row": (1, 9), "w3": (2, 13), "scale": ()}
OPT = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.01, precondition_frequency=2, block_size=K, precondition_1d=True)


def _init():
    return seeded_tensors(SHAPES, 3)


def _grads(step):
    return seeded_tensors(SHAPES, 100 + step)


def _layout(shape, spec, world_size, shift, block_size):
    numel = math.prod(shape)
    if block_size is None:  # whole tensors: all on rank `shift % W`
        owner = shift % world_size
        return RaggedLayout(tuple(shape), tuple([0] * (owner + 1) + [numel] * (world_size - owner)))
    geom = shampoo_blocks(tuple(shape), block_size, spec)
    starts = [geom.strip_start_row(i) * geom.cols for i in range(geom.num_strips)] + [numel]
    weights = [(r + shift) % world_size for r in range(world_size)]
    tot = sum(weights) or 1
    acc, bounds = 0, [0]
    for w in weights[:-1]:
        acc += w
        bounds.append(starts[round(geom.num_strips * acc / tot)])
    bounds.append(numel)
    return RaggedLayout(tuple(shape), tuple(bounds))


def _assemble(outs, key_fn):
    full = {}
    for k in SHAPES:
        for key in outs[0][1][k]:
            gnum = outs[0][1][k][key][0].global_numel
            v = torch.full((gnum,), float("nan"))
            for o in outs:
                sh, t = o[1][k][key]
                v[sh.start : sh.end] = t.reshape(-1)
            assert not v.isnan().any(), (k, key)
            full[k, key] = v
    return full


def run(world_size, *, steps=6, opt_kw=None, count_comms=False, load=None, start=0, dtype=torch.float32):
    kw = opt_kw or OPT
    bs = kw.get("block_size")
    init = {k: v.to(dtype) for k, v in _init().items()} if load is None else load[0]
    specs = {k: SOAP.rule(block_size=bs)(k, torch.empty(s), None) for k, s in SHAPES.items()}
    layouts = {k: _layout(s, specs[k], world_size, i, bs) for i, (k, s) in enumerate(SHAPES.items())}

    def fn():
        rank = dist.get_rank()
        params = {k: make_sharded_param(init[k], spec=specs[k], layout=layouts[k], fqn=k) for k in SHAPES}
        opt = SOAP(list(params.values()), **kw)
        if load is not None:  # reshard: each rank takes its range of every global state vector
            for k, p in params.items():
                for key, sh in opt.state_shards(p).items():
                    opt.state[p][key].copy_(load[1][k, key][sh.start : sh.end])
                opt.state[p]["step"].fill_(load[2])
        comms = []
        for s in range(start, start + steps):
            g = _grads(s)
            for k, p in params.items():
                p.grad = sharded_grad(p, g[k].to(dtype))
            with CommDebugMode() if count_comms else contextlib.nullcontext() as mode:
                opt.step()
            if count_comms:
                comms.append({str(op): n for op, n in mode.get_comm_counts().items() if n})
        state = {k: {key: (sh, opt.state[p][key].clone()) for key, sh in opt.state_shards(p).items()}
                 for k, p in params.items()}  # fmt: skip
        return {k: local_tensor(p).clone() for k, p in params.items()}, state, comms, float(opt.state[params["w1"]]["step"])

    outs = run_distributed(fn, world_size=world_size)
    result = {k: layouts[k].unshard([o[0][k] for o in outs]) for k in SHAPES}
    return result, _assemble(outs, None), [o[2] for o in outs], outs[0][3]


@pytest.fixture(scope="module")
def single_process():
    return run(1)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_block_soap_sharded_equals_single_process_bitwise(world_size, single_process):
    ref, ref_state, _, _ = single_process
    ours, state, comms, _ = run(world_size, count_comms=True)
    for k in SHAPES:
        assert torch.equal(ours[k], ref[k]), f"{k}: max |diff| {(ours[k] - ref[k]).abs().max():.3e}"
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        assert torch.equal(state[key], ref_state[key]), key
    assert all(c == {} for per_rank in comms for c in per_rank), comms
    moved = {k: (ours[k] - _init()[k]).abs().max().item() for k in SHAPES}
    assert all(v > 1e-3 for v in moved.values()), moved


def test_block_soap_is_per_block_whole_tensor_soap():
    """block_size = k: each Shampoo block is its own SOAP tensor: a [4, 4] block of an [8, 4]
    parameter equals whole-tensor SOAP run on that [4, 4] slice alone, bitwise."""
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(8, 4, generator=gen)
    grads = [torch.randn(8, 4, generator=gen) for _ in range(5)]
    p, q = torch.nn.Parameter(x0.clone()), torch.nn.Parameter(x0[4:].clone())
    a, b = SOAP([p], block_size=4, precondition_frequency=2), SOAP([q], precondition_frequency=2)
    for g in grads:
        p.grad, q.grad = g.clone(), g[4:].clone()
        a.step()
        b.step()
    assert torch.equal(local_tensor(p).detach()[4:], q.detach())


@pytest.mark.parametrize("world_size", [2, 4])
def test_whole_tensor_soap_sharded_equals_single_process(world_size):
    kw = dict(OPT, block_size=None)
    ref, ref_state, _, _ = run(1, opt_kw=kw)
    ours, state, comms, _ = run(world_size, opt_kw=kw, count_comms=True)
    for k in SHAPES:
        assert torch.equal(ours[k], ref[k]), k
    for key in ref_state:
        assert torch.equal(state[key], ref_state[key]), key
    assert all(c == {} for per_rank in comms for c in per_rank), comms


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_block_soap_sharded_equals_single_process_bitwise(world_size):
    """bf16 parameters take the update and the decay in fp32, rounded once ([Note: low-precision
    updates]): torch's bf16 ``add_(alpha=)`` rounds a tensor's last elements (a rank's piece's)
    differently from its body; that gave 3.9e-3 at shard ends after 6 steps (W = 2..4)."""
    for batched in (False, True):
        kw = dict(OPT, batched=batched)
        ref, _, _, _ = run(1, opt_kw=kw, dtype=torch.bfloat16)
        ours, _, _, _ = run(world_size, opt_kw=kw, dtype=torch.bfloat16)
        for k in SHAPES:
            assert ours[k].dtype == torch.bfloat16
            assert torch.equal(ours[k], ref[k]), f"batched={batched} {k}: max |diff| {(ours[k] - ref[k]).abs().max():.3e}"


def test_state_reshards_from_2_to_3_ranks(single_process):
    """3 steps at W=2, the global state vectors (StateShard ranges) loaded at W=3, 3 more steps:
    bitwise the uninterrupted single-process run."""
    ref, ref_state, _, _ = single_process
    mid, mid_state, _, step = run(2, steps=3)
    assert step == 3.0
    ours, state, _, _ = run(3, steps=3, load=(mid, mid_state, step), start=3)
    for k in SHAPES:
        assert torch.equal(ours[k], ref[k]), k
    for key in ref_state:
        assert torch.equal(state[key], ref_state[key]), key


# ---- errors ---------------------------------------------------------------------------------------
def test_whole_tensor_mode_rejects_a_split_tensor_naming_it_and_the_fix():
    full = torch.randn(6, 4)

    def fn():
        p = make_sharded_param(full, spec=whole(), layout=RaggedLayout((6, 4), (0, 8, 24)), fqn="layers.0.w")
        SOAP([p])

    with pytest.raises(DistributedTestError, match=r"ranks with errors: \[0, 1\]") as e:
        run_distributed(fn, world_size=2)
    assert "layers.0.w" in str(e.value) and "SOAP.rule(block_size=None)" in str(e.value)

    def fn2():
        p = make_sharded_param(full, spec=elements(1), layout=RaggedLayout((6, 4), (0, 4, 24)), fqn="w")
        SOAP([p], block_size=4)

    with pytest.raises(DistributedTestError, match="SOAP.rule\\(block_size=4\\)"):
        run_distributed(fn2, world_size=2)

    def fn3():  # a group refused for its layout is taken back out: the optimizer is as it was
        good = make_sharded_param(full, spec=whole(), layout=RaggedLayout((6, 4), (0, 0, 24)), fqn="w")
        bad = make_sharded_param(full, spec=whole(), layout=RaggedLayout((6, 4), (0, 8, 24)), fqn="layers.0.w")
        opt = SOAP([good])
        with pytest.raises(ValueError, match="layers.0.w"):
            opt.add_param_group({"params": [bad]})
        good.grad = torch.ones_like(good)
        opt.step()
        return len(opt.param_groups), bad in opt.state, len(opt.state)

    assert run_distributed(fn3, world_size=2) == [(1, False, 1)] * 2


# ---- batched (see [Note: batched SOAP]) ----------------------------------------------------------
BATCH_SHAPES = [(37, 50), (64, 64), (64, 64), (64, 64), (5,), (3, 7, 11), (1, 600), (1, 600), (), ()]


def _run_batched(batched, **kw):
    """6 calls (5 Adam steps: bases refreshed at 2 and 4) on shapes that divide nothing; the third
    tensor has no gradient at call 4, so it lags its batch-mates a step (two phases of one shape)."""
    gen = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in BATCH_SHAPES]
    opt = SOAP(ps, lr=0.01, betas=(0.9, 0.95), precondition_frequency=2, precondition_1d=True, batched=batched, **kw)
    for step in range(6):
        for i, p in enumerate(ps):
            p.grad = None if (i, step) == (2, 3) else torch.randn(p.shape, generator=gen)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("normalize_grads", [False, True])
def test_batched_equals_looped_bitwise(block_size, normalize_grads):
    """Parameters and every state vector bitwise (CPU kernels run per matrix; [Note: batched SOAP])."""
    ref, ref_opt = _run_batched(False, block_size=block_size, normalize_grads=normalize_grads)
    ours, opt = _run_batched(True, block_size=block_size, normalize_grads=normalize_grads)
    for i, (a, b) in enumerate(zip(ref, ours)):
        assert torch.equal(a, b), f"{BATCH_SHAPES[i]}: max |diff| {(a - b).abs().max():.3e}"
        for key, v in ref_opt.state[a].items():
            assert torch.equal(v, opt.state[b][key]), (BATCH_SHAPES[i], key)


@pytest.mark.parametrize("shape", [(1, 600), (5,), (3, 37)])
def test_products_do_not_depend_on_where_their_operands_lie(shape):
    """The rotations and outer products read the same bits at any float offset (a factor's view into
    the flat state lies at sums of ``n * n``): MKL's kernels for products with a small dim round by
    operand alignment on AVX-512 CPUs, which made batched and looped SOAP differ there."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    qs = [torch.linalg.qr(torch.randn(n, n, generator=gen))[0].contiguous() for n in shape]  # as the state holds them

    def at(t, offset):  # ``t``'s values in a view ``offset`` floats into a larger buffer
        buf = torch.zeros(t.numel() + 16)
        view = buf[offset : offset + t.numel()].view(t.shape)
        view.copy_(t)
        return view

    for back in (False, True):
        ref = _rotate(x, qs, back=back)
        for offset in range(1, 16):
            moved = _rotate(at(x, offset), [at(q, offset) for q in qs], back=back)
            assert torch.equal(moved, ref), (back, offset)
    for dim in range(len(shape)):
        ref = _outer(x, dim)
        assert all(torch.equal(_outer(at(x, o), dim), ref) for o in range(1, 16)), dim


@pytest.mark.parametrize(("shape", "kw"), [((131, 37), {}), ((37,), {"precondition_1d": True}), ((20, 40), {"block_size": 16})])
def test_batched_unit_steps_alike_alone_and_later_in_a_stack(shape, kw):
    """A unit's result does not depend on its batch-mates or its place in their stack, which the
    world size decides: on AVX-512 CPUs stacked ``eigh`` / ``qr`` rounded by address, and the
    rank-deficient factors of a tall matrix turned that into 4.2e-2 after 4 steps at lr 1e-2
    ([Note: alignment-independent kernels])."""

    def make(ps):
        return SOAP(ps, lr=1e-2, precondition_frequency=2, **kw)

    alone = last_param_after(make, shape, 1)
    assert torch.equal(last_param_after(make, shape, 2), alone) and torch.equal(last_param_after(make, shape, 3), alone)


def test_batched_is_the_default_and_false_loops():
    p = torch.nn.Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4)
    for batched, other in [(None, "_step_param"), (True, "_step_param"), (False, "_step_group_batched")]:
        opt = SOAP([p], batched=batched)
        setattr(opt, other, None)  # a call would raise
        opt.step()


@pytest.fixture(scope="module")
def looped_single_process():
    return run(1, opt_kw=dict(OPT, batched=False))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_batched_block_soap_sharded_equals_looped_single_process_bitwise(world_size, looped_single_process):
    ref, ref_state, _, _ = looped_single_process
    ours, state, comms, _ = run(world_size, opt_kw=dict(OPT, batched=True), count_comms=True)
    for k in SHAPES:
        assert torch.equal(ours[k], ref[k]), f"{k}: max |diff| {(ours[k] - ref[k]).abs().max():.3e}"
    for key in ref_state:
        assert torch.equal(state[key], ref_state[key]), key
    assert all(c == {} for per_rank in comms for c in per_rank), comms


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("block_size", [None, 2])
def test_non_finite_gradient_raises_naming_the_parameter_and_changes_nothing(block_size, batched):
    """A NaN or Inf gradient (on the first call, which builds the bases, and on a later one) is named
    with its shape before any parameter or state changes, so the step can be skipped and training go
    on; without the check ``eigh`` fails to converge on the first call and NaNs spread later."""
    gen = torch.Generator().manual_seed(4)
    a, b = torch.nn.Parameter(torch.randn(4, 3, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))
    opt = SOAP([{"params": [a, b], "param_names": ["layers.0.w", "layers.0.b"]}], block_size=block_size,
               batched=batched, precondition_1d=True, precondition_frequency=1)  # fmt: skip
    for bad in [float("nan"), float("inf"), float("nan")]:
        a.grad, b.grad = torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)
        b.grad[1] = bad
        assert_step_refused_changing_nothing(opt, [a, b], match=r"SOAP: non-finite gradient .* layers\.0\.b \(shape \(5,\)\)",
                                             unnamed="layers.0.w")  # fmt: skip
        b.grad[1] = 0.0  # the same step without the bad element goes on
        opt.step()
    assert all(torch.isfinite(v).all() for st in opt.state.values() for v in st.values())


def test_bad_arguments():
    p = torch.nn.Parameter(torch.randn(3, 3))
    for kw, match in [(dict(betas=(0.9, 1.0)), "betas"), (dict(data_format="nhwc"), "data_format"),
                      (dict(block_size=0), "block_size"), (dict(precondition_frequency=0), "precondition_frequency"),
                      (dict(shampoo_beta=1.0), "shampoo_beta")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            SOAP([p], **kw)
    with pytest.warns(UserWarning, match="merge_dims is ignored"):
        SOAP([p], merge_dims=True, block_size=2)
    opt = SOAP([p])  # a later group is checked as the constructor's (it was accepted as given)
    for kw, match in [(dict(betas=(0.9, 1.0)), "parameter group 1: betas"), (dict(shampoo_beta=1.0), "shampoo_beta"),
                      (dict(precondition_frequency=0), "precondition_frequency"), (dict(eps=-1.0), "eps")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], **kw})
        assert len(opt.param_groups) == 1
    assert SOAP.blocks("w", torch.empty(3, 3), None) == whole()
    assert SOAP.rule(block_size=4)("w", torch.empty(1, 45), None) == elements(4)


def test_save_checkpoint_at_2_load_at_3_restores_every_state_vector(tmp_path):
    """fsdp_optim.save_checkpoint with a fully_shard model + SOAP(block_size=4) at W=2, load_checkpoint
    at W=3 into a differently initialized model: parameters and every SOAP state vector (assembled
    from the ranks' StateShard ranges) equal the saved ones bitwise, and training continues."""
    import fsdp_optim

    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(9, 11), torch.nn.Tanh(), torch.nn.Linear(11, 6))
        rule = SOAP.rule(block_size=4)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fsdp_optim.fully_shard(layer, blocks=rule)
        fsdp_optim.fully_shard(m, blocks=rule)
        return m, SOAP(m.parameters(), block_size=4, precondition_frequency=2)

    def train(m, o, steps):
        for s in steps:
            m(torch.randn(5, 9, generator=torch.Generator().manual_seed(s))).square().sum().backward()
            o.step()
            o.zero_grad()

    def state(m, o):
        return {(n, key): (sh, o.state[p][key].clone()) for n, p in m.named_parameters()
                for key, sh in o.state_shards(p).items()}  # fmt: skip

    def save():
        m, o = make(0)
        train(m, o, range(3))
        fsdp_optim.save_checkpoint(tmp_path / "ck", model=m, optimizer=o)
        return fsdp_optim.full_state_dict(m), state(m, o)

    def load():
        m, o = make(1)
        with warnings.catch_warnings():  # "RNG states are not restored" (rank 0 only) across world sizes
            warnings.simplefilter("ignore")
            fsdp_optim.load_checkpoint(tmp_path / "ck", model=m, optimizer=o)
        out = fsdp_optim.full_state_dict(m), state(m, o)
        train(m, o, range(3, 5))
        return out

    def assemble(outs):
        full = {}
        for key in outs[0][1]:
            sh0 = outs[0][1][key][0]
            v = torch.full((sh0.global_numel,), float("nan"))
            for o in outs:
                sh, t = o[1][key]
                v[sh.start : sh.end] = t.reshape(-1)
            full[key] = v
        return full

    saved, loaded = run_distributed(save, world_size=2), run_distributed(load, world_size=3)
    assert all(torch.equal(saved[0][0][k], loaded[0][0][k]) for k in saved[0][0])
    a, b = assemble(saved), assemble(loaded)
    assert a.keys() == b.keys() and any(k[1] == "Q" and v.numel() for k, v in a.items())
    for k in a:
        assert torch.equal(a[k], b[k]), k
