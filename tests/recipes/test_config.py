"""Config loading: every shipped TOML loads, overrides apply, unknown keys and bad types fail clearly."""

from pathlib import Path

import pytest
from config import Config, load_config

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
