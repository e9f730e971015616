"""Communication model: bytes and time per training step per rank, Muon, from the real plans.

An alpha-beta estimate (latency ``alpha`` per message step + bytes / link bandwidth ``B``) of the
collectives one training step issues on every rank, for every ``fsdp-optim plan`` preset and
world size, for three ways to run Muon under sharded data parallelism:

(a) **ours**: the plan ``plan_model`` makes for Muon's block rule (``--layout``, default auto).
    Per bucket one all-gather in forward, one in backward (reshard after forward), one
    reduce-scatter of the gradients. EVEN buckets are ring collectives of ``W * S`` elements.
    RAGGED buckets move uneven segments; ``--ragged-model`` says how they are costed:
    ``grouped`` (default; what DistributedBuffer issues on NCCL): the all-gather is one group of
    per-owner broadcasts, the reduce-scatter one group of per-owner reduces, pipelined on a ring,
    so the busiest link carries every segment but the smallest once:
    ``steps(W) * alpha + owners * alpha + (total - min_seg) / B`` (an even ring's figure, plus a
    message per owner);
    ``ring-max`` (pessimistic): a ring whose every step moves the largest segment,
    ``(W-1) * (alpha + max_seg / B)``; ``grouped-serial``: ``grouped`` whose broadcasts each fill
    their own pipeline, ``owners * steps(W) * alpha`` (the pessimistic latency of the same form).
    The JSON also holds ours under ``ring-max``. Matrices the plan had to split
    (``num_split_blocks``) add two all-to-alls per bucket (pieces to the matrix's owner, the
    update back) at the optimizer dtype. No other optimizer communication.
(b) **FSDP2 + torch.optim.Muon** (gather-based, DTensor): FSDP2's per-parameter ``Shard(0)``
    (dim 0 padded to a multiple of W, one all-gather / reduce-scatter per bucket and direction),
    plus in the optimizer step one all-gather of every Muon matrix (routed experts as separate
    2-D parameters: torch.optim.Muon is 2-D only), one collective per matrix. This is a lower
    bound: DTensor issued 16 collectives per matrix per step in ``benchmarks/bench_muon.py``.
(c) **gather/scatter-per-matrix Muon** (veScale-FSDP / torchtitan DistMuon style): flat even
    buckets without padding (``ceil(N / W) * W``, a lower bound for their planner), plus per
    bucket one all-to-all gathering every Muon matrix to a root rank (roots assigned
    longest-first) and one scattering the update back: 2 extra transfers of every matrix.

Ring all-gather / reduce-scatter of N bytes over W ranks: ``(W-1) * alpha + (W-1)/W * N / B``;
all-to-all: ``(W-1) * alpha + max_rank(max(bytes sent, bytes received)) / B``; ring all-reduce:
twice a reduce-scatter. ``--latency log2`` replaces every ``(W-1) * alpha`` by
``ceil(log2 W) * alpha`` (tree / Bruck algorithms). HSDP (``--shard-size N``): every scheme shards
over N ranks and replicates over ``R = W / N``; each bucket's gradient shard is then all-reduced
across the R replicas, ``2 (R-1) alpha + 2 (R-1)/R * shard_bytes / B`` per rank (ours: each rank
all-reduces its own, uneven, segments on its own link; the busiest rank's sum counts).
Bytes are those one rank sends per step (the largest rank's), time is the sum over collectives
with no overlap with compute (what a step would cost if communication were exposed).

    python benchmarks/comm_model.py                              # all presets, W in {8 .. 16384}
    python benchmarks/comm_model.py --models llama3-8b --world-sizes 64 --no-write
    python benchmarks/comm_model.py --shard-size 64 --out-name comm_model_hsdp64
    python benchmarks/comm_model.py --ep         # issue 26: expert parallelism, MoE presets, W in {1024, 16384}
    python benchmarks/comm_model.py --balanced   # issue 27: W in {64, 1024, 16384}, pure FSDP and the
                                                 # suggest_mesh shape at 80 GB -> comm_model_balanced.*

``--ep`` (issue 26): expert parallelism on the MoE presets at W in {1024, 16384}, 16M tokens per step
(``--tokens-per-step``), three schemes at equal sharded memory (every one holds E/W of the experts per
rank): **ours** = EP over ``ep`` ranks (the power of two dividing W and E that minimizes ours' time;
``--ep-size`` forces one), each rank's ``E / ep`` experts planned by our default plan over the ``W / ep``
ranks holding them, the dense part planned on the HSDP shape ``suggest_mesh`` picks for it, Muon local
(two all-to-alls only for matrices a plan split); **EP + FSDP2 + DistMuon-style** = the same EP and
meshes, flat buckets, two all-to-alls per bucket moving every Muon matrix (experts too) to a root and
back (as (c)); **FSDP2 + gather-based Muon without EP** = (b) with the experts sharded over all W.
Per MoE layer both EP schemes add 4 token all-to-alls (dispatch + combine, forward and backward) of
``T x top_k x hidden x act_bytes x (ep-1)/ep`` bytes per rank (dropless, capacity factor 1, average
load) + 1 of the routing counts. -> ``comm_model_ep.{json,md}``.

``--balanced``: per preset and W, ours (the default, balanced plan) as pure FSDP and at the HSDP
shape ``suggest_mesh`` picks for ``--memory-per-rank`` (default 80 GB), each against (b) and (c) on
the same mesh (equal per-rank memory: the same shard size holds the same parameter share). A cell
where ours is slower than a peer names why (its optimizer exchanges or its ragged collectives).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from fsdp_optim._cli import optimizer_rule
from fsdp_optim.sharding.plan import BucketPlan, Layout, plan_model
from fsdp_optim.sharding import PlanConfig
from fsdp_optim.sharding.plan import PRESETS, preset_buckets, preset_names
from fsdp_optim.sharding.plan import LinkModel, WireMode, choose_wire_mode, split_exchange

WORLD_SIZES = (8, 64, 256, 1024, 4096, 16384)
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _out import out_dir  # noqa: E402
SCHEMES = ("ours", "fsdp2_muon", "gather_scatter")
SCHEME_LABELS = {
    "ours": "(a) ours",
    "fsdp2_muon": "(b) FSDP2 + torch.optim.Muon",
    "gather_scatter": "(c) gather/scatter per matrix",
}


@dataclass(kw_only=True)
class LinkConfig:
    """Network and dtype assumptions of the model (all CLI flags)."""

    bandwidth_gbps: float = 400.0
    """Per-GPU link bandwidth, Gbit/s, each direction (one 400G InfiniBand NIC per GPU)."""
    alpha_us: float = 5.0
    """Latency per message step, microseconds."""
    param_bytes: int = 2
    """All-gather dtype (bf16 parameters)."""
    grad_bytes: int = 4
    """Reduce-scatter / all-reduce dtype (fp32 gradients)."""
    optim_bytes: int = 4
    """Optimizer exchanges (momentum to the root, update back): fp32."""
    latency: str = "ring"
    """``ring``: (W-1) alpha per collective; ``log2``: ceil(log2 W) alpha."""
    ragged_model: str = "grouped"
    """Uneven collectives: ``grouped``, ``grouped-serial`` or ``ring-max`` (see the module docstring)."""

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def alpha_s(self) -> float:
        return self.alpha_us * 1e-6

    def steps(self, w: int) -> int:
        """Latency steps of one collective over ``w`` ranks."""
        if w <= 1:
            return 0
        return w - 1 if self.latency == "ring" else math.ceil(math.log2(w))


@dataclass(kw_only=True)
class Cost:
    """Per-rank communication of some collectives: bytes sent (largest rank), seconds, count."""

    bytes: float = 0.0
    seconds: float = 0.0
    collectives: int = 0

    def __add__(self, o: Cost) -> Cost:
        return Cost(
            bytes=self.bytes + o.bytes, seconds=self.seconds + o.seconds, collectives=self.collectives + o.collectives
        )

    def scale(self, k: int) -> Cost:
        return Cost(bytes=self.bytes * k, seconds=self.seconds * k, collectives=self.collectives * k)


# ---- collective costs ------------------------------------------------------------------
def ring(link: LinkConfig, w: int, seg_bytes: np.ndarray) -> Cost:
    """Ring all-gather or reduce-scatter of per-rank segments ``seg_bytes`` (even or not): each of
    the W-1 steps moves one segment per rank and waits for the largest; a rank sends every
    segment but one (its successor's), the largest rank ``total - min``."""
    if w <= 1 or seg_bytes.sum() == 0:
        return Cost()
    mx, mn, total = float(seg_bytes.max()), float(seg_bytes.min()), float(seg_bytes.sum())
    return Cost(bytes=total - mn, seconds=link.steps(w) * link.alpha_s + (w - 1) * mx / link.bytes_per_s, collectives=1)


def ring_even(link: LinkConfig, w: int, seg_bytes: float) -> Cost:
    """``ring`` with every rank's segment ``seg_bytes``: ``(W-1) alpha + (W-1) * seg / B``."""
    if w <= 1 or seg_bytes == 0:
        return Cost()
    sec = link.steps(w) * link.alpha_s + (w - 1) * seg_bytes / link.bytes_per_s
    return Cost(bytes=(w - 1) * seg_bytes, seconds=sec, collectives=1)


def grouped(link: LinkConfig, w: int, seg_bytes: np.ndarray) -> Cost:
    """Uneven all-gather / reduce-scatter as one group of per-owner broadcasts / reduces (NCCL's
    uneven list ``all_gather``; list ``reduce_scatter`` with uneven sizes), pipelined on one ring:
    the busiest link carries every segment but one (``(total - min_seg) / B``, as an even ring),
    one pipeline fill plus one message per non-empty owner (``steps(W) alpha + owners * alpha``)."""
    if w <= 1 or seg_bytes.sum() == 0:
        return Cost()
    owners = int((seg_bytes > 0).sum())
    moved = float(seg_bytes.sum()) - float(seg_bytes.min())
    if link.ragged_model == "grouped-serial":  # each broadcast fills its own pipeline
        lat = owners * link.steps(w) * link.alpha_s
    else:
        lat = (link.steps(w) + owners) * link.alpha_s
    return Cost(bytes=moved, seconds=lat + moved / link.bytes_per_s, collectives=1)


def all_to_all(link: LinkConfig, w: int, send: np.ndarray, recv: np.ndarray) -> Cost:
    """One all-to-all: every rank may talk to every other; the busiest rank's bytes set the time."""
    if w <= 1:
        return Cost()
    busiest = float(np.maximum(send, recv).max())
    sec = link.steps(w) * link.alpha_s + busiest / link.bytes_per_s
    return Cost(bytes=float(send.max()), seconds=sec, collectives=1)


def all_reduce(link: LinkConfig, r: int, shard_bytes: float) -> Cost:
    """Ring all-reduce of ``shard_bytes`` over ``r`` replicas (reduce-scatter + all-gather)."""
    if r <= 1 or shard_bytes == 0:
        return Cost()
    sec = 2 * link.steps(r) * link.alpha_s + 2 * (r - 1) / r * shard_bytes / link.bytes_per_s
    return Cost(bytes=2 * (r - 1) / r * shard_bytes, seconds=sec, collectives=1)


# ---- per-bucket figures -----------------------------------------------------------------
def _matrices(bucket: BucketPlan) -> list[int]:
    """Element counts of every Muon matrix block of the bucket."""
    return [r * c for p in bucket.placements for _, r, c in p.spec.matrices(p.shape)]


def _fsdp2_numel(shape: tuple[int, ...], spec, w: int) -> int:
    """Elements FSDP2 moves for one parameter: dim 0 padded to a multiple of W (Shard(0) chunks
    of ``ceil(d0 / W)`` rows); Muon experts as separate 2-D parameters, each padded on its rows."""
    if not shape:
        return w
    mats = spec.matrices(shape) if spec.is_matrix and len(shape) == 3 else []
    if mats:
        return sum(math.ceil(r / w) * w * c for _, r, c in mats)
    return math.ceil(shape[0] / w) * w * math.prod(shape[1:])


def _split_exchange(bucket: BucketPlan) -> tuple[np.ndarray, np.ndarray]:
    """Elements each rank sends / receives to gather its split matrices to their owners (the rank
    holding the largest piece); the update goes back the same way (``plan.split_exchange``)."""
    send, recv = split_exchange(bucket)
    return np.asarray(send, dtype=np.float64), np.asarray(recv, dtype=np.float64)


def _root_loads(mats: list[int], w: int) -> np.ndarray:
    """Matrix elements each rank roots when matrices are dealt longest-first to the least loaded."""
    loads = np.zeros(w)
    if not mats:
        return loads
    if len(mats) <= w:
        loads[: len(mats)] = sorted(mats, reverse=True)
        return loads
    heap = [(0, r) for r in range(w)]
    for m in sorted(mats, reverse=True):
        load, r = heapq.heappop(heap)
        heapq.heappush(heap, (load + m, r))
    for load, r in heap:
        loads[r] = load
    return loads


# ---- one (preset, W) ---------------------------------------------------------------------
@dataclass(kw_only=True)
class SchemeCost:
    fsdp: Cost = field(default_factory=Cost)
    """Parameter all-gathers (fwd + bwd) and gradient reduce-scatters (+ HSDP all-reduces)."""
    optim: Cost = field(default_factory=Cost)
    """Communication of the optimizer step."""

    @property
    def total(self) -> Cost:
        return self.fsdp + self.optim

    def as_dict(self) -> dict:
        t = self.total
        return {
            "bytes": t.bytes, "seconds": t.seconds, "collectives": t.collectives,
            "fsdp": asdict(self.fsdp), "optim": asdict(self.optim),
        }


def model_step(
    preset: str, world_size: int, *, link: LinkConfig, layout: str = "auto", shard_size: int | None = None
) -> dict:
    """Bytes and time per training step per rank for the three schemes (see the module docstring)."""
    n = shard_size or world_size
    if world_size % n:
        raise ValueError(f"--shard-size {n} must divide the world size {world_size}")
    replicas = world_size // n
    buckets = preset_buckets(preset, rule=optimizer_rule("muon"))
    plan = plan_model(buckets, world_size=n, config=PlanConfig(layout=layout))
    st = plan.stats()
    pb, gb, ob = link.param_bytes, link.grad_bytes, link.optim_bytes
    ours, fsdp2, gs = SchemeCost(), SchemeCost(), SchemeCost()
    ours_alt = SchemeCost()  # ours with the other ragged-collective model
    alt_model = "ring-max" if link.ragged_model != "ring-max" else "grouped"
    num_mats = 0
    ar_bytes, ar_msgs = np.zeros(n), np.zeros(n)  # ours, HSDP: per-rank replica all-reduce totals
    # Wire formats of ragged buckets (see [Note: wire format] in fsdp_optim/sharding/_wire.py): the
    # grouped list forms with serial per-owner pipelines (NCCL's coalesced broadcasts / reduces),
    # one padded ring, and the runtime's per-bucket choice by fsdp_optim's own model.
    serial = LinkConfig(**{**asdict(link), "ragged_model": "grouped-serial"})
    wire_link = LinkModel(alpha_s=link.alpha_s, bytes_per_s=link.bytes_per_s)
    wire = {m: Cost() for m in ("grouped", "padded", "auto")}
    num_padded = 0
    for b in plan.buckets:
        seg = np.diff(np.asarray(b.rank_bounds, dtype=np.float64))
        if b.layout is Layout.EVEN:
            even = ring(link, n, seg * pb).scale(2) + ring(link, n, seg * gb)
            for m in wire:
                wire[m] += even
        else:
            g = grouped(serial, n, seg * pb).scale(2) + grouped(serial, n, seg * gb)
            pad = ring_even(link, n, float(seg.max()) * pb).scale(2) + ring_even(link, n, float(seg.max()) * gb)
            choice = choose_wire_mode([int(x) for x in seg], element_size=pb, backend="nccl", link=wire_link)
            num_padded += choice is WireMode.PADDED
            wire["grouped"] += g
            wire["padded"] += pad
            wire["auto"] += pad if choice is WireMode.PADDED else g
        # (a) ours
        for sc, rm in ((ours, link.ragged_model), (ours_alt, alt_model)):
            coll = ring if (b.layout is Layout.EVEN or rm == "ring-max") else grouped
            sc.fsdp += coll(link, n, seg * pb).scale(2) + coll(link, n, seg * gb)
        if replicas > 1:  # each rank all-reduces its own segment with its replicas (its own link)
            ar_bytes += 2 * (replicas - 1) / replicas * seg * gb
            ar_msgs += 2 * link.steps(replicas) * (seg > 0)
        if b.num_split_blocks:
            send, recv = _split_exchange(b)
            ex = all_to_all(link, n, send * ob, recv * ob)
            ours.optim += ex + all_to_all(link, n, recv * ob, send * ob)
            ours_alt.optim += ex + all_to_all(link, n, recv * ob, send * ob)
        mats = _matrices(b)
        num_mats += len(mats)
        # (b) FSDP2 + torch.optim.Muon: FSDP2's padded Shard(0), one all-gather per matrix
        f2 = sum(_fsdp2_numel(p.shape, p.spec, n) for p in b.placements)
        fsdp2.fsdp += ring_even(link, n, f2 / n * pb).scale(2) + ring_even(link, n, f2 / n * gb)
        fsdp2.fsdp += all_reduce(link, replicas, f2 / n * gb)
        for p in b.placements:
            for _, r, c in p.spec.matrices(p.shape):
                fsdp2.optim += ring_even(link, n, math.ceil(r / n) * c * ob)
        # (c) gather/scatter per matrix: flat even bucket, two all-to-alls of every matrix
        flat = math.ceil(b.param_numel / n)
        gs.fsdp += ring_even(link, n, flat * pb).scale(2) + ring_even(link, n, flat * gb)
        gs.fsdp += all_reduce(link, replicas, flat * gb)
        if mats and n > 1:
            held = sum(mats) / n  # each rank's share of the bucket's matrix elements
            roots = _root_loads(mats, n)
            send = np.full(n, held) - roots / n  # a rank keeps its own piece of the matrices it roots
            recv = roots * (n - 1) / n
            gs.optim += all_to_all(link, n, send * ob, recv * ob) + all_to_all(link, n, recv * ob, send * ob)
    if replicas > 1:
        busiest = float(np.max(ar_msgs * link.alpha_s + ar_bytes / link.bytes_per_s))
        ar = Cost(bytes=float(ar_bytes.max()), seconds=busiest, collectives=len(plan.buckets))
        ours.fsdp += ar
        ours_alt.fsdp += ar
    out = {
        "model": preset,
        "world_size": world_size,
        "shard_size": n,
        "replicas": replicas,
        "layout": layout,
        "num_buckets": st.num_buckets,
        "num_even_buckets": st.num_even_buckets,
        "num_ragged_buckets": st.num_ragged_buckets,
        "num_split_blocks": st.num_split_blocks,
        "split_bytes_ratio": st.split_bytes_ratio,
        "padding_ratio": st.padding_ratio,
        "bytes_max_over_mean": st.bytes_max_over_mean,
        "num_muon_matrices": num_mats,
        "param_numel": st.param_numel,
        "plan_seconds": st.plan_seconds,
    }
    for name, sc in zip(SCHEMES, (ours, fsdp2, gs)):
        out[name] = sc.as_dict()
    out["wire"] = {m: {"seconds": c.seconds + ours.optim.seconds, "bytes": c.bytes + ours.optim.bytes}
                   for m, c in wire.items()}  # fmt: skip
    out["wire"]["num_padded_buckets"] = num_padded
    out["ours_other_ragged_model"] = {"ragged_model": alt_model, **ours_alt.as_dict()}
    for name in SCHEMES[1:]:
        out[f"time_ratio_{name}_over_ours"] = out[name]["seconds"] / out["ours"]["seconds"]
        out[f"bytes_ratio_{name}_over_ours"] = out[name]["bytes"] / out["ours"]["bytes"]
    return out


# ---- issue 27: balanced plans, pure FSDP and the suggested mesh --------------------------------
BALANCED_WORLD_SIZES = (64, 1024, 16384)


def _why_slower(r: dict) -> str:
    """Empty when ours is no slower than (b) and (c); else what ours spends more on."""
    o = r["ours"]
    peers = {k: r[k] for k in ("fsdp2_muon", "gather_scatter") if r[k]["seconds"] < o["seconds"]}
    if not peers:
        return ""
    parts = []
    for k, p in peers.items():
        d_f = o["fsdp"]["seconds"] - p["fsdp"]["seconds"]
        d_o = o["optim"]["seconds"] - p["optim"]["seconds"]
        what = (f"its ragged buckets' grouped collectives pay one latency per owner, +{d_f * 1e3:.0f} ms over flat "
                f"even rings (+{d_f / max(p['fsdp']['seconds'], 1e-12) * 100:.1f}%); HSDP avoids it"
                if d_f >= d_o else f"split-matrix exchanges ({r['num_split_blocks']} split) +{d_o * 1e3:.0f} ms")  # fmt: skip
        parts.append(f"slower than {SCHEME_LABELS[k]}: {what}")
    return "; ".join(parts)


def balanced_rows(models, world_sizes, *, link: LinkConfig, memory_per_rank: float) -> list[dict]:
    """Per preset and W: ours pure FSDP and at ``suggest_mesh``'s shape, each with (b) and (c)."""
    from fsdp_optim.sharding.plan import suggest_mesh

    rows = []
    for model in models:
        for w in world_sizes:
            wire = LinkModel(alpha_s=link.alpha_s, bytes_per_s=link.bytes_per_s)
            try:
                sug = suggest_mesh(model=model, world_size=w, rule=optimizer_rule("muon"), memory_per_rank=memory_per_rank,
                                   param_bytes=link.param_bytes, grad_bytes=link.grad_bytes, optim_bytes=link.optim_bytes,
                                   link=wire)  # fmt: skip
                fits = {c.shard_size: (c.fits, c.max_rank_bytes) for c in sug.candidates}
                meshes = (("fsdp", w), ("suggested", sug.shard_size))
            except ValueError:  # nothing fits this memory at this W (even pure FSDP): the FSDP row says so
                fits, meshes = {}, (("fsdp (no shape fits)", w),)
            for mesh, n in meshes:
                r = model_step(model, w, link=link, shard_size=n)
                r["mesh"] = mesh
                r["memory_fits"], r["max_rank_bytes_modeled"] = fits.get(n, (False, None))
                r["why"] = _why_slower(r)
                rows.append(r)
                print(f"{model:16s} W={w:<6d} {mesh:9s} {n:>6d} x {w // n:<5d} ours {r['ours']['seconds'] * 1e3:10.1f} ms | "
                      f"(b) x{r['time_ratio_fsdp2_muon_over_ours']:7.2f} | (c) x{r['time_ratio_gather_scatter_over_ours']:6.2f}"
                      f" {r['why']}", flush=True)  # fmt: skip
    return rows


def balanced_markdown(data: dict) -> str:
    a = data["assumptions"]
    out = [
        "# Communication model on balanced plans (issue 27): ours vs FSDP2 + Muon vs gather/scatter Muon",
        "",
        f"Made by: `{data['command']}`",
        "",
        f"Same alpha-beta model as comm_model.md ({a['bandwidth_gbps']:g} Gb/s, alpha {a['alpha_us']:g} us, "
        f"{a['latency']} latency, ragged `{a['ragged_model']}`, no overlap). Our plans are the default PlanConfig "
        "(balance 'auto': busiest rank <= 1.10 x the mean, matrices split on rows where whole ones cannot). "
        f"Rows: pure FSDP over W, and the HSDP shape `suggest_mesh` picks at {data['memory_per_rank'] / 1e9:g} GB "
        "per rank (16 B per sharded element + two gathered buckets); each scheme runs on the same mesh, so each "
        "holds the same parameter share per rank (equal per-rank memory). `fits`: the modeled busiest rank fits "
        "the memory. ms = collective time per step on the busiest rank.",
        "",
        "| preset | W | mesh (shard x replicas) | fits | ours ms | (b) FSDP2+Muon ms | (c) gather/scatter ms | (b)/ours | "
        "(c)/ours | split | ours bytes max/mean | why ours is slower |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        out.append(
            f"| {r['model']} | {r['world_size']} | {r['mesh']}: {r['shard_size']} x {r['replicas']} | "
            f"{'yes' if r['memory_fits'] else 'no'} | {_ms(r['ours']['seconds'])} | {_ms(r['fsdp2_muon']['seconds'])} | "
            f"{_ms(r['gather_scatter']['seconds'])} | {r['time_ratio_fsdp2_muon_over_ours']:.2f} | "
            f"{r['time_ratio_gather_scatter_over_ours']:.2f} | {r['num_split_blocks']} | {r['bytes_max_over_mean']:.3f} | "
            f"{r['why'] or '-'} |"
        )
    slower = [r for r in data["rows"] if r["why"]]
    out += ["", f"Cells where ours is slower than a peer: {len(slower)} of {len(data['rows'])}."]
    return "\n".join(out) + "\n"


# ---- issue 26: expert parallelism --------------------------------------------------------------
EP_WORLD_SIZES = (1024, 16384)
EP_TOKENS_PER_STEP = 16 * 2**20
"""Global batch per step in tokens (16M, DeepSeek-V3's final batch size was 15360 x 4096 = 63M tokens;
Llama 3 405B's 16M); per-rank tokens = this / W."""
TOP_K = {name: p.num_experts_per_tok for name, p in PRESETS.items() if p.is_moe}
"""Routed experts per token: ``ModelPreset.num_experts_per_tok``, the official configs' (gpt-oss:
``experts_per_token``), as collected in tests/data/model_shapes.json."""
EP_SCHEMES = ("ours", "ep_distmuon", "fsdp2_no_ep")
EP_LABELS = {
    "ours": "ours (EP + our plans, local Muon)",
    "ep_distmuon": "EP + FSDP2 + DistMuon-style",
    "fsdp2_no_ep": "FSDP2 + gather-based Muon, no EP",
}


def _is_expert(fqn: str) -> bool:
    return ".mlp.experts." in fqn


def ep_buckets(preset: str, ep: int, *, rule) -> tuple[list, list]:
    """``(dense, experts)`` planner buckets of a preset under EP degree ``ep``: the dense part of every
    layer (attention, router, shared experts, norms) as the preset's buckets, and per MoE layer one
    bucket of this rank's routed experts, every ``[E, ...]`` parameter cut to ``[ceil(E / ep), ...]``
    (the largest slice: ``expert_parallel`` gives the first ranks one more when ``ep`` does not divide E)."""
    from fsdp_optim.sharding.plan import TensorSpec, preset_shapes

    dense, experts = [], []
    for bname, tensors in preset_shapes(preset):
        d = [(f, s) for f, s in tensors if not _is_expert(f)]
        x = [(f, (math.ceil(s[0] / ep), *s[1:])) for f, s in tensors if _is_expert(f)]
        for out, ts, name in ((dense, d, bname), (experts, x, f"{bname}.experts")):
            if ts:
                out.append((name, [TensorSpec(name=f, shape=s, spec=rule(f, _meta(s), None), itemsize=4) for f, s in ts]))
    return dense, experts


def _meta(shape):
    import torch

    return torch.empty(shape, device="meta")


def _bucket_mats(specs) -> list[int]:
    return [r * c for ts in specs for _, r, c in ts.spec.matrices(ts.shape)]


def ours_cost(buckets, n: int, replicas: int, *, link: LinkConfig) -> tuple[SchemeCost, dict]:
    """(a) on planner buckets: the default plan over ``n`` ranks, all-gathers x2 + reduce-scatter per
    bucket (ragged ones by ``link.ragged_model``), the replica all-reduce when ``replicas > 1``, and
    Muon's two all-to-alls only in buckets where a matrix was split. Also the plan's busiest rank."""
    rule_cfg = PlanConfig()
    plan = plan_model(buckets, world_size=n, config=rule_cfg)
    pb, gb, ob = link.param_bytes, link.grad_bytes, link.optim_bytes
    sc = SchemeCost()
    held = np.zeros(n)
    ar_bytes, ar_msgs = np.zeros(n), np.zeros(n)
    for b in plan.buckets:
        seg = np.diff(np.asarray(b.rank_bounds, dtype=np.float64))
        held += seg
        coll = ring if (b.layout is Layout.EVEN or link.ragged_model == "ring-max") else grouped
        sc.fsdp += coll(link, n, seg * pb).scale(2) + coll(link, n, seg * gb)
        if replicas > 1:
            ar_bytes += 2 * (replicas - 1) / replicas * seg * gb
            ar_msgs += 2 * link.steps(replicas) * (seg > 0)
        if b.num_split_blocks:
            send, recv = _split_exchange(b)
            sc.optim += all_to_all(link, n, send * ob, recv * ob) + all_to_all(link, n, recv * ob, send * ob)
    if replicas > 1:
        busiest = float(np.max(ar_msgs * link.alpha_s + ar_bytes / link.bytes_per_s))
        sc.fsdp += Cost(bytes=float(ar_bytes.max()), seconds=busiest, collectives=len(plan.buckets))
    st = plan.stats()
    return sc, {"max_rank_elems": float(held.max()), "num_split_blocks": st.num_split_blocks,
                "num_ragged_buckets": st.num_ragged_buckets, "bytes_max_over_mean": st.bytes_max_over_mean}  # fmt: skip


def distmuon_cost(buckets, n: int, replicas: int, *, link: LinkConfig) -> tuple[SchemeCost, dict]:
    """(c) on planner buckets: flat even buckets (``ceil(N / n)`` per rank, no padding), all-gathers x2 +
    reduce-scatter, the replica all-reduce, and per bucket two all-to-alls moving every Muon matrix to
    its root (roots dealt longest-first) and the update back (torchtitan's DistMuon, veScale)."""
    pb, gb, ob = link.param_bytes, link.grad_bytes, link.optim_bytes
    sc, held = SchemeCost(), 0.0
    for _, specs in buckets:
        flat = math.ceil(sum(ts.numel for ts in specs) / n)
        held += flat
        sc.fsdp += ring_even(link, n, flat * pb).scale(2) + ring_even(link, n, flat * gb)
        sc.fsdp += all_reduce(link, replicas, flat * gb)
        mats = _bucket_mats(specs)
        if mats and n > 1:
            roots = _root_loads(mats, n)
            send = np.full(n, sum(mats) / n) - roots / n
            recv = roots * (n - 1) / n
            sc.optim += all_to_all(link, n, send * ob, recv * ob) + all_to_all(link, n, recv * ob, send * ob)
    return sc, {"max_rank_elems": held}


def fsdp2_gather_cost(buckets, n: int, replicas: int, *, link: LinkConfig) -> tuple[SchemeCost, dict]:
    """(b) on planner buckets: FSDP2's dim-0 padded ``Shard(0)`` (experts as separate 2-D parameters),
    all-gathers x2 + reduce-scatter, the replica all-reduce, and one all-gather of every Muon matrix in
    the step (torch.optim.Muon on DTensors; a lower bound, see the module docstring)."""
    pb, gb, ob = link.param_bytes, link.grad_bytes, link.optim_bytes
    sc, held = SchemeCost(), 0.0
    for _, specs in buckets:
        f2 = sum(_fsdp2_numel(ts.shape, ts.spec, n) for ts in specs)
        held += f2 / n
        sc.fsdp += ring_even(link, n, f2 / n * pb).scale(2) + ring_even(link, n, f2 / n * gb)
        sc.fsdp += all_reduce(link, replicas, f2 / n * gb)
        for ts in specs:
            for _, r, c in ts.spec.matrices(ts.shape):
                sc.optim += ring_even(link, n, math.ceil(r / n) * c * ob)
    return sc, {"max_rank_elems": held}


def token_exchange(preset: str, world_size: int, ep: int, *, tokens_per_step: int, act_bytes: int,
                   link: LinkConfig) -> tuple[Cost, dict]:  # fmt: skip
    """EP's per-step token traffic on one rank: per MoE layer one all-to-all of the ``[E]`` routing
    counts, the dispatch and the combine in forward and the same two reversed in backward (4 data
    all-to-alls), each sending (and receiving) ``T x top_k x hidden x act_bytes x (ep-1)/ep`` bytes,
    ``T = tokens_per_step / W`` (dropless, capacity factor 1, average load: every expert gets its share)."""
    m = PRESETS[preset]
    moe_layers = m.num_layers - m.num_dense_layers
    t = tokens_per_step / world_size
    per = t * TOP_K[preset] * m.hidden_size * act_bytes * (ep - 1) / ep
    data = all_to_all(link, ep, np.full(ep, per), np.full(ep, per))
    counts = all_to_all(link, ep, np.full(ep, m.num_experts * 8 * (ep - 1) / ep), np.full(ep, m.num_experts * 8 * (ep - 1) / ep))
    c = (data.scale(4) + counts).scale(moe_layers)
    return c, {"moe_layers": moe_layers, "tokens_per_rank": t, "top_k": TOP_K[preset],
               "bytes_per_data_all_to_all": per}  # fmt: skip


def _dense_mesh(dense, world_size: int, *, expert_elems: float, link: LinkConfig, memory_per_rank: float) -> int:
    """The dense part's shard size: ``suggest_mesh`` on the dense buckets with the memory left after the
    experts' sharded state (16 B per element, ``expert_elems / W`` per rank: equal for every scheme)."""
    from fsdp_optim.sharding.plan import suggest_mesh

    left = memory_per_rank - 16.0 * expert_elems / world_size
    try:
        sug = suggest_mesh(model=dense, world_size=world_size, rule=optimizer_rule("muon"), memory_per_rank=left,
                           param_bytes=link.param_bytes, grad_bytes=link.grad_bytes, optim_bytes=link.optim_bytes,
                           link=LinkModel(alpha_s=link.alpha_s, bytes_per_s=link.bytes_per_s))  # fmt: skip
        return sug.shard_size
    except ValueError:
        return world_size


def _ep_candidates(num_experts: int, world_size: int) -> list[int]:
    """EP degrees tried: powers of two dividing W and E (every rank the same number of whole experts)."""
    out, ep = [], 2
    while ep <= num_experts and world_size % ep == 0:
        if num_experts % ep == 0:
            out.append(ep)
        ep *= 2
    return out


def ep_step(preset: str, world_size: int, *, link: LinkConfig, tokens_per_step: int = EP_TOKENS_PER_STEP,
            act_bytes: int = 2, ep: int | None = None, memory_per_rank: float = 80e9) -> dict:  # fmt: skip
    """Per step per rank: ours vs EP + FSDP2 + DistMuon-style vs FSDP2 + gather-based Muon without EP
    (see ``--ep`` in the module docstring). ``ep=None``: the candidate minimizing ours' time."""
    m = PRESETS[preset]
    if not m.is_moe:
        raise ValueError(f"{preset} has no routed experts")
    rule = optimizer_rule("muon")
    dense, _ = ep_buckets(preset, 1, rule=rule)
    full_experts = ep_buckets(preset, 1, rule=rule)[1]
    expert_elems = float(sum(ts.numel for _, specs in full_experts for ts in specs))
    n_d = _dense_mesh(dense, world_size, expert_elems=expert_elems, link=link, memory_per_rank=memory_per_rank)
    r_d = world_size // n_d
    dense_ours, dense_ours_info = ours_cost(dense, n_d, r_d, link=link)
    dense_dm, dense_dm_info = distmuon_cost(dense, n_d, r_d, link=link)
    dense_f2, dense_f2_info = fsdp2_gather_cost(dense, n_d, r_d, link=link)

    def with_ep(e: int) -> dict:
        _, local = ep_buckets(preset, e, rule=rule)
        reps = world_size // e
        tok, tok_info = token_exchange(preset, world_size, e, tokens_per_step=tokens_per_step, act_bytes=act_bytes,
                                       link=link)  # fmt: skip
        xo, xo_info = ours_cost(local, reps, 1, link=link)
        xd, xd_info = distmuon_cost(local, reps, 1, link=link)
        return {"ep": e, "expert_replicas": reps, "tokens": tok, "tok_info": tok_info,
                "ours": (xo, xo_info), "ep_distmuon": (xd, xd_info)}  # fmt: skip

    tried = {e: with_ep(e) for e in ([ep] if ep else _ep_candidates(m.num_experts, world_size))}

    def ours_total(x):
        return (x["tokens"].seconds + x["ours"][0].total.seconds + dense_ours.total.seconds)

    best = min(tried.values(), key=ours_total)
    xf2, xf2_info = fsdp2_gather_cost(full_experts, world_size, 1, link=link)
    parts = {
        "ours": (best["tokens"], dense_ours, best["ours"][0], dense_ours_info, best["ours"][1]),
        "ep_distmuon": (best["tokens"], dense_dm, best["ep_distmuon"][0], dense_dm_info, best["ep_distmuon"][1]),
        "fsdp2_no_ep": (Cost(), dense_f2, xf2, dense_f2_info, xf2_info),
    }
    out = {
        "model": preset, "world_size": world_size, "tokens_per_step": tokens_per_step,
        "tokens_per_rank": tokens_per_step / world_size, "top_k": TOP_K[preset], "hidden": m.hidden_size,
        "num_experts": m.num_experts, "moe_layers": best["tok_info"]["moe_layers"], "ep": best["ep"],
        "experts_per_rank": math.ceil(m.num_experts / best["ep"]), "expert_replicas": best["expert_replicas"],
        "dense_shard_size": n_d, "dense_replicas": r_d,
        "ours_seconds_by_ep": {str(e): ours_total(x) for e, x in tried.items()},
        "ep_distmuon_seconds_by_ep": {str(e): x["tokens"].seconds + x["ep_distmuon"][0].total.seconds
                                      + dense_dm.total.seconds for e, x in tried.items()},
    }  # fmt: skip
    out["ep_distmuon_best_seconds"] = min(out["ep_distmuon_seconds_by_ep"].values())
    for name, (tok, dense_c, exp_c, dinfo, xinfo) in parts.items():
        total = tok + dense_c.total + exp_c.total
        optim = dense_c.optim + exp_c.optim
        out[name] = {
            "seconds": total.seconds, "bytes": total.bytes, "collectives": total.collectives,
            "tokens": asdict(tok), "dense_fsdp": asdict(dense_c.fsdp), "expert_fsdp": asdict(exp_c.fsdp),
            "optim": asdict(optim), "dense_optim": asdict(dense_c.optim), "expert_optim": asdict(exp_c.optim),
            "max_rank_elems": dinfo["max_rank_elems"] + xinfo["max_rank_elems"],
            "dense_plan": dinfo, "expert_plan": xinfo,
        }  # fmt: skip
    for name in EP_SCHEMES[1:]:
        out[f"time_ratio_{name}_over_ours"] = out[name]["seconds"] / out["ours"]["seconds"]
    out["why"] = _why_ep_slower(out)
    return out


def _why_ep_slower(r: dict) -> str:
    """Empty when ours is no slower than either peer; else the terms where ours spends more."""
    o, parts = r["ours"], []
    for k in EP_SCHEMES[1:]:
        p = r[k]
        if p["seconds"] >= o["seconds"]:
            continue
        terms = {t: o[t]["seconds"] - p[t]["seconds"] for t in ("tokens", "dense_fsdp", "expert_fsdp", "optim")}
        worst = max(terms, key=terms.get)
        parts.append(f"slower than {EP_LABELS[k]} by {(o['seconds'] - p['seconds']) * 1e3:.0f} ms: "
                     f"{worst} +{terms[worst] * 1e3:.0f} ms")  # fmt: skip
    return "; ".join(parts)


def ep_markdown(data: dict) -> str:
    a = data["assumptions"]
    out = [
        "# Communication model under expert parallelism (issue 26): ours vs EP + FSDP2 + DistMuon vs FSDP2 without EP",
        "",
        f"Made by: `{data['command']}`",
        "",
        "Assumptions: the alpha-beta model of comm_model.md, "
        f"{a['bandwidth_gbps']:g} Gb/s per GPU each direction, alpha = {a['alpha_us']:g} us per message step "
        f"({a['latency']} latency; ragged buckets `{a['ragged_model']}`), parameters gathered in "
        f"{8 * a['param_bytes']}-bit, gradients reduced in {8 * a['grad_bytes']}-bit, optimizer exchanges in "
        f"{8 * a['optim_bytes']}-bit, no overlap with compute; every all-to-all (tokens too) at the same link "
        f"(an EP group spanning nodes; within an NVLink node it would be faster for both EP schemes alike). "
        f"Tokens: {data['tokens_per_step'] / 2**20:g}M per step (global batch), W-th of it per rank; "
        f"activations {8 * data['act_bytes']}-bit; dropless routing with capacity factor 1 at the average load "
        "(every EP rank sends and receives `T x top_k x hidden x act_bytes x (ep-1)/ep` per all-to-all); per "
        "MoE layer 4 token all-to-alls (dispatch + combine, forward and backward) + 1 of the `[E]` routing counts. "
        "EP: `ep` is the power of two dividing W and E that minimizes ours' time (`ep` whole experts per "
        "group, same `ep` for both EP schemes); each rank's `E / ep` experts FSDP-sharded over the `W / ep` "
        "ranks holding them; the dense part (attention, router, shared experts, embeddings, head) on the HSDP "
        "shape `suggest_mesh` picks for it with the memory left at "
        f"{data['memory_per_rank'] / 1e9:g} GB after the experts' sharded state, the same shape for all three "
        "schemes. Every scheme holds E/W of the experts per rank (equal sharded memory; `M elems/rank` is the "
        "busiest rank's sharded parameter elements), but without EP a layer's gathered experts are E/ep times "
        "larger. Schemes: **ours** = our default plans (whole expert matrices), Muon local except where a "
        "plan split a matrix (2 all-to-alls of the split pieces); **EP + DistMuon** = the same EP, FSDP2-style flat "
        "buckets, and per bucket 2 all-to-alls moving every Muon matrix (experts too) to a root and back; "
        "**no EP** = FSDP2 dim-0 padded Shard(0) of the whole model over W (experts all-gathered over W in "
        "forward and backward, today's comm_model (b) row) + torch.optim.Muon's all-gather per matrix "
        "(a lower bound). ms = summed collective time per step on the busiest rank; GB = bytes it sends.",
        "",
        "| preset | W | tokens/rank | top_k | ep (experts/rank, expert replicas) | dense mesh | ours ms "
        "| ours: tokens / dense / experts / optim ms "
        "| EP+DistMuon ms | its optim ms | no-EP ms | its optim ms | ours GB | EP+DistMuon GB | no-EP GB "
        "| M elems/rank ours / DistMuon / no-EP | DistMuon/ours | no-EP/ours | why ours is slower |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        o, d, f = r["ours"], r["ep_distmuon"], r["fsdp2_no_ep"]
        out.append(
            f"| {r['model']} | {r['world_size']} | {r['tokens_per_rank']:,.0f} | {r['top_k']} | {r['ep']} "
            f"({r['experts_per_rank']}, {r['expert_replicas']}) | {r['dense_shard_size']} x {r['dense_replicas']} | "
            f"{_ms(o['seconds'])} | {_ms(o['tokens']['seconds'])} / {_ms(o['dense_fsdp']['seconds'])} / "
            f"{_ms(o['expert_fsdp']['seconds'])} / {_ms(o['optim']['seconds'])} | {_ms(d['seconds'])} | "
            f"{_ms(d['optim']['seconds'])} | {_ms(f['seconds'])} | {_ms(f['optim']['seconds'])} | {_gb(o['bytes'])} | "
            f"{_gb(d['bytes'])} | {_gb(f['bytes'])} | {o['max_rank_elems'] / 1e6:.0f} / {d['max_rank_elems'] / 1e6:.0f} / "
            f"{f['max_rank_elems'] / 1e6:.0f} | {r['time_ratio_ep_distmuon_over_ours']:.2f} | "
            f"{r['time_ratio_fsdp2_no_ep_over_ours']:.2f} | {r['why'] or '-'} |"
        )
    slower = [r for r in data["rows"] if r["why"]]
    beaten = [r for r in data["rows"] if r["ep_distmuon_best_seconds"] < r["ours"]["seconds"]]
    out += ["", f"Rows where ours is slower than a peer: {len(slower)} of {len(data['rows'])}. "
            "Each scheme's time by EP degree is in the JSON (`ours_seconds_by_ep`, `ep_distmuon_seconds_by_ep`): "
            f"rows where EP + DistMuon at its own best `ep` beats ours at ours': {len(beaten)}. "
            "Where `ours: optim` is not 0, the expert plan split matrices (1-3 experts per rank over 64-128 "
            "replicas: their 3-9 matrices cannot cover the ranks whole), costing the split pieces' 2 all-to-alls; "
            "no-EP's larger `M elems/rank` at W = 16384 is FSDP2's dim-0 padding of each expert matrix's rows "
            "to a multiple of W."]  # fmt: skip
    return "\n".join(out) + "\n"


def ep_rows(models, world_sizes, *, link: LinkConfig, tokens_per_step: int, act_bytes: int, ep: int | None,
            memory_per_rank: float) -> list[dict]:  # fmt: skip
    rows = []
    for model in models:
        if not PRESETS[model].is_moe:
            continue
        for w in world_sizes:
            r = ep_step(model, w, link=link, tokens_per_step=tokens_per_step, act_bytes=act_bytes, ep=ep,
                        memory_per_rank=memory_per_rank)  # fmt: skip
            rows.append(r)
            print(f"{model:16s} W={w:<6d} ep={r['ep']:<4d} dense {r['dense_shard_size']}x{r['dense_replicas']} ours "
                  f"{r['ours']['seconds'] * 1e3:9.1f} ms | DistMuon x{r['time_ratio_ep_distmuon_over_ours']:6.2f} | "
                  f"no-EP x{r['time_ratio_fsdp2_no_ep_over_ours']:8.2f} {r['why']}", flush=True)  # fmt: skip
    return rows


# ---- outputs -------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def to_markdown(data: dict) -> str:
    a = data["assumptions"]
    hsdp = any(r["replicas"] > 1 for r in data["rows"])
    out = [
        "# Communication model: Muon, bytes and time per training step per rank",
        "",
        f"Made by: `{data['command']}`",
        "",
        f"Assumptions: {a['bandwidth_gbps']:g} Gb/s per GPU each direction, alpha = {a['alpha_us']:g} us per "
        f"message step ({a['latency']} latency: {'(W-1)' if a['latency'] == 'ring' else 'ceil(log2 W)'} alpha per "
        f"collective), all-gathers in {8 * a['param_bytes']}-bit, reductions in {8 * a['grad_bytes']}-bit, optimizer "
        f"exchanges in {8 * a['optim_bytes']}-bit; ragged all-gathers costed as `{a['ragged_model']}`; "
        "no overlap with compute. Real `plan_model` plans of Muon's block rule "
        f"(layout `{data['rows'][0]['layout'] if data['rows'] else 'auto'}`), one bucket per layer. "
        "(a) ours: per bucket all-gather x2 + reduce-scatter, 2 all-to-alls only where a matrix was split; "
        "(b) FSDP2 (dim-0 padded Shard(0)) + torch.optim.Muon: + one all-gather per Muon matrix per step "
        "(a lower bound: DTensor issued 16 per matrix in bench_muon); (c) flat unpadded buckets + "
        "gather-to-root / scatter-back all-to-alls per bucket (veScale, DistMuon). GB = 1e9 bytes sent "
        "by the busiest rank of each collective, summed; ms = summed collective time; `opt` = the optimizer "
        "step's share. Last column: our plan's buckets, split matrices and per-rank bytes max/mean (above "
        "1.10 whole matrices no longer balance: the memory cost this model does not price; HSDP's regime).",
        "",
        "| preset | W | " + ("shard N x R | " if hsdp else "")
        + "ours GB | ours ms | ours opt ms | (b) GB | (b) ms | (b) opt ms | (c) GB | (c) ms | (c) opt ms "
        "| (b)/ours time | (c)/ours time | ours even/ragged, split, bytes max/mean |",
        "|---|---|" + ("---|" if hsdp else "") + "---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        o, b, c = r["ours"], r["fsdp2_muon"], r["gather_scatter"]
        out.append(
            f"| {r['model']} | {r['world_size']} | "
            + (f"{r['shard_size']} x {r['replicas']} | " if hsdp else "")
            + f"{_gb(o['bytes'])} | {_ms(o['seconds'])} | {_ms(o['optim']['seconds'])} | "
            f"{_gb(b['bytes'])} | {_ms(b['seconds'])} | {_ms(b['optim']['seconds'])} | "
            f"{_gb(c['bytes'])} | {_ms(c['seconds'])} | {_ms(c['optim']['seconds'])} | "
            f"{r['time_ratio_fsdp2_muon_over_ours']:.2f} | {r['time_ratio_gather_scatter_over_ours']:.2f} | "
            f"{r['num_even_buckets']}/{r['num_ragged_buckets']}, {r['num_split_blocks']}, "
            f"{r['bytes_max_over_mean']:.2f} |"
        )
    wire_rows = [r for r in data["rows"] if r["replicas"] == 1 and "wire" in r]
    if not wire_rows:  # results made before the wire formats existed
        return "\n".join(out) + "\n"
    out += [
        "",
        "## Wire formats of ragged buckets (no HSDP rows)",
        "",
        "Per step, FSDP collectives of our plan plus our optimizer exchanges, with every ragged bucket moved as "
        "`grouped` (NCCL's list forms: one broadcast / reduce per owner, each its own pipeline: "
        "`owners * (W-1) * alpha`), `padded` (one ring over segments padded to the largest) or `auto` (the "
        "runtime's per-bucket choice by `fsdp_optim.sharding.plan._wire`); (b) FSDP2 + gather-based torch.optim.Muon "
        "beside them.",
        "",
        "| preset | W | grouped ms | padded ms | auto ms | padded buckets / ragged | (b) FSDP2 + Muon ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in wire_rows:
        wr = r["wire"]
        out.append(
            f"| {r['model']} | {r['world_size']} | {_ms(wr['grouped']['seconds'])} | {_ms(wr['padded']['seconds'])} | "
            f"{_ms(wr['auto']['seconds'])} | {wr['num_padded_buckets']} / {r['num_ragged_buckets']} | "
            f"{_ms(r['fsdp2_muon']['seconds'])} |"
        )
    return "\n".join(out) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    models = list(dict.fromkeys(r["model"] for r in data["rows"]))
    for model in models:
        rs = sorted((r for r in data["rows"] if r["model"] == model), key=lambda r: r["world_size"])
        ws = [r["world_size"] for r in rs]
        (line,) = axes[0].plot(ws, [r["ours"]["seconds"] for r in rs], marker="o", label=model)
        axes[0].plot(ws, [r["fsdp2_muon"]["seconds"] for r in rs], ls="--", color=line.get_color(), alpha=0.7)
        axes[0].plot(ws, [r["gather_scatter"]["seconds"] for r in rs], ls=":", color=line.get_color(), alpha=0.7)
        axes[1].plot(ws, [r["time_ratio_fsdp2_muon_over_ours"] for r in rs], marker="o", color=line.get_color())
        axes[2].plot(ws, [r["time_ratio_gather_scatter_over_ours"] for r in rs], marker="o", color=line.get_color())
    axes[0].set(xscale="log", yscale="log", xlabel="world size W", ylabel="comm seconds per step per rank",
                title="ours (solid), (b) FSDP2+Muon (dashed), (c) gather/scatter (dotted)")
    axes[1].set(xscale="log", yscale="log", xlabel="world size W", ylabel="time (b) / ours",
                title="(b) FSDP2 + torch.optim.Muon over ours")
    axes[2].set(xscale="log", xlabel="world size W", ylabel="time (c) / ours", title="(c) gather/scatter per matrix over ours")
    for ax in axes[1:]:
        ax.axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=7)
    a = data["assumptions"]
    fig.suptitle(f"alpha-beta model: {a['bandwidth_gbps']:g} Gb/s, alpha {a['alpha_us']:g} us, {a['latency']} latency, "
                 f"ragged {a['ragged_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=preset_names(), choices=preset_names())
    ap.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    ap.add_argument("--shard-size", type=int, default=None,
                    help="HSDP: plan over N ranks, replicate over W/N (W < N rows are skipped)")
    ap.add_argument("--layout", default="auto", choices=("auto", "even", "ragged"), help="our plan's layout")
    ap.add_argument("--bandwidth-gbps", type=float, default=LinkConfig.bandwidth_gbps)
    ap.add_argument("--alpha-us", type=float, default=LinkConfig.alpha_us)
    ap.add_argument("--param-bytes", type=int, default=LinkConfig.param_bytes)
    ap.add_argument("--grad-bytes", type=int, default=LinkConfig.grad_bytes)
    ap.add_argument("--optim-bytes", type=int, default=LinkConfig.optim_bytes)
    ap.add_argument("--latency", default=LinkConfig.latency, choices=("ring", "log2"))
    ap.add_argument("--ragged-model", default=LinkConfig.ragged_model, choices=("grouped", "grouped-serial", "ring-max"))
    ap.add_argument("--out-name", default="comm_model", help="results/<name>.{json,md,png}")
    ap.add_argument("--balanced", action="store_true",
                    help="issue 27 table: W in {64, 1024, 16384} (or --world-sizes), pure FSDP and suggest_mesh's "
                    "shape at --memory-per-rank, -> <out>/comm_model_balanced.{json,md}")
    ap.add_argument("--memory-per-rank", type=float, default=80e9,
                    help="--balanced / --ep: bytes per rank (default 80e9)")
    ap.add_argument("--ep", action="store_true",
                    help="issue 26: expert parallelism on the MoE presets, W in {1024, 16384} (or --world-sizes): ours vs "
                    "EP + FSDP2 + DistMuon vs FSDP2 + gather-based Muon without EP -> <out>/comm_model_ep.{json,md}")
    ap.add_argument("--tokens-per-step", type=int, default=EP_TOKENS_PER_STEP,
                    help="--ep: global batch in tokens per step (default 16M = 2^24)")
    ap.add_argument("--act-bytes", type=int, default=2, help="--ep: bytes per activation element (bf16: 2)")
    ap.add_argument("--ep-size", type=int, default=None, help="--ep: force this EP degree (default: the best for ours)")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/ for the full run with "
                    "default assumptions, runs/bench-quick/ when any other flag is changed)")
    args = ap.parse_args(argv)
    results = out_dir(ap, args, keep=("shard_size", "out_name", "no_write", "balanced", "ep"))
    link = LinkConfig(
        bandwidth_gbps=args.bandwidth_gbps, alpha_us=args.alpha_us, param_bytes=args.param_bytes,
        grad_bytes=args.grad_bytes, optim_bytes=args.optim_bytes, latency=args.latency, ragged_model=args.ragged_model,
    )
    command = " ".join(["python benchmarks/comm_model.py", *(sys.argv[1:] if argv is None else argv)])
    t0 = time.perf_counter()
    if args.balanced:
        ws = args.world_sizes if args.world_sizes != list(WORLD_SIZES) else list(BALANCED_WORLD_SIZES)
        rows = balanced_rows(args.models, ws, link=link, memory_per_rank=args.memory_per_rank)
        data = {"command": command, "assumptions": asdict(link), "memory_per_rank": args.memory_per_rank,
                "seconds": time.perf_counter() - t0, "python": platform.python_version(), "rows": rows}  # fmt: skip
        return _emit(data, balanced_markdown(data), results, "comm_model_balanced", no_write=args.no_write)
    if args.ep:
        ws = args.world_sizes if args.world_sizes != list(WORLD_SIZES) else list(EP_WORLD_SIZES)
        rows = ep_rows(args.models, ws, link=link, tokens_per_step=args.tokens_per_step, act_bytes=args.act_bytes,
                       ep=args.ep_size, memory_per_rank=args.memory_per_rank)  # fmt: skip
        data = {"command": command, "assumptions": asdict(link), "memory_per_rank": args.memory_per_rank,
                "tokens_per_step": args.tokens_per_step, "act_bytes": args.act_bytes, "top_k": TOP_K,
                "seconds": time.perf_counter() - t0, "python": platform.python_version(), "rows": rows}  # fmt: skip
        return _emit(data, ep_markdown(data), results, "comm_model_ep", no_write=args.no_write)
    rows = []
    for model in args.models:
        for w in args.world_sizes:
            if args.shard_size and (w < args.shard_size or w % args.shard_size):
                continue
            r = model_step(model, w, link=link, layout=args.layout, shard_size=args.shard_size)
            rows.append(r)
            print(
                f"{model:16s} W={w:<6d} ours {r['ours']['seconds'] * 1e3:10.1f} ms {r['ours']['bytes'] / 1e9:8.2f} GB | "
                f"(b) x{r['time_ratio_fsdp2_muon_over_ours']:7.2f} | (c) x{r['time_ratio_gather_scatter_over_ours']:6.2f}",
                flush=True,
            )
    data = {
        "command": command,
        "assumptions": asdict(link),
        "seconds": time.perf_counter() - t0,
        "python": platform.python_version(),
        "rows": rows,
    }
    return _emit(data, to_markdown(data), results, args.out_name, no_write=args.no_write, with_plot=True)


def _emit(data: dict, md: str, results: Path, name: str, *, no_write: bool, with_plot: bool = False) -> int:
    """Print the table (``--no-write``), or write ``name``.json / .md (and the plot) under ``results``."""
    if no_write:
        print(md)
        return 0
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(data, indent=1))
    (results / f"{name}.md").write_text(md)
    if with_plot:
        plot(data, results / f"{name}.png")
    print(f"wrote {results}/{name}.{{json,md{',png' if with_plot else ''}}} in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
