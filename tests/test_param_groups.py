"""param_groups and the nanoGPT rule ``p.ndim >= 2`` on sharded models equal the unsharded grouping
(W = 1..3): a sharded parameter is a DTensor of the global shape, so the rule works as written."""

import pytest
import torch

import fsdp_optim
from fsdp_optim.optimizers import AdamW
from tests._models import TinyConfig, TinyTransformer


def _named_groups(model: torch.nn.Module, groups: list[dict]) -> list[tuple[float, list[tuple[str, tuple]]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["weight_decay"], [(names[id(p)], tuple(p.shape)) for p in g["params"]]) for g in groups]


def _unsharded():
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig())
    return model, _named_groups(model, fsdp_optim.param_groups(model, weight_decay=0.1))


def _ndim_rule(model: torch.nn.Module) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_param_groups_and_the_ndim_rule_match_unsharded(dist_run, world_size):
    _, expected = _unsharded()
    assert [wd for wd, _ in expected] == [0.1, 0.0]
    assert all(len(shape) >= 2 for _, shape in expected[0][1]) and all(len(s) < 2 for _, s in expected[1][1])
    assert "layers.1.mlp_norm.weight" not in [n for _, ps in expected for n, _ in ps]  # frozen: left out

    def fn():
        model, _ = _unsharded()
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, blocks=AdamW.blocks)
        fsdp_optim.fully_shard(model, blocks=AdamW.blocks)
        groups = fsdp_optim.param_groups(model, weight_decay=0.1)
        AdamW(groups, lr=1e-3)  # the groups are valid optimizer input
        torch.optim.AdamW(_ndim_rule(model), lr=1e-3)
        return _named_groups(model, groups), _named_groups(model, _ndim_rule(model))

    for got, by_ndim in dist_run(fn, world_size=world_size):
        assert got == expected
        assert by_ndim == expected  # nanoGPT's p.ndim >= 2 on the sharded model: the same groups


def test_param_groups_plain_and_errors():
    w = torch.nn.Parameter(torch.zeros(3, 5))
    model = torch.nn.Linear(4, 2)
    model.bias.requires_grad_(False)
    assert fsdp_optim.param_groups(model, weight_decay=0) == [{"params": [model.weight], "weight_decay": 0.0}]
    with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0, got -1"):
        fsdp_optim.param_groups(model, weight_decay=-1)
    with pytest.raises(ValueError, match="model must be an nn.Module"):
        fsdp_optim.param_groups([w], weight_decay=0.1)
