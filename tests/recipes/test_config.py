"""Config loading: every shipped TOML loads, overrides apply, unknown keys and bad types fail clearly."""

from pathlib import Path

import pytest
from config import Config, check_ranges, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "recipes" / "configs").glob("*.toml"))


def test_shipped_configs_load():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", "llama3-1b", "llama3-8b", "moe-tiny", "hf-llama-tiny"} <= names
    for p in CONFIGS:
        assert isinstance(load_config(p), Config)


def test_overrides_are_toml_values():
    cfg = load_config(CONFIGS[0], ["model.dim=96", "train.dtype=bf16", "optim.betas=[0.8, 0.9]", "optim.lr=1e-3",
                                   'data.path="/x y/*.txt"', "model.tie_embeddings=true", "optim.weight_decay=0"])
    assert cfg.model.dim == 96 and cfg.train.dtype == "bf16" and cfg.optim.betas == (0.8, 0.9)
    assert cfg.optim.lr == 1e-3 and cfg.data.path == "/x y/*.txt" and cfg.model.tie_embeddings is True
    assert cfg.optim.weight_decay == 0.0 and isinstance(cfg.optim.weight_decay, float)


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.dimm=3", r"unknown config key 'model.dimm' in --set. Did you mean 'dim'"),
        ("modle.dim=3", r"unknown config key 'modle.dim'.*\[model\]"),
        ("model=3", r"unknown config key 'model'"),
        ("model.dim", r"must look like section.key=value"),
        ("model.dim=1.5", r"'model.dim' in --set must be int"),
        ("train.steps=true", r"'train.steps' in --set must be int"),
        # tuple keys: length and element types
        ("optim.betas=0.9", r"'optim.betas' in --set must be a list of 2 floats, e.g. \[0.9, 0.95\], got 0.9"),
        ("optim.betas=[0.9]", r"'optim.betas' in --set must be a list of 2 floats.*got \[0.9\]"),
        ('optim.betas=["a", "b"]', r"'optim.betas\[0\]' in --set must be float, got 'a'"),
        ("optim.betas=[0.9, true]", r"'optim.betas\[1\]' in --set must be float, got True"),
    ],
)
def test_bad_overrides(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [override])


def test_unknown_key_in_file_names_file_and_key(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[train]\nsteps = 3\nwarmup = 2\n")
    with pytest.raises(ValueError, match=r"unknown config key 'train.warmup' in .*bad.toml. Did you mean 'warmup_steps'"):
        load_config(p)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_tuple_of_ints_becomes_floats():
    assert load_config(None, ["optim.betas=[1, 0]"]).optim.betas == (1.0, 0.0)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"[train\nsteps = 3\n", r"config file '.*bad.toml' is not valid TOML: Expected ']'"),
        (b"[train]\nsteps = 3\n[train]\nsteps = 4\n", r"config file '.*bad.toml' is not valid TOML: Cannot declare"),
        (b"# caf\xe9\n[train]\nsteps = 3\n", r"config file '.*bad.toml' is not UTF-8 text \(byte 5: b'\\xe9'\)"),
    ],
)
def test_unreadable_config_file_is_named(tmp_path, content, match):
    (tmp_path / "bad.toml").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_config(tmp_path / "bad.toml")


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.grad_clip=-1", r"train.grad_clip = -1.0 is out of range: it must be >= 0 \(0: no clipping\)"),
        ("train.min_lr_ratio=-0.5", r"train.min_lr_ratio = -0.5 is out of range: it must be in \[0, 1\]"),
        ("train.min_lr_ratio=1.5", r"train.min_lr_ratio = 1.5 is out of range: it must be in \[0, 1\]"),
        ("optim.lr=-0.01", r"optim.lr = -0.01 is out of range: it must be >= 0"),
        ("optim.adamw_lr=-0.01", r"optim.adamw_lr = -0.01 is out of range"),
        ("optim.weight_decay=-0.1", r"optim.weight_decay = -0.1 is out of range"),
        ("optim.betas=[0.9, 1.0]", r"optim.betas = \(0.9, 1.0\) is out of range: it must be in \[0, 1\)"),
        ("train.batch_size=0", r"train.batch_size = 0 is out of range: it must be >= 1"),
        ("data.seq_len=0", r"data.seq_len = 0 is out of range"),
        ("train.grad_accum=-1", r"train.grad_accum = -1 is out of range"),
        ("log.every=0", r"log.every = 0 is out of range"),
        ("model.dim=0", r"model.dim = 0 is out of range"),
        ("model.n_layers=0", r"model.n_layers = 0 is out of range"),
        ("model.n_kv_heads=0", r"model.n_kv_heads = 0 is out of range"),
        ("data.val_fraction=-0.1", r"data.val_fraction = -0.1 is out of range: it must be in \[0, 1\) \(0: no held-out"),
        ("train.grad_clip=nan", r"train.grad_clip = nan is out of range"),
        ("optim.lr=inf", r"optim.lr = inf is out of range"),
    ],
)
def test_out_of_range_values_are_refused(override, match):
    with pytest.raises(ValueError, match=match):
        check_ranges(load_config(None, [override]))


def test_edge_values_are_accepted():
    check_ranges(load_config(None, ["train.grad_clip=0", "optim.lr=0", "optim.adamw_lr=0", "train.min_lr_ratio=1",
                                    "data.val_fraction=0", "optim.weight_decay=0", "model.n_kv_heads='none'"]))
    for p in CONFIGS:
        check_ranges(load_config(p))
