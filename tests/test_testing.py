"""The multi-rank harness itself: results, errors with tracebacks, no hangs."""

import time

import pytest
import torch
import torch.distributed as dist

from fsdp_optim._testing import DistributedTestError, run_distributed


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_in_rank_order(world_size):
    def fn():
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        return dist.get_rank(), t.item()

    out = run_distributed(fn, world_size=world_size)
    total = world_size * (world_size + 1) / 2
    assert out == [(r, total) for r in range(world_size)]


def test_error_surfaces_with_traceback_and_does_not_hang():
    def fn():
        if dist.get_rank() == 1:
            raise ValueError("boom on rank one")
        dist.barrier()  # rank 0 waits for rank 1, which never comes

    # a hang would end in the harness's TimeoutError after 30 s, not this error: no duration asserted
    with pytest.raises(DistributedTestError, match="boom on rank one") as info:
        run_distributed(fn, world_size=2, timeout=30)
    assert "Traceback" in str(info.value)


def test_timeout_kills_the_group():
    def fn():
        time.sleep(60)

    with pytest.raises(TimeoutError, match="ranks still running"):
        run_distributed(fn, world_size=2, timeout=1.0)


def test_groups_back_to_back():
    """Fresh groups one after another (each test makes its own); the overhead (~0.1 s per 4-rank
    group here) is a benchmark figure, not asserted."""
    for _ in range(3):
        assert run_distributed(lambda: dist.get_rank(), world_size=4) == [0, 1, 2, 3]


def test_live_bytes_counts_allocations_frees_and_resizes():
    from fsdp_optim._testing import LiveBytes

    before = torch.zeros(10_000)  # made outside the block: not counted
    with LiveBytes() as m:
        a = torch.zeros(1000)  # 4,000 B
        b = torch.ones(2000)  # 8,000 B; peak 12,000 here
        del a
        c = b[:10].clone()  # 40 B
        d = torch.zeros(1 << 16)  # 262,144 B, then shrunk in place to nothing
        peak_with_d = m._total()
        d.untyped_storage().resize_(0)
        e = before + 1  # an op's output is counted: 40,000 B
        del e
    assert peak_with_d == 8000 + 40 + (1 << 18)
    assert m.peak == peak_with_d
    assert m.current == 8000 + 40


# ---------------------------------------------------------------------------------------------
# fsdp_optim.testing.check_sharded_equals_unsharded: passes for our optimizers, catches planted bugs
# ---------------------------------------------------------------------------------------------
import os
import subprocess
import sys
from pathlib import Path

from torch import nn

import fsdp_optim
from fsdp_optim.optimizers import AdamW, Muon
from fsdp_optim.sharding.contract import local_shard, local_tensor
from fsdp_optim.sharding import whole
from fsdp_optim.testing import ShardedCheckReport, check_sharded_equals_unsharded, count_collectives

ROOT = Path(__file__).resolve().parents[1]


class _Model(nn.Module):
    """Dims that divide nothing (vocab 101, hidden 24, MLP 37): every layout is uneven at W = 2..4."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(101, 24)
        self.w1 = nn.Linear(24, 37)
        self.w2 = nn.Linear(37, 24, bias=False)
        self.norm = nn.RMSNorm(24)
        self.output = nn.Linear(24, 101, bias=False)


def _whole_rule(fqn, param, module):
    return whole()


class _NormalizedSGD(torch.optim.Optimizer):
    """``p -= lr * g / ||g||`` per tensor, written the way an optimizer on fsdp_optim's shards computes:
    on ``local_tensor(p)``. ``norm``: ``"local"`` (the norm of this rank's piece: right only when the block
    rule keeps each tensor whole on one rank) or ``"all_reduce"`` (the squares summed over the shard group:
    right on any layout, one collective per tensor and step)."""

    def __init__(self, params, *, lr=0.1, norm="local"):
        super().__init__(params, dict(lr=lr))
        self.norm = norm

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                x, g = local_tensor(p), local_tensor(p.grad)
                sq = g.square().sum()
                info = local_shard(p)
                if self.norm == "all_reduce" and info is not None and info.group is not None:
                    dist.all_reduce(sq, group=info.group)
                x.add_(g, alpha=-group["lr"] / sq.sqrt().clamp_min(1e-12).item())


def _check(**kw):
    kw.setdefault("make_model", _Model)
    kw.setdefault("steps", 2)
    return check_sharded_equals_unsharded(**kw)


def test_check_passes_for_adamw_bitwise_on_every_mesh():
    report = _check(make_optimizer=lambda m: AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
    assert isinstance(report, ShardedCheckReport)
    assert [r.mesh for r in report.results] == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 2)]
    assert all(r.bitwise and r.max_abs_diff == 0.0 and r.collectives_per_step == 0 for r in report.results)
    # element blocks: at W >= 2 the planner cuts tensors across ranks (the check had something to check)
    assert [r.num_params for r in report.results] == [6] * 5
    assert report.results[0].cut_params == 0 and all(r.cut_params > 0 for r in report.results[1:])
    print(report)


def test_check_passes_for_muon_bitwise_and_within_its_measured_floor():
    def make(m):
        return Muon(m.named_parameters(), lr=2e-2, adamw_lr=1e-2)

    report = _check(make_optimizer=make, blocks=Muon.blocks, steps=3)
    assert all(r.bitwise and r.collectives_per_step == 0 for r in report.results)
    measured = _check(make_optimizer=make, blocks=Muon.blocks, tolerance="measured", hsdp=False, world_sizes=(3,))
    assert measured.floor > 0.0 and measured.bound == 4.0 * measured.floor  # Adam moves under one-ulp gradient changes
    print(report, measured, sep="\n")


def test_check_catches_a_local_norm_where_the_global_one_is_meant():
    """The planted bug: the norm of this rank's piece. With whole-tensor blocks it is the global norm
    (the check passes, bitwise); on element blocks W >= 2 cuts tensors and the check raises, naming
    the runs, while W = 1 (one piece) is reported equal."""
    whole = _check(make_optimizer=lambda m: _NormalizedSGD(m.parameters()), blocks=_whole_rule)
    assert all(r.cut_params == 0 for r in whole.results)  # every tensor whole on one rank
    with pytest.raises(AssertionError, match=r"W=2: not bitwise equal to unsharded") as info:
        _check(make_optimizer=lambda m: _NormalizedSGD(m.parameters()))
    msg = str(info.value)
    assert "W=1: " not in msg and "W=3: not bitwise" in msg and "HSDP 2x2: not bitwise" in msg
    # and in measured mode too: the error is far above the noise floor
    with pytest.raises(AssertionError, match=r"W=2: max \|diff\| .* exceeds the bound .* noise floor"):
        _check(make_optimizer=lambda m: _NormalizedSGD(m.parameters()), tolerance="measured", hsdp=False)


def test_check_catches_a_collective_in_step_and_measures_its_rounding():
    """The planted bug: the right values through an all_reduce in every step. The default (no
    collective allowed) raises naming the op; allowing it, the sums over shards round otherwise than
    the unsharded sum, and the runs stay within the measured floor."""
    make = lambda m: _NormalizedSGD(m.parameters(), norm="all_reduce")  # noqa: E731
    with pytest.raises(AssertionError, match=r"W=2: step\(\) issued 6 collective\(s\) in one step \(c10d.allreduce_\)"):
        _check(make_optimizer=make, tolerance="measured")
    report = _check(make_optimizer=make, tolerance="measured", max_collectives=None)
    assert [r.collectives_per_step for r in report.results] == [0, 6, 6, 6, 6]  # one per tensor (W = 1: no group)
    assert report.floor > 0.0 and all(r.max_abs_diff <= report.bound for r in report.results)
    print(report)


def test_check_with_a_float64_floor_and_an_absolute_tolerance():
    """The other floor: the reference in float64 against float32 (AdamW passes within it, the local norm
    does not); and a number as the bound (the all-reduced norm passes 1e-6, the local norm fails it)."""
    report = _check(make_optimizer=lambda m: AdamW(m.parameters(), lr=1e-2), tolerance="measured", floor="float64",
                    world_sizes=(3,), hsdp=False)  # fmt: skip
    assert report.floor_method == "float64" and report.floor > 0.0 and report.results[0].max_abs_diff <= report.bound
    with pytest.raises(AssertionError, match=r"W=3: max \|diff\| .* float64 noise floor"):
        _check(make_optimizer=lambda m: _NormalizedSGD(m.parameters()), tolerance="measured", floor="float64",
               world_sizes=(3,), hsdp=False)  # fmt: skip
    make = lambda m: _NormalizedSGD(m.parameters(), norm="all_reduce")  # noqa: E731
    report = _check(make_optimizer=make, tolerance=1e-6, max_collectives=None, world_sizes=(4,), hsdp=False)
    assert report.bound == 1e-6 and report.floor is None
    with pytest.raises(AssertionError, match=r"W=4: max \|diff\| .* exceeds the bound 1.000e-06"):
        _check(make_optimizer=lambda m: _NormalizedSGD(m.parameters()), tolerance=1e-6, world_sizes=(4,), hsdp=False)


def test_check_shards_the_way_the_user_does():
    """``shard(model, mesh)``: per-module calls then the root, on the world and on the HSDP mesh; Muon's
    matrices stay whole and its step bitwise, whatever the buckets. A ``shard`` that renames
    parameters is refused, naming them."""
    def shard(model, mesh):
        assert mesh is None or (tuple(mesh.shape), mesh.mesh_dim_names) == ((2, 2), ("replicate", "shard")), mesh
        fsdp_optim.fully_shard([model.w1, model.w2], mesh=mesh, blocks=Muon.blocks)
        fsdp_optim.fully_shard(model, mesh=mesh, blocks=Muon.blocks)

    report = _check(make_optimizer=lambda m: Muon(m.named_parameters(), lr=2e-2), shard=shard, world_sizes=(2, 3))
    assert all(r.bitwise and r.collectives_per_step == 0 for r in report.results)

    def renaming(model, mesh):
        model.register_parameter("extra", nn.Parameter(torch.zeros(3)))
        fsdp_optim.fully_shard(model, mesh=mesh)

    with pytest.raises(DistributedTestError, match=r"trainable parameters \['extra'\] are not the unsharded model's"):
        _check(make_optimizer=lambda m: AdamW(m.parameters()), shard=renaming, world_sizes=(2,), hsdp=False)


def test_check_catches_ranks_that_disagree():
    """An optimizer whose result depends on the rank: replicas drift apart (HSDP), named in the error."""

    class RankNoise(_NormalizedSGD):
        @torch.no_grad()
        def step(self):
            super().step()
            for group in self.param_groups:
                for p in group["params"]:
                    local_tensor(p).add_(dist.get_rank() * 1e-3)

    with pytest.raises(AssertionError, match=r"rank 1 ends with other values of"):
        _check(make_optimizer=lambda m: RankNoise(m.parameters()), blocks=_whole_rule, world_sizes=(), hsdp=[(2, 1)])


def test_count_collectives_sees_collectives_and_point_to_point():
    def fn():
        t = torch.ones(2)
        with count_collectives() as seen:
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            if dist.get_rank() == 0:
                dist.send(t, dst=1)
            else:
                dist.recv(t, src=0)
        with count_collectives() as none:
            t.add_(1)
        return seen.by_op, seen.total, none.total

    out = run_distributed(fn, world_size=2)
    for rank, (ops, total, none) in enumerate(out):
        p2p = "torch.distributed.send" if rank == 0 else "torch.distributed.recv"
        assert ops == {"c10d.allreduce_": 1, "c10d.broadcast_": 1, p2p: 1} and total == 3 and none == 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(tolerance="close"), "tolerance must be 'bitwise', 'measured' or a number"),
        (dict(tolerance=-1.0), "tolerance must be"),
        (dict(world_sizes=4), "world_sizes must be a sequence of ints >= 1"),
        (dict(world_sizes=(0, 2)), "world_sizes must be"),
        (dict(hsdp=[(2,)]), r"hsdp must be True, False or a sequence of \(replicate, shard\)"),
        (dict(steps=0), "steps must be an int >= 1"),
        (dict(floor="fp16"), "floor must be one of"),
        (dict(floor_multiple=0.5), "floor_multiple must be a number >= 1"),
        (dict(max_collectives=-1), "max_collectives must be"),
        (dict(world_sizes=(), hsdp=False), "no sharded run asked for"),
        (dict(make_optimizer=None), "make_optimizer must be callable"),
    ],
)
def test_check_refuses_bad_arguments(kw, match):
    kw = {"make_optimizer": lambda m: AdamW(m.parameters()), **kw}
    with pytest.raises(ValueError, match=match):
        _check(**kw)


def test_check_refuses_to_run_inside_a_process_group():
    def fn():
        try:
            _check(make_optimizer=lambda m: AdamW(m.parameters()))
        except ValueError as e:
            return str(e)

    for msg in run_distributed(fn, world_size=2):
        assert "already a rank of a process group" in msg and "not under torchrun" in msg


def test_example_script_runs_from_outside_the_repository(tmp_path):
    """examples/check_my_optimizer.py as a user runs it: from another directory, the package importable
    (here through PYTHONPATH, as an installed package would be)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "check_my_optimizer.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bitwise" in proc.stdout and "planted bug caught" in proc.stdout
