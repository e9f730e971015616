"""AdamW4bit on sharded params equals torchao's AdamW4bit unsharded, for every W, bitwise.

Reference nobody here wrote: ``torchao.optim.AdamW4bit`` (block 128, two codes per byte), run eager
(``TORCHDYNAMO_DISABLE=1``) against our ``compile=False``. Ranks are emulated in one process where
only the step is under test (``step()`` issues no collectives: checked on real ranks below).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_optim
from fsdp_optim._testing import make_sharded_param, run_distributed, sharded_grad
from fsdp_optim._testing import random_block_layout as _random_layout
from fsdp_optim.optimizers import AdamW4bit, AdamW8bit
from fsdp_optim.optimizers._quantized_adamw import FORMAT_4BIT, dequantize_blockwise, quantize_blockwise
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding import elements
from fsdp_optim.sharding.contract import local_tensor
from fsdp_optim.sharding.contract import local_shard
from tests.optimizers.test_adamw8bit import dynamo_disabled, torchao_amsgrad  # (TORCHDYNAMO_DISABLE=1 for torchao's step)

warnings.filterwarnings("ignore", message=".*KernelPreference.*")
torchao_optim = pytest.importorskip("torchao.optim")

BS = 128
# Sizes torchao quantizes (multiple of 128, >= 4096), plus small tensors both keep in fp32.
TORCHAO_SHAPES = [(64, 64), (33, 128), (4224,), (7, 5)]
# >= 4096 but not a multiple of 128 (torchao keeps fp32; we quantize): odd and even tails.
ODD_SHAPES = [(4097,), (17, 243), (35, 130)]


def random_block_layout(shape, world_size: int, seed: int) -> RaggedLayout:
    """Random contiguous 128-block-aligned ranges (some empty)."""
    return _random_layout(shape, world_size, seed, block=BS)


def make_data(shapes, num_steps: int, *, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) * 0.1 for s in shapes] for _ in range(num_steps)]
    return params, grads


def torchao_reference(params, grads, **kw):
    """Unsharded torchao AdamW4bit (eager): final params and per-param {key: flat state}."""
    ps = [nn.Parameter(p.clone()) for p in params]
    opt = torchao_optim.AdamW4bit(ps, **kw)
    with dynamo_disabled():
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
    states = []
    for p in ps:
        st = {}
        for k, v in opt.state[p].items():
            if k == "step":
                continue
            if hasattr(v, "codes"):
                st[f"{k}_codes"], st[f"{k}_scale"] = v.codes.reshape(-1).clone(), v.scale.clone()
                st[f"{k}_dequantized"] = v.dequantize().reshape(-1).float()
            else:
                st[k] = v.reshape(-1).float().clone()
        states.append(st)
    return [local_tensor(p).clone() for p in ps], states


def emulated_ranks(params, grads, layouts, **kw):
    """Every rank's AdamW4bit in this process: (unsharded params, {(i, key): global flat state})."""
    world_size = layouts[0].world_size
    ranks = []
    for rank in range(world_size):
        ps = []
        for i, (f, lay) in enumerate(zip(params, layouts)):
            p = make_sharded_param(f, spec=elements(BS), layout=lay, fqn=f"p{i}", rank=rank)
            ps.append(p)
        ranks.append((ps, AdamW4bit(ps, compile=False, **kw)))
    for gs in grads:
        for rank, (ps, opt) in enumerate(ranks):
            for p, g, lay in zip(ps, gs, layouts):
                p.grad = sharded_grad(p, g)
            opt.step()
    out_p = [lay.unshard([ps[i].to_local().detach() for ps, _ in ranks]) for i, lay in enumerate(layouts)]
    out_s = {}
    for i in range(len(layouts)):
        for key in ranks[0][1].state[ranks[0][0][i]]:
            if key != "step":
                out_s[(i, key)] = torch.cat([opt.state[ps[i]][key].reshape(-1) for ps, opt in ranks])
        for name in ranks[0][1].dequantized_state(ranks[0][0][i]):
            out_s[(i, f"{name}_dequantized")] = torch.cat([opt.dequantized_state(ps[i])[name] for ps, opt in ranks])
    quantized = [ranks[0][1].is_quantized(ranks[0][0][i]) for i in range(len(layouts))]
    return out_p, out_s, quantized


def assert_matches_torchao(out, ref, shapes):
    """Params, codes, scales and dequantized states bitwise equal to torchao's, and the same 4-bit
    decisions; returns how many tensors are quantized."""
    (out_p, out_s, quantized), (ref_p, ref_s) = out, ref
    for i in range(len(shapes)):
        assert torch.equal(out_p[i], ref_p[i]), f"param {i}: max diff {(out_p[i] - ref_p[i]).abs().max()}"
        assert quantized[i] == ("exp_avg_codes" in ref_s[i])  # the same 4-bit decision as torchao
        for key, want in ref_s[i].items():
            if key.endswith("_codes") or key.endswith("_scale"):
                assert out_s[(i, key)].dtype == want.dtype and torch.equal(out_s[(i, key)], want), (i, key)
            else:  # dequantized values (quantized), or the fp32 moments themselves (small tensors)
                got = out_s[(i, key if quantized[i] else f"{key}_dequantized")]
                assert torch.equal(got, want), (i, key)
    return sum(quantized[: len(shapes)])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("hp", [dict(lr=1e-2), dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)])
def test_matches_torchao_bitwise(world_size, hp):
    params, grads = make_data(TORCHAO_SHAPES, 3)
    layouts = [random_block_layout(s, world_size, seed=10 * world_size + i) for i, s in enumerate(TORCHAO_SHAPES)]
    ref = torchao_reference(params, grads, **hp)
    assert assert_matches_torchao(emulated_ranks(params, grads, layouts, **hp), ref, TORCHAO_SHAPES) == 3


def padded_reference(params, grads, **kw):
    """torchao on each tensor zero-padded to a multiple of 128 (zero params and grads stay zero), so
    torchao quantizes it: its first ``numel`` elements are what quantizing a partial block means."""
    padded_p, padded_g = [], [[] for _ in grads]
    for i, p in enumerate(params):
        n = p.numel()
        size = -(-n // BS) * BS
        padded_p.append(torch.cat([p.reshape(-1), p.new_zeros(size - n)]))
        for t, gs in enumerate(grads):
            padded_g[t].append(torch.cat([gs[i].reshape(-1), p.new_zeros(size - n)]))
    ref_p, ref_s = torchao_reference(padded_p, padded_g, **kw)
    out = []
    for p, rp, rs in zip(params, ref_p, ref_s):
        n = p.numel()
        assert torch.count_nonzero(rp[n:]) == 0  # the padding stayed zero
        out.append((rp[:n].reshape(p.shape), rs))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_odd_sizes_are_4bit_and_identical_across_world_sizes(world_size):
    params, grads = make_data(ODD_SHAPES, 3, seed=1)
    layouts = [random_block_layout(s, world_size, seed=world_size + i) for i, s in enumerate(ODD_SHAPES)]
    out = emulated_ranks(params, grads, layouts, lr=1e-2)
    assert all(out[2]), "a tensor >= 4096 elements gets 4-bit state whatever its size mod 128"
    assert_odd_sizes_match_padded_torchao(out, padded_reference(params, grads, lr=1e-2), params)


def assert_odd_sizes_match_padded_torchao(out, ref, params, names=("exp_avg", "exp_avg_sq")):
    out_p, out_s, _ = out
    for i, (want_p, want_s) in enumerate(ref):
        n = params[i].numel()
        assert torch.equal(out_p[i], want_p), i
        for name in names:
            # Scales and the real elements' values equal torchao's on the padded tensor; the padding's
            # own codes are not stored (the final byte of an odd tail holds one real code).
            assert torch.equal(out_s[(i, f"{name}_scale")], want_s[f"{name}_scale"]), (i, name)
            assert torch.equal(out_s[(i, f"{name}_dequantized")], want_s[f"{name}_dequantized"][:n]), (i, name)
            codes = out_s[(i, f"{name}_codes")]
            assert codes.numel() == -(-n // 2)
            assert torch.equal(codes[: n // 2], want_s[f"{name}_codes"][: n // 2]), (i, name)


@pytest.mark.parametrize("world_size", [1, 3])
def test_amsgrad_matches_torchao_amsgrad(world_size):
    """amsgrad against torchao's own (``torchao_amsgrad``), fed the gradients only, never our state:
    params, codes, scales and dequantized values of every moment, the max included, bitwise; sizes
    torchao quantizes and small ones, and odd sizes against torchao on the zero-padded tensor."""
    shapes, k = TORCHAO_SHAPES + ODD_SHAPES, len(TORCHAO_SHAPES)  # torchao's sizes first, then odd ones
    params, grads = make_data(shapes, 4, seed=5)
    layouts = [random_block_layout(s, world_size, seed=7 * world_size + i) for i, s in enumerate(shapes)]
    out_p, out_s, quantized = emulated_ranks(params, grads, layouts, lr=1e-2, amsgrad=True)
    with torchao_amsgrad():
        ref = torchao_reference(params[:k], [gs[:k] for gs in grads], lr=1e-2, amsgrad=True)
        padded = padded_reference(params[k:], [gs[k:] for gs in grads], lr=1e-2, amsgrad=True)
    assert sum("max_exp_avg_sq_codes" in st for st in ref[1]) == 3  # 4-bit maxima compared, not only fp32 ones
    assert assert_matches_torchao((out_p, out_s, quantized), ref, TORCHAO_SHAPES) == 3
    odd_out = (out_p[k:], {(i - k, key): v for (i, key), v in out_s.items() if i >= k}, quantized[k:])
    assert_odd_sizes_match_padded_torchao(odd_out, padded, params[k:], names=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))


def test_amsgrad_identical_across_world_sizes():
    # Bitwise equal for W = 1..4 (torchao's own amsgrad: test_amsgrad_matches_torchao_amsgrad).
    shapes = TORCHAO_SHAPES + ODD_SHAPES
    params, grads = make_data(shapes, 3, seed=2)
    runs = []
    for world_size in (1, 2, 3, 4):
        layouts = [random_block_layout(s, world_size, seed=world_size + i) for i, s in enumerate(shapes)]
        out_p, out_s, _ = emulated_ranks(params, grads, layouts, lr=1e-2, amsgrad=True)
        runs.append((out_p, out_s))
        assert out_s[(0, "max_exp_avg_sq_codes")].dtype == torch.uint8
    for out_p, out_s in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out_p, runs[0][0]))
        assert out_s.keys() == runs[0][1].keys() and all(torch.equal(v, runs[0][1][k]) for k, v in out_s.items())


def test_step_is_collective_free_and_state_is_checkpoint_shaped():
    shapes = [(17, 243), (64, 64), (7,)]
    params, grads = make_data(shapes, 1)
    layouts = [random_block_layout(s, 3, seed=i + 1) for i, s in enumerate(shapes)]

    def fn():
        rank = dist.get_rank()
        ps = [make_sharded_param(f, spec=elements(BS), layout=lay) for f, lay in zip(params, layouts)]
        opt = AdamW4bit(ps, compile=False)
        for p, g, lay in zip(ps, grads[0], layouts):
            p.grad = sharded_grad(p, g)
        with CommDebugMode() as comm:
            opt.step()
        shards = []
        for p in ps:
            sh = opt.state_shards(p)
            for key, s in sh.items():
                assert opt.state[p][key].numel() == s.end - s.start and opt.state[p][key].is_contiguous()
            shards.append({k: tuple(v) for k, v in sh.items()})
        return comm.get_total_counts(), shards

    out = run_distributed(fn, world_size=3)
    assert all(o[0] == 0 for o in out)
    n = 17 * 243
    for key in out[0][1][0]:
        ranges = [o[1][0][key] for o in out]
        assert ranges[0][1] == 0 and ranges[-1][2] == ranges[0][0]
        assert all(a[2] == b[1] for a, b in zip(ranges, ranges[1:]))  # they tile the global vector
    assert out[0][1][0]["exp_avg_codes"][0] == -(-n // 2) and out[0][1][0]["exp_avg_scale"][0] == -(-n // BS)


def _empty_tail_layout(shape, world_size: int, seed: int) -> RaggedLayout:
    """Everything on the ranks before the last, which holds an empty range at the tensor's end."""
    del seed
    n = shape[0] * shape[1]
    if world_size == 1:
        return RaggedLayout(tuple(shape), (0, n))
    cuts = [min(n, BS * -(-n * r // (world_size - 1) // BS)) for r in range(world_size)]
    return RaggedLayout(tuple(shape), (*cuts, n))


@pytest.mark.parametrize(
    ("shapes", "layout"),
    [
        ({"a.weight": (37, 130), "b.weight": (64, 64), "c.bias": (7,)}, random_block_layout),
        # odd length >= 4096 (4-bit codes end in a half-used byte) with an empty range at its end
        ({"a.weight": (37, 131), "b.weight": (64, 65)}, _empty_tail_layout),
    ],
    ids=["random-layouts", "odd-length-empty-tail"],
)
def test_checkpoint_reshards_2_to_3_bitwise(tmp_path, shapes, layout):
    """Saved on 2 ranks, loaded on 3 with other layouts: the next steps equal an uninterrupted run."""
    g = torch.Generator().manual_seed(3)
    full = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()} for _ in range(4)]

    def build(seed: int) -> tuple[nn.Module, AdamW4bit]:
        rng = random.Random(seed)
        root = nn.Module()
        for fqn, t in full.items():
            mod_name, leaf = fqn.split(".")
            if not hasattr(root, mod_name):
                root.add_module(mod_name, nn.Module())
            lay = layout(t.shape, dist.get_world_size(), seed=rng.randrange(1000))
            getattr(root, mod_name).register_parameter(leaf, make_sharded_param(t, spec=elements(BS), layout=lay, fqn=fqn))
        return root, AdamW4bit(root.parameters(), lr=1e-2, compile=False)

    def steps(model, opt, ts):
        for t in ts:
            for name, p in model.named_parameters():
                p.grad = sharded_grad(p, grads[t][name])
            opt.step()

    def gathered(model) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in model.named_parameters():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, (local_shard(p).start, local_tensor(p).clone()))
            out[name] = torch.cat([t for _, t in sorted(every, key=lambda x: x[0])])
        return out

    def save():
        model, opt = build(seed=0)
        steps(model, opt, range(2))
        fsdp_optim.save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)

    def resume():
        model, opt = build(seed=1)
        fsdp_optim.load_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
        steps(model, opt, range(2, 4))
        return gathered(model)

    def uninterrupted():
        model, opt = build(seed=2)
        steps(model, opt, range(4))
        return gathered(model)

    run_distributed(save, world_size=2)
    got = run_distributed(resume, world_size=3)[0]
    want = run_distributed(uninterrupted, world_size=1)[0]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_blockwise_helpers_match_torchao_and_round_trip_odd_tails():
    from torchao.optim.subclass_4bit import OptimState4bit

    x = torch.randn(4096 + 77)
    codes, scale = quantize_blockwise(x, signed=True, block_size=BS, fmt=FORMAT_4BIT)
    assert codes.dtype == torch.uint8 and codes.numel() == -(-x.numel() // 2) and scale.numel() == 33
    assert torch.equal(scale[-1], x[4096:].abs().max())  # the partial block's own absmax
    ref = OptimState4bit.zeros((4096,), True, BS)
    ref.copy_(x[:4096])
    assert torch.equal(codes[:2048], ref.codes) and torch.equal(scale[:32], ref.scale)
    y = dequantize_blockwise(codes, scale, signed=True, block_size=BS, fmt=FORMAT_4BIT, numel=x.numel())
    assert y.numel() == x.numel() and torch.equal(y[:4096], ref.dequantize())
    assert (y - x).abs().max() <= 0.25 * x.abs().max()  # 4-bit map: coarse, but bounded by the block scale


def test_bad_input_names_the_parameter_and_the_fix():
    # elements(1) sharding as plain FSDP would do it: rank boundaries inside 128-blocks.
    shape = (37, 130)
    lay = RaggedLayout.even_rows(shape, 3)
    full = torch.randn(shape)
    for rank in range(3):
        p = make_sharded_param(full, spec=elements(1), layout=lay, fqn="layers.0.w1.weight", rank=rank)
        with pytest.raises(ValueError, match=r"layers\.0\.w1\.weight.*world size 3.*blocks=AdamW4bit\.blocks"):
            AdamW4bit([p])
    with pytest.raises(ValueError, match="block_size"):
        AdamW4bit([nn.Parameter(torch.zeros(3))], block_size=127)
    assert AdamW4bit.blocks("w", torch.zeros(3), None) == elements(128)
    assert AdamW8bit.blocks("w", torch.zeros(3), None) == elements(256)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_runs_of_adjacent_shards_equal_per_tensor_calls_bitwise(amsgrad):
    """[Note: runs] with 4-bit codes (two per byte): shards back to back in one buffer, stepped one
    call per run, give the bits of one call per tensor (itself equal to torchao, tested above); the
    odd sizes' partial final blocks end their runs. W = 3, a parameter without a gradient at step 1."""
    from tests.optimizers.test_adamw8bit import RUN_SHAPES, adjacent_run

    world_size = 3
    params, grads = make_data(RUN_SHAPES, 3, seed=11)
    layouts = [random_block_layout(s, world_size, seed=i) for i, s in enumerate(RUN_SHAPES)]
    kw = dict(cls=AdamW4bit, bs=BS, lr=1e-2, amsgrad=amsgrad)
    fused = adjacent_run(params, grads, layouts, fuse_runs=True, **kw)
    plain = adjacent_run(params, grads, layouts, fuse_runs=False, **kw)
    for f, p in zip(fused, plain):
        assert all(torch.equal(a, b) for a, b in zip(f[0], p[0]))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(f[1], p[1]) for k in a)
        assert f[4][0] < p[4][0] or not any(len(r) > 1 for r in f[5])
    assert any(len(r) > 1 for f in fused for r in f[5])
