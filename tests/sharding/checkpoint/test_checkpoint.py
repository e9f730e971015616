"""Checkpoints: DCP save/load across world sizes and layouts, exact resume, bad input, atomic saves.

Every distributed result is compared with an unsharded reference: the full tensors before a save
(gathered from the shards) against the full tensors after a load at another world size and
layout; resumed runs against uninterrupted ones; a plain ``nn.Module`` loaded from an exported full
state dict against the sharded model's forward; checkpoints written and read by PyTorch FSDP2.
All comparisons are bitwise: a load only moves bytes, and a resumed run repeats the same kernels
on the same data in the same order (one thread per rank).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import fsdp_optim
from fsdp_optim._testing import DistributedTestError, make_sharded_param, run_distributed, sharded_grad
from fsdp_optim.sharding import RaggedDTensor, elements
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding.contract import local_tensor
from fsdp_optim.sharding.checkpoint import (
    MANIFEST,
    load_checkpoint,
    load_full_state_dict,
    register_optimizer_hooks,
    register_state_dict_hooks,
    save_checkpoint,
)
from fsdp_optim.sharding.contract import local_shard
from fsdp_optim.sharding.plan import flat_range_boxes

PAIRS = [(2, 4), (4, 2), (4, 3), (1, 3), (3, 1)]


def _warm_imports() -> None:
    """The first optimizer step imports ~200 modules (dynamo); do it once here, not in every forked rank."""
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    torch.optim.AdamW([p]).step()


_warm_imports()


# ---- pure: flat ranges as boxes --------------------------------------------------------------
@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (0, 3), (3, 0, 2)])
def test_flat_range_boxes_tile_every_range(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).reshape(shape)
    for s, e in itertools.combinations_with_replacement(range(numel + 1), 2):
        boxes = flat_range_boxes(shape, s, e)
        assert len(boxes) <= max(2 * len(shape) - 1, 1)
        got = []
        pos = s
        for b in boxes:
            assert b.start == pos and b.numel > 0
            piece = index[tuple(slice(o, o + z) for o, z in zip(b.offsets, b.sizes))]
            got += piece.reshape(-1).tolist()
            pos += b.numel
        assert got == list(range(s, e)), (shape, s, e, boxes)
    with pytest.raises(ValueError, match="outside"):
        flat_range_boxes(shape, 0, numel + 1)


# ---- helpers ---------------------------------------------------------------------------------
SHAPES = {
    "embed.weight": (20, 16),
    "layers.0.w1.weight": (16, 24),
    "layers.0.w2.weight": (24, 16),
    "layers.0.norm.weight": (16,),
    "layers.1.w1.weight": (16, 24),
    "layers.1.norm.weight": (16,),
    "head.weight": (10, 16),
    "scale": (),
    "empty.weight": (0, 4),
}


def _random_layout(shape, spec, world_size, rng: random.Random) -> RaggedLayout:
    """A random block-aligned layout; often with empty ranks (a ragged plan's)."""
    starts = spec.block_starts(shape)
    numel = math.prod(shape)
    inner = starts[:-1] if numel else [0]
    cuts = sorted(rng.choice(inner + [numel]) for _ in range(world_size - 1))
    return RaggedLayout(tuple(shape), (0, *cuts, numel))


def _module_of(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    *path, leaf = fqn.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    return mod, leaf


def build_sharded(full: dict[str, torch.Tensor], rule, seed: int) -> nn.Module:
    """A module whose parameters are this rank's shards of ``full`` under random layouts."""
    w = dist.get_world_size()
    rng = random.Random(seed)
    root = nn.Module()
    for fqn, t in full.items():
        spec = rule(fqn, t, None)
        layout = _random_layout(tuple(t.shape), spec, w, rng)
        mod, leaf = _module_of(root, fqn)
        mod.register_parameter(leaf, make_sharded_param(t, spec=spec, layout=layout, fqn=fqn))
    root.register_buffer("step_buf", torch.zeros(3))
    return root


def gather_pieces(pieces: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """``{key: (flat local piece, start, global shape)}`` -> full tensors on every rank, in one
    collective (the pieces of every rank must tile each tensor)."""
    mine = {k: (local_tensor(t).detach().reshape(-1).clone(), s, tuple(shape)) for k, (t, s, shape) in pieces.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    for k, (t, _, shape) in mine.items():
        full = torch.empty(math.prod(shape), dtype=t.dtype)
        covered = 0
        for other in every:
            piece, start, _ = other[k]
            full[start : start + piece.numel()] = piece
            covered += piece.numel()
        assert covered == full.numel(), k
        out[k] = full.view(shape)
    return out


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    pieces = {}
    for name, p in model.named_parameters():
        info = local_shard(p)
        pieces[name] = (p, info.start, info.shape)
    return gather_pieces(pieces)


def full_optim_state(model: nn.Module, opt) -> dict[str, torch.Tensor | float]:
    """Every optimizer state tensor as its global flat vector (replicated ones as they are)."""
    pieces, out = {}, {}
    for name, p in model.named_parameters():
        shards = opt.state_shards(p) if hasattr(opt, "state_shards") else None
        info = local_shard(p)
        for k, v in opt.state[p].items():
            if shards is not None and k in shards:
                pieces[f"{name}.{k}"] = (v, shards[k].start, (shards[k].global_numel,))
            elif shards is None and isinstance(v, RaggedDTensor):  # a torch optimizer's (the parameter's layout)
                pieces[f"{name}.{k}"] = (v, info.start, (info.numel,))
            elif shards is None and torch.is_tensor(v) and v.ndim > 0:
                pieces[f"{name}.{k}"] = (v, info.start, (info.numel,))
            else:
                out[f"{name}.{k}"] = v.clone() if torch.is_tensor(v) else v
    return {**out, **gather_pieces(pieces)}


def random_grads(model: nn.Module, gen: torch.Generator | None = None) -> None:
    """Each rank's slice of one global random gradient (same full gradient for every W)."""
    for p in model.parameters():
        p.grad = sharded_grad(p, torch.randn(tuple(p.shape), generator=gen))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _full_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _torch_adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _torch_rule(fqn, t, module):
    return elements(1)


# ---- world-size pairs: torch.optim.AdamW on flat shards ------------------------------------------
@pytest.mark.parametrize("src,dst", [(4, 3), (1, 3)])  # every pair: test_reshard_every_optimizer
def test_reshard_torch_adamw_params_and_state(tmp_path, src, dst):
    full = _full_tensors()
    ck = str(tmp_path / "ck")

    def save():
        m = build_sharded(full, _torch_rule, seed=src)
        opt = _torch_adamw(m.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            random_grads(m, gen)
            opt.step()
            sched.step()
        m.step_buf.fill_(7.0)
        save_checkpoint(ck, model=m, optimizer=opt, scheduler=sched, extra={"data": 123})
        return full_params(m), full_optim_state(m, opt), opt.param_groups[0]["lr"]

    def load():
        m = build_sharded({k: torch.zeros_like(v) for k, v in full.items()}, _torch_rule, seed=100 + dst)
        opt = _torch_adamw(m.parameters())  # fresh: torch creates state lazily
        opt.param_groups[0]["lr"] = 99.0
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        extra = load_checkpoint(ck, model=m, optimizer=opt, scheduler=sched)
        lr, buf = opt.param_groups[0]["lr"], m.step_buf.tolist()
        return full_params(m), full_optim_state(m, opt), lr, extra, buf, sched.last_epoch

    before = run_distributed(save, world_size=src)[0]
    after = run_distributed(load, world_size=dst)
    for r in range(dst):
        p, s, lr, extra, buf, epoch = after[r]
        assert_same(before[0], p)
        assert_same(before[1], s)
        assert lr == before[2] == 0.01 * 0.25
        assert extra == {"data": 123} and buf == [7.0] * 3 and epoch == 2


# ---- plain dcp.save / dcp.load on model.state_dict() and optimizer.state_dict() -------------------
def test_plain_dcp_on_hooked_state_dicts(tmp_path):
    full = _full_tensors(3)
    ck = str(tmp_path / "dcp")

    def save():
        m = build_sharded(full, _torch_rule, seed=5)
        register_state_dict_hooks(m)
        opt = _torch_adamw(m.parameters())
        register_optimizer_hooks(opt)
        random_grads(m, torch.Generator().manual_seed(2))
        opt.step()
        msd = m.state_dict()
        assert isinstance(msd["layers.0.w1.weight"], RaggedDTensor)
        assert tuple(msd["layers.0.w1.weight"].shape) == SHAPES["layers.0.w1.weight"]
        assert isinstance(opt.state_dict()["state"][0]["exp_avg"], RaggedDTensor)
        w1 = msd["layers.0.w1.weight"]
        assert torch.equal(w1.full_tensor(), full_params(m)["layers.0.w1.weight"])  # the DTensor gathers too
        assert torch.equal(w1.clone().to_local(), getattr(m.layers, "0").w1.weight.to_local())
        dcp.save({"model": msd, "optim": opt.state_dict()}, checkpoint_id=ck)
        return full_params(m), full_optim_state(m, opt)

    def load():
        m = build_sharded({k: torch.zeros_like(v) for k, v in full.items()}, _torch_rule, seed=11)
        register_state_dict_hooks(m)
        opt = _torch_adamw(m.parameters())
        register_optimizer_hooks(opt)
        sd = {"model": m.state_dict(), "optim": opt.state_dict()}  # a fresh lazy optimizer gets its state
        assert float(opt.state[m.embed.weight]["step"]) == 1.0 and not opt.state[m.embed.weight]["exp_avg"].any()
        dcp.load(sd, checkpoint_id=ck)
        m.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        return full_params(m), full_optim_state(m, opt)

    before = run_distributed(save, world_size=3)[0]
    for r, (p, s) in enumerate(run_distributed(load, world_size=2)):
        assert_same(before[0], p)
        assert_same(before[1], s)


# ---- exact resume (same W): bitwise equal to the uninterrupted run ------------------------------------
@pytest.mark.parametrize("world_size", [1, 3])
def test_exact_resume_torch_adamw_with_rng(tmp_path, world_size):
    """Gradients drawn from the global RNG: the resumed run must restore it too."""
    full = _full_tensors(4)
    ck = str(tmp_path / "ck")

    def train(m, opt, steps):
        losses = []
        for _ in range(steps):
            random_grads(m)  # torch's default generator, restored from the checkpoint
            opt.step()
            losses.append(sum(float(p.detach().double().sum()) for p in m.parameters()))
        return losses

    def uninterrupted():
        torch.manual_seed(dist.get_rank())
        m = build_sharded(full, _torch_rule, seed=1)
        opt = _torch_adamw(m.parameters())
        first = train(m, opt, 2)
        save_checkpoint(ck, model=m, optimizer=opt, extra={"step": 2})
        return first + train(m, opt, 3), full_params(m), full_optim_state(m, opt)

    def resumed():
        torch.manual_seed(1234)  # a restarted process: RNG differs until the checkpoint restores it
        m = build_sharded({k: torch.zeros_like(v) for k, v in full.items()}, _torch_rule, seed=1)
        opt = _torch_adamw(m.parameters())
        extra = load_checkpoint(ck, model=m, optimizer=opt)
        assert extra == {"step": 2}
        return train(m, opt, 3), full_params(m), full_optim_state(m, opt)

    ref = run_distributed(uninterrupted, world_size=world_size)
    got = run_distributed(resumed, world_size=world_size)
    for r in range(world_size):
        assert ref[r][0][2:] == got[r][0]
        assert_same(ref[r][1], got[r][1])
        assert_same(ref[r][2], got[r][2])


# ---- full state dicts --------------------------------------------------------------------------
def test_load_full_state_dict_into_sharded_model():
    full = _full_tensors(5)

    def fn():
        m = build_sharded({k: torch.zeros_like(v) for k, v in full.items()}, _torch_rule, seed=3)
        load_full_state_dict(m, {**full, "step_buf": torch.ones(3)})
        with pytest.raises(ValueError, match="missing keys: step_buf"):
            load_full_state_dict(m, full)
        bad = {**full, "step_buf": torch.ones(3), "head.weight": torch.zeros(16, 10)}
        with pytest.raises(ValueError, match=r"shape mismatch for head.weight.*\(16, 10\)"):
            load_full_state_dict(m, bad)
        return full_params(m), m.step_buf.tolist()

    for p, buf in run_distributed(fn, world_size=3):
        assert_same(full, p)
        assert buf == [1.0] * 3


# ---- bad input: clear errors on every rank, nothing loaded -------------------------------------------
def _save_reference(ck: str, world_size: int, full) -> None:
    def save():
        m = build_sharded(full, _torch_rule, seed=world_size)
        opt = _torch_adamw(m.parameters())
        random_grads(m, torch.Generator().manual_seed(0))
        opt.step()
        save_checkpoint(ck, model=m, optimizer=opt)

    run_distributed(save, world_size=world_size)


def _expect_error_on_every_rank(world_size, make, match, strict=True):
    """Run ``load_checkpoint`` on every rank; each must raise ``match`` and leave params untouched."""

    def fn():
        m, opt, ck = make()
        before = {k: local_tensor(v).detach().clone() for k, v in m.named_parameters()}
        try:
            load_checkpoint(ck, model=m, optimizer=opt, strict=strict)
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
        else:
            msg = "no error"
        untouched = all(torch.equal(before[k], local_tensor(v)) for k, v in m.named_parameters())
        return msg, untouched

    import re

    msgs = []
    for r, (msg, untouched) in enumerate(run_distributed(fn, world_size=world_size, timeout=60)):
        assert re.search(match, msg), (r, msg)
        assert untouched, r
        msgs.append(msg)
    return msgs


def test_bad_input_errors(tmp_path):
    full = _full_tensors(6)
    ck = str(tmp_path / "ck")
    _save_reference(ck, 2, full)
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}

    def model(extra_param=False, shape_of_head=None):
        f = dict(zeros)
        if extra_param:
            f["layers.1.w2.weight"] = torch.zeros(24, 16)
        if shape_of_head:
            f["head.weight"] = torch.zeros(shape_of_head)
        return build_sharded(f, _torch_rule, seed=9)

    # missing keys (the model has a parameter the checkpoint lacks), under strict
    def missing():
        m = model(extra_param=True)
        return m, _torch_adamw(m.parameters()), ck

    _expect_error_on_every_rank(3, missing, r"ValueError: .*missing keys: .*layers\.1\.w2\.weight")

    # an error on one rank only (its model differs) reaches every rank, no hang
    def one_rank():
        m = model(extra_param=dist.get_rank() == 1)
        return m, None, ck

    msgs = _expect_error_on_every_rank(
        3, one_rank, r"ValueError: (load_checkpoint failed on rank 1 of 3: ValueError: )?.*missing keys: .*layers\.1\.w2\.weight"
    )
    assert [m.startswith("ValueError: load_checkpoint failed on rank 1 of 3: ") for m in msgs] == [True, False, True]

    # unexpected keys (the checkpoint has parameters the model lacks)
    def unexpected():
        m = model()
        delattr(m.layers, "1")
        return m, None, ck

    _expect_error_on_every_rank(3, unexpected, r"ValueError: .*unexpected keys: .*layers\.1\.norm\.weight")

    # shape mismatch
    def shape():
        m = model(shape_of_head=(16, 10))
        return m, None, ck

    _expect_error_on_every_rank(2, shape, r"ValueError: shape mismatch for model\.head\.weight.*\(10, 16\).*\(16, 10\)")

    # another optimizer's checkpoint
    def other_opt():
        m = model()
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), ck

    _expect_error_on_every_rank(3, other_opt, r"ValueError: .*optimizer torch\.optim\.adamw\.AdamW.*SGD")

    # a missing shard file, then a truncated one (on a copy)
    bad = str(tmp_path / "bad")
    shutil.copytree(ck, bad)
    os.remove(os.path.join(bad, "__1_0.distcp"))

    def missing_file():
        m = model()
        return m, _torch_adamw(m.parameters()), bad

    _expect_error_on_every_rank(3, missing_file, r"FileNotFoundError: .*shard file .*__1_0\.distcp is missing")
    shutil.rmtree(bad)
    shutil.copytree(ck, bad)
    f = os.path.join(bad, "__0_0.distcp")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    _expect_error_on_every_rank(3, missing_file, r"ValueError: .*__0_0\.distcp is truncated")

    # a truncated DCP metadata file; a missing manifest
    shutil.rmtree(bad)
    shutil.copytree(ck, bad)
    with open(os.path.join(bad, ".metadata"), "r+b") as fh:
        fh.truncate(10)
    _expect_error_on_every_rank(2, missing_file, r"ValueError: checkpoint file .*bad/\.metadata is corrupt")
    shutil.rmtree(bad)
    shutil.copytree(ck, bad)
    os.remove(os.path.join(bad, "fsdp_optim.json"))
    _expect_error_on_every_rank(2, missing_file, r"FileNotFoundError: .*bad/fsdp_optim\.json is missing")

    # a save never replaces a directory that is not a checkpoint
    os.makedirs(tmp_path / "data")
    (tmp_path / "data" / "keep.txt").write_text("x")

    def save_over_data():
        m = model()
        try:
            save_checkpoint(tmp_path / "data", model=m)
        except ValueError as e:
            return str(e)

    for msg in run_distributed(save_over_data, world_size=2):
        assert "data exists and is not a checkpoint" in msg
    assert os.listdir(tmp_path / "data") == ["keep.txt"]

    # not a checkpoint at all
    def nowhere():
        m = model()
        return m, None, str(tmp_path / "nowhere")

    _expect_error_on_every_rank(2, nowhere, r"FileNotFoundError: no checkpoint at .*nowhere")


def test_non_strict_keeps_missing(tmp_path):
    full = _full_tensors(7)
    ck = str(tmp_path / "ck")
    _save_reference(ck, 2, full)

    def fn():
        f = {**{k: torch.zeros_like(v) for k, v in full.items()}, "extra.weight": torch.full((5,), 3.0)}
        m = build_sharded(f, _torch_rule, seed=2)
        with pytest.warns(UserWarning, match="extra.weight"):
            load_checkpoint(ck, model=m, strict=False)
        return full_params(m)

    for p in run_distributed(fn, world_size=3):
        assert torch.equal(p["extra.weight"], torch.full((5,), 3.0))
        assert not torch.equal(p["head.weight"], torch.zeros(10, 16))


# ---- atomic save: a crash mid-save leaves the previous checkpoint -------------------------------------
def test_interrupted_save_leaves_previous_checkpoint(tmp_path):
    full = _full_tensors(8)
    ck = str(tmp_path / "ck")

    def first():
        m = build_sharded(full, _torch_rule, seed=1)
        save_checkpoint(ck, model=m, extra={"version": 1})
        return full_params(m)

    ref = run_distributed(first, world_size=2)[0]

    def crashing():
        m = build_sharded({k: v + 1 for k, v in full.items()}, _torch_rule, seed=1)
        original = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            fut = original(self, plan, planner)
            fut.wait()
            if dist.get_rank() == 1:
                os._exit(1)  # killed after writing its shard file, before the metadata / rename
            return fut

        dcp.FileSystemWriter.write_data = write_then_die
        save_checkpoint(ck, model=m, extra={"version": 2})

    with pytest.raises((DistributedTestError, TimeoutError)):
        run_distributed(crashing, world_size=2, timeout=30)
    assert os.path.isdir(ck + ".tmp")  # the partial save is there, but not in place

    def reload():
        m = build_sharded({k: torch.zeros_like(v) for k, v in full.items()}, _torch_rule, seed=4)
        extra = load_checkpoint(ck, model=m)
        return extra, full_params(m)

    for extra, p in run_distributed(reload, world_size=3):
        assert extra == {"version": 1}
        assert_same(ref, p)

    # a crash between the two renames (old checkpoint moved aside, new one not yet in place)
    os.rename(ck, ck + ".old")
    for extra, p in run_distributed(reload, world_size=2):
        assert extra == {"version": 1}
        assert_same(ref, p)

    # the next save cleans up and replaces it
    def second():
        m = build_sharded({k: v + 1 for k, v in full.items()}, _torch_rule, seed=2)
        save_checkpoint(ck, model=m, extra={"version": 3})

    run_distributed(second, world_size=2)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert run_distributed(reload, world_size=1)[0][0] == {"version": 3}


def test_trailing_slash_names_the_same_checkpoint(tmp_path):
    """``ck/`` is ``ck``: saved twice (the second replaces the first), loaded with and without the slash.
    Before: the second save failed renaming ``ck/`` and left ``ck/.tmp`` inside the checkpoint."""
    full = _full_tensors(9)
    ck = str(tmp_path / "ck") + os.sep

    def fn():
        save_checkpoint(ck, model=build_sharded({k: v + 1 for k, v in full.items()}, _torch_rule, seed=1), extra=1)
        save_checkpoint(ck, model=build_sharded(full, _torch_rule, seed=2), extra=2)
        out = []
        for path in (ck, ck.rstrip(os.sep)):
            m = build_sharded({k: torch.zeros_like(v) for k, v in full.items()}, _torch_rule, seed=3)
            out.append((load_checkpoint(path, model=m), full_params(m)))
        return out

    for loads in run_distributed(fn, world_size=2):
        for extra, p in loads:
            assert extra == 2
            assert_same(full, p)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert ".tmp" not in os.listdir(tmp_path / "ck")


def test_save_onto_a_symlink_is_refused_and_changes_nothing(tmp_path):
    """A save onto ``latest -> step_1`` raises a ValueError on every rank before writing anything (see
    [Note: saving onto a symlink]); the link and its checkpoint stay, and a load through the link works.
    Before: an OSError from rmtree, the link moved to ``latest.old`` and every later save lost."""
    full = _full_tensors(10)
    step_1, latest = str(tmp_path / "step_1"), str(tmp_path / "latest")

    def first():
        save_checkpoint(step_1, model=build_sharded(full, _torch_rule, seed=1), extra={"step": 1})

    run_distributed(first, world_size=2)
    os.symlink(step_1, latest)

    def fn():
        m = build_sharded({k: v + 1 for k, v in full.items()}, _torch_rule, seed=2)
        for _ in range(2):
            with pytest.raises(ValueError, match=r"latest is a symbolic link \(to .*step_1\).*Save to a real dir"):
                save_checkpoint(latest, model=m, extra={"step": 2})
        m = build_sharded({k: torch.zeros_like(v) for k, v in full.items()}, _torch_rule, seed=3)
        return load_checkpoint(latest, model=m), full_params(m)

    for extra, p in run_distributed(fn, world_size=2):
        assert extra == {"step": 1}
        assert_same(full, p)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_1"] and os.path.islink(latest)


def _tree(folder) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            out[os.path.relpath(os.path.join(d, f), folder)] = open(os.path.join(d, f), "rb").read()
    return out


def test_save_never_deletes_what_it_did_not_write(tmp_path):
    """See [Note: what a save replaces]: files added inside a checkpoint, a folder that merely has a
    ``.metadata`` entry, and a user's ``<path>.old`` / ``<path>.tmp`` are refused on every rank before
    anything is written, naming the path and the entries; every byte stays and the checkpoint still
    loads. Checkpoint files only (an empty folder, a crashed save's ``<path>.tmp``) are replaced.
    Before: each was deleted and the save succeeded."""
    full = _full_tensors(11)
    ck = str(tmp_path / "ck")

    def on_rank0(fn) -> None:
        if dist.get_rank() == 0:
            fn()
        dist.barrier()

    def write(path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("precious\n")

    def fn():
        m = build_sharded(full, _torch_rule, seed=1)
        save_checkpoint(ck, model=m, extra=1)
        cases = [
            (lambda: (write(f"{ck}/NOTES.md"), write(f"{ck}/eval/results.json")), ck,
             r"ck exists and is not a checkpoint .*\(NOTES\.md, eval/\); a save replaces the whole folder"),
            (lambda: (write(f"{ck}.old/my_backup.txt")), ck + ".old",
             r"ck\.old \(left by an interrupted save to .*ck, which removes it\) holds entries a save did not "
             r"write \(my_backup\.txt\).*move them out"),
            (lambda: (write(f"{ck}.tmp/scratch.txt")), ck + ".tmp", r"ck\.tmp \(left by .*\(scratch\.txt\)"),
        ]
        out = []
        for setup, folder, match in cases:
            on_rank0(setup)
            before = _tree(tmp_path)
            with pytest.raises(ValueError, match=match):
                save_checkpoint(ck, model=build_sharded({k: v + 1 for k, v in full.items()}, _torch_rule, seed=2))
            dist.barrier()
            out.append(_tree(tmp_path) == before)
            dist.barrier()
            on_rank0(lambda folder=folder: shutil.rmtree(folder) if folder != ck else
                     (os.remove(f"{ck}/NOTES.md"), shutil.rmtree(f"{ck}/eval")))
        # a folder with a `.metadata` entry (an Eclipse workspace) is not a checkpoint
        ws = str(tmp_path / "workspace")
        on_rank0(lambda: (write(f"{ws}/.metadata/version.ini"), write(f"{ws}/project/src/main.py")))
        with pytest.raises(ValueError, match=r"workspace exists and is not a checkpoint .*\(\.metadata/, project/\)"):
            save_checkpoint(ws, model=m)
        dist.barrier()
        out.append(sorted(_tree(ws)) == [".metadata/version.ini", "project/src/main.py"])
        m2 = build_sharded({k: torch.zeros_like(v) for k, v in full.items()}, _torch_rule, seed=3)
        out.append(load_checkpoint(ck, model=m2) == 1 and all(torch.equal(full[k], v) for k, v in full_params(m2).items()))
        # checkpoint files only: an empty folder and a crashed save's leftovers are replaced
        empty = str(tmp_path / "empty")
        on_rank0(lambda: (os.makedirs(empty), shutil.copytree(ck, empty + ".tmp"), os.remove(f"{empty}.tmp/{MANIFEST}")))
        save_checkpoint(empty, model=m, extra=2)
        out.append(load_checkpoint(empty, model=m2) == 2 and not os.path.exists(empty + ".tmp"))
        return out

    for r, ok in enumerate(run_distributed(fn, world_size=2, timeout=60)):
        assert ok == [True] * 6, (r, ok)
    assert sorted(os.listdir(tmp_path)) == ["ck", "empty", "workspace"]


def test_load_state_dict_refuses_a_plain_tensor_of_another_global_shape():
    """A plain tensor whose shape is not the parameter's global shape is a size mismatch naming both
    global shapes, as torch's, even when it happens to have this rank's local length (e.g. 32 of 52);
    nothing changes. Before: ``<All keys matched successfully>``, the local-length values loaded."""

    def fn():
        torch.manual_seed(0)
        m = nn.Sequential(nn.RMSNorm(52))
        fsdp_optim.fully_shard(m)
        local = tuple(m[0].weight.to_local().shape)
        before = fsdp_optim.full_state_dict(m)["0.weight"].clone()
        other = {"0.weight": torch.randn(local)}
        for strict in (True, False):
            with pytest.raises(RuntimeError, match=rf"size mismatch for 0\.weight: copying a param with shape "
                               rf"torch\.Size\(\[{local[0]}\]\) from checkpoint, the shape in current model is torch\.Size\(\[52\]\)"):
                m.load_state_dict(other, strict=strict)
        unchanged = torch.equal(fsdp_optim.full_state_dict(m)["0.weight"], before)
        m.load_state_dict({"0.weight": torch.arange(52.0)})  # the global shape still loads
        return local, unchanged, torch.equal(fsdp_optim.full_state_dict(m)["0.weight"], torch.arange(52.0))

    out = run_distributed(fn, world_size=2, timeout=60)
    assert [x[1:] for x in out] == [(True, True)] * 2 and sum(x[0][0] for x in out) == 52 and out[0][0][0] > 0


def test_whole_tensor_save_with_a_failure_on_one_rank_raises_on_every_rank(tmp_path):
    """A ``WholeTensorOptimizer`` save whose rank 1 fails building its state raises on both ranks, naming
    rank 1, and writes nothing; the next save works. Before: rank 0's schema gather paired with rank
    1's error agreement, and rank 0 hung."""
    from fsdp_optim.optimizers import WholeTensorOptimizer

    ck = tmp_path / "ck"

    def fn():
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
        fsdp_optim.fully_shard(m, blocks=WholeTensorOptimizer.blocks, plan_config=PlanConfig(layout="ragged"))
        opt = WholeTensorOptimizer(m.parameters(), torch.optim.NAdam, lr=1e-2)
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
        owned_state = opt.owned_state
        if dist.get_rank() == 1:
            def boom():
                raise RuntimeError("simulated failure on rank 1")

            opt.owned_state = boom
        with pytest.raises(RuntimeError, match=r"^(save_checkpoint failed on rank 1 of 2: RuntimeError: )?simulated failure on rank 1$"):
            save_checkpoint(ck, model=m, optimizer=opt)
        dist.barrier()
        nothing = sorted(os.listdir(tmp_path)) == []
        dist.barrier()  # both ranks have looked before either starts the next save
        opt.owned_state = owned_state
        save_checkpoint(ck, model=m, optimizer=opt)
        return nothing

    assert run_distributed(fn, world_size=2, timeout=30) == [True, True]
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# =====================================================================================================
# fully_shard models with every optimizer
# =====================================================================================================
import torch.nn.functional as F  # noqa: E402

from fsdp_optim.optimizers import (  # noqa: E402
    AdamW,
    AdamW8bit,
    Muon,
    Shampoo,
    adamw8bit_rule,
    adamw_rule,
    muon_rule,
    shampoo_rule,
)
from fsdp_optim.sharding import PlanConfig  # noqa: E402
from tests._models import TinyConfig, TinyTransformer, make_batch  # noqa: E402

# Dims that divide nothing; the embedding (211 x 36 = 7596 elements) gets 8-bit state, the rest fp32.
CFG = TinyConfig(vocab_size=211, dim=36, num_heads=3, num_layers=2, mlp_dim=52)

OPTIMIZERS = {
    "torch_adamw": (adamw_rule, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "adamw": (adamw_rule, lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "adamw8bit": (adamw8bit_rule(256), lambda ps: AdamW8bit(ps, lr=1e-2, compile=False)),
    "muon": (muon_rule(), lambda ps: Muon(ps, lr=2e-2, adamw_lr=1e-2)),
    "shampoo": (shampoo_rule(16), lambda ps: Shampoo(ps, lr=1e-2, max_preconditioner_dim=16)),
}

FSDP_OPTIMIZERS = {k: v for k, v in OPTIMIZERS.items() if k != "torch_adamw"}
# torch's lazy state, 8-bit codes and Shampoo factors (both with their own load_state_dict)
HOOKED_OPTIMIZERS = {k: OPTIMIZERS[k] for k in ("torch_adamw", "adamw8bit", "shampoo")}

# Two plans: per-layer buckets on an even layout vs one bucket on a ragged layout.
PLANS = {
    "even_layers": dict(per_layer=True, config=PlanConfig(layout="even", padding_cap=0.0)),
    "ragged_root": dict(per_layer=False, config=PlanConfig(layout="ragged")),
}


def _warm_optimizers() -> None:
    """First steps import torchao / dynamo pieces; once in the parent instead of in every rank."""
    for rule, make in OPTIMIZERS.values():
        p = nn.Parameter(torch.zeros(4, 4))
        p.grad = torch.ones(4, 4)
        make([p]).step()


_warm_optimizers()


def sharded_model(rule, plan: str, *, seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer(CFG)
    if PLANS[plan]["per_layer"]:
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, blocks=rule)
    fsdp_optim.fully_shard(model, blocks=rule, plan_config=PLANS[plan]["config"])
    return model


def train(model, opt, steps: range, sched=None) -> list[float]:
    losses = []
    for s in steps:
        x, y = make_batch(batch_size=4, seq_len=8, vocab_size=CFG.vocab_size, seed=1000 + s)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def full_state(model, opt) -> tuple[dict, dict]:
    """Full parameters (``fsdp_optim.full_state_dict``) and full optimizer state (dequantized too)."""
    state = full_optim_state(model, opt)
    if isinstance(opt, AdamW8bit):
        pieces = {}
        for name, p in model.named_parameters():
            info = local_shard(p)
            for k, v in opt.dequantized_state(p).items():
                pieces[f"{name}.{k}.dequantized"] = (v, info.start, (info.numel,))
        state.update(gather_pieces(pieces))
    return fsdp_optim.full_state_dict(model), state


def _other(plan: str) -> str:
    return "ragged_root" if plan == "even_layers" else "even_layers"


@pytest.fixture(scope="module")
def saved_at(tmp_path_factory):
    """``saved_at(W) -> (dir, plan, full state per optimizer)``: one save per source world size
    (W=4 serves two pairs), each optimizer trained one step on ``plan`` and checkpointed."""
    cache = {}

    def get(world_size: int):
        if world_size not in cache:
            root = tmp_path_factory.mktemp(f"saved_w{world_size}")
            plan = "even_layers" if world_size <= 2 else "ragged_root"

            def save():
                out = {}
                for name, (rule, make) in OPTIMIZERS.items():
                    model = sharded_model(rule, plan)
                    opt = make(model.parameters())
                    train(model, opt, range(1))
                    fsdp_optim.save_checkpoint(root / name, model=model, optimizer=opt, extra={"opt": name})
                    out[name] = full_state(model, opt)
                return out

            cache[world_size] = root, plan, run_distributed(save, world_size=world_size)[0]
        return cache[world_size]

    return get


@pytest.mark.parametrize("src,dst", PAIRS)
def test_reshard_every_optimizer(saved_at, src, dst):
    """Saved at ``src`` ranks on one plan, loaded at ``dst`` on the other (bucket grouping, layout,
    padding cap): full parameters and optimizer state (8-bit: codes, scales and dequantized
    moments) equal, bitwise."""
    root, plan_src, before = saved_at(src)

    def load():
        out = {}
        for name, (rule, make) in OPTIMIZERS.items():
            model = sharded_model(rule, _other(plan_src), seed=1)
            opt = make(model.parameters())
            assert fsdp_optim.load_checkpoint(root / name, model=model, optimizer=opt) == {"opt": name}
            out[name] = full_state(model, opt)
        return out

    after = run_distributed(load, world_size=dst)
    for r in range(dst):
        for name in OPTIMIZERS:
            assert_same(before[name][0], after[r][name][0])
            assert_same(before[name][1], after[r][name][1])
    assert any(k.endswith("_codes") for k in before["adamw8bit"][1])  # 8-bit state was exercised


@pytest.mark.parametrize("world_size", [3])
def test_exact_resume_every_optimizer(tmp_path, world_size):
    """Train 2 steps, save, rebuild everything fresh, load, train 2 more: bitwise the uninterrupted run."""

    def make_sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    def uninterrupted():
        out = {}
        for name, (rule, make) in FSDP_OPTIMIZERS.items():
            model = sharded_model(rule, "ragged_root")
            opt = make(model.parameters())
            sched = make_sched(opt)
            losses = train(model, opt, range(2), sched)
            fsdp_optim.save_checkpoint(tmp_path / name, model=model, optimizer=opt, scheduler=sched, extra={"step": 2})
            losses += train(model, opt, range(2, 4), sched)
            out[name] = losses, full_state(model, opt)
        return out

    def resumed():
        out = {}
        for name, (rule, make) in FSDP_OPTIMIZERS.items():
            model = sharded_model(rule, "ragged_root", seed=7)  # a different init, overwritten by the load
            opt = make(model.parameters())
            sched = make_sched(opt)
            extra = fsdp_optim.load_checkpoint(tmp_path / name, model=model, optimizer=opt, scheduler=sched)
            losses = train(model, opt, range(extra["step"], 4), sched)
            out[name] = losses, full_state(model, opt)
        return out

    ref = run_distributed(uninterrupted, world_size=world_size)
    got = run_distributed(resumed, world_size=world_size)
    for r in range(world_size):
        for name in FSDP_OPTIMIZERS:
            assert ref[r][name][0][2:] == got[r][name][0], name
            assert_same(ref[r][name][1][0], got[r][name][1][0])
            assert_same(ref[r][name][1][1], got[r][name][1][1])


def test_full_state_round_trip():
    """Export a sharded model's full state, load it into a plain nn.Module: same forward output.
    And the reverse: a plain model's state_dict into a fresh sharded model with load_full_state_dict."""
    x, _ = make_batch(batch_size=2, seq_len=8, vocab_size=CFG.vocab_size, seed=5)

    def fn():
        model = sharded_model(muon_rule(), "even_layers")
        opt = Muon(model.parameters(), lr=2e-2)
        train(model, opt, range(2))
        full = fsdp_optim.full_state_dict(model)
        with torch.no_grad():
            y_sharded = model(x)
        plain = TinyTransformer(CFG)
        plain.load_state_dict(full)  # strict: the model's own names, no padding
        with torch.no_grad():
            y_plain = plain(x)

        torch.manual_seed(3)
        pretrained = TinyTransformer(CFG)
        fresh = sharded_model(muon_rule(), "ragged_root", seed=9)
        fsdp_optim.load_full_state_dict(fresh, pretrained.state_dict())
        also = sharded_model(muon_rule(), "even_layers", seed=10)
        also.load_state_dict(pretrained.state_dict())  # the root's hooks take full tensors too
        with torch.no_grad():
            y_fresh, y_also, y_pre = fresh(x), also(x), pretrained(x)
        return y_sharded, y_plain, y_fresh, y_also, y_pre

    for y_sharded, y_plain, y_fresh, y_also, y_pre in run_distributed(fn, world_size=3):
        # Same kernels on the same full weights and input (one thread per rank): bitwise.
        assert torch.equal(y_sharded, y_plain)
        assert torch.equal(y_fresh, y_pre) and torch.equal(y_also, y_pre)


@pytest.mark.parametrize("meta", [False, True])
def test_load_state_dict_assign_true_loads_into_the_runtimes_parameters(meta):
    """``model.load_state_dict(full_sd, assign=True)`` on a sharded (plain- or meta-built) model: the values
    land in the parameters the runtime gathers and steps (the same objects as before), and forward plus
    two torch.optim.AdamW steps equal the unsharded model bitwise. Before: the load reported success,
    replaced the parameters by objects the runtime never reads, and the model kept its old values."""
    torch.manual_seed(3)
    pretrained = TinyTransformer(CFG)
    full = {k: v.clone() for k, v in pretrained.state_dict().items()}
    ref_opt = torch.optim.AdamW(pretrained.parameters(), lr=1e-2)
    x, _ = make_batch(batch_size=2, seq_len=8, vocab_size=CFG.vocab_size, seed=5)
    with torch.no_grad():
        y_ref = pretrained(x)
    train(pretrained, ref_opt, range(2))  # (each rank's batch is the same: the averaged gradient is this one)
    want = {k: v.detach().clone() for k, v in pretrained.state_dict().items()}

    def fn():
        torch.manual_seed(9)
        if meta:
            with torch.device("meta"):
                model = TinyTransformer(CFG)
        else:
            model = TinyTransformer(CFG)
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, blocks=adamw_rule)
        fsdp_optim.fully_shard(model, blocks=adamw_rule)
        before = list(model.parameters())
        result = model.load_state_dict(full, assign=True)
        same_objects = all(a is b for a, b in zip(before, model.parameters()))
        with torch.no_grad():
            y = model(x)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train(model, opt, range(2))
        return str(result), same_objects, y, fsdp_optim.full_state_dict(model)

    for result, same_objects, y, got in run_distributed(fn, world_size=2):
        assert result == "<All keys matched successfully>" and same_objects
        assert torch.equal(y, y_ref)
        assert_same(want, got)


def test_load_state_dict_assign_true_keeps_the_sharded_dtype_with_a_warning():
    torch.manual_seed(3)
    half = {k: v.to(torch.bfloat16) for k, v in TinyTransformer(CFG).state_dict().items()}

    def fn():
        model = sharded_model(adamw_rule, "even_layers", seed=4)
        with pytest.warns(UserWarning, match=r"is torch\.bfloat16 .* assign=True cannot change a sharded parameter's"):
            model.load_state_dict(half, assign=True)
        return {k: v.dtype for k, v in model.named_parameters()}, fsdp_optim.full_state_dict(model)

    for dtypes, got in run_distributed(fn, world_size=2):
        assert set(dtypes.values()) == {torch.float32}
        assert_same({k: v.float() for k, v in half.items()}, got)


def test_state_dicts_are_dcp_ready_under_fully_shard(tmp_path):
    """fully_shard's root registers the model hooks and our optimizers their own (a torch optimizer
    needs ``register_optimizer_hooks``): plain ``dcp.save`` / ``dcp.load`` on ``model.state_dict()``
    and ``optimizer.state_dict()`` reshard too."""
    x = make_batch(batch_size=1, seq_len=4, vocab_size=CFG.vocab_size)[0]

    def save():
        out = {}
        for name, (rule, make) in HOOKED_OPTIMIZERS.items():
            model = sharded_model(rule, "even_layers")
            opt = make(model.parameters())
            if name == "torch_adamw":  # ours register the hooks themselves (make_dcp_ready)
                register_optimizer_hooks(opt)
            train(model, opt, range(1))
            with torch.no_grad():
                model(x)  # leaves the root's bucket gathered: state_dict() must reshard first
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            assert isinstance(sd["model"]["embed.weight"], RaggedDTensor)
            assert isinstance(sd["model"]["output.weight"], RaggedDTensor)  # tied: under both names
            dcp.save(sd, checkpoint_id=str(tmp_path / name))
            out[name] = full_state(model, opt)
        return out

    def load():
        out = {}
        for name, (rule, make) in HOOKED_OPTIMIZERS.items():
            model = sharded_model(rule, "ragged_root", seed=4)
            opt = make(model.parameters())
            if name == "torch_adamw":
                register_optimizer_hooks(opt)
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.load(sd, checkpoint_id=str(tmp_path / name))
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            out[name] = full_state(model, opt)
        return out

    ref = run_distributed(save, world_size=2)[0]
    for got in run_distributed(load, world_size=3):
        for name in HOOKED_OPTIMIZERS:
            assert_same(ref[name][0], got[name][0])
            assert_same(ref[name][1], got[name][1])


def test_interoperates_with_fsdp2_checkpoints(tmp_path):
    """The model part of a checkpoint is laid out as PyTorch FSDP2's (global N-D tensors, the
    model's names): FSDP2 loads ours and we load FSDP2's, across world sizes."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")

    def fsdp2_model(seed):
        torch.manual_seed(seed)
        model = TinyTransformer(CFG)
        for layer in model.layers:
            fsdp2_fully_shard(layer)
        return fsdp2_fully_shard(model)

    def save_ours():
        model = sharded_model(adamw_rule, "even_layers")
        train(model, AdamW(model.parameters(), lr=1e-2), range(1))
        fsdp_optim.save_checkpoint(ours, model=model)
        return fsdp_optim.full_state_dict(model)

    def fsdp2_round_trip():
        model = fsdp2_model(seed=5)
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=ours)
        got = {k: v.full_tensor() for k, v in sd["model"].items()}
        model2 = fsdp2_model(seed=6)
        dcp.save({"model": model2.state_dict()}, checkpoint_id=theirs)
        return got, {k: v.full_tensor() for k, v in model2.state_dict().items()}

    def load_theirs():
        model = sharded_model(adamw_rule, "ragged_root", seed=1)
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=theirs)
        model.load_state_dict(sd["model"])
        return fsdp_optim.full_state_dict(model)

    ref = run_distributed(save_ours, world_size=3)[0]
    got, fsdp2_full = run_distributed(fsdp2_round_trip, world_size=2)[0]
    assert_same(ref, got)
    for mine in run_distributed(load_theirs, world_size=3):
        assert_same(fsdp2_full, mine)


# ---- use without a process group ---------------------------------------------------------------------
def test_single_process_plain_module(tmp_path):
    """No process group, no sharding: a plain DCP checkpoint with the same API."""
    torch.manual_seed(0)
    model = TinyTransformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(1))
    save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, extra=[1, 2])
    torch.manual_seed(1)
    fresh = TinyTransformer(CFG)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    assert load_checkpoint(tmp_path / "ck", model=fresh, optimizer=fresh_opt) == [1, 2]
    assert_same(model.state_dict(), fresh.state_dict())
    for p, q in zip(model.parameters(), fresh.parameters()):
        if p.requires_grad:
            assert_same(opt.state[p], fresh_opt.state[q])
        else:
            assert p not in opt.state and q not in fresh_opt.state
    assert fresh_opt.param_groups[0]["lr"] == 1e-2


def test_sharded_checkpoint_into_plain_module(tmp_path):
    """A W=3 checkpoint of a fully_shard model loads into a plain nn.Module + torch.optim.AdamW
    in one process (no process group): every tensor equals the gathered sharded one."""
    rule, make = OPTIMIZERS["torch_adamw"]

    def save():
        model = sharded_model(rule, "ragged_root")
        opt = make(model.parameters())
        train(model, opt, range(2))
        fsdp_optim.save_checkpoint(tmp_path / "ck", model=model, optimizer=opt)
        return full_state(model, opt)

    params, state = run_distributed(save, world_size=3)[0]
    plain = TinyTransformer(CFG)
    opt = make(plain.parameters())
    load_checkpoint(tmp_path / "ck", model=plain, optimizer=opt)
    assert_same(params, plain.state_dict())
    for name, p in plain.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            assert torch.equal(v.reshape(-1) if v.ndim else v, state[f"{name}.{k}"]), (name, k)
    assert len(opt.state) == sum(p.requires_grad for p in plain.parameters())


def test_a_failed_final_rename_puts_the_previous_checkpoint_back(tmp_path, monkeypatch):
    """[Note: atomic publish], shared with export_hf: ``<path>.tmp`` -> ``path`` fails after the previous
    checkpoint was moved to ``<path>.old``; it is moved back. Before: ``path`` was left missing."""
    ck = tmp_path / "ck"
    save_checkpoint(ck, model=nn.Linear(3, 2), extra=1)
    before = sorted(os.listdir(ck))
    rename = os.rename

    def failing(src, dst):
        if str(src) == f"{ck}.tmp":
            raise OSError("disk went away")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="disk went away"):
        save_checkpoint(ck, model=nn.Linear(3, 2), extra=2)
    monkeypatch.undo()
    assert sorted(os.listdir(ck)) == before and not (tmp_path / "ck.old").exists()
    assert load_checkpoint(ck, model=nn.Linear(3, 2)) == 1


def test_a_failed_directory_fsync_after_the_rename_raises(tmp_path, monkeypatch):
    """The renames are in place but their folder's fsync fails: the save raises saying so (export_hf
    ignored it before)."""
    from fsdp_optim.sharding.checkpoint import _files

    real = _files.fsync

    def failing(path):
        if os.path.abspath(path) == str(tmp_path):
            raise OSError("fsync not supported here")
        real(path)

    monkeypatch.setattr(_files, "fsync", failing)
    with pytest.raises(OSError, match=r"is in place but fsync of its folder .* failed .*may not survive a crash"):
        save_checkpoint(tmp_path / "ck", model=nn.Linear(3, 2), extra=1)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "ck", model=nn.Linear(3, 2)) == 1


def test_saved_param_groups_replace_the_current_ones_as_torch_does(tmp_path):
    # A group saved without a key the current optimizer sets (Muon's AdamW part before its lr followed
    # Muon's schedule: lr in AdamW's units, no "base_lr") must step as saved. Keeping the new group's
    # "base_lr" beside the old lr stepped AdamW at adamw_lr / lr = 0.15x its lr, silently.
    path = str(tmp_path / "ckpt")

    def fn():
        torch.manual_seed(0)
        model = TinyTransformer(TinyConfig())
        fsdp_optim.fully_shard(model, blocks=Muon.blocks)
        old = Muon(model.parameters(), lr=0.02, adamw_lr=3e-3)
        for g in old.param_groups:
            if not g["use_muon"]:  # the older format
                g["lr"] = g.pop("adamw_lr")
                del g["base_lr"]
        fsdp_optim.save_checkpoint(path, model=model, optimizer=old)
        new = Muon(model.parameters(), lr=0.02, adamw_lr=3e-3)
        fsdp_optim.load_checkpoint(path, model=model, optimizer=new)
        lrs = [Muon.adamw_lr(g) for g in new.param_groups if not g["use_muon"]]
        same = [dict(g, params=None) for g in new.param_groups] == [dict(g, params=None) for g in old.param_groups]
        del model, old, new
        return lrs, same

    for lrs, same in run_distributed(fn, world_size=2):
        assert lrs and all(lr == 3e-3 for lr in lrs) and same
