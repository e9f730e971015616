"""Muon on shards equals torch.optim.Muon (matrices) + torch.optim.AdamW (the rest), unsharded.

Every comparison is bitwise: Muon's update is element-wise but for Newton–Schulz, which runs on
the whole matrix with the same ops as torch (owned matrices locally, split matrices on their owner
after an exact bf16 exchange), so there is no rounding difference to tolerate.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.optim._muon import _zeropower_via_newtonschulz

from fsdp_optim._testing import DistributedTestError, make_sharded_param, run_distributed, sharded_grad
from fsdp_optim.optimizers import Muon
from fsdp_optim.optimizers._muon import DEFAULT_NS_COEFFICIENTS, assign_owners, newton_schulz
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding import elements, expert, whole
from fsdp_optim.sharding.contract import local_tensor

STEPS = 3


@contextlib.contextmanager
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded; so does the reference
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _grads(
    shapes: dict[str, tuple[int, ...]], step: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}


def _init(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}


# ---- layouts ------------------------------------------------------------------------------
def owner_layout(shape, world_size: int, owner: int) -> RaggedLayout:
    """All of the tensor on ``owner`` (what a ragged plan does with a matrix); other ranks empty."""
    n = math.prod(shape)
    return RaggedLayout(tuple(shape), tuple([0] * (owner + 1) + [n] * (world_size - owner)))


def uneven_layout(shape, world_size: int, unit: int = 1) -> RaggedLayout:
    """Uneven, ``unit``-aligned ranges (rank r gets a share ~ r + 1): divides nothing."""
    n = math.prod(shape)
    units = -(-n // unit)
    tot = world_size * (world_size + 1) // 2
    cuts = [min(units * (r * (r + 1) // 2) // tot * unit, n) for r in range(world_size)] + [n]
    return RaggedLayout(tuple(shape), tuple(cuts))


# ---- the reference ------------------------------------------------------------------------
MUON_KW = dict(lr=0.02, momentum=0.9, ns_steps=5)
ADAMW_KW = dict(adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.05)


def reference(
    init: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    muon_names: list[str],
    *,
    weight_decay: float,
    nesterov: bool,
    adjust_lr_fn: str | None,
    sub_matrices: dict[str, list[tuple[int, int, int]]] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on every hidden matrix (or on each of its sub-matrices), torch.optim.AdamW on
    the rest; full tensors, one process, one thread; gradients of ``dtype`` (init's dtype)."""
    sub_matrices = sub_matrices or {}
    with _one_thread():
        full = {k: v.clone() for k, v in init.items()}
        pieces: dict[str, list[torch.nn.Parameter]] = {}
        for k in muon_names:
            mats = sub_matrices.get(k) or [(0, *shapes[k])]
            flat = full[k].reshape(-1)
            pieces[k] = [torch.nn.Parameter(flat[o : o + r * c].view(r, c).clone()) for o, r, c in mats]
        rest = {k: torch.nn.Parameter(full[k]) for k in full if k not in muon_names}
        muon = torch.optim.Muon(
            [q for k in muon_names for q in pieces[k]], weight_decay=weight_decay, nesterov=nesterov,
            adjust_lr_fn=adjust_lr_fn, **MUON_KW,
        )  # fmt: skip
        adamw = torch.optim.AdamW(
            list(rest.values()) or [torch.nn.Parameter(torch.zeros(1))],
            lr=ADAMW_KW["adamw_lr"], betas=ADAMW_KW["adamw_betas"],
            eps=ADAMW_KW["adamw_eps"], weight_decay=ADAMW_KW["adamw_weight_decay"],
        )  # fmt: skip
        for s in range(STEPS):
            g = _grads(shapes, s, dtype)
            for k in muon_names:
                mats = sub_matrices.get(k) or [(0, *shapes[k])]
                flat = g[k].reshape(-1)
                for q, (o, r, c) in zip(pieces[k], mats):
                    q.grad = flat[o : o + r * c].view(r, c).clone()
            for k, q in rest.items():
                q.grad = g[k].clone()
            muon.step()
            adamw.step()
        out = {k: v.detach().clone() for k, v in rest.items()}
        for k in muon_names:
            out[k] = torch.cat([q.detach().reshape(-1) for q in pieces[k]]).view(shapes[k])
        return out


def run_sharded(
    init, shapes, specs, layouts, splits, buckets, *, world_size, configs: list[dict], dtype=torch.float32
) -> list[tuple[dict[str, torch.Tensor], list]]:
    """Our Muon on sharded params over ``world_size`` gloo ranks, once per optimizer config (one
    launch); per config the unsharded result and each rank's per-step collective counts. Gradients
    of ``dtype`` (init's dtype)."""

    def fn():
        out = []
        for kw in configs:
            params = {
                k: make_sharded_param(
                    init[k], spec=specs[k], layout=layouts[k], fqn=k, split=k in splits
                )
                for k in shapes
            }
            opt = Muon(list(params.values()), **MUON_KW, **ADAMW_KW, **kw)
            counts = []
            for s in range(STEPS):
                g = _grads(shapes, s, dtype)
                for k, p in params.items():
                    p.grad = sharded_grad(p, g[k])
                with CommDebugMode() as mode:
                    opt.step()
                counts.append({str(op): n for op, n in mode.get_comm_counts().items() if n})
            out.append(({k: local_tensor(p).clone() for k, p in params.items()}, counts))
        return out

    outs = run_distributed(fn, world_size=world_size)
    return [
        ({k: layouts[k].unshard([o[i][0][k] for o in outs]) for k in shapes}, [o[i][1] for o in outs])
        for i in range(len(configs))
    ]


def assert_bitwise(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    for k in ref:
        assert torch.equal(ours[k], ref[k]), f"{k}: max |diff| {(ours[k] - ref[k]).abs().max().item():.3e}"


# ---- a small model's parameters --------------------------------------------------------------
SHAPES = {
    "embed.weight": (11, 6),
    "layers.0.attn.wq.weight": (12, 10),
    "layers.0.mlp.w1.weight": (7, 13),
    "layers.0.mlp.w2.weight": (13, 7),
    "layers.0.norm.weight": (10,),
    "layers.0.mlp.b1": (7,),
    "layers.0.attn.gate.weight": (1, 33),
    "layers.1.mlp.w1.weight": (7, 13),
    "layers.1.mlp.w2.weight": (13, 7),
    "lm_head.weight": (9, 6),
}
MATRICES = [
    "layers.0.attn.wq.weight", "layers.0.mlp.w1.weight", "layers.0.mlp.w2.weight", "layers.0.attn.gate.weight",
    "layers.1.mlp.w1.weight", "layers.1.mlp.w2.weight",
]  # fmt: skip


def _specs(shapes):
    return {k: Muon.blocks(k, torch.empty(s), None) for k, s in shapes.items()}


CONFIGS = [
    dict(adjust_lr_fn="original", nesterov=True, weight_decay=0.1),
    dict(adjust_lr_fn="original", nesterov=False, weight_decay=0.0),
    dict(adjust_lr_fn="match_rms_adamw", nesterov=True, weight_decay=0.0),
    dict(adjust_lr_fn="match_rms_adamw", nesterov=False, weight_decay=0.1),
]
REFERENCE_MODE = dict(adjust_lr_fn="original", nesterov=True, weight_decay=0.1, batched=False)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_whole_matrices_equal_torch_muon(world_size):
    """Both adjust_lr_fns x Nesterov on/off x weight decay on/off (one launch per W)."""
    init, specs = _init(SHAPES), _specs(SHAPES)
    assert [k for k in SHAPES if specs[k].is_matrix] == MATRICES  # embeddings, head, 1-D -> AdamW
    layouts = {}
    for i, (k, s) in enumerate(SHAPES.items()):
        layouts[k] = owner_layout(s, world_size, i % world_size) if specs[k].is_matrix else uneven_layout(s, world_size)
    configs = [*CONFIGS, REFERENCE_MODE]  # batched (default) and the per-matrix reference mode
    results = run_sharded(init, SHAPES, specs, layouts, set(), {}, world_size=world_size, configs=configs)
    for kw, (ours, counts) in zip(configs, results):
        kw = {k: v for k, v in kw.items() if k != "batched"}
        assert_bitwise(ours, reference(init, SHAPES, MATRICES, **kw))
        assert all(c == {} for per_rank in counts for c in per_rank), counts  # zero collectives in step()


def _split_case(world_size, *, large: bool = False):
    """Two buckets with split matrices (bucket 0 also holds a whole one), bucket 2 without.
    ``large``: split matrices of > 64 elements per piece whose pieces divide nothing (add_'s tails)."""
    split_shapes = ((67, 33), (29, 41)) if large else ((13, 7), (9, 9))  # large: one tall, one wide
    shapes = {
        "a.weight": split_shapes[0], "b.weight": (6, 17), "c.weight": split_shapes[1], "d.weight": (10, 5),
        "e.bias": (9,),
    }  # fmt: skip
    buckets = {"a.weight": 0, "b.weight": 0, "c.weight": 1, "d.weight": 2, "e.bias": 2}
    specs = _specs(shapes)
    layouts, splits = {}, set()
    for k, s in shapes.items():
        if k in ("a.weight", "c.weight") and world_size > 1:  # cut on rows, unevenly (an empty rank at W >= 3)
            layouts[k] = uneven_layout(s, world_size, unit=s[1])
            splits.add(k)
        elif specs[k].is_matrix:
            layouts[k] = owner_layout(s, world_size, world_size - 1)
        else:
            layouts[k] = uneven_layout(s, world_size)
    return shapes, buckets, specs, layouts, splits


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_split_matrices_equal_torch_muon_with_one_exchange_pair(world_size):
    """Split matrices in two buckets: one all_to_all_single pair per step for all of them."""
    shapes, buckets, specs, layouts, splits = _split_case(world_size)
    assert all(len(set(layouts[k].bounds)) >= 3 for k in splits)  # really cut: pieces on >= 2 ranks
    init = _init(shapes)
    configs = [CONFIGS[0], CONFIGS[3], REFERENCE_MODE]
    results = run_sharded(init, shapes, specs, layouts, splits, buckets, world_size=world_size, configs=configs)
    assert len({buckets[k] for k in splits}) == (2 if splits else 0)
    want = {"c10d.alltoall_base_": 2} if splits else {}
    for kw, (ours, counts) in zip(configs, results):
        kw = {k: v for k, v in kw.items() if k != "batched"}
        # Bitwise, not within a tolerance: the owner orthogonalizes the exact full bf16 update.
        assert_bitwise(ours, reference(init, shapes, [k for k in shapes if specs[k].is_matrix], **kw))
        assert all(c == want for per_rank in counts for c in per_rank), counts


def _sub_matrix_case(world_size, *, split: bool, large: bool = False):
    """``large``: sub-matrices of > 64 elements that divide nothing (add_'s tails)."""
    if large:
        shapes = {"attn.wq.weight": (120, 33), "attn.wqkv.weight": (100, 33), "moe.experts.w1": (4, 20, 70)}
        head, qkv = 40, [60, 20, 20]
    else:
        shapes = {"attn.wq.weight": (12, 10), "attn.wqkv.weight": (10, 6), "moe.experts.w1": (3, 5, 7)}
        head, qkv = 4, [6, 2, 2]
    rule = Muon.rule(head_dims={"attn.wq.weight": head}, row_splits={"attn.wqkv.weight": qkv})
    specs = {k: rule(k, torch.empty(s), None) for k, s in shapes.items()}
    assert specs["attn.wq.weight"] == whole(row_splits=[head] * 3) and specs["moe.experts.w1"] == expert()
    layouts = {}
    for k, s in shapes.items():
        unit = specs[k].split_unit(s) if split else None
        if split:  # cut on rows, never on a sub-matrix boundary (move such cuts one row on)
            b = list(uneven_layout(s, world_size, unit=unit).bounds)
            for i in range(1, world_size):
                b[i] = max(b[i - 1], b[i] + unit if 0 < b[i] < b[-1] and specs[k].is_boundary(s, b[i]) else b[i])
            layouts[k] = RaggedLayout(s, tuple(b))
        else:  # whole sub-matrices spread over the ranks (block starts), uneven
            starts = specs[k].block_starts(s)
            idx = [len(starts) - 1 - (len(starts) - 1) * (world_size - r) * (world_size - r + 1)
                   // (world_size * (world_size + 1)) for r in range(world_size)] + [len(starts) - 1]
            idx[0] = 0
            layouts[k] = RaggedLayout(s, tuple(starts[i] for i in idx))
            assert layouts[k].is_aligned(specs[k])
    subs = {k: specs[k].matrices(s) for k, s in shapes.items()}
    return shapes, specs, layouts, subs


@pytest.mark.parametrize("world_size,split", [(w, False) for w in (1, 2, 3, 4)] + [(w, True) for w in (2, 3, 4)])
def test_heads_fused_qkv_and_experts_equal_torch_muon_per_sub_matrix(world_size, split):
    """Per-head (whole(row_splits=[4]*3)), fused QKV (row_splits [6, 2, 2]) and experts ([3, 5, 7]):
    sub-matrices whole on ranks (split=False) or cut inside a sub-matrix on a row (split=True)."""
    shapes, specs, layouts, subs = _sub_matrix_case(world_size, split=split)
    splits = {k for k in shapes if split and any(
        o < b < o + r * c for o, r, c in subs[k] for b in layouts[k].bounds[1:-1])}  # fmt: skip
    assert splits == (set(shapes) if split else set())
    init = _init(shapes)
    kw = dict(weight_decay=0.1, nesterov=True, adjust_lr_fn="match_rms_adamw")
    results = run_sharded(init, shapes, specs, layouts, splits, {}, world_size=world_size,
                          configs=[kw, {**kw, "batched": False}])  # fmt: skip
    want = {"c10d.alltoall_base_": 2} if splits else {}
    for ours, counts in results:
        assert_bitwise(ours, reference(init, shapes, list(shapes), sub_matrices=subs, **kw))
        assert all(c == want for per_rank in counts for c in per_rank), counts


@pytest.mark.parametrize("world_size,dtype", [
    pytest.param(2, torch.bfloat16, id="bf16-W2"), pytest.param(3, torch.bfloat16, id="bf16-W3"),
    pytest.param(4, torch.bfloat16, id="bf16-W4"), pytest.param(3, torch.float16, id="fp16-W3"),
])  # fmt: skip
def test_low_precision_split_matrices_equal_torch_muon(world_size, dtype):
    """bf16 / fp16 parameters, split matrices (one tall, one wide) whose pieces divide nothing:
    torch's CPU add_ rounds its scalar code (the tail, a transposed operand) differently from its
    vectorized body, so bf16 pieces added on their ranks got other bits than torch.optim.Muon's
    whole-matrix add (1 ulp, ~1.5% of elements); the owner adds the whole matrix instead. Still one
    all_to_all_single pair per step. (fp16 passed before too on these data: it checks the 2-byte bit
    view the parameter pieces travel in.)"""
    shapes, buckets, specs, layouts, splits = _split_case(world_size, large=True)
    assert all(b - a > 64 for k in splits for a, b in zip(layouts[k].bounds, layouts[k].bounds[1:]))
    init = _init(shapes, dtype)
    configs = [CONFIGS[0], CONFIGS[2], REFERENCE_MODE]
    results = run_sharded(init, shapes, specs, layouts, splits, buckets, world_size=world_size, configs=configs,
                          dtype=dtype)  # fmt: skip
    for kw, (ours, counts) in zip(configs, results):
        kw = {k: v for k, v in kw.items() if k != "batched"}
        assert all(v.dtype == dtype for v in ours.values())
        assert_bitwise(ours, reference(init, shapes, [k for k in shapes if specs[k].is_matrix], dtype=dtype, **kw))
        assert all(c == {"c10d.alltoall_base_": 2} for per_rank in counts for c in per_rank), counts


@pytest.mark.parametrize("world_size,split", [(1, False), (3, False), (2, True), (3, True), (4, True)])
def test_bf16_heads_fused_qkv_and_experts_equal_torch_muon_per_sub_matrix(world_size, split):
    """bf16 sub-matrices of > 64 elements (heads [40, 33], QKV [60|20|20, 33], experts [3, 40, 33]):
    a local run of several is added matrix by matrix, as torch.optim.Muon adds each (one
    [count, rows, cols] add put other elements in add_'s tail); split ones are added whole by the owner."""
    shapes, specs, layouts, subs = _sub_matrix_case(world_size, split=split, large=True)
    splits = {k for k in shapes if split and any(
        o < b < o + r * c for o, r, c in subs[k] for b in layouts[k].bounds[1:-1])}  # fmt: skip
    assert splits == (set(shapes) if split else set())
    init = _init(shapes, torch.bfloat16)
    kw = dict(weight_decay=0.1, nesterov=True, adjust_lr_fn="match_rms_adamw")
    results = run_sharded(init, shapes, specs, layouts, splits, {}, world_size=world_size,
                          configs=[kw, {**kw, "batched": False}], dtype=torch.bfloat16)  # fmt: skip
    want = {"c10d.alltoall_base_": 2} if splits else {}
    for ours, counts in results:
        assert_bitwise(ours, reference(init, shapes, list(shapes), sub_matrices=subs, dtype=torch.bfloat16, **kw))
        assert all(c == want for per_rank in counts for c in per_rank), counts


def test_split_matrix_of_one_byte_dtype_is_a_value_error():
    """Low-precision split pieces travel bit for bit in 2-byte slots: other element sizes are refused."""
    shapes, buckets, specs, layouts, splits = _split_case(2)

    def fn():
        p = make_sharded_param(_init(shapes)["a.weight"].to(torch.float8_e4m3fn), spec=specs["a.weight"],
                               layout=layouts["a.weight"], fqn="a.weight", split=True)  # fmt: skip
        with pytest.raises(ValueError, match=r"a\.weight is a split matrix of dtype torch\.float8_e4m3fn"):
            Muon([p], lr=0.02)

    run_distributed(fn, world_size=2)


def test_comm_debug_mode_counts_c10d_collectives():
    """Positive control for the zero-collective assertions above."""

    def fn():
        with CommDebugMode() as mode:
            out = torch.empty(dist.get_world_size())
            dist.all_to_all_single(out, torch.ones(dist.get_world_size()))
            dist.all_to_all_single(torch.empty(0), torch.empty(0), [0] * 3, [0] * 3)
        return {str(k): v for k, v in mode.get_comm_counts().items() if v}

    assert run_distributed(fn, world_size=3) == [{"c10d.alltoall_base_": 2}] * 3


# ---- state ---------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
def test_state_dict_keys_and_shapes_are_checkpoint_shaped(world_size):
    shapes, buckets, specs, layouts, splits = _split_case(world_size)
    init = _init(shapes)

    def fn():
        params = [make_sharded_param(init[k], spec=specs[k], layout=layouts[k], fqn=k,
                                     split=k in splits) for k in shapes]  # fmt: skip
        opt = Muon(params, lr=0.02)
        desc = lambda sd: {i: {k: tuple(v.shape) for k, v in st.items()} for i, st in sd["state"].items()}  # noqa: E731
        before = desc(opt.state_dict())
        for p, k in zip(params, shapes):
            p.grad = sharded_grad(p, _grads(shapes, 0)[k])
        opt.step()
        after = desc(opt.state_dict())
        shards = {i: {k: tuple(v) for k, v in opt.state_shards(p).items()} for i, p in enumerate(params)}
        sizes = {i: {k: opt.state[p][k].numel() for k in opt.state_shards(p)} for i, p in enumerate(params)}
        keys = {i: sorted(st) for i, st in opt.state_dict()["state"].items()}
        return before, after, shards, sizes, keys, [{k: v for k, v in g.items() if k != "params"}
                                                    for g in opt.state_dict()["param_groups"]]

    outs = run_distributed(fn, world_size=world_size)
    for rank, (before, after, shards, sizes, keys, groups) in enumerate(outs):
        assert before == after
        assert keys == outs[0][4] and groups == outs[0][5]  # the same keys and groups on every rank
        for i, st in shards.items():
            for k, (gnum, a, b, bounds, *_) in st.items():
                assert sizes[i][k] == b - a
                # every rank's start, then the global size; this rank's range is its entry
                assert len(bounds) == world_size + 1 and (bounds[rank], bounds[rank + 1], bounds[-1]) == (a, b, gnum)
                assert bounds == outs[0][2][i][k][3]  # the same bounds on every rank
    for i in outs[0][2]:  # global sizes agree and the ranges tile the global state
        for k in outs[0][2][i]:
            gnum = outs[0][2][i][k][0]
            assert [o[2][i][k][0] for o in outs] == [gnum] * world_size
            assert sum(o[3][i][k] for o in outs) == gnum


def test_state_dict_round_trip_and_lr_scheduler():
    init = _init(SHAPES)
    named = lambda: [(k, torch.nn.Parameter(v.clone())) for k, v in init.items()]  # noqa: E731

    def run(params, opt, steps):
        for s in steps:
            g = _grads(SHAPES, s)
            for k, p in params:
                p.grad = g[k].clone()
            opt.step()

    with _one_thread():
        a = named()
        opt_a = Muon(a, lr=0.02, adamw_lr=1e-3)
        assert [g["use_muon"] for g in opt_a.param_groups] == [True, False]
        assert [Muon.adamw_lr(g) for g in opt_a.param_groups] == [0.02, 1e-3]
        sched = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda s: 0.5)
        assert [Muon.adamw_lr(g) for g in opt_a.param_groups] == [0.01, 5e-4]  # both groups scheduled
        run(a, opt_a, [0, 1])
        b = [(k, torch.nn.Parameter(local_tensor(p).clone())) for k, p in a]
        opt_b = Muon(b, lr=0.02, adamw_lr=1e-3)
        opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as from a checkpoint
        run(a, opt_a, [2])
        run(b, opt_b, [2])
        del sched
    for (k, p), (_, q) in zip(a, b):
        assert torch.equal(p, q), k


@pytest.mark.parametrize("schedule", ["LambdaLR", "OneCycleLR"])
def test_a_scheduler_keeps_the_adamw_to_muon_lr_ratio(schedule):
    """Issue #29: OneCycleLR(max_lr=0.02) on Muon(lr=0.02, adamw_lr=3e-3) drove the AdamW part to
    Muon's lr. The reference: torch.optim.Muon and torch.optim.AdamW, each driven by the same
    schedule (OneCycleLR with max_lr 0.02 and 3e-3)."""
    steps = 6
    init = _init(SHAPES)

    def sched(opt, max_lr):
        if schedule == "LambdaLR":
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4 if s < 3 else 0.5 ** (s - 2))
        # cycle_momentum=False: on Muon it cycles the Muon part's momentum only (docs/muon.md).
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=steps, cycle_momentum=False)

    with _one_thread():
        params = [(k, torch.nn.Parameter(v.clone())) for k, v in init.items()]
        opt = Muon(params, lr=0.02, adamw_lr=3e-3, weight_decay=0.1, adamw_weight_decay=0.05)
        s = sched(opt, 0.02)
        ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
        ref_muon = torch.optim.Muon([ref[k] for k in MATRICES], lr=0.02, weight_decay=0.1)
        ref_adamw = torch.optim.AdamW([p for k, p in ref.items() if k not in MATRICES], lr=3e-3, weight_decay=0.05)
        ref_scheds = [sched(ref_muon, 0.02), sched(ref_adamw, 3e-3)]
        for step in range(steps - 1):
            g = _grads(SHAPES, step)
            for k, p in params:
                p.grad = g[k].clone()
                ref[k].grad = g[k].clone()
            opt.step()
            ref_muon.step()
            ref_adamw.step()
            for x in [s, *ref_scheds]:
                x.step()
            want = [ref_muon.param_groups[0]["lr"], ref_adamw.param_groups[0]["lr"]]
            got = [Muon.adamw_lr(g) for g in opt.param_groups]
            assert got == pytest.approx(want, rel=1e-12), (step, got, want)
    for k, p in params:  # the lr factor is the schedule's to its last bit, so not bitwise
        torch.testing.assert_close(local_tensor(p).detach(), ref[k].detach(), rtol=1e-6, atol=1e-7, msg=k)


def test_plain_named_parameters_equal_torch():
    """W = 1, plain (unsharded) parameters: names route embeddings and the head to AdamW."""
    init = _init(SHAPES)
    with _one_thread():
        params = [(k, torch.nn.Parameter(v.clone())) for k, v in init.items()]
        opt = Muon(params, **MUON_KW, **ADAMW_KW, weight_decay=0.1)
        for s in range(STEPS):
            g = _grads(SHAPES, s)
            for k, p in params:
                p.grad = g[k].clone()
            opt.step()
    ref = reference(init, SHAPES, MATRICES, weight_decay=0.1, nesterov=True, adjust_lr_fn=None)
    assert_bitwise({k: local_tensor(p).detach() for k, p in params}, ref)


# ---- pieces ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape", [(1, 33), (33, 1), (5, 7), (7, 5), (16, 16), (33, 65), (65, 33), (96, 128), (200, 72)]
)
def test_newton_schulz_same_bits_as_torch(shape):
    """The premise of bitwise equality and of W-invariance with batching: the same ops on the same
    full matrix, matrix by matrix or in a stack of any composition (which matrices share a stack
    depends on W), give each matrix torch.optim.Muon's bits."""
    g = torch.randn(5, *shape)
    with _one_thread():
        ref = torch.stack([_zeropower_via_newtonschulz(g[i], DEFAULT_NS_COEFFICIENTS, 5, 1e-7) for i in range(5)])
        assert torch.equal(newton_schulz(g[1]), ref[1])
        assert torch.equal(newton_schulz(g), ref)
        for idx in ([1], [3, 0], [4, 2, 1], [0, 1, 2, 3]):  # stacks of other sizes and members
            assert torch.equal(newton_schulz(g[idx]), ref[idx]), idx
        assert torch.equal(newton_schulz(g[1].bfloat16()), ref[1])  # the exchanged (bf16) input
    gb = g.bfloat16()
    newton_schulz(gb)
    assert torch.equal(gb, g.bfloat16())  # input untouched


def test_one_batched_chain_per_shape_and_reference_mode_one_per_matrix(monkeypatch):
    """Batched: one Newton–Schulz call per [rows, cols] (across parameters and groups with the same
    NS settings), stacks capped at _STACK_NUMEL; reference: one 2-D call per matrix. Same bits."""
    from fsdp_optim.optimizers import _muon

    shapes = {f"l{i}.w": (6, 4) for i in range(4)} | {"l9.w": (4, 6), "moe.w": (3, 6, 4), "x.w": (6, 4)}
    init = _init(shapes)
    calls: list[tuple[int, ...]] = []
    real = _muon.newton_schulz
    monkeypatch.setattr(_muon, "newton_schulz", lambda g, **kw: calls.append(tuple(g.shape)) or real(g, **kw))

    def run(batched, groups_ns=(5, 5)):
        with _one_thread():
            params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
            names = list(params)
            opt = Muon([{"params": [(k, params[k]) for k in names[:4]], "ns_steps": groups_ns[0]},
                        {"params": [(k, params[k]) for k in names[4:]], "ns_steps": groups_ns[1], "lr": 0.03}],
                       lr=0.02, batched=batched)  # fmt: skip
            for s in range(2):
                g = _grads(shapes, s)
                for k, p in params.items():
                    p.grad = g[k].clone()
                calls.clear()
                opt.step()
        return {k: local_tensor(p).detach() for k, p in params.items()}, sorted(calls)

    batched, calls_b = run(True)
    assert calls_b == sorted([(8, 6, 4), (1, 4, 6)]), calls_b
    ref, calls_r = run(False)
    assert calls_r == sorted([(6, 4)] * 8 + [(4, 6)]), calls_r
    assert_bitwise(batched, ref)
    _, calls_g = run(True, groups_ns=(5, 4))  # different NS settings never share a stack
    assert calls_g == sorted([(4, 6, 4), (4, 6, 4), (1, 4, 6)]), calls_g
    monkeypatch.setattr(_muon, "_STACK_NUMEL", 3 * 24)  # stacks of at most 3 matrices
    capped, calls_c = run(True)
    tall = [c for c in calls_c if c[1:] == (6, 4)]
    assert all(c[0] <= 3 for c in tall) and sum(c[0] for c in tall) == 8 and len(tall) < 8, calls_c
    assert_bitwise(capped, ref)
    monkeypatch.setattr(_muon, "_CPU_STACK_MAX_NUMEL", 23)  # on CPU, larger matrices go one at a time
    big, calls_big = run(True)
    assert calls_big == calls_r and _muon._stacks_well(6, 4, torch.device("cuda")), calls_big
    assert_bitwise(big, ref)


def test_assign_owners_balances_and_is_deterministic():
    # two big matrices go to different ranks; rank 1 starts loaded, so the first goes to rank 0
    assert assign_owners([10, 10, 1], [[5, 5], [5, 5], [0, 1]], [0, 3]) == [0, 1, 0]
    # ties go to the rank holding more of the matrix
    assert assign_owners([4], [[1, 3, 0]], [0, 0, 0]) == [1]
    costs = [7, 3, 9, 2, 2, 5]
    owners = assign_owners(costs, [[1, 1, 1]] * 6, [0, 0, 0])
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert max(loads) <= sum(costs) / 3 + max(costs)  # LPT bound
    assert owners == assign_owners(costs, [[1, 1, 1]] * 6, [0, 0, 0])


@pytest.mark.usefixtures("one_process_group")
def test_bad_layout_raises_naming_the_parameter_and_the_fix():
    full = torch.randn(6, 4)
    layout = RaggedLayout((6, 4), (0, 10, 24))  # cuts a row and the matrix, not recorded as split
    p = make_sharded_param(full, spec=whole(), layout=layout, fqn="blocks.0.w", rank=0)
    with pytest.raises(ValueError, match=r"blocks\.0\.w.*Muon\.blocks"):
        Muon([p])
    p = make_sharded_param(full, spec=whole(), layout=layout, fqn="blocks.0.w", split=True, rank=0)
    with pytest.raises(ValueError, match=r"blocks\.0\.w.*row boundaries"):
        Muon([p])
    q = make_sharded_param(full, spec=elements(1), layout=layout, fqn="blocks.0.w2", rank=0)
    with pytest.warns(UserWarning, match=r"blocks\.0\.w2, block spec elements\(1\)\) were not sharded as whole matrices.*AdamW fallback"):
        Muon([q])  # element-wise spec: AdamW fallback, any layout; a matrix there is worth a warning


def test_error_is_raised_on_every_rank():
    full = torch.randn(6, 4)

    def fn():
        p = make_sharded_param(full, spec=whole(), layout=RaggedLayout((6, 4), (0, 8, 24)), fqn="w")
        Muon([p])

    with pytest.raises(DistributedTestError, match=r"ranks with errors: \[0, 1\]"):
        run_distributed(fn, world_size=2)


# ---- end to end with fully_shard ---------------------------------------------------------------
def _fully_shard():
    from fsdp_optim import fully_shard  # an import error here is a failure, never a skip

    return fully_shard


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 7), torch.nn.Tanh(),
        torch.nn.Linear(7, 5, bias=False),
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_fully_shard_with_muon_blocks_equals_torch_muon(world_size):
    """fully_shard(..., blocks=Muon.blocks) + Muon(model.parameters()) vs torch.optim.Muon / AdamW on
    the unsharded model. Every rank sees the same batch, so the averaged gradient is exactly the
    single-process one (sums of W equal values, W a power of two) and the result is bitwise."""
    fully_shard = _fully_shard()

    def fn():
        model, ref = _mlp(), _mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, blocks=Muon.blocks)
        fully_shard(model, blocks=Muon.blocks)
        opt = Muon(model.parameters(), lr=0.02, weight_decay=0.1)
        muon = torch.optim.Muon([p for p in ref.parameters() if p.ndim == 2], lr=0.02, weight_decay=0.1)
        adamw = torch.optim.AdamW([p for p in ref.parameters() if p.ndim != 2])
        for s in range(3):
            x = torch.randn(6, 12, generator=torch.Generator().manual_seed(s))
            for m in (model, ref):
                m(x).square().sum().backward()
            for o in (opt, muon, adamw):
                o.step()
                o.zero_grad()
        from fsdp_optim.sharding.contract import local_shard

        return [(n, torch.equal(local_tensor(p).detach(), local_shard(p).layout.shard(q.detach(), local_shard(p).rank)))
                for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())]  # fmt: skip

    for per_rank in run_distributed(fn, world_size=world_size):
        assert all(ok for _, ok in per_rank), per_rank


@pytest.mark.parametrize("world_size", [3])
def test_param_groups_with_own_hyperparameters_share_a_split_bucket(world_size):
    """Two user groups (own lr, momentum, Nesterov, ns_steps, adamw_lr) with split matrices of both in
    one bucket: one exchange pair, each matrix orthogonalized with its own group's settings."""
    shapes, _, specs, layouts, splits = _split_case(world_size)
    init = _init(shapes)
    g1 = dict(lr=0.01, momentum=0.8, nesterov=False, ns_steps=4, adamw_lr=1e-2)
    first, second = ["a.weight", "b.weight"], ["c.weight", "d.weight", "e.bias"]

    def fn():
        params = {k: make_sharded_param(init[k], spec=specs[k], layout=layouts[k], fqn=k,
                                        split=k in splits) for k in shapes}  # fmt: skip
        opt = Muon([{"params": [params[k] for k in first]}, {"params": [params[k] for k in second], **g1}],
                   lr=0.02, weight_decay=0.1, adjust_lr_fn="original")  # fmt: skip
        counts = []
        for s in range(STEPS):
            g = _grads(shapes, s)
            for k, p in params.items():
                p.grad = sharded_grad(p, g[k])
            with CommDebugMode() as mode:
                opt.step()
            counts.append({str(op): n for op, n in mode.get_comm_counts().items() if n})
        return {k: local_tensor(p).clone() for k, p in params.items()}, counts

    outs = run_distributed(fn, world_size=world_size)
    ours = {k: layouts[k].unshard([o[0][k] for o in outs]) for k in shapes}
    assert all(c == {"c10d.alltoall_base_": 2} for o in outs for c in o[1])
    with _one_thread():
        full = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
        m1 = torch.optim.Muon([full["a.weight"], full["b.weight"]], lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
        m2 = torch.optim.Muon([full["c.weight"], full["d.weight"]], lr=0.01, momentum=0.8, nesterov=False,
                              ns_steps=4, weight_decay=0.1, adjust_lr_fn="original")  # fmt: skip
        aw = torch.optim.AdamW([full["e.bias"]], lr=1e-2)
        for s in range(STEPS):
            g = _grads(shapes, s)
            for k, p in full.items():
                p.grad = g[k].clone()
            for o in (m1, m2, aw):
                o.step()
    assert_bitwise(ours, {k: local_tensor(p).detach() for k, p in full.items()})


def test_pieces_match_brute_force():
    """The exchange plans (Muon's split matrices, Shampoo's split strips) find the ranks holding a range by
    bisection (no loop over all W)."""
    from fsdp_optim.optimizers._base import range_pieces

    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        w = int(torch.randint(1, 9, (1,), generator=gen))
        bounds = [0, *sorted(torch.randint(0, 60, (w - 1,), generator=gen).tolist()), 60]
        off = int(torch.randint(0, 50, (1,), generator=gen))
        n = int(torch.randint(1, 60 - off + 1, (1,), generator=gen))
        brute = [(q, max(bounds[q], off) - off, min(bounds[q + 1], off + n) - off) for q in range(w)]
        assert range_pieces(bounds, off, n) == tuple(x for x in brute if x[2] > x[1]), (bounds, off, n)


# ---- explicit Newton-Schulz / AdamW sets (issue 15) --------------------------------------------
class _OutHead(torch.nn.Module):
    """An embedding, a hidden matrix and an output head named ``out`` (no name token says "head")."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(11, 6)
        self.hidden = torch.nn.Linear(6, 8, bias=False)
        self.out = torch.nn.Linear(8, 11, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.tok(x))))


def _out_head_reference(steps: int = 3) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on ``hidden`` only, torch.optim.AdamW on ``tok`` and ``out``."""
    with _one_thread():
        ref = _OutHead()
        muon = torch.optim.Muon([ref.hidden.weight], lr=0.02, weight_decay=0.1)
        adamw = torch.optim.AdamW([ref.tok.weight, ref.out.weight], lr=1e-3, weight_decay=1e-2)
        for s in range(steps):
            ref(torch.arange(s, s + 5) % 11).square().sum().backward()
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
    return {n: local_tensor(p).clone() for n, p in ref.named_parameters()}


def _train_out_head(model, opt, steps: int = 3) -> None:
    for s in range(steps):
        model(torch.arange(s, s + 5) % 11).square().sum().backward()
        opt.step()
        opt.zero_grad()


def test_head_named_out_guessed_by_name_warns_and_gets_newton_schulz():
    """The trap issue 15 names: ``out.weight`` looks like a hidden matrix to the name guess (and a
    plain ``tok.weight`` too: without its module the guess cannot see it is an nn.Embedding)."""
    model = _OutHead()
    with pytest.warns(UserWarning, match=r"ambiguous: out\.weight -> Newton-Schulz.*use_muon=False"):
        opt = Muon(model.named_parameters(), lr=0.02)
    assert [n for g in opt.param_groups if g["use_muon"] for n in g["param_names"]] == [
        "tok.weight", "hidden.weight", "out.weight"]


def test_hidden_layer_named_like_a_head_inside_a_block_warns():
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.warns(UserWarning, match=r"ambiguous: layers\.0\.attention\.output\.dense\.weight -> AdamW"):
        Muon([("layers.0.attention.output.dense.weight", w)])


@pytest.mark.parametrize("how", ["groups", "rule"])
def test_head_named_out_passed_explicitly_equals_torch(how, recwarn):
    """use_muon=False groups (Keller Jordan's MuonWithAuxAdam convention), or the rule's
    embedding_and_head names: ``out`` goes to AdamW, no warning, bitwise equal to torch."""
    with _one_thread():
        model = _OutHead()
        if how == "groups":
            opt = Muon([{"params": [model.hidden.weight], "use_muon": True},
                        {"params": [model.tok.weight, model.out.weight], "use_muon": False}],
                       lr=0.02, adamw_lr=1e-3)  # fmt: skip
        else:
            opt = Muon(model.named_parameters(), lr=0.02, blocks=Muon.rule(embedding_and_head=["tok", "out"]))
        assert [g["use_muon"] for g in opt.param_groups] == [True, False]
        assert Muon.adamw_lr(opt.param_groups[1]) == 1e-3 and opt.param_groups[1]["betas"] == (0.9, 0.999)
        _train_out_head(model, opt)
    assert not [w for w in recwarn if "Muon" in str(w.message)], [str(w.message) for w in recwarn]
    assert_bitwise({n: local_tensor(p).detach() for n, p in model.named_parameters()}, _out_head_reference())


@pytest.mark.parametrize("world_size", [2, 3])
def test_fully_shard_with_explicit_embedding_and_head_equals_torch(world_size):
    """fully_shard(..., blocks=Muon.rule(embedding_and_head=["out"])) and the same rule given to
    Muon: ``out`` is element-wise (AdamW, any layout), ``tok`` an nn.Embedding by type, no
    warning. Every rank sees the same batch, so at W=2 the result is bitwise; at W=3 the mean of
    3 equal gradients may round, so there within 1e-6 relative."""
    fully_shard = _fully_shard()
    ref = _out_head_reference()

    def fn():
        model = _OutHead()
        rule = Muon.rule(embedding_and_head=["out"])
        fully_shard(model, blocks=rule)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = Muon(model.parameters(), lr=0.02, blocks=rule)
        assert [g["use_muon"] for g in opt.param_groups] == [True, False]
        _train_out_head(model, opt)
        from fsdp_optim.sharding.contract import local_shard

        return {n: (local_tensor(p).clone(), local_shard(p).layout) for n, p in model.named_parameters()}

    outs = run_distributed(fn, world_size=world_size)
    for n, want in ref.items():
        got = outs[0][n][1].unshard([o[n][0] for o in outs])
        if world_size == 2:
            assert torch.equal(got, want), n
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_explicit_group_errors_and_ignored_settings():
    full = torch.randn(6, 4)
    p = make_sharded_param(full, spec=elements(1), layout=RaggedLayout((6, 4), (0, 24)), fqn="model.out.weight", rank=0)
    with pytest.raises(ValueError, match=r"model\.out\.weight.*use_muon=True.*embedding_and_head"):
        Muon([{"params": [p], "use_muon": True}])
    q = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match=r"<unnamed>.*plain tensor"):
        Muon([{"params": [q], "use_muon": True}])
    with pytest.raises(ValueError, match=r"both lr and adamw_lr"):
        Muon([{"params": [q], "use_muon": False, "lr": 1e-3, "adamw_lr": 1e-3}])
    with pytest.warns(UserWarning, match=r"\['momentum'\] ignored in a use_muon=False group"):
        Muon([{"params": [q], "use_muon": False, "momentum": 0.9}])
    with pytest.warns(UserWarning, match=r"\['adamw_lr'\] ignored in a use_muon=True group"):
        Muon([{"params": [torch.nn.Parameter(torch.randn(3, 3))], "use_muon": True, "adamw_lr": 1e-3}])
    # a plain matrix named like an embedding, put in a use_muon=True group: Newton-Schulz it is
    opt = Muon([{"params": [("embed.weight", torch.nn.Parameter(torch.randn(3, 3)))], "use_muon": True}])
    assert opt.param_groups[0]["use_muon"] and opt._plans[opt.param_groups[0]["params"][0]].runs


# ---- non-finite gradients (issue 12 item 7) -----------------------------------------------------
def _nonfinite_run(world_size, nonfinite, *, split: bool, bad_rank: int, bad_step: int = 1):
    """W ranks, whole or split matrices; at ``bad_step`` rank ``bad_rank`` gets a NaN in its piece of
    ``a.weight`` (an inf in ``e.bias`` too). Returns per rank: params, counts, skipped, warnings."""
    shapes, buckets, specs, layouts, splits = _split_case(world_size)
    if not split:
        layouts = {k: owner_layout(s, world_size, bad_rank) if specs[k].is_matrix else layouts[k]
                   for k, s in shapes.items()}  # fmt: skip
        splits = set()
    init = _init(shapes)

    def fn():
        params = {k: make_sharded_param(init[k], spec=specs[k], layout=layouts[k], fqn=k,
                                        split=k in splits) for k in shapes}  # fmt: skip
        opt = Muon(list(params.values()), **MUON_KW, **ADAMW_KW, nonfinite=nonfinite)
        counts, caught = [], []
        for s in range(STEPS):
            g = _grads(shapes, s)
            for k, p in params.items():
                p.grad = sharded_grad(p, g[k])
            if s == bad_step and dist.get_rank() == bad_rank:
                local_tensor(params["a.weight"].grad)[0] = float("nan")  # (this rank's pieces)
                local_tensor(params["e.bias"].grad)[-1:] = float("inf")
            with CommDebugMode() as mode, warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter("always")
                opt.step()
            caught += [str(w.message) for w in ws]
            counts.append({str(op): n for op, n in mode.get_comm_counts().items() if n})
        return {k: local_tensor(p).clone() for k, p in params.items()}, counts, opt.num_skipped_steps, caught

    return shapes, layouts, init, run_distributed(fn, world_size=world_size)


@pytest.mark.parametrize("split", [False, True])
def test_nonfinite_error_on_every_rank_no_hang(split):
    """A NaN on one rank only: every rank raises, naming the parameter, before the split-matrix
    exchange (a rank raising after the other entered it would leave that one blocked)."""
    with pytest.raises(DistributedTestError, match=r"(?s)ranks with errors: \[0, 1\].*non-finite gradient in a\.weight"):
        _nonfinite_run(2, "error", split=split, bad_rank=1 if not split else 0)


@pytest.mark.parametrize("split", [False, True])
def test_nonfinite_skip_skips_the_step_on_every_rank(split):
    """``nonfinite="skip"``: the bad step changes nothing on any rank (AdamW part included); the run
    equals torch's with that step left out. One all_reduce per step (the agreement), plus the
    exchange pair where matrices are split."""
    world_size = 2
    shapes, layouts, init, outs = _nonfinite_run(world_size, "skip", split=split, bad_rank=1)
    ours = {k: layouts[k].unshard([o[0][k] for o in outs]) for k in shapes}
    for _, counts, skipped, caught in outs:
        assert skipped == 1 and any("skipped on every rank" in m and "a.weight" in m and "e.bias" in m for m in caught)
        want = {"c10d.allreduce_": 1, **({"c10d.alltoall_base_": 2} if split else {})}
        assert counts[0] == counts[2] == want and counts[1] == {"c10d.allreduce_": 1}, counts
    with _one_thread():  # torch, steps 0 and 2 only
        full = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
        muon = torch.optim.Muon([full[k] for k in shapes if k != "e.bias"], lr=0.02, momentum=0.9, weight_decay=0.1)
        aw = torch.optim.AdamW([full["e.bias"]], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
        for s in (0, 2):
            g = _grads(shapes, s)
            for k, p in full.items():
                p.grad = g[k].clone()
            muon.step()
            aw.step()
    assert_bitwise(ours, {k: local_tensor(p).detach() for k, p in full.items()})


def test_nonfinite_default_ignores_with_zero_collectives():
    shapes, layouts, init, outs = _nonfinite_run(2, "ignore", split=False, bad_rank=1)
    for params, counts, skipped, _ in outs:
        assert skipped == 0 and all(c == {} for c in counts), counts
    assert torch.isnan(layouts["a.weight"].unshard([o[0]["a.weight"] for o in outs])).all()  # torch's behaviour
    with pytest.raises(ValueError, match=r"nonfinite must be one of"):
        Muon([torch.nn.Parameter(torch.randn(3, 3))], nonfinite="raise")


@pytest.mark.parametrize("nesterov", [False, True])
def test_batched_step_memory_is_one_stack_at_a_time(monkeypatch, nesterov):
    """Live bytes a step allocates beyond params and state (fsdp_optim._testing.LiveBytes): one
    stack's Newton–Schulz transients (each stack's input, Nesterov's fp32 update included, is made
    when the stack is built, and its result added before the next one is). Stacks capped at 4
    matrices: bounded whatever the number of matrices."""
    from fsdp_optim._testing import LiveBytes
    from fsdp_optim.optimizers import _muon

    ps = [(f"l{i}.w", torch.nn.Parameter(torch.randn(16, 16))) for i in range(64)]
    extra = {}
    for cap in (None, 4 * 256):
        if cap:
            monkeypatch.setattr(_muon, "_STACK_NUMEL", cap)
        opt = Muon(ps, lr=0.02, nesterov=nesterov)
        for _, p in ps:
            p.grad = torch.randn(16, 16)
        with _one_thread(), LiveBytes() as m:
            opt.step()
        extra[cap] = m.peak - m.current  # current: what outlives the step (params, state)
    stack_bytes = 4 * 256 * 2  # 4 bf16 matrices
    assert 0 < extra[4 * 256] <= 8 * stack_bytes, extra
    assert extra[None] >= 4 * extra[4 * 256], extra  # one stack of all 64: the cap is what bounds it


# ---- weight decay of param groups (fsdp_optim.param_groups) ---------------------------------------
class _Decay(torch.nn.Module):
    """An embedding, a hidden matrix with a bias, a norm and a head: every kind of parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 6)
        self.hidden = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 11, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.hidden(self.embed(x)))))


def test_param_groups_weight_decay_reaches_the_adamw_part_equals_torch():
    """``Muon(fsdp_optim.param_groups(model, weight_decay=0.1))`` on a sharded model: the no-decay
    group's norms and bias get no decay, the decay group's embedding and head AdamW's 0.1, as with
    torch.optim.Muon + two torch.optim.AdamW groups unsharded (W=2, the same batch on every rank:
    bitwise). Before: the no-decay group's AdamW part got adamw_weight_decay (0.01)."""
    import fsdp_optim

    with _one_thread():
        ref = _Decay()
        muon = torch.optim.Muon([ref.hidden.weight], lr=0.02, weight_decay=0.1)
        adamw = torch.optim.AdamW([{"params": [ref.embed.weight, ref.head.weight], "weight_decay": 0.1},
                                   {"params": [ref.hidden.bias, ref.norm.weight, ref.norm.bias], "weight_decay": 0.0}],
                                  lr=3e-3)  # fmt: skip
        for s in range(STEPS):
            ref(torch.arange(s, s + 5) % 11).square().sum().backward()
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
    want = {n: local_tensor(p).clone() for n, p in ref.named_parameters()}

    def fn():
        model = _Decay()
        fsdp_optim.fully_shard(model, blocks=Muon.blocks)
        opt = Muon(fsdp_optim.param_groups(model, weight_decay=0.1), lr=0.02, adamw_lr=3e-3)
        decays = [(g["use_muon"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
        for s in range(STEPS):
            model(torch.arange(s, s + 5) % 11).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return decays, fsdp_optim.full_state_dict(model)

    for decays, got in run_distributed(fn, world_size=2):
        assert decays == [(True, 0.1, 1), (False, 0.1, 2), (False, 0.0, 3)]
        assert_bitwise(got, want)


def test_group_weight_decay_precedence_and_ignored_betas():
    """The AdamW part's decay: the group's adamw_weight_decay, else its weight_decay, else the
    constructor's adamw_weight_decay. ``betas`` in a group without use_muon is ignored, with a warning."""
    def parts(**group):
        w, b = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))
        opt = Muon([{"params": [("w", w), ("b", b)], **group}], weight_decay=0.2, adamw_weight_decay=0.03)
        return [(g["use_muon"], g["weight_decay"]) for g in opt.param_groups]

    assert parts() == [(True, 0.2), (False, 0.03)]
    assert parts(weight_decay=0.0) == [(True, 0.0), (False, 0.0)]
    assert parts(weight_decay=0.1, adamw_weight_decay=0.05) == [(True, 0.1), (False, 0.05)]
    with pytest.warns(UserWarning, match=r"'betas' ignored in a param group without use_muon.*adamw_betas"):
        assert parts(betas=(0.8, 0.9)) == [(True, 0.2), (False, 0.03)]


@pytest.mark.parametrize("weight_decay", [0.1, 0.05])
def test_bf16_matrices_with_weight_decay_equal_torch_muon_bitwise(weight_decay):
    """bf16 parameters decay as torch.optim.Muon's ``mul_`` does (fp32 multiply, one rounding):
    the CPU foreach kernel rounded ``1 - lr * wd`` to bf16 first (0.998 -> 0.99609375, twice the
    decay; 0.999 -> 1.0, none). lr * wd = 2e-3 and 1e-3 cover both."""
    torch.manual_seed(0)
    init = [torch.randn(53, 19).bfloat16() * 3, torch.randn(64, 64).bfloat16()]
    grads = [[torch.randn(p.shape).bfloat16() for p in init] for _ in range(3)]
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    ref = [torch.nn.Parameter(p.clone()) for p in init]
    opt = Muon(ours, lr=0.02, weight_decay=weight_decay)
    ref_opt = torch.optim.Muon(ref, lr=0.02, weight_decay=weight_decay)
    for step_grads in grads:
        for a, b, g in zip(ours, ref, step_grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
