"""Shampoo and SOAP on tensor-parallel cuts through their blocks ([Note: preconditioner blocks under
tensor parallelism]): bitwise equal to the unsharded optimizer fed the same gradients, parameters and
every state tensor (the global per-block vectors included); two all-to-alls per step inside the TP
group; checkpoints load across TP sizes and without TP; a non-finite gradient on one TP rank raises on
every rank; what runs cannot assemble is refused by name.

The model is ``tests/_models.py``'s TP transformer (dim 32, 4 heads, ffn 64, vocab 128) under torchtitan's
plan: with ``k = 12`` every ``ColwiseParallel`` weight is cut on rows that 12 does not divide (16 or 32
TP-local rows) and every ``RowwiseParallel`` one on columns that 12 does not divide (16 or 32); ``k = 5``
at tp 4 as well. W = 4 (and 2) on CPU / gloo.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_optim
from fsdp_optim._testing import run_distributed
from tests._models import TPConfig, feed_gradients, load_state, make_batch, save_state, tp_backward, tp_plan, tp_sharded

STEPS = 4


def _make(name: str, k: int | None, **kw):
    from fsdp_optim.optimizers import SOAP, Shampoo

    if name == "shampoo":
        hp = dict(lr=1e-2, max_preconditioner_dim=k, precondition_frequency=2, start_preconditioning_step=2, momentum=0.5)
        return Shampoo.rule(max_preconditioner_dim=k), lambda params: Shampoo(params, **{**hp, **kw})
    hp = dict(lr=1e-2, block_size=k, precondition_frequency=2, max_precond_dim=48)
    return SOAP.rule(block_size=k), lambda params: SOAP(params, **{**hp, **kw})


def _state(opt, model) -> dict[str, torch.Tensor]:
    """Every parameter's state as its global tensor (the sharded run's through ``state_dict()``'s
    DTensors; the reference's as it is), by parameter name and key."""
    names = [n for n, _ in model.named_parameters()]
    out = {}
    for i, st in opt.state_dict()["state"].items():
        for key, v in st.items():
            if key != "step":
                out[f"{names[i]}.{key}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).reshape(-1)
    return out


def _equal_run(name: str, dp: int, tp: int, k: int | None, batched: bool):
    rule, make = _make(name, k, batched=batched)
    mesh, model, ref = tp_sharded(dp, tp, rule)
    opt, ropt = make(model.parameters()), make(ref.parameters())
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    calls = []
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls[-1] += 1
        return real(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        for step in range(STEPS):
            tp_backward(model, mesh, step)
            feed_gradients(model, ref)
            calls.append(0)
            opt.step()
            ropt.step()
            for o in (opt, ropt):
                o.zero_grad()
    finally:
        dist.all_to_all_single = real
    runs = sorted(n for n, p in model.named_parameters() if opt._plans[p].run is not None)
    cut = sorted(n for n, p in model.named_parameters() if p.ragged.tp_blocks is not None)
    params = {n: (a.full_tensor() - b).abs().max().item() for (n, a), b in zip(model.named_parameters(), ref.parameters())}
    moved = min((p.full_tensor() - before[n]).abs().max().item() for n, p in model.named_parameters() if n in cut)
    mine, theirs = _state(opt, model), _state(ropt, ref)
    state = {key: (mine[key] - theirs[key]).abs().max().item() if mine[key].numel() else 0.0 for key in theirs}
    return runs, cut, params, state, moved, calls, set(mine) == set(theirs)


CASES = [
    ("shampoo", 2, 2, 12, False),
    ("shampoo", 2, 2, 12, True),
    ("shampoo", 1, 4, 5, True),
    ("shampoo", 1, 4, 300, False),  # one strip per weight; the TP-local [8, 32] ones merge to vectors (each whole)
    ("soap", 2, 2, 12, False),
    ("soap", 1, 4, 5, True),
    ("soap", 2, 2, None, True),  # whole-tensor SOAP: each TP-split tensor one unit, at one TP rank
    ("soap", 1, 4, None, False),
]


@pytest.mark.parametrize("name,dp,tp,k,batched", CASES)
def test_cuts_through_blocks_equal_the_unsharded_optimizer_bitwise(name, dp, tp, k, batched):
    for runs, _, params, state, moved, calls, same_keys in run_distributed(
        lambda: _equal_run(name, dp, tp, k, batched), world_size=dp * tp
    ):
        # every TP weight: wq / wk / wv / w1 / w3 / output cut on rows, wo / w2 / tok_embeddings on columns
        assert len(runs) == 16 and any("wq" in n for n in runs) and any("wo" in n for n in runs), runs
        assert moved > 0
        assert max(params.values()) == 0.0, params  # measured: bitwise
        assert same_keys and max(state.values()) == 0.0, state  # the global state vectors too
        # one all-to-all out per step, one back from the first update on (Shampoo: start_preconditioning_step 2;
        # SOAP: its first call only builds the bases)
        assert calls == [1, 2, 2, 2], calls


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_cuts_between_blocks_need_no_exchange_and_equal_the_unsharded_optimizer_bitwise(name):
    """k = 8: every cut falls between the [8, 8] blocks (16 TP-local rows under ColwiseParallel, TP-local
    width 16 under RowwiseParallel), so each TP rank preconditions its own blocks, which are global ones:
    no runs, no all-to-all, parameters and per-element state bitwise the unsharded optimizer's. (The
    per-block state is each TP rank's own blocks, in its order: [Note: per-block state under TP].)"""
    for runs, cut, params, state, moved, calls, _ in run_distributed(lambda: _equal_run(name, 2, 2, 8, False), world_size=4):
        assert runs == [] and any("wo" in n for n in cut) and any("w2" in n for n in cut), (runs, cut)
        assert moved > 0 and calls == [0] * STEPS, calls
        assert max(params.values()) == 0.0, params  # measured: bitwise
        blockwise = ("factor_matrices", "inv_factor_matrices", "GG", "Q")
        per_element = {key: v for key, v in state.items() if key.rsplit(".", 1)[-1] not in blockwise}
        assert per_element and max(per_element.values()) == 0.0, per_element


def _hsdp_model(**kw):
    """HSDP x TP, (replicate 2, shard 1, tp 2): the state mesh keeps the replicate dim. ``(mesh, model,
    reference, optimizer, its reference)``."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from tests._models import TPTransformer

    rule, make = _make("shampoo", 12, **kw)
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    torch.manual_seed(0)
    model = TPTransformer()
    ref = copy.deepcopy(model)
    tp_plan(model, mesh["tp"], loss_parallel=False, sequence_parallel=False)
    for block in model.layers:
        fsdp_optim.fully_shard(block, mesh=mesh["dp_replicate", "dp_shard"], blocks=rule)
    fsdp_optim.fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"], blocks=rule)
    return mesh, model, ref, make(model.parameters()), make(ref.parameters())


def _hsdp_backward(model, mesh, step: int) -> None:
    r = mesh.get_coordinate()[0]
    tok, tgt = make_batch(batch_size=4, seq_len=8, vocab_size=TPConfig().vocab_size, seed=step)
    F.cross_entropy(model(tok[2 * r : 2 * r + 2]).flatten(0, 1), tgt[2 * r : 2 * r + 2].flatten()).backward()


def _hsdp_run():
    mesh, model, ref, opt, ropt = _hsdp_model()
    for step in range(3):
        _hsdp_backward(model, mesh, step)
        feed_gradients(model, ref)
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    mine, theirs = _state(opt, model), _state(ropt, ref)
    params = max((a.full_tensor() - b).abs().max().item() for (_, a), b in zip(model.named_parameters(), ref.parameters()))
    return params, max((mine[key] - theirs[key]).abs().max().item() for key in theirs if theirs[key].numel())


def test_hsdp_x_tp_equals_the_unsharded_optimizer_bitwise():
    for params, state in run_distributed(_hsdp_run, world_size=4):
        assert params == 0.0 and state == 0.0, (params, state)


def _biased_run(name: str):
    """Linear layers with biases: a ColwiseParallel [36, 32] weight and its [36] bias (TP-local 18 rows,
    k = 12: both cut through a strip, planned whole), a RowwiseParallel [32, 36] weight (TP-local width 18)
    and its replicated bias; SOAP with ``precondition_1d`` so the bias's blocks have factors too."""
    import copy

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rule, make = _make(name, 12, **({"precondition_1d": True} if name == "soap" else {}))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 36), nn.ReLU(), nn.Linear(36, 32))
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fsdp_optim.fully_shard(model, mesh=mesh["dp"], blocks=rule)
    opt, ropt = make(model.parameters()), make(ref.parameters())
    r = mesh.get_coordinate()[0]
    for step in range(STEPS):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        model(x[2 * r : 2 * r + 2]).square().mean().backward()
        feed_gradients(model, ref)
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    runs = sorted(n for n, p in model.named_parameters() if opt._plans[p].run is not None)
    return runs, max((a.full_tensor() - b).abs().max().item() for (_, a), b in zip(model.named_parameters(), ref.parameters()))


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_biases_cut_through_their_strips_equal_the_unsharded_optimizer_bitwise(name):
    for runs, diff in run_distributed(lambda: _biased_run(name), world_size=4):
        assert runs == ["0.bias", "0.weight", "2.weight"], runs
        assert diff == 0.0, diff


def _hsdp_save(path: str):
    mesh, model, _, opt, _ = _hsdp_model(precondition_frequency=1, start_preconditioning_step=1)
    for step in range(3):
        _hsdp_backward(model, mesh, step)
        opt.step()
        opt.zero_grad()
    fsdp_optim.save_checkpoint(path, model=model, optimizer=opt)
    return _snapshot(model, opt)


def _hsdp_load(path: str, dp: int, tp: int):
    _, model, opt = _build("shampoo", dp, tp)
    fsdp_optim.load_checkpoint(path, model=model, optimizer=opt)
    return _snapshot(model, opt)


def test_hsdp_x_tp_checkpoint_loads_at_other_layouts(tmp_path):
    """Saved under HSDP x TP (the runs' state replicated over dp_replicate: written once), loaded at (4, 1),
    (1, 4) and (2, 2): every parameter and state tensor bitwise."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(lambda: _hsdp_save(path), world_size=4)[0]
    for dp, tp in [(4, 1), (1, 4), (2, 2)]:
        got = run_distributed(lambda: _hsdp_load(path, dp, tp), world_size=4)[0]
        assert got.keys() == saved.keys() and all(torch.equal(got[k], v) for k, v in saved.items()), (dp, tp)


# ---- checkpoints across layouts -----------------------------------------------------------------
LR = 1e-2


def _build(name: str, dp: int, tp: int):
    rule, make = _make(name, 12, precondition_frequency=1, **({"start_preconditioning_step": 1} if name == "shampoo" else {}))
    mesh, model, _ = tp_sharded(dp, tp, rule)
    return mesh, model, make(model.parameters())


def _step(model, opt, mesh, step: int) -> None:
    dp, r = mesh.size(0), mesh.get_coordinate()[0]
    n = 4 // dp
    tok, tgt = make_batch(batch_size=4, seq_len=8, vocab_size=TPConfig().vocab_size, seed=step)
    F.cross_entropy(model(tok[r * n : (r + 1) * n]).flatten(0, 1), tgt[r * n : (r + 1) * n].flatten()).backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    return {**{f"param:{n}": p.full_tensor() for n, p in model.named_parameters()}, **_state(opt, model)}


def _save(path: str, name: str, how: str):
    mesh, model, opt = _build(name, 2, 2)
    for s in range(3):
        _step(model, opt, mesh, s)
    save_state(path, how, model, opt)
    saved = _snapshot(model, opt)
    _step(model, opt, mesh, 3)
    return saved, {n: p.full_tensor() for n, p in model.named_parameters()}


def _load(path: str, name: str, how: str, dp: int, tp: int):
    mesh, model, opt = _build(name, dp, tp)
    load_state(path, how, model, opt)
    loaded = _snapshot(model, opt)
    _step(model, opt, mesh, 3)
    return loaded, {n: p.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,how", [("shampoo", "fsdp_optim"), ("shampoo", "torch_dcp"), ("soap", "fsdp_optim")])
def test_saved_at_dp2_tp2_loads_at_other_tp_sizes_and_without_tp(tmp_path, name, how):
    """The runs' state is the global per-block vector (and SOAP's moments the global per-element one):
    loaded at tp 1, 2 and 4, every state tensor equals the saved one bitwise, and the next step equals
    the uninterrupted run up to the reduction order of the gradients (measured <= 1.2e-5; bound lr / 100)."""
    path = str(tmp_path / "ckpt")
    saved, uninterrupted = run_distributed(lambda: _save(path, name, how), world_size=4)[0]
    for dp, tp in [(4, 1), (1, 2), (2, 1), (1, 4)]:
        loaded, after = run_distributed(lambda: _load(path, name, how, dp, tp), world_size=dp * tp)[0]
        assert loaded.keys() == saved.keys()
        for key, v in saved.items():
            assert torch.equal(loaded[key], v), (dp, tp, key)
        worst = max((after[key] - uninterrupted[key]).abs().max().item() for key in uninterrupted)
        print(f"{name} ({how}): saved at (dp 2, tp 2), loaded at (dp {dp}, tp {tp}): next step max |diff| = {worst:.3g}")
        assert worst <= LR / 100, (dp, tp, worst)


# ---- off the happy path ---------------------------------------------------------------------------
def _nan_on_one_tp_rank(name: str):
    rule, make = _make(name, 12)
    mesh, model, _ = tp_sharded(2, 2, rule)
    opt = make(model.parameters())
    tp_backward(model, mesh, 0)
    if dist.get_rank() == 3:  # a TP rank whose partner holds the same runs
        p = model.layers[1].attention.wo.weight
        if p.grad.to_local().numel():
            p.grad.to_local().view(-1)[0] = float("nan")
        else:
            model.layers[0].attention.wo.weight.grad.to_local().view(-1)[0] = float("nan")
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    try:
        opt.step()
    except FloatingPointError as e:
        return str(e), all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    return None, False


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_a_non_finite_gradient_on_one_tp_rank_raises_on_every_rank_changing_nothing(name):
    for msg, unchanged in run_distributed(lambda: _nan_on_one_tp_rank(name), world_size=4):
        assert msg is not None and "attention.wo.weight" in msg and "every rank raises" in msg, msg
        assert unchanged


def _refused(name: str):
    from fsdp_optim.optimizers import SOAP, Shampoo

    if name == "shampoo":  # k = 1024 merges the [32, 32] weights into 1024-vectors: not their own shape
        mesh, model, _ = tp_sharded(1, 2, Shampoo.rule(max_preconditioner_dim=1024))
        Shampoo(model.parameters(), lr=1e-3)
    else:  # whole-tensor SOAP with merge_dims merges dims across the cut
        mesh, model, _ = tp_sharded(1, 2, SOAP.blocks)
        SOAP(model.parameters(), lr=1e-3, merge_dims=True)


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_what_runs_cannot_assemble_is_refused_naming_the_parameter(name):
    with pytest.raises(Exception) as e:
        run_distributed(lambda: _refused(name), world_size=2)
    msg = str(e.value)
    assert "is tensor-parallel, split along dim" in msg and "TP-local shape" in msg and "merge_small_dims keeps" in msg
    assert "tok_embeddings.weight" in msg or "wq.weight" in msg
