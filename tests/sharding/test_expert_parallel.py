"""Expert parallelism (issue #26): dispatch / compute / combine against a single-process MoE.

The reference is plain torch in one process on the whole batch: a router, top-k, and a per-expert
SwiGLU loop (``_PlainSwiGLU``). Under EP, every rank holds the same weights, keeps its whole experts
(``expert_parallel``) and feeds its own slice of the batch. Each expert sees the same rows in the same
order as the reference, so with the same per-expert module the outputs, input gradients and the
owners' expert gradients are compared bitwise (fp32).

With ``grouped_linear`` experts (``_GroupedSwiGLU``) the SiLU and product run over all of a rank's
arrived rows at once instead of one expert's block; ATen's CPU elementwise kernels round the
vectorized body and the scalar tail of a tensor differently (exp), so a row's last bit depends on
where it sits in the tensor. Those runs are compared with rtol 1e-5 / atol 1e-7 and check the compute
counter instead.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_optim.sharding._expert_parallel import (
    ExpertParallelModule,
    expert_parallel,
    expert_ranges,
    expert_shard,
    local_permutation,
    token_splits,
)
from fsdp_optim.sharding._grouped_mm import count_grouped_mm, grouped_linear
from tests._models import SwiGLUExperts

D, H = 8, 16


class _PlainSwiGLU(SwiGLUExperts):
    """Reference experts: plain torch, one SwiGLU per expert on its contiguous rows."""

    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts, D, H)


class _GroupedSwiGLU(_PlainSwiGLU):
    """The same experts computed with ``grouped_linear`` (what a real experts module would do)."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        h = F.silu(grouped_linear(x, self.w1, num_tokens_per_expert))
        h = h * grouped_linear(x, self.w3, num_tokens_per_expert)
        return grouped_linear(h, self.w2, num_tokens_per_expert)


class _MoE(nn.Module):
    """Router + top-k + experts; tokens handed to the experts sorted (stably) by expert id."""

    def __init__(self, experts: nn.Module, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = nn.Linear(D, num_experts, bias=False)
        self.experts = experts
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        # Row by row (a broadcast product and a last-dim sum), not a matmul: CPU BLAS may round a row
        # differently with a different number of rows, and each rank routes only its slice.
        scores = torch.softmax((x[:, None, :] * self.router.weight).sum(-1), dim=-1)
        if route is None:
            gates, route = torch.topk(scores, self.top_k, dim=-1)
        else:
            gates = scores.gather(1, route)
        flat = route.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        y = self.experts(x.index_select(0, order // self.top_k), counts)
        unsorted = torch.empty_like(y).index_copy(0, order, y)
        return (unsorted.view(-1, self.top_k, y.shape[-1]) * gates.unsqueeze(-1)).sum(1)


def _reference(num_experts: int, top_k: int, x: torch.Tensor, g: torch.Tensor, route=None, scale: float = 1.0):
    """Build the model, run it on the whole batch; ``(state dict, out, x grad, expert grads, router grad)``."""
    moe = _MoE(_PlainSwiGLU(num_experts), num_experts, top_k)
    state = copy.deepcopy(moe.state_dict())
    x = x.clone().requires_grad_()
    out = moe(x, route)
    ((out * g).sum() * scale).backward()
    grads = {n: p.grad for n, p in moe.experts.named_parameters()}
    return state, out.detach(), x.grad, grads, moe.router.weight.grad


def _ep_rank(state, num_experts, top_k, x_full, g_full, bounds, route_full=None, group=None, scale=1.0,
             experts_cls=_PlainSwiGLU):
    """On one rank: the same model, experts sharded, this rank's slice of the batch."""
    rank = dist.get_rank()
    lo, hi = bounds[rank], bounds[rank + 1]
    moe = _MoE(experts_cls(num_experts), num_experts, top_k)
    moe.load_state_dict(state)
    expert_parallel(moe.experts, group=group)
    x = x_full[lo:hi].clone().requires_grad_()
    route = None if route_full is None else route_full[lo:hi]
    with count_grouped_mm() as counter:
        out = moe(x, route)
    ((out * g_full[lo:hi]).sum() * scale).backward()
    shards = {n: expert_shard(p) for n, p in moe.experts.named_parameters()}
    grads = {n: p.grad for n, p in moe.experts.named_parameters()}
    first = shards["w1"].first_expert
    result = dict(
        out=out.detach(), x_grad=x.grad, grads=grads, first=first, n_local=shards["w1"].num_local_experts,
        router_grad=moe.router.weight.grad, rows=counter.rows, calls=counter.calls,
        shapes={n: (tuple(p.shape), shards[n].global_shape) for n, p in moe.experts.named_parameters()},
    )
    del moe, x, out
    return result


def _same(a, b, exact: bool, what: str = "") -> None:
    if exact:
        assert torch.equal(a, b), (what, (a - b).abs().max())
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=what)


def _check_against_reference(results, ref, *, exact: bool) -> None:
    _, out, x_grad, grads, _ = ref
    _same(torch.cat([r["out"] for r in results]), out, exact, "out")
    _same(torch.cat([r["x_grad"] for r in results]), x_grad, exact, "x grad")
    for r in results:
        lo, hi = r["first"], r["first"] + r["n_local"]
        for n, gr in r["grads"].items():
            assert gr is not None, f"{n} has no gradient on the rank owning experts {lo}..{hi - 1}"
            _same(gr, grads[n][lo:hi], exact, f"{n}[{lo}:{hi}]")


def _check_counter(results, top_k, tokens_total) -> None:
    # Dropless, no padding: 3 grouped matmuls (w1, w3, w2) over exactly the routed token slots.
    assert sum(r["rows"] for r in results) == 3 * tokens_total * top_k
    assert all(r["calls"] == 3 for r in results)


# ---- pure index arithmetic ---------------------------------------------------------------------
def test_expert_ranges_are_ragged_and_whole():
    assert expert_ranges(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert expert_ranges(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert expert_ranges(8, 1) == [range(0, 8)]
    assert expert_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    for e in range(1, 20):
        for ep in range(1, e + 1):
            rs = expert_ranges(e, ep)
            assert [x for r in rs for x in r] == list(range(e))
            assert max(map(len, rs)) - min(map(len, rs)) <= 1
    with pytest.raises(ValueError, match="num_experts=3 < ep_size=4"):
        expert_ranges(3, 4)
    with pytest.raises(ValueError, match="ep_size must be >= 1"):
        expert_ranges(3, 0)


def test_token_splits_and_local_permutation():
    assert token_splits([3, 0, 2, 1, 4, 0], expert_ranges(6, 4)) == [3, 3, 4, 0]
    # Brute force: rows tagged (source, expert) in arrival order, re-sorted stably by expert.
    torch.manual_seed(1)
    for ep, n_local in [(1, 3), (2, 1), (3, 2), (4, 3)]:
        recv = torch.randint(0, 4, (ep, n_local))
        recv[0, 0] = 0
        tags = [(s, e, i) for s in range(ep) for e in range(n_local) for i in range(int(recv[s, e]))]
        want = sorted(range(len(tags)), key=lambda j: (tags[j][1], tags[j][0], tags[j][2]))
        assert local_permutation(recv).tolist() == want


def test_grouped_linear_loop_matches_per_group_matmul():
    torch.manual_seed(2)
    w = torch.randn(4, 5, 3, requires_grad=True)
    counts = torch.tensor([2, 0, 3, 1])
    x = torch.randn(6, 3)
    with count_grouped_mm() as c:
        y = grouped_linear(x, w, counts)
    want = torch.cat([x[0:2] @ w[0].T, x[2:5] @ w[2].T, x[5:6] @ w[3].T])
    assert torch.equal(y, want)
    assert (c.calls, c.rows, c.fused_calls) == (1, 6, 0)
    y.sum().backward()
    assert torch.equal(w.grad[1], torch.zeros(5, 3))
    # No token at all: an empty result that still gives the weight a (zero) gradient.
    w.grad = None
    grouped_linear(x[:0], w, torch.zeros(4, dtype=torch.long)).sum().backward()
    assert w.grad is not None and not w.grad.any()
    with pytest.raises(ValueError, match=r"num_tokens_per_group must be \[G\] = \[4\]"):
        grouped_linear(x, w, counts[:3])


def test_expert_parallel_without_process_group_is_identity():
    torch.manual_seed(3)
    experts = _GroupedSwiGLU(4)
    w1 = experts.w1.detach().clone()
    expert_parallel(experts)
    assert isinstance(experts, ExpertParallelModule) and isinstance(experts, _GroupedSwiGLU)
    s = expert_shard(experts.w1)
    assert (s.ep_size, s.first_expert, s.num_local_experts, s.global_shape) == (1, 0, 4, (4, H, D))
    assert torch.equal(experts.w1, w1)
    x = torch.randn(5, D)
    assert experts(x, torch.tensor([1, 2, 0, 2])).shape == (5, D)
    with pytest.raises(ValueError, match="already expert parallel"):
        expert_parallel(experts)
    with pytest.raises(ValueError, match=r"must be a \[num_experts\] = \[4\] tensor"):
        experts(x, torch.tensor([3, 2]))
    mixed = _GroupedSwiGLU(4)
    mixed.w2 = nn.Parameter(torch.zeros(3, D, H))
    with pytest.raises(ValueError, match="disagree on dim 0"):
        expert_parallel(mixed)


# ---- dispatch / combine against the single-process reference ------------------------------------
@pytest.mark.parametrize("num_experts", [8, 6])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_ep_matches_single_process(dist_run, ep, num_experts):
    top_k, per_rank = 2, 6
    torch.manual_seed(10 * ep + num_experts)
    x = torch.randn(ep * per_rank, D)
    g = torch.randn(ep * per_rank, D)
    ref = _reference(num_experts, top_k, x, g)
    bounds = [r * per_rank for r in range(ep + 1)]
    results = dist_run(lambda: _ep_rank(ref[0], num_experts, top_k, x, g, bounds), world_size=ep)
    _check_against_reference(results, ref, exact=True)
    ranges = expert_ranges(num_experts, ep)
    for r, rg in zip(results, ranges):
        assert (r["first"], r["n_local"]) == (rg.start, len(rg))
        assert r["shapes"]["w1"] == ((len(rg), H, D), (num_experts, H, D))
        assert r["shapes"]["w2"] == ((len(rg), D, H), (num_experts, D, H))
    # Router (data parallel): per-rank gradients sum to the reference's.
    torch.testing.assert_close(sum(r["router_grad"] for r in results), ref[4], rtol=1e-5, atol=1e-6)


def _routes(case: str, sizes: list[int]) -> tuple[torch.Tensor, int]:
    """Forced routing per rank for the edge cases (E = 8 over 4 ranks: rank r owns 2r, 2r+1)."""
    if case == "one_expert":  # every token of every rank goes to expert 3 (rank 1)
        return torch.full((sum(sizes), 1), 3), 1
    # "no_local": rank 0 sends to experts 0 and 5; ranks 1-3 only to experts 0 and 1 (rank 0's), so
    # ranks 1 and 3 receive nothing, experts 2, 3, 4, 6, 7 get no token; rank 2 has no token at all.
    per_rank = [[0, 5], [0, 1], [0, 1], [1, 0]]
    return torch.cat([torch.tensor(per_rank[r]).expand(n, 2) for r, n in enumerate(sizes)]), 2


def test_grouped_experts_under_ep_compute_only_routed_tokens(dist_run):
    num_experts, top_k, per_rank, ep = 6, 2, 7, 4
    torch.manual_seed(6)
    x, g = torch.randn(ep * per_rank, D), torch.randn(ep * per_rank, D)
    ref = _reference(num_experts, top_k, x, g)
    bounds = [r * per_rank for r in range(ep + 1)]
    results = dist_run(
        lambda: _ep_rank(ref[0], num_experts, top_k, x, g, bounds, experts_cls=_GroupedSwiGLU), world_size=ep
    )
    _check_against_reference(results, ref, exact=False)
    _check_counter(results, top_k, ep * per_rank)


@pytest.mark.parametrize("experts_cls", [_PlainSwiGLU, _GroupedSwiGLU])
@pytest.mark.parametrize("case", ["no_local", "one_expert"])
def test_ep_edge_cases(dist_run, case, experts_cls):
    sizes = [5, 4, 0, 3] if case == "no_local" else [3, 4, 2, 5]
    route, top_k = _routes(case, sizes)
    torch.manual_seed(4)
    x, g = torch.randn(sum(sizes), D), torch.randn(sum(sizes), D)
    ref = _reference(8, top_k, x, g, route)
    bounds = [sum(sizes[:r]) for r in range(5)]
    results = dist_run(
        lambda: _ep_rank(ref[0], 8, top_k, x, g, bounds, route, experts_cls=experts_cls), world_size=4
    )
    _check_against_reference(results, ref, exact=experts_cls is _PlainSwiGLU)
    for r in results:  # experts that got no token: a zero gradient, not None
        for n, gr in r["grads"].items():
            for e in range(r["first"], r["first"] + r["n_local"]):
                if not (route == e).any():
                    assert not gr[e - r["first"]].any(), (n, e)
    if experts_cls is _PlainSwiGLU:
        return
    _check_counter(results, top_k, sum(sizes))
    if case == "no_local":
        assert [r["rows"] for r in results] == [3 * (5 + 2 * 4 + 2 * 3), 0, 3 * 5, 0]
        assert torch.equal(results[1]["grads"]["w1"], torch.zeros(2, H, D))
    else:
        assert [r["rows"] for r in results] == [0, 3 * sum(sizes), 0, 0]


def test_ep_times_dp_gradient_divide_factor(dist_run):
    """W = 4 data-parallel ranks, EP groups {0, 1} and {2, 3}; each rank's loss a mean over its own
    tokens. An expert's gradient, summed over its replicas ({0, 2} or {1, 3}) and divided by W (not
    by the 2 replicas), equals the gradient of the global-mean loss. Not bitwise here: an expert's
    matmul runs over its EP group's rows only (fewer rows than the reference's block, which CPU BLAS
    may round differently) and the replicas' partial gradients are summed; rtol 1e-5 / atol 1e-7."""
    num_experts, top_k, per_rank, world = 6, 2, 5, 4
    torch.manual_seed(5)
    x, g = torch.randn(world * per_rank, D), torch.randn(world * per_rank, D)
    ref = _reference(num_experts, top_k, x, g, scale=1.0 / (world * per_rank))
    bounds = [r * per_rank for r in range(world + 1)]

    def fn():
        ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        rank = dist.get_rank()
        r = _ep_rank(ref[0], num_experts, top_k, x, g, bounds, group=ep_groups[rank // 2], scale=1.0 / per_rank)
        for gr in r["grads"].values():
            dist.all_reduce(gr, group=replica_groups[rank % 2])
            gr.div_(world)
        return r

    results = dist_run(fn, world_size=world)
    _same(torch.cat([r["out"] for r in results]), ref[1], False, "out")
    for r in results:
        lo, hi = r["first"], r["first"] + r["n_local"]
        for n, gr in r["grads"].items():
            _same(gr, ref[3][n][lo:hi], False, n)
            # The factor matters: dividing by the 2 replicas only would be 2x off.
            assert not torch.allclose(gr * 2, ref[3][n][lo:hi], rtol=1e-3, atol=0)


# ---- bad input: ValueError on every rank, no hang ------------------------------------------------
def _errors_on_every_rank(dist_run, fn, world_size):
    def wrapped():
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    msgs = dist_run(wrapped, world_size=world_size, timeout=60)
    assert all(m is not None for m in msgs), msgs
    return msgs


def test_fewer_experts_than_ranks_raises_everywhere(dist_run):
    msgs = _errors_on_every_rank(dist_run, lambda: expert_parallel(_GroupedSwiGLU(3)), 4)
    assert all("num_experts=3 < ep_size=4" in m for m in msgs), msgs


def test_modules_that_differ_across_ranks_raise_everywhere(dist_run):
    msgs = _errors_on_every_rank(dist_run, lambda: expert_parallel(_GroupedSwiGLU(4 + 2 * dist.get_rank())), 2)
    assert all("differs across the EP group" in m for m in msgs), msgs


@pytest.mark.parametrize("bad", ["local_counts", "wrong_sum", "float_counts"])
def test_bad_counts_raise_on_every_rank(dist_run, bad):
    def fn():
        torch.manual_seed(0)
        experts = expert_parallel(_GroupedSwiGLU(6))
        x = torch.randn(4, D)
        counts = torch.tensor([1, 0, 1, 1, 0, 1])
        if dist.get_rank() == 1:
            counts = {"local_counts": torch.tensor([2, 2]), "wrong_sum": counts + 1,
                      "float_counts": counts.float()}[bad]
        experts(x, counts)

    msgs = _errors_on_every_rank(dist_run, fn, 4)
    want = {"local_counts": "must be a [num_experts] = [6] tensor", "wrong_sum": "sum to the 4 rows",
            "float_counts": "integer tensor"}[bad]
    assert want in msgs[1] and "EP rank 1 of ep_size=4" in msgs[1], msgs[1]
    assert all("EP ranks [1] of ep_size=4 passed invalid" in msgs[r] for r in (0, 2, 3)), msgs
