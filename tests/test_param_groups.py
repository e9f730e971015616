"""global_shape / param_groups on sharded models equal the unsharded grouping (W = 1..3); the p.ndim trap."""

import pytest
import torch

import fsdp_optim
from fsdp_optim.optimizers import AdamW
from tests._models import TinyConfig, TinyTransformer


def _named_groups(model: torch.nn.Module, groups: list[dict]) -> list[tuple[float, list[tuple[str, tuple]]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["weight_decay"], [(names[id(p)], tuple(fsdp_optim.global_shape(p))) for p in g["params"]]) for g in groups]


def _unsharded():
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig())
    return model, _named_groups(model, fsdp_optim.param_groups(model, weight_decay=0.1))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_param_groups_match_unsharded(dist_run, world_size):
    _, expected = _unsharded()
    assert [wd for wd, _ in expected] == [0.1, 0.0]
    assert all(len(shape) >= 2 for _, shape in expected[0][1]) and all(len(s) < 2 for _, s in expected[1][1])
    assert "layers.1.mlp_norm.weight" not in [n for _, ps in expected for n, _ in ps]  # frozen: left out

    def fn():
        model, _ = _unsharded()
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, blocks=AdamW.blocks)
        fsdp_optim.fully_shard(model, blocks=AdamW.blocks)
        trap = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]  # nanoGPT's rule on shards
        groups = fsdp_optim.param_groups(model, weight_decay=0.1)
        AdamW(groups, lr=1e-3)  # the groups are valid optimizer input
        return _named_groups(model, groups), len(trap)

    for got, trap in dist_run(fn, world_size=world_size):
        assert got == expected
        assert trap == 0  # the trap: every sharded parameter is 1-D


def test_global_shape_plain_and_errors():
    w = torch.nn.Parameter(torch.zeros(3, 5))
    assert fsdp_optim.global_shape(w) == torch.Size([3, 5])
    model = torch.nn.Linear(4, 2)
    model.bias.requires_grad_(False)
    assert fsdp_optim.param_groups(model, weight_decay=0) == [{"params": [model.weight], "weight_decay": 0.0}]
    with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0, got -1"):
        fsdp_optim.param_groups(model, weight_decay=-1)
    with pytest.raises(ValueError, match="model must be an nn.Module"):
        fsdp_optim.param_groups([w], weight_decay=0.1)


def test_groups_made_with_p_dim_warn_at_the_first_step(dist_run):
    # Issue #29: the trap is detectable at the first step (an empty decay group beside a no-decay group
    # holding sharded matrices); the groups fsdp_optim.param_groups makes do not warn.
    import warnings

    def fn():
        model, _ = _unsharded()
        fsdp_optim.fully_shard(model, blocks=AdamW.blocks)
        params = [p for p in model.parameters() if p.requires_grad]
        caught = {}
        for how in ("ndim", "global"):
            if how == "ndim":
                groups = [
                    {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
                ]
            else:
                groups = fsdp_optim.param_groups(model, weight_decay=0.1)
            opt = torch.optim.AdamW(groups, lr=1e-3)
            model(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                opt.step()
            opt.zero_grad()
            caught[how] = [str(x.message) for x in w if "p.dim() >= 2" in str(x.message)]
        return caught

    for caught in dist_run(fn, world_size=2):
        assert len(caught["ndim"]) == 1 and "fsdp_optim.param_groups" in caught["ndim"][0], caught
        assert caught["global"] == []
