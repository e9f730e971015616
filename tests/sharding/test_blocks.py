"""Block specs: boundaries, alignment and matrices, checked by brute force on small shapes."""

import math

import pytest

from fsdp_optim.sharding.contract import BlockKind
from fsdp_optim.sharding import elements, expert, heads, rows, whole

SHAPES = [(7,), (5, 3), (4, 6), (1, 9), (3, 2, 5), (2, 3, 4)]


def _brute_boundaries(spec, shape):
    """Block starts computed by walking element indices (independent of BlockSpec's arithmetic)."""
    numel = math.prod(shape)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    if spec.kind is BlockKind.ELEMENTS:
        return sorted({i for i in range(numel) if i % spec.size == 0} | {numel})
    if spec.kind is BlockKind.ROWS:
        return sorted({i for i in range(numel) if (i // row) % spec.size == 0 and i % row == 0} | {numel})
    if spec.kind is BlockKind.EXPERT:
        return sorted({i for i in range(numel) if i % (shape[1] * shape[2]) == 0} | {numel})
    if spec.row_splits is None:
        return [0, numel]
    cuts, r = [0], 0
    for s in spec.row_splits:
        r += s
        cuts.append(r * row)
    return cuts


def _specs_for(shape):
    out = [elements(1), elements(2), elements(4), rows(1), rows(2), rows(3), whole()]
    if len(shape) == 3:
        out.append(expert())
    if len(shape) == 2 and shape[0] >= 2:
        out.append(whole(row_splits=[1, shape[0] - 1]))
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_boundaries_match_brute_force(shape):
    numel = math.prod(shape)
    for spec in _specs_for(shape):
        spec.check(shape)
        want = _brute_boundaries(spec, shape)
        assert spec.block_starts(shape) == want, spec
        assert spec.num_blocks(shape) == len(want) - 1
        for off in range(numel + 1):
            assert spec.is_boundary(shape, off) == (off in want), (spec, off)
            assert spec.align_down(shape, off) == max(b for b in want if b <= off)
            assert spec.align_up(shape, off) == min(b for b in want if b >= off)


def test_matrices():
    assert whole().matrices((4, 6)) == [(0, 4, 6)]
    assert whole(row_splits=[1, 3]).matrices((4, 6)) == [(0, 1, 6), (6, 3, 6)]
    assert expert().matrices((3, 2, 5)) == [(0, 2, 5), (10, 2, 5), (20, 2, 5)]
    assert elements(4).matrices((4, 6)) == []
    assert heads(6, 2) == whole(row_splits=[2, 2, 2])
    assert whole().split_unit((4, 6)) == 6
    assert expert().split_unit((3, 2, 5)) == 5


def test_bad_specs_name_the_problem():
    with pytest.raises(ValueError, match="size must be >= 1"):
        elements(0)
    with pytest.raises(ValueError, match="3-D"):
        expert().check((4, 5), "layer.w")
    with pytest.raises(ValueError, match="layer.qkv.*sum to 5.*6 rows"):
        whole(row_splits=[2, 3]).check((6, 4), "layer.qkv")
    with pytest.raises(ValueError, match="head_dim 4"):
        heads(6, 4)
