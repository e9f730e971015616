"""Expert parallelism under fully_shard (issue #26): experts split whole over an EP group, each local
slice FSDP-sharded over the ranks holding the same experts ([Note: separate roots]), the dense part
sharded over the world. Training equals a single process on the global batch (torch.optim.AdamW, the
reference nobody here wrote), and Muon on the experts equals torch.optim.Muon per expert matrix,
bitwise, with no collective in its step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon
from fsdp_optim.sharding import RaggedDTensor, expert_parallel, expert_parallel_groups
from fsdp_optim.sharding.contract import local_shard
from fsdp_optim.sharding._fully_shard import _STATE
from tests._models import SwiGLUExperts

D, H, TOP_K, ROWS, STEPS, LR = 8, 12, 2, 24, 3, 1e-2


class _Net(nn.Module):
    """A dense layer, a top-k routed MoE and a dense head."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.router = nn.Linear(D, num_experts, bias=False)
        self.experts = SwiGLUExperts(num_experts, D, H)
        self.head = nn.Linear(D, 3)
        self.num_experts = num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        # Row by row (a product and a last-dim sum): a matmul's rounding may depend on the row count.
        scores = torch.softmax((h[:, None, :] * self.router.weight).sum(-1), dim=-1)
        gates, route = torch.topk(scores, TOP_K, dim=-1)
        flat = route.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        y = self.experts(h.index_select(0, order // TOP_K), counts)
        y = torch.empty_like(y).index_copy(0, order, y)
        return self.head(h + (y.view(-1, TOP_K, D) * gates.unsqueeze(-1)).sum(1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, D, generator=g), torch.randn(ROWS, 3, generator=g)


def _reference(num_experts: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _Net(num_experts)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _shard(model: _Net, ep: int, blocks=None) -> None:
    groups = expert_parallel_groups(ep)
    expert_parallel(model.experts, group=groups.ep)
    fsdp_optim.fully_shard(model.experts, mesh=groups.replicas, blocks=blocks)
    fsdp_optim.fully_shard(model, blocks=blocks)


def _gathered(module: nn.Module) -> bool:
    b = getattr(module, _STATE).bucket
    return b.gathered is not None and b.gathered.untyped_storage().nbytes() > 0


def _pieces(model: nn.Module) -> dict[str, tuple[tuple[int, ...], int, torch.Tensor]]:
    """Each parameter's (whole shape, where this rank's piece starts in it, the piece)."""
    return {
        n: (tuple(p.shape), p.local_range[0], p.to_local().clone())
        for n, p in model.named_parameters()
        if isinstance(p, RaggedDTensor)
    }


def _assemble(ranks: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for pieces in ranks:
        for n, (shape, start, flat) in pieces.items():
            full = out.setdefault(n, torch.full(shape, float("nan")))
            hits = covered.setdefault(n, torch.zeros(shape, dtype=torch.int64))
            full.view(-1)[start : start + flat.numel()] = flat
            hits.view(-1)[start : start + flat.numel()] += 1
    for n, hits in covered.items():
        assert bool((hits == 1).all()), f"{n}: the ranks' pieces do not cover it exactly once"
    return out


@pytest.mark.parametrize("num_experts", [8, 6])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_training_equals_one_process(ep, num_experts):
    reference, ref_losses = _reference(num_experts)

    def fn():
        world, rank = dist.get_world_size(), dist.get_rank()
        model = _Net(num_experts)
        _shard(model, ep)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, freed = [], []
        n = ROWS // world
        for step in range(STEPS):
            x, y = _batch(step)
            pred = model(x[rank * n : (rank + 1) * n])
            # Between forward and backward the experts' bucket is freed, as any inner bucket (it
            # was kept gathered, as a root's, from its forward to its backward); the root's is kept.
            freed.append([not _gathered(m) for m in (model.experts, model)])
            loss = F.mse_loss(pred, y[rank * n : (rank + 1) * n])
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        mean = torch.stack(losses)
        dist.all_reduce(mean)
        out = _pieces(model), (mean / world).tolist(), freed
        del model, opt
        return out

    ranks = run_distributed(fn, world_size=4)
    assert all(f == [[True, False]] * STEPS for *_, f in ranks)
    params = _assemble([r[0] for r in ranks])
    assert set(params) == set(reference)
    for k, v in reference.items():
        torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=k)
    torch.testing.assert_close(torch.tensor(ranks[0][1]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def test_muon_on_experts_is_torch_muon_per_matrix_without_collectives():
    # After one backward at W = 4, ep = 2 (each expert slice FSDP-sharded over 2 ranks, whole expert
    # matrices by Muon's rule), each rank steps the expert matrices it holds whole: equal to
    # torch.optim.Muon on each matrix bitwise, and no collective in step().
    def fn():
        model = _Net(8)
        _shard(model, 2, blocks=Muon.blocks)
        x, y = _batch(0)
        rank, n = dist.get_rank(), ROWS // 4
        F.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        experts = [p for p in model.experts.parameters()]
        refs = []
        for p in experts:
            info = local_shard(p)
            # an expert-parallel weight is one DTensor of its whole [E, ...] shape over the world
            assert p.shape[0] == model.num_experts and info.world_size == dist.get_world_size()
            for off, r, c in info.owned_matrices():
                w = nn.Parameter(p.to_local()[off - info.start : off - info.start + r * c].view(r, c).clone())
                w.grad = p.grad.to_local()[off - info.start : off - info.start + r * c].view(r, c).clone()
                refs.append((p, off - info.start, w))
        ref_opt = torch.optim.Muon([w for _, _, w in refs], lr=0.02, momentum=0.9, weight_decay=0.0)
        ref_opt.step()
        opt = Muon(experts, lr=0.02, momentum=0.9, weight_decay=0.0)
        with CommDebugMode() as comm:
            opt.step()
        equal = all(torch.equal(p.to_local()[o : o + w.numel()].view_as(w), w.detach()) for p, o, w in refs)
        out = equal, len(refs), comm.get_total_counts()
        del model, opt, ref_opt
        return out

    for equal, num_matrices, num_collectives in run_distributed(fn, world_size=4):
        assert equal and num_collectives == 0
        assert num_matrices > 0


def test_experts_planned_with_the_rest_are_refused():
    # The experts' own fully_shard call (over the ranks holding the same experts) must come first.
    def fn():
        model = _Net(4)
        groups = expert_parallel_groups(2)
        expert_parallel(model.experts, group=groups.ep)
        try:
            fsdp_optim.fully_shard(model)
        except ValueError as e:
            return str(e)
        return None

    for msg in run_distributed(fn, world_size=2):
        assert msg is not None and "call fully_shard on the experts module itself first" in msg


def test_experts_sharded_over_ranks_holding_other_experts_are_refused():
    def fn():
        model = _Net(4)
        groups = expert_parallel_groups(2)
        expert_parallel(model.experts, group=groups.ep)
        try:
            fsdp_optim.fully_shard(model.experts, mesh=groups.ep)  # the EP group: ranks with other experts
        except ValueError as e:
            return str(e)
        return None

    for msg in run_distributed(fn, world_size=2):
        assert msg is not None and "the experts they hold" in msg


def _wrong_order(then_expert_parallel: bool):
    """fully_shard on the experts before expert_parallel (issue 37: the advice was about passing the same
    DeviceMesh, wrong for this mistake), then expert_parallel or not, then the root."""

    def fn():
        model = _Net(4)
        groups = expert_parallel_groups(2)
        try:
            fsdp_optim.fully_shard(model.experts, mesh=groups.replicas)
            if then_expert_parallel:
                expert_parallel(model.experts, group=groups.ep)
            fsdp_optim.fully_shard(model)
        except ValueError as e:
            return str(e)
        return None

    return run_distributed(fn, world_size=4)


def test_expert_parallel_after_fully_shard_names_the_order():
    for msg in _wrong_order(then_expert_parallel=True):
        assert msg is not None and msg.startswith(
            "expert_parallel: the parameters of ShardedSwiGLUExperts (w1, w3, w2) are already sharded (DTensors: by "
            "fully_shard, or another parallelism); "
            "the order is expert_parallel first, then fully_shard: groups = expert_parallel_groups(ep); "
            "expert_parallel(experts, group=groups.ep); fully_shard(experts, mesh=groups.replicas)"
        ), msg


def test_experts_sharded_over_fewer_ranks_without_expert_parallel_names_it():
    for msg in _wrong_order(then_expert_parallel=False):
        assert msg is not None and (
            "SwiGLUExperts was sharded over a mesh of world size 2 (1 replicas) but its root _Net over world size 4"
            in msg
        ), msg
        assert "for experts, the order is expert_parallel first, then fully_shard (groups = " in msg, msg


def test_ep_groups_refuse_an_ep_that_does_not_divide_the_world():
    def fn():
        try:
            expert_parallel_groups(2)
        except ValueError as e:
            return str(e)

    for msg in run_distributed(fn, world_size=3):
        assert "ep_size=2 must divide the world size 3" in msg


def test_clip_grad_norm_counts_each_expert_once():
    # The total norm equals torch's on the single-process model (the gradients are those of the global
    # batch, averaged), whatever the experts' and the dense part's groups.
    ref = _Net(6)
    x, y = _batch(0)
    F.mse_loss(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)

    def fn():
        model = _Net(6)
        _shard(model, 2)
        rank, n = dist.get_rank(), ROWS // 4
        F.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        total = fsdp_optim.clip_grad_norm_(model.parameters(), 1e-3)
        del model
        return total

    for total in run_distributed(fn, world_size=4):
        torch.testing.assert_close(total, want, rtol=1e-5, atol=0)


def _train_ep(model: _Net, opt, steps: range) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    n = ROWS // world
    for step in steps:
        x, y = _batch(step)
        F.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        opt.step()
        opt.zero_grad()


def _muon_run(path: str, *, ep: int, load: bool, save: bool, steps: range) -> tuple[dict, dict]:
    model = _Net(6)
    _shard(model, ep, blocks=Muon.blocks)
    opt = Muon(model.parameters(), lr=0.02, momentum=0.9, adamw_lr=LR)
    if load:
        fsdp_optim.load_checkpoint(path, model=model, optimizer=opt)
    loaded = fsdp_optim.full_state_dict(model)
    _train_ep(model, opt, steps)
    if save:
        fsdp_optim.save_checkpoint(path, model=model, optimizer=opt)
    out = loaded, fsdp_optim.full_state_dict(model)
    del model, opt
    return out


@pytest.mark.parametrize(("ep_to", "world_to"), [(4, 4), (1, 2)])
def test_checkpoints_reshard_across_ep(tmp_path, ep_to, world_to):
    # Saved at (ep = 2, W = 4) after 2 Muon steps, loaded at another (ep, W): the loaded model is the
    # saved one bitwise, and one more step equals the uninterrupted run's third (to reduction rounding:
    # the world size changes the gradient sums; Muon's state is the saved momentum, resharded).
    path = str(tmp_path / "ckpt")
    straight = run_distributed(lambda: _muon_run(path + "x", ep=2, load=False, save=False, steps=range(3)), world_size=4)
    saved = run_distributed(lambda: _muon_run(path, ep=2, load=False, save=True, steps=range(2)), world_size=4)
    resumed = run_distributed(lambda: _muon_run(path, ep=ep_to, load=True, save=False, steps=range(2, 3)), world_size=world_to)
    for loaded, after in resumed:
        assert set(loaded) == set(saved[0][1])
        for k, v in saved[0][1].items():
            assert torch.equal(loaded[k], v), k
        for k, v in straight[0][1].items():
            torch.testing.assert_close(after[k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_full_state_dict_round_trip_gives_and_takes_whole_experts():
    # full_state_dict gives the whole [E, ...] experts (equal to the unsharded model's), and
    # load_full_state_dict (from every rank, and broadcast from rank 0) takes them back.
    reference = _Net(6).state_dict()

    def fn():
        model = _Net(6)
        _shard(model, 2)
        sd = fsdp_optim.full_state_dict(model)
        target = _Net(6)
        with torch.no_grad():
            for p in target.parameters():
                p.zero_()
        _shard(target, 2)
        fsdp_optim.load_full_state_dict(target, sd if dist.get_rank() == 0 else None, broadcast_from_rank0=True)
        back = fsdp_optim.full_state_dict(target)
        target2 = _Net(5 + 1)
        _shard(target2, 2)
        fsdp_optim.load_full_state_dict(target2, {k: torch.zeros_like(v) for k, v in sd.items()})
        zeros = fsdp_optim.full_state_dict(target2)
        del model, target, target2
        return sd, back, zeros

    for sd, back, zeros in run_distributed(fn, world_size=4):
        for k, v in reference.items():
            assert torch.equal(sd[k], v) and torch.equal(back[k], v), k
            assert not zeros[k].any(), k


def test_export_hf_and_load_hf_give_and_take_whole_experts(tmp_path):
    # export_hf at (ep = 2, W = 4) writes whole [E, ...] experts (safetensors read back: the unsharded
    # model's tensors); load_hf at (ep = 4, W = 4) takes them back.
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    reference = _Net(6).state_dict()
    path = tmp_path / "hf"

    def export():
        model = _Net(6)
        _shard(model, 2)
        fsdp_optim.export_hf(model, path, config=transformers.PretrainedConfig())
        del model

    def load():
        model = _Net(6)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        _shard(model, 4)
        fsdp_optim.load_hf(model, path)
        out = fsdp_optim.full_state_dict(model)
        del model
        return out

    run_distributed(export, world_size=4)
    written = {}
    for f in sorted(path.glob("*.safetensors")):
        written.update(safetensors_torch.load_file(str(f)))
    assert set(written) == set(reference)
    for k, v in reference.items():
        assert torch.equal(written[k], v), k
    for sd in run_distributed(load, world_size=4):
        for k, v in reference.items():
            assert torch.equal(sd[k], v), k
