"""The runtime off the happy path: what users do between passes, and the guards against silent errors.

Each parity test compares with single-process ``torch.optim.AdamW`` on the global batch (the
reference nobody here wrote); W = 3 divides nothing in the tiny model. Each of these failed on the
main branch before the fixes (issue 12 items 2-6): wrong parameters, a deferred reduction, a world
of one, zero updates, drifting ranks, or a hang.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp_optim
from fsdp_optim._testing import DistributedTestError, run_distributed
from fsdp_optim.optimizers import AdamW
from fsdp_optim.sharding.contract import local_shard
from fsdp_optim.sharding.contract import local_tensor
from tests._models import TinyConfig, TinyTransformer, assert_close_after_adamw, make_batch

CFG = TinyConfig(vocab_size=101, dim=24, num_heads=2, num_layers=2, mlp_dim=40)
GLOBAL_BATCH, SEQ, LR = 6, 8, 1e-2


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CFG)


def _shard(model: nn.Module) -> nn.Module:
    for layer in model.layers:
        fsdp_optim.fully_shard(layer)
    fsdp_optim.fully_shard(model)
    return model


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _batch(step: int):
    return make_batch(batch_size=GLOBAL_BATCH, seq_len=SEQ, vocab_size=CFG.vocab_size, seed=100 + step)


def _reference(num_steps: int) -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(num_steps):
        x, y = _batch(step)
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    w, r = dist.get_world_size(), dist.get_rank()
    n = t.shape[0] // w
    return t[r * n : (r + 1) * n]


def _assert_close(got: dict, want: dict) -> None:
    assert_close_after_adamw(got, want, lr=LR)


def _train_sharded(model: nn.Module, num_steps: int) -> dict[str, torch.Tensor]:
    """AdamW on this rank's share of the reference batches for ``num_steps`` steps; the full state."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(num_steps):
        x, y = _batch(step)
        _loss(model, _local(x), _local(y)).backward()
        opt.step()
        opt.zero_grad()
    return fsdp_optim.full_state_dict(model)


@pytest.mark.parametrize("eval_mode", ["no_grad", "grad_enabled", "grad_enabled_kept"])
def test_evaluation_forward_between_backward_and_step_trains_like_the_reference(eval_mode):
    """A validation forward between backward and step, with or without ``torch.no_grad()``: the next
    forward must use the stepped parameters (on main, a grad-enabled one left the root bucket
    gathered with the pre-step values: parameters 1.1% off after 5 steps)."""
    num_steps = 4
    want = _reference(num_steps)

    def fn():
        model = _shard(_model())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        kept = []
        for step in range(num_steps):
            x, y = _batch(step)
            _loss(model, _local(x), _local(y)).backward()
            if eval_mode == "no_grad":
                with torch.no_grad():
                    _loss(model, _local(x), _local(y))
            else:
                val = _loss(model, _local(x), _local(y))  # graph dropped here, or kept one step
                if eval_mode == "grad_enabled_kept":
                    kept = [val]
            opt.step()
            opt.zero_grad()
        del kept
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=3):
        _assert_close(got, want)


def test_a_dropped_graph_does_not_defer_the_next_backwards_reductions():
    """After a grad-enabled forward whose graph is dropped, the next backward still reduces each layer
    as soon as its backward is done (on main every reduce-scatter waited for the end of backward)."""

    def fn():
        model = _shard(_model())
        x, y = _batch(0)
        _loss(model, _local(x), _local(y))  # dropped: no backward
        order = []
        for name, m in model.named_modules():
            st = getattr(m, "_fsdp_optim_state", None)
            if st is not None and st.bucket is not None:
                b = st.bucket
                orig = b.post_backward

                def logged(_orig=orig, _name=name or "<root>"):
                    order.append((_name, b.ctx.callback_queued and _in_final_callback[0]))
                    return _orig()

                b.post_backward = logged
        _in_final_callback = [False]
        rt = model._fsdp_optim_state.runtime
        orig_final = rt.final_callback

        def final():
            _in_final_callback[0] = True
            try:
                orig_final()
            finally:
                _in_final_callback[0] = False

        rt.final_callback = final
        _loss(model, _local(x), _local(y)).backward()
        return order

    for order in run_distributed(fn, world_size=2):
        layers = [deferred for name, deferred in order if name.startswith("layers.")]
        assert layers == [False, False], order  # both layers reduced during backward, not at its end


def test_fully_shard_under_torchrun_without_a_process_group_raises():
    def fn():
        # What torchrun sets, without init_process_group (the group of the harness is destroyed first).
        dist.destroy_process_group()
        os.environ["WORLD_SIZE"] = "2"
        try:
            with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*init_process_group"):
                fsdp_optim.fully_shard(_model())
        finally:
            os.environ["WORLD_SIZE"] = "1"
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return True

    assert run_distributed(fn, world_size=1) == [True]


@pytest.mark.parametrize("optimizer", ["torch", "ours"])
def test_optimizer_built_before_the_root_call(optimizer):
    """An optimizer built between the layer calls and the root call: the root replaces the parameters
    no inner call sharded (the embedding: every update would be 0.0, silently), so a step raises naming
    it; the layers' parameters it holds are the objects the root re-lays out in place. torch's optimizer
    over those makes its state at its first step and trains them like one built after the root; ours
    planned their state for the inner layout and raise at their first step, naming the parameter from
    the root (layers.1.*) and the fix."""

    def fn():
        model, twin = _model(), _model()
        for layer in model.layers:
            fsdp_optim.fully_shard(layer)
        make = (lambda ps: torch.optim.AdamW(ps, lr=LR)) if optimizer == "torch" else (lambda ps: AdamW(ps, lr=LR))
        everything = make(model.parameters())
        layers = make(model.layers.parameters())
        fsdp_optim.fully_shard(model)
        _shard(twin)
        after = make(twin.layers.parameters())
        x, y = _batch(0)
        for m in (model, twin):
            _loss(m, _local(x), _local(y)).backward()
        with pytest.raises(ValueError, match=r"parameter embed\.weight .*fully_shard replaced.*after the outermost"):
            everything.step()
        if optimizer == "ours":
            with pytest.raises(ValueError, match=r"parameter layers\.\d\.\S+ \(shape .*laid out again.*after the outermost fully_shard"):
                layers.step()
            return True
        layers.step()
        after.step()
        a, b = fsdp_optim.full_state_dict(model), fsdp_optim.full_state_dict(twin)
        return all(torch.equal(a[k], b[k]) for k in a)

    assert run_distributed(fn, world_size=2) == [True, True]


@pytest.mark.parametrize("optimizer", ["torch", "ours"])
def test_a_replaced_parameter_added_by_add_param_group_after_the_first_step_raises(optimizer):
    """The guard checks an optimizer at its first step and again whenever its parameter count
    changed (``_optimizer_pre_step``): a parameter object that fully_shard replaced (``stale``, taken
    from the model before the calls), added with ``add_param_group`` after a clean first step, must
    raise at the next step, naming it; a fresh parameter added the same way does not. Without the
    re-check the stale parameter would be skipped silently (its ``.grad`` is never set)."""

    def fn():
        model = _model()
        stale = model.layers[1].mlp.w1.weight  # replaced by the layer's fully_shard call
        _shard(model)
        make = torch.optim.AdamW if optimizer == "torch" else AdamW
        opt = make(model.parameters(), lr=LR)
        x, y = _batch(0)
        _loss(model, _local(x), _local(y)).backward()
        opt.step()  # first step: every parameter is the sharded one, no error
        opt.zero_grad()
        # a fresh (never replaced) parameter: the re-check passes
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "lr": LR})
        _loss(model, _local(x), _local(y)).backward()
        opt.step()
        opt.zero_grad()
        if optimizer == "ours":  # our AdamW refuses replaced parameters as soon as they are added
            with pytest.raises(ValueError, match=r"parameter layers\.1\.mlp\.w1\.weight .*fully_shard replaced"):
                opt.add_param_group({"params": [stale], "lr": LR})
            return True
        opt.add_param_group({"params": [stale], "lr": LR})
        _loss(model, _local(x), _local(y)).backward()
        stale_msg = r"parameter layers\.1\.mlp\.w1\.weight \(shape \(40, 24\)\) that fully_shard replaced"
        with pytest.raises(ValueError, match=stale_msg):
            opt.step()
        return True

    assert run_distributed(fn, world_size=2) == [True, True]


@pytest.mark.usefixtures("one_process_group")
def test_ours_built_from_parameters_replaced_earlier_raises_at_construction():
    model = _model()
    params = list(model.parameters())
    _shard(model)
    with pytest.raises(ValueError, match=r"parameter embed\.weight .*fully_shard replaced"):
        AdamW(params, lr=LR)
    with pytest.raises(ValueError, match=r"parameter layers\.1\.\S+ .*fully_shard replaced"):
        AdamW(params[len(params) // 2 :], lr=LR)


def test_forgotten_root_call_warns_naming_the_unmanaged_parameters():
    """Layers sharded but not the root: embeddings and head are never averaged (on main the ranks
    drifted apart without a word)."""

    def fn():
        model = _model()
        for layer in model.layers:
            fsdp_optim.fully_shard(layer)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        x, y = _batch(0)
        _loss(model, _local(x), _local(y)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        return [str(w.message) for w in caught]

    for msgs in run_distributed(fn, world_size=2):
        assert any("not managed by fully_shard" in m and "(101, 24)" in m for m in msgs), msgs


def test_debug_mode_names_a_rank_that_skips_backward_instead_of_hanging():
    """FSDP_OPTIM_DEBUG=1: ranks agree on each collective first; a rank that skips backward makes
    every rank raise, naming what each was about to do (without it, every rank hangs)."""

    def fn():
        os.environ["FSDP_OPTIM_DEBUG"] = "1"
        model = _shard(_model())
        x, y = _batch(0)
        loss = _loss(model, _local(x), _local(y))
        if dist.get_rank() == 0:
            loss.backward()
        _loss(model, _local(x), _local(y))  # rank 1 goes on to the next forward
        return True

    with pytest.raises(DistributedTestError, match=r"ranks disagree on the next collective.*rank 0: all_gather.*rank 1: all_gather"):
        run_distributed(fn, world_size=2, timeout=60)


def test_debug_mode_agrees_on_a_normal_step_and_changes_nothing():
    want = _reference(2)

    def fn():
        os.environ["FSDP_OPTIM_DEBUG"] = "1"
        return _train_sharded(_shard(_model()), 2)

    for got in run_distributed(fn, world_size=3):
        _assert_close(got, want)


# ---- parameters without gradients, requires_grad changes, failed backwards, hooks --------------
class _Skippable(TinyTransformer):
    """TinyTransformer whose forward skips the modules named in ``skip`` (``layers.i``: stochastic
    depth, a frozen branch; ``norm``): their parameters get no gradient in that step."""

    skip: frozenset = frozenset()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            if f"layers.{i}" not in self.skip:
                h = layer(h)
        return self.output(h if "norm" in self.skip else self.norm(h))


def _skippable() -> _Skippable:
    torch.manual_seed(0)
    return _Skippable(CFG)


SKIPS = [frozenset(), frozenset({"layers.1"}), frozenset({"layers.1", "norm"}), frozenset({"layers.0"})]


def _train_with_skips(model, opt, local) -> list[list[str]]:
    """Steps with the layers of ``SKIPS`` skipped; returns the names of parameters without a
    gradient after each backward."""
    none = []
    for step, skip in enumerate(SKIPS):
        model.skip = skip
        x, y = _batch(step)
        _loss(model, local(x), local(y)).backward()
        none.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
    return none


@pytest.mark.parametrize("world_size", [1, 3])
def test_parameters_without_a_gradient_keep_none_and_do_not_move(world_size):
    """A layer skipped in a step: its parameters' ``.grad`` stays ``None`` as in plain PyTorch, so
    AdamW applies neither weight decay nor momentum to them (before: a zero gradient was attached
    and the skipped layer moved by 0.0126 after 3 steps)."""
    model = _skippable()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    want_none = _train_with_skips(model, opt, lambda t: t)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert want_none[1] and all(n.startswith("layers.1.") for n in want_none[1]) and "norm.weight" in want_none[2]

    def fn():
        model = _shard(_skippable())
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        none = _train_with_skips(model, opt, _local)
        # torch.autograd.grad alone (a saliency map through every layer) accumulates no .grad: none
        # is attached.
        x, y = _batch(9)
        model.skip = frozenset()
        embedded = []
        handle = model.embed.register_forward_hook(lambda m, args, out: embedded.append(out))
        loss = _loss(model, _local(x), _local(y))
        torch.autograd.grad(loss, embedded[0])
        handle.remove()
        assert all(p.grad is None for p in model.parameters())
        return none, fsdp_optim.full_state_dict(model)

    for none, got in run_distributed(fn, world_size=world_size):
        assert none == want_none
        _assert_close(got, want)


def test_a_gradient_from_another_rank_reaches_a_parameter_unused_here():
    """A data-dependent graph inside a bucket: rank 0 uses the final norm, rank 1 skips it (the
    root's bucket runs on both, so the collectives match). The averaged gradient (rank 0's half)
    becomes ``.grad`` on both, as the single-process mean over the global batch has it."""

    def reference():
        model = _skippable()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        for step in range(3):
            x, y = _batch(step)
            n = x.shape[0] // 2
            losses = []
            for r, skip in enumerate([frozenset(), frozenset({"norm"})]):
                model.skip = skip
                losses.append(_loss(model, x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]))
            (sum(losses) / 2).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    want = reference()

    def fn():
        model = _shard(_skippable())
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        for step in range(3):
            model.skip = frozenset({"norm"}) if dist.get_rank() == 1 else frozenset()
            x, y = _batch(step)
            _loss(model, _local(x), _local(y)).backward()
            assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.numel() > 0)
            opt.step()
            opt.zero_grad()
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=2):
        _assert_close(got, want)


class _SometimesEmbedded(nn.Module):
    """A linear layer plus an embedding that only some ranks' data looks up (rank-dependent graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.emb = nn.Embedding(8, 4)

    def forward(self, x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        h = self.lin(x)
        return h if idx is None else h + self.emb(idx).sum(0)


class _EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = _SometimesEmbedded()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        return self.head(self.layer(x, idx)).pow(2).mean()


def _embed_data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(3, 4, generator=gen)
    if step == 0:
        return x, torch.arange(8)  # every rank looks up every row
    return x, (torch.tensor([0]) if rank == 0 else None)  # then rank 0 only, row 0 only


@pytest.mark.parametrize("mesh_shape", [None, (2, 2)], ids=["fsdp-w2", "hsdp-2x2"])
def test_a_parameter_reached_on_another_rank_gets_its_gradient_even_where_it_is_zero(mesh_shape):
    """Whether a parameter got a gradient is agreed by every rank ([Note: unused parameters]): rank 1
    never calls the embedding after step 0 and holds rows 6-7, which nobody looks up, so its piece
    of the averaged gradient is exactly zero; it is still its ``.grad`` (zeros), as in the single
    process over the global batch, so AdamW's momentum keeps moving those rows. Before, a zero piece
    counted as unused: ``.grad`` stayed None and rows 6-7 ended 1.2e-2 off the reference. Under
    HSDP the agreement spans the replicas too (ranks 1-3 never call it)."""
    world_size = 2 if mesh_shape is None else 4
    torch.manual_seed(0)
    ref = _EmbedNet()
    init = copy.deepcopy(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(3):
        (sum(ref(*_embed_data(step, r)) for r in range(world_size)) / world_size).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    def fn():
        from torch.distributed.device_mesh import init_device_mesh

        mesh = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        model = _EmbedNet()
        model.load_state_dict(init)
        fsdp_optim.fully_shard(model.layer, mesh=mesh)
        fsdp_optim.fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        piece, nones = model.layer.emb.weight, []
        for step in range(3):
            model(*_embed_data(step, dist.get_rank())).backward()
            nones.append(piece.grad is None)
            opt.step()
            opt.zero_grad()
        return piece.numel(), nones, fsdp_optim.full_state_dict(model)

    results = run_distributed(fn, world_size=world_size)
    assert results[1][0] > 0  # rank 1 holds a piece of the embedding
    for _, nones, got in results:
        assert nones == [False] * 3
        for k in want:  # (HSDP: replicas average in another order than one process: fp32 rounding)
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0 if mesh_shape is None else 1e-6)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_gradient_released_by_setting_grad_to_none_is_never_written_again(world_size):
    """``held = w.grad; w.grad = None`` (a per-group ``zero_grad``, a second optimizer) while the
    bias keeps its gradient: the next backward writes a new gradient segment, so ``held`` keeps its
    values, as in plain PyTorch and FSDP2, and the bias accumulates. Before, the old segment was
    reused: ``held`` was zeroed and overwritten (changed by 9.998 at W=1)."""

    def run(sharded: bool):
        torch.manual_seed(0)
        m = nn.Linear(4, 4)
        if sharded:
            fsdp_optim.fully_shard(m)
        gen = torch.Generator().manual_seed(1)
        m(torch.randn(3, 4, generator=gen)).pow(2).sum().backward()
        held = m.weight.grad
        before = held.clone()
        m.weight.grad = None
        m(torch.randn(3, 4, generator=gen)).pow(2).sum().backward()
        grads = {}
        for name, p in m.named_parameters():
            info = local_shard(p)
            lo, hi = (info.start, info.end) if info is not None else (0, p.numel())
            grads[name] = (lo, hi, local_tensor(p.grad).reshape(-1).clone())
        return torch.equal(held, before), grads

    untouched, want = run(False)
    assert untouched
    for untouched, grads in run_distributed(lambda: run(True), world_size=world_size):
        assert untouched
        for name, (lo, hi, g) in grads.items():
            assert torch.equal(g, want[name][2][lo:hi]), name  # weight: the new gradient; bias: the sum


@dataclasses.dataclass
class _Hidden:
    h: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Batch:
    x: torch.Tensor
    scale: float


class _DataclassBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, inp: _Batch | _Hidden) -> _Hidden:
        x = inp.x * inp.scale if isinstance(inp, _Batch) else inp.h
        self.seen_dtype = x.dtype
        h = torch.tanh(self.lin(x))
        return _Hidden(h=h, aux=h.square().mean())


class _DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_DataclassBlock() for _ in range(2))

    def forward(self, batch: _Batch) -> torch.Tensor:
        out = self.blocks[1](self.blocks[0](batch))
        return out.h.float().sum() + out.aux.float()


@pytest.mark.parametrize("world_size", [1, 2])
def test_dataclass_inputs_and_outputs_of_sharded_modules(world_size):
    """A plain ``@dataclass`` as a sharded module's output and a frozen one as its input (pytree
    treats both as leaves; FSDP2 walks them): the output's tensors get the pre-backward hooks, so
    each bucket is gathered again for its backward and trains like the single process; under
    mixed precision the input's tensors are cast. Before, backward failed with ``setStorage: ...
    out of bounds for storage of size 0`` and the bf16 forward with a dtype mismatch."""
    gen = torch.Generator().manual_seed(3)
    batches = [_Batch(x=torch.randn(2 * world_size, 4, generator=gen), scale=0.5) for _ in range(3)]
    torch.manual_seed(0)
    ref = _DataclassNet()
    init = copy.deepcopy(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for b in batches:  # the ranks' losses summed (each rank's gradient is averaged, then times W)
        sum(ref(_Batch(x=b.x[r * 2 : (r + 1) * 2], scale=b.scale)) for r in range(world_size)).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    def fn():
        w, r = dist.get_world_size(), dist.get_rank()
        model = _DataclassNet()
        model.load_state_dict(init)
        for blk in model.blocks:
            fsdp_optim.fully_shard(blk)
        fsdp_optim.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for b in batches:
            local = _Batch(x=b.x[r * 2 : (r + 1) * 2], scale=b.scale)
            (model(local) * w).backward()
            opt.step()
            opt.zero_grad()
        got = fsdp_optim.full_state_dict(model)
        mp = _DataclassNet()
        for blk in mp.blocks:
            fsdp_optim.fully_shard(blk, mp_policy=fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fsdp_optim.fully_shard(mp, mp_policy=fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        mp(_Batch(x=torch.randn(2, 4), scale=1.0)).backward()
        return got, [blk.seen_dtype for blk in mp.blocks]

    for got, dtypes in run_distributed(fn, world_size=world_size):
        assert dtypes == [torch.bfloat16] * 2
        _assert_close(got, want)


def _freeze_schedule(model, step: int) -> None:
    """Progressive (un)freezing: the final norm is frozen at setup and unfrozen at step 2; layer 0
    is frozen from step 1 on."""
    model.norm.weight.requires_grad_(step >= 2)
    for p in model.layers[0].parameters():
        p.requires_grad_(step < 1)


@pytest.mark.parametrize("world_size", [1, 2])
def test_requires_grad_changed_after_fully_shard_is_followed(world_size):
    """Freezing or unfreezing a parameter after ``fully_shard`` (before: ignored both ways; a frozen
    layer kept training and an unfrozen one never trained)."""
    num_steps = 4

    def train(model, opt, local):
        for step in range(num_steps):
            _freeze_schedule(model, step)
            x, y = _batch(step)
            _loss(model, local(x), local(y)).backward()
            frozen_grads = [p.grad for p in model.parameters() if not p.requires_grad]
            assert all(g is None for g in frozen_grads)
            opt.step()
            opt.zero_grad()

    model = _model()
    model.norm.weight.requires_grad_(False)
    train(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), lambda t: t)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def fn():
        model = _model()
        model.norm.weight.requires_grad_(False)
        _shard(model)
        train(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), _local)
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=world_size):
        _assert_close(got, want)


@pytest.mark.parametrize("where", ["layer", "head"])
def test_a_backward_that_raised_does_not_break_later_steps(where):
    """An exception inside backward (e.g. a caught out-of-memory error) drops autograd's
    end-of-backward callback; the next forward resets the runtime (before: every later backward
    silently produced no gradient)."""
    num_steps = 3
    want = _reference(num_steps)

    def fn():
        model = _shard(_model())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        x, y = _batch(0)

        def boom(grad):
            raise RuntimeError("simulated out of memory")

        target = model.layers[0] if where == "layer" else model.output
        handle = target.register_full_backward_hook(lambda *a: boom(None))
        with pytest.raises(RuntimeError, match="simulated out of memory"):
            _loss(model, _local(x), _local(y)).backward()
        handle.remove()
        opt.zero_grad()
        for step in range(num_steps):
            x, y = _batch(step)
            _loss(model, _local(x), _local(y)).backward()
            assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
            opt.step()
            opt.zero_grad()
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=2):
        _assert_close(got, want)


def test_post_accumulate_grad_hooks_run_on_the_sharded_gradient():
    """``register_post_accumulate_grad_hook`` on the sharded parameters (an optimizer step inside
    backward, as torchtune does) runs once per parameter per backward with the reduced gradient
    (before: never), and trains like the reference."""
    num_steps = 3
    want = _reference(num_steps)

    def fn():
        model = _shard(_model())
        opts = {p: torch.optim.AdamW([p], lr=LR) for p in model.parameters()}
        calls = []

        def step_in_backward(p):
            calls.append(p)
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(step_in_backward)
        for step in range(num_steps):
            x, y = _batch(step)
            _loss(model, _local(x), _local(y)).backward()
        assert len(calls) == num_steps * sum(p.requires_grad for p in model.parameters())
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=2):
        _assert_close(got, want)


def test_first_forward_under_inference_mode_then_training():
    """The gathered buffer made by a first forward under ``torch.inference_mode()`` is not an
    inference tensor (before: every later training forward raised)."""
    want = _reference(2)

    def fn():
        model = _shard(_model())
        x, y = _batch(0)
        with torch.inference_mode():
            _loss(model, _local(x), _local(y))
        return _train_sharded(model, 2)

    for got in run_distributed(fn, world_size=2):
        _assert_close(got, want)


def test_dtype_change_after_fully_shard_raises_naming_the_parameter():
    """``model.double()`` after sharding cannot change the buckets' dtype: a clear error on every
    rank at the next forward (before: silently ignored, or a crash deep in backward)."""

    def fn():
        model = _shard(_model()).double()
        x, _ = _batch(0)
        with pytest.raises(ValueError, match=r"'embed.weight'.*converted to torch.float64.*before calling fully_shard"):
            model(_local(x))
        return True

    assert run_distributed(fn, world_size=2) == [True, True]


def test_data_assigned_after_a_forward_is_seen_by_full_state_dict_at_once():
    """``p.data = ...`` on a sharded parameter reaches ``full_state_dict`` and checkpoints without
    waiting for the next forward (before: the old values until then)."""

    def fn():
        model = _shard(_model())
        x, y = _batch(0)
        _loss(model, _local(x), _local(y)).backward()
        for p in model.parameters():
            p.data = torch.full_like(p.data, 0.5)
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=2):
        assert all(bool((v == 0.5).all()) for v in got.values())


def _shared_layer_model() -> TinyTransformer:
    """Three layers, the third one the first again: ``layers.0`` runs twice per forward."""
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab_size=101, dim=24, num_heads=2, num_layers=3, mlp_dim=40))
    model.layers[2] = model.layers[0]
    return model


def _two_backwards(model, mode: str, local) -> None:
    if mode == "retain_graph":
        x, y = _batch(0)
        loss = _loss(model, local(x), local(y))
        loss.backward(retain_graph=True)
        loss.backward()
    else:  # two forwards, then their two backwards
        losses = [_loss(model, local(x), local(y)) for x, y in (_batch(0), _batch(1))]
        for loss in losses:
            loss.backward()


@pytest.mark.parametrize("mode", ["retain_graph", "two_forwards_two_backwards"])
def test_a_module_called_twice_with_a_second_backward(mode):
    """A module called twice per forward and a second backward over calls from an earlier forward:
    its gradients after the first reduction are gathered again, reduced and added (before: one
    call's gradient was lost and leaked into the next step)."""

    def train(model, local):
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        _two_backwards(model, mode, local)
        opt.step()
        opt.zero_grad()
        x, y = _batch(2)  # a plain step after it: nothing left over
        _loss(model, local(x), local(y)).backward()
        opt.step()

    model = _shared_layer_model()
    train(model, lambda t: t)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def fn():
        model = _shared_layer_model()
        for layer in model.layers[:2]:
            fsdp_optim.fully_shard(layer)
        fsdp_optim.fully_shard(model)
        train(model, _local)
        return fsdp_optim.full_state_dict(model)

    for got in run_distributed(fn, world_size=2):
        _assert_close({k: v for k, v in got.items()}, {k: want[k] for k in got})


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_weight_tied_across_an_inner_call_stays_tied(world_size):
    """Embedding and output head share their weight; the embedding gets its own inner
    ``fully_shard`` call, the head does not. The head still holds the original tensor the inner call
    replaced: the root call resolves it to the same sharded parameter, so the tie holds and training
    equals the reference (before: silently untied, a second parameter, wrong at W = 1 too)."""
    tied = _model()
    assert tied.output.weight is tied.embed.weight
    num_steps = 3
    want = _reference(num_steps)

    def fn():
        model = _model()
        fsdp_optim.fully_shard(model.embed)
        _shard(model)
        assert model.output.weight is model.embed.weight
        return _train_sharded(model, num_steps)

    for got in run_distributed(fn, world_size=world_size):
        _assert_close(got, want)


def test_a_weight_tied_across_separate_calls_is_refused_on_every_rank():
    """Two sibling layers sharing a weight, each in its own ``fully_shard`` call: the second call
    cannot share the first one's bucket, so it raises naming the parameter and the fix (before:
    silently untied)."""

    def fn():
        model = _model()
        model.layers[1].mlp.w1.weight = model.layers[0].mlp.w1.weight
        fsdp_optim.fully_shard(model.layers[0])
        with pytest.raises(ValueError, match=r"mlp.w1.weight.*shares its parameter.*separate fully_shard call.*common parent"):
            fsdp_optim.fully_shard(model.layers[1])
        return True

    assert run_distributed(fn, world_size=2) == [True, True]


def test_two_models_sharing_a_module_or_a_weight_are_refused_naming_it():
    """A student and a teacher sharing a module (or a parameter): the second root's call cannot
    share the first one's bucket, so it raises naming the parameter (neither is silently untied)."""

    def fn():
        student, teacher = _model(), _model()
        teacher.embed = student.embed  # a shared module
        fsdp_optim.fully_shard(student)
        with pytest.raises(ValueError, match=r"embed.weight \(shape \(\d+, \d+\)\).*another model sharing this module"):
            fsdp_optim.fully_shard(teacher)
        student, teacher = _model(), _model()
        teacher.embed.weight = student.embed.weight  # a shared parameter
        fsdp_optim.fully_shard(student)
        with pytest.raises(ValueError, match=r"embed.weight.*shares its parameter.*separate fully_shard call"):
            fsdp_optim.fully_shard(teacher)
        return True

    assert run_distributed(fn, world_size=2) == [True, True]


@pytest.mark.parametrize("tie", [False, True])
def test_the_root_resharded_after_forward_trains_bitwise_like_the_root_kept(tie):
    """``fully_shard(model, reshard_after_forward=True)`` frees the root's gathered parameters after
    forward and gathers them again for the head's backward (FSDP2 honours it too; it used to be
    ignored). Off the plain path as well: an evaluation forward with grad enabled whose graph is kept
    over the step, accumulation over two micro-batches without sync, a second backward through a
    retained graph, tied embeddings. Bitwise equal to the root kept, at W = 3, and both equal to the
    single-process run of the same sequence (to the sharded-reduction tolerance)."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    world_size = 3

    torch.manual_seed(0)
    ref = TinyTransformer(cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(4):
        x, y = _batch(step)
        if step == 1:  # each rank's first row, then each rank's second: the two global micro-batches
            for k in range(2):
                rows = list(range(k, GLOBAL_BATCH, GLOBAL_BATCH // world_size))
                _loss(ref, x[rows], y[rows]).backward()
        elif step == 2:
            (1.5 * _loss(ref, x, y)).backward()
        else:
            _loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    def train(root_reshard: bool | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = TinyTransformer(cfg)
        for layer in model.layers:
            fsdp_optim.fully_shard(layer)
        fsdp_optim.fully_shard(model, reshard_after_forward=root_reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        kept = None
        for step in range(4):
            x, y = (_local(t) for t in _batch(step))
            if step == 1:  # two micro-batches, the first without sync
                model.set_requires_gradient_sync(False)
                _loss(model, x[:1], y[:1]).backward()
                model.set_requires_gradient_sync(True)
                _loss(model, x[1:], y[1:]).backward()
            elif step == 2:  # a second backward through a retained graph
                loss = _loss(model, x, y)
                loss.backward(retain_graph=True)
                (0.5 * loss).backward()
            else:
                _loss(model, x, y).backward()
            if step == 0:  # an evaluation forward with grad enabled, its graph kept over the step
                kept = _loss(model, x, y)
            opt.step()
            opt.zero_grad()
        del kept
        out = fsdp_optim.full_state_dict(model)
        del model, opt
        return out

    def fn():
        return train(None), train(True)

    for kept_root, freed_root in run_distributed(fn, world_size=world_size):
        _assert_close(kept_root, want)
        assert kept_root.keys() == freed_root.keys()
        for k, v in kept_root.items():
            assert torch.equal(v, freed_root[k]), k
