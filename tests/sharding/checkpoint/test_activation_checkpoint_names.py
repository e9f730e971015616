"""Activation checkpointing does not change a single name the library writes ([Note: state-dict names]
in ``sharding/checkpoint/_state.py``).

torch's ``checkpoint_wrapper`` (applied per layer, as torchtitan applies AC) holds each layer as
``_checkpoint_wrapped_module``; ``model.state_dict()``, torch's ``get_model_state_dict`` and DCP drop
that component from their keys. So do ``full_state_dict``, ``load_full_state_dict``, checkpoints
(model entries and the optimizer's parameter names) and ``export_hf`` / ``load_hf``: a checkpoint saved
with AC loads without it and the reverse, model and optimizer, and the next step is bitwise the
uninterrupted run's (AC recomputes the same forward: one thread per rank, the same kernels).

Also here: a full state dict with a missing or an unexpected key raises a ``ValueError`` naming the
keys on every rank (not a ``KeyError``), and an optimizer whose parameters are not the checkpoint's
is told which names differ.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdp_optim
from fsdp_optim._testing import DistributedTestError, run_distributed
from fsdp_optim.optimizers import Muon
from tests._models import TinyTransformer, make_batch

WORLD_SIZES = [2, 3]
WRAPPED = "_checkpoint_wrapped_module"


def _model(ac: bool, *, seed: int = 0) -> TinyTransformer:
    """The tiny transformer (tied head, a frozen norm), each layer wrapped for activation checkpointing
    when ``ac``, sharded per layer and at the root with Muon's rule."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    if ac:
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    for layer in model.layers:
        fsdp_optim.fully_shard(layer, blocks=Muon.blocks)
    fsdp_optim.fully_shard(model, blocks=Muon.blocks)
    return model


def _muon(model):
    return Muon(model.named_parameters(), lr=0.02, adamw_lr=1e-3)


def _step(model, opt, seed: int) -> None:
    x, y = make_batch(batch_size=2, seq_len=8, seed=seed)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad()


def _plain_keys() -> list[str]:
    torch.manual_seed(0)
    return list(TinyTransformer().state_dict())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_name_is_the_one_torch_writes(world_size):
    """full_state_dict, model.state_dict(), get_model_state_dict and the unsharded model agree on the
    keys with AC on; the values are the model's without AC."""

    def fn():
        ac, plain = _model(True), _model(False)
        assert any(WRAPPED in n for n, _ in ac.named_parameters())  # the wrapper is there
        full = fsdp_optim.full_state_dict(ac)
        torch_full = get_model_state_dict(ac, options=StateDictOptions(full_state_dict=True))
        want = fsdp_optim.full_state_dict(plain)
        return list(full), list(ac.state_dict()), list(torch_full), {k: torch.equal(full[k], want[k]) for k in want}

    for full_keys, sd_keys, torch_keys, same in run_distributed(fn, world_size=world_size):
        assert full_keys == sd_keys == torch_keys == _plain_keys()
        assert all(same.values()), same


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_full_state_dicts_load_across_activation_checkpointing(world_size):
    """AC -> no AC and no AC -> AC, every rank passing the dict and broadcast from rank 0; and torch's
    ``load_state_dict`` of the full tensors into the AC model."""

    def fn():
        src_ac, src_plain = _model(True, seed=1), _model(False, seed=2)
        want_ac, want_plain = fsdp_optim.full_state_dict(src_ac), fsdp_optim.full_state_dict(src_plain)
        out = []
        for broadcast in (False, True):
            into_plain, into_ac = _model(False), _model(True)
            fsdp_optim.load_full_state_dict(into_plain, want_ac, broadcast_from_rank0=broadcast)
            fsdp_optim.load_full_state_dict(into_ac, want_plain, broadcast_from_rank0=broadcast)
            got_plain, got_ac = fsdp_optim.full_state_dict(into_plain), fsdp_optim.full_state_dict(into_ac)
            out.append(all(torch.equal(got_plain[k], v) for k, v in want_ac.items()))
            out.append(all(torch.equal(got_ac[k], v) for k, v in want_plain.items()))
        by_torch = _model(True)
        by_torch.load_state_dict(want_plain)
        got = fsdp_optim.full_state_dict(by_torch)
        out.append(all(torch.equal(got[k], v) for k, v in want_plain.items()))
        return out

    for flags in run_distributed(fn, world_size=world_size):
        assert flags == [True] * 5


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("save_ac", [True, False], ids=["save_with_ac", "save_without_ac"])
def test_checkpoint_does_not_depend_on_activation_checkpointing(tmp_path, world_size, save_ac):
    """Two steps, save (model + Muon state) with AC on or off, load into a model with the other
    setting, one more step: bitwise the uninterrupted run's third step."""
    ck = str(tmp_path / "ck")

    def fn():
        model = _model(save_ac)
        opt = _muon(model)
        for s in range(2):
            _step(model, opt, seed=s)
        fsdp_optim.save_checkpoint(ck, model=model, optimizer=opt)
        _step(model, opt, seed=2)
        want = fsdp_optim.full_state_dict(model)

        other = _model(not save_ac, seed=5)
        other_opt = _muon(other)
        fsdp_optim.load_checkpoint(ck, model=other, optimizer=other_opt)
        _step(other, other_opt, seed=2)
        got = fsdp_optim.full_state_dict(other)
        return {k: torch.equal(got[k], v) for k, v in want.items()}

    for same in run_distributed(fn, world_size=world_size):
        assert all(same.values()), [k for k, v in same.items() if not v]
    with open(os.path.join(ck, "fsdp_optim.json")) as f:
        manifest = json.load(f)
    text = json.dumps(manifest)
    assert WRAPPED not in text  # no entry, no optimizer parameter name carries the wrapper's attribute
    assert "layers.0.attn.wq.weight" in text
    for f in os.listdir(ck):  # nor any byte written (the param groups' param_names included)
        with open(os.path.join(ck, f), "rb") as fh:
            assert WRAPPED.encode() not in fh.read(), f


def test_export_hf_and_load_hf_use_the_torch_names(tmp_path):
    """The safetensors files of a model with AC hold ``model.state_dict()``'s keys; ``load_hf`` loads
    them into a model without AC (and the reverse), bitwise."""
    from safetensors import safe_open

    class _Config:  # export_hf needs only save_pretrained of a config
        def save_pretrained(self, path):
            with open(os.path.join(path, "config.json"), "w") as f:
                f.write("{}")

    def fn():
        ac, plain = _model(True, seed=1), _model(False, seed=2)
        fsdp_optim.export_hf(ac, tmp_path / "from_ac", config=_Config())
        fsdp_optim.export_hf(plain, tmp_path / "from_plain", config=_Config())
        into_plain, into_ac = _model(False), _model(True)
        fsdp_optim.load_hf(into_plain, tmp_path / "from_ac")
        fsdp_optim.load_hf(into_ac, tmp_path / "from_plain")
        a, b = fsdp_optim.full_state_dict(into_plain), fsdp_optim.full_state_dict(ac)
        c, d = fsdp_optim.full_state_dict(into_ac), fsdp_optim.full_state_dict(plain)
        return all(torch.equal(a[k], b[k]) for k in b) and all(torch.equal(c[k], d[k]) for k in d)

    assert run_distributed(fn, world_size=2) == [True, True]
    names = set()
    for f in os.listdir(tmp_path / "from_ac"):
        if f.endswith(".safetensors"):
            with safe_open(str(tmp_path / "from_ac" / f), "pt") as h:
                names |= set(h.keys())
    plain = set(_plain_keys())
    assert names == plain - {"output.weight"}  # the tied head is written once, under the embedding's name


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("broadcast", [False, True])
def test_load_full_state_dict_names_missing_and_unexpected_keys_on_every_rank(world_size, broadcast):
    """Into a model with AC: a ValueError naming the keys (state-dict keys, no wrapper attribute) on
    every rank, nothing loaded; with strict=False the keys both hold load and the missing one keeps its value."""
    def fn():
        model = _model(True)
        sd = fsdp_optim.full_state_dict(_model(False))
        sd.pop("layers.1.attn.wq.weight")
        sd["layers.1.attn.wz.weight"] = torch.zeros(72, 72)
        before = fsdp_optim.full_state_dict(model)
        try:
            fsdp_optim.load_full_state_dict(model, sd, broadcast_from_rank0=broadcast)
        except ValueError as e:
            err = (type(e).__name__, str(e))
        else:
            err = None
        unchanged = all(torch.equal(v, before[k]) for k, v in fsdp_optim.full_state_dict(model).items())
        sd.pop("layers.1.attn.wz.weight")
        fsdp_optim.load_full_state_dict(model, sd, strict=False, broadcast_from_rank0=broadcast)
        after = fsdp_optim.full_state_dict(model)
        loaded = all(torch.equal(after[k], v) for k, v in sd.items())
        kept = torch.equal(after["layers.1.attn.wq.weight"], before["layers.1.attn.wq.weight"])
        return err, unchanged, loaded, kept

    for err, unchanged, loaded, kept in run_distributed(fn, world_size=world_size):
        assert err is not None, "no error"
        name, msg = err
        assert name == "ValueError"
        assert "missing keys: layers.1.attn.wq.weight" in msg and "unexpected keys: layers.1.attn.wz.weight" in msg
        assert "strict=False loads the keys both hold" in msg and WRAPPED not in msg
        assert unchanged and loaded and kept  # the refused load changed nothing; strict=False loads the rest


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_optimizer_name_mismatch_says_which_names_differ(tmp_path, world_size):
    """An optimizer over other parameters than the saved one's: the error names them, on every rank."""
    ck = str(tmp_path / "ck")

    def fn():
        model = _model(True)
        opt = _muon(model)
        _step(model, opt, seed=0)
        fsdp_optim.save_checkpoint(ck, model=model, optimizer=opt)
        other = _model(False)
        fewer = Muon([(n, p) for n, p in other.named_parameters() if n != "layers.0.mlp.w2.weight"], lr=0.02)
        fsdp_optim.load_checkpoint(ck, model=other, optimizer=fewer)

    with pytest.raises(DistributedTestError) as info:
        run_distributed(fn, world_size=world_size)
    msg = str(info.value)
    assert "param groups do not match the checkpoint's" in msg
    assert "only in the checkpoint: layers.0.mlp.w2.weight" in msg
    assert WRAPPED not in msg
