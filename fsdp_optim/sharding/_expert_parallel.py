"""Expert parallelism: each rank of an EP group keeps whole experts; tokens travel to their owners.

``expert_parallel(experts, group=...)`` shards an experts module in place (its ``[E, ...]``
parameters become this rank's ``[E_local, ...]`` slice, each tagged with an ``ExpertShard``) and
wraps its forward with a dropless dispatch / combine (see [Note: expert parallel dispatch]).

The experts-module contract (what ``expert_parallel`` accepts):

- every parameter (direct or in submodules) has dim 0 = experts, the same ``E`` for all of them
  (``w1``/``w3`` ``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]``, a bias ``[E, hidden]``...);
  buffers are left whole (keep per-expert state in parameters), parameters are not tied elsewhere;
- ``forward(x, num_tokens_per_expert)``: ``x`` is ``[T, dim]`` tokens sorted by expert (expert 0's
  rows first, contiguous), ``num_tokens_per_expert`` a ``[E]`` integer tensor summing to ``T``;
  it returns ``[T, out]`` in the same row order, and treats each row independently (a token's
  output depends only on that row and its expert's weights). ``grouped_linear`` computes it.

After ``expert_parallel`` the caller (the MoE layer) keeps calling
``experts(x, num_tokens_per_expert)`` with this rank's routed tokens sorted by *global* expert id
and the global ``[E]`` counts; the original forward then runs on ``E_local`` experts with the rows
that arrived from every rank, and the result comes back in the caller's row order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ._dist import agree_on_error, rank_and_world_size
from .plan import expert_ranges, token_splits

__all__ = [
    "ExpertGroups",
    "ExpertParallelModule",
    "ExpertShard",
    "expert_parallel",
    "expert_parallel_groups",
    "expert_ranges",
    "expert_shard",
    "local_permutation",
    "token_splits",
]

# [Note: expert parallel dispatch]
# Experts are split whole over the EP group by ``expert_ranges`` (rank r owns a contiguous range;
# sizes differ by at most one, larger first: E = 6 over 4 ranks is 2/2/1/1; every expert has the same
# bytes, so this is also the byte balance). Per forward, on every rank of the group:
#   1. counts: one ``all_to_all_single`` of the caller's ``[E]`` token counts (the slice for rank j's
#      experts goes to j), so rank r learns ``recv[s, e]``: tokens rank s sends to local expert e;
#   2. dispatch: one variable-size ``all_to_all_single`` of the token rows (rank s's rows for rank r's
#      experts are contiguous because the caller sorted them by global expert id). They arrive
#      ordered by (source rank, local expert); a permutation (``local_permutation``) re-sorts them by
#      (local expert, source rank), so each expert's rows are contiguous and, within an expert, in
#      the order of the global batch ``cat(rank 0's tokens, rank 1's, ...)`` sorted stably by expert;
#   3. the original forward runs on exactly those rows with the ``[E_local]`` counts (no padding, no
#      slot for an expert this rank does not own);
#   4. combine: the inverse permutation and the inverse ``all_to_all_single`` return each row to its
#      sender, in the caller's order.
# Both token exchanges are ``_AllToAll`` autograd functions whose backward is the reverse exchange,
# so backward runs the same two collectives in reverse order on every rank. Hence:
#   - when the EP group feeds the whole batch (ep = W), each expert sees the same rows in the same
#     order as a single process holding that batch, so outputs, input gradients and expert weight
#     gradients are bitwise those of that run, provided the experts module computes each expert's
#     block on its own (a per-expert loop). Elementwise ops over all local experts' rows at once
#     (``grouped_linear`` then SiLU) put a row at a different position than in the single-process
#     tensor, and ATen's CPU kernels round a vector body and a scalar tail differently: equal to
#     rounding there. With ep < W an expert only sees its EP group's rows (a smaller matmul block,
#     and replicas' partial gradients summed): equal to rounding too;
#   - the owner's weight gradient already sums every sender's tokens (one matmul over all arrived
#     rows): never all-reduce expert gradients over the EP group. With data parallel over W ranks
#     and a per-rank mean loss, the owner's gradient is W times the global-mean gradient; reduce it
#     over the expert's replicas (the ranks holding the same experts, W / ep of them) and divide by
#     W in total (a SUM over replicas then / W, or an AVG over replicas then / ep);
#   - every rank of the group must call the forward, and the combined output must reach the loss on
#     every rank (else a peer waits in the backward exchange). A rank with no token still calls it.
# Bad counts (wrong shape or dtype, negative, not summing to T) are sent as -1 in step 1 instead of
# skipping it, so every rank raises ValueError after the same collective and none hangs.


@dataclass(frozen=True, kw_only=True)
class ExpertShard:
    """What an expert-parallel parameter knows: its global shape and which experts it holds."""

    num_experts: int
    ep_rank: int
    ep_size: int
    first_expert: int
    """Global id of local expert 0 (the expert offset; the slice is ``[first_expert, + num_local)``)."""
    num_local_experts: int
    global_shape: tuple[int, ...]
    """``(num_experts, *local_shape[1:])``."""
    group: dist.ProcessGroup | None = None
    """The EP group (``None``: the default group)."""

    @property
    def experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.num_local_experts)


_ATTR = "_fsdp_optim_expert_shard"


def expert_shard(p: torch.Tensor) -> ExpertShard | None:
    """``p``'s ``ExpertShard``, or ``None`` for a parameter ``expert_parallel`` did not shard."""
    return getattr(p, _ATTR, None)


# ---- index arithmetic (pure) ------------------------------------------------------------------
def local_permutation(recv_counts: torch.Tensor) -> torch.Tensor:
    """``recv_counts[s, e]`` rows from source ``s`` for local expert ``e`` arrived ordered by
    ``(s, e)``; return ``idx`` with ``arrived[idx]`` ordered by ``(e, s)`` (stable within a block)."""
    ep, n_local = recv_counts.shape
    lengths = recv_counts.reshape(-1)
    starts = torch.cumsum(lengths, 0) - lengths  # where block (s, e) starts on arrival
    lengths_t = recv_counts.t().reshape(-1)  # blocks in target order (e, s)
    starts_t = starts.view(ep, n_local).t().reshape(-1)
    total = int(lengths.sum())
    target_starts = torch.cumsum(lengths_t, 0) - lengths_t
    pos = torch.arange(total, device=recv_counts.device)
    return torch.repeat_interleave(starts_t - target_starts, lengths_t, output_size=total) + pos


# ---- the exchange ------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """Rows ``x[sum(send[:j]) : sum(send[:j+1])]`` go to rank j; ``recv[i]`` rows come from rank i.
    Backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup | None):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def _bad_counts(x: torch.Tensor, counts: torch.Tensor, shard: ExpertShard) -> ValueError | None:
    where = f"(EP rank {shard.ep_rank} of ep_size={shard.ep_size}, num_experts={shard.num_experts})"
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.shape[0] != shard.num_experts:
        shape = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        return ValueError(
            f"num_tokens_per_expert must be a [num_experts] = [{shard.num_experts}] tensor of global "
            f"per-expert counts; got {shape} {where}. Pass the counts for all experts, not the local ones"
        )
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        return ValueError(f"num_tokens_per_expert must be an integer tensor; got {counts.dtype} {where}")
    if x.dim() != 2:
        return ValueError(f"x must be [T, dim] tokens sorted by expert; got {tuple(x.shape)} {where}")
    return None


def _exchange_counts(
    x: torch.Tensor, counts: torch.Tensor, shard: ExpertShard, ranges: list[range]
) -> tuple[list[int], torch.Tensor]:
    """Step 1: validate, send each rank its experts' counts; ``(this rank's counts, recv [ep, E_local])``.
    Raises ValueError on every rank if any rank's counts were bad."""
    err = _bad_counts(x, counts, shard)
    mine: list[int] = []
    if err is None:
        mine = counts.tolist()
        if min(mine) < 0 or sum(mine) != x.shape[0]:
            err = ValueError(
                f"num_tokens_per_expert must be >= 0 and sum to the {x.shape[0]} rows of x; got sum "
                f"{sum(mine)}, min {min(mine)} (EP rank {shard.ep_rank} of ep_size={shard.ep_size})"
            )
    send = (
        torch.full((shard.num_experts,), -1, dtype=torch.int64, device=x.device)
        if err is not None
        else counts.to(device=x.device, dtype=torch.int64)
    )
    recv = send.new_empty((shard.ep_size * shard.num_local_experts,))
    dist.all_to_all_single(
        recv, send, [shard.num_local_experts] * shard.ep_size, [len(r) for r in ranges], group=shard.group
    )
    recv = recv.view(shard.ep_size, shard.num_local_experts)
    if err is not None:
        raise err
    bad = [s for s, row in enumerate(recv.tolist()) if min(row) < 0]
    if bad:
        raise ValueError(
            f"expert parallel forward failed: EP ranks {bad} of ep_size={shard.ep_size} passed invalid "
            f"num_tokens_per_expert (see their error); this is EP rank {shard.ep_rank}"
        )
    return mine, recv


def _dispatch_compute_combine(forward, x: torch.Tensor, counts: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    if shard.ep_size == 1:  # nothing to exchange (no process group needed)
        err = _bad_counts(x, counts, shard)
        if err is None and (int(counts.min()) < 0 or int(counts.sum()) != x.shape[0]):
            err = ValueError(f"num_tokens_per_expert must be >= 0 and sum to the {x.shape[0]} rows of x")
        if err is not None:
            raise err
        return forward(x, counts)
    ranges = expert_ranges(shard.num_experts, shard.ep_size)
    mine, recv_counts = _exchange_counts(x, counts, shard, ranges)
    send_splits = token_splits(mine, ranges)
    recv_splits = recv_counts.sum(1).tolist()
    arrived = _AllToAll.apply(x, recv_splits, send_splits, shard.group)
    local_counts = recv_counts.sum(0)
    reorder = shard.ep_size > 1 and shard.num_local_experts > 1
    if reorder:
        idx = local_permutation(recv_counts)
        inverse = torch.empty_like(idx)
        inverse[idx] = torch.arange(idx.numel(), device=idx.device)
        arrived = arrived.index_select(0, idx)
    y = forward(arrived, local_counts)
    if y.shape[0] != arrived.shape[0]:
        raise ValueError(
            f"the experts forward returned {y.shape[0]} rows for {arrived.shape[0]} tokens; it must return "
            f"one row per token in the input order"
        )
    if reorder:
        y = y.index_select(0, inverse)
    return _AllToAll.apply(y, send_splits, recv_splits, shard.group)


class ExpertParallelModule:
    """Mixed into an experts module's class by ``expert_parallel``; ``forward`` dispatches to the
    owning ranks, runs the original forward on the local experts, and combines."""

    _ep: ExpertShard

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return _dispatch_compute_combine(super().forward, x, num_tokens_per_expert, self._ep)


_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelModule, cls), {})
    return _CLASSES[cls]


def _check_module(experts: nn.Module, ep_size: int) -> int:
    """The contract's shape part; returns E."""
    if isinstance(experts, ExpertParallelModule):
        raise ValueError(f"{type(experts).__name__} is already expert parallel; call expert_parallel once")
    sharded = [name for name, p in experts.named_parameters() if isinstance(p, DTensor)]  # (fully_shard's, or any)
    tp = [name for name, p in experts.named_parameters() if isinstance(p, DTensor) and not hasattr(p, "ragged")]
    if tp:
        raise ValueError(
            f"expert_parallel: the parameters of {type(experts).__name__} ({', '.join(tp)}) are tensor-parallel "
            "DTensors (parallelize_module); expert parallelism with tensor-parallel experts (EP x TP) is not supported "
            "(docs/tensor-parallel.md): leave the experts module out of the TP plan"
        )
    if sharded:
        raise ValueError(
            f"expert_parallel: the parameters of {type(experts).__name__} ({', '.join(sharded)}) are already "
            "sharded (DTensors: by fully_shard, or another parallelism); the order is expert_parallel first, then fully_shard: groups = "
            "expert_parallel_groups(ep); expert_parallel(experts, group=groups.ep); fully_shard(experts, "
            "mesh=groups.replicas); then fully_shard on the layers and the root"
        )
    params = list(experts.named_parameters())
    if not params:
        raise ValueError(f"expert_parallel: {type(experts).__name__} has no parameters; expected [E, ...] weights")
    dims = {name: tuple(p.shape) for name, p in params}
    bad = [n for n, s in dims.items() if len(s) < 1]
    if bad:
        raise ValueError(f"expert_parallel: parameters {bad} are scalars; every parameter must be [E, ...]")
    sizes = {s[0] for s in dims.values()}
    if len(sizes) != 1:
        raise ValueError(
            f"expert_parallel: parameters disagree on dim 0 (the number of experts): {dims}; every "
            f"parameter of the experts module must be [E, ...] with the same E"
        )
    num_experts = sizes.pop()
    expert_ranges(num_experts, ep_size)  # raises for E < ep
    return num_experts


def expert_parallel(experts: nn.Module, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Keep this rank's whole experts of ``experts`` (in place) and route tokens over ``group`` (the
    EP group; default the world). Returns ``experts``, whose class gains ``ExpertParallelModule``.

    Raises ValueError on every rank of ``group`` if the module breaks the contract (module
    docstring) or has fewer experts than ranks.
    """
    ep_rank, ep_size = rank_and_world_size(group)
    if ep_rank < 0:
        raise ValueError(
            f"expert_parallel: this rank is not a member of the EP group (size {ep_size}); call it only "
            f"on the ranks of `group` (build one EP group per replica with dist.new_group on every rank)"
        )
    err, num_experts = None, 0
    try:
        num_experts = _check_module(experts, ep_size)
    except ValueError as e:
        err = ValueError(f"{e} (EP rank {ep_rank} of ep_size={ep_size})")
    shapes = None if err else sorted((n, tuple(p.shape)) for n, p in experts.named_parameters())
    every = agree_on_error(err, group=group, what="expert_parallel", payload=shapes)
    if any(s != shapes for s in every):
        # Same verdict on every rank: all of them saw the same payloads.
        differ = [r for r, s in enumerate(every) if s != every[0]]
        raise ValueError(
            f"expert_parallel: the experts module differs across the EP group (ep_size={ep_size}): ranks "
            f"{differ} have parameters {[every[r] for r in differ]}, rank 0 has {every[0]}; build the same "
            f"full [E, ...] module on every rank before calling expert_parallel"
        )
    mine = expert_ranges(num_experts, ep_size)[ep_rank]
    for module in experts.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            local = nn.Parameter(p.detach()[mine.start : mine.stop].clone(), requires_grad=p.requires_grad)
            setattr(
                local,
                _ATTR,
                ExpertShard(
                    num_experts=num_experts,
                    ep_rank=ep_rank,
                    ep_size=ep_size,
                    first_expert=mine.start,
                    num_local_experts=len(mine),
                    global_shape=tuple(p.shape),
                    group=group,
                ),
            )
            setattr(module, name, local)
    experts._ep = ExpertShard(
        num_experts=num_experts,
        ep_rank=ep_rank,
        ep_size=ep_size,
        first_expert=mine.start,
        num_local_experts=len(mine),
        global_shape=(num_experts,),
        group=group,
    )
    experts.__class__ = _ep_class(type(experts))
    return experts


class ExpertGroups(NamedTuple):
    """This rank's two groups under expert parallelism (``expert_parallel_groups``)."""

    ep: dist.ProcessGroup | None
    """The ranks whose experts together make the whole layer (tokens travel within it)."""
    replicas: dist.ProcessGroup | None
    """The ranks holding the same experts: the mesh of ``fully_shard(experts, mesh=...)``."""


def expert_parallel_groups(ep_size: int, *, group: dist.ProcessGroup | None = None) -> ExpertGroups:
    """Split ``group`` (default: the world; ``W`` ranks) into EP groups of ``ep_size`` contiguous ranks
    (``[i * ep, (i + 1) * ep)``: the all-to-all traffic stays among neighbours, within a node on
    GPUs) and replica groups of the ``W / ep_size`` ranks holding the same experts (``{j, j + ep, ...}``).
    Every rank of ``group`` must call it (it creates every group, in the same order)."""
    rank, world = rank_and_world_size(group)
    if ep_size < 1 or world % ep_size:
        raise ValueError(
            f"expert_parallel_groups: ep_size={ep_size} must divide the world size {world} (ranks per EP group "
            f"times the replicas of each expert); choose an ep of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    if world == 1:
        return ExpertGroups(ep=None, replicas=None)
    members = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    ep = replicas = None
    for i in range(world // ep_size):
        g = dist.new_group([members[i * ep_size + j] for j in range(ep_size)])
        if rank // ep_size == i:
            ep = g
    for j in range(ep_size):
        g = dist.new_group([members[i * ep_size + j] for i in range(world // ep_size)])
        if rank % ep_size == j:
            replicas = g
    return ExpertGroups(ep=ep, replicas=replicas)
