"""The bucket lifecycle ([Note: bucket lifecycle] in ``sharding/_bucket.py``) as a user's loop moves it,
the profiler ranges the runtime names, and no host synchronization inside its hooks.

The training result of each loop is compared with single-process ``torch.optim.AdamW`` (the states are
the means; equal training is the end). W = 3 divides nothing in the tiny model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.sharding._bucket import BucketPhase, BucketState
from fsdp_optim.sharding._context import TrainingState
from fsdp_optim.sharding._runtime import _STATE
from tests._models import TinyConfig, TinyTransformer, assert_close_after_adamw, full, make_batch

CFG = TinyConfig(vocab_size=101, dim=24, num_heads=2, num_layers=2, mlp_dim=40)
GLOBAL_BATCH, SEQ, LR = 6, 8, 1e-2


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CFG)


def _shard(model: nn.Module, **kwargs) -> nn.Module:
    for layer in model.layers:
        fsdp_optim.fully_shard(layer, **kwargs)
    fsdp_optim.fully_shard(model, **kwargs)
    return model


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _batch(step: int):
    return make_batch(batch_size=GLOBAL_BATCH, seq_len=SEQ, vocab_size=CFG.vocab_size, seed=100 + step)


def _local(t: torch.Tensor) -> torch.Tensor:
    w, r = dist.get_world_size(), dist.get_rank()
    n = t.shape[0] // w
    return t[r * n : (r + 1) * n]


def _buckets(model: nn.Module) -> dict[str, object]:
    return {name or "<root>": m._fsdp_optim_state.bucket for name, m in model.named_modules() if hasattr(m, _STATE)}


def _states(model: nn.Module) -> dict[str, tuple[str, str]]:
    return {k: (b.where.value, b.phase.value) for k, b in _buckets(model).items()}


def _reference(num_steps: int, rows: int = GLOBAL_BATCH) -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(num_steps):
        x, y = _batch(step)
        _loss(model, x[:rows], y[:rows]).backward()
        opt.step()
        opt.zero_grad()
    return {k: full(v) for k, v in model.state_dict().items()}


def test_states_follow_the_note_through_an_iteration():
    """Every transition of the Note, observed where it happens, on every rank alike; the loop trains
    like the reference."""
    num_steps = 2
    want = _reference(num_steps)

    def fn():
        model = _shard(_model())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        seen: dict[str, list] = {}
        rt = model._fsdp_optim_state.runtime

        def during(name):
            def hook(module, args, output):
                b = module._fsdp_optim_state.bucket
                seen.setdefault(name, []).append((b.where, b.phase, rt.ctx.state))
            return hook

        for i, layer in enumerate(model.layers):
            layer.register_forward_hook(during(f"layers.{i}"), prepend=True)  # before the runtime's post-forward
        idle = {k: ("sharded", "idle") for k in _buckets(model)}
        assert _states(model) == idle  # after setup: nothing gathered, nothing allocated at full size
        assert all(b.gathered is None for b in _buckets(model).values())
        out = []
        for step in range(num_steps):
            x, y = _batch(step)
            loss = _loss(model, _local(x), _local(y))
            after_forward = _states(model)
            loss.backward()
            after_backward = _states(model)
            opt.step()
            opt.zero_grad()
            out.append((after_forward, after_backward))
        with torch.no_grad():
            _loss(model, *_batch(0))
        after_eval = _states(model)
        return seen, out, after_eval, rt.ctx.state, fsdp_optim.full_state_dict(model)

    for seen, out, after_eval, final_state, got in run_distributed(fn, world_size=3):
        for name, obs in seen.items():
            training = (BucketState.UNSHARDED, BucketPhase.FORWARD, TrainingState.FORWARD)
            evaluation = (BucketState.UNSHARDED, BucketPhase.IDLE, TrainingState.FORWARD)  # no_grad: no backward due
            assert obs == [training, training, evaluation], (name, obs)
        for after_forward, after_backward in out:
            # Layers reshard after forward; the root's bucket stays gathered for backward.
            assert after_forward == {
                "<root>": ("unsharded", "forward"),
                "layers.0": ("sharded", "forward"),
                "layers.1": ("sharded", "forward"),
            }
            assert after_backward == {k: ("sharded", "idle") for k in after_backward}
        assert after_eval == {k: ("sharded", "idle") for k in after_eval}  # no_grad forward frees everything
        assert final_state is TrainingState.IDLE
        assert_close_after_adamw(got, want, lr=LR)


def test_explicit_unshard_is_used_by_the_next_forward_then_freed():
    """``unshard()`` gathers now (UNSHARDED, explicit); the next forward uses that gather (no second
    all-gather of the bucket) and frees it after its forward like any other; a gather kept across an
    optimizer step (``reshard_after_forward=False``) is gathered again by the next forward. Training
    equals the reference."""
    num_steps = 3
    want = _reference(num_steps)

    def fn():
        model = _shard(_model())
        model.layers[1].set_reshard_after_forward(False)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        b0, b1 = _buckets(model)["layers.0"], _buckets(model)["layers.1"]
        gathers = []
        for b in (b0, b1):
            orig = b.buffer.all_gather

            def counted(*args, _orig=orig, _b=b, **kwargs):
                gathers.append(_b.plan.name)
                return _orig(*args, **kwargs)

            b.buffer.all_gather = counted
        for step in range(num_steps):
            model.layers[0].unshard()
            model.layers[1].unshard()
            assert (b0.where, b0.explicit_unshard) == (BucketState.UNSHARDED, True)
            del gathers[:]
            x, y = _batch(step)
            loss = _loss(model, _local(x), _local(y))
            assert gathers == [], gathers  # the forward used the explicit gathers
            assert b0.where is BucketState.SHARDED and b1.where is BucketState.UNSHARDED
            loss.backward()
            opt.step()
            opt.zero_grad()
            model.layers[1].unshard()  # no-op now; the next forward must still gather the new values
            assert b1.where is BucketState.UNSHARDED
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=2):
        assert_close_after_adamw(got, want, lr=LR)


@pytest.mark.parametrize("mp", ["fp32", "bf16_compute_fp32_reduce"])
def test_gradient_copy_in_is_batched_and_exact(mp):
    """Every bucket moves its gradients into the flat reduction buffer with one ``_foreach_copy_``
    (no per-parameter ``copy_``; ``_foreach_add_`` when accumulating without sync); the reduced
    gradients equal a single process's, bitwise in fp32 at W=1."""

    def fn():
        kwargs = {}
        if mp != "fp32":
            kwargs["mp_policy"] = fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = _shard(_model(), **kwargs)
        x, y = _batch(0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _loss(model, x, y).backward()
        copy_in = [e for e in prof.events() if e.name.startswith("fsdp_optim::copy_in(")]
        names = [[c.name for c in e.cpu_children] for e in copy_in]
        grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        return names, grads

    ref = _model()
    if mp != "fp32":
        ref = ref.to(torch.bfloat16)
    _loss(ref, *_batch(0)).backward()
    (names, grads), = run_distributed(fn, world_size=1)
    assert len(names) == 3, names  # one copy-in per bucket
    for children in names:  # one foreach op, never a per-parameter add_ / copy_
        assert children == ["aten::_foreach_copy_"], children
    assert set(grads) == {n for n, p in ref.named_parameters() if p.grad is not None}
    for n, p in ref.named_parameters():
        if p.grad is None:
            continue
        if mp == "fp32":
            assert torch.equal(grads[n].reshape(p.shape), p.grad), n
        else:  # bf16 forward and backward in both; the fp32 copy-in of a bf16 gradient is exact
            assert torch.equal(grads[n].reshape(p.shape), p.grad.float()), n


def test_profiler_shows_named_collectives_and_no_host_sync_in_the_hooks():
    """A CPU profile of one training step at W=2 shows ``fsdp_optim::all_gather(...)`` and
    ``fsdp_optim::reduce_scatter(...)`` per bucket, and no ``aten::_local_scalar_dense`` (``.item()``,
    a host synchronization on a GPU) anywhere in forward or backward."""

    def fn():
        model = _shard(_model())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        x, y = _batch(0)
        _loss(model, _local(x), _local(y)).backward()  # warm-up: first-gather allocations
        opt.step()
        opt.zero_grad()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _loss(model, _local(x), _local(y)).backward()
        return [e.name for e in prof.events()]

    for names in run_distributed(fn, world_size=2):
        gathers = {n for n in names if n.startswith("fsdp_optim::all_gather(")}
        reduces = {n for n in names if n.startswith("fsdp_optim::reduce_scatter(")}
        assert gathers == {"fsdp_optim::all_gather(0:<root>)", "fsdp_optim::all_gather(1:layers.0)",
                           "fsdp_optim::all_gather(2:layers.1)"}, gathers  # fmt: skip
        assert reduces == {n.replace("all_gather", "reduce_scatter") for n in gathers}, reduces
        assert "aten::_local_scalar_dense" not in names


class _RecordingStreams:
    """Stands in for CUDA side streams on the CPU: records which stream each collective runs on and
    every cross-stream wait, so the dependency graph of [Note: streams] is checked without a GPU."""

    def __init__(self) -> None:
        self.all_gather, self.reduce_scatter, self.all_reduce = "all_gather", "reduce_scatter", "all_reduce"
        self.log: list[tuple] = []
        self.stack = ["compute"]

    def on(self, stream):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.log.append(("wait", stream, self.stack[-1]))
            self.stack.append(stream)
            try:
                yield
            finally:
                self.stack.pop()

        return ctx()

    def compute_waits_for(self, stream) -> None:
        self.log.append(("wait", "compute", stream))

    def waits(self, waiter, waitee) -> None:
        self.log.append(("wait", waiter, waitee))

    def record(self, tensor, stream) -> None:
        self.log.append(("record", stream, tensor.numel()))


@pytest.mark.parametrize("hsdp", [False, True])
def test_stream_graph_matches_the_note(hsdp):
    """With side streams standing in (recorded), every all-gather and reduce-scatter is issued on its
    stream, compute waits for each gather before the bucket runs, never for a reduction during
    backward (only once at its end), the flat gradient buffer is marked for the reduce-scatter
    stream, and HSDP's all-reduce runs on its own stream after the reduce-scatter's. Training equals
    the reference (the recording changes nothing)."""
    num_steps = 2
    rows = 4 if hsdp else GLOBAL_BATCH  # the global batch the W ranks split evenly
    want = _reference(num_steps, rows)

    def fn():
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
        model = _shard(_model(), mesh=mesh)
        rt = model._fsdp_optim_state.runtime
        rec = _RecordingStreams()
        rt.ctx.streams = rec
        module_of = {id(st.bucket): m for m in model.modules() if (st := getattr(m, "_fsdp_optim_state", None)) is not None}
        for b in rt.buckets:
            for op in ("all_gather", "reduce_scatter"):
                orig = getattr(b.buffer, op)

                def logged(*args, _orig=orig, _op=op, _name=b.plan.name, **kwargs):
                    rec.log.append((_op, rec.stack[-1], _name))
                    return _orig(*args, **kwargs)

                setattr(b.buffer, op, logged)
            module_of[id(b)].register_forward_pre_hook(
                lambda m, a, _name=b.plan.name: rec.log.append(("compute", _name)) if not m is model else None
            )
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(num_steps):
            x, y = _batch(step)
            loss = _loss(model, _local(x[:rows]), _local(y[:rows]))  # every rank its slice of the global batch
            rec.log.append(("backward",))
            loss.backward()
            rec.log.append(("end",))
            opt.step()
            opt.zero_grad()
        logs = list(rec.log)  # (the state dict below gathers synchronously, outside training)
        return logs, fsdp_optim.full_state_dict(model)

    for log, got in run_distributed(fn, world_size=4 if hsdp else 3):
        assert_close_after_adamw(got, want, lr=LR)
        gathers = [e for e in log if e[0] == "all_gather"]
        reduces = [e for e in log if e[0] == "reduce_scatter"]
        assert gathers and all(e[1] == "all_gather" for e in gathers), gathers
        assert reduces and all(e[1] == "reduce_scatter" for e in reduces), reduces
        assert len([e for e in log if e[0] == "record" and e[1] == "reduce_scatter"]) >= len(reduces)
        for i, e in enumerate(log):
            if e[0] == "compute" and e[1] != "<root>":  # a layer runs only after compute waited for its gather
                before = log[:i]
                last_gather_wait = max(j for j, x in enumerate(before) if x == ("wait", "compute", "all_gather"))
                assert last_gather_wait > max(j for j, x in enumerate(before) if x[0] == "all_gather" and x[2] == e[1])
        start = 0
        while ("backward",) in log[start:]:
            b = log.index(("backward",), start)
            end = log.index(("end",), b)
            waits = [x for x in log[b:end] if x[0] == "wait" and x[1] == "compute" and x[2] in ("reduce_scatter", "all_reduce")]
            # Compute waits for the reductions only in finish_reduces at the end of backward.
            assert len(waits) == 2, waits
            tail = log[b:end][-2:]
            assert tail == [("wait", "compute", "reduce_scatter"), ("wait", "compute", "all_reduce")], tail
            start = end
        if hsdp:
            assert ("wait", "all_reduce", "reduce_scatter") in log
            assert any(e[0] == "record" and e[1] == "all_reduce" for e in log)


@pytest.mark.usefixtures("one_process_group")
def test_setup_decisions_are_logged_under_the_fsdp_optim_logger(caplog):
    """INFO: one line per root call with the plan summary; DEBUG: one line per bucket (layout,
    sizes, dtypes). One process (a world of one), so caplog sees the records."""
    with caplog.at_level("DEBUG", logger="fsdp_optim"):
        _shard(_model())
    info = [r.getMessage() for r in caplog.records if r.levelname == "INFO" and r.name.startswith("fsdp_optim")]
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG" and r.name.startswith("fsdp_optim")]
    assert len(info) == 3, info  # two layers (provisional roots), then the root
    assert info[-1].startswith("fully_shard(TinyTransformer): 3 buckets") and "absorbed 2 earlier root(s)" in info[-1]
    assert [m.split(":")[0] for m in debug[-3:]] == ["bucket 0 '<root>'", "bucket 1 'layers.0'", "bucket 2 'layers.1'"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_per_owner_reduction_under_mixed_precision_matches_the_flat_buffer(world_size):
    """bf16 gradients reduced in fp32 go one owner segment at a time ([Note: per-owner reduction under
    mixed precision] in ``_buffer.py``). Against the flat-buffer path (forced): bitwise at W = 2 (a sum
    of two is commutative); at W >= 3 gloo's reduce may add in another order than its all-reduce /
    reduce-scatter, so close to fp32 rounding. Covered: a fresh reduction, one added to ``.grad`` kept
    by ``zero_grad(set_to_none=False)``, micro-batches accumulated without sync then synced (the flat
    buffer path), and a gradient divide factor (the chunks are pre-multiplied)."""
    from fsdp_optim.sharding._bucket import _Bucket

    def fn():
        results = []
        for per_owner in (True, False):
            saved = _Bucket._owner_chunks
            if not per_owner:
                _Bucket._owner_chunks = lambda self: False
            try:
                mp = fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                model = _shard(_model(), mp_policy=mp)
                got = []
                x, y = _batch(0)
                _loss(model, _local(x), _local(y)).backward()  # fresh
                got.append({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
                x, y = _batch(1)
                _loss(model, _local(x), _local(y)).backward()  # added to the kept .grad
                got.append({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
                for p in model.parameters():
                    p.grad = None
                model.set_requires_gradient_sync(False)
                _loss(model, _local(x), _local(y)).backward()
                model.set_requires_gradient_sync(True)
                x, y = _batch(2)
                _loss(model, _local(x), _local(y)).backward()  # no sync, then sync: the flat buffer
                got.append({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
                for p in model.parameters():
                    p.grad = None
                model.set_gradient_divide_factor(3.0)
                _loss(model, _local(x), _local(y)).backward()
                got.append({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
                results.append(got)
            finally:
                _Bucket._owner_chunks = saved
        return results

    for new, old in run_distributed(fn, world_size=world_size):
        for case, (a, b) in enumerate(zip(new, old)):
            assert set(a) == set(b) and a, case
            for n in a:
                assert a[n].dtype == torch.float32, (case, n)
                if world_size <= 2:
                    assert torch.equal(a[n], b[n]), (case, n)
                else:
                    torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-7, msg=f"case {case}, {n}")
