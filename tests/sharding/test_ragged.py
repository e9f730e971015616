"""RaggedLayout: every block-aligned split of small shapes round-trips bitwise; DTensor interop."""

import math

import pytest
import torch
import torch.distributed as dist

from fsdp_optim._testing import run_distributed
from fsdp_optim.sharding.plan import RaggedLayout, block_aligned_splits, chunk_bounds
from fsdp_optim.sharding import elements, expert, RaggedShard, distribute_ragged, rows, whole

CASES = [
    ((7,), elements(1)),
    ((7,), elements(3)),
    ((5, 3), rows(2)),
    ((5, 3), elements(4)),
    ((4, 6), whole()),
    ((4, 6), whole(row_splits=[1, 3])),
    ((3, 2, 2), expert()),
    ((0, 3), rows(1)),
]


@pytest.mark.parametrize("shape,spec", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_every_block_aligned_split_round_trips(shape, spec, world_size):
    full = torch.randn(shape)
    starts = set(spec.block_starts(shape))
    num = 0
    for layout in block_aligned_splits(shape, spec, world_size):
        num += 1
        assert layout.world_size == world_size
        assert layout.is_aligned(spec)
        layout.check(spec, "p")
        # contiguous, in rank order, covering every element exactly once, cuts on block starts
        assert all(b in starts or b == layout.numel for b in layout.bounds)
        pieces = [layout.shard(full, r) for r in range(world_size)]
        assert sum(p.numel() for p in pieces) == full.numel()
        back = layout.unshard([p.clone() for p in pieces])
        assert torch.equal(back, full)
        owned = sorted(i for r in range(world_size) for i in range(*layout.range(r)))
        assert owned == list(range(full.numel()))
    # W > number of blocks and empty ranks are part of the sweep
    nblocks = spec.num_blocks(shape)
    assert num == math.comb(nblocks + world_size - 1, world_size - 1) if nblocks else num == 1


def test_misaligned_layout_is_rejected_with_names():
    layout = RaggedLayout((4, 6), (0, 9, 24))
    with pytest.raises(ValueError, match=r"layer.w .*ranks 0 and 1.*element 9.*rows\(1\)"):
        layout.check(rows(1), "layer.w")
    with pytest.raises(ValueError, match="must rise"):
        RaggedLayout((4,), (0, 3, 2, 4))
    with pytest.raises(ValueError, match="pieces"):
        RaggedLayout((4,), (0, 2, 4)).unshard([torch.zeros(4)])


def test_chunk_bounds_matches_torch_chunk():
    for n in range(0, 12):
        for w in range(1, 6):
            sizes = [c.numel() for c in torch.arange(n).chunk(w)] if n else []
            sizes += [0] * (w - len(sizes))
            b = chunk_bounds(n, w)
            assert [b[i + 1] - b[i] for i in range(w)] == sizes


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_dtensor_round_trip_through_torch_row_sharding(world_size):
    """Every block-aligned layout (rows cut or not) -> torch's Shard(0) (torch.chunk rows) -> back, bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    shape = (7, 3)
    layouts = list(block_aligned_splits(shape, elements(2), world_size))[:: max(1, 3 * world_size)]

    def fn():
        mesh = init_device_mesh("cpu", (world_size,))
        full = torch.arange(21, dtype=torch.float32).reshape(shape)
        for layout in layouts:
            x = distribute_ragged(full, mesh, [RaggedShard(layout)])
            dt = x.redistribute(placements=[Shard(0)])
            assert torch.equal(dt.full_tensor(), full)
            assert torch.equal(distribute_ragged(dt, mesh, [RaggedShard(layout)]).to_local(), x.to_local())
        return len(layouts)

    assert all(run_distributed(fn, world_size=world_size))
