"""NorMuon on tensor-parallel matrices ([Note: NorMuon under tensor parallelism]).

Reference: our ``NorMuon`` on the unsharded matrices (plain tensors, one process; it is tested against
the authors' algorithm in tests/optimizers/test_normuon.py), fed the sharded run's own reduced
gradients, gathered (tests/_models.py ``feed_gradients``), so both see bitwise the same input. Asserted
bitwise: the parameters and every TP rank's second moments (``ColwiseParallel``: its rows of ``v``;
``RowwiseParallel``: all of ``v``), fp32, bf16 and fp64 parameters, at (dp, tp) = (2, 2), (1, 4) and (3, 1).
Also: the step's only collectives are Muon's two all-to-alls inside the TP group; a checkpoint saved at
(dp 2, tp 2) loads at (dp 2, tp 2) bitwise and the next step equals the uninterrupted one; a load at
another TP size raises; a TP cut NorMuon cannot assemble is refused naming the parameter.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon, NorMuon
from fsdp_optim.sharding.contract import local_tensor
from tests._models import TPConfig, TPTransformer, feed_gradients, tp_backward, tp_sharded

LR, WD, STEPS = 0.02, 0.1, 3
HIDDEN = ("attention.w", "feed_forward.w")
RULE_NAMES = ["tok_embeddings", "output"]
COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "send", "recv")  # fmt: skip


def _is_hidden(name: str) -> bool:
    return any(h in name for h in HIDDEN)


class _Recording:
    """Records every collective ``dist.<name>`` called inside the block: ``(name, group ranks)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...] | None]] = []
        self._real: dict[str, object] = {}

    def __enter__(self) -> _Recording:
        for name in COLLECTIVES:
            real = getattr(dist, name)
            self._real[name] = real

            def recording(*args, _name=name, _real=real, group=None, **kw):
                self.calls.append((_name, tuple(dist.get_process_group_ranks(group)) if group is not None else None))
                return _real(*args, group=group, **kw)

            setattr(dist, name, recording)
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._real.items():
            setattr(dist, name, real)


def _second_moments(opt, model, mesh) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's ``v`` of each hidden matrix it holds, with its TP coordinate."""
    t = mesh.get_coordinate()[1]
    out = {}
    for n, p in model.named_parameters():
        v = opt.state[p].get("second_momentum_buffer")
        if _is_hidden(n) and v is not None and v.numel():
            out[n] = (t, v.clone())
    return out


def _run(dp: int, tp: int, dtype: torch.dtype):
    rule = Muon.rule(embedding_and_head=RULE_NAMES)
    mesh, model, ref = tp_sharded(dp, tp, rule, make=lambda: TPTransformer().to(dtype), plan=True)
    opt = NorMuon(model.parameters(), lr=LR, weight_decay=WD)
    hidden_ref = [p for n, p in ref.named_parameters() if _is_hidden(n)]
    ropt = NorMuon(hidden_ref, lr=LR, weight_decay=WD)
    calls = []
    for step in range(STEPS):
        tp_backward(model, mesh, step)
        feed_gradients(model, ref, keep=_is_hidden)
        with _Recording() as rec:
            opt.step()
        calls.append(rec.calls)
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    hidden = [(n, a) for n, a in model.named_parameters() if _is_hidden(n)]
    diffs = {n: (a.full_tensor().float() - b.float()).abs().max().item() for (n, a), b in zip(hidden, hidden_ref)}
    equal = {n: torch.equal(a.full_tensor(), b) for (n, a), b in zip(hidden, hidden_ref)}
    ref_v = {n: ropt.state[b]["second_momentum_buffer"].clone() for (n, _), b in zip(hidden, hidden_ref)}
    return diffs, equal, _second_moments(opt, model, mesh), ref_v, calls, tuple(mesh["tp"].mesh.tolist())


@pytest.mark.parametrize(
    "dp,tp,dtype",
    [(2, 2, torch.float32), (1, 4, torch.float32), (3, 1, torch.float32), (2, 2, torch.bfloat16), (2, 2, torch.float64)],
    ids=["2x2", "1x4", "3x1", "2x2-bf16", "2x2-fp64"],
)
def test_normuon_on_tp_sharded_matrices_equals_unsharded_normuon_bitwise(dp, tp, dtype):
    out = run_distributed(lambda: _run(dp, tp, dtype), world_size=dp * tp)
    n_matrices = 7 * TPConfig().num_layers
    seen: dict[str, set[int]] = {}
    kinds = set()
    for diffs, equal, second, ref_v, calls, tp_group in out:
        assert len(diffs) == n_matrices
        assert all(equal.values()), diffs
        for n, (t, v) in second.items():
            want = ref_v[n]
            assert v.dtype == want.dtype == dtype, (n, v.dtype)
            if v.numel() == want.numel():  # RowwiseParallel (or no TP): every TP rank holds all rows
                kinds.add("all rows")
                assert torch.equal(v, want), n
            else:  # ColwiseParallel: this TP rank's rows
                kinds.add("own rows")
                assert v.numel() * tp == want.numel(), (n, v.numel())
                assert torch.equal(v, want[t * v.numel() : (t + 1) * v.numel()]), (n, t)
            assert want.abs().sum() > 0, n  # the second moments moved
            seen.setdefault(n, set()).add(t)
        # the step's collectives: Muon's two all-to-alls per step, inside this rank's TP group (none without TP)
        for step_calls in calls:
            assert [c for c, _ in step_calls] == (["all_to_all_single"] * 2 if tp > 1 else []), step_calls
            assert all(ranks == tp_group for _, ranks in step_calls), (step_calls, tp_group)
    assert len(seen) == n_matrices and all(ts == set(range(tp)) for ts in seen.values()), seen
    assert kinds == ({"all rows", "own rows"} if tp > 1 else {"all rows"}), kinds


def _build(dp: int, tp: int):
    rule = Muon.rule(embedding_and_head=RULE_NAMES)
    mesh, model, _ = tp_sharded(dp, tp, rule, plan=True)
    return mesh, model, NorMuon(model.parameters(), lr=LR, weight_decay=WD)


def _step(model, opt, mesh, step: int) -> None:
    tp_backward(model, mesh, step, per_rank=4 // mesh.size(0))  # the same global batch at every layout
    opt.step()
    opt.zero_grad()


def _local(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        out[f"param:{n}"] = local_tensor(p).clone()
        for k, v in opt.state[p].items():
            out[f"state:{n}:{k}"] = v.clone()
    return out


def _global(model, opt) -> dict[str, torch.Tensor]:
    """Parameters and state as global tensors (``state_dict()``'s DTensors, gathered)."""
    names = [n for n, _ in model.named_parameters()]
    out = {f"param:{n}": p.full_tensor() for n, p in model.named_parameters()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if k != "step":
                out[f"state:{names[i]}:{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def _save(path: str):
    mesh, model, opt = _build(2, 2)
    for s in range(2):
        _step(model, opt, mesh, s)
    fsdp_optim.save_checkpoint(path, model=model, optimizer=opt)
    saved, full = _local(model, opt), _global(model, opt)
    _step(model, opt, mesh, 2)
    return saved, _local(model, opt), full, {n: p.full_tensor() for n, p in model.named_parameters()}


def _load(path: str, dp: int, tp: int):
    mesh, model, opt = _build(dp, tp)
    fsdp_optim.load_checkpoint(path, model=model, optimizer=opt)
    loaded, full = _local(model, opt), _global(model, opt)
    _step(model, opt, mesh, 2)
    return loaded, _local(model, opt), full, {n: p.full_tensor() for n, p in model.named_parameters()}


def test_checkpoint_round_trips_at_the_same_tp_size_and_loads_at_other_tp_sizes(tmp_path):
    """``v`` of a TP-cut matrix is checkpointed as the vector of its global rows (``StateShard.rows``):
    at the same TP size every rank's state loads bitwise and the next step equals the uninterrupted one;
    at tp 4, 1 and (1, 2) the global parameters and state equal the saved ones bitwise and the next step
    equals the uninterrupted one up to bf16 Newton–Schulz roundings of another reduction order (the same
    global batch at every layout; measured <= 9e-5; bound lr, as Muon's TP checkpoint test)."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(lambda: _save(path), world_size=4)
    loaded = run_distributed(lambda: _load(path, 2, 2), world_size=4)
    for (before, after, _, _), (got, got_after, _, _) in zip(saved, loaded):
        assert before.keys() == got.keys()
        assert any(k.endswith(":second_momentum_buffer") and v.numel() for k, v in before.items())
        for k, v in before.items():
            assert v.dtype == got[k].dtype and torch.equal(v, got[k]), k
        for k, v in after.items():
            assert torch.equal(v, got_after[k]), k
    _, _, full, uninterrupted = saved[0]
    for dp, tp in [(1, 4), (4, 1), (1, 2)]:
        _, _, got, after = run_distributed(lambda: _load(path, dp, tp), world_size=dp * tp)[0]
        assert got.keys() == full.keys()
        for k, v in full.items():
            assert torch.equal(got[k], v), (dp, tp, k)
        worst = max((after[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
        print(f"NorMuon: saved at (dp 2, tp 2), loaded at (dp {dp}, tp {tp}): next step max |diff| = {worst:.3g}")
        assert worst <= LR, (dp, tp, worst)


def _refused():
    # fused sub-matrices of wo (RowwiseParallel): the TP cut splits each sub-matrix's columns, and
    # NorMuon (as Muon) assembles only whole 2-D matrices over TP
    rule = Muon.rule(embedding_and_head=RULE_NAMES, row_splits={"attention.wo.weight": [16, 16]})
    _, model, _ = tp_sharded(1, 2, rule, plan=True)
    NorMuon(model.parameters(), lr=LR)


def test_a_tp_cut_normuon_cannot_assemble_is_refused_naming_the_parameter():
    with pytest.raises(Exception) as e:
        run_distributed(_refused, world_size=2)
    msg = str(e.value)
    assert "NorMuon: parameter layers.0.attention.wo.weight" in msg and "is tensor-parallel, split along dim 1" in msg, msg
