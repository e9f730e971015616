"""Hugging Face in and out: ``export_hf`` writes what ``transformers``' ``from_pretrained`` loads (the
reference nobody here wrote), with the sharded model's logits, and ``load_hf`` into a meta-built
sharded model round-trips bitwise."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest
import torch
import torch.distributed as dist

import fsdp_optim
from fsdp_optim._testing import run_distributed

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _config(tied: bool):
    return transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )


def _sharded(cfg, *, device: str = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    for layer in model.model.layers:
        fsdp_optim.fully_shard(layer)
    fsdp_optim.fully_shard(model)
    return model


TOKENS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


@pytest.mark.parametrize("tied", [True, False])
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, tied):
    cfg = _config(tied)

    def fn():
        model = _sharded(cfg)
        with torch.no_grad():
            logits = model(input_ids=TOKENS, use_cache=False).logits
        fsdp_optim.export_hf(model, tmp_path / "hf")
        return logits

    logits = run_distributed(fn, world_size=2)[0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    with torch.no_grad():
        want = loaded(input_ids=TOKENS, use_cache=False).logits
    assert torch.equal(logits, want)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


def test_load_hf_into_a_meta_built_sharded_model_round_trips_bitwise(tmp_path):
    cfg = _config(True)

    def export():
        fsdp_optim.export_hf(_sharded(cfg, seed=0), tmp_path / "a")

    def reload():
        model = _sharded(cfg, device="meta")
        fsdp_optim.load_hf(model, tmp_path / "a")
        fsdp_optim.export_hf(model, tmp_path / "b")
        return dist.get_rank()

    run_distributed(export, world_size=2)
    run_distributed(reload, world_size=3)
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if "rotary" not in k)


def test_load_hf_from_a_missing_directory_raises_on_every_rank(tmp_path):
    def fn():
        model = _sharded(_config(True))
        with pytest.raises(ValueError, match=r"rank 0 cannot read the checkpoint: FileNotFoundError"):
            fsdp_optim.load_hf(model, tmp_path / "nowhere")
        return True

    assert run_distributed(fn, world_size=2, timeout=60) == [True, True]


def test_export_hf_onto_a_file_raises_on_every_rank(tmp_path):
    """The target is a file: refused on every rank before anything is written (no rank waits for rank
    0 at the next bucket), and the file is left alone."""
    target = tmp_path / "a_file"
    target.write_text("not a directory")

    def fn():
        model = _sharded(_config(False))
        with pytest.raises(ValueError, match=r"export_hf: .*a_file \(the target\) exists and is not a folder"):
            fsdp_optim.export_hf(model, target)
        return True

    assert run_distributed(fn, world_size=2, timeout=60) == [True, True]
    assert target.read_text() == "not a directory" and not (tmp_path / "a_file.tmp").exists()


def _files(folder) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def test_export_replaces_an_older_save_pretrained_folder(tmp_path):
    """A folder that ``save_pretrained`` wrote (one ``model.safetensors``, which ``from_pretrained``
    prefers to an index, and ``generation_config.json``), plus a leftover ``.tmp`` of an interrupted
    export: the export replaces it all, and ``from_pretrained`` loads the exported weights (the
    unsharded model's, bitwise). The files get the mode ``open()`` gives, as config.json."""
    cfg = _config(False)
    out = tmp_path / "hf"
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    assert (out / "model.safetensors").exists() and (out / "generation_config.json").exists()
    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.tmp" / "model-00001-of-00009.safetensors").write_bytes(b"half written")

    def fn():
        model = _sharded(cfg, seed=0)
        with torch.no_grad():
            logits = model(input_ids=TOKENS, use_cache=False).logits
        fsdp_optim.export_hf(model, out)
        return logits

    logits = run_distributed(fn, world_size=2)[0]
    torch.manual_seed(0)
    want = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").state_dict()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    got = loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=TOKENS, use_cache=False).logits, logits)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {f.name for f in out.iterdir()} == {"config.json", "model.safetensors.index.json", *index["weight_map"].values()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {
        f.name: 0o666 & ~umask for f in out.iterdir()
    }


def test_failed_export_leaves_the_previous_export_as_it_was(tmp_path):
    """Writing fails on rank 0 after some buckets (here: ``convert`` raises on the second layer):
    every rank raises a ValueError saying the folder was not changed, the previous export is there
    byte for byte, and the temporary folder is gone."""
    cfg = _config(False)
    out = tmp_path / "hf"
    run_distributed(lambda: fsdp_optim.export_hf(_sharded(cfg, seed=0), out), world_size=2)
    before = _files(out)

    def convert(name, t):
        if name.startswith("model.layers.1."):
            raise RuntimeError("boom")
        return name, t

    def fn():
        with pytest.raises(ValueError) as e:
            fsdp_optim.export_hf(_sharded(cfg, seed=1), out, convert=convert)
        return str(e.value)

    msgs = run_distributed(fn, world_size=2, timeout=60)
    assert msgs[0] == msgs[1]
    assert "failed on rank 0: RuntimeError: boom" in msgs[0]
    assert msgs[0].endswith(f"{out} was not changed and {out}.tmp was removed")
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_refuses_a_folder_with_other_files_and_a_symlink(tmp_path):
    """A folder holding files that are not a model export (a user's notes, a tokenizer) is refused,
    not deleted; so is a symbolic link (replacing it would replace the link). On every rank, naming
    the folder, the files and the fix; nothing is written."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    (mine / "notes.txt").write_text("keep me")
    link = tmp_path / "latest"
    link.symlink_to(mine)

    def fn():
        model = _sharded(_config(False))
        with pytest.raises(ValueError, match=r"mine \(the target\) holds files that are not part of a Hugging Face "
                                             r"model export \(notes.txt\); .*export to a new folder or move"):
            fsdp_optim.export_hf(model, mine)
        with pytest.raises(ValueError, match=r"latest \(the target\) is a symbolic link .*Export to a real folder"):
            fsdp_optim.export_hf(model, link)
        return True

    assert run_distributed(fn, world_size=2, timeout=60) == [True, True]
    assert _files(mine) == {"config.json": b"{}", "notes.txt": b"keep me"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "mine"] and link.is_symlink()


def test_load_hf_of_a_truncated_file_raises_on_every_rank_naming_it(tmp_path):
    """A truncated safetensors file (one shard of an export, or ``save_pretrained``'s single file):
    every rank raises a ValueError naming the file, before any broadcast."""
    cfg = _config(True)
    run_distributed(lambda: fsdp_optim.export_hf(_sharded(cfg), tmp_path / "sharded"), world_size=2)
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "single")
    single = tmp_path / "single" / "model.safetensors"
    for f in (shard, single):
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size - 16)

    def fn():
        model = _sharded(cfg, device="meta")
        for f in (shard, single):
            with pytest.raises(ValueError, match=rf"{re.escape(str(f))} is truncated or corrupt"):
                fsdp_optim.load_hf(model, f.parent)
        return True

    assert run_distributed(fn, world_size=2, timeout=60) == [True, True]


@pytest.mark.usefixtures("one_process_group")
def test_export_whose_final_rename_fails_puts_the_previous_export_back(tmp_path, monkeypatch):
    """The last step (``<path>.tmp`` -> ``path``, after moving the previous export to ``<path>.old``)
    fails: the previous export is moved back and the error says so (one process, no group)."""
    cfg = _config(False)
    out = tmp_path / "hf"
    fsdp_optim.export_hf(_sharded(cfg, seed=0), out)
    before = _files(out)
    rename = os.rename

    def failing(src, dst):
        if str(src).endswith(".tmp"):
            raise OSError("disk went away")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(ValueError, match=rf"failed on rank 0: OSError: disk went away; {re.escape(str(out))} was not "
                                         "changed and .*hf.tmp was removed"):
        fsdp_optim.export_hf(_sharded(cfg, seed=1), out)
    monkeypatch.undo()
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in fsdp_optim.full_state_dict(model).items()}


def test_load_hf_convert_skips_non_persistent_buffers_and_its_errors_raise_on_every_rank(tmp_path):
    """``convert`` is called for ``state_dict()`` names only (not the non-persistent rotary ``inv_freq``,
    which no file holds), and an exception it raises is a ValueError on every rank naming the name,
    before anything is loaded. Before: a KeyError for ``model.rotary_emb.inv_freq`` on rank 0 only,
    and rank 1 hung."""
    cfg = _config(False)
    known = set(transformers.AutoModelForCausalLM.from_config(cfg).state_dict())
    seen, fail = [], {"model.norm.weight"}

    def convert(name):
        seen.append(name)
        if name not in known or name in fail:
            raise KeyError(f"no HF name for {name}")
        return name, lambda t: t

    def fn():
        fsdp_optim.export_hf(_sharded(cfg, seed=0), tmp_path / "hf")
        model = _sharded(cfg, seed=1)
        before = _state(model)
        with pytest.raises(ValueError, match=r"load_hf\(.*hf\): convert\('model\.norm\.weight'\) raised KeyError"):
            fsdp_optim.load_hf(model, tmp_path / "hf", convert=convert)
        after = _state(model)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        fail.clear()
        fsdp_optim.load_hf(model, tmp_path / "hf", convert=convert)
        return unchanged, sorted(set(seen) - known)

    assert run_distributed(fn, world_size=2, timeout=60) == [(True, [])] * 2


def test_load_hf_from_hf_of_the_wrong_shape_raises_on_every_rank(tmp_path):
    """A ``from_hf`` giving a wrongly shaped tensor: seen on a meta tensor, it is refused before anything
    is loaded; seen only on real data (numpy), it raises on every rank when read (see [Note:
    broadcasting from rank 0]). Both name the tensor and the shapes. Before: rank 0 raised mid-broadcast,
    rank 1 hung, the buckets before it stayed loaded."""
    cfg = _config(False)
    victim = "model.layers.0.mlp.down_proj.weight"
    layouts = {
        "meta": (lambda t: t.t().contiguous()[:10], r"shape mismatch for model\.layers\.0\.mlp\.down_proj\.weight: "
                 r"the full state dict has \(10, 32\), the model \(32, 72\)"),
        "data": (lambda t: torch.from_numpy(t.numpy().T[:10].copy()), r"rank 0 cannot send model\.layers\.0\.mlp\."
                 r"down_proj\.weight: ValueError: shape mismatch .* has \(10, 32\), the model \(32, 72\)"),
    }

    def fn():
        fsdp_optim.export_hf(_sharded(cfg, seed=0), tmp_path / "hf")
        out = []
        for from_hf, match in layouts.values():
            model = _sharded(cfg, seed=1)
            before = _state(model)
            with pytest.raises(ValueError, match=match):
                fsdp_optim.load_hf(model, tmp_path / "hf", convert=lambda n: (n, from_hf if n == victim else (lambda t: t)))
            after = _state(model)
            out.append(all(torch.equal(before[k], after[k]) for k in before))
        return out

    # (the data case loads the buckets before the victim's: only the meta case leaves everything as it was)
    assert [r[0] for r in run_distributed(fn, world_size=2, timeout=60)] == [True, True]


def _transpose_in_files(hf_dir, name: str) -> None:
    """Rewrite the exported files with ``name`` stored transposed (a layout only ``convert`` undoes)."""
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors = safetensors_torch.load_file(f)
        if name in tensors:
            tensors[name] = tensors[name].t().contiguous()
            safetensors_torch.save_file(tensors, f, metadata={"format": "pt"})
            return
    raise AssertionError(f"{name} is in no exported file")


@pytest.mark.parametrize("world_size", [1, 2])
def test_load_hf_from_hf_that_needs_real_data_is_checked_when_read(tmp_path, world_size):
    """A ``from_hf`` that only works on real data (numpy) cannot be evaluated on meta, so its shape is
    checked when read: one that permutes the file's layout back loads bitwise equal to the exported
    model, and one that gives a tensor of the same size but the wrong shape raises naming it. Before:
    the file's own shape was checked instead, so the first was refused at W=2 and the second loaded
    silently permuted at W=1."""
    cfg = _config(False)
    victim = "model.layers.0.mlp.down_proj.weight"  # (32, 72)
    numpy_t = lambda t: torch.from_numpy(t.numpy().T.copy())  # noqa: E731
    numpy_as_is = lambda t: torch.from_numpy(t.numpy().copy())  # noqa: E731

    def fn():
        ref = _sharded(cfg, seed=0)
        fsdp_optim.export_hf(ref, tmp_path / "hf")
        want = _state(ref)
        if dist.get_rank() == 0:
            _transpose_in_files(tmp_path / "hf", victim)
        dist.barrier()
        model = _sharded(cfg, seed=1)
        fsdp_optim.load_hf(model, tmp_path / "hf", convert=lambda n: (n, numpy_t if n == victim else (lambda t: t)))
        got = _state(model)
        loads = sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
        model = _sharded(cfg, seed=1)
        with pytest.raises(ValueError, match=r"down_proj\.weight: .*shape mismatch for model\.layers\.0\.mlp\."
                           r"down_proj\.weight: the full state dict has \(72, 32\), the model \(32, 72\)"):
            # the file's transposed layout, read as it is
            fsdp_optim.load_hf(model, tmp_path / "hf", convert=lambda n: (n, numpy_as_is))
        return loads

    assert run_distributed(fn, world_size=world_size, timeout=60) == [True] * world_size


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("shard_root", [True, False])
def test_export_file_names_count_the_files_written(tmp_path, shard_root):
    """``model-0000k-of-0000N.safetensors``: N is the number of files written and k runs 1..N, with or
    without a file for unsharded tensors (the root left unsharded). Before: N counted every bucket plus
    one (``-of-00004`` on three files)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(False), attn_implementation="eager")
    for layer in model.model.layers:
        fsdp_optim.fully_shard(layer)
    if shard_root:
        fsdp_optim.fully_shard(model)
    fsdp_optim.export_hf(model, tmp_path / "hf")
    files = sorted(f.name for f in (tmp_path / "hf").glob("model-*.safetensors"))
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)], files
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files


@pytest.mark.parametrize("call", ["export_hf", "load_hf"])
def test_an_hf_call_not_entered_by_every_rank_fails_in_bounded_time(tmp_path, call):
    """Rank 0 alone calls it: it raises within ``timeout`` naming the missing rank and the rule, having
    written nothing. Before: it waited for the process group's timeout (30 minutes by default). The bound
    is the harness's ``timeout=60`` (a hang fails there); no duration is asserted (a busy machine is slow)."""

    def fn():
        model = _sharded(_config(False))
        if dist.get_rank() != 0:
            return None
        with pytest.raises(TimeoutError, match=rf"rank\(s\) \[1\] of 2 did not call {call} within 2 s; every rank must"):
            if call == "export_hf":
                fsdp_optim.export_hf(model, tmp_path / "hf", timeout=2)
            else:
                fsdp_optim.load_hf(model, tmp_path / "hf", timeout=2)
        return sorted(os.listdir(tmp_path))

    assert run_distributed(fn, world_size=2, timeout=60)[0] == []
