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
    python benchmarks/comm_model.py --balanced   # issue 27: W in {64, 1024, 16384}, pure FSDP and the
                                                 # suggest_mesh shape at 80 GB -> comm_model_balanced.*

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
from fsdp_optim.sharding import BucketPlan, Layout, PlanConfig, plan_model
from fsdp_optim.sharding.plan import preset_buckets, preset_names
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
    ap.add_argument("--memory-per-rank", type=float, default=80e9, help="--balanced: bytes per rank (default 80e9)")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/ for the full run with "
                    "default assumptions, runs/bench-quick/ when any other flag is changed)")
    args = ap.parse_args(argv)
    results = out_dir(ap, args, keep=("shard_size", "out_name", "no_write", "balanced"))
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
        md = balanced_markdown(data)
        if args.no_write:
            print(md)
            return 0
        results.mkdir(parents=True, exist_ok=True)
        (results / "comm_model_balanced.json").write_text(json.dumps(data, indent=1))
        (results / "comm_model_balanced.md").write_text(md)
        print(f"wrote {results}/comm_model_balanced.{{json,md}} in {data['seconds']:.0f} s")
        return 0
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
    md = to_markdown(data)
    if args.no_write:
        print(md)
        return 0
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.out_name}.json").write_text(json.dumps(data, indent=1))
    (results / f"{args.out_name}.md").write_text(md)
    plot(data, results / f"{args.out_name}.png")
    print(f"wrote {results}/{args.out_name}.{{json,md,png}} in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
