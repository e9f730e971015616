"""Checkpoints: DCP save/load of sharded models and optimizers at any world size and plan.

A sharded parameter holds the flat range ``[start, end)`` of its row-major flattened global
tensor on each rank. ``torch.distributed.checkpoint`` (DCP) reshards N-D *chunks* (boxes), and a
flat range of an N-D tensor is a union of at most ``2 * ndim - 1`` boxes, each a contiguous piece
of the range (``flat_range_boxes``). ``FlatShardTensor`` wraps a rank's flat piece so that DCP
sees the global tensor with those boxes as this rank's chunks (the ``__create_write_items__`` /
``__create_chunk_list__`` / ``__get_tensor_shard__`` hooks DCP calls on DTensor): saved, a model
looks exactly like an FSDP2 / DTensor checkpoint of the same model; loaded, DCP reads whatever
boxes of any saved layout overlap this rank's range, straight into the parameter's storage.

[Note: checkpoint layout]
- ``model.<name>``: every entry of ``model.state_dict()`` under the model's own names, sharded
  parameters as their global N-D tensors (no padding), buffers and unsharded parameters as plain
  (replicated) tensors.
- ``optim.state.<param name>.<key>``: sharded optimizer state (``state_shards``, see
  [Note: checkpoint-shaped optimizer state]; for optimizers without it, as torch's AdamW on
  flat shards, tensors with one element per local parameter element) as its global flat vector,
  shaped like the parameter when it has one element per parameter element; other replicated
  tensors as they are. ``optim.scalars``: step counters and other 0-dim / non-tensor state, one
  blob. ``optim.param_groups``: hyperparameters, with parameter names instead of ids.
- ``scheduler``, ``extra`` (rank 0's, returned to every rank) and ``rng.rank<r>`` (per rank;
  restored only at the same world size) as opaque ``torch.save`` bytes.
- ``fsdp_optim.json``: the manifest (world size, optimizer class, state schema, group names),
  written last by rank 0, so it is read first to check a load before any tensor is touched.

A rank with an empty piece writes nothing for it. HSDP (a 2-D mesh, see [Note: HSDP] in
``_fully_shard``): every replica holds the same ranges, so the replicas offer DCP identical write
items (same key, same chunk offsets) and DCP's ``dedup_save_plans`` keeps one of each, spreading
the writes over the replicas: one copy on disk (tested in tests/sharding/test_hsdp.py). A save writes ``<path>.tmp`` and renames it
into place after every rank has written (atomic: a crash mid-save leaves the previous checkpoint;
a crash between the two renames leaves ``<path>.old``, which a load then falls back to); it only
ever replaces or removes folders of checkpoint files (see [Note: what a save replaces]). Every
check of a load (keys, shapes, dtypes of optimizer state, optimizer class, param groups, every
shard file present and long enough) runs on every rank and the verdict is agreed on with one
collective, so a bad checkpoint raises on all ranks before anything is read and never hangs;
a failure inside the read itself (corrupt bytes) raises on all ranks through DCP.

Integration: ``fully_shard``'s root call must run ``register_state_dict_hooks(root)`` so that
``model.state_dict()`` / ``model.load_state_dict()`` are DCP-ready (as with FSDP2); an optimizer
runs ``register_optimizer_hooks(optimizer)`` (e.g. at the end of its ``__init__``) to make
``optimizer.state_dict()`` / ``load_state_dict()`` DCP-ready. ``save_checkpoint`` /
``load_checkpoint`` need neither.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import types
import pickle
import re
import warnings
import zlib
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint._traverse import set_element

from ._runtime import _runtimes_under, reshard_all
from ._shard_info import ShardInfo, shard_info

__all__ = [
    "Box",
    "FlatShardTensor",
    "flat_range_boxes",
    "model_state_dict",
    "register_state_dict_hooks",
    "register_optimizer_hooks",
    "save_checkpoint",
    "load_checkpoint",
    "load_full_state_dict",
    "MANIFEST",
]

MANIFEST = "fsdp_optim.json"
_FORMAT_VERSION = 1
_SHARDED, _REPLICATED, _SCALAR, _OWNED = "sharded", "replicated", "scalar", "owned"
aten = torch.ops.aten


# ---- flat ranges as N-D boxes (pure) -------------------------------------------------------
class Box(NamedTuple):
    """An N-D chunk of a tensor whose elements are the flat range ``[start, start + numel)``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def _boxes(shape: tuple[int, ...], s: int, e: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes ``(offsets, sizes)`` covering flat ``[s, e)`` of ``shape`` in order; ``0 <= s < e <= numel``."""
    if len(shape) == 1:
        return [((s,), (e - s,))]
    inner = shape[1:]
    row = math.prod(inner)
    r0, c0 = divmod(s, row)
    r1, c1 = divmod(e, row)

    def in_row(r: int, a: int, b: int):
        return [((r, *o), (1, *z)) for o, z in _boxes(inner, a, b)]

    if r0 == r1:  # inside one row
        return in_row(r0, c0, c1)
    out = []
    if c0:
        out += in_row(r0, c0, row)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *([0] * len(inner))), (r1 - r0, *inner)))
    if c1:
        out += in_row(r1, 0, c1)
    return out


def flat_range_boxes(shape: Iterable[int], start: int, end: int) -> list[Box]:
    """The N-D boxes (in flat order, each a contiguous sub-range) that make up flat ``[start, end)``.

    At most ``2 * ndim - 1`` boxes; none for an empty range; one ``()``-box for a 0-dim tensor.
    """
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of shape {shape} ({numel} elements)")
    if start == end:
        return []
    if not shape:
        return [Box((), (), 0)]
    out, pos = [], start
    for offsets, sizes in _boxes(shape, start, end):
        out.append(Box(offsets, sizes, pos))
        pos += math.prod(sizes)
    assert pos == end
    return out


# ---- the DCP-ready wrapper -------------------------------------------------------------------
class FlatShardTensor(torch.Tensor):
    """This rank's flat piece ``[start, start + n)`` of a global tensor of ``shape``, for DCP.

    ``size()`` is the global shape; the data is the wrapped local piece (not a copy: a DCP load
    writes straight into it). Only checkpoint hooks, ``detach``, ``to_local`` and
    ``full_tensor`` are supported; it is not a general tensor.
    """

    _local: torch.Tensor
    _start: int
    _boxes: tuple[Box, ...]

    @staticmethod
    def __new__(cls, local: torch.Tensor, *, shape: Iterable[int], start: int) -> FlatShardTensor:
        shape = torch.Size(tuple(int(d) for d in shape))
        if not local.is_contiguous():
            raise ValueError(
                f"FlatShardTensor needs a contiguous local piece (a load writes into it in place); "
                f"got strides {local.stride()} for shape {tuple(local.shape)}"
            )
        flat = local.view(-1)
        boxes = tuple(flat_range_boxes(shape, start, start + flat.numel()))
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        r._local = flat
        r._start = int(start)
        r._boxes = boxes
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            (x,) = args
            return FlatShardTensor(x._local.detach(), shape=x.shape, start=x._start)
        if func in (aten.clone.default, aten._to_copy.default):  # .clone(), .to(dtype / device)
            x, *rest = args
            return FlatShardTensor(func(x._local, *rest, **kwargs), shape=x.shape, start=x._start)
        raise NotImplementedError(
            f"{func} is not supported on FlatShardTensor (one rank's flat piece of a global tensor, "
            "for checkpoints); use .to_local() or .full_tensor()"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"FlatShardTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"local=[{self._start}, {self._start + self._local.numel()}))"
        )

    def __deepcopy__(self, memo: dict) -> FlatShardTensor:
        return FlatShardTensor(self._local.clone(), shape=self.shape, start=self._start)

    def __reduce_ex__(self, protocol):
        # This rank's piece only (``torch.load(..., weights_only=False)``); for one portable file
        # use ``fsdp_optim.full_state_dict(model)``.
        return _rebuild_flat_shard, (self._local, tuple(self.shape), self._start)

    # ---- accessors ------------------------------------------------------------------------
    @property
    def local_range(self) -> tuple[int, int]:
        return self._start, self._start + self._local.numel()

    def to_local(self) -> torch.Tensor:
        """The flat local piece (shares storage with the wrapped tensor)."""
        return self._local

    def full_tensor(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The global tensor on every rank (a collective; ranges must tile the tensor)."""
        return _gather_flat(self._local, self._start, math.prod(self.shape), group).view(self.shape)

    # ---- DCP hooks --------------------------------------------------------------------------
    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self._local)
        boxes = self._boxes
        if not boxes and math.prod(self.shape) == 0:
            # An empty global tensor: every rank offers the same empty chunk; DCP keeps one.
            boxes = (Box((0,) * len(self.shape), tuple(self.shape), 0),)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(b.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)),
                    properties=props,
                    size=self.shape,
                ),
            )
            for b in boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        boxes = self._boxes
        hint = index.index
        if hint is not None and hint < len(boxes) and torch.Size(boxes[hint].offsets) == index.offset:
            b = boxes[hint]
        else:
            found = [b for b in boxes if torch.Size(b.offsets) == index.offset]
            if not found:
                if math.prod(self.shape) == 0:
                    return self._local.view(self.shape)
                raise ValueError(f"{index.fqn}: no local chunk at offset {tuple(index.offset or ())}")
            b = found[0]
        a = b.start - self._start
        return self._local[a : a + b.numel].view(b.sizes)


def _rebuild_flat_shard(local: torch.Tensor, shape: tuple[int, ...], start: int) -> FlatShardTensor:
    return FlatShardTensor(local, shape=shape, start=start)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, inp, group=group)


def _gather_flat(local: torch.Tensor, start: int, numel: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's flat piece (ranges must tile ``[0, numel)``) on every rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        assert start == 0 and local.numel() == numel, "a single rank must hold the whole tensor"
        return local.clone()
    w = dist.get_world_size(group)
    meta = torch.tensor([start, local.numel()], dtype=torch.int64, device=local.device)  # NCCL: on device
    metas = torch.empty(2 * w, dtype=torch.int64, device=local.device)
    _all_gather(metas, meta, group)
    metas = metas.view(w, 2).tolist()
    width = max(n for _, n in metas)
    pad = local.new_zeros(width)
    pad[: local.numel()] = local
    out = local.new_empty(w * width)
    if width:
        _all_gather(out, pad, group)
    full = local.new_empty(numel)
    for r, (s, n) in enumerate(metas):
        full[s : s + n] = out[r * width : r * width + n]
    return full


# ---- state dicts -------------------------------------------------------------------------------
def _wrap_param(p: torch.Tensor, info: ShardInfo) -> FlatShardTensor:
    if p.numel() != info.local_numel:
        raise ValueError(
            f"{info.fqn}: the local shard has {p.numel()} elements, but its layout gives rank {info.rank} "
            f"{info.local_numel}; is the model unsharded (inside forward)?"
        )
    return FlatShardTensor(p.detach(), shape=info.shape, start=info.start)


def _ensure_sharded(model: nn.Module) -> None:
    """Swap the sharded parameters back in where ``fully_shard`` left a bucket gathered (e.g. the
    root's after a forward without backward), as FSDP2 does before a state dict."""
    reshard_all(model)


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with sharded parameters as ``FlatShardTensor`` (DCP-ready, no gather)."""
    _ensure_sharded(model)
    sd = model.state_dict()
    _wrap_module_state(model, sd, "")
    return sd


def _wrap_module_state(module: nn.Module, sd: dict[str, Any], prefix: str) -> None:
    for name, p in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        info = shard_info(p)
        if info is not None and key in sd and not isinstance(sd[key], FlatShardTensor):
            sd[key] = _wrap_param(p, info)


def _param_names(model: nn.Module | None, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """``id(param) -> name``: the model's first name for each parameter (``ShardInfo.fqn`` without a model)."""
    names: dict[int, str] = {}
    if model is not None:
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            if id(p) in names:
                continue
            info = shard_info(p)
            if model is not None or info is None or not info.fqn:
                raise ValueError(
                    f"optimizer parameter {pi} of param group {gi} (shape {tuple(p.shape)}) is not a parameter "
                    f"of the model passed; pass the model the optimizer was built on"
                )
            names[id(p)] = info.fqn
    return names


def _state_kinds(optimizer: torch.optim.Optimizer, p: torch.Tensor, name: str) -> dict[str, tuple[str, Any]]:
    """``key -> (kind, info)`` for the state of ``p``: sharded keys carry ``(global_shape, start)``."""
    info = shard_info(p)
    state = optimizer.state.get(p, {})
    shards = optimizer.state_shards(p) if hasattr(optimizer, "state_shards") else None
    out: dict[str, tuple[str, Any]] = {}
    for key, v in state.items():
        if shards is not None and key in shards:
            ss = shards[key]
            if not torch.is_tensor(v) or v.numel() != ss.end - ss.start:
                raise ValueError(
                    f"{type(optimizer).__name__}.state_shards: state {key!r} of {name} has "
                    f"{v.numel() if torch.is_tensor(v) else 'no'} elements but its StateShard says {ss.end - ss.start}"
                )
            param_shape = info.shape if info is not None else tuple(p.shape)
            shape = param_shape if ss.global_numel == math.prod(param_shape) else (ss.global_numel,)
            out[key] = (_SHARDED, (shape, ss.start))
        elif shards is None and info is not None and torch.is_tensor(v) and v.ndim > 0:
            if v.numel() != info.local_numel:
                raise ValueError(
                    f"state {key!r} of {name} (shape {tuple(v.shape)}) is neither per-element ({info.local_numel} "
                    f"local elements) nor a scalar, and {type(optimizer).__name__} has no state_shards() saying "
                    "where it lies; checkpoints cannot reshard it"
                )
            out[key] = (_SHARDED, (info.shape, info.start))
        elif torch.is_tensor(v) and v.ndim > 0:
            out[key] = (_REPLICATED, None)
        else:  # step counters and other scalars: one small blob for all of them
            out[key] = (_SCALAR, None)
    return out


def _optim_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    """The DCP-ready ``{name: {key: tensor}}`` state, the scalars ``{name: {key: value}}`` (0-dim
    tensors and numbers, replicated) and the schema ``{name: {key: kind}}``."""
    state, scalars, schema = {}, {}, {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = names[id(p)]
            kinds = _state_kinds(optimizer, p, name)
            if not kinds:
                continue
            st = optimizer.state[p]
            entry, small = {}, {}
            for key, (kind, where) in kinds.items():
                v = st[key]
                if kind == _SHARDED:
                    shape, start = where
                    entry[key] = FlatShardTensor(v.detach(), shape=shape, start=start)
                elif kind == _REPLICATED:
                    entry[key] = v.detach()
                else:
                    small[key] = v.detach().cpu() if torch.is_tensor(v) else v
            if entry:
                state[name] = entry
            if small:
                scalars[name] = small
            schema[name] = {k: kind for k, (kind, _) in kinds.items()}
    return state, scalars, schema


def _owned_optim_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> tuple[dict[str, dict[str, Any]], dict, dict[str, dict[str, str]]]:
    """A whole-tensor optimizer's state: each owner's tensors whole, plain (no blob of scalars), and
    this rank's schema; no collective (``_gather_owned_schema`` merges the ranks' schemas)."""
    state = {names[id(p)]: {k: v.detach() for k, v in st.items()} for p, st in optimizer.owned_state().items()}
    mine = {name: {k: _OWNED for k in entry} for name, entry in state.items()}
    return state, {}, mine


def _gather_owned_schema(mine: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Every rank's owned-state schema, merged (one ``all_gather_object``, a collective). Called after
    the ranks agreed that each built its state, so it pairs with the same gather on every rank."""
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    schema: dict[str, dict[str, str]] = {}
    for part in every:
        for name, keys in part.items():
            schema.setdefault(name, {}).update(keys)
    return schema


def _plan_owned_load(optimizer, model, manifest: dict[str, Any], saved: dict[str, Any], plan: _LoadPlan, strict: bool):
    """Targets for the state this rank owns now, shaped and typed from DCP's metadata."""
    inner = _class_name(optimizer.optim)
    if manifest.get("inner_optimizer") != inner:
        raise ValueError(
            f"the checkpoint holds WholeTensorOptimizer state of {manifest.get('inner_optimizer')}; it cannot be "
            f"loaded into a WholeTensorOptimizer of {inner}"
        )
    names = _param_names(model, optimizer)
    schema: dict[str, dict[str, str]] = manifest["optim_schema"]
    plan.sd["optim"] = {"state": {}, "scalars": b"", "param_groups": b""}
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = names[id(p)]
            keys = schema.get(name, {})
            if strict and p.requires_grad and not keys and schema:
                raise ValueError(f"optimizer state of {name} is not in the checkpoint (strict=True)")
            if not keys or not optimizer.owns(p):
                continue
            entry = {}
            for key in keys:
                fkey = f"optim.state.{name}.{key}"
                md = saved.get(fkey)
                if not isinstance(md, TensorStorageMetadata):
                    raise ValueError(f"checkpoint entry {fkey} is missing (the manifest lists it)")
                device = torch.device("cpu") if len(md.size) == 0 else p.device
                entry[key] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
            plan.sd["optim"]["state"][name] = entry
            plan.owned.append((p, entry))


def _param_groups(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """Hyperparameters of each group, with parameter names instead of the parameters."""
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]


# ---- agreeing on errors ----------------------------------------------------------------------
_RERAISE = (ValueError, FileNotFoundError, KeyError, TypeError, RuntimeError)


def _agree(err: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if any rank failed (one collective), naming the first failing rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if err is not None:
            raise err
        return
    mine = None if err is None else (type(err).__name__, str(err))
    errs: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errs, mine, group=group)
    failed = [(r, e) for r, e in enumerate(errs) if e is not None]
    if not failed:
        return
    if err is not None:
        raise err
    r, (tname, msg) = failed[0]
    cls = next((c for c in _RERAISE if c.__name__ == tname), RuntimeError)
    raise cls(f"rank {r}: {msg}")


def _group_info() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _to_bytes(obj: Any, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, refused now (``ValueError``) if ``load_checkpoint`` would refuse
    them (see [Note: loading runs no code]): a checkpoint is never written that cannot be loaded."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        data = buf.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpicklable or refused: find the value to name
        where, bad = _first_refused(obj, what)
        raise ValueError(
            f"save_checkpoint: {where} is a {_type_name(bad)}, which load_checkpoint cannot load "
            f"({_refusal(e)}); checkpoints load only tensors, numbers, strings, lists, tuples and dicts: "
            "convert it (a numpy scalar: int(x) / float(x) or x.item(); an array: torch.from_numpy(x)), or, "
            "if you trust the class, allow it with torch.serialization.add_safe_globals([...]) in the saving "
            "and the loading processes"
        ) from None
    return data


def _loads_safely(obj: Any) -> bool:
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001
        return False
    return True


def _first_refused(obj: Any, where: str) -> tuple[str, Any]:
    """The path and value of the first part of ``obj`` that ``torch.load(weights_only=True)`` refuses."""
    if isinstance(obj, Mapping):
        items = [(f"{where}[{k!r}]", v) for k, v in obj.items()] + [(f"the key {k!r} of {where}", k) for k in obj]
    elif isinstance(obj, list | tuple):
        items = [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
    else:
        return where, obj
    for child_where, child in items:
        if not _loads_safely(child):
            return _first_refused(child, child_where)
    return where, obj  # every part loads: the container's own class is refused


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _refusal(e: BaseException) -> str:
    """The useful line of a ``torch.load(weights_only=True)`` error (the refused global), without ANSI codes."""
    text = _ANSI.sub("", str(e))
    for marker in ("WeightsUnpickler error:", "Unsupported global:"):
        if marker in text:
            line = text[text.index(marker) :].splitlines()[0].strip()
            line = line.split(" by default.")[0]  # (torch's advice follows; ours is in the caller's message)
            return f"{type(e).__name__}: {line}"[:600]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:600] if lines else ''}"


def _numbers_from_numpy(obj: Any) -> Any:
    """``obj`` with numpy scalars (``np.float64`` from a numpy LR schedule) as the equal Python numbers."""
    if isinstance(obj, np.generic) and isinstance(obj, np.number | np.bool_):
        return obj.item()
    if type(obj) is dict:
        return {k: _numbers_from_numpy(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_numbers_from_numpy(v) for v in obj)
    return obj


def _from_bytes(data: Any, what: str) -> Any:
    if not isinstance(data, bytes | bytearray):
        raise RuntimeError(f"checkpoint entry {what!r} was not loaded")
    # See [Note: loading runs no code]: tensors, numbers, strings and containers only.
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - refused (a class or callable) or undecodable
        raise ValueError(
            f"checkpoint entry {what!r} cannot be loaded safely: {_refusal(e)}. Only tensors, numbers, strings, "
            "lists, tuples and dicts are loaded (a checkpoint of another writer; save_checkpoint refuses such values), "
            "unless the class is allowed with torch.serialization.add_safe_globals([...]), if you trust it"
        ) from None


# [Note: loading runs no code]
# A checkpoint is data: loading one must not run code, whoever wrote it. Three places would unpickle:
# our small entries (optimizer scalars, param groups, scheduler state, RNG states, ``extra``), which
# are read with ``torch.load(weights_only=True)`` (tensors and plain containers only); DCP's own byte
# records that carry them, which DCP's default load planner reads with ``weights_only=False`` and
# ``_SafeLoadPlanner`` reads with ``weights_only=True``; and DCP's ``.metadata`` file, a plain pickle,
# which ``_SafeReader`` reads through an unpickler that resolves only DCP's metadata classes and the
# few torch and pathlib names they use (``_METADATA_GLOBALS``). Anything else raises a clear error.
# ``save_checkpoint`` reads each small entry back the same way before writing (``_to_bytes``), so it
# never writes one that a load would refuse.
_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
            # Only the classes DCP defines there (dataclasses and enums), never a function or a module
            # those modules happen to import.
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} (not a DCP metadata class)")


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose ``.metadata`` is read by ``_MetadataUnpickler`` (see the Note)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot read the DCP metadata file {path} safely: {type(e).__name__}: {e}") from None
        if not isinstance(md, Metadata):
            raise ValueError(f"the DCP metadata file {path} holds a {type(md).__name__}, not DCP Metadata")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _root_cause(e: CheckpointException) -> str:
    """The first rank's own exception inside DCP's CheckpointException."""
    for failure in e.failures.values():
        inner = getattr(failure, "exception", failure)
        return f"{type(inner).__name__}: {inner}"
    return str(e)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading byte records with ``weights_only=True`` (see the Note)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"checkpoint byte record {fqn!r} cannot be loaded safely: {_refusal(e)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- save ---------------------------------------------------------------------------------------
def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    extra: Any | None = None,
) -> None:
    """Save model, optimizer, scheduler, RNG states and ``extra`` to directory ``path`` (every rank).

    Each rank writes only its own shards (no gather). ``extra`` (e.g. the data position: tensors,
    numbers, strings, lists, tuples and dicts, what ``load_checkpoint`` loads) is taken from rank 0.
    A value a load would refuse (a numpy scalar in ``extra``, a custom class) raises a ``ValueError``
    naming it on every rank before anything is written; numpy scalars in param groups, optimizer
    scalars and scheduler state (an LR from a numpy schedule) are saved as the equal Python numbers.
    Atomic: the checkpoint is written to ``<path>.tmp`` and moved into place after every rank is
    done, replacing a previous checkpoint. Only folders holding nothing but checkpoint files are
    replaced or removed (``path``, a leftover ``<path>.tmp`` / ``<path>.old``): anything else there
    is refused with a ``ValueError`` on every rank before anything is written (see [Note: what a
    save replaces]).
    """
    path = _normalize(path)
    rank, world_size = _group_info()
    tmp, old = path + ".tmp", path + ".old"
    sd: dict[str, Any] = {}
    manifest: dict[str, Any] = {}
    err = None
    owned_schema = None  # a WholeTensorOptimizer's schema on this rank, merged after the agreement below
    try:
        sd["model"] = model_state_dict(model)
        manifest = {
            "format_version": _FORMAT_VERSION,
            "world_size": world_size,
            "model_keys": sorted(sd["model"]),
            "optimizer": None,
            "scheduler": scheduler is not None,
            "extra": extra is not None,
        }
        if optimizer is not None:
            names = _param_names(model, optimizer)
            if hasattr(optimizer, "owned_state"):  # WholeTensorOptimizer: [Note: whole-tensor checkpoints]
                state, scalars, owned_schema = _owned_optim_state(optimizer, names)
                schema = {}  # (every rank's, gathered once every rank agreed it has its own)
                manifest["inner_optimizer"] = _class_name(optimizer.optim)
            else:
                state, scalars, schema = _optim_state(optimizer, names)
            groups = _numbers_from_numpy(_param_groups(optimizer, names))
            sd["optim"] = {
                "state": state,
                "scalars": _to_bytes(_numbers_from_numpy(scalars), "optim.scalars"),
                "param_groups": _to_bytes(groups, "optimizer.param_groups"),
            }
            manifest["optimizer"] = _class_name(optimizer)
            manifest["optim_schema"] = schema
            manifest["optim_groups"] = [g["params"] for g in groups]
        if scheduler is not None:
            sd["scheduler"] = _to_bytes(_numbers_from_numpy(scheduler.state_dict()), "scheduler.state_dict()")
        if extra is not None and rank == 0:
            sd["extra"] = _to_bytes(extra, "extra")
        sd[f"rng.rank{rank}"] = _to_bytes(_rng_state(), "the RNG state")
        if rank == 0:
            if os.path.islink(path):  # see [Note: saving onto a symlink]
                raise ValueError(
                    f"save_checkpoint: {path} is a symbolic link (to {os.readlink(path)}); a save replaces the "
                    "directory at the path, so it would replace the link, not the checkpoint it points to. Save to "
                    f"a real directory (e.g. the target {os.path.realpath(path)}, to overwrite it, or a new one) and "
                    "then point the link at it"
                )
            for folder in (path, tmp, old):  # see [Note: what a save replaces]
                why = _save_refusal(folder, path)
                if why is not None:
                    raise ValueError(why)
            if os.path.lexists(tmp):
                shutil.rmtree(tmp)  # a crashed earlier save (checkpoint files only, checked above)
            os.makedirs(tmp)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        err = e
    try:
        _agree(err)  # a collective: the temp dir exists before anyone writes
    except Exception:
        if rank == 0 and err is None:
            shutil.rmtree(tmp, ignore_errors=True)  # another rank refused: leave nothing behind
        raise
    if owned_schema is not None:  # a collective: after the agreement, so every rank joins it
        manifest["optim_schema"] = _gather_owned_schema(owned_schema)
    # A collective; .metadata is written when it returns. DCP raises on every rank if any rank fails.
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise ValueError(
            f"save_checkpoint({path}): writing {tmp} failed: {_root_cause(e)}; the previous checkpoint at {path} "
            "(if any) is untouched"
        ) from None
    err, sums = None, None
    try:
        sums = _checksums_of(tmp, rank, world_size)
    except Exception as e:  # noqa: BLE001
        err = e
    _agree(err)
    err = None
    if rank == 0:
        try:
            manifest["checksums"] = sums
            _write_manifest(tmp, manifest)
            for folder in (path, old):  # again: entries may have appeared since the checks before writing
                why = _save_refusal(folder, path)
                if why is not None:
                    raise ValueError(
                        f"{why}. Nothing was replaced; the new checkpoint is complete in {tmp} (rename it once "
                        f"{folder} is cleared, or save again)"
                    )
            if os.path.exists(path):
                if os.path.lexists(old):
                    shutil.rmtree(old)
                os.rename(path, old)
            os.rename(tmp, path)
            _fsync(os.path.dirname(os.path.abspath(path)))
            if os.path.exists(old):
                shutil.rmtree(old)
        except Exception as e:  # noqa: BLE001
            err = e
    _agree(err)


def _normalize(path: str | os.PathLike) -> str:
    """``path`` without a trailing separator (``ck/`` is ``ck``), so ``<path>.tmp`` is its sibling."""
    path = os.fspath(path)
    if not path:
        raise ValueError("save_checkpoint / load_checkpoint: path is empty; pass a directory path")
    return os.path.normpath(path)


# [Note: saving onto a symlink]
# A save writes <path>.tmp and renames it onto <path>; onto a symlink (``latest -> step_1``) that would
# replace the link by a directory (or, before, crashed in rmtree after moving the link aside). Following
# the link instead would silently overwrite the checkpoint it points to, which a ``latest`` link
# usually means to keep. Neither is what the caller can be assumed to want, so a save onto a symlink is
# refused (on every rank, before anything is written); loading through a symlink is fine.


# [Note: what a save replaces]
# A save replaces the folder at ``path`` as a whole (rename aside, rename ``<path>.tmp`` in, remove the
# old one) and first removes a leftover ``<path>.tmp`` of a crashed save; a crash between the renames
# leaves ``<path>.old``, removed by the next save. Each of the three is only replaced or removed when
# it is absent, empty or holds nothing but the files a save writes: the manifest, DCP's ``.metadata``
# file (and its ``.metadata.tmp`` of a save killed while writing it) and ``__<rank>_<n>.distcp``
# files. Anything else (a user's notes or evaluation results put inside a checkpoint, a folder that
# merely has a ``.metadata`` entry, a subfolder, a symbolic link) is refused on every rank before
# anything is written, naming the entries: a save never deletes what it did not write. The check
# runs again just before the renames, in case entries appeared meanwhile.
_CHECKPOINT_FILE = re.compile(rf"{re.escape(MANIFEST)}|\.metadata(\.tmp)?|__\d+_\d+\.distcp")


def _foreign_entries(folder: str, ours: re.Pattern[str], n: int = 5) -> str | None:
    """``folder``'s entries other than plain files named as ``ours`` matches, shown as ``a, b/ and 3 more``
    (a subfolder with a trailing ``/``); ``None`` when there are none (only such files, or empty)."""
    foreign = sorted(
        e.name + ("/" if e.is_dir(follow_symlinks=False) else "")
        for e in os.scandir(folder)
        if not (e.is_file(follow_symlinks=False) and ours.fullmatch(e.name))
    )
    if not foreign:
        return None
    return ", ".join(foreign[:n]) + (f" and {len(foreign) - n} more" if len(foreign) > n else "")


def _save_refusal(folder: str, path: str) -> str | None:
    """Why a save to ``path`` may not replace or remove ``folder`` (``None``: it may; see the Note)."""
    if not os.path.lexists(folder):
        return None
    if folder == path:
        if not os.path.isdir(folder):
            return (
                f"save_checkpoint: {path} exists and is not a checkpoint (not a folder); save to a new path or remove it"
            )
        shown = _foreign_entries(folder, _CHECKPOINT_FILE)
        if shown is None:
            return None
        return (
            f"save_checkpoint: {path} exists and is not a checkpoint (or files were added to one): it holds entries "
            f"a save did not write ({shown}); a save replaces the whole folder and would delete them, so save to a new "
            "path or move them out (keep notes or evaluation results next to a checkpoint, not inside it)"
        )
    what = f"left by an interrupted save to {path}, which removes it"
    if os.path.islink(folder):
        return (
            f"save_checkpoint: {folder} ({what}) is a symbolic link (to {os.readlink(folder)}); remove or rename "
            "the link, or save to another path"
        )
    if not os.path.isdir(folder):
        return f"save_checkpoint: {folder} ({what}) is not a folder; remove or rename it, or save to another path"
    shown = _foreign_entries(folder, _CHECKPOINT_FILE)
    if shown is None:
        return None
    return (
        f"save_checkpoint: {folder} ({what}) holds entries a save did not write ({shown}), which removing it "
        "would delete; move them out or rename the folder, or save to another path"
    )


def _write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: str) -> None:
    """Flush a file's or a directory's (its entries') writes to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- load ---------------------------------------------------------------------------------------
def _resolve_path(path: str) -> str:
    if os.path.isdir(path):
        return path
    old = path + ".old"
    if os.path.isfile(os.path.join(old, MANIFEST)):
        warnings.warn(f"checkpoint {path} is missing; a save was interrupted while replacing it, loading {old}")
        return old
    raise FileNotFoundError(f"no checkpoint at {path}")


def _read_checkpoint_meta(path: str) -> tuple[dict[str, Any], Metadata]:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise FileNotFoundError(
            f"{mpath} is missing: {path} is not a complete fsdp_optim checkpoint (save_checkpoint writes it last)"
        )
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the checkpoint manifest {mpath}: {e}") from e
    version = manifest.get("format_version")
    if isinstance(version, int) and version > _FORMAT_VERSION:
        raise ValueError(
            f"{mpath}: checkpoint format version {version} was written by a newer fsdp_optim (this one reads "
            f"version {_FORMAT_VERSION}); upgrade fsdp_optim to load it"
        )
    if version != _FORMAT_VERSION:
        raise ValueError(f"{mpath}: checkpoint format version {version!r} is not {_FORMAT_VERSION}")
    if manifest.get("checksums") and ".metadata" in manifest["checksums"]:
        _verify_file(path, ".metadata", manifest["checksums"][".metadata"])
    try:
        md = _SafeReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - a missing or truncated .metadata
        raise ValueError(f"cannot read the DCP metadata file {os.path.join(path, '.metadata')}: {e}") from e
    return manifest, md


_CHECKSUM_CHUNK = 8 << 20


def _crc32_of(path: str) -> tuple[int, str]:
    """``(size, crc32 hex)`` of a file, streamed in 8 MiB chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHECKSUM_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def _checksums_of(directory: str, rank: int, world_size: int) -> dict[str, list] | None:
    """``{file: [size, crc32]}`` of every file of a saved checkpoint (rank 0's result; ``None`` elsewhere).

    [Note: checkpoint checksums]
    After DCP has written every file, each rank checksums every W-th file of the (shared) directory
    listing, so the files are read once in all and in parallel; rank 0 records ``[size, crc32]`` per
    file in the manifest, which it writes last. A load verifies the files the same way (every W-th
    on each rank), ``.metadata`` first on every rank (it is read before the rest), and agrees on the
    verdict before any tensor is touched: a corrupt, truncated or missing file raises on every rank,
    naming it, and the model, optimizer and scheduler keep their values. CRC32 (zlib) because it is
    the fastest here: ~4 GB/s against ~0.7 GB/s for blake2b and ~1.4 GB/s for sha256 on this
    machine. Checksums detect corruption, not tampering: anyone who can write the files can write
    matching checksums.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"save_checkpoint: {directory} disappeared while saving (removed by another process?); "
            "the checkpoint was not written and the previous one, if any, is untouched"
        )
    files = sorted(f for f in os.listdir(directory) if f != MANIFEST)
    mine = {f: list(_crc32_of(os.path.join(directory, f))) for f in files[rank::world_size]}
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        every: list = [None] * world_size
        dist.all_gather_object(every, (files, mine))
        if any(other != files for other, _ in every):
            raise ValueError(
                f"save_checkpoint: the ranks see different files in {directory}; checkpoints need a directory "
                "shared by every rank"
            )
        mine = {k: v for _, part in every for k, v in part.items()}
    return mine if rank == 0 else None


def _verify_checksums(path: str, manifest: dict[str, Any], rank: int, world_size: int) -> None:
    """Raise naming the first file whose size or CRC32 differs from the manifest (see the Note)."""
    sums = manifest.get("checksums")
    if not sums:  # absent or empty: a saved checkpoint always has files (.metadata at least)
        if rank == 0:
            warnings.warn(f"{path}: the checkpoint has no checksums (saved before they existed); not verified")
        return
    for name in sorted(sums)[rank::world_size]:
        _verify_file(path, name, sums[name])


def _verify_file(path: str, name: str, want: list) -> None:
    f = os.path.join(path, name)
    if not os.path.isfile(f):
        raise FileNotFoundError(f"checkpoint file {f} is missing (the manifest lists it)")
    size, crc = _crc32_of(f)
    if [size, crc] != list(want):
        raise ValueError(
            f"checkpoint file {f} is corrupt: {size} bytes with CRC32 {crc}, but {want[0]} bytes with CRC32 "
            f"{want[1]} were saved; nothing was loaded (restore the file or load another checkpoint)"
        )


def _check_files(path: str, md: Metadata) -> None:
    """Every shard file the metadata points to exists and is long enough (names the file)."""
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        need[rel] = max(need.get(rel, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            raise FileNotFoundError(f"checkpoint shard file {f} is missing")
        have = os.path.getsize(f)
        if have < size:
            raise ValueError(f"checkpoint shard file {f} is truncated: {have} bytes, its entries need {size}")


def _fmt_keys(keys: Iterable[str], n: int = 8) -> str:
    keys = sorted(keys)
    more = f" (and {len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


class _LoadPlan:
    """What to load where, built and checked on every rank before anything is read."""

    def __init__(self) -> None:
        self.sd: dict[str, Any] = {}
        self.fresh: dict[int, tuple[torch.Tensor, str, dict[str, Any]]] = {}  # lazy optimizers' new state
        # (optimizer.state[p] or fresh state, key, name, device of a fresh step counter)
        self.scalars: list[tuple[dict[str, Any], str, str, torch.device | None]] = []
        self.owned: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []  # WholeTensorOptimizer: (param, state)


def _check_tensor(key: str, md: Any, obj: Any, *, exact_dtype: bool) -> None:
    if not isinstance(md, TensorStorageMetadata):
        if torch.is_tensor(obj):
            raise ValueError(
                f"checkpoint entry {key} is not a tensor, but the target is one of shape {tuple(obj.shape)}"
            )
        return
    if not torch.is_tensor(obj):
        raise ValueError(
            f"checkpoint entry {key} is a tensor of shape {tuple(md.size)}, but the target is {type(obj).__name__}"
        )
    if tuple(md.size) != tuple(obj.size()):
        raise ValueError(
            f"shape mismatch for {key}: the checkpoint has {tuple(md.size)}, the target {tuple(obj.size())}"
        )
    if exact_dtype and md.properties.dtype != obj.dtype:
        raise ValueError(f"dtype mismatch for {key}: the checkpoint has {md.properties.dtype}, the target {obj.dtype}")


def _plan_load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    manifest: dict[str, Any],
    md: Metadata,
    strict: bool,
    rank: int,
    world_size: int,
) -> _LoadPlan:
    saved = md.state_dict_metadata
    plan = _LoadPlan()

    # model
    model_sd = model_state_dict(model)
    saved_model = {k[len("model.") :] for k in saved if k.startswith("model.")}
    missing, unexpected = set(model_sd) - saved_model, saved_model - set(model_sd)
    if strict and (missing or unexpected):
        raise ValueError(
            "the checkpoint does not match the model (strict=True): "
            + (f"missing keys: {_fmt_keys(missing)}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected keys: {_fmt_keys(unexpected)}" if unexpected else "")
        )
    if missing:
        warnings.warn(f"load_checkpoint(strict=False): keeping the current values of {_fmt_keys(missing)}")
    plan.sd["model"] = {}
    for k, v in model_sd.items():
        if k in saved_model:
            _check_tensor(f"model.{k}", saved[f"model.{k}"], v, exact_dtype=False)
            plan.sd["model"][k] = v

    # optimizer
    if optimizer is not None:
        saved_cls = manifest.get("optimizer")
        if saved_cls is None:
            raise ValueError("the checkpoint holds no optimizer state; call load_checkpoint without optimizer=")
        if saved_cls != _class_name(optimizer):
            raise ValueError(
                f"the checkpoint holds the state of optimizer {saved_cls}; it cannot be loaded into a "
                f"{_class_name(optimizer)}"
            )
        names = _param_names(model, optimizer)
        groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        if groups != manifest["optim_groups"]:
            raise ValueError(
                "the optimizer's param groups do not match the checkpoint's: "
                f"{[len(g) for g in groups]} parameters per group here, {[len(g) for g in manifest['optim_groups']]} "
                "in the checkpoint (or different parameter names); build the optimizer as it was saved"
            )
        if hasattr(optimizer, "owned_state") or "inner_optimizer" in manifest:
            if not hasattr(optimizer, "owned_state"):
                raise AssertionError("an optimizer class name matched a WholeTensorOptimizer checkpoint")
            _plan_owned_load(optimizer, model, manifest, saved, plan, strict)
            optimizer = None  # (its targets are planned; nothing below applies)
        schema: dict[str, dict[str, str]] = manifest["optim_schema"]
        if optimizer is not None:
            plan.sd["optim"] = {"state": {}, "scalars": b"", "param_groups": b""}
        for g in optimizer.param_groups if optimizer is not None else ():
            for p in g["params"]:
                name = names[id(p)]
                saved_keys = schema.get(name, {})
                kinds = _state_kinds(optimizer, p, name)
                if not kinds and saved_keys and not hasattr(optimizer, "state_shards"):
                    # A lazy (torch) optimizer before its first step: create the state it would.
                    target = _fresh_state(p, name, saved_keys, saved)
                    plan.fresh[id(p)] = (p, name, target)
                    info = shard_info(p)
                    kinds = {
                        k: (kind, (info.shape, info.start) if kind == _SHARDED and info is not None else None)
                        for k, kind in saved_keys.items()
                    }
                else:
                    target = optimizer.state.get(p, {})
                    miss, unexp = set(kinds) - set(saved_keys), set(saved_keys) - set(kinds)
                    if (miss or unexp) and strict:
                        raise ValueError(
                            f"optimizer state of {name} does not match the checkpoint (strict=True): "
                            + (f"missing keys: {_fmt_keys(miss)} " if miss else "")
                            + (f"unexpected keys: {_fmt_keys(unexp)}" if unexp else "")
                        )
                    for k in sorted(miss):
                        warnings.warn(
                            f"load_checkpoint(strict=False): optimizer state {name}.{k} is not in the checkpoint; kept"
                        )
                entry = {}
                for key, (kind, where) in kinds.items():
                    if key not in saved_keys:
                        continue
                    if (saved_keys[key] == _SCALAR) != (kind == _SCALAR):  # sharded vs full: same global tensor
                        raise ValueError(
                            f"optimizer state {name}.{key} is {saved_keys[key]} in the checkpoint but {kind} here"
                        )
                    if kind == _SCALAR:
                        # torch keeps step counters on the parameter's device when fused / capturable
                        on_device = id(p) in plan.fresh and (g.get("fused") or g.get("capturable"))
                        plan.scalars.append((target, key, name, p.device if on_device else None))
                        continue
                    v = target[key]
                    if kind == _SHARDED and where is not None:
                        shape, start = where
                        v = FlatShardTensor(v.reshape(-1), shape=shape, start=start)
                    entry[key] = v
                    fkey = f"optim.state.{name}.{key}"
                    if fkey not in saved:
                        raise ValueError(f"checkpoint entry {fkey} is missing (the manifest lists it)")
                    _check_tensor(fkey, saved[fkey], v, exact_dtype=True)
                if entry:
                    plan.sd["optim"]["state"][name] = entry

    # scheduler, extra, rng
    if scheduler is not None:
        if not manifest.get("scheduler"):
            raise ValueError("the checkpoint holds no LR scheduler state; call load_checkpoint without scheduler=")
        plan.sd["scheduler"] = b""
    if manifest.get("extra"):
        plan.sd["extra"] = b""
    if manifest["world_size"] == world_size and f"rng.rank{rank}" in saved:
        plan.sd[f"rng.rank{rank}"] = b""
    elif rank == 0 and manifest["world_size"] != world_size:
        warnings.warn(
            f"checkpoint saved at world size {manifest['world_size']}, loading at {world_size}: "
            "RNG states are not restored"
        )
    return plan


def _fresh_state(p: torch.Tensor, name: str, saved_keys: dict[str, str], saved: dict[str, Any]) -> dict[str, Any]:
    """Allocate the state a lazy (torch) optimizer would create, from the checkpoint's schema."""
    info = shard_info(p)
    out: dict[str, Any] = {}
    for key, kind in saved_keys.items():
        md = saved.get(f"optim.state.{name}.{key}")
        if kind == _SCALAR or not isinstance(md, TensorStorageMetadata):
            out[key] = None  # filled from the scalars blob
            continue
        dtype = md.properties.dtype
        if kind == _SHARDED:
            local = info.local_numel if info is not None else p.numel()
            out[key] = torch.zeros(local, dtype=dtype, device=p.device).view(
                (-1,) if info is not None else p.shape
            )
        else:
            out[key] = torch.zeros(md.size, dtype=dtype, device=p.device)
    return out


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    strict: bool = True,
) -> Any:
    """Load a ``save_checkpoint`` directory into ``model`` (and optimizer, scheduler) at any world
    size and plan; return the saved ``extra`` (``None`` if none). RNG states are restored when
    the world size matches. Errors (missing/unexpected keys under ``strict``, shapes, another
    optimizer, missing or truncated files) are raised on every rank before anything is loaded.
    """
    path = _normalize(path)
    rank, world_size = _group_info()
    err, plan = None, None
    try:
        path = _resolve_path(path)
        manifest, md = _read_checkpoint_meta(path)
        _check_files(path, md)
        _verify_checksums(path, manifest, rank, world_size)
        plan = _plan_load(model, optimizer, scheduler, manifest, md, strict, rank, world_size)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        err = e
    _agree(err)
    if plan is None:
        raise AssertionError("load_checkpoint: no plan after an agreed success")
    no_dist = not dist.is_initialized()
    # Small entries first, decoded before any tensor is read: a bad one leaves everything as it was.
    blobs: dict[str, Any] = {k: v for k, v in plan.sd.items() if isinstance(v, bytes)}
    if "optim" in plan.sd:
        blobs["optim"] = {"scalars": b"", "param_groups": b""}
    try:
        dcp.load(blobs, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:  # raised on every rank by DCP: name the root cause plainly
        raise ValueError(f"load_checkpoint({path}): {_root_cause(e)}") from None
    decoded: dict[str, Any] = {}
    err = None
    try:
        for key, value in blobs.items():
            if key == "optim":
                decoded["optim.param_groups"] = _from_bytes(value["param_groups"], "optim.param_groups")
                decoded["optim.scalars"] = _from_bytes(value["scalars"], "optim.scalars")
            else:
                decoded[key] = _from_bytes(value, key)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        err = e
    _agree(err)
    tensors = {k: v for k, v in plan.sd.items() if k == "model"}
    if "optim" in plan.sd:
        tensors["optim"] = {"state": plan.sd["optim"]["state"]}
    dcp.load(tensors, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(), no_dist=no_dist)

    if optimizer is not None:
        for g, saved_g in zip(optimizer.param_groups, decoded["optim.param_groups"]):
            for k, v in saved_g.items():
                if k != "params":
                    g[k] = v
        scalars = decoded["optim.scalars"]
        for target, key, name, device in plan.scalars:
            v, old = scalars[name][key], target.get(key)
            if torch.is_tensor(v) and (torch.is_tensor(old) or device is not None):
                v = v.to(old.device if torch.is_tensor(old) else device)
            target[key] = v
        for p, _, state in plan.fresh.values():
            optimizer.state[p] = state
        for p, state in plan.owned:
            optimizer.install_state(p, state)
    if scheduler is not None:
        scheduler.load_state_dict(decoded["scheduler"])
    if f"rng.rank{rank}" in decoded:
        _set_rng_state(decoded[f"rng.rank{rank}"])
    return decoded.get("extra")


# ---- full (unsharded) state dicts ---------------------------------------------------------------
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
    rank = dist.get_rank() if dist.is_initialized() else 0
    holds_dict = not broadcast_from_rank0 or rank == 0
    full = full if full is not None else {}
    err = None
    pairs: list[tuple[str, ShardInfo | None]] = []
    try:
        _ensure_sharded(model)
        params = dict(model.named_parameters(remove_duplicate=False))
        own = model.state_dict()
        if holds_dict:
            missing, unexpected = set(own) - set(full), set(full) - set(own)
            if strict and (missing or unexpected):
                raise ValueError(
                    "load_full_state_dict(strict=True): "
                    + (f"missing keys: {_fmt_keys(missing)}" if missing else "")
                    + ("; " if missing and unexpected else "")
                    + (f"unexpected keys: {_fmt_keys(unexpected)}" if unexpected else "")
                )
        for key in own:
            if holds_dict and key not in full:
                continue
            p = params.get(key)
            info = shard_info(p) if p is not None else None
            shape = info.shape if info is not None else tuple(own[key].shape)
            if holds_dict:
                _check_source(key, full, shape, own[key].dtype)
            pairs.append((key, info))
    except Exception as e:  # noqa: BLE001
        err = e
    _agree(err)
    targets = {**dict(model.named_buffers(remove_duplicate=False)), **params}
    if not broadcast_from_rank0 or not dist.is_initialized() or dist.get_world_size() == 1:
        with torch.no_grad():
            for n, (key, info) in enumerate(pairs):
                dst = targets[key]
                try:
                    src = _read_source(full, key, info.shape if info is not None else tuple(dst.shape))
                except Exception as e:  # noqa: BLE001 - a lazy source (load_hf) failing when read
                    state = f"the {n} tensors before it are loaded, the rest are not" if n else "nothing was loaded"
                    raise ValueError(
                        f"load_full_state_dict: cannot read {key}: {type(e).__name__}: {e}; {state}"
                    ) from e
                if info is not None:
                    dst.copy_(src.detach().reshape(-1)[info.start : info.end])
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
        raise ValueError(f"{key}: the full state dict holds a {_type_name(src)}, not a tensor")
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
        raise ValueError(f"{key}: the full state dict holds a {_type_name(src)}, not a tensor")
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
# broadcast and agreed on (``_agree``), so a bad source raises on every rank and nothing is loaded.
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
        flat = torch.zeros(b.buffer.total_numel, dtype=b.buffer.dtype, device=b.buffer.device)
        views = b.full_views(flat)
        rank0_fills([(view, name) for view, name in zip(views, names) if name is not None])
        dist.broadcast(flat, src=0)
        for sp, view, name in zip(b.sharded, views, names):
            if name is not None:
                a, e = shard_info(sp).start, shard_info(sp).end
                sp.detach().copy_(view.reshape(-1)[a:e])
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


# ---- hooks: DCP-ready model.state_dict() / optimizer.state_dict() -----------------------------------
_HOOKED = "_fsdp_optim_ckpt_hooks"


# [Note: load_state_dict(assign=True) on sharded parameters]
# ``nn.Module.load_state_dict(sd, assign=True)`` replaces each parameter object by the state dict's
# tensor. A sharded parameter is a view into its bucket's flat segment, which the runtime gathers
# from and the reduce-scatter writes into; a new object there is read by no one (the load reported
# success and loaded nothing). So for sharded parameters the root's pre-hook copies this rank's
# range into the runtime's parameter (materializing a meta-built bucket first, as every load does)
# and hands nn.Module that same parameter to assign: the objects, device and dtype stay the
# runtime's (a dtype the state dict would have changed is warned about). Unsharded parameters and
# buffers are assigned as torch does (so a meta-built model's buffers become real).
def register_state_dict_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` return ``FlatShardTensor`` for sharded parameters (DCP-ready, as
    FSDP2's DTensors) and ``module.load_state_dict()`` accept those or full tensors. Idempotent;
    ``fully_shard``'s root calls it."""
    if getattr(module, _HOOKED, False):
        return
    setattr(module, _HOOKED, True)

    def pre_hook(mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        _ensure_sharded(mod)

    def post_hook(mod: nn.Module, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        _wrap_module_state(mod, sd, prefix)

    def load_pre_hook(mod, sd, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        _ensure_sharded(mod)
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        # A submodule sharded on its own first (``fully_shard(layer)``) keeps its hooks: its keys are left
        # to it (it runs next, on the same entries), so each entry is converted once, by the innermost.
        inner = tuple(f"{n}." for n, m in mod.named_modules(remove_duplicate=False) if n and getattr(m, _HOOKED, False))
        for name, p in mod.named_parameters(remove_duplicate=False):
            key = prefix + name
            info = shard_info(p)
            if info is None or key not in sd or name.startswith(inner):
                continue
            v = sd[key]
            shape = tuple(v.shape) if torch.is_tensor(v) else None
            if shape is not None and shape != info.shape and not (info.shape == () and shape == (1,)):  # (nn.Module's)
                # Compared with the global shape here: nn.Module compares with the local piece's, and a
                # plain tensor of another model that happens to have this rank's flat length would load
                # silently as every rank's piece. (A local piece is only accepted as FlatShardTensor.)
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {torch.Size(v.shape)} from checkpoint, "
                    f"the shape in current model is {torch.Size(info.shape)}."
                )
                sd[key] = p  # nn.Module copies the parameter onto itself: nothing changes, nothing is missing
                continue
            if isinstance(v, FlatShardTensor):
                if v.local_range != (info.start, info.end):
                    error_msgs.append(
                        f"{key}: the FlatShardTensor holds [{v.local_range[0]}, {v.local_range[1]}) but this rank's "
                        f"shard is [{info.start}, {info.end}); dcp.load into model.state_dict() to reshard"
                    )
                    continue
                local = v.to_local()
            elif torch.is_tensor(v):
                local = v.detach().reshape(-1)[info.start : info.end]  # a full tensor: take this rank's range
            else:
                continue
            if assign:  # see [Note: load_state_dict(assign=True) on sharded parameters]
                if local.dtype != p.dtype:
                    warnings.warn(
                        f"load_state_dict(assign=True): {key} is {local.dtype} in the state dict but the sharded "
                        f"parameter is {p.dtype}; assign=True cannot change a sharded parameter's dtype, the values "
                        f"are copied as {p.dtype} (cast the model before fully_shard to change it)",
                        stacklevel=3,
                    )
                with torch.no_grad():
                    p.copy_(local)
                sd[key] = p  # assigning the parameter to itself: nn.Module keeps the runtime's object
            else:
                sd[key] = local

    module.register_state_dict_pre_hook(pre_hook)
    module.register_state_dict_post_hook(post_hook)
    module.register_load_state_dict_pre_hook(load_pre_hook)


def register_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` DCP-ready: sharded state as ``FlatShardTensor`` (torch's
    id-keyed layout otherwise); ``optimizer.load_state_dict()`` takes it back. A lazy optimizer
    with no state yet gets it from one zero-learning-rate step (as ``torch.distributed.checkpoint.
    state_dict`` does) so that a fresh optimizer's state dict has every key for ``dcp.load``."""
    if getattr(optimizer, _HOOKED, False):
        return
    setattr(optimizer, _HOOKED, True)
    dtypes: dict[tuple[int, str], torch.dtype] = {}

    def pre_hook(opt: torch.optim.Optimizer) -> None:
        if not opt.state and not hasattr(opt, "state_shards"):
            _init_lazy_state(opt)

    def post_hook(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        params = [p for g in opt.param_groups for p in g["params"]]
        new_state = {}
        for i, p in enumerate(params):
            if i not in sd["state"]:
                continue
            kinds = _state_kinds(opt, p, f"param {i}")
            entry = dict(sd["state"][i])
            for key, (kind, where) in kinds.items():
                if kind == _SHARDED:
                    shape, start = where
                    entry[key] = FlatShardTensor(entry[key].detach().reshape(-1), shape=shape, start=start)
            new_state[i] = entry
        return {**sd, "state": new_state}

    def unwrap(sd: dict[str, Any]) -> dict[str, Any]:
        dtypes.clear()
        new_state = {}
        for i, entry in sd["state"].items():
            e = {}
            for k, v in entry.items():
                if isinstance(v, FlatShardTensor):
                    v = v.to_local()
                if torch.is_tensor(v):
                    dtypes[(i, k)] = v.dtype
                e[k] = v
            new_state[i] = e
        return {**sd, "state": new_state}

    def load_post_hook(opt: torch.optim.Optimizer) -> None:
        # Optimizer.load_state_dict casts every state tensor to its parameter's dtype; undo that
        # for integer state (8-bit codes): the cast to float and back is exact for 8-bit values.
        params = [p for g in opt.param_groups for p in g["params"]]
        for (i, k), dt in dtypes.items():
            st = opt.state.get(params[i])
            if st is not None and torch.is_tensor(st.get(k)) and st[k].dtype != dt:
                st[k] = st[k].to(dt)

    optimizer.register_state_dict_pre_hook(pre_hook)
    optimizer.register_state_dict_post_hook(post_hook)
    # Unwrap before the optimizer's own load_state_dict (overrides read the dict before torch's
    # pre-hooks run); a bound method on the instance, so copies of the optimizer rebind it.
    def load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        type(self).load_state_dict(self, unwrap(state_dict))

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    optimizer.register_load_state_dict_post_hook(load_post_hook)


def _init_lazy_state(opt: torch.optim.Optimizer) -> None:
    """Create a lazy optimizer's state without changing parameters: one step at lr 0 with zero
    gradients, the step counters then reset by the checkpoint that is loaded into it."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None
