"""Choose the mesh: the HSDP shape (replicas x shard size), or for an MoE preset the expert-parallel
degree, with the least modeled step time whose busiest rank fits in memory (``suggest_mesh``,
``fsdp-optim plan --suggest``).

[Note: mesh suggestion model]
Every divisor ``N`` of the world size ``W`` is a candidate shard size (``R = W / N`` replicas; ``N = W``
is pure FSDP). Each is planned with ``plan_model`` over ``N`` ranks (the plan a replica holds) and
priced per step on the busiest rank:

- memory: its sharded elements x ``state_bytes`` (fp32 parameter, gradient and two optimizer
  moments: 16) plus two gathered buckets (the one in use and the prefetched one) x
  ``gathered_bytes`` (a bf16 parameter and an fp32 gradient: 6), plus the per-block state a rule
  declares (``rule.block_state_bytes(shape, spec) -> [(flat offset, bytes)]``, on the rank holding
  that element: Shampoo's factors and inverse roots, per strip, on the rank holding its first
  element, as ``Shampoo`` keeps them). Activations are not modeled: pass ``memory_per_rank`` net of them;
- time: per bucket two all-gathers (forward, backward) at ``param_bytes`` and one reduce-scatter at
  ``grad_bytes``, as the runtime moves them (even: one ring; ragged: grouped or padded, whichever
  ``choose_wire_mode`` picks), the two all-to-alls of split blocks where the plan split one
  (``optim_bytes`` per element each way, or the rule's ``exchange_bytes = (out, back)``: Shampoo
  sends raw and filtered gradients out and the direction back, fp32), and with
  ``R > 1`` an all-reduce of the rank's gradient segment over the replicas. The alpha-beta formulas
  are those of ``_wire.py`` (the model ``benchmarks/comm_model.py`` uses); no overlap with compute.

Candidates whose memory lower bound (parameters x ``state_bytes`` / N, plus the rule's block state
/ N) already exceeds the budget are not planned. The fitting candidate with the least time wins (ties: the larger shard size, less memory).

[Note: tensor-parallel candidates]
When no data-parallel shape fits (and the model is a dense preset), TP degrees ``tp`` in 2, 4, 8 that
divide ``W`` (and the heads, key/value heads, FFN width and vocabulary) are candidates, laid out as
torchtitan's Llama plan lays them out: q/k/v and gate/up projections split by rows, o/down projections
by columns, the embedding and the head by vocabulary rows, each split tensor ``1 / tp`` of its bytes on
a rank; norms (and any other tensor) replicated whole. Every shape above is then tried on those
TP-local tensors over the ``W / tp`` data-parallel ranks (memory and data-parallel collectives as
above). TP's own activation collectives are not modeled, so among the fitting candidates the least
``tp`` wins, then the least modeled time.

[Note: expert-parallel candidates]
For an MoE preset every EP degree ``ep`` dividing ``W`` (``1 < ep <= E``) is a candidate too, laid out as
``expert_parallel`` + ``fully_shard`` lay it out (docs/expert-parallel.md): the routed experts of each
layer split whole over ``ep`` ranks (the busiest holds ``ceil(E / ep)``), each rank's slice planned over
the ``W / ep`` ranks holding the same experts, the dense part (attention, router, shared experts, norms,
embedding, head) planned over all ``W`` ranks (pure FSDP: HSDP replicas of the dense part with EP are not
supported yet). Rank ``r`` holds its dense segments and its experts' segment ``r // ep`` of the expert
plan; gathered: the biggest dense bucket and the biggest expert bucket, twice. Time: both plans'
collectives as above, plus the token exchanges per MoE layer: 4 all-to-alls over the EP group
(dispatch and combine, forward and backward) of ``tokens_per_rank x top_k x hidden x act_bytes x
(ep - 1) / ep`` bytes each (dropless, every expert its average share), and one of the ``[E]`` counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from ._blocks import BlockRule
from ._plan import Layout, Plan, PlanConfig, TensorSpec, config_for_rules
from ._planner import plan_model
from ._presets import PRESETS, preset_buckets, preset_shapes
from ._wire import LinkModel, WireMode, all_reduce_seconds, all_to_all_seconds, choose_wire_mode
from ._wire import grouped_seconds, padded_seconds, split_exchange

__all__ = ["MeshCandidate", "MeshSuggestion", "suggest_mesh", "module_buckets", "block_state_per_rank"]


class MeshCandidate(NamedTuple):
    """One HSDP shape and the figures behind it (see [Note: mesh suggestion model])."""

    shard_size: int
    num_replicas: int
    max_rank_bytes: int
    """Modeled memory of the busiest rank (sharded state + two gathered buckets)."""
    fits: bool
    collective_seconds: float
    """Modeled collective time per step on the busiest rank."""
    balance_ratio: float
    """The plan's busiest rank parameter bytes over the mean (``PlanStats.balance_ratio``)."""
    num_split_blocks: int
    planned: bool
    """False: skipped, its memory lower bound does not fit (``max_rank_bytes`` is that bound)."""
    ep: int = 1
    """Expert-parallel degree (1: none); with ``ep > 1`` the shape is ``ep`` x ``W / ep`` for the experts and
    pure FSDP (``shard_size = W``) for the rest: [Note: expert-parallel candidates]."""
    tp: int = 1
    """Tensor-parallel degree (1: none); with ``tp > 1`` the shape is ``num_replicas x shard_size`` over the
    ``W / tp`` data-parallel ranks, of the TP-local tensors: [Note: tensor-parallel candidates]."""


class MeshSuggestion(NamedTuple):
    """``suggest_mesh``'s answer: the chosen shape, its figures, and every candidate considered."""

    shard_size: int
    num_replicas: int
    max_rank_bytes: int
    collective_seconds: float
    plan: Plan
    """The chosen shard group's plan (with ``ep > 1``: the dense part's, over all ranks)."""
    candidates: tuple[MeshCandidate, ...]
    ep: int = 1
    """The chosen expert-parallel degree (1: none)."""
    expert_plan: Plan | None = None
    """With ``ep > 1``: the plan of one rank's experts over the ``W / ep`` ranks holding the same experts."""
    tp: int = 1
    """The chosen tensor-parallel degree (1: none; the plan is then of the TP-local tensors)."""


def module_buckets(module: nn.Module, *, rule: BlockRule, itemsize: int = 4) -> list[tuple[str, list[TensorSpec]]]:
    """Planner input from a module's parameter shapes: one bucket per top-level child (per item of a
    top-level ``nn.ModuleList`` / ``nn.Sequential``, e.g. ``layers.3``), in registration order, plus
    one for the root's own parameters; each spec from ``rule(fqn, param, owner module)``."""
    groups: dict[str, list[TensorSpec]] = {}
    for mname, mod in module.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            fqn = f"{mname}.{pname}" if mname else pname
            parts = mname.split(".") if mname else []
            top = module.get_submodule(parts[0]) if parts else None
            key = ".".join(parts[:2]) if isinstance(top, (nn.ModuleList, nn.Sequential)) and len(parts) > 1 else (parts[0] if parts else "")
            spec = rule(fqn, p, mod)
            groups.setdefault(key, []).append(TensorSpec(name=fqn, shape=tuple(p.shape), spec=spec, itemsize=itemsize))
    return [(k or "root", v) for k, v in groups.items()]


def block_state_per_rank(plan: Plan, rule: BlockRule) -> np.ndarray:
    """Per rank of ``plan``: bytes of the per-block state ``rule.block_state_bytes`` declares (zeros
    for a rule without), each block's on the rank holding the element it names."""
    out = np.zeros(plan.world_size)
    fn = getattr(rule, "block_state_bytes", None)
    if fn is None:
        return out
    cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for b in plan.buckets:
        bounds = np.asarray(b.rank_bounds, dtype=np.int64)
        for p in b.placements:
            key = (tuple(p.shape), p.spec)
            if key not in cache:
                pairs = fn(p.shape, p.spec) if p.numel else []
                cache[key] = (np.asarray([o for o, _ in pairs], dtype=np.int64), np.asarray([n for _, n in pairs], dtype=np.float64))
            offs, nbytes = cache[key]
            if len(offs):
                np.add.at(out, np.searchsorted(bounds, p.offset + offs, side="right") - 1, nbytes)
    return out


def _block_state_total(buckets, rule: BlockRule) -> float:
    fn = getattr(rule, "block_state_bytes", None)
    if fn is None:
        return 0.0
    return float(sum(n for _, specs in buckets for ts in specs if ts.numel for _, n in fn(ts.shape, ts.spec)))


def _step_seconds(plan: Plan, replicas: int, *, link: LinkModel, param_bytes: int, grad_bytes: int,
                  exchange_bytes: tuple[int, int]) -> float:  # fmt: skip
    """Modeled collective seconds per step on the plan's busiest rank (see [Note: mesh suggestion model])."""
    total = 0.0
    w = plan.world_size
    held = np.zeros(w)  # per rank: elements of its segments, and buckets it holds a piece of
    pieces = np.zeros(w)
    for b in plan.buckets:
        sizes = b.segment_sizes
        seg = np.asarray(sizes, dtype=np.float64)
        held += seg
        pieces += seg > 0
        for isz, n in ((param_bytes, 2), (grad_bytes, 1)):
            if b.layout is Layout.EVEN or choose_wire_mode(sizes, element_size=isz, wire=plan.config.wire) is WireMode.PADDED:
                total += n * padded_seconds(sizes, element_size=isz, link=link)
            else:
                total += n * grouped_seconds(sizes, element_size=isz, link=link)
        if b.num_split_blocks:
            send, recv = split_exchange(b)
            total += all_to_all_seconds(send, recv, element_size=exchange_bytes[0], link=link)
            total += all_to_all_seconds(recv, send, element_size=exchange_bytes[1], link=link)
    if replicas > 1:
        # each rank all-reduces its own segment of every bucket with its replicas: per bucket
        # ``all_reduce_seconds(seg)`` = latency + slope * seg (the same model, summed per rank)
        one, two = (all_reduce_seconds(x, replicas, element_size=grad_bytes, link=link) for x in (1.0, 2.0))
        slope, latency = two - one, 2 * one - two
        total += float((pieces * latency + held * slope).max())
    return total


def suggest_mesh(
    *,
    model: str | nn.Module | Sequence[tuple[str, Sequence[TensorSpec]]],
    world_size: int,
    rule: BlockRule,
    memory_per_rank: float,
    config: PlanConfig = PlanConfig(),
    itemsize: int = 4,
    state_bytes: float = 16.0,
    gathered_bytes: float = 6.0,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    optim_bytes: int = 4,
    link: LinkModel = LinkModel(),
    tokens_per_rank: int = 8192,
    act_bytes: int = 2,
) -> MeshSuggestion:
    """The HSDP shape (``num_replicas x shard_size``), or for an MoE preset the expert-parallel degree,
    with the least modeled collective time per step whose busiest rank fits in ``memory_per_rank`` bytes,
    and every candidate's figures.

    ``model``: a preset name (``preset_names()``), an ``nn.Module`` (its parameter shapes, meta is
    fine; buckets by ``module_buckets``) or planner buckets. ``rule``: the optimizer's block rule
    (``Muon.blocks``, ``muon_rule()``, ...); ``config``: the planner's (``balance="auto"`` splits matrices only for a rule that takes them,
    see ``config_for_rules``). ``tokens_per_rank`` and ``act_bytes`` (bf16 activations) price an MoE
    preset's expert-parallel token exchanges. The rest: [Note: mesh suggestion model], [Note:
    expert-parallel candidates].
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not (isinstance(memory_per_rank, (int, float)) and math.isfinite(memory_per_rank) and memory_per_rank > 0):
        raise ValueError(f"memory_per_rank must be a positive number of bytes (80e9 for 80 GB), got {memory_per_rank!r}")
    for name, v in (("state_bytes", state_bytes), ("gathered_bytes", gathered_bytes)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0 (bytes per element), got {v!r}")
    exchange = tuple(getattr(rule, "exchange_bytes", (optim_bytes, optim_bytes)))
    prices = dict(state_bytes=state_bytes, gathered_bytes=gathered_bytes, param_bytes=param_bytes, grad_bytes=grad_bytes,
                  exchange_bytes=exchange, link=link, tokens_per_rank=tokens_per_rank, act_bytes=act_bytes)  # fmt: skip
    cands, plans = [], {}
    buckets = _buckets(model, rule=rule, itemsize=itemsize)
    for c, plan in _dp_candidates(buckets, world_size, rule, config, memory_per_rank, prices):
        cands.append(c)
        plans[(1, 1, c.shard_size)] = plan
    if isinstance(model, str) and PRESETS[model].is_moe:
        for c, dense_plan, expert_plan in _ep_candidates(model, world_size, rule, config, memory_per_rank, itemsize, prices):
            cands.append(c)
            plans[(c.ep, 1, c.shard_size)] = (dense_plan, expert_plan)
    elif isinstance(model, str) and not any(c.fits for c in cands):  # [Note: tensor-parallel candidates]
        for tp in _tp_degrees(model, world_size):
            tp_buckets = _tp_buckets(model, tp, rule, itemsize)
            for c, plan in _dp_candidates(tp_buckets, world_size // tp, rule, config, memory_per_rank, prices, tp=tp):
                cands.append(c)
                plans[(1, tp, c.shard_size)] = plan
    fitting = [c for c in cands if c.fits]
    if not fitting:
        least = min(c.max_rank_bytes for c in cands)
        shapes = ("HSDP shape or expert-parallel degree" if any(c.ep > 1 for c in cands)
                  else "HSDP shape or tensor-parallel degree" if any(c.tp > 1 for c in cands) else "HSDP shape")
        raise ValueError(
            f"memory_per_rank={memory_per_rank:.4g} bytes fits no {shapes} of world size {world_size}: the least "
            f"needs {least:.4g} bytes on the busiest rank ({state_bytes:g} bytes per sharded element + the rule's "
            f"per-block state + two gathered buckets); raise memory_per_rank or the world size"
        )
    best = min(fitting, key=lambda c: (c.tp, c.collective_seconds, c.ep, -c.shard_size))
    chosen = plans[(best.ep, best.tp, best.shard_size)]
    plan, expert_plan = chosen if best.ep > 1 else (chosen, None)
    return MeshSuggestion(best.shard_size, best.num_replicas, best.max_rank_bytes, best.collective_seconds, plan,
                          tuple(cands), best.ep, expert_plan, best.tp)  # fmt: skip


def _dp_candidates(buckets, w: int, rule: BlockRule, config: PlanConfig, memory_per_rank: float, prices: dict,
                   tp: int = 1):  # fmt: skip
    """``(MeshCandidate, plan)`` per HSDP shape of ``w`` data-parallel ranks: [Note: mesh suggestion model]."""
    state_bytes = prices["state_bytes"]
    numel = sum(ts.numel for _, specs in buckets for ts in specs)
    biggest = max((sum(ts.numel for ts in specs) for _, specs in buckets), default=0)
    gathered = 2 * biggest * prices["gathered_bytes"]
    block_total = _block_state_total(buckets, rule)
    for n in sorted((d for d in range(1, w + 1) if w % d == 0), reverse=True):
        floor = int((numel * state_bytes + block_total) / n + gathered)
        if floor > memory_per_rank:
            yield MeshCandidate(n, w // n, floor, False, math.inf, 1.0, 0, False, tp=tp), None
            continue
        plan = plan_model(buckets, world_size=n, config=config_for_rules(config, [rule]))
        elems = sum(np.diff(np.asarray(b.rank_bounds, dtype=np.int64)) for b in plan.buckets)
        mem = int(float(np.max(elems * state_bytes + block_state_per_rank(plan, rule))) + gathered)
        secs = _step_seconds(plan, w // n, link=prices["link"], param_bytes=prices["param_bytes"],
                             grad_bytes=prices["grad_bytes"], exchange_bytes=prices["exchange_bytes"])  # fmt: skip
        st = plan.stats()
        yield (MeshCandidate(n, w // n, mem, mem <= memory_per_rank, secs, st.balance_ratio, st.num_split_blocks, True,
                             tp=tp), plan)  # fmt: skip


# Where torchtitan's Llama plan splits a preset's tensors: the dim, by name suffix (the rest is replicated).
_TP_DIMS = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_proj.bias": 0, "k_proj.bias": 0,
            "v_proj.bias": 0, "o_proj.weight": 1, "gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1,
            "embed_tokens.weight": 0, "lm_head.weight": 0}  # fmt: skip


def _tp_degrees(model: str, w: int) -> list[int]:
    """The TP degrees tried for a dense preset: 2, 4, 8 dividing ``w`` and every split size."""
    m = PRESETS[model]
    if m.attention == "mla":
        return []
    sizes = (m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size)
    return [tp for tp in (2, 4, 8) if w % tp == 0 and all(s % tp == 0 for s in sizes)]


def _tp_buckets(model: str, tp: int, rule: BlockRule, itemsize: int):
    """A dense preset's buckets of TP-local tensors (``_TP_DIMS`` cut ``tp`` ways)."""
    out = []
    for bname, tensors in preset_shapes(model):
        specs = []
        for fqn, shape in tensors:
            d = next((d for suffix, d in _TP_DIMS.items() if fqn.endswith(suffix)), None)
            if d is not None:
                shape = tuple(s // tp if i == d else s for i, s in enumerate(shape))
            specs.append(TensorSpec(name=fqn, shape=shape, spec=rule(fqn, torch.empty(shape, device="meta"), None),
                                    itemsize=itemsize))  # fmt: skip
        out.append((bname, specs))
    return out


def _is_routed_expert(fqn: str) -> bool:
    return ".mlp.experts." in fqn  # the presets' stacked [E, ...] routed-expert tensors


def _ep_buckets(model: str, ep: int, rule: BlockRule, itemsize: int):
    """``(dense, experts)`` buckets of an MoE preset under EP degree ``ep``: the preset's buckets without
    the routed experts, and per MoE layer one bucket of the busiest rank's experts, every ``[E, ...]``
    tensor cut to ``[ceil(E / ep), ...]`` (``expert_parallel`` gives the first ranks one more when ``ep``
    does not divide E)."""
    dense, experts = [], []
    for bname, tensors in preset_shapes(model):
        d = [(f, s) for f, s in tensors if not _is_routed_expert(f)]
        x = [(f, (-(-s[0] // ep), *s[1:])) for f, s in tensors if _is_routed_expert(f)]
        for out, ts, name in ((dense, d, bname), (experts, x, f"{bname}.experts")):
            if ts:
                out.append((name, [TensorSpec(name=f, shape=s, spec=rule(f, torch.empty(s, device="meta"), None),
                                              itemsize=itemsize) for f, s in ts]))  # fmt: skip
    return dense, experts


def _ep_candidates(model: str, w: int, rule: BlockRule, config: PlanConfig, memory_per_rank: float, itemsize: int,
                   prices: dict):  # fmt: skip
    """``(MeshCandidate, dense plan, expert plan)`` per EP degree: [Note: expert-parallel candidates]."""
    m = PRESETS[model]
    state, gathered_b, link = prices["state_bytes"], prices["gathered_bytes"], prices["link"]
    cfg = config_for_rules(config, [rule])
    dense_plan = None
    for ep in (d for d in range(2, min(w, m.num_experts) + 1) if w % d == 0):
        dense, experts = _ep_buckets(model, ep, rule, itemsize)
        reps = w // ep  # the ranks holding the same experts
        biggest = max(sum(ts.numel for ts in specs) for _, specs in dense) + max(sum(ts.numel for ts in specs) for _, specs in experts)
        gathered = 2 * biggest * gathered_b
        dense_numel = sum(ts.numel for _, specs in dense for ts in specs)
        expert_numel = sum(ts.numel for _, specs in experts for ts in specs)
        floor = int((dense_numel * state + _block_state_total(dense, rule)) / w
                    + (expert_numel * state + _block_state_total(experts, rule)) / reps + gathered)  # fmt: skip
        if floor > memory_per_rank:
            yield MeshCandidate(w, 1, floor, False, math.inf, 1.0, 0, False, ep), None, None
            continue
        dense_plan = dense_plan or plan_model(dense, world_size=w, config=cfg)  # the same for every ep
        expert_plan = plan_model(experts, world_size=reps, config=cfg)
        per_rank = [sum(np.diff(np.asarray(b.rank_bounds, dtype=np.int64)) for b in p.buckets) * state
                    + block_state_per_rank(p, rule) for p in (dense_plan, expert_plan)]  # fmt: skip
        mem = int(float(np.max(per_rank[0] + per_rank[1][np.arange(w) // ep])) + gathered)
        secs = (_step_seconds(dense_plan, 1, link=link, param_bytes=prices["param_bytes"], grad_bytes=prices["grad_bytes"],
                              exchange_bytes=prices["exchange_bytes"])
                + _step_seconds(expert_plan, 1, link=link, param_bytes=prices["param_bytes"],
                                grad_bytes=prices["grad_bytes"], exchange_bytes=prices["exchange_bytes"])
                + _token_seconds(m, ep, prices["tokens_per_rank"], prices["act_bytes"], link))  # fmt: skip
        ds, xs = dense_plan.stats(), expert_plan.stats()
        yield (MeshCandidate(w, 1, mem, mem <= memory_per_rank, secs, max(ds.balance_ratio, xs.balance_ratio),
                             ds.num_split_blocks + xs.num_split_blocks, True, ep), dense_plan, expert_plan)  # fmt: skip


def _token_seconds(m, ep: int, tokens_per_rank: int, act_bytes: int, link: LinkModel) -> float:
    """EP's token traffic per step on one rank: per MoE layer 4 all-to-alls of the routed activations
    (dispatch and combine, forward and backward) and one of the ``[E]`` routing counts (int64)."""
    out = tokens_per_rank * m.num_experts_per_tok * m.hidden_size * act_bytes * (ep - 1) / ep
    counts = m.num_experts * 8 * (ep - 1) / ep
    one = 4 * all_to_all_seconds([out] * ep, [out] * ep, element_size=1, link=link)
    one += all_to_all_seconds([counts] * ep, [counts] * ep, element_size=1, link=link)
    return (m.num_layers - m.num_dense_layers) * one


def _buckets(model, *, rule: BlockRule, itemsize: int):
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"model {model!r} is not a preset; choose one of {', '.join(PRESETS)} or pass an nn.Module")
        return preset_buckets(model, rule=rule, itemsize=itemsize)
    if isinstance(model, nn.Module):
        return module_buckets(model, rule=rule, itemsize=itemsize)
    if isinstance(model, torch.Tensor):
        raise ValueError("model must be a preset name, an nn.Module or planner buckets, got a tensor")
    return list(model)
