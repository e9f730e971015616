"""NorMuon (arXiv:2510.05491) against its authors' algorithm, and sharded == one process.

The reference: neither the authors' code (github.com/zichongli5/NorMuon, not on PyPI) nor NVIDIA
Emerging-Optimizers' ``AdaptiveMuon(moment2_method="normuon")`` (PyPI, but Python >= 3.12: it imports
``typing.override``; this suite runs on 3.10/3.11) installs here, so ``normuon_reference`` below restates
the authors' ``normuon_update`` + ``SingleDeviceNorMuon.step`` op by op (per row ``v.lerp_(mean(O^2),
1 - beta2)``, ``O * (1 / (sqrt(v) + 1e-10))``, rescale to the pre-normalization Frobenius norm,
``* max(1, rows / cols) ** 0.5``, ``p *= 1 - lr wd``, ``p -= lr * update``) on torch.optim.Muon's own
pieces: its Newton–Schulz function and its momentum / Nesterov ops (the authors' Muon part is Keller
Jordan's, which torch.optim.Muon reproduces), and torch.optim.AdamW for the rest.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.optim._muon import _zeropower_via_newtonschulz

from fsdp_optim._testing import make_sharded_param, random_block_layout, run_distributed, sharded_grad
from fsdp_optim.optimizers import Muon, NorMuon
from fsdp_optim.optimizers._orthogonalize import DEFAULT_NS_COEFFICIENTS
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding import expert, whole
from fsdp_optim.sharding.contract import local_tensor
from tests.optimizers.test_muon import (
    ADAMW_KW, MATRICES, SHAPES, STEPS, _grads, _init, _one_thread, _specs, _split_case, assert_bitwise, reference,
)  # fmt: skip

KW = dict(lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True, beta2=0.95)


def normuon_reference(init, shapes, muon_names, *, sub_matrices=None, lr, momentum, weight_decay, nesterov, beta2):
    """The authors' NorMuon step (see the module docstring) on every matrix / sub-matrix, one process."""
    sub_matrices = sub_matrices or {}
    with _one_thread():
        mats = {k: sub_matrices.get(k) or [(0, *shapes[k])] for k in muon_names}
        qs = {k: [init[k].reshape(-1)[o : o + r * c].view(r, c).clone() for o, r, c in mats[k]] for k in muon_names}
        bufs = {k: [torch.zeros_like(q) for q in qs[k]] for k in muon_names}
        second = {k: [torch.zeros_like(q[..., 0:1]) for q in qs[k]] for k in muon_names}
        for s in range(STEPS):
            g = _grads(shapes, s)
            for k in muon_names:
                flat = g[k].reshape(-1)
                for q, buf, v, (o, r, c) in zip(qs[k], bufs[k], second[k], mats[k]):
                    grad = flat[o : o + r * c].view(r, c).clone()
                    buf.lerp_(grad, 1 - momentum)
                    update = grad.lerp_(buf, momentum) if nesterov else buf
                    update = _zeropower_via_newtonschulz(update, DEFAULT_NS_COEFFICIENTS, 5, 1e-7).float()
                    vnorm = update.norm(dim=(-2, -1), keepdim=True)
                    v.lerp_(torch.mean(update * update, dim=-1, keepdim=True), 1 - beta2)
                    update.mul_(1 / v.sqrt().add_(1e-10))
                    update.mul_(vnorm / update.norm(dim=(-2, -1), keepdim=True).add_(1e-10))
                    update *= max(1, r / c) ** 0.5
                    q.mul_(1 - lr * weight_decay)
                    q.add_(update, alpha=-lr)
        out = {k: torch.cat([q.reshape(-1) for q in qs[k]]).view(shapes[k]) for k in muon_names}
        return out, {k: torch.cat([v.reshape(-1) for v in second[k]]) for k in muon_names}


def _close(ours: dict, ref: dict, shapes: dict, sub_matrices=None) -> None:
    """Bitwise where torch.optim.Muon's shape factor is 1 (wide and square matrices); tall ones: the
    authors multiply the update by sqrt(rows / cols) and then by lr, Muon (and so we) by one adjusted
    lr, a different fp32 rounding: at most one ulp of the largest weight per step (measured: 0.29 ulp
    after 3 steps)."""
    for k, want in ref.items():
        mats = (sub_matrices or {}).get(k) or [(0, *shapes[k])]
        if all(r <= c for _, r, c in mats):
            assert torch.equal(ours[k], want), f"{k}: max |diff| {(ours[k] - want).abs().max().item():.3e}"
        else:
            ulp = torch.finfo(torch.float32).eps * want.abs().max().item()
            assert (ours[k] - want).abs().max().item() <= STEPS * ulp, k


def _sub_case():
    shapes = {"attn.wq.weight": (12, 10), "attn.wqkv.weight": (10, 6), "moe.experts.w1": (3, 5, 7),
              "mlp.w1.weight": (9, 20), "mlp.w2.weight": (20, 9)}  # fmt: skip
    rule = Muon.rule(head_dims={"attn.wq.weight": 4}, row_splits={"attn.wqkv.weight": [6, 2, 2]})
    specs = {k: rule(k, torch.empty(s), None) for k, s in shapes.items()}
    assert specs["attn.wq.weight"] == whole(row_splits=[4, 4, 4]) and specs["moe.experts.w1"] == expert()
    return shapes, rule, specs, {k: specs[k].matrices(s) for k, s in shapes.items()}


def _run(init, shapes, specs, layouts, *, world_size, configs, rule=None):
    """NorMuon on sharded parameters; per config the unsharded parameters and second moments (each
    assembled from the ranks' StateShards) and each rank's collectives per step."""

    def fn():
        rank = dist.get_rank()
        out = []
        for kw in configs:
            params = {k: make_sharded_param(init[k], spec=specs[k], layout=layouts[k], fqn=k) for k in shapes}
            opt = NorMuon(list(params.values()), **ADAMW_KW, **kw, **({"blocks": rule} if rule else {}))
            counts = []
            for s in range(STEPS):
                g = _grads(shapes, s)
                for k, p in params.items():
                    p.grad = sharded_grad(p, g[k])
                with CommDebugMode() as mode:
                    opt.step()
                counts.append({str(op): n for op, n in mode.get_comm_counts().items() if n})
            state = {k: (opt.state_shards(p)["second_momentum_buffer"], opt.state[p]["second_momentum_buffer"].clone())
                     for k, p in params.items() if "second_momentum_buffer" in opt.state[p]}  # fmt: skip
            out.append(({k: local_tensor(p).clone() for k, p in params.items()}, state, counts))
        return out

    outs = run_distributed(fn, world_size=world_size)
    results = []
    for i in range(len(configs)):
        params = {k: layouts[k].unshard([o[i][0][k] for o in outs]) for k in shapes}
        second = {}
        for k, (sh, _) in outs[0][i][1].items():
            full = torch.full((sh.global_numel,), float("nan"))
            for o in outs:
                piece_sh, piece = o[i][1][k]
                assert piece_sh.global_numel == sh.global_numel and piece.numel() == piece_sh.end - piece_sh.start
                full[piece_sh.start : piece_sh.end] = piece
            assert not full.isnan().any(), k  # the ranks' rows tile the global vector
            second[k] = full
        results.append((params, second, [o[i][2] for o in outs]))
    return results


# ---- one process: the authors' algorithm ------------------------------------------------------------
@pytest.mark.parametrize("nesterov", [True, False])
def test_normuon_equals_the_authors_algorithm(nesterov):
    """Matrices (AdamW for embeddings, head, norms, biases), STEPS steps, one process."""
    init, specs = _init(SHAPES), _specs(SHAPES)
    layouts = {k: RaggedLayout(s, (0, math.prod(s))) for k, s in SHAPES.items()}
    kw = {**KW, "nesterov": nesterov}
    [(ours, second, _)] = _run(init, SHAPES, specs, layouts, world_size=1, configs=[kw])
    want, want_second = normuon_reference(init, SHAPES, MATRICES, **kw)
    _close({k: ours[k] for k in MATRICES}, want, SHAPES)
    assert_bitwise(second, want_second)
    muon = reference(init, SHAPES, MATRICES, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=None)  # + AdamW
    rest = [k for k in SHAPES if k not in MATRICES]
    assert_bitwise({k: ours[k] for k in rest}, {k: muon[k] for k in rest})
    # the normalization changed every matrix of more than one row (one row: scaled back to its own norm)
    assert all(not torch.equal(ours[k], muon[k]) for k in MATRICES if SHAPES[k][0] > 1)


def test_heads_fused_qkv_and_experts_are_normalized_per_sub_matrix():
    shapes, rule, specs, subs = _sub_case()
    init = _init(shapes)
    layouts = {k: RaggedLayout(s, (0, math.prod(s))) for k, s in shapes.items()}
    [(ours, second, _)] = _run(init, shapes, specs, layouts, world_size=1, configs=[KW], rule=rule)
    want, want_second = normuon_reference(init, shapes, list(shapes), sub_matrices=subs, **KW)
    _close(ours, want, shapes, subs)
    assert_bitwise(second, want_second)


# ---- sharded == one process, no collective ------------------------------------------------------------
CONFIGS = [KW, {**KW, "batched": False, "beta2": 0.9}, {**KW, "orthogonalize": "gram_newton_schulz",
                                                        "coefficients": "polar_express"}]  # fmt: skip


@pytest.fixture(scope="module")
def one_process():
    shapes, rule, specs, _ = _sub_case()
    shapes, specs = {**SHAPES, **shapes}, {**_specs(SHAPES), **specs}
    init = _init(shapes)
    layouts = {k: RaggedLayout(s, (0, math.prod(s))) for k, s in shapes.items()}
    return shapes, rule, specs, init, _run(init, shapes, specs, layouts, world_size=1, configs=CONFIGS, rule=rule)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_equals_one_process_with_zero_collectives(world_size, one_process):
    """Whole matrices and sub-matrices (heads, fused QKV, experts) spread over the ranks at random
    block-aligned cuts (empty ranks included), the other parameters cut anywhere: the same parameters and
    the same global second-moment vector as one process, bitwise; no collective in step()."""
    shapes, rule, specs, init, want = one_process
    layouts = {}
    for i, (k, s) in enumerate(shapes.items()):
        seed = 31 * world_size + i
        if not specs[k].is_matrix:
            layouts[k] = random_block_layout(s, world_size, seed, block=1)
            continue
        starts = [o for o, _, _ in specs[k].matrices(s)] + [math.prod(s)]  # cut only between (sub-)matrices
        gen = torch.Generator().manual_seed(seed)
        cuts = sorted(starts[j] for j in torch.randint(0, len(starts), (world_size - 1,), generator=gen).tolist())
        layouts[k] = RaggedLayout(s, (0, *cuts, math.prod(s)))
        assert layouts[k].is_aligned(specs[k]), k
    assert any(len({b for b in layouts[k].bounds[1:-1] if 0 < b < math.prod(s)}) > 0
               for k, s in shapes.items() if len(specs[k].matrices(s)) > 1)  # some parameter really cut
    got = _run(init, shapes, specs, layouts, world_size=world_size, configs=CONFIGS, rule=rule)
    for (params, second, counts), (want_params, want_second, _) in zip(got, want):
        assert_bitwise(params, want_params)
        assert_bitwise(second, want_second)
        assert all(c == {} for per_rank in counts for c in per_rank), counts


def test_split_matrices_are_refused_naming_the_fix():
    shapes, buckets, specs, layouts, splits = _split_case(2)
    init = _init(shapes)

    def fn():
        params = [make_sharded_param(init[k], spec=specs[k], layout=layouts[k], fqn=k, split=k in splits)
                  for k in shapes]  # fmt: skip
        with pytest.raises(ValueError, match=r"NorMuon: parameter a\.weight .*cut across ranks.*balance='whole'"):
            NorMuon(params)
        return True

    assert run_distributed(fn, world_size=2) == [True, True]


def test_arguments_groups_and_state_dict():
    w, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6))
    with pytest.raises(ValueError, match=r"beta2 must be in \[0, 1\), got 1.0"):
        NorMuon([("w", w)], beta2=1.0)
    with pytest.raises(ValueError, match=r"norm_eps must be >= 0"):
        NorMuon([("w", w)], norm_eps=-1.0)
    with pytest.raises(ValueError, match=r"beta2 must be in \[0, 1\)"):
        NorMuon([{"params": [("w", w)], "beta2": -0.1}])
    opt = NorMuon([{"params": [("w", w), ("b", b)], "beta2": 0.8}], beta2=0.9)
    assert [(g["use_muon"], g.get("beta2")) for g in opt.param_groups] == [(True, 0.8), (False, None)]
    assert opt.defaults["beta2"] == 0.9 and opt.defaults["norm_eps"] == 1e-10
    assert opt.state[w]["second_momentum_buffer"].shape == (6,) and "second_momentum_buffer" not in opt.state[b]
    with pytest.warns(UserWarning, match=r"\['beta2'\] ignored in a use_muon=False group"):
        NorMuon([{"params": [b], "use_muon": False, "beta2": 0.5}])
    w.grad, b.grad = torch.randn(6, 4), torch.randn(6)
    opt.step()
    opt2 = NorMuon([{"params": [("w", torch.nn.Parameter(w.detach().clone())), ("b", torch.nn.Parameter(b.detach().clone()))]}])
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["beta2"] == 0.8
    assert torch.equal(opt2.state[opt2.param_groups[0]["params"][0]]["second_momentum_buffer"],
                       opt.state[w]["second_momentum_buffer"])  # fmt: skip


def test_checkpoint_reshards_across_world_sizes(tmp_path):
    """Under fully_shard: trained 2 steps and saved at W = 2 (a bucket per layer), loaded at W = 3 (one
    root bucket): the global second-moment vectors (and everything else) equal, bitwise; a step runs."""
    from fsdp_optim import fully_shard, load_checkpoint, save_checkpoint
    from fsdp_optim.optimizers import muon_rule
    from fsdp_optim.sharding import PlanConfig
    from tests._models import TinyConfig, TinyTransformer, make_batch
    from tests.sharding.checkpoint.test_checkpoint import assert_same, full_optim_state

    cfg = TinyConfig(vocab_size=61, dim=20, num_heads=2, num_layers=2, mlp_dim=36)

    def build(per_layer: bool, seed: int):
        torch.manual_seed(seed)
        model = TinyTransformer(cfg)
        whole_matrices = PlanConfig(layout="ragged", balance="whole")
        for layer in model.layers if per_layer else ():
            fully_shard(layer, blocks=muon_rule(), plan_config=whole_matrices)
        fully_shard(model, blocks=muon_rule(), plan_config=whole_matrices)
        return model, NorMuon(model.parameters(), lr=0.02, adamw_lr=1e-2, beta2=0.9)

    def step(model, opt, s):
        x, y = make_batch(batch_size=2, seq_len=6, vocab_size=cfg.vocab_size, seed=s)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

    def save():
        model, opt = build(per_layer=True, seed=0)
        for s in range(2):
            step(model, opt, s)
        save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
        return full_optim_state(model, opt)

    def load():
        model, opt = build(per_layer=False, seed=1)
        load_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
        state = full_optim_state(model, opt)
        step(model, opt, 2)
        return state

    before = run_distributed(save, world_size=2)[0]
    after = run_distributed(load, world_size=3)
    assert sum(k.endswith("second_momentum_buffer") for k in before) >= 4  # every hidden matrix has one
    assert all(before[k].abs().sum() > 0 for k in before if k.endswith("second_momentum_buffer"))
    for got in after:
        assert_same(before, got)
