"""Block-wise FP8 parameter all-gather (``fully_shard(..., fp8_all_gather=Float8AllGather(...))``).

Reference for every distributed check: an independent transcription, written here, of block-wise
e4m3 quantization of the *full* tensor unsharded (``_blockwise_e4m3``: tile by tile, scale = amax /
448 in fp32, an all-zero tile scale 1, codes = clamp(x / scale, -448, 448) cast to ``float8_e4m3fn``,
dequantized = codes.float() * scale cast to the compute dtype, as [Note: FP8 all-gather invariant]
states), which the gathered parameters must equal bitwise, for W = 1..4, both tile modes, every
optimizer's block rule, even and ragged layouts, and shapes that divide nothing (edge tiles partial).
The library's own ``quantize_blockwise`` is checked against the same transcription (codes and scales,
bitwise). Also: one collective per bucket, the bytes per
step against a bf16 gather, a short training run against the bf16 run, every optimizer and a
checkpoint round trip.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdp_optim
from fsdp_optim import Float8AllGather, MixedPrecisionPolicy
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import AdamW, AdamW8bit, Muon, Shampoo, adamw8bit_rule, adamw_rule, muon_rule, shampoo_rule
from fsdp_optim.sharding._buffer import DistributedBuffer
from fsdp_optim.sharding import PlanConfig, elements, rows, whole
from fsdp_optim.sharding.plan import TensorSpec, plan_model
from fsdp_optim.sharding._float8 import dequantize_blockwise, quantize_blockwise
from fsdp_optim.sharding._fully_shard import _STATE
from tests._models import TinyConfig, TinyTransformer, make_batch

TILES = {"128x128": (128, 128), "1x128": (1, 128)}
SHAPES = {"a": (300, 200), "b": (129, 77), "c": (77,), "d": (64, 40), "e": (256, 128), "f": (5, 3)}


E4M3_FN_MAX = 448.0  # float8_e4m3fn's largest finite value (torch.finfo)
assert torch.finfo(torch.float8_e4m3fn).max == E4M3_FN_MAX


def _blockwise_e4m3(full: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantization of a whole 2-D tensor, one tile at a time (edge tiles partial), as
    the docs of ``Float8AllGather`` state it, written without the library: per tile ``scale = amax /
    448`` (fp32; 1 where the tile is all zero: the brief's bare ``amax / 448`` would give 0 and NaN
    codes there), ``codes = clamp(x / scale, -448, 448).to(float8_e4m3fn)`` (round to nearest even;
    torch's cast saturates finite values at 448 anyway, so the clamp changes no bit here) and
    ``dequantized = codes.float() * scale`` (fp32). Returns (codes, scales [tiles], dequantized)."""
    th, tw = tile
    x = full.detach().float()
    rows, cols = x.shape
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    deq = torch.empty(rows, cols, dtype=torch.float32)
    scales = torch.empty(-(-rows // th), -(-cols // tw), dtype=torch.float32)
    for i in range(0, rows, th):
        for j in range(0, cols, tw):
            t = x[i : i + th, j : j + tw]
            amax = t.abs().max()
            scale = amax / E4M3_FN_MAX if amax > 0 else torch.tensor(1.0)
            c = torch.clamp(t / scale, -E4M3_FN_MAX, E4M3_FN_MAX).to(torch.float8_e4m3fn)
            codes[i : i + th, j : j + tw] = c
            deq[i : i + th, j : j + tw] = c.float() * scale
            scales[i // th, j // tw] = scale
    return codes, scales, deq


_REFERENCES: dict = {}


def _reference(key: str, full: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The gathered value of an FP8-eligible parameter: the transcription on the full tensor, in the
    compute dtype (cached per process: the same ``_Params`` in every configuration)."""
    k = (key, tile, dtype)
    if k not in _REFERENCES:
        _REFERENCES[k] = _blockwise_e4m3(full, tile)[2].to(dtype)
    return _REFERENCES[k]


# ---- pure quantization ------------------------------------------------------------------------
def test_quantize_blockwise_tiles_scales_and_zero_tiles():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 200, generator=g) * 100
    x[:128, :128] = 0  # an all-zero tile: scale 1, codes 0
    codes, scales = quantize_blockwise(x, (128, 128))
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (300, 200)
    assert scales.dtype == torch.float32 and scales.shape == (3, 2)
    assert scales[0, 0] == 1 and codes[:128, :128].float().abs().max() == 0
    # every other tile's largest element maps to +-448 exactly (scale = amax / 448)
    for i in range(3):
        for j in range(2):
            tile = x[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            if tile.abs().max() > 0:
                assert scales[i, j] == tile.abs().max() / 448
                assert codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs().max() == 448
    y = dequantize_blockwise(codes, scales, (128, 128), dtype=torch.float32)
    assert (y - x).abs().max() <= x.abs().max() * 2**-3  # e4m3: 3 mantissa bits
    c1, s1 = quantize_blockwise(x, (1, 128))
    assert s1.shape == (300, 2)


@pytest.mark.parametrize("tile", sorted(TILES))
def test_quantize_blockwise_equals_the_transcription(tile):
    """The library's quantizer against ``_blockwise_e4m3``: codes, scales and dequantized values
    bitwise, on shapes with partial edge tiles, rows of very different magnitudes and a zero tile."""
    g = torch.Generator().manual_seed(1)
    for shape in [(300, 200), (129, 77), (256, 128), (5, 3)]:
        x = torch.randn(shape, generator=g) * 10 ** torch.randn(shape[0], 1, generator=g)
        x[: min(128, shape[0]), : min(128, shape[1])] = 0
        codes, scales = quantize_blockwise(x, TILES[tile])
        want_codes, want_scales, want = _blockwise_e4m3(x, TILES[tile])
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), shape
        assert scales.dtype == torch.float32 and torch.equal(scales, want_scales), shape
        got = dequantize_blockwise(codes, scales, TILES[tile], dtype=torch.float32)
        assert torch.equal(got, want), shape


def test_bad_config():
    with pytest.raises(ValueError, match="tile"):
        Float8AllGather(tile="64x64")
    with pytest.raises(ValueError, match="min_numel"):
        Float8AllGather(min_numel=-1)
    with pytest.raises(ValueError, match="fp8_all_gather"):
        fsdp_optim.fully_shard(nn.Linear(4, 4), fp8_all_gather="128x128")


# ---- planner: rank boundaries on tile rows --------------------------------------------------------
@pytest.mark.parametrize("layout", ["even", "ragged", "auto"])
def test_planner_aligns_fp8_tensors_to_tile_rows(layout):
    """Every rank boundary inside an ``align_rows`` tensor is a block boundary of its spec *and* a
    multiple of ``align_rows`` rows; the recorded spec is the optimizer's (unchanged)."""
    shapes = [(300, 200), (129, 77), (1024, 64), (384, 96), (77,), (640, 32)]
    specs = [elements(1), elements(256), rows(16), rows(1024), whole(), None]
    for align in (128, 1):
        for w in range(1, 9):
            for k, spec in enumerate(specs):
                ts = []
                for i, shape in enumerate(shapes):
                    sp = spec if spec is not None else whole(row_splits=[64] * (shape[0] // 64)) if (
                        len(shape) == 2 and shape[0] % 64 == 0) else elements(1)
                    a = align if len(shape) == 2 else None
                    ts.append(TensorSpec(name=f"t{i}", shape=shape, spec=sp, align_rows=a))
                plan = plan_model([("b0", ts[:3]), ("b1", ts[3:])], world_size=w, config=PlanConfig(layout=layout))
                for b in plan.buckets:
                    b.check()
                    for pl in b.placements:
                        t = next(x for x in ts if x.name == pl.name)
                        assert pl.spec == t.spec
                        if t.align_rows is not None:
                            unit = t.align_rows * pl.shape[1]
                            assert all(x in (0, pl.numel) or x % unit == 0 for x in pl.shard.bounds), (
                                layout, align, w, k, pl.name, pl.shard.bounds)
                            if not pl.split:
                                assert pl.shard.is_aligned(pl.spec)


# ---- gather == unsharded quantization, bitwise --------------------------------------------------
class _Params(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for k, s in SHAPES.items():
            t = torch.randn(s, generator=g)
            if len(s) == 2:  # rows of very different magnitudes: scales differ per tile
                t = t * 10 ** torch.randn(s[0], 1, generator=g)
            if k == "a":
                t[:128, :128] = 0
            setattr(self, k, nn.Parameter(t))


def _gather_parity() -> dict:
    calls = []
    orig = DistributedBuffer.all_gather

    def counting(self, **kw):
        calls.append(self.plan.name)
        return orig(self, **kw)

    DistributedBuffer.all_gather = counting
    n_fp8 = 0
    try:
        for tile, th in TILES.items():
            for rule in (adamw_rule, adamw8bit_rule(), muon_rule(), shampoo_rule(16)):
                for layout in ("even", "ragged"):
                    for dtype in (torch.bfloat16, torch.float32):
                        ref, m = _Params(), _Params()
                        mp = MixedPrecisionPolicy(param_dtype=dtype) if dtype != torch.float32 else None
                        fsdp_optim.fully_shard(
                            m, blocks=rule, mp_policy=mp, plan_config=PlanConfig(layout=layout),
                            fp8_all_gather=Float8AllGather(tile=tile, min_numel=1000),
                        )
                        bucket = getattr(m, _STATE).bucket
                        flags = bucket.fp8_gather.fp8
                        for pl, f in zip(bucket.plan.placements, flags):
                            assert f == (len(pl.shape) == 2 and pl.numel >= 1000), (pl.name, pl.shard.bounds)
                            n_fp8 += f
                        masters = [p.detach().clone() for p in m.parameters()]
                        del calls[:]
                        m.unshard()
                        assert calls == [f"{bucket.plan.name}/fp8"]  # one collective for the bucket
                        for k, s in SHAPES.items():
                            full = getattr(ref, k).detach()
                            fp8 = len(s) == 2 and full.numel() >= 1000
                            want = _reference(k, full, th, dtype) if fp8 else full.to(dtype)
                            got = getattr(m, k)
                            assert got.shape == full.shape and got.dtype == dtype
                            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (tile, rule, layout, k)
                        m.reshard()
                        assert all(torch.equal(a, b) for a, b in zip(masters, m.parameters()))  # masters untouched
    finally:
        DistributedBuffer.all_gather = orig
    return {"fp8": n_fp8}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gather_equals_unsharded_quantization(world_size):
    out = run_distributed(_gather_parity, world_size=world_size, timeout=300)
    assert all(o["fp8"] == 2 * 4 * 2 * 2 * 4 for o in out)  # a, b, d, e in every configuration


# ---- bytes per step on a recipe-like model ------------------------------------------------------
def _recipe_like_model() -> nn.Module:
    """A Llama-style decoder sized like recipes/configs/tiny.toml (dim 256, 4 layers, 8 heads,
    byte vocabulary 258), built from TinyTransformer: every weight matrix >= 128 rows."""
    torch.manual_seed(0)
    return TinyTransformer(TinyConfig(vocab_size=258, dim=256, num_heads=8, num_layers=4, mlp_dim=768, frozen=False))


def _bytes_per_step(fp8: bool) -> dict:
    sizes = []
    orig = DistributedBuffer.all_gather

    def counting(self, **kw):
        out = orig(self, **kw)
        res = out if torch.is_tensor(out) else out.wait()
        sizes.append(res.numel() * res.element_size())
        return out

    model = _recipe_like_model()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = Float8AllGather() if fp8 else None
    for layer in model.layers:
        fsdp_optim.fully_shard(layer, blocks=adamw_rule, mp_policy=mp, fp8_all_gather=cfg)
    fsdp_optim.fully_shard(model, blocks=adamw_rule, mp_policy=mp, fp8_all_gather=cfg)
    x, y = make_batch(batch_size=2, seq_len=16, vocab_size=258, seed=0)
    DistributedBuffer.all_gather = counting
    try:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    finally:
        DistributedBuffer.all_gather = orig
    return {"bytes": sum(sizes), "calls": len(sizes)}


def test_allgather_bytes_about_half_of_bf16():
    bf16 = run_distributed(lambda: _bytes_per_step(False), world_size=2)[0]
    fp8 = run_distributed(lambda: _bytes_per_step(True), world_size=2)[0]
    ratio = fp8["bytes"] / bf16["bytes"]
    print(f"all-gather bytes per step: bf16 {bf16['bytes']}, fp8 {fp8['bytes']}, ratio {ratio:.4f}")
    assert fp8["calls"] == bf16["calls"]  # the same number of collectives
    assert 0.5 <= ratio <= 0.52  # codes are 1 byte, bf16 2; scales and norms add < 2%


# ---- training ----------------------------------------------------------------------------------
# Matrices >= 128 rows (FP8-gathered); an untied head so the initial loss is ~ln(vocab).
TRAIN_CFG = TinyConfig(dim=128, num_heads=4, mlp_dim=256, tie_embeddings=False)


def _train(*, fp8: bool, opt: str = "adamw", steps: int = 20, ckpt: str | None = None) -> list[float]:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = TinyTransformer(TRAIN_CFG)
    rule = {"adamw": adamw_rule, "adamw8bit": adamw8bit_rule(), "muon": muon_rule(), "shampoo": shampoo_rule(128)}[opt]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = Float8AllGather(min_numel=128 * 128) if fp8 else None
    for layer in model.layers:
        fsdp_optim.fully_shard(layer, blocks=rule, mp_policy=mp, fp8_all_gather=cfg)
    fsdp_optim.fully_shard(model, blocks=rule, mp_policy=mp, fp8_all_gather=cfg)
    if fp8:
        n = sum(sum(b.fp8_gather.fp8) for b in getattr(model, _STATE).runtime.buckets if b.fp8_gather is not None)
        assert n == 2 + 6 * TRAIN_CFG.num_layers  # embedding, head, and q/k/v/o, w1, w2 per layer
    params = list(model.parameters())
    optim = {
        "adamw": lambda: AdamW(params, lr=3e-3, weight_decay=0.0),
        "adamw8bit": lambda: AdamW8bit(params, lr=3e-3, weight_decay=0.0, compile=False),
        "muon": lambda: Muon(list(model.named_parameters()), lr=2e-2, adamw_lr=3e-3, weight_decay=0.0),
        "shampoo": lambda: Shampoo(params, lr=3e-3, max_preconditioner_dim=128),
    }[opt]()
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for s in range(steps):
        x, y = make_batch(batch_size=8, seq_len=16, seed=100 + s % 4)  # 4 batches, cycled: learnable
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = F.cross_entropy(model(xs).float().flatten(0, 1), ys.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if ckpt is not None:  # master weights round-trip through a checkpoint into a model without FP8
        masters = [p.detach().clone() for p in model.parameters()]
        fsdp_optim.save_checkpoint(ckpt, model=model, optimizer=optim)
        torch.manual_seed(1)
        other = TinyTransformer(TRAIN_CFG)
        fsdp_optim.fully_shard(other, blocks=rule, mp_policy=mp)
        fsdp_optim.load_checkpoint(ckpt, model=other)
        full = fsdp_optim.full_state_dict(other)
        mine = fsdp_optim.full_state_dict(model)
        assert all(torch.equal(full[k], mine[k]) for k in mine)
        assert len(masters) == len(list(model.parameters()))
    return losses


def test_training_tracks_bf16_gather():
    ref = run_distributed(lambda: _train(fp8=False), world_size=2)[0]
    got = run_distributed(lambda: _train(fp8=True), world_size=2)[0]
    gap = [abs(a - b) for a, b in zip(got, ref)]
    print(f"loss after {len(ref)} steps (from {ref[0]:.4f}): bf16 {ref[-1]:.4f}, fp8 {got[-1]:.4f}, "
          f"gap {gap[-1]:.4f}; max gap over the run {max(gap):.4f}")
    assert ref[-1] < ref[0] - 0.5 and got[-1] < got[0] - 0.5  # both learn
    assert max(gap) < 0.05 * ref[0] and gap[-1] < 0.02 * ref[-1]


@pytest.mark.parametrize("opt", ["adamw8bit", "muon", "shampoo"])
def test_every_optimizer_and_checkpoint(opt):
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(tmp, "ck")
        ref = run_distributed(lambda: _train(fp8=False, opt=opt, steps=3), world_size=2)[0]
        got = run_distributed(lambda: _train(fp8=True, opt=opt, steps=3, ckpt=ck), world_size=2)[0]
    assert abs(got[-1] - ref[-1]) < 0.02 * ref[-1], (got, ref)
