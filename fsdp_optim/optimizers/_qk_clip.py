"""QK-clip (MuonClip): cap each attention head's largest pre-softmax logit by rescaling W_q / W_k.

[Note: QK-clip]
Kimi K2 (Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, section "MuonClip:
Stable Training with Weight Clipping") trains with Muon plus QK-clip: after each optimizer step,
every head h whose largest pre-softmax attention logit in that step, S_h = max (q_i k_j^T * scale),
exceeded a threshold tau has its query and key projections scaled down by gamma_h = tau / S_h,
so that the same input would now give a largest logit of exactly tau:

* no shared keys (``n_kv_heads == n_heads``): W_q^h and W_k^h are both scaled by sqrt(gamma_h)
  (the report's rule for per-head query/key components);
* shared keys (GQA, ``n_kv_heads < n_heads``): the report's MLA rule for the shared rotary key is
  "scale the head's query part by gamma_h, leave the shared key untouched". We apply that rule to
  the whole head: only the query head's rows of W_q are scaled, by gamma_h. Scaling the shared key
  would also shrink the logits of the other query heads of its group, which did not exceed tau.

The logit q k^T is linear in each of the two projections (RoPE is a rotation, applied after the
projection), so a factor c on W_q^h's rows scales head h's logits by c, and nothing else.
Heads with S_h <= tau are untouched; the optimizer state is untouched.

Recording costs no extra pass: ``attention_with_max_logits`` computes attention explicitly
(logits, mask, softmax, @ v) and keeps each head's max of the same logits (detached), or an
attention that has its own logits calls ``record_max_logits``. Maxima accumulate (running max)
over every grad-enabled forward since the last ``qk_clip_`` (micro-batches of one step);
forwards under ``torch.no_grad()`` (evaluation) are not recorded. ``qk_clip_`` then makes ONE
``all_reduce(MAX)`` of all layers' per-head maxima over the data-parallel group, scales the rows
of the clipped heads and resets the maxima.

Sharded parameters (``fsdp_optim.fully_shard``) hold a flat piece ``[start, end)`` of the
row-major global weight; head h's rows are the flat range ``[h * hd * cols, (h + 1) * hd * cols)``.
Scaling rows is element-wise, so each rank scales the part of that range it holds with the same
``mul_`` the unsharded weight would get: the result is bitwise the unsharded one, whatever the
layout, and needs no communication besides the all-reduce of the maxima.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.tensor import Shard

from ..sharding.contract import RaggedDTensor, local_shard, local_tensor

__all__ = [
    "ClipStats",
    "attention_with_max_logits",
    "measure_max_logits",
    "qk_clip_",
    "record_max_logits",
    "recorded_max_logits",
]

_ATTR = "_qk_clip_max_logits"


class ClipStats(NamedTuple):
    """What ``qk_clip_`` saw (the same on every rank): maxima are before clipping, over all ranks."""

    max_logit: float
    """Largest pre-softmax logit over every head and layer (``-inf`` with no layers)."""
    num_clipped: int
    """Heads scaled down (summed over layers)."""
    layer_max: tuple[float, ...]
    """Each layer's largest logit, in the order of the layers."""


# ---- recording -------------------------------------------------------------------------------------
def record_max_logits(module: nn.Module, logits: torch.Tensor) -> None:
    """Fold the per-head max of ``logits`` (``[batch, heads, q_len, k_len]``, scaled, masked positions
    ``-inf``) into ``module``'s running maxima (detached, float32). No-op when grad is disabled."""
    if not torch.is_grad_enabled():
        return
    if logits.dim() != 4:
        raise ValueError(
            f"record_max_logits({type(module).__name__}): logits must be [batch, heads, q_len, k_len], got shape "
            f"{tuple(logits.shape)}"
        )
    _fold_max(module, logits.detach().amax(dim=(0, 2, 3)).float())


def _fold_max(module: nn.Module, m: torch.Tensor) -> None:
    """Fold per-head maxima ``m`` (float32 ``[heads]``) into ``module``'s running maxima."""
    old = getattr(module, _ATTR, None)
    if old is not None and old.shape != m.shape:
        raise ValueError(
            f"record_max_logits({type(module).__name__}): {m.numel()} heads recorded after {old.numel()}; a module "
            "records one attention's heads"
        )
    setattr(module, _ATTR, m if old is None else torch.maximum(old, m))


def measure_max_logits(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    max_chunk_elements: int = 1 << 24,
) -> None:
    """Record each query head's max logit of ``q k^T * scale`` on ``module`` without keeping anything
    for backward: a no-grad pass over chunks of query rows (at most ``max_chunk_elements`` logits at a
    time), for an attention computed by ``F.scaled_dot_product_attention`` (whose kernels do not expose
    their logits). An extra ``q k^T`` pass, so for measuring (the recipe's ``max_attn_logit`` on logged
    steps); ``attention_with_max_logits`` records from the attention's own logits. Shapes as there.
    No-op when grad is disabled (evaluation forwards are not recorded, as ``record_max_logits``)."""
    if not torch.is_grad_enabled():
        return
    if q.dim() != 4 or k.dim() != 4 or k.shape[1] == 0 or q.shape[1] % k.shape[1] or k.shape[::3] != q.shape[::3]:
        raise ValueError(
            f"measure_max_logits({type(module).__name__}): need q [batch, n_heads, q_len, head_dim] and k [batch, "
            f"n_kv_heads, k_len, head_dim] with n_heads a multiple of n_kv_heads, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = max(1, max_chunk_elements // max(1, b * hq * s))
    top = torch.full((hq,), float("-inf"), dtype=torch.float32, device=q.device)
    with torch.no_grad():
        kt = k.detach().unsqueeze(2).transpose(-2, -1)
        for i in range(0, t, rows):
            qi = q.detach()[:, :, i : i + rows]
            logits = (qi.reshape(b, hkv, g, qi.shape[2], d) @ kt).view(b, hq, qi.shape[2], s) * scale
            if causal:
                pos = torch.arange(i, i + qi.shape[2], device=q.device)[:, None]
                logits = logits.masked_fill(torch.arange(s, device=q.device)[None, :] > pos, float("-inf"))
            top = torch.maximum(top, logits.amax(dim=(0, 2, 3)).float())
    _fold_max(module, top)


def recorded_max_logits(module: nn.Module) -> torch.Tensor | None:
    """This rank's per-head maxima recorded since the last ``qk_clip_`` (``None``: never recorded)."""
    return getattr(module, _ATTR, None)


def attention_with_max_logits(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)``
    computed explicitly (logits = q k^T * scale, causal mask, softmax in fp32, @ v), recording each
    query head's max logit on ``module`` (see ``record_max_logits``) from the same logits.

    ``q``: ``[batch, n_heads, q_len, head_dim]``; ``k``, ``v``: ``[batch, n_kv_heads, k_len, head_dim]``
    with ``n_heads`` a multiple of ``n_kv_heads`` (query head h uses key head ``h // (n_heads //
    n_kv_heads)``, as SDPA's ``enable_gqa``). ``causal``: query i sees keys ``j <= i`` (SDPA's
    top-left alignment). ``scale`` defaults to ``1 / sqrt(head_dim)``. Equal to SDPA to fp32
    rounding (measured on CPU, fp32: max |diff| <= 4.8e-7 on O(1) outputs; see the tests).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention_with_max_logits({type(module).__name__}): q, k, v must be [batch, heads, len, head_dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv or k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"attention_with_max_logits({type(module).__name__}): need n_heads ({hq}) a multiple of n_kv_heads "
            f"({hkv}), k of shape [batch={b}, n_kv_heads, k_len, head_dim={d}] and v [batch, n_kv_heads, k_len, *], "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # Key/value heads broadcast over their g query heads: one [q_len, k_len] product per (batch, query
    # head), the shapes SDPA's math path and a per-head loop use, so the logits are bitwise theirs
    # (batching the g heads as [g * q_len] rows rounds differently). The expanded k / v copies are
    # q-sized, small beside the [q_len, k_len] logits that explicit attention materializes anyway.
    logits = (q.view(b, hkv, g, t, d) @ k.unsqueeze(2).transpose(-2, -1)).view(b, hq, t, s) * scale
    if causal:
        keep = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
        logits = logits.masked_fill(~keep, float("-inf"))
    record_max_logits(module, logits)
    probs = torch.softmax(logits.float(), dim=-1).to(v.dtype)
    return (probs.view(b, hkv, g, t, s) @ v.unsqueeze(2)).view(b, hq, t, v.shape[-1])


# ---- clipping --------------------------------------------------------------------------------------
class _Layer(NamedTuple):
    name: str
    module: nn.Module
    wq: torch.Tensor
    wk: torch.Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int


def _is_attention(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("wq", "wk", "n_heads"))


def _layer(name: str, m: nn.Module) -> _Layer:
    what = f"qk_clip_: attention module {name or type(m).__name__!r}"
    if not _is_attention(m):
        raise ValueError(
            f"{what} has no {[a for a in ('wq', 'wk', 'n_heads') if not hasattr(m, a)]}: qk_clip_ needs modules with "
            "`wq` and `wk` (nn.Linear query and key projections), `n_heads`, and optionally `n_kv_heads` "
            "(default n_heads) and `head_dim` (default wq.out_features // n_heads)"
        )
    wq_mod, wk_mod = m.wq, m.wk
    if wq_mod is wk_mod:
        raise ValueError(f"{what}: wq and wk are one module (a fused QKV projection); split it into wq and wk")
    for proj, mod in (("wq", wq_mod), ("wk", wk_mod)):
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"{what}: {proj} must be a linear layer with a 2-D weight, got {type(mod).__name__}")
        if getattr(mod, "bias", None) is not None:
            raise ValueError(
                f"{what}: {proj} has a bias; qk_clip_ scales weight rows only, which would leave the bias "
                f"unscaled. Use {proj} = nn.Linear(..., bias=False)"
            )
        if type(w).__name__ == "DTensor":
            raise ValueError(
                f"{what}: {proj}.weight is a DTensor with placements {w.placements} (FSDP2 / TP); shard with "
                "fsdp_optim.fully_shard instead"
            )
    n_heads = m.n_heads
    n_kv = getattr(m, "n_kv_heads", None) or n_heads
    wq, wk = wq_mod.weight, wk_mod.weight
    (q_rows, q_cols), (k_rows, k_cols) = wq.shape, wk.shape  # (DTensors: the global shapes)
    hd = getattr(m, "head_dim", None) or (q_rows // n_heads if isinstance(n_heads, int) and n_heads > 0 else 0)
    ok_ints = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (n_heads, n_kv, hd))
    if not ok_ints or n_heads % n_kv or q_rows != n_heads * hd or k_rows != n_kv * hd:
        raise ValueError(
            f"{what}: n_heads={n_heads}, n_kv_heads={n_kv}, head_dim={hd} do not fit wq [{q_rows}, {q_cols}] and "
            f"wk [{k_rows}, {k_cols}]: need positive ints, n_heads a multiple of n_kv_heads, "
            "wq.out_features == n_heads * head_dim and wk.out_features == n_kv_heads * head_dim"
        )
    return _Layer(name, m, wq, wk, n_heads, n_kv, hd)


def _layers(modules_or_model: nn.Module | Iterable[nn.Module]) -> list[_Layer]:
    if isinstance(modules_or_model, nn.Module):
        if _is_attention(modules_or_model):
            return [_layer("", modules_or_model)]
        found = [(n, m) for n, m in modules_or_model.named_modules() if _is_attention(m)]
        if not found:
            raise ValueError(
                f"qk_clip_: no attention module in {type(modules_or_model).__name__}: it looks for modules with `wq`, "
                "`wk` and `n_heads` (see fsdp_optim.optimizers.qk_clip_); pass the attention modules explicitly"
            )
        return [_layer(n, m) for n, m in found]
    mods = list(modules_or_model)
    bad = [type(m).__name__ for m in mods if not isinstance(m, nn.Module)]
    if bad:
        raise ValueError(f"qk_clip_: expects an nn.Module or an iterable of attention modules, got items of type {bad}")
    seen: dict[int, int] = {}
    for i, m in enumerate(mods):
        if id(m) in seen:
            raise ValueError(
                f"qk_clip_: attention module [{i}] ({type(m).__name__}) is listed twice (first as [{seen[id(m)]}]); "
                "it would be clipped twice. List each attention module once"
            )
        seen[id(m)] = i
    return [_layer(f"[{i}]", m) for i, m in enumerate(mods)]


def _tp_rows(p: torch.Tensor, what: str) -> tuple[int, int]:
    """``(first global row, rows)`` of this rank's tensor-parallel part of ``p`` (all rows without TP):
    ``ColwiseParallel`` splits ``wq`` / ``wk`` by rows, so each TP rank holds whole heads."""
    if not isinstance(p, RaggedDTensor):
        return 0, p.shape[0]
    for d, q in enumerate(p.placements):
        if isinstance(q, Shard):
            if q.dim != 0:
                raise ValueError(
                    f"qk_clip_: {what} is tensor-parallel along dim {q.dim} (placements {p.placements}); QK-clip scales "
                    "heads' rows, so wq / wk must be split by rows (ColwiseParallel) or not at all"
                )
            n = p.shape[0] // p.device_mesh.size(d)
            return p.device_mesh.get_coordinate()[d] * n, n
    return 0, p.shape[0]


def _scale_rows_(p: torch.Tensor, row0: int, nrows: int, factor: float) -> None:
    """``W[row0 : row0 + nrows] *= factor`` on the global weight, applied to the piece this rank holds."""
    info = local_shard(p)
    if info is None:
        p.data[row0 : row0 + nrows].mul_(factor)
        return
    first, rows = _tp_rows(p, "a weight")  # (the rows of this TP rank's part; all without TP)
    row0, end = max(row0 - first, 0), min(row0 + nrows - first, rows)
    if end <= row0:
        return
    nrows = end - row0
    cols = info.shape[1]
    lo, hi = max(row0 * cols, info.start), min((row0 + nrows) * cols, info.end)
    if lo < hi:
        local_tensor(p).view(-1)[lo - info.start : hi - info.start].mul_(factor)


def _check_tau(tau: float) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(
            f"qk_clip_: tau must be a positive number (the cap on the pre-softmax logit, e.g. 100.0; math.inf "
            f"only measures), got {tau!r}"
        )
    return float(tau)


@torch.no_grad()
def qk_clip_(
    modules_or_model: nn.Module | Iterable[nn.Module],
    *,
    tau: float,
    group: dist.ProcessGroup | None = None,
) -> ClipStats:
    """QK-clip (see [Note: QK-clip]): call after ``optimizer.step()``, on every rank of ``group``.

    ``modules_or_model``: a model (every submodule with ``wq``, ``wk``, ``n_heads`` is an attention
    layer, in ``named_modules`` order), one attention module, or an iterable of them. Each layer has
    ``wq`` / ``wk``: bias-free linear layers (plain or sharded by ``fsdp_optim.fully_shard``),
    ``n_heads``, optional ``n_kv_heads`` (default ``n_heads``) and ``head_dim`` (default
    ``wq.out_features // n_heads``), and records its logits in forward with
    ``attention_with_max_logits`` or ``record_max_logits``. ``tau``: the cap (``math.inf``: measure
    only). ``group``: the data-parallel group the maxima are reduced over (default: the world; no
    collective when not distributed). Every layer's per-head maxima go into ONE ``all_reduce(MAX)``;
    a head with max S_h > tau gets gamma_h = tau / S_h (float64): W_q^h and W_k^h times
    sqrt(gamma_h) without shared keys, only W_q^h times gamma_h with GQA; a NaN or infinite max (a
    diverged step) is reported in the stats but clips nothing. The maxima are then reset.
    Returns ``ClipStats``; a layer no rank recorded since the last call raises ``ValueError``.

    Sharded parameters are clipped in place on each rank's piece: call it with the model resharded,
    as it is after backward and ``optimizer.step()`` (not between an explicit ``unshard()`` and the
    next forward, which would use the gathered copy). Only ``fsdp_optim.fully_shard`` sharding and
    plain modules: DTensor parameters (torch's FSDP2) are refused.
    """
    tau = _check_tau(tau)
    layers = _layers(modules_or_model)
    if not layers:
        return ClipStats(float("-inf"), 0, ())
    device = layers[0].wq.device
    parts = []
    for L in layers:
        rec = recorded_max_logits(L.module)
        # Under tensor parallelism each TP rank records its own heads (ColwiseParallel wq): they go to
        # their global positions, the others stay -inf, and the MAX over the world fills in every head.
        first, rows = _tp_rows(L.wq, f"{L.name!r}.wq")
        _tp_rows(L.wk, f"{L.name!r}.wk")
        local = rows // L.head_dim
        if rec is not None and rec.numel() != local:
            raise ValueError(
                f"qk_clip_: attention module {L.name!r} recorded {rec.numel()} heads but has n_heads={L.n_heads}"
                + (f" ({local} on this tensor-parallel rank)" if local != L.n_heads else "")
                + "; record the logits of all its query heads ([batch, n_heads, q_len, k_len])"
            )
        part = torch.full((L.n_heads,), float("-inf"), device=device)
        if rec is not None:
            part[first // L.head_dim : first // L.head_dim + local] = rec.to(device)
        parts.append(part)
    maxima = torch.cat(parts)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    host = maxima.cpu()  # one device-to-host copy; everything below reads it
    per_layer = host.split([L.n_heads for L in layers])
    for L in layers:
        rec = recorded_max_logits(L.module)
        if rec is not None:
            rec.fill_(float("-inf"))
    empty = [L.name for L, s in zip(layers, per_layer) if bool(torch.isneginf(s).all())]
    if empty:
        raise ValueError(
            f"qk_clip_: attention module(s) {empty} recorded no logits since the last qk_clip_ on any rank; compute "
            "their attention with fsdp_optim.optimizers.attention_with_max_logits (or call record_max_logits) in "
            "forward, with grad enabled"
        )
    num_clipped = 0
    for L, heads in zip(layers, per_layer):
        shared = L.n_kv_heads != L.n_heads
        for h, s_h in enumerate(heads.tolist()):
            if not tau < s_h < math.inf:  # NaN / inf (a diverged step): reported, not clipped
                continue
            gamma = tau / s_h
            num_clipped += 1
            if shared:
                _scale_rows_(L.wq, h * L.head_dim, L.head_dim, gamma)
            else:
                root = math.sqrt(gamma)
                _scale_rows_(L.wq, h * L.head_dim, L.head_dim, root)
                _scale_rows_(L.wk, h * L.head_dim, L.head_dim, root)
    layer_max = tuple(s.max().item() for s in per_layer)  # NaN propagates to the log
    return ClipStats(host.max().item(), num_clipped, layer_max)
