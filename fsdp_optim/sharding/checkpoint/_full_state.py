"""Full (unsharded) state dicts of a model sharded with ``fully_shard``: gathering them
(``full_state_dict``) and loading them (``load_full_state_dict``, from every rank or from rank 0)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._bucket import _Bucket
from .._dist import agree_on_error, is_distributed, rank_and_world_size
from .._runtime import _runtimes_under, buckets_of
from .._dtensor import RaggedDTensor
from ._serialization import type_name
from ._state import check_keys, torch_names

__all__ = ["full_state_dict", "gather_to_group_rank0", "load_full_state_dict", "whole_tensors"]


def full_state_dict(module: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """Plain full tensors under ``module``'s own names (as ``module.state_dict()`` of the unsharded
    model: tied parameters under each name, persistent buffers included).

    Collective: every rank of the mesh must call it (one all-gather per bucket holding a parameter of
    ``module``, one bucket at a time). Parameters come back in their master dtype.
    ``rank0_only``: only global rank 0 keeps the tensors; the others return ``{}`` and never hold more
    than one bucket at full size (the one being gathered). ``cpu_offload``: the tensors are copied to
    the CPU as each bucket arrives (else they stay on the mesh's device). As FSDP2's
    ``get_model_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    keys = torch_names(module)  # state_dict()'s keys: [Note: state-dict names] in _state.py
    names: list[tuple[str, torch.Tensor]] = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                names.append((keys.get(pre + name, pre + name), p))
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                names.append((keys.get(pre + name, pre + name), b))
    wanted = {id(t) for _, t in names}

    def out_of(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu" if cpu_offload else t.device, copy=True)

    full: dict[int, torch.Tensor] = {}
    for b in buckets_of(module):
        ups = b.unsharded if b.unsharded is not None else [None] * len(b.sharded)  # never gathered yet
        ids = [(sp, up) for sp, up in zip(b.sharded, ups) if id(sp) in wanted or id(up) in wanted]
        if not ids:
            continue
        views = whole_tensors(b, rank0_only=rank0_only)
        if keep:
            for (sp, up), view in zip(zip(b.sharded, ups), views):
                if id(sp) in wanted or id(up) in wanted:
                    full[id(sp)] = out_of(view)
                    if up is not None:
                        full[id(up)] = full[id(sp)]
        del views
    if not keep:
        return {}
    return {key: full[id(t)] if id(t) in full else out_of(t) for key, t in names}


def whole_tensors(b: _Bucket, *, rank0_only: bool) -> list[torch.Tensor] | None:
    """The bucket's tensors, whole, in placement order: one gather in its shard group (to the group's
    rank 0 only with ``rank0_only``: ``None`` on the other ranks); an expert-parallel bucket's tensors
    each gathered whole over their mesh (every rank of the world holds a piece; on every rank)."""
    if b.is_expert:
        b.settle()
        return [sp.full_tensor() for sp in b.sharded]
    tp = next((sp.tp for sp in b.params if sp.tp is not None), None)
    if tp is not None:
        return _whole_tp_tensors(b, tp.mesh)
    flat = gather_to_group_rank0(b) if rank0_only else b.gather_full()
    return None if flat is None else b.full_views(flat)


def _whole_tp_tensors(b: _Bucket, tp_mesh: Any) -> list[torch.Tensor]:
    """A tensor-parallel bucket's tensors, whole, on every rank: one all-gather in the shard group (the
    TP-local tensors), then one of that flat buffer over the TP group (every TP rank's bucket has the
    same plan, [Note: FSDP x TP]); each TP-split tensor is its TP ranks' parts concatenated."""
    flat = b.gather_full()
    group = tp_mesh.get_group(0)
    size = tp_mesh.size()
    every = flat.new_empty(size * flat.numel())
    dist.all_gather_into_tensor(every, flat, group=group)
    group_ranks = dist.get_process_group_ranks(group)
    parts = every.view(size, -1)
    by_coord = [b.full_views(parts[group_ranks.index(r)]) for r in tp_mesh.mesh.tolist()]
    return [
        torch.cat([views[i] for views in by_coord], dim=sp.tp.dim) if sp.tp is not None and sp.tp.dim is not None
        else by_coord[0][i]
        for i, sp in enumerate(b.params)
    ]  # fmt: skip


def gather_to_group_rank0(b: _Bucket) -> torch.Tensor | None:
    """The bucket's full flat buffer on its shard group's rank 0 (``None`` elsewhere): one ``gather``
    of segments padded to the largest, so the other ranks hold only their own (padded) segment."""
    b.settle()
    buf = b.buffer
    if buf.backend is None or buf.world_size == 1:
        return buf.all_gather()
    size = max(buf.sizes)
    send = torch.zeros(size, dtype=buf.dtype, device=buf.device)
    send[: buf.segment_numel].copy_(buf.segment)
    # Gather to global rank 0 where it is in this group (the rank that keeps the result), else to the
    # group's first rank (another HSDP replica: gathered and dropped).
    try:
        dist.get_group_rank(buf.group or dist.group.WORLD, 0)
        group_rank0 = 0
    except (ValueError, RuntimeError):
        group_rank0 = dist.get_global_rank(buf.group, 0)
    me_first = dist.get_rank() == group_rank0
    pieces = [torch.empty(size, dtype=buf.dtype, device=buf.device) for _ in range(buf.world_size)] if me_first else None
    dist.gather(send, pieces, dst=group_rank0, group=buf.group)
    if not me_first:
        return None
    return torch.cat([piece[:n] for piece, n in zip(pieces, buf.sizes)])


def load_full_state_dict(
    model: nn.Module, full: Mapping[str, torch.Tensor] | None, *, strict: bool = True, broadcast_from_rank0: bool = False
) -> None:
    """Load plain full tensors (the model's own names, global shapes) into a sharded model.

    Default: every rank passes the full dict and copies its own range; no communication.
    ``broadcast_from_rank0``: only global rank 0 needs the dict (the others may pass ``None`` or
    ``{}``); it is sent one bucket at a time (one broadcast per bucket, then one per buffer or
    unsharded parameter), so no rank holds more than the dict (rank 0) or one bucket at full size.
    As FSDP2's ``set_model_state_dict(..., StateDictOptions(broadcast_from_rank0=True))``.
    Keys, shapes and sources (tensors with values, of a dtype that converts) are checked and agreed
    on before anything is loaded, so a bad dict raises a ``ValueError`` on every rank and changes
    nothing; see [Note: broadcasting from rank 0] for a failure only seen while reading.
    """
    rank, _ = rank_and_world_size()
    holds_dict = not broadcast_from_rank0 or rank == 0
    full = full if full is not None else {}
    err = None
    pairs: list[tuple[str, RaggedDTensor | None]] = []
    try:
        keys = torch_names(model)  # (reshards) params and targets under state_dict()'s keys: [Note: state-dict names]
        params = {keys[n]: p for n, p in model.named_parameters(remove_duplicate=False)}
        buffers = {keys[n]: b for n, b in model.named_buffers(remove_duplicate=False)}
        own = model.state_dict()
        if holds_dict:
            what = "load_full_state_dict(strict=True)"
            try:
                check_keys(set(own) - set(full), set(full) - set(own), strict=strict, what=what)
            except ValueError as e:
                raise ValueError(
                    f"{e}; a full state dict holds model.state_dict()'s keys (fsdp_optim.full_state_dict(model) "
                    "gives them); strict=False loads the keys both hold and keeps the model's values of the others"
                ) from None
        for key in own:
            if holds_dict and key not in full:
                continue
            if key not in params and key not in buffers:
                raise ValueError(
                    f"load_full_state_dict: model.state_dict() holds {key!r}, which is no parameter or buffer of "
                    f"{type(model).__name__} (a state-dict hook made it); load it with model.load_state_dict()"
                )
            p = params.get(key)
            info = p if isinstance(p, RaggedDTensor) else None
            shape = tuple(own[key].shape)
            if holds_dict:
                _check_source(key, full, shape, own[key].dtype)
            pairs.append((key, info))
    except Exception as e:  # noqa: BLE001
        err = e
    agree_on_error(err, what="load_full_state_dict")
    targets = {**buffers, **params}
    if not broadcast_from_rank0 or not is_distributed():
        with torch.no_grad():
            for n, (key, info) in enumerate(pairs):
                dst = targets[key]
                try:
                    src = _read_source(full, key, tuple(dst.shape))
                except Exception as e:  # noqa: BLE001 - a lazy source (load_hf) failing when read
                    state = f"the {n} tensors before it are loaded, the rest are not" if n else "nothing was loaded"
                    raise ValueError(
                        f"load_full_state_dict: cannot read {key}: {type(e).__name__}: {e}; {state}"
                    ) from e
                if info is not None:
                    a, e = info.local_range
                    dst._local_tensor.copy_(info._tp_local(src.detach()).reshape(-1)[a:e])
                else:
                    dst.copy_(src)
        return
    _broadcast_full_state(model, full, [k for k, _ in pairs], targets, rank)


def _check_source(key: str, full: Mapping[str, Any], shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise naming ``key`` unless ``full[key]`` can be copied into a target of ``shape`` and ``dtype``:
    a dense tensor with values (not meta), of that shape, of a dtype that converts. A lazy mapping (as
    ``load_hf``'s) answers ``meta_of(key)``, a meta tensor of what reading would give, without reading
    (or ``None``: then the tensor is checked when read, by ``_read_source``)."""
    lazy = hasattr(full, "meta_of")
    src = full.meta_of(key) if lazy else full[key]
    if lazy and src is None:
        return  # only reading can tell: checked then (``_read_source``)
    if not torch.is_tensor(src):
        raise ValueError(f"{key}: the full state dict holds a {type_name(src)}, not a tensor")
    if tuple(src.shape) != tuple(shape):
        raise ValueError(
            f"shape mismatch for {key}: the full state dict has {tuple(src.shape)}, the model {tuple(shape)}"
        )
    if src.is_meta and not lazy:
        raise ValueError(
            f"{key}: the full state dict's tensor is on the meta device (a shape without values); pass one with "
            "values (e.g. from a model built on a real device, or loaded from a file)"
        )
    if src.layout != torch.strided:
        raise ValueError(f"{key}: the full state dict's tensor is {src.layout}; pass a dense one (.to_dense())")
    if not _copies(src.dtype, dtype):
        raise ValueError(f"{key}: the full state dict's {src.dtype} tensor cannot be copied into the model's {dtype}")


def _read_source(full: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``full[key]``, refused unless a tensor of ``shape``: what ``_check_source`` could not see of a lazy
    source (a ``from_hf`` that needs real data) is seen here, before a wrong shape of the same size is
    copied in as a silently permuted tensor."""
    src = full[key]
    if not torch.is_tensor(src):
        raise ValueError(f"{key}: the full state dict holds a {type_name(src)}, not a tensor")
    if tuple(src.shape) != tuple(shape):
        raise ValueError(
            f"shape mismatch for {key}: the full state dict has {tuple(src.shape)}, the model {tuple(shape)}"
        )
    return src


def _copies(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``copy_`` converts ``src`` to ``dst`` (tried on one element)."""
    if src == dst:
        return True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (complex to real warns, and converts)
            torch.empty(1, dtype=dst).copy_(torch.zeros(1, dtype=src))
    except Exception:  # noqa: BLE001
        return False
    return True


# [Note: broadcasting from rank 0]
# ``load_full_state_dict(broadcast_from_rank0=True)`` (and so ``load_hf``) reads every tensor on rank 0
# only, while the other ranks wait in the bucket's broadcast. Everything rank 0 can check without
# reading (keys, shapes, dtypes, no meta tensors; for ``load_hf``'s lazy files the shape and dtype of
# what ``convert``'s ``from_hf`` returns, evaluated on a meta tensor) is checked before the first
# broadcast and agreed on (``agree_on_error``), so a bad source raises on every rank and nothing is loaded.
# What only reading can show (an I/O error, a ``from_hf`` that fails or changes the shape only on real
# data) would otherwise raise on rank 0 alone and leave the others waiting forever: so rank 0 fills each
# bucket (or buffer) inside a ``try`` and broadcasts its outcome (one small ``broadcast_object_list``)
# before the data. On a failure no rank copies that bucket and every rank raises the same
# ``ValueError`` naming the key; the buckets sent before it stay loaded (the error says how many
# tensors), since keeping them back would double every rank's memory.
def _broadcast_full_state(
    model: nn.Module, full: Mapping[str, torch.Tensor], pair_keys: list[str], targets: dict[str, torch.Tensor], rank: int
) -> None:
    """``load_full_state_dict(broadcast_from_rank0=True)``: one broadcast per bucket from global rank 0.
    (81 lines: its inner functions share the agreed keys and the count of loaded tensors that every
    failure message reports; see [Note: broadcasting from rank 0].)

    Which keys rank 0 sends is agreed first (strict=False may skip some), so every rank joins the
    same broadcasts in the same order; each broadcast is preceded by rank 0's ok (see the Note).
    """
    keys = [pair_keys]
    dist.broadcast_object_list(keys, src=0)
    present = set(keys[0])
    key_of_param: dict[int, list[str]] = {}
    for key, t in targets.items():
        key_of_param.setdefault(id(t), []).append(key)
    done: set[str] = set()
    loaded: list[str] = []

    def fill(dst: torch.Tensor, key: str) -> None:
        dst.copy_(_read_source(full, key, tuple(dst.shape)).detach())

    def rank0_fills(items: list[tuple[torch.Tensor, str]]) -> None:
        """Rank 0 fills each ``(buffer, key)``; its outcome is broadcast, so every rank raises on a failure."""
        failure = None
        if rank == 0:
            for dst, key in items:
                try:
                    fill(dst, key)
                except Exception as e:  # noqa: BLE001 - told to every rank below
                    failure = (key, f"{type(e).__name__}: {e}")
                    break
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            key, why = box[0]
            state = f"the {len(loaded)} tensors sent before it are loaded, the rest are not" if loaded else (
                "nothing was loaded"
            )
            raise ValueError(
                f"load_full_state_dict(broadcast_from_rank0=True): rank 0 cannot send {key}: {why}; {state}"
            )

    def one_bucket(b) -> None:  # (a function, so the broadcast buffer dies before the next one)
        names = [next((k for k in key_of_param.get(id(sp), []) if k in present), None) for sp in b.sharded]
        if not any(names):
            return
        if b.is_expert or any(q.tp is not None for q in b.params):
            # expert or tensor parallel: each whole tensor in turn (each rank keeps its part of it)
            for sp, name in zip(b.sharded, names):
                if name is not None:
                    whole = torch.zeros(sp.shape, dtype=b.buffer.dtype, device=b.buffer.device)
                    rank0_fills([(whole, name)])
                    dist.broadcast(whole, src=0)
                    a, e = sp.local_range
                    sp._local_tensor.copy_(sp._tp_local(whole).reshape(-1)[a:e])
                    done.update(key_of_param[id(sp)])
                    loaded.append(name)
            return
        flat = torch.zeros(b.buffer.total_numel, dtype=b.buffer.dtype, device=b.buffer.device)
        views = b.full_views(flat)
        rank0_fills([(view, name) for view, name in zip(views, names) if name is not None])
        dist.broadcast(flat, src=0)
        for sp, view, name in zip(b.sharded, views, names):
            if name is not None:
                a, e = sp.local_range
                sp._local_tensor.copy_(view.reshape(-1)[a:e])
                done.update(key_of_param[id(sp)])
                loaded.append(name)

    with torch.no_grad():
        for rt in _runtimes_under(model):
            for b in rt.buckets:
                b.settle()
                one_bucket(b)
        for key in keys[0]:
            if key in done:
                continue
            dst = targets[key]
            buf = torch.empty_like(dst)
            rank0_fills([(buf, key)])
            dist.broadcast(buf, src=0)
            dst.copy_(buf)
            loaded.append(key)
