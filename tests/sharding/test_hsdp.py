"""HSDP: ``fully_shard`` over a 2-D ``(replicate, shard)`` mesh.

Parity follows tests/sharding/test_fully_shard.py (its model, batches, helpers and tolerances): the
same TinyTransformer trained in one process on the global batch is the reference.

- AdamW (``torch.optim.AdamW``), each rank of the W = R * S ranks on its slice of the global batch:
  the test_fully_shard tolerances (loss rtol 1e-5; parameters max abs diff <= lr/10, >= 99.5% of the
  elements within 1e-5). Measured: loss rel. diff <= 4.8e-7, max abs diff <= 1.7e-4.
- ``fsdp_optim.optimizers.Muon``: its Newton–Schulz runs in bf16 (as ``torch.optim.Muon``), so the
  last-bit differences of a different summation order flip bf16 roundings and grow over steps
  (measured with per-rank slices: max abs diff 0.011-0.032 after 5 steps at lr 0.02 on 2x2, 1x3 and
  3x1; 1x3 is plain FSDP over 3 ranks, so this is Muon's, not HSDP's). So every rank sees the whole
  global batch (as in test_muon's fully_shard test): the mean over W equal per-rank gradients is
  then exactly the single-process gradient when the mean's divisions are exact, which they are on
  the 2x2 mesh (two halvings): asserted bitwise. On
  W = 3 (1x3, 3x1) ``(g + g + g) / 3`` may round, so there: 3x1 (all-reduce across replicas) equals 1x3
  (reduce-scatter in the shard group) bitwise, and both stay within the bf16 Muon tolerance of the
  reference (loss rtol 1e-4, measured 9.1e-6; parameters max abs diff <= 2 lr = 0.04, measured 0.011).
  On the 2x2 mesh Muon also runs with per-MLP buckets on an even layout without padding, which splits
  each ``w1`` across the shard group (Muon's one exchange per bucket, in ``ShardInfo.group``): bitwise
  too.
- Muon against a reference nobody here wrote: ``torch.optim.Muon`` (hidden matrices) +
  ``torch.optim.AdamW`` (the rest) in one process on the global batch, each rank on its slice, on 3x1,
  1x3, 2x2 and 2x2 with split matrices: one step's parameters (tolerance from the bf16 Newton–Schulz,
  see test_hsdp_muon_one_step_matches_torch_muon_and_adamw) and two steps' losses.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon, adamw_rule, muon_rule
from torch.distributed.tensor import Replicate

from fsdp_optim.sharding import PlanConfig, RaggedShard
from fsdp_optim.sharding.contract import local_shard, local_tensor
from fsdp_optim.sharding._fully_shard import _STATE
from tests._models import assert_close_after_adamw
from tests.sharding.checkpoint.test_checkpoint import assert_same
from tests.sharding.test_fully_shard import (
    LR,
    _accum_batch,
    _assert_close_params,
    _batches,
    _expected_ops,
    _full_grads,
    _local,
    _loss,
    _mean_over_ranks,
    _new_model,
    _reference,
    _reference_grads,
)

MUON_LR = 2e-2
MESHES = [(2, 2), (1, 3), (3, 1)]


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _shard(model, rule, mesh, *, layout="auto", mlp_buckets=False, **config):
    for layer in model.layers:
        fsdp_optim.fully_shard(layer.mlp if mlp_buckets else layer, mesh=mesh, blocks=rule)
    fsdp_optim.fully_shard(model, mesh=mesh, blocks=rule, plan_config=PlanConfig(layout=layout, **config))
    return model


def _muon(params):
    return Muon(params, lr=MUON_LR, adamw_lr=LR, weight_decay=0.1)


def _train(model, opt, *, whole_batch: bool, mesh_size: int):
    """Five steps, ``zero_grad(set_to_none=...)`` alternating; each rank on its slice of the global
    batch (by global rank) or on the whole batch."""
    r = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step, (x, y) in enumerate(_batches()):
        if not whole_batch:
            x, y = _local(x, mesh_size, r), _local(y, mesh_size, r)
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        losses.append(_mean_over_ranks(loss) if dist.is_initialized() else loss.item())
    return losses


@functools.cache
def _muon_reference():
    """One rank: fully_shard + Muon on the global batch."""

    def fn():
        model = _shard(_new_model(), muon_rule(), None, layout="ragged")
        losses = _train(model, _muon(model.parameters()), whole_batch=True, mesh_size=1)
        return losses, fsdp_optim.full_state_dict(model)

    return run_distributed(fn, world_size=1)[0]


# ---------------------------------------------------------------------------------------------
# Training parity
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_hsdp_training_parity(shape):
    ref_losses, ref_state = _reference()
    muon_losses, muon_state = _muon_reference()
    world_size = shape[0] * shape[1]

    def fn():
        mesh = _mesh(shape)
        out = {}
        configs = [
            ("adamw", adamw_rule, "auto", lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1), False),
            ("muon", muon_rule(), "ragged", _muon, True),
        ]
        if shape == (2, 2):  # MLP buckets on an even layout without padding split w1 over the shard group
            configs.append(("muon_split", muon_rule(), "even", _muon, True))
        for name, rule, layout, make, whole_batch in configs:
            cfg = {"padding_cap": 0.0, "mlp_buckets": True} if name == "muon_split" else {}
            model = _shard(_new_model(), rule, mesh, layout=layout, **cfg)
            plan = fsdp_optim.sharded_plan(model)
            assert plan.world_size == shape[1]  # planned over the shard axis only
            if name == "muon_split":
                assert any(pl.split for b in plan.buckets for pl in b.placements)
            for p in model.parameters():
                info = local_shard(p)
                assert info.group is (mesh.get_group("shard") if shape[1] > 1 else None)
                assert info.rank == mesh.get_local_rank("shard")
                assert p.device_mesh is mesh and isinstance(p.placements[0], Replicate)
                assert isinstance(p.placements[1], RaggedShard)
            losses = _train(model, make(model.parameters()), whole_batch=whole_batch, mesh_size=world_size)
            out[name] = losses, fsdp_optim.full_state_dict(model), [b.rank_bounds for b in plan.buckets]
        return out

    out = run_distributed(fn, world_size=world_size, timeout=240)
    for name in out[0]:
        for o in out[1:]:  # every rank (every replica) ends with the same model and the same layout
            assert o[name][0] == out[0][name][0] and o[name][2] == out[0][name][2]
            for k, v in out[0][name][1].items():
                assert torch.equal(o[name][1][k], v), (name, k)
    losses, state, _ = out[0]["adamw"]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _assert_close_params(state, ref_state, world_size=world_size)
    losses, state, _ = out[0]["muon"]
    if world_size == 4:
        assert losses == muon_losses
        _assert_close_params(state, muon_state, world_size=1)  # bitwise
        losses, state, _ = out[0]["muon_split"]
        assert losses == muon_losses
        _assert_close_params(state, muon_state, world_size=1)  # bitwise, split matrices too
    else:
        assert losses == pytest.approx(muon_losses, rel=1e-4)
        for k, v in muon_state.items():
            assert (state[k] - v).abs().max().item() <= 2 * MUON_LR, k
        _W3_MUON[shape] = state


_W3_MUON: dict = {}


def test_hsdp_3x1_equals_1x3_for_muon_bitwise():
    """Every replica's all-reduce of equal gradients (3x1) and the shard group's reduce-scatter (1x3)
    give the same bits, so the only gap to the reference on W = 3 is the mean's rounding."""
    for shape in ((1, 3), (3, 1)):
        if shape not in _W3_MUON:
            test_hsdp_training_parity(shape)
    a, b = _W3_MUON[(1, 3)], _W3_MUON[(3, 1)]
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------
# Collective counts, gradient accumulation without sync, clip_grad_norm_ on the 2x2 mesh
# ---------------------------------------------------------------------------------------------
def test_hsdp_collectives_accumulation_and_clipping_2x2():
    """Per step and bucket: one all-gather in the shard group in forward (and one in backward for
    non-root buckets), one reduce-scatter in it, one all-reduce across the replicas (on the
    1/shard-size segment; none where this rank's segment is empty); nothing in the optimizer step.
    Gradient accumulation without sync reduces nothing until the synced micro-batch; the result
    equals one big batch. clip_grad_norm_ all-reduces once, in the shard group, and matches the
    single-process norm."""
    ref_grads = _reference_grads()
    xa, ya = _accum_batch()
    max_norm = 0.5
    ref_model = _new_model()
    _loss(ref_model, *_batches(1)[0]).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm).item()
    ref_clipped = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}

    def fn():
        w, r = dist.get_world_size(), dist.get_rank()
        mesh = _mesh((2, 2))
        shard_group, rep_group = mesh.get_group("shard"), mesh.get_group("replicate")
        all_reduces: list = []
        orig_all_reduce = dist.all_reduce

        def recording_all_reduce(t, *a, group=None, **k):
            all_reduces.append((group, t.numel(), t.dtype))
            return orig_all_reduce(t, *a, group=group, **k)

        dist.all_reduce = recording_all_reduce
        try:
            out = {}
            for name, rule, layout in (("adamw", adamw_rule, "even"), ("muon", muon_rule(), "ragged")):
                model = _shard(_new_model(), rule, mesh, layout=layout)
                plan = fsdp_optim.sharded_plan(model)
                buckets = [getattr(m, _STATE).bucket for m in model.modules() if getattr(m, _STATE, None)]
                buckets = [b for b in buckets if b is not None]
                assert all(b.buffer.group is shard_group for b in buckets)
                names = [b.name for b in plan.buckets]
                bwd_gathers = [n for n in names if n != "<root>"]
                reducing = [b for b in buckets if b.num_trainable and b.buffer.segment_numel]
                want_fwd = _expected_ops(plan, gather_buckets=names, reduce_buckets=[])
                want_bwd = _expected_ops(plan, gather_buckets=bwd_gathers, reduce_buckets=names)
                if reducing:
                    want_bwd["c10d.allreduce_"] = want_bwd.get("c10d.allreduce_", 0) + len(reducing)
                # the end-of-backward agreement on which parameters got a gradient, over the shard
                # group and then the replicas ([Note: unused parameters]): int32 flags
                want_bwd["c10d.allreduce_"] = want_bwd.get("c10d.allreduce_", 0) + 2
                want_ar = sorted(b.buffer.segment_numel for b in reducing)
                opt = torch.optim.AdamW(model.parameters(), lr=LR) if name == "adamw" else _muon(model.parameters())
                for x, y in _batches(3):  # the first step learns the order; later ones prefetch
                    with CommDebugMode() as fwd:
                        loss = _loss(model, _local(x, w, r), _local(y, w, r))
                    assert {str(k): v for k, v in fwd.get_comm_counts().items()} == want_fwd
                    all_reduces.clear()
                    with CommDebugMode() as bwd:
                        loss.backward()
                    assert {str(k): v for k, v in bwd.get_comm_counts().items()} == want_bwd
                    # across replicas, on the segment; over the shard group only the even buckets'
                    # reductions on gloo ([Note: even reduce-scatter on gloo])
                    flags = [g for g, _, dt in all_reduces if dt == torch.int32]
                    assert flags == [shard_group, rep_group]
                    grads = [(g, n) for g, n, dt in all_reduces if dt != torch.int32]
                    replica = [n for g, n in grads if g is rep_group]
                    assert all(g is rep_group or g is shard_group for g, _ in grads)
                    assert sorted(replica) == want_ar
                    assert len(grads) - len(replica) == want_bwd["c10d.allreduce_"] - len(reducing) - 2
                    with CommDebugMode() as step:
                        opt.step()
                        opt.zero_grad()
                    assert step.get_total_counts() == 0
                out[name] = len(reducing), len(buckets)

            # Gradient accumulation without sync: 3 micro-batches of 2 sequences per rank.
            model = _shard(_new_model(), muon_rule(), mesh, layout="ragged")
            k = 3
            xs, ys = _local(xa, w, r).chunk(k), _local(ya, w, r).chunk(k)
            counts = []
            for i in range(k):
                model.set_requires_gradient_sync(i == k - 1)
                with CommDebugMode() as mode:
                    (_loss(model, xs[i], ys[i]) / k).backward()
                counts.append({str(op): n for op, n in mode.get_comm_counts().items() if "reduce" in str(op)})
            out["accum"] = counts, _full_grads(model)

            # clip_grad_norm_: one all-reduce, over the shard group.
            model = _shard(_new_model(), muon_rule(), mesh, layout="ragged")
            x, y = _batches(1)[0]
            _loss(model, _local(x, w, r), _local(y, w, r)).backward()
            all_reduces.clear()
            with CommDebugMode() as mode:
                norm = fsdp_optim.clip_grad_norm_(model.parameters(), max_norm)
            assert all_reduces == []  # (not dist.all_reduce: the norm's Partial, reduced by DTensor over the shard dim)
            out["clip"] = norm.item(), _full_grads(model), {str(k): v for k, v in mode.get_comm_counts().items()}
            return out
        finally:
            dist.all_reduce = orig_all_reduce

    for rank_out in run_distributed(fn, world_size=4, timeout=240):
        assert rank_out["adamw"][0] == rank_out["adamw"][1] == 3  # even: every bucket all-reduces
        assert rank_out["muon"][0] >= 1
        counts, grads = rank_out["accum"]
        assert counts[0] == counts[1] == {}  # no reduce-scatter, no all-reduce while accumulating
        assert set(counts[2]) <= {"c10d._reduce_scatter_base_", "c10d.reduce_scatter_", "c10d.allreduce_"}
        assert sum(v for op, v in counts[2].items() if "reduce_scatter" in op) == 3
        assert set(grads) == set(ref_grads)
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7)
        norm, clipped, clip_counts = rank_out["clip"]
        assert norm == pytest.approx(ref_norm, rel=1e-5) and clip_counts == {"c10d_functional.all_reduce": 1}
        for n, g in ref_clipped.items():
            torch.testing.assert_close(clipped[n], g, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Checkpoints: one copy, loadable on any (replicate, shard) shape, from and to pure FSDP
# ---------------------------------------------------------------------------------------------
CKPT_OPTIMIZERS = {
    "torch_adamw": (adamw_rule, "auto", lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1)),
    "muon": (muon_rule(), "ragged", _muon),
}


def _full_state(model, opt, group):
    """Full parameters and optimizer state (global flat vectors), gathered within ``group`` (the
    shard group: each replica holds a whole copy)."""
    info_of = {n: local_shard(p) for n, p in model.named_parameters()}
    pieces, scalars = {}, {}
    for name, p in model.named_parameters():
        info = info_of[name]
        pieces[name] = (p.to_local().clone(), info.start, info.numel)
        shards = opt.state_shards(p) if hasattr(opt, "state_shards") else None
        for k, v in opt.state[p].items():
            if shards is not None and k in shards:
                pieces[f"{name}.{k}"] = (v.detach().reshape(-1).clone(), shards[k].start, shards[k].global_numel)
            elif shards is None and torch.is_tensor(v) and v.ndim > 0:
                pieces[f"{name}.{k}"] = (local_tensor(v).detach().reshape(-1).clone(), info.start, info.numel)
            else:
                scalars[f"{name}.{k}"] = v.clone() if torch.is_tensor(v) else v
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    every = [None] * n
    if dist.is_initialized():
        dist.all_gather_object(every, pieces, group=group)
    else:
        every = [pieces]
    full = {}
    for key, (t, _, numel) in pieces.items():
        out, covered = torch.empty(numel, dtype=t.dtype), 0
        for other in every:
            piece, start, _ = other[key]
            out[start : start + piece.numel()] = piece
            covered += piece.numel()
        assert covered == numel, key
        full[key] = out
    return {**full, **scalars}


def _checkpoint_bytes(path) -> tuple[int, int, int, dict[str, int]]:
    """(bytes in data files, bytes the metadata references, tensor elements x itemsize stored,
    bytes per data file)."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    files = {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp")}
    referenced = sum(s.length for s in md.storage_data.values())
    tensor_bytes = 0
    for fqn, m in md.state_dict_metadata.items():
        if hasattr(m, "chunks"):
            numel = sum(math.prod(c.sizes) for c in m.chunks)
            assert numel == math.prod(m.size), fqn  # the chunks tile the tensor exactly once
            tensor_bytes += numel * m.properties.dtype.itemsize
    return sum(files.values()), referenced, tensor_bytes, files


def test_hsdp_checkpoint_one_copy_loads_on_fsdp_and_one_rank(tmp_path):
    """Saved on a 2x2 mesh: the data files hold one copy (every written byte is referenced by the
    metadata: DCP dedups the replicas' identical chunks; the total equals a pure-FSDP save of the same
    plan at W=2). It loads on W=3 pure FSDP and on W=1, bitwise; that W=3 model saved again as pure FSDP
    loads on a 3x1 HSDP mesh, bitwise."""
    hsdp, fsdp2, fsdp3 = tmp_path / "hsdp2x2", tmp_path / "fsdp2", tmp_path / "fsdp3"

    def save_hsdp():
        mesh = _mesh((2, 2))
        out = {}
        for name, (rule, layout, make) in CKPT_OPTIMIZERS.items():
            model = _shard(_new_model(), rule, mesh, layout=layout)
            opt = make(model.parameters())
            _train(model, opt, whole_batch=False, mesh_size=4)
            fsdp_optim.save_checkpoint(hsdp / name, model=model, optimizer=opt, extra={"opt": name})
            out[name] = _full_state(model, opt, mesh.get_group("shard"))
        return out

    def save_fsdp2():  # the same plan as the 2x2 mesh's shard axis, without replicas
        for name, (rule, layout, make) in CKPT_OPTIMIZERS.items():
            model = _shard(_new_model(), rule, None, layout=layout)
            opt = make(model.parameters())
            _train(model, opt, whole_batch=False, mesh_size=2)
            fsdp_optim.save_checkpoint(fsdp2 / name, model=model, optimizer=opt)

    def load_fsdp3():
        out = {}
        for name, (rule, layout, make) in CKPT_OPTIMIZERS.items():
            model = _shard(_new_model(), rule, None, layout="even" if layout == "ragged" else "ragged")
            opt = make(model.parameters())
            assert fsdp_optim.load_checkpoint(hsdp / name, model=model, optimizer=opt) == {"opt": name}
            out[name] = _full_state(model, opt, None)
            fsdp_optim.save_checkpoint(fsdp3 / name, model=model, optimizer=opt)
            mesh = _mesh((3, 1))
            model = _shard(_new_model(), rule, mesh, layout=layout)
            opt = make(model.parameters())
            fsdp_optim.load_checkpoint(fsdp3 / name, model=model, optimizer=opt)
            out[f"{name} 3x1"] = _full_state(model, opt, mesh.get_group("shard"))
        return out

    def load_one():
        out = {}
        for name, (rule, layout, make) in CKPT_OPTIMIZERS.items():
            model = _shard(_new_model(), rule, None, layout=layout)
            opt = make(model.parameters())
            fsdp_optim.load_checkpoint(hsdp / name, model=model, optimizer=opt)
            out[name] = _full_state(model, opt, None)
        return out

    before = run_distributed(save_hsdp, world_size=4, timeout=240)
    for o in before[1:]:
        for name in CKPT_OPTIMIZERS:
            assert_same(o[name], before[0][name])
    run_distributed(save_fsdp2, world_size=2, timeout=240)
    for name in CKPT_OPTIMIZERS:
        written, referenced, tensor_bytes, files = _checkpoint_bytes(hsdp / name)
        written2, _, tensor_bytes2, _ = _checkpoint_bytes(fsdp2 / name)
        assert written == referenced  # no unreferenced (duplicate) bytes
        assert tensor_bytes == tensor_bytes2 and written <= written2 + 32 * 1024  # + 2 more RNG entries, extra
        assert tensor_bytes <= written <= 1.5 * tensor_bytes + 64 * 1024, (written, tensor_bytes)
        assert len(files) == 4
    after3 = run_distributed(load_fsdp3, world_size=3, timeout=240)
    after1 = run_distributed(load_one, world_size=1, timeout=240)
    for name in CKPT_OPTIMIZERS:
        for o in after3:
            assert_same(o[name], before[0][name])
            assert_same(o[f"{name} 3x1"], before[0][name])
        assert_same(after1[0][name], before[0][name])


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_hsdp_mixed_precision_2x1(reduce_dtype):
    """bf16 compute, fp32 master; the reduce-scatter and the all-reduce across replicas run in
    ``reduce_dtype`` and land in the fp32 gradient segment. Reference: the bf16 model's gradients on the
    global batch (tolerance of test_fully_shard's mixed-precision test: bf16 sums over sub-batches)."""
    x, y = _batches(1)[0]
    ref = _new_model().to(torch.bfloat16)
    _loss(ref, x, y).backward()
    ref_grads = {n: p.grad.float() for n, p in ref.named_parameters() if p.grad is not None}

    def fn():
        w, r = dist.get_world_size(), dist.get_rank()
        mp = fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        model, mesh = _new_model(), _mesh((2, 1))
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, mesh=mesh, blocks=adamw_rule, mp_policy=mp)
        fsdp_optim.fully_shard(model, mesh=mesh, blocks=adamw_rule, mp_policy=mp)
        _loss(model, _local(x, w, r), _local(y, w, r)).backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        return _full_grads(model)

    out = run_distributed(fn, world_size=2)
    for n, g in ref_grads.items():
        assert torch.equal(out[0][n], out[1][n]), n  # the replicas agree bitwise
        torch.testing.assert_close(out[0][n], g, rtol=2e-2, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def test_hsdp_bad_input_raises_on_every_rank():
    """A 3-D mesh, an inner call on another mesh than its root's, and replicas that build different
    models: a ValueError naming the mesh shape / replicas and the fix, on every rank, no hang."""

    def fn():
        from torch.distributed.device_mesh import init_device_mesh

        r = dist.get_rank()
        msgs = []
        mesh3 = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("a", "replicate", "shard"))
        try:
            fsdp_optim.fully_shard(_new_model(), mesh=mesh3)
        except ValueError as e:
            msgs.append(str(e))
        mesh = _mesh((2, 1))
        model = _new_model()
        fsdp_optim.fully_shard(model.layers[0], mesh=mesh)
        try:
            fsdp_optim.fully_shard(model)  # the root over the world group, the layer over the 2-D mesh
        except ValueError as e:
            msgs.append(str(e))
        # Replica 1 builds a different model (another block rule): the replicas would plan different
        # layouts; every rank raises.
        rule = muon_rule() if r == 1 else adamw_rule
        try:
            fsdp_optim.fully_shard(_new_model(), mesh=mesh, blocks=rule)
        except ValueError as e:
            msgs.append(str(e))
        dist.barrier()
        return msgs

    for msgs in run_distributed(fn, world_size=2, timeout=60):
        assert len(msgs) == 3, msgs
        assert "3-D mesh of shape (1, 1, 2)" in msgs[0] and "mesh['replicate', 'shard']" in msgs[0]
        assert "2 replicas" in msgs[1] and "same mesh" in msgs[1]
        assert "differ from replica" in msgs[2] and "planned layout" in msgs[2]


# ---------------------------------------------------------------------------------------------
# Muon against torch.optim.Muon + torch.optim.AdamW (a reference nobody here wrote)
# ---------------------------------------------------------------------------------------------
REF_WD = 0.5  # Muon's decoupled decay: 0.01 |p| per step, large enough to be seen in one step
REF_ADAMW_WD = 0.01  # fsdp_optim Muon's adamw_weight_decay default (torch.optim.AdamW's)


@functools.cache
def _torch_muon_reference():
    """One process, the global batch, two steps: ``torch.optim.Muon`` on the hidden matrices (every
    2-D parameter of the transformer blocks), ``torch.optim.AdamW`` on the rest (the tied embedding /
    head, norms, biases). The losses, and the parameters after the first step."""
    model = _new_model()
    named = dict(model.named_parameters())  # the tied head is embed.weight
    hidden = sorted(n for n, p in named.items() if p.ndim == 2 and n.startswith("layers."))
    rest = [p for n, p in named.items() if n not in hidden and p.requires_grad]
    muon = torch.optim.Muon([named[n] for n in hidden], lr=MUON_LR, weight_decay=REF_WD)
    adamw = torch.optim.AdamW(rest, lr=LR, weight_decay=REF_ADAMW_WD)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses, after_one = [], None
    for x, y in _batches(2):
        loss = _loss(model, x, y)
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        losses.append(loss.item())
        if after_one is None:
            after_one = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, init, after_one, hidden


@pytest.mark.parametrize(
    "shape,split", [((3, 1), False), ((1, 3), False), ((2, 2), False), ((2, 2), True)],
    ids=["3x1", "1x3", "2x2", "2x2-split"],
)
def test_hsdp_muon_one_step_matches_torch_muon_and_adamw(shape, split):
    """HSDP + fsdp_optim Muon, each of the W ranks on its slice of the global batch (by global rank),
    against ``torch.optim.Muon`` + ``torch.optim.AdamW`` in one process on the global batch.

    Tolerance, from the math of one step. The sharded gradients are the single-process ones up to fp32
    summation order (~1e-7 relative; the losses agree to 1.2e-7). Newton–Schulz casts ``G / ||G||`` to
    bf16 (8 significant bits), so such a perturbation flips the bf16 rounding of a few inputs by one
    ulp, and the five bf16 iterations spread that to a few ulps of the output: each matrix's update
    ``lr * adjust * NS(G)`` may differ by some bf16 ulps of its largest element (an ulp is 2^-8..2^-7 of
    it). Asserted per matrix: max |diff| <= max |update| / 16 (8-16 ulps); measured <= 2.4% (3-6 ulps)
    on 3x1, 1x3 and 2x2. Caught: a wrong shape-based lr (sqrt(200/72) on w1/w2 moves the update by 40%),
    a halved decay (``0.01 |p|`` per step at wd 0.5: the parameters alone then miss by 5.9e-4 against a
    tolerance of 5.1e-4; the second loss by far more). Both breaks pass test_hsdp_training_parity,
    whose reference is our own W = 1 run. AdamW's first update is ``lr * g / (|g| + eps)``: an element
    with |g| ~ eps may move differently by up to lr, so the AdamW parameters use the library-wide AdamW
    tolerance (max lr/10, 99.5% within 1e-5; measured max 1.2e-7). Over more steps the bf16 flips compound (0.5-1.6 lr
    after 5 steps, see the module docstring), so only the second step's loss (the model after one step)
    is compared further: rtol 1e-5, measured <= 1e-6."""
    ref_losses, init, ref_state, hidden = _torch_muon_reference()
    world_size = shape[0] * shape[1]

    def fn():
        mesh = _mesh(shape)
        w, r = dist.get_world_size(), dist.get_rank()
        cfg = {"padding_cap": 0.0, "mlp_buckets": True} if split else {}
        model = _shard(_new_model(), muon_rule(), mesh, layout="even" if split else "ragged", **cfg)
        if split:
            assert any(pl.split for b in fsdp_optim.sharded_plan(model).buckets for pl in b.placements)
        opt = Muon(model.parameters(), lr=MUON_LR, adamw_lr=LR, weight_decay=REF_WD)
        losses, state = [], None
        for x, y in _batches(2):
            loss = _loss(model, _local(x, w, r), _local(y, w, r))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_mean_over_ranks(loss))
            if state is None:
                state = fsdp_optim.full_state_dict(model)
        return losses, state

    out = run_distributed(fn, world_size=world_size, timeout=240)
    losses, state = out[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert set(state) == set(ref_state)
    for k in hidden:
        update = (ref_state[k] - init[k]).abs().max().item()
        diff = (state[k] - ref_state[k]).abs().max().item()
        assert diff <= update / 16, (k, diff, update)
    assert_close_after_adamw({k: state[k] for k in state if k not in hidden},
                             {k: v for k, v in ref_state.items() if k not in hidden}, lr=LR)
