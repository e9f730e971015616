"""Muon's optimizer step under FSDP x tensor parallelism, modelled (issue #35 item 2): the logic of
``comm_model_tp.py`` (which see for the CLI and the outputs).

Per optimizer step of the Muon matrices (wq, wk, wv, wo, w1, w2, w3 of every layer; embeddings, head and
norms go to AdamW, element-wise, no optimizer communication in any scheme) on a (dp, tp) mesh of
``W = D x T`` ranks, rank ``g * T + t`` (TP innermost, torchtitan's mesh order), TP torchtitan-style:
wq/wk/wv/w1/w3 ``Shard(0)`` (ColwiseParallel), wo/w2 ``Shard(1)`` (RowwiseParallel). Every figure is per
rank and the busiest rank's; ``S`` is a full matrix's bytes at ``exchange_bytes`` (bf16 by default, for
every scheme alike). Newton-Schulz (NS) FLOPs per iteration of an [m, n] matrix: ``2 a^2 (2 b + a)``,
``a = min(m, n)``, ``b = max(m, n)`` (``fsdp_optim.optimizers._homes.ns_cost``; torch.optim.Muon's
iteration), times ``ns_steps`` (5). "Single" = one process's torch.optim.Muon step on the whole model.

Schemes:

``ours``: ``fully_shard(mesh=dp)`` over the TP DTensors ([Note: FSDP x TP]): the real ``plan_model``
    plan (``balance="whole"``, one bucket per layer, TP-local shapes) puts every TP-local matrix whole on
    one dp coordinate, the same on every TP rank. Per TP group, its matrices' NS homes are dealt
    longest-first (by NS FLOPs) to the least-loaded TP rank; one ``all_to_all_single`` over the TP group
    sends every slice to its home, NS runs once per matrix, a second returns the result slices: 2
    collectives per step, no data-parallel optimizer traffic, FLOPs 1.0x single: what ``Muon`` runs
    ([Note: Muon under tensor parallelism]; measured at W = 4 by ``bench_tp_muon.py``).
``megatron_duplicated``: Megatron-LM ``TensorParallelMuon(mode="duplicated")``
    (megatron/core/optimizer/emerging_optimizers.py: ``newton_schulz_tp`` per parameter) under
    ``LayerWiseDistributedOptimizer`` (layer_wise_optimizer.py: whole parameters dealt to dp ranks
    largest-first by numel, gradients all-reduced, updated parameters all-gathered afterwards, which
    takes FSDP's all-gather's place and is not counted here). Per matrix one all-gather over the TP
    group, NS on every TP rank: T x the FLOPs of TP-sharded matrices (all seven here).
``megatron_layer_sharded``: Megatron-LM ``LayerShardedMuon`` (megatron/core/optimizer/
    layer_sharded_muon.py, 2026) with its ``gtp_remat`` axis = the data-parallel ranks: each TP-local
    matrix sharded evenly on dim 0 over the D ranks; every matrix gets one NS home ``(g_home, t_home)``
    in the D x T domain (dealt longest-first by its cost proxy ``m n min(m, n)``); stage 1, one
    all_to_all over the dp group, assembles the TP-local matrix on the home's dp coordinate (every TP
    rank of it); stage 2, one all_to_all over the TP group *per TP partition dim* (the class keeps one
    exchange per ``partition_dim``), assembles the full matrix on the home; NS once; the reverse
    stages scatter the result: 2 + 2 x (number of partition dims) = 6 collectives, FLOPs 1.0x.
``megatron_layer_sharded_gtp1``: the same class with no ``gtp_remat`` axis, under the layer-wise dp
    optimizer (whole TP-local matrices per dp rank, as ours): stage 2 only.
``fsdp2_muon``: FSDP2 ``fully_shard(mesh=dp)`` over the TP DTensors + ``torch.optim.Muon`` on the
    DTensor parameters. Lower bound: every matrix is redistributed to ``Replicate()`` on both mesh
    dims, one all-gather per mesh dim (dp: FSDP2's ``Shard(0)`` rows padded to a multiple of D; tp),
    ``(W-1)/W S`` bytes or more per matrix, and NS runs on every rank: W x the FLOPs. (Issue #35
    measured 5.3x the single-process step at W = 4 = dp 2 x tp 2, above this 4x bound: DTensor issues
    more than one collective per matrix and runs NS's matmuls on DTensors.)

Time: the alpha-beta collectives of ``comm_model.py`` (all-gather ``steps(n) alpha + (n-1)/n x / B``,
all-to-all ``steps(n) alpha + busiest rank's max(sent, received) / B``); a group whose ranks sit on one
node (``gpus_per_node``) uses the NVLink figures, any other the inter-node ones (comm_model's). NS time:
the busiest rank's NS FLOPs at ``ns_tflops``. No overlap, every collective of a step in sequence.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import tomllib
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import comm_model as cm
from fsdp_optim._cli import optimizer_rule
from fsdp_optim.sharding.plan import PlanConfig, TensorSpec, plan_model

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ("ours", "megatron_duplicated", "megatron_layer_sharded", "megatron_layer_sharded_gtp1", "fsdp2_muon")
SCHEME_LABELS = {
    "ours": "ours (fsdp_optim)",
    "megatron_duplicated": "Megatron TensorParallelMuon duplicated",
    "megatron_layer_sharded": "Megatron LayerShardedMuon (gtp_remat = dp)",
    "megatron_layer_sharded_gtp1": "Megatron LayerShardedMuon (gtp_remat = 1, layer-wise dp)",
    "fsdp2_muon": "FSDP2 + torch.optim.Muon on DTensor (lower bound)",
}
# (short name, HF name in model_shapes.json, TP dim: 0 = ColwiseParallel, 1 = RowwiseParallel)
LAYER_MATRICES = (
    ("wq", "self_attn.q_proj.weight", 0), ("wk", "self_attn.k_proj.weight", 0), ("wv", "self_attn.v_proj.weight", 0),
    ("wo", "self_attn.o_proj.weight", 1), ("w1", "mlp.gate_proj.weight", 0), ("w2", "mlp.down_proj.weight", 1),
    ("w3", "mlp.up_proj.weight", 0),
)  # fmt: skip
# model name -> where its shapes come from: a recipe config or an entry of tests/data/model_shapes.json
MODELS = {
    "tiny": ("recipe", "recipes/configs/tiny.toml"),
    "llama3-1b": ("recipe", "recipes/configs/llama3-1b.toml"),
    "llama3.1-8b": ("shapes", "Llama-3.1-8B"),
    "llama3.1-70b": ("shapes", "Llama-3.1-70B"),
    "llama3.1-405b": ("shapes", "Llama-3.1-405B"),
}


@dataclass(frozen=True)
class Model:
    name: str
    source: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    matrices: tuple[tuple[str, tuple[int, int], int], ...]
    """One layer's Muon matrices: (short name, full [out, in] shape, TP dim)."""


def load_model(name: str) -> Model:
    kind, where = MODELS[name]
    if kind == "recipe":
        m = tomllib.loads((ROOT / where).read_text())["model"]
        h, nh, kv, f = m["dim"], m["n_heads"], m.get("n_kv_heads") or m["n_heads"], m["ffn_dim"]
        hd = h // nh
        shapes = {"wq": (nh * hd, h), "wk": (kv * hd, h), "wv": (kv * hd, h), "wo": (h, nh * hd), "w1": (f, h),
                  "w2": (h, f), "w3": (f, h)}  # fmt: skip
        mats = tuple((s, shapes[s], d) for s, _, d in LAYER_MATRICES)
        return Model(name=name, source=where, hidden=h, layers=m["n_layers"], heads=nh, kv_heads=kv,
                     vocab=m.get("vocab_size") or 258, matrices=mats)  # fmt: skip
    entry = next(e for e in json.loads((ROOT / "tests/data/model_shapes.json").read_text()) if e["name"] == where)
    c, dense = entry["config"], entry["layers"]["dense"]
    mats = tuple((s, tuple(dense[hf]), d) for s, hf, d in LAYER_MATRICES)
    return Model(name=name, source=f"tests/data/model_shapes.json[{where!r}]", hidden=c["hidden_size"],
                 layers=c["num_hidden_layers"], heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"],
                 vocab=c["vocab_size"], matrices=mats)  # fmt: skip


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """torch.optim.Muon's Newton-Schulz FLOPs on one [rows, cols] matrix (``_homes.ns_cost`` x steps)."""
    a, b = min(rows, cols), max(rows, cols)
    return steps * 2 * a * a * (2 * b + a)


def tp_local(shape: tuple[int, int], dim: int, tp: int) -> tuple[int, int]:
    s = list(shape)
    s[dim] //= tp
    return tuple(s)


def check_mesh(model: Model, tp: int) -> None:
    if model.heads % tp or model.kv_heads % tp:
        raise ValueError(f"{model.name}: tp = {tp} must divide the {model.heads} heads and {model.kv_heads} KV heads")
    for s, shape, d in model.matrices:
        if shape[d] % tp:
            raise ValueError(f"{model.name}: tp = {tp} does not divide {s}'s dim {d} ({shape})")


# ---- the data-parallel placement of whole TP-local matrices ------------------------------------
def ours_dp_owner(model: Model, dp: int, tp: int) -> np.ndarray:
    """The dp coordinate holding each matrix (layer-major, LAYER_MATRICES order) under our planner:
    ``plan_model(balance="whole")`` on the TP-local shapes, one bucket per layer (norms included),
    the vocabulary-parallel embedding and head as their own buckets (AdamW's, they place nothing)."""
    rule = optimizer_rule("muon")

    def spec(fqn, shape):
        return TensorSpec(name=fqn, shape=shape, spec=rule(fqn, torch.empty(shape, device="meta"), None), itemsize=4)

    h = model.hidden
    buckets = [("embed", [spec("model.embed_tokens.weight", (model.vocab // tp or 1, h))])]
    for layer in range(model.layers):
        p = f"model.layers.{layer}."
        tensors = [spec(p + "input_layernorm.weight", (h,)), spec(p + "post_attention_layernorm.weight", (h,))]
        tensors += [spec(p + hf, tp_local(shape, d, tp)) for (_, shape, d), (_, hf, _) in zip(model.matrices, LAYER_MATRICES)]
        buckets.append((f"layers.{layer}", tensors))
    buckets.append(("head", [spec("model.norm.weight", (h,)), spec("lm_head.weight", (model.vocab // tp or 1, h))]))
    with warnings.catch_warnings():  # "whole blocks miss the balance cap": the memory side, not priced here
        warnings.simplefilter("ignore")
        plan = plan_model(buckets, world_size=dp, config=PlanConfig(balance="whole"))
    where = {}  # fqn -> dp coordinate (the planner orders a bucket's tensors its own way)
    for b in plan.buckets:
        for p in b.placements:
            for off, _, _ in p.spec.matrices(p.shape):
                where[p.name] = bisect.bisect_right(b.rank_bounds, p.offset + off) - 1
    return np.asarray([where[f"model.layers.{i}.{hf}"] for i in range(model.layers) for _, hf, _ in LAYER_MATRICES])


def longest_first(costs, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Deal items longest-first (ties: lower index) to the least-loaded of ``n`` bins (ties: lower
    bin): (bin per item, load per bin). Graham's bound: max load <= mean + the largest item."""
    where = np.zeros(len(costs), dtype=np.int64)
    loads = np.zeros(n)
    heap = [(0.0, r) for r in range(n)]
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        load, r = heapq.heappop(heap)
        where[j] = r
        loads[r] = load + costs[j]
        heapq.heappush(heap, (loads[r], r))
    return where, loads


# ---- links ----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TPLinks:
    """Inter-node links are comm_model's ``LinkConfig`` (400 Gb/s, 5 us); these add the node."""

    nvlink_gbps: float = 3600.0
    """Per-GPU NVLink bandwidth each direction, Gbit/s (H100 SXM NVLink 4: 900 GB/s total = 450 GB/s each way)."""
    nvlink_alpha_us: float = 5.0
    """Latency per message step inside a node (assumed equal to comm_model's inter-node 5 us)."""
    gpus_per_node: int = 8
    exchange_bytes: int = 2
    """Bytes per element every scheme's optimizer exchanges move (bf16)."""
    ns_tflops: float = 400.0
    """Sustained NS matmul rate per GPU, TFLOP/s (assumed: ~40% of an H100's 989 dense bf16 peak)."""
    ns_steps: int = 5

    def link(self, inter: cm.LinkConfig, span: int) -> cm.LinkConfig:
        """The link of a group whose ranks span ``span`` consecutive ranks."""
        if span <= self.gpus_per_node:
            return cm.LinkConfig(**{**asdict(inter), "bandwidth_gbps": self.nvlink_gbps, "alpha_us": self.nvlink_alpha_us})
        return inter


def _a2a_seconds(link: cm.LinkConfig, n: int, send: np.ndarray, recv: np.ndarray) -> float:
    """One all-to-all across many concurrent groups: the slowest group (comm_model.all_to_all's form)."""
    if n <= 1 or (send.max() == 0 and recv.max() == 0):
        return 0.0
    return cm.all_to_all(link, n, send, recv).seconds


# ---- one configuration ---------------------------------------------------------------------------
def model_tp(name: str, dp: int, tp: int, *, inter: cm.LinkConfig | None = None, links: TPLinks | None = None) -> dict:
    """Every scheme's per-step Muon optimizer cost for ``name`` on a (dp, tp) mesh (module docstring)."""
    inter = inter or cm.LinkConfig()
    links = links or TPLinks()
    model = load_model(name)
    check_mesh(model, tp)
    D, T, W, eb = dp, tp, dp * tp, links.exchange_bytes
    tp_link = links.link(inter, T)
    dp_link = links.link(inter, W)  # a dp group strides over every TP group: it spans the world
    shapes = [shape for _ in range(model.layers) for _, shape, _ in model.matrices]
    dims = np.asarray([d for _ in range(model.layers) for _, _, d in model.matrices])
    S = np.asarray([eb * r * c for r, c in shapes], dtype=np.float64)  # full-matrix bytes
    F = np.asarray([ns_flops(r, c, links.ns_steps) for r, c in shapes], dtype=np.float64)
    single = float(F.sum())
    out = {"model": name, "source": model.source, "dp": D, "tp": T, "world_size": W,
           "num_matrices": len(shapes), "matrix_bytes": float(S.sum()), "single_ns_flops": single,
           "tp_link": "nvlink" if T <= links.gpus_per_node else "inter-node",
           "dp_link": "nvlink" if W <= links.gpus_per_node else "inter-node", "schemes": {}}  # fmt: skip

    def result(sent, seconds, colls, flops_total, flops_busiest, **extra):
        ns_s = flops_busiest / (links.ns_tflops * 1e12)
        return {"bytes": float(sent), "comm_seconds": float(seconds), "collectives": int(colls),
                "ns_flops_total": float(flops_total), "ns_flops_ratio": float(flops_total / single),
                "ns_flops_busiest_rank": float(flops_busiest), "ns_seconds": ns_s, "seconds": float(seconds) + ns_s,
                **extra}  # fmt: skip

    def tp_exchange(owner: np.ndarray, cost: np.ndarray, per_dim: bool) -> dict:
        """Whole TP-local matrices on dp coordinate ``owner``; homes dealt longest-first by ``cost`` over
        each coordinate's T ranks; one all_to_all each way (or one per TP dim, ``per_dim``)."""
        send, recv = np.zeros((D, T)), np.zeros((D, T))
        by_dim = {d: (np.zeros((D, T)), np.zeros((D, T))) for d in (0, 1)}
        loads = np.zeros((D, T))
        balance = []
        for g in range(D):
            idx = np.flatnonzero(owner == g)
            if not len(idx):
                continue
            home, _ = longest_first(list(cost[idx]), T)
            flops_home = np.bincount(home, weights=F[idx], minlength=T)
            loads[g] = flops_home
            balance.append((flops_home.max(), F[idx].sum() / T, F[idx].max()))
            for j, h in zip(idx, home):
                for s, r in ((send, recv), by_dim[int(dims[j])]):
                    s[g] += S[j] / T
                    s[g, h] -= S[j] / T  # the home keeps its own slice
                    r[g, h] += S[j] * (T - 1) / T
        if per_dim:
            sec = sum(2 * _a2a_seconds(tp_link, T, s.ravel(), r.ravel()) for s, r in by_dim.values() if r.any())
            colls = 2 * sum(1 for s, r in by_dim.values() if r.any()) if T > 1 else 0
        else:
            sec = 2 * _a2a_seconds(tp_link, T, send.ravel(), recv.ravel())
            colls = 2 if T > 1 else 0
        worst = max(balance, key=lambda x: x[0] - x[1])
        return dict(sent=(send + recv).max(), seconds=sec, colls=colls, flops_total=single, flops_busiest=loads.max(),
                    home_flops_max=float(worst[0]), home_flops_mean=float(worst[1]), home_largest_item=float(worst[2]),
                    total_bytes_all_ranks=float((send + recv).sum()))  # fmt: skip

    # ours: our planner's dp placement, homes by NS FLOPs, one all_to_all each way
    owner = ours_dp_owner(model, D, T)
    r = tp_exchange(owner, F, per_dim=False)
    out["schemes"]["ours"] = result(r.pop("sent"), r.pop("seconds"), r.pop("colls"), r.pop("flops_total"),
                                    r.pop("flops_busiest"), matrices_per_dp_rank_max=int(np.bincount(owner).max()), **r)  # fmt: skip

    # Megatron layer-wise dp placement: whole parameters, largest numel first, to the least-loaded dp rank
    lw_owner, _ = longest_first(list(S / T), D)
    proxy = np.asarray([r * c * min(r, c) for r, c in shapes], dtype=np.float64)  # LayerShardedMuon's ns_cost

    # TensorParallelMuon duplicated: per matrix an all-gather over TP, NS on every TP rank
    per_g_bytes = np.bincount(lw_owner, weights=S * (T - 1) / T, minlength=D)
    per_g_sec = np.bincount(lw_owner, weights=[cm.ring_even(tp_link, T, s / T).seconds for s in S], minlength=D)
    per_g_flops = np.bincount(lw_owner, weights=F, minlength=D)
    per_g_count = np.bincount(lw_owner, minlength=D)
    out["schemes"]["megatron_duplicated"] = result(
        per_g_bytes.max(), per_g_sec.max(), per_g_count.max() if T > 1 else 0, T * single, per_g_flops.max(),
        total_bytes_all_ranks=float(T * per_g_bytes.sum()))  # fmt: skip

    # LayerShardedMuon, gtp_remat = 1: layer-wise dp placement, homes by its proxy, one exchange per TP dim
    r = tp_exchange(lw_owner, proxy, per_dim=True)
    out["schemes"]["megatron_layer_sharded_gtp1"] = result(r.pop("sent"), r.pop("seconds"), r.pop("colls"),
                                                           r.pop("flops_total"), r.pop("flops_busiest"), **r)  # fmt: skip

    # LayerShardedMuon, gtp_remat = dp: homes over the D x T domain, stage 1 over dp, stage 2 over tp
    home, _ = longest_first(list(proxy), W)
    gh = home // T
    piece = S / (T * D)  # one rank's dim-0 share of the TP-local matrix
    s1_send, s1_recv = np.zeros(D), np.zeros(D)  # per dp coordinate (the same on every TP rank)
    s1_send += piece.sum()
    np.subtract.at(s1_send, gh, piece)
    np.add.at(s1_recv, gh, piece * (D - 1))
    s2 = {d: (np.zeros(W), np.zeros(W)) for d in (0, 1)}
    for j in range(len(S)):
        send, recv = s2[int(dims[j])]
        col = gh[j] * T + np.arange(T)
        send[col] += S[j] / T
        send[home[j]] -= S[j] / T
        recv[home[j]] += S[j] * (T - 1) / T
    sec = 2 * _a2a_seconds(dp_link, D, s1_send, s1_recv)
    sec += sum(2 * _a2a_seconds(tp_link, T, s, r) for s, r in s2.values() if r.any())
    nd = sum(1 for _, r in s2.values() if r.any())
    colls = (2 if D > 1 else 0) + (2 * nd if T > 1 else 0)
    sent = np.repeat(s1_send + s1_recv, T) + sum(s + r for s, r in s2.values())
    out["schemes"]["megatron_layer_sharded"] = result(
        sent.max(), sec, colls, single, np.bincount(home, weights=F, minlength=W).max(),
        homes_used=int(len(np.unique(home))), total_bytes_all_ranks=float(sent.sum()))  # fmt: skip

    # FSDP2 + torch.optim.Muon on DTensors: all-gather over dp (FSDP2's padded Shard(0) rows) and over tp
    sent = sec = 0.0
    for (rows, cols), d in zip(shapes, dims):
        lr, lc = tp_local((rows, cols), int(d), T)
        padded = math.ceil(lr / D) * D * lc * eb
        a = cm.ring_even(dp_link, D, padded / D) + cm.ring_even(tp_link, T, rows * cols * eb / T)
        sent += a.bytes
        sec += a.seconds
    per_matrix = (D > 1) + (T > 1)
    out["schemes"]["fsdp2_muon"] = result(sent, sec, per_matrix * len(S), W * single, single,
                                          total_bytes_all_ranks=float(W * sent))  # fmt: skip
    return out
