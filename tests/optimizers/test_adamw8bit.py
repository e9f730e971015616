"""AdamW8bit on sharded params equals torchao's AdamW8bit unsharded, for every W, bitwise.

References nobody here wrote: ``torchao.optim.AdamW8bit`` (eager via ``TORCHDYNAMO_DISABLE=1`` for
the many-shape sweeps, and compiled as shipped for one sweep), ``torch.optim.AdamW`` (the 50-step
error bounds of bitsandbytes' own test).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from fsdp_optim._testing import make_sharded_param, run_distributed, sharded_grad, train_steps
from fsdp_optim._testing import random_block_layout as _random_layout
from fsdp_optim.optimizers import AdamW8bit, adamw8bit_rule
from fsdp_optim.optimizers._adamw8bit import dequantize_blockwise, quantize_blockwise
from fsdp_optim.sharding import RaggedDTensor, elements
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding.contract import local_tensor

warnings.filterwarnings("ignore", message=".*KernelPreference.*")
torchao_optim = pytest.importorskip("torchao.optim")

BS = 256
# Sizes torchao quantizes (multiple of 256, >= 4096), plus small tensors both keep in fp32.
TORCHAO_SHAPES = [(64, 64), (48, 128), (4096,), (16, 16, 20), (37, 19), (7,)]
# Sizes torchao would keep in fp32 (not a multiple of 256) that we quantize: dim 0 divides no W.
ODD_SHAPES = [(4097,), (17, 241), (35, 130)]


def random_block_layout(shape, world_size: int, seed: int) -> RaggedLayout:
    """Random contiguous 256-block-aligned ranges (some empty: rank 0 for odd seeds)."""
    return _random_layout(shape, world_size, seed, block=BS, empty_first=bool(seed % 2))


def even_block_layout(shape, world_size: int) -> RaggedLayout:
    """Nearly equal numbers of whole 256-blocks per rank (what the planner does for one tensor)."""
    numel = torch.Size(shape).numel()
    num_blocks = -(-numel // BS)
    per = -(-num_blocks // world_size)
    return RaggedLayout(tuple(shape), tuple(min(r * per * BS, numel) for r in range(world_size + 1)))


def make_data(shapes, num_steps: int, *, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 0.1).to(dtype) for s in shapes] for _ in range(num_steps)]
    return params, grads


@contextlib.contextmanager
def dynamo_disabled():
    """torchao compiles its step on every call; TORCHDYNAMO_DISABLE=1 makes that call eager."""
    old = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = old


@contextlib.contextmanager
def torchao_amsgrad():
    """Let torchao's own amsgrad run. Its step (``torchao.optim.adam.single_param_adam``) takes
    ``torch.maximum(max_exp_avg_sq.float(), v)``, but ``.float()`` of its quantized state is that
    state and its subclasses do not implement ``aten.maximum`` (torchao 0.18; pytorch/ao#2497, open),
    so ``amsgrad=True`` raises on every quantized tensor. This supplies that one op (dequantize, then
    the plain maximum) while the context lasts; the rest is torchao's: the fp32 max in the
    denominator, ``copy_`` quantizing it into the state."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    quantized = (OptimState8bit, OptimState4bit)

    def maximum(func, types, args, kwargs):
        return func(*(a.dequantize() if isinstance(a, quantized) else a for a in args), **kwargs)

    op = torch.ops.aten.maximum.default
    tables = [cls._ATEN_OP_TABLE[cls] for cls in quantized]
    assert all(op not in t for t in tables), "torchao implements maximum now: drop torchao_amsgrad"
    for t in tables:
        t[op] = maximum
    try:
        yield
    finally:
        for t in tables:
            t.pop(op)


def torchao_reference(params, grads, *, eager: bool, scheduler=None, **kw):
    """Unsharded torchao AdamW8bit: final params and flat states (codes/scales where 8-bit)."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torchao_optim.AdamW8bit(ps, **kw)
    with dynamo_disabled() if eager else contextlib.nullcontext():
        train_steps(opt, ps, grads, scheduler=scheduler(opt) if scheduler else None)
    states = []
    for p in ps:
        st = {}
        for k, v in opt.state[p].items():
            if k == "step":
                st[k] = v.clone()
            elif hasattr(v, "codes"):
                st[f"{k}_codes"], st[f"{k}_scale"], st[k] = v.codes.reshape(-1).clone(), v.scale.clone(), v.dequantize().reshape(-1).float()
            else:
                st[k] = v.reshape(-1).float().clone()
        states.append(st)
    return [local_tensor(p).clone() for p in ps], states


def sharded_run(params, grads, layouts, *, scheduler=None, **kw):
    """Our AdamW8bit on each rank: (local params, raw states, dequantized states, quantized flags)."""

    def fn():
        ps = [make_sharded_param(f, spec=elements(BS), layout=lay, fqn=f"p{i}") for i, (f, lay) in enumerate(zip(params, layouts))]
        opt = AdamW8bit(ps, **kw)
        train_steps(opt, ps, grads, scheduler=scheduler(opt) if scheduler else None, layouts=layouts)
        return (
            [local_tensor(p).clone() for p in ps],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in ps],
            [opt.dequantized_state(p) for p in ps],
            [opt.is_quantized(p) for p in ps],
        )

    return run_distributed(fn, world_size=layouts[0].world_size, timeout=300)


def gather(out, layouts, i, pick):
    """The global flat tensor of param ``i`` from every rank's ``pick(rank_output)``."""
    lay = layouts[i]
    return torch.cat([pick(o).reshape(-1) for o in out]) if lay.numel else torch.empty(0)


def assert_matches_torchao(out, ref, layouts):
    ref_params, ref_states = ref
    for i, lay in enumerate(layouts):
        got = lay.unshard([o[0][i] for o in out])
        assert torch.equal(got, ref_params[i]), f"param {i} {lay.shape}: max diff {(got.float() - ref_params[i].float()).abs().max()}"
        quantized = "exp_avg_codes" in ref_states[i]
        assert all(o[3][i] == quantized for o in out)  # the same 8-bit decision as torchao
        for key, want in ref_states[i].items():
            if key == "step":
                assert all(torch.equal(o[1][i]["step"], want) for o in out)
                continue
            source = 1 if key.endswith(("_codes", "_scale")) else 2  # raw codes/scales, else dequantized
            got = gather(out, layouts, i, lambda o: o[source][i][key])
            assert torch.equal(got, want), f"{key} of param {i} {lay.shape}"


@pytest.mark.parametrize(
    "world_size, hp",
    [(1, dict(lr=1e-2)), (2, dict(lr=1e-2)), (3, dict(lr=1e-2)), (4, dict(lr=1e-2)),
     (3, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1))],
)
def test_matches_torchao_eager(world_size, hp):
    params, grads = make_data(TORCHAO_SHAPES, 3)
    layouts = [random_block_layout(s, world_size, seed=world_size * 10 + i) for i, s in enumerate(TORCHAO_SHAPES)]
    ref = torchao_reference(params, grads, eager=True, **hp)
    out = sharded_run(params, grads, layouts, compile=False, **hp)
    assert_matches_torchao(out, ref, layouts)


def test_bf16_params_match_torchao():
    params, grads = make_data([(32, 256), (9, 3)], 3, dtype=torch.bfloat16)
    layouts = [random_block_layout((32, 256), 3, seed=1), random_block_layout((9, 3), 3, seed=2)]
    ref = torchao_reference(params, grads, eager=True, lr=1e-2)
    out = sharded_run(params, grads, layouts, compile=False, lr=1e-2)
    assert_matches_torchao(out, ref, layouts)
    assert all(o[1][0]["exp_avg_scale"].dtype == torch.float32 for o in out)


@pytest.mark.parametrize("world_size", [1, 3])
def test_lr_scheduler_matches_torchao(world_size):
    # torchao keeps lr as a tensor; the scheduler updates it in place. Ours accepts a float lr and a scheduler.
    shapes = [(64, 64), (10,)]
    params, grads = make_data(shapes, 4)
    layouts = [random_block_layout(s, world_size, seed=i) for i, s in enumerate(shapes)]

    def sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    ref = torchao_reference(params, grads, eager=True, scheduler=sched, lr=1e-2)
    out = sharded_run(params, grads, layouts, compile=False, scheduler=sched, lr=1e-2)
    assert_matches_torchao(out, ref, layouts)


def padded_reference(params, grads, **kw):
    """torchao on each tensor zero-padded to a multiple of 256 (zero params and grads stay zero),
    so torchao quantizes it; its first ``numel`` elements are what quantizing a partial block means."""
    padded_p, padded_g = [], [[] for _ in grads]
    for i, p in enumerate(params):
        n = p.numel()
        size = -(-n // BS) * BS
        padded_p.append(torch.cat([p.reshape(-1), p.new_zeros(size - n)]))
        for t, gs in enumerate(grads):
            padded_g[t].append(torch.cat([gs[i].reshape(-1), p.new_zeros(size - n)]))
    ref_p, ref_s = torchao_reference(padded_p, padded_g, eager=True, **kw)
    out_p, out_s = [], []
    for p, rp, rs in zip(params, ref_p, ref_s):
        n = p.numel()
        assert torch.count_nonzero(rp[n:]) == 0  # the padding stayed zero: it cannot have moved anything
        out_p.append(rp[:n].reshape(p.shape))
        out_s.append({k: (v if k == "step" or k.endswith("_scale") else v[:n]) for k, v in rs.items()})
    return out_p, out_s


@pytest.mark.parametrize("world_size, layout", [(1, "even"), (2, "random"), (3, "even"), (3, "random"), (4, "random")])
def test_odd_sizes_are_8bit_and_identical_across_world_sizes(world_size, layout):
    params, grads = make_data(ODD_SHAPES, 3)
    if layout == "even":
        layouts = [even_block_layout(s, world_size) for s in ODD_SHAPES]
    else:
        layouts = [random_block_layout(s, world_size, seed=world_size + i) for i, s in enumerate(ODD_SHAPES)]
    out = sharded_run(params, grads, layouts, compile=False, lr=1e-2)
    for i in range(len(ODD_SHAPES)):
        assert all(o[3][i] for o in out), "odd-sized tensor >= 4096 elements must get 8-bit state"
        assert all(o[1][i]["exp_avg_codes"].dtype == torch.uint8 for o in out)
    # Equal to torchao on the zero-padded tensor (an independent statement of what a partial block
    # means), hence identical for every W: params, codes, scales, dequantized states, bitwise.
    assert_matches_torchao(out, padded_reference(params, grads, lr=1e-2), layouts)


def test_amsgrad_identical_across_world_sizes():
    # All tensors bitwise equal for W = 1..4 (torchao's own amsgrad: test_amsgrad_matches_torchao_amsgrad).
    shapes = TORCHAO_SHAPES + ODD_SHAPES
    params, grads = make_data(shapes, 3)
    runs = []
    for world_size in (1, 2, 3, 4):
        layouts = [random_block_layout(s, world_size, seed=world_size + i) for i, s in enumerate(shapes)]
        out = sharded_run(params, grads, layouts, compile=False, lr=1e-2, amsgrad=True)
        runs.append({
            (i, key): gather(out, layouts, i, lambda o: o[1][i][key])
            for i in range(len(shapes)) for key in out[0][1][i] if key != "step"
        } | {(i, "param"): layouts[i].unshard([o[0][i] for o in out]) for i in range(len(shapes))})
        assert all(o[1][0]["max_exp_avg_sq_codes"].dtype == torch.uint8 for o in out)
    for run in runs[1:]:
        assert run.keys() == runs[0].keys()
        assert all(torch.equal(run[k], runs[0][k]) for k in run), [k for k in run if not torch.equal(run[k], runs[0][k])]
    small = [i for i, s in enumerate(shapes) if torch.Size(s).numel() < 4096]
    ref_p, _ = torchao_reference([params[i] for i in small], [[gs[i] for i in small] for gs in grads], eager=True, lr=1e-2, amsgrad=True)
    assert all(torch.equal(runs[0][(i, "param")], r) for i, r in zip(small, ref_p))


def emulated_ranks(params, grads, layouts, **kw):
    """Every rank's step in this one process (ranks are independent: ``step()`` issues no collectives,
    see the CommDebugMode tests), so torch.compile builds each local shape once; returns
    ``(unsharded params, {(i, key): global flat state})``."""
    world_size = layouts[0].world_size
    ranks = []
    for rank in range(world_size):
        ps = []
        for i, (f, lay) in enumerate(zip(params, layouts)):
            p = make_sharded_param(f, spec=elements(BS), layout=lay, fqn=f"p{i}", rank=rank)
            ps.append(p)
        ranks.append((ps, AdamW8bit(ps, **kw)))
    for gs in grads:
        for rank, (ps, opt) in enumerate(ranks):
            for p, g, lay in zip(ps, gs, layouts):
                p.grad = sharded_grad(p, g)
            opt.step()
    out_p = [lay.unshard([ps[i].to_local().detach() for ps, _ in ranks]) for i, lay in enumerate(layouts)]
    out_s = {
        (i, key): torch.cat([opt.state[ps[i]][key].reshape(-1) for ps, opt in ranks])
        for i in range(len(layouts)) for key in ranks[0][1].state[ranks[0][0][i]] if key != "step"
    }
    for i in range(len(layouts)):
        out_s[(i, "dequantized")] = torch.cat([opt.dequantized_state(ps[i])["exp_avg_sq"] for ps, opt in ranks])
    return out_p, out_s


@pytest.mark.parametrize("world_size", [1, 3])
def test_amsgrad_matches_torchao_amsgrad(world_size):
    """amsgrad against torchao's own (``torchao_amsgrad``), fed the gradients only, never our state:
    params, codes, scales and dequantized values of every moment, the max included, bitwise, on the
    sizes torchao quantizes, the small ones it keeps in fp32, and odd sizes (against torchao on the
    zero-padded tensor); W = 1 and 3 with uneven and empty ranks."""
    shapes = TORCHAO_SHAPES + ODD_SHAPES
    params, grads = make_data(shapes, 4, seed=5)
    layouts = [random_block_layout(s, world_size, seed=7 * world_size + i) for i, s in enumerate(shapes)]
    out = sharded_run(params, grads, layouts, compile=False, lr=1e-2, amsgrad=True)
    with torchao_amsgrad():
        ref = padded_reference(params, grads, lr=1e-2, amsgrad=True)
    assert sum("max_exp_avg_sq_codes" in st for st in ref[1]) == 7  # 8-bit maxima compared, not only fp32 ones
    assert_matches_torchao(out, ref, layouts)


@pytest.mark.timeout(900)
def test_compiled_matches_compiled_torchao_for_every_world_size():
    # torchao as shipped (its step under torch.compile) vs ours with compile=True, W = 1..4 with an
    # empty rank, bitwise; plus an odd size (4097: torchao would keep it fp32) identical across W.
    # Few distinct local shapes (8192, 4096, 2048 and the 256 tail) keep compilation affordable.
    shapes = [(8192,), (4097,)]
    params, grads = make_data(shapes, 3)
    ref_p, ref_s = torchao_reference(params[:1], [gs[:1] for gs in grads], eager=False, lr=1e-2)
    runs = []
    for b0, b1 in [((0, 8192), (0, 4097)), ((0, 4096, 8192), (0, 2048, 4097)),
                   ((0, 4096, 6144, 8192), (0, 0, 4096, 4097)), ((0, 2048, 2048, 6144, 8192), (0, 2048, 4096, 4096, 4097))]:
        runs.append(emulated_ranks(params, grads, [RaggedLayout((8192,), b0), RaggedLayout((4097,), b1)], compile=True, lr=1e-2))
    for out_p, out_s in runs:
        assert torch.equal(out_p[0], ref_p[0])
        for key in ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale"):
            assert torch.equal(out_s[(0, key)], ref_s[0][key]), key
        assert torch.equal(out_s[(0, "dequantized")], ref_s[0]["exp_avg_sq"])
        assert torch.equal(out_p[1], runs[0][0][1]) and out_s.keys() == runs[0][1].keys()
        assert all(torch.equal(v, runs[0][1][k]) for k, v in out_s.items())


@pytest.mark.parametrize("amsgrad", [False, True])
def test_within_bitsandbytes_bounds_of_torch_adamw_over_50_steps(amsgrad):
    # Protocol and bounds of bitsandbytes' tests/test_optim.py::test_optimizer8bit (fp32 case; commit
    # 027f4ad8 of bitsandbytes-foundation/bitsandbytes): params randn*0.1, grads randn*0.01, 50 steps;
    # after every step mean |p_8bit - p_torch| < 6e-5 and mean relative error < 6e-4; then the fp32
    # reference is re-synced to the 8-bit params and dequantized states (so errors are per step).
    # Sharded W=3 with a partial final block; the torch reference runs element-wise on each rank's
    # pieces, which equals the unsharded run (tests/optimizers/test_adamw.py).
    shapes = [(16, 4097), (32, 1024)]
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    grads = [[torch.randn(s, generator=g) * 0.01 for s in shapes] for _ in range(50)]
    layouts = [even_block_layout(s, 3) for s in shapes]

    def fn():
        rank = dist.get_rank()
        ours = [make_sharded_param(f, spec=elements(BS), layout=lay) for f, lay in zip(params, layouts)]
        ref = [torch.nn.Parameter(lay.shard(f, rank).clone()) for f, lay in zip(params, layouts)]
        opt8, opt32 = AdamW8bit(ours, compile=False, amsgrad=amsgrad), torch.optim.AdamW(ref, amsgrad=amsgrad)
        sums = []
        for gs in grads:
            for p, q, g_, lay in zip(ours, ref, gs, layouts):
                p.grad = sharded_grad(p, g_)
                q.grad = local_tensor(p.grad).clone()
            opt8.step()
            opt32.step()
            err = torch.cat([(q - local_tensor(p)).abs().detach() for p, q in zip(ours, ref)])
            rel = torch.cat([((q - local_tensor(p)).abs() / (q.abs() + 1e-9)).detach() for p, q in zip(ours, ref)])
            sums.append((err.sum().item(), rel.sum().item(), err.numel()))
            with torch.no_grad():
                for p, q in zip(ours, ref):
                    q.copy_(local_tensor(p))
                    for k, v in opt8.dequantized_state(p).items():
                        opt32.state[q][k].copy_(v)
        return sums

    out = run_distributed(fn, world_size=3, timeout=300)
    for step in range(50):
        n = sum(o[step][2] for o in out)
        err, rel = sum(o[step][0] for o in out) / n, sum(o[step][1] for o in out) / n
        assert err < 6e-5 and rel < 6e-4, f"step {step}: mean abs err {err:.3g}, mean rel err {rel:.3g}"


def test_state_is_checkpoint_shaped_and_step_is_collective_free():
    shapes = [(17, 241), (64, 64), (7,)]
    params, grads = make_data(shapes, 1)
    layouts = [random_block_layout(s, 3, seed=i + 1) for i, s in enumerate(shapes)]

    def fn():
        rank = dist.get_rank()
        ps = [make_sharded_param(f, spec=elements(BS), layout=lay) for f, lay in zip(params, layouts)]
        opt = AdamW8bit(ps, amsgrad=True, compile=False)

        def describe():
            sd = opt.state_dict()["state"]
            return {i: {k: (opt.state_shards(ps[i]).get(k, (None,))[0], v.dtype) for k, v in sd[i].items()} for i in sd}

        before = describe()
        for p, g, lay in zip(ps, grads[0], layouts):
            p.grad = sharded_grad(p, g)
        with CommDebugMode() as comm:
            opt.step()
        with CommDebugMode() as control:  # positive control: the counter sees gloo c10d ops
            dist.all_reduce(torch.ones(1))
        shards = []
        for p in ps:
            sh = opt.state_shards(p)
            for key, s in sh.items():
                assert opt.state[p][key].numel() == s.end - s.start and opt.state[p][key].is_contiguous()
            shards.append({k: tuple(v) for k, v in sh.items()})
        return before, describe(), comm.get_total_counts(), control.get_total_counts(), shards

    out = run_distributed(fn, world_size=3)
    for before, after, num_step, num_control, _ in out:
        assert before == after == out[0][0]
        assert num_step == 0 and num_control == 1
    # Per-element and per-block ranges tile their global vectors in rank order.
    for i in range(len(shapes)):
        for key in out[0][4][i]:
            ranges = [out[r][4][i][key] for r in range(3)]
            assert ranges[0][1] == 0 and ranges[-1][2] == ranges[0][0]
            assert all(a[2] == b[1] for a, b in zip(ranges, ranges[1:]))
    assert out[0][4][0]["exp_avg_scale"][0] == -(-17 * 241 // BS)


def test_state_dict_round_trip_keeps_codes_and_continues_bitwise():
    params, grads = make_data([(16, 260), (5,)], 4, dtype=torch.bfloat16)

    def run(split: bool):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = AdamW8bit(ps, lr=1e-2, compile=False)
        for t, gs in enumerate(grads):
            if split and t == 2:
                sd = opt.state_dict()
                opt = AdamW8bit(ps, lr=1e-2, compile=False)
                opt.load_state_dict(sd)
                st = opt.state[ps[0]]
                assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_scale"].dtype == torch.float32
                assert torch.equal(st["exp_avg_scale"], sd["state"][0]["exp_avg_scale"])
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        return [local_tensor(p).detach() for p in ps]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_layout_cutting_a_quantization_block_is_rejected_on_every_rank(world_size):
    # elements(1) sharding as plain FSDP would do it: rank boundaries inside 256-blocks.
    shape = (37, 130)
    lay = RaggedLayout.even_rows(shape, world_size)
    full = torch.randn(shape)
    for rank in range(world_size):  # the check reads the global layout, so every rank raises
        p = make_sharded_param(full, spec=elements(1), layout=lay, fqn="layers.0.w1.weight", rank=rank)
        with pytest.raises(ValueError, match=r"layers\.0\.w1\.weight.*world size.*blocks=AdamW8bit\.blocks"):
            AdamW8bit([p])
    # A small tensor keeps fp32 state, so any layout is fine for it.
    small = RaggedLayout.even_rows((7, 3), world_size)
    q = make_sharded_param(torch.randn(7, 3), spec=elements(1), layout=small, fqn="norm.weight", rank=0)
    assert not AdamW8bit([q], compile=False).is_quantized(q)


def test_blockwise_helpers_match_torchao_and_round_trip_partial_blocks():
    from torchao.optim.subclass_8bit import OptimState8bit

    x = torch.randn(4096 + 77)
    codes, scale = quantize_blockwise(x, signed=True)
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel() and scale.numel() == 17
    assert torch.equal(scale[-1], x[4096:].abs().max())  # the partial block's own absmax
    ref = OptimState8bit.zeros((4096,), True, 256)
    ref.copy_(x[:4096])
    assert torch.equal(codes[:4096], ref.codes) and torch.equal(scale[:16], ref.scale)
    y = dequantize_blockwise(codes, scale, signed=True)
    assert torch.equal(y[:4096], ref.dequantize())
    assert (y - x).abs().max() <= 0.05 * x.abs().max()  # 8-bit dynamic map: a few percent of absmax


def test_blocks_rule_and_hyperparameter_errors():
    assert AdamW8bit.blocks("w", torch.zeros(3), None) == elements(256)
    assert AdamW8bit([torch.nn.Parameter(torch.zeros(3))], block_size=128, compile=False).blocks("w", torch.zeros(3), None) == adamw8bit_rule(128)("w", torch.zeros(3), None)
    for kw, match in [(dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), r"betas\[1\]"), (dict(eps=-1.0), "eps"),
                      (dict(weight_decay=-1.0), "weight_decay"), (dict(block_size=0), "block_size")]:
        with pytest.raises(ValueError, match=match):
            AdamW8bit([torch.nn.Parameter(torch.zeros(3))], **kw)


# ---- one step call per run of adjacent shards ([Note: runs]) -------------------------------------
# A bucket segment's layout: 8-bit tensors, fp32-state ones between them, and an odd size whose
# final partial block must end its run; plus a tensor that gets no gradient at step 1.
RUN_SHAPES = [(64, 64), (7,), (37, 19), (48, 128), (17, 241), (16, 16, 20), (35, 130), (4096,)]
NO_GRAD_AT = {(1, 6)}  # (step, param): that parameter has no gradient at that step


def shards_in_one_buffer(params, layouts, *, rank: int, bs: int = BS):
    """This rank's pieces of ``params`` back to back in one flat buffer, as sharded parameters whose
    local pieces are views of it (what a ``fully_shard`` bucket segment holds); also each piece's
    offset and size in the buffer."""
    sizes = [lay.shard(f, rank).numel() for f, lay in zip(params, layouts)]
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    flat = torch.cat([lay.shard(f.detach(), rank).reshape(-1) for f, lay in zip(params, layouts)])
    ps = []
    for i, (f, lay) in enumerate(zip(params, layouts)):
        p = make_sharded_param(f, spec=elements(bs), layout=lay, fqn=f"p{i}", rank=rank, local=flat[offs[i] : offs[i] + sizes[i]])
        ps.append(p)
    return ps, offs, sizes


def adjacent_run(params, grads, layouts, *, fuse_runs: bool, adjacent_grads: bool = True, cls=AdamW8bit, bs=BS, **kw):
    """Our optimizer on shards laid out back to back in one flat buffer (as a ``fully_shard`` bucket
    segment holds them), gradients views of one flat gradient buffer; counts the step calls."""
    import fsdp_optim.optimizers._quantized_adamw as qa

    def fn():
        rank = dist.get_rank()
        ps, offs, sizes = shards_in_one_buffer(params, layouts, rank=rank, bs=bs)
        calls = []
        real = qa._step_fn(False)
        orig = qa._step_fn
        qa._step_fn = lambda compile: (lambda *a: (calls.append(a[0].numel()), real(*a))[1])
        try:
            opt = cls(ps, fuse_runs=fuse_runs, compile=False, **kw)
            gbuf = torch.empty(sum(sizes))
            num_calls = []
            for step, gs in enumerate(grads):
                calls.clear()
                for i, (p, g, lay) in enumerate(zip(ps, gs, layouts)):
                    if (step, i) in NO_GRAD_AT:
                        p.grad = None
                        continue
                    local = lay.shard(g, rank).reshape(-1)
                    if adjacent_grads:  # a sharded gradient whose local piece is a view of gbuf
                        view = gbuf[offs[i] : offs[i] + sizes[i]]
                        view.copy_(local)
                        p.grad = RaggedDTensor.from_local(view, p.device_mesh, p.placements)
                        assert local_tensor(p.grad).data_ptr() == view.data_ptr()
                    else:
                        p.grad = sharded_grad(p, g)
                opt.step()
                num_calls.append(len(calls))
        finally:
            qa._step_fn = orig
        return (
            [local_tensor(p).clone() for p in ps],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in ps],
            [opt.dequantized_state(p) for p in ps],
            [opt.is_quantized(p) for p in ps],
            num_calls,
            [[next(j for j, x in enumerate(ps) if x is q) for q in run] for run in opt._runs],
            {k: v for k, v in opt.state_dict()["state"].items()},
        )

    return run_distributed(fn, world_size=layouts[0].world_size, timeout=300)


def _reference_with_missing_grads(params, grads, **kw):
    """torchao unsharded (eager), with the same gradients left out."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torchao_optim.AdamW8bit(ps, **kw)
    with dynamo_disabled():
        for step, gs in enumerate(grads):
            for i, (p, g) in enumerate(zip(ps, gs)):
                p.grad = None if (step, i) in NO_GRAD_AT else g.clone()
            opt.step()
    return ps, opt


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_runs_of_adjacent_shards_take_one_call_each_and_match_torchao(world_size):
    params, grads = make_data(RUN_SHAPES, 3, seed=7)
    layouts = [random_block_layout(s, world_size, seed=world_size + i) for i, s in enumerate(RUN_SHAPES)]
    fused = adjacent_run(params, grads, layouts, fuse_runs=True, lr=1e-2)
    plain = adjacent_run(params, grads, layouts, fuse_runs=False, lr=1e-2)
    ps, ref = _reference_with_missing_grads(params, grads, lr=1e-2)
    odd = {i for i, s in enumerate(RUN_SHAPES) if s in ODD_SHAPES}  # 8-bit here, fp32 in torchao: not compared
    quantized = {i for i, p in enumerate(ps) if hasattr(ref.state[p]["exp_avg"], "codes")} | odd
    for out in (fused, plain):
        for i, lay in enumerate(layouts):
            assert all(o[3][i] == (i in quantized) for o in out), i
            if i in odd:
                continue
            got = lay.unshard([o[0][i] for o in out])
            assert torch.equal(got, ps[i].detach()), f"param {i} {lay.shape}"
            want_step = ref.state[ps[i]]["step"]
            assert all(torch.equal(o[1][i]["step"], want_step) for o in out), i
            if i in quantized:
                for key in ("exp_avg", "exp_avg_sq"):
                    codes = torch.cat([o[1][i][f"{key}_codes"] for o in out])
                    assert torch.equal(codes, ref.state[ps[i]][key].codes.reshape(-1)), (i, key)
    # The same bits and state either way; the fused run makes fewer calls, and the runs are what
    # [Note: runs] allows: adjacent, one kind, a partial final block only at a run's end.
    for f, p in zip(fused, plain):
        assert all(torch.equal(a, b) for a, b in zip(f[0], p[0]))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(f[1], p[1]) for k in a)
    for rank_out in fused:
        sizes = [p.numel() for p in rank_out[0]]
        for run in rank_out[5]:
            assert run == sorted(run) and len({i in quantized for i in run}) == 1, run
            if run[0] in quantized:
                assert all(sizes[i] % BS == 0 for i in run[:-1]), run

    def calls(numel: int, q: bool) -> int:  # a quantized span's partial final block is a second call
        return (numel >= BS) + (numel % BS != 0) if q else 1

    for f, p in zip(fused, plain):  # step 0: every parameter has its gradient and the same count
        sizes = [t.numel() for t in p[0]]
        assert p[4][0] == sum(calls(n, i in quantized) for i, n in enumerate(sizes) if n), (sizes, quantized)
        runs = f[5] + [[i] for i, n in enumerate(sizes) if n and not any(i in r for r in f[5])]
        assert f[4][0] == sum(calls(sum(sizes[i] for i in r), r[0] in quantized) for r in runs), (sizes, runs, quantized)
        assert f[4][2] >= f[4][0]  # after a step without its gradient, param 6 counts apart
    assert sum(f[4][0] for f in fused) < sum(p[4][0] for p in plain)
    assert any(len(run) > 1 for o in fused for run in o[5])


def test_runs_with_gradients_that_are_not_adjacent_and_a_state_dict_round_trip():
    """Gradients set one by one (not views of one buffer) are concatenated for the call; a state
    dict saved and loaded back keeps the run buffers and continues bitwise."""
    world_size = 2
    params, grads = make_data(RUN_SHAPES, 3, seed=8)
    layouts = [even_block_layout(s, world_size) for s in RUN_SHAPES]
    fused = adjacent_run(params, grads, layouts, fuse_runs=True, adjacent_grads=False, lr=1e-2)
    plain = adjacent_run(params, grads, layouts, fuse_runs=False, adjacent_grads=True, lr=1e-2)
    for f, p in zip(fused, plain):
        assert all(torch.equal(a, b) for a, b in zip(f[0], p[0]))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(f[1], p[1]) for k in a)

    def fn():
        rank = dist.get_rank()

        def build():
            ps, _, _ = shards_in_one_buffer(params, layouts, rank=rank)
            return ps, AdamW8bit(ps, compile=False, lr=1e-2)

        def steps(ps, opt, which):
            for s in which:
                for p, g, lay in zip(ps, grads[s], layouts):
                    p.grad = sharded_grad(p, g)
                opt.step()

        a, opt_a = build()
        steps(a, opt_a, range(3))
        b, opt_b = build()
        steps(b, opt_b, range(1))
        sd = opt_b.state_dict()
        c, opt_c = build()
        for pc, pb in zip(c, b):
            pc.data.copy_(pb.data)
        opt_c.load_state_dict(sd)
        assert opt_c._runs and all(  # the loaded state is back in one buffer per run
            opt_c.state[q]["exp_avg_sq_codes" if opt_c.is_quantized(q) else "exp_avg_sq"].untyped_storage().data_ptr()
            == opt_c.state[run[0]]["exp_avg_sq_codes" if opt_c.is_quantized(run[0]) else "exp_avg_sq"].untyped_storage().data_ptr()
            for run in opt_c._runs for q in run
        )
        steps(c, opt_c, range(1, 3))
        return all(torch.equal(local_tensor(x), local_tensor(y)) for x, y in zip(a, c)) and all(
            torch.equal(opt_a.state[x][k], opt_c.state[y][k]) for x, y in zip(a, c) for k in opt_a.state[x]
        )

    assert run_distributed(fn, world_size=world_size) == [True, True]


def test_runs_whose_storage_is_replaced_fall_back_to_one_call_per_tensor():
    """A parameter whose local piece moved to new storage after the optimizer was built breaks its
    run's span: the step notices (pointer checks) and steps those parameters one by one, same bits.
    (``p.data = v`` on a sharded parameter copies into its piece in place, keeping the storage, so the
    piece itself is moved here with ``set_``.)"""
    world_size = 1
    params, grads = make_data(RUN_SHAPES, 2, seed=9)
    layouts = [even_block_layout(s, world_size) for s in RUN_SHAPES]

    def fn():
        outs = []
        for replace in (False, True):
            ps, _, _ = shards_in_one_buffer(params, layouts, rank=0)
            opt = AdamW8bit(ps, compile=False, lr=1e-2)
            assert any(len(r) > 1 for r in opt._runs)
            if replace:
                from fsdp_optim.optimizers._quantized_adamw import _adjacent

                for p in ps[3:5]:
                    old = local_tensor(p).data_ptr()
                    local_tensor(p).set_(local_tensor(p).clone())
                    assert local_tensor(p).data_ptr() != old
                assert not all(_adjacent([local_tensor(q) for q in run]) for run in opt._runs)  # a span is broken
            for gs in grads:
                for p, g in zip(ps, gs):
                    p.grad = sharded_grad(p, g)
                opt.step()
            outs.append([local_tensor(p).clone() for p in ps])
        return all(torch.equal(a, b) for a, b in zip(*outs))

    assert run_distributed(fn, world_size=world_size) == [True]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_runs_under_fully_shard_equal_per_tensor_and_torchao(world_size):
    """Under ``fully_shard`` a bucket's local pieces and their gradients are adjacent views of its
    segment, so real runs form. Every rank sees the same batch (W a power of two: the averaged gradient
    is exact), so the result equals unsharded torchao bitwise (sizes torchao quantizes; odd sizes are
    covered above). Test idea from the q8seg branch."""
    from fsdp_optim import fully_shard
    from fsdp_optim.optimizers._quantized_adamw import _adjacent
    from fsdp_optim.sharding.contract import local_shard

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 64, bias=False), torch.nn.Linear(64, 80, bias=False),
            torch.nn.Tanh(), torch.nn.Linear(80, 64), torch.nn.Linear(64, 64, bias=False),
        )

    def fn():
        models = {"runs": model(), "per_tensor": model(), "torchao": model()}
        for name in ("runs", "per_tensor"):
            fully_shard(models[name], blocks=AdamW8bit.blocks)
        opts = {
            "runs": AdamW8bit(models["runs"].parameters(), lr=1e-2, compile=False),
            "per_tensor": AdamW8bit(models["per_tensor"].parameters(), lr=1e-2, compile=False, fuse_runs=False),
            "torchao": torchao_optim.AdamW8bit(models["torchao"].parameters(), lr=1e-2),
        }
        adjacent_grads = []
        with dynamo_disabled():
            for s in range(3):
                x = torch.randn(5, 64, generator=torch.Generator().manual_seed(s))
                for m in models.values():
                    m(x).square().sum().backward()
                adjacent_grads += [_adjacent([local_tensor(p.grad) for p in run]) for run in opts["runs"]._runs]
                for o in opts.values():
                    o.step()
                    o.zero_grad()
        ps = {k: list(m.parameters()) for k, m in models.items()}
        same = all(torch.equal(local_tensor(a), local_tensor(b)) for a, b in zip(ps["runs"], ps["per_tensor"]))
        same_torchao = [
            torch.equal(local_tensor(p).detach(), local_shard(p).layout.shard(q.detach(), local_shard(p).rank))
            for p, q in zip(ps["runs"], ps["torchao"])
        ]
        return same, same_torchao, [len(r) for r in opts["runs"]._runs], adjacent_grads

    out = run_distributed(fn, world_size=world_size, timeout=300)
    assert all(o[0] for o in out), "runs differ from per-tensor steps"
    assert all(all(o[1]) and len(o[1]) == 6 for o in out), [o[1] for o in out]
    assert any(n >= 2 for o in out for n in o[2]), [o[2] for o in out]
    assert all(all(o[3]) and o[3] for o in out if o[2]), "fully_shard's gradients are adjacent views of one segment"


def test_compile_defaults_to_eager_on_cpu():
    # recipes/README.md: "AdamW8bit runs its step eagerly on CPU and torch.compile'd on GPUs".
    p = torch.nn.Parameter(torch.zeros(8))
    assert AdamW8bit([p]).compile is False
    assert AdamW8bit([{"params": [p]}]).compile is False
    assert AdamW8bit([p], compile=True).compile is True
