"""RaggedDTensor and the RaggedShard placement (sharding/_dtensor.py, _dtensor_ops.py, _placement.py):
every supported op equals the unsharded op on every rank of uneven layouts (empty pieces, cuts inside
rows), every other op raises naming the way out, a stock torch DTensor holding the placement refuses to
compute, and redistribution, DCP chunks, autograd and pickling keep the layout's meaning."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsdp_optim._testing import emulated_mesh, run_distributed
from fsdp_optim.sharding import RaggedDTensor, RaggedShard, distribute_ragged, elements, whole
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding._dtensor import RaggedPiece

SHAPE = (5, 7)
# per world size: a layout with an empty piece and cuts inside rows
BOUNDS = {1: (0, 35), 2: (0, 3, 35), 3: (0, 0, 20, 35), 4: (0, 9, 9, 30, 35)}


def _layout(w: int) -> RaggedShard:
    return RaggedShard(RaggedLayout(SHAPE, BOUNDS[w]), elements(1))


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g), torch.rand(SHAPE, generator=g) + 0.5


# ---- supported ops: equal to the unsharded op ---------------------------------------------
ELEMENTWISE = {
    "add scalar": lambda a, b, c: a + 2.5,
    "add tensor": lambda a, b, c: a + b,
    "sub alpha": lambda a, b, c: torch.sub(a, b, alpha=0.3),
    "mul 0-dim tensor": lambda a, b, c: a * torch.tensor(1.7),
    "div": lambda a, b, c: a / c,
    "pow": lambda a, b, c: c**1.5,
    "sqrt": lambda a, b, c: c.sqrt(),
    "abs neg sign": lambda a, b, c: (-a).abs() * a.sign(),
    "exp": lambda a, b, c: a.exp(),
    "clamp": lambda a, b, c: a.clamp(-0.3, 0.4),
    "maximum": lambda a, b, c: torch.maximum(a, b),
    "where": lambda a, b, c: torch.where(a > b, a, c),
    "isfinite": lambda a, b, c: torch.isfinite(a / (b - b)),
    "lerp_": lambda a, b, c: a.clone().lerp_(b, 0.1),
    "addcdiv_": lambda a, b, c: a.clone().addcdiv_(b, c, value=-0.01),
    "addcmul_": lambda a, b, c: a.clone().addcmul_(b, b, value=0.001),
    "mul_ add_ chain": lambda a, b, c: a.clone().mul_(0.9).add_(b, alpha=0.1),
    "copy_": lambda a, b, c: a.clone().copy_(b),
    "zero_": lambda a, b, c: a.clone().zero_(),
    "fill_": lambda a, b, c: a.clone().fill_(3.0),
    "to bf16": lambda a, b, c: a.to(torch.bfloat16),
    "zeros_like": lambda a, b, c: torch.zeros_like(a) + 1,
    "full_like": lambda a, b, c: torch.full_like(a, 7.0),
    "detach clone": lambda a, b, c: a.detach().clone(),
    "nan_to_num": lambda a, b, c: torch.nan_to_num(a / (b - b), posinf=1.0, neginf=-1.0),
}
ULP = {"pow"}
FOREACH = {
    "_foreach_add_": lambda xs, ys: torch._foreach_add_(xs, ys, alpha=0.5),
    "_foreach_mul_ scalar": lambda xs, ys: torch._foreach_mul_(xs, 0.5),
    "_foreach_mul_ 0-dim tensor": lambda xs, ys: torch._foreach_mul_(xs, torch.tensor(0.25)),
    "_foreach_lerp_": lambda xs, ys: torch._foreach_lerp_(xs, ys, 0.2),
    "_foreach_addcdiv_ scalar list": lambda xs, ys: torch._foreach_addcdiv_(xs, ys, ys, [0.1, 0.2]),
    "_foreach_copy_": lambda xs, ys: torch._foreach_copy_(xs, ys),
    "_foreach_zero_": lambda xs, ys: torch._foreach_zero_(xs),
    "_foreach_sqrt": lambda xs, ys: torch._foreach_sqrt(torch._foreach_abs(xs)),
}
REDUCTIONS = {  # exact where the order of additions cannot matter
    "sum": (lambda a: a.sum(), 1e-6),
    "mean": (lambda a: a.mean(), 1e-6),
    "max": (lambda a: a.max(), 0.0),
    "min": (lambda a: a.min(), 0.0),
    "amax": (lambda a: a.amax(), 0.0),
    "vector_norm 2": (lambda a: torch.linalg.vector_norm(a), 1e-6),
    "vector_norm 1": (lambda a: torch.linalg.vector_norm(a, 1), 1e-6),
    "vector_norm inf": (lambda a: torch.linalg.vector_norm(a, math.inf), 0.0),
    "vector_norm 3 fp64": (lambda a: torch.linalg.vector_norm(a, 3, dtype=torch.float64), 1e-12),
    "norm": (lambda a: a.norm(), 1e-6),
}


def _ragged(full: torch.Tensor, mesh, rs: RaggedShard) -> RaggedDTensor:
    return distribute_ragged(full, mesh, [rs])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_supported_ops_equal_the_unsharded_op(world_size):
    def fn():
        mesh = init_device_mesh("cpu", (world_size,))
        rs = _layout(world_size)
        a, b, c = _data()
        out = {}
        for name, op in ELEMENTWISE.items():
            got = op(*(_ragged(t, mesh, rs) for t in (a, b, c)))
            assert isinstance(got, RaggedDTensor) and got.placements == (rs,), name
            g, w = got.full_tensor(), op(a, b, c)
            # (ATen's CPU kernels may round a vector body and a scalar tail apart: pow by an ulp)
            out[name] = torch.equal(g, w) if name not in ULP else torch.allclose(g, w, rtol=2.5e-7, atol=0)
        for name, op in FOREACH.items():
            xs, ys = [_ragged(a, mesh, rs), _ragged(c, mesh, rs)], [_ragged(b, mesh, rs), _ragged(c, mesh, rs)]
            ref_x, ref_y = [a.clone(), c.clone()], [b.clone(), c.clone()]
            got, want = op(xs, ys), op(ref_x, ref_y)
            if got is None:
                got, want = xs, ref_x
            out[name] = all(torch.equal(g.full_tensor(), w) for g, w in zip(got, want))
        for name, (op, tol) in REDUCTIONS.items():
            got = op(_ragged(a, mesh, rs))
            assert isinstance(got, DTensor) and not isinstance(got, RaggedDTensor)
            assert world_size == 1 or any(isinstance(p, Partial) for p in got.placements), (name, got.placements)
            full, want = got.full_tensor(), op(a)
            out[name] = abs(full.item() - want.item()) <= tol * max(1.0, abs(want.item()))
        norms = torch._foreach_norm([_ragged(a, mesh, rs), _ragged(b, mesh, rs)], 2.0)
        out["_foreach_norm"] = torch.allclose(torch.stack([n.full_tensor() for n in norms]), torch.stack([a.norm(), b.norm()]))
        x = _ragged(a, mesh, rs)
        y = _ragged(a, mesh, rs)
        if dist.get_rank() == world_size - 1:  # one rank's piece differs: every rank must say so
            y.to_local().add_(1.0)
        out["equal"] = (torch.equal(x, x + 0), torch.equal(x, y), torch.allclose(x, x * (1 + 1e-9))) == (True, False, True)
        out["all/any"] = (bool(torch.isfinite(x).all().full_tensor()), bool((x > 100).any().full_tensor())) == (True, False)
        return out

    for rank_out in run_distributed(fn, world_size=world_size):
        assert all(rank_out.values()), {k: v for k, v in rank_out.items() if not v}


def test_an_empty_piece_contributes_the_identity_of_max_and_inf_norms():
    def fn():
        mesh = init_device_mesh("cpu", (3,))
        full = -torch.rand(SHAPE) - 1  # all negative: a 0 from an empty piece would win max()
        x = _ragged(full, mesh, _layout(3))  # rank 0's piece is empty
        return (
            x.max().full_tensor().item() == full.max().item(),
            x.min().full_tensor().item() == full.min().item(),
            torch.linalg.vector_norm(x, math.inf).full_tensor().item() == full.abs().max().item(),
        )

    assert all(all(r) for r in run_distributed(fn, world_size=3))


# ---- everything else raises, naming the way out -----------------------------------------
UNSUPPORTED = {
    "view": lambda x: x.view(35),
    "reshape": lambda x: x.reshape(7, 5),
    "t": lambda x: x.t(),
    "transpose": lambda x: x.transpose(0, 1),
    "getitem": lambda x: x[1],
    "matmul": lambda x: x @ torch.ones(7, 2),
    "mm ragged": lambda x: torch.mm(x, x.t()),
    "sum over a dim": lambda x: x.sum(dim=0),
    "norm over a dim": lambda x: torch.linalg.vector_norm(x, dim=1),
    "max over a dim": lambda x: x.max(dim=0),
    "cumsum": lambda x: x.cumsum(0),
    "softmax": lambda x: x.softmax(-1),
    "cat": lambda x: torch.cat([x, x]),
    "stack": lambda x: torch.stack([x, x]),
    "sort": lambda x: x.sort(),
    "index_select": lambda x: x.index_select(0, torch.tensor([0])),
    "plain non-scalar operand": lambda x: x + torch.ones(SHAPE),
    "out=": lambda x: torch.add(x, 1.0, out=x),
    "randn_like": lambda x: torch.randn_like(x),
    "copy into a plain tensor": lambda x: torch.zeros(SHAPE).copy_(x),
}


@pytest.mark.parametrize("world_size", [2])
def test_every_other_op_raises_naming_the_op_and_the_way_out(world_size):
    def fn():
        mesh = init_device_mesh("cpu", (world_size,))
        x = _ragged(torch.randn(SHAPE), mesh, _layout(world_size))
        msgs = {}
        for name, op in UNSUPPORTED.items():
            try:
                op(x)
                msgs[name] = None
            except NotImplementedError as e:
                msgs[name] = str(e)
        other = _ragged(torch.randn(SHAPE), mesh, RaggedShard(RaggedLayout(SHAPE, (0, 7, 35))))
        try:
            x + other
            msgs["two layouts"] = None
        except NotImplementedError as e:
            msgs["two layouts"] = str(e)
        return msgs

    msgs = run_distributed(fn, world_size=world_size)[0]
    print()
    for name, msg in msgs.items():
        assert msg is not None, f"{name} did not raise"
        assert "not supported on a RaggedDTensor" in msg and "full_tensor()" in msg and "to_local()" in msg, (name, msg)
        print(f"  {name}: {msg.split(' is not supported')[0]} ... raises")
    assert "laid out differently" in msgs["two layouts"]
    assert "plain tensor of shape (5, 7)" in msgs["plain non-scalar operand"]


def test_a_replicated_dtensor_of_the_global_shape_is_sliced_and_a_partial_scalar_reduced():
    def fn():
        mesh = init_device_mesh("cpu", (2,))
        a, b, _ = _data()
        x = _ragged(a, mesh, _layout(2))
        rep = DTensor.from_local(b, mesh, [Replicate()])
        total = x.sum()  # Partial: reduced before it scales anything
        y = x + rep
        z = x * total
        return torch.equal(y.full_tensor(), a + b), torch.allclose(z.full_tensor(), a * a.sum())

    assert all(all(r) for r in run_distributed(fn, world_size=2))


def test_a_stock_dtensor_holding_the_placement_refuses_to_compute():
    """torch's propagation does not know RaggedShard: a plain DTensor with it (DTensor.from_local) would
    compute x * 2 as if its piece were replicated; every such op raises instead."""

    def fn():
        mesh = init_device_mesh("cpu", (2,))
        rs = _layout(2)
        local = torch.randn(rs.range(dist.get_rank())[1] - rs.range(dist.get_rank())[0])
        stock = DTensor.from_local(local, mesh, [rs], run_check=False, shape=torch.Size(SHAPE), stride=(7, 1))
        assert type(stock) is DTensor
        out = {}
        for name, op in {
            "mul": lambda t: t * 2,
            "sum": lambda t: t.sum(),
            "add": lambda t: t + t,
            "full_tensor": lambda t: t.full_tensor(),
            "redistribute": lambda t: t.redistribute(mesh, [Replicate()]),
        }.items():
            try:
                op(stock)
                out[name] = None
            except (NotImplementedError, RuntimeError) as e:  # ours, or torch's strategy refusing the type
                out[name] = f"{type(e).__name__}: {e}"
        return out

    out = run_distributed(fn, world_size=2)[0]
    print()
    for name, msg in out.items():
        assert msg is not None, f"a stock DTensor with RaggedShard computed {name}"
        print(f"  stock DTensor {name}: {msg[:100]}")
    # the silent case of the issue (x * 2 -> Replicate holding one piece) raises with the way out
    assert "torch's DTensor operators do not know the RaggedShard placement" in out["mul"] and "distribute_ragged" in out["mul"]


# ---- redistribution, DCP, autograd, pickling --------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_redistribute_to_and_from_torch_placements(world_size):
    def fn():
        mesh = init_device_mesh("cpu", (world_size,))
        full = torch.arange(35, dtype=torch.float32).reshape(SHAPE)
        x = _ragged(full, mesh, _layout(world_size))
        rows = x.redistribute(placements=[Shard(0)])
        ref_rows = DTensor.from_local(full.chunk(world_size)[dist.get_rank()] if dist.get_rank() < len(full.chunk(world_size)) else full[:0], mesh, [Shard(0)], shape=torch.Size(SHAPE), stride=(7, 1), run_check=False)
        rep = x.redistribute(placements=[Replicate()])
        other = RaggedShard(RaggedLayout(SHAPE, tuple(reversed([35 - b for b in BOUNDS[world_size]]))))
        moved = x.redistribute(placements=[other])
        back = distribute_ragged(rows, mesh, [_layout(world_size)])
        from_rep = distribute_ragged(rep, mesh, [other])
        return (
            type(rows) is DTensor and torch.equal(rows.to_local(), ref_rows.to_local()),
            torch.equal(rows.full_tensor(), full),
            torch.equal(rep.to_local(), full),
            isinstance(moved, RaggedDTensor) and torch.equal(moved.full_tensor(), full),
            torch.equal(back.to_local(), x.to_local()),
            torch.equal(from_rep.to_local(), moved.to_local()),
        )

    for r in run_distributed(fn, world_size=world_size):
        assert all(r), r


@pytest.mark.parametrize("save_w,load_w", [(2, 3), (3, 2), (4, 1)])
def test_dcp_saves_n_d_chunks_and_loads_into_another_layout(tmp_path, save_w, load_w):
    import torch.distributed.checkpoint as dcp

    full = torch.randn(SHAPE)
    path = str(tmp_path / "ckpt")

    def save():
        mesh = init_device_mesh("cpu", (save_w,))
        dcp.save({"w": _ragged(full, mesh, _layout(save_w)), "b": torch.ones(3)}, checkpoint_id=path)

    def load():
        mesh = init_device_mesh("cpu", (load_w,))
        rs = RaggedShard(RaggedLayout(SHAPE, tuple(reversed([35 - b for b in BOUNDS[load_w]]))), whole())
        x = _ragged(torch.zeros(SHAPE), mesh, rs)
        local = x.to_local()
        dcp.load({"w": x}, checkpoint_id=path)
        return torch.equal(x.full_tensor(), full) and x.to_local().data_ptr() == local.data_ptr()  # in place

    run_distributed(save, world_size=save_w)
    assert all(run_distributed(load, world_size=load_w))
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata["w"]
    assert tuple(md.size) == SHAPE  # the global N-D tensor, as FSDP2 writes it
    covered = sum(math.prod(c.sizes) for c in md.chunks)
    assert covered == 35


def test_autograd_through_to_local_and_full_tensor():
    def fn():
        mesh = init_device_mesh("cpu", (2,))
        full = torch.randn(SHAPE)
        p = torch.nn.Parameter(_ragged(full, mesh, _layout(2)))
        (p.to_local() ** 2).sum().backward()
        g1 = p.grad
        p.grad = None
        (p.full_tensor() * 3).sum().backward()
        a, b = p.local_range
        return (
            isinstance(g1, RaggedDTensor) and g1.placements == p.placements,
            torch.equal(g1.full_tensor(), 2 * full),
            torch.equal(p.grad.to_local(), torch.full((b - a,), 3.0)),
        )

    for r in run_distributed(fn, world_size=2):
        assert all(r), r


def test_pickled_pieces_load_with_weights_only_and_name_their_range():
    def fn():
        mesh = init_device_mesh("cpu", (2,))
        p = _ragged(torch.arange(35.0).reshape(SHAPE), mesh, _layout(2))
        buf = io.BytesIO()
        torch.save({"w": p}, buf)
        buf.seek(0)
        piece = torch.load(buf, weights_only=True)["w"]
        return isinstance(piece, RaggedPiece), piece.local_range == p.local_range, "full_state_dict" in repr(piece)

    for r in run_distributed(fn, world_size=2):
        assert all(r), r


def test_emulated_mesh_stands_at_each_coordinate_without_a_process_group():
    """The test harness's emulation (fsdp_optim._testing.emulated_mesh) relies on DeviceMesh's _rank."""
    assert not dist.is_initialized()
    for r in range(3):
        mesh = emulated_mesh(3, r)
        x = distribute_ragged(torch.arange(35.0).reshape(SHAPE), mesh, [_layout(3)])
        assert x.shard_rank == r and x.local_range == _layout(3).range(r)
        assert torch.equal((x * 2).to_local(), 2 * torch.arange(35.0)[slice(*_layout(3).range(r))])


def test_placement_equality_hash_and_repr():
    a = RaggedShard(RaggedLayout(SHAPE, (0, 3, 35)), whole())
    assert a == RaggedShard(RaggedLayout(SHAPE, (0, 3, 35)), whole()) and hash(a) == hash(RaggedShard(RaggedLayout(SHAPE, (0, 3, 35)), whole()))
    assert a != RaggedShard(RaggedLayout(SHAPE, (0, 3, 35)), elements(1)) and a.same_layout(RaggedShard(RaggedLayout(SHAPE, (0, 3, 35))))
    assert a != Shard(0) and "bounds=[0, 3, 35]" in repr(a)
    big = RaggedShard(RaggedLayout((1000,), tuple(range(0, 1001, 10))))
    assert "(100 ranks)" in repr(big)
    with pytest.raises(NotImplementedError, match="distribute_ragged"):
        a.is_shard()
    with pytest.raises(TypeError, match="RaggedLayout"):
        RaggedShard((0, 3, 35))
