"""Checkpoints across tensor-parallel layouts ([Note: FSDP x TP]).

Saved at (dp 2, tp 2) after two steps (Muon on the hidden matrices, its AdamW on the rest), loaded at
(dp 4, tp 1), (dp 1, tp 2) and (dp 2, tp 1): the loaded parameters and optimizer state equal the saved
ones bitwise, and the next step is the uninterrupted run's (the global batch is the same at every
layout; gradients are reduced in another order, and Muon's Newton–Schulz runs in bf16, which turns
last-bit differences into bf16 roundings: bound 0.02 = lr on any parameter after the step, measured in
the test's output). With ``fsdp_optim.save_checkpoint`` and with torch's own ``dcp.save(get_state_dict)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon
from tests._models import TPConfig, TPTransformer, load_state, make_batch, save_state, tp_sharded

GLOBAL_BATCH, LR = 4, 0.02


def _build(dp: int, tp: int):
    mesh, model, _ = tp_sharded(dp, tp, Muon.rule(embedding_and_head=["tok_embeddings", "output"]))
    opt = Muon(model.parameters(), lr=LR, adamw_lr=LR)
    return mesh, model, opt


def _step(model, opt, mesh, step: int) -> None:
    dp = mesh.size(0)
    r = mesh.get_coordinate()[0]
    n = GLOBAL_BATCH // dp
    tok, tgt = make_batch(batch_size=GLOBAL_BATCH, seq_len=8, vocab_size=TPConfig().vocab_size, seed=step)
    F.cross_entropy(model(tok[r * n : (r + 1) * n]).flatten(0, 1), tgt[r * n : (r + 1) * n].flatten()).backward()
    opt.step()
    opt.zero_grad()


def _full(model, opt) -> dict[str, torch.Tensor]:
    out = {f"param:{n}": p.full_tensor() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        buf = opt.state[p].get("momentum_buffer")
        if buf is None:
            buf = opt.state[p]["exp_avg"]
        # the state as checkpoints see it: a RaggedDTensor of the parameter's shape and placements
        from fsdp_optim.sharding.checkpoint._state import state_tensor

        out[f"state:{n}"] = state_tensor(p, buf, tuple(p.shape), tuple(p.ragged.bounds)).full_tensor()
    return out


def _save(path: str, how: str):
    mesh, model, opt = _build(2, 2)
    for s in range(2):
        _step(model, opt, mesh, s)
    save_state(path, how, model, opt)
    saved = _full(model, opt)
    _step(model, opt, mesh, 2)
    return saved, {n: p.full_tensor() for n, p in model.named_parameters()}


def _load(path: str, how: str, dp: int, tp: int):
    mesh, model, opt = _build(dp, tp)
    load_state(path, how, model, opt)
    loaded = _full(model, opt)
    _step(model, opt, mesh, 2)
    return loaded, {n: p.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["fsdp_optim", "torch_dcp"])
def test_saved_at_dp2_tp2_loads_at_other_layouts_and_continues(tmp_path, how):
    path = str(tmp_path / "ckpt")
    saved, uninterrupted = run_distributed(lambda: _save(path, how), world_size=4)[0]
    for dp, tp in [(4, 1), (1, 2), (2, 1)]:
        loaded, after = run_distributed(lambda: _load(path, how, dp, tp), world_size=dp * tp)[0]
        assert loaded.keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(loaded[k], v), (dp, tp, k)
        worst = max((after[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
        print(f"{how}: saved at (dp 2, tp 2), loaded at (dp {dp}, tp {tp}): next step max |diff| = {worst:.3g}")
        assert worst <= LR, (dp, tp, worst)


def _full_dicts():
    mesh, model, opt = _build(2, 2)
    _step(model, opt, mesh, 0)
    full = fsdp_optim.full_state_dict(model)
    torch.manual_seed(0)
    return {k: v.clone() for k, v in full.items()}, {n: p.full_tensor() for n, p in model.named_parameters()}


def test_full_state_dict_of_a_tp_model_holds_the_unsharded_tensors():
    for full, params in run_distributed(_full_dicts, world_size=4):
        assert set(full) == set(params)
        for k, v in params.items():
            assert full[k].shape == v.shape and torch.equal(full[k], v), k


def _round_trip_full(full):
    mesh, model, opt = _build(2, 2)
    fsdp_optim.load_full_state_dict(model, full)
    got = {n: p.full_tensor() for n, p in model.named_parameters()}
    fsdp_optim.load_full_state_dict(model, full if dist.get_rank() == 0 else None, broadcast_from_rank0=True)
    got2 = {n: p.full_tensor() for n, p in model.named_parameters()}
    return got, got2


def test_load_full_state_dict_into_a_tp_model():
    torch.manual_seed(1)
    full = {k: torch.randn_like(v) for k, v in TPTransformer().state_dict().items()}
    for got, got2 in run_distributed(lambda: _round_trip_full(full), world_size=4):
        for k, v in full.items():
            assert torch.equal(got[k], v) and torch.equal(got2[k], v), k


def _adamw8bit(path: str, dp: int, tp: int, save: bool):
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fsdp_optim.optimizers import AdamW8bit

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256, bias=False), nn.Tanh(), nn.Linear(256, 128, bias=False))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fsdp_optim.fully_shard(model, mesh=mesh["dp"], blocks=AdamW8bit.blocks)
    opt = AdamW8bit(model.parameters(), lr=1e-2, compile=False)
    if save:
        model(torch.randn(4, 128, generator=torch.Generator().manual_seed(0))).square().sum().backward()
        opt.step()
        fsdp_optim.save_checkpoint(path, model=model, optimizer=opt)
    else:
        fsdp_optim.load_checkpoint(path, model=model, optimizer=opt)
    state = opt.state_dict()["state"]
    return {k: {n: v.full_tensor() for n, v in s.items() if hasattr(v, "full_tensor")} for k, s in state.items()}


def test_per_block_state_loads_at_the_same_tp_size_and_is_refused_at_another(tmp_path):
    """[Note: per-block state under TP]: 8-bit scales of TP-local blocks load at (dp 1, tp 2) from
    (dp 2, tp 2) bitwise; at (dp 4, tp 1) the load raises instead of attaching them to other blocks."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(lambda: _adamw8bit(path, 2, 2, True), world_size=4)[0]
    loaded = run_distributed(lambda: _adamw8bit(path, 1, 2, False), world_size=2)[0]
    assert saved.keys() == loaded.keys()
    for k in saved:
        for n, v in saved[k].items():
            assert torch.equal(loaded[k][n], v), (k, n)
    with pytest.raises(Exception) as e:
        run_distributed(lambda: _adamw8bit(path, 4, 1, False), world_size=4)
    assert "loads only at the same TP size" in str(e.value)


def test_export_hf_of_a_tp_model_writes_the_unsharded_tensors_and_load_hf_reads_them_back(tmp_path):
    import os

    from safetensors import safe_open

    class _Config:  # export_hf needs only save_pretrained of a config
        def save_pretrained(self, path):
            with open(os.path.join(path, "config.json"), "w") as f:
                f.write("{}")

    def fn():
        mesh, model, opt = _build(2, 2)
        _step(model, opt, mesh, 0)
        fsdp_optim.export_hf(model, tmp_path / "hf", config=_Config())
        _, other, _ = _build(1, 4)  # another layout reads it back
        fsdp_optim.load_hf(other, tmp_path / "hf")
        want = {n: p.full_tensor() for n, p in model.named_parameters()}
        got = {n: p.full_tensor() for n, p in other.named_parameters()}
        return want, all(torch.equal(got[k], v) for k, v in want.items())

    want, same = run_distributed(fn, world_size=4)[0]
    assert same
    files = {}
    for f in os.listdir(tmp_path / "hf"):
        if f.endswith(".safetensors"):
            with safe_open(str(tmp_path / "hf" / f), "pt") as h:
                files.update({k: h.get_tensor(k) for k in h.keys()})
    assert files.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(files[k], v), k


def _full_plain_state_loads(name: str):
    """``optimizer.load_state_dict`` given *full* plain state tensors (each ``state_dict()`` DTensor
    gathered): every rank takes its own piece, the TP slice first ([Note: per-block state under TP])."""
    from fsdp_optim.optimizers import NorMuon, Shampoo

    if name == "shampoo":  # k = 12 cuts through the blocks: runs over the (dp, tp) cells
        rule, make = Shampoo.rule(max_preconditioner_dim=12), lambda ps: Shampoo(
            ps, lr=LR, max_preconditioner_dim=12, start_preconditioning_step=1, precondition_frequency=1)  # fmt: skip
    else:  # Muon / NorMuon: per-element momentum of TP slices, NorMuon's per-row v, AdamW on the rest
        cls = {"muon": Muon, "normuon": NorMuon}[name]
        rule, make = Muon.rule(embedding_and_head=["tok_embeddings", "output"]), lambda ps: cls(ps, lr=LR, adamw_lr=LR)
    mesh, model, _ = tp_sharded(2, 2, rule)
    opt = make(model.parameters())
    for s in range(2):
        _step(model, opt, mesh, s)
    sd = opt.state_dict()
    full = {i: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in st.items()} for i, st in sd["state"].items()}
    _, other, _ = tp_sharded(2, 2, rule)
    other_opt = make(other.parameters())
    other_opt.load_state_dict({"state": full, "param_groups": sd["param_groups"]})
    mine = other_opt.state_dict()["state"]
    return [
        (i, k) for i, st in full.items() for k, v in st.items()
        if not torch.equal(mine[i][k].full_tensor() if hasattr(mine[i][k], "full_tensor") else mine[i][k], v)
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["muon", "normuon", "shampoo"])
def test_full_plain_state_tensors_load_into_their_tp_pieces(name):
    for wrong in run_distributed(lambda: _full_plain_state_loads(name), world_size=4):
        assert wrong == [], wrong
