"""Hugging Face in and out: a sharded ``transformers`` model to a ``from_pretrained`` directory and back.

[Note: streaming Hugging Face checkpoints]
``export_hf`` writes ``config.json`` and one safetensors file per bucket, plus
``model.safetensors.index.json``; each bucket is gathered to rank 0 alone (the other ranks send
their segment and keep nothing), written, and dropped, so rank 0 holds one bucket at a time and the
others their own segment. Tied parameters are written once, under their first name (as
``save_pretrained`` does; ``from_pretrained`` re-ties them from the config). ``load_hf`` reads the
safetensors files lazily on rank 0 (``safe_open``, one tensor at a time) and broadcasts each bucket
to every rank, which keeps its own range: no rank holds more than one bucket at full size. Names are
the model's own (``model.state_dict()`` keys), which for ``transformers`` models are the Hub's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ._checkpoint import load_full_state_dict
from ._runtime import buckets_of
from ._shard_info import shard_info
from ._state_dict import _gather_to_group_rank0

__all__ = ["export_hf", "load_hf"]

_INDEX = "model.safetensors.index.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Persistent state under the model's names, first name only for tied tensors."""
    out, seen = [], set()
    for prefix, m in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((pre + name, p))
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out.append((pre + name, b))
    return out


def export_hf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    config: object | None = None,
    convert: Callable[[str, torch.Tensor], tuple[str, torch.Tensor]] | None = None,
) -> None:
    """Write a ``transformers.AutoModelForCausalLM.from_pretrained``-loadable directory (collective).

    ``model``: a sharded ``transformers`` model (its ``.config`` is saved), or any sharded module with
    ``config`` (a ``PretrainedConfig``) and ``convert(name, tensor) -> (hf_name, hf_tensor)`` mapping
    its names and layouts to the Hub's (e.g. the recipes' Llama: ``recipes/model.py``). Every rank
    calls it; rank 0 writes. See [Note: streaming Hugging Face checkpoints].
    """
    from safetensors.torch import save_file

    path = os.fspath(path)
    config = config if config is not None else getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError(
            f"export_hf: {type(model).__name__} has no .config; pass config= (a transformers PretrainedConfig)"
        )
    rank = _rank()
    err: str | None = None  # rank 0's write error: it keeps joining the gathers, then every rank raises

    def on_rank0(fn: Callable[[], None]) -> None:
        nonlocal err
        if rank == 0 and err is None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
                err = f"{type(e).__name__}: {e}"

    def write_config() -> None:
        os.makedirs(path, exist_ok=True)
        config.save_pretrained(path)

    on_rank0(write_config)
    names = {id(t): n for n, t in _named_tensors(model)}
    weight_map: dict[str, str] = {}
    written: set[int] = set()
    buckets = buckets_of(model)
    num_files = len(buckets) + 1
    for i, b in enumerate(buckets):
        mine = [(names.get(id(sp)), sp) for sp in b.sharded]
        if not any(n for n, _ in mine):
            continue
        b.settle()
        flat = _gather_to_group_rank0(b)
        if rank != 0 or flat is None:
            continue

        def write_bucket(i=i, mine=mine, b=b, flat=flat) -> None:
            tensors = {}
            for (name, sp), view in zip(mine, b.full_views(flat)):
                if name is not None:
                    hf_name, t = convert(name, view.detach()) if convert else (name, view.detach())
                    tensors[hf_name] = t.to("cpu", copy=True).contiguous()
                    written.add(id(sp))
            fname = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
            save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in tensors})

        on_rank0(write_bucket)
        del flat

    def write_rest_and_index() -> None:
        rest = dict(
            (convert(n, t.detach()) if convert else (n, t.detach()))
            for n, t in _named_tensors(model)
            if shard_info(t) is None and id(t) not in written
        )
        rest = {n: t.to("cpu", copy=True).contiguous() for n, t in rest.items()}
        if rest:
            fname = f"model-{num_files:05d}-of-{num_files:05d}.safetensors"
            save_file(rest, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in rest})
        total = sum(os.path.getsize(os.path.join(path, f)) for f in set(weight_map.values()))
        with open(os.path.join(path, _INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)

    on_rank0(write_rest_and_index)
    if dist.is_available() and dist.is_initialized():
        box = [err]
        dist.broadcast_object_list(box, src=0)  # also the final barrier: every rank waits for the files
        err = box[0]
    if err is not None:
        raise ValueError(f"export_hf: writing {path!r} failed on rank 0: {err} (nothing else was changed)")


def load_hf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    convert: Callable[[str], tuple[str, Callable[[torch.Tensor], torch.Tensor]]] | None = None,
) -> None:
    """Load a Hugging Face safetensors directory (single file or sharded with an index) into a sharded
    model (collective), e.g. one built on meta and sharded: rank 0 reads lazily and broadcasts one
    bucket at a time (see the Note). Tied names missing from the files are fine. ``convert(name) ->
    (hf_name, from_hf)`` maps a model name to the file's name and a function turning the file's tensor
    into the model's layout (the inverse of ``export_hf``'s ``convert``)."""
    path = os.fspath(path)
    lazy, err = None, None
    if _rank() == 0:
        try:
            keys, getter, shapes = _lazy_reader(path)
        except Exception as e:  # noqa: BLE001 - told to every rank below, so none waits for rank 0
            err = f"{type(e).__name__}: {e}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [err]
        dist.broadcast_object_list(box, src=0)
        err = box[0]
    if err is not None:
        raise ValueError(f"load_hf({path}): rank 0 cannot read the checkpoint: {err}")
    if _rank() == 0:
        if convert is not None:
            names = [n for n, _ in model.named_parameters(remove_duplicate=False)] + [
                n for n, _ in model.named_buffers(remove_duplicate=False)
            ]
            mapping = {n: convert(n) for n in names}
            mapping = {n: m for n, m in mapping.items() if m[0] in keys}
            file_get, file_shape = getter, shapes
            keys = set(mapping)
            getter = lambda n: mapping[n][1](file_get(mapping[n][0]))  # noqa: E731
            shapes = lambda n: file_shape(mapping[n][0])  # noqa: E731 - layouts permute, shapes stay
        lazy = _LazyDict(keys, getter, shapes, tied_names=_tied_aliases(model))
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    load_full_state_dict(model, lazy, strict=strict, broadcast_from_rank0=distributed)


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for tied parameters (a file may hold either name)."""
    first: dict[int, str] = {}
    out = {}
    for n, t in model.named_parameters(remove_duplicate=False):
        if id(t) in first:
            out[n] = first[id(t)]
        else:
            first[id(t)] = n
    return out


def _lazy_reader(path: str) -> tuple[set[str], Callable[[str], torch.Tensor], Callable[[str], tuple[int, ...]]]:
    from safetensors import safe_open

    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        single = os.path.join(path, "model.safetensors")
        if not os.path.isfile(single):
            raise FileNotFoundError(f"load_hf: neither {index} nor {single} exists")
        with safe_open(single, framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    handles: dict[str, object] = {}

    def handle(name: str):
        fname = weight_map[name]
        if fname not in handles:
            handles[fname] = safe_open(os.path.join(path, fname), framework="pt")
        return handles[fname]

    def get(name: str) -> torch.Tensor:
        return handle(name).get_tensor(name)

    def shape(name: str) -> tuple[int, ...]:
        return tuple(handle(name).get_slice(name).get_shape())

    return set(weight_map), get, shape


class _LazyDict(dict):
    """A read-only mapping whose tensors are read on access (rank 0 of ``load_hf``); a tied alias
    missing from the files reads its first name's tensor."""

    def __init__(self, keys: set[str], getter, shapes, *, tied_names: dict[str, str]) -> None:
        super().__init__()
        self._tied = {a: first for a, first in tied_names.items() if a not in keys and first in keys}
        self._keys = set(keys) | set(self._tied)
        self._get, self._shape = getter, shapes

    def _source(self, key: str) -> str:
        if key not in self._keys:
            raise KeyError(key)
        return self._tied.get(key, key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self):  # noqa: D102
        return self._keys

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._get(self._source(key))

    def shape_of(self, key: str) -> tuple[int, ...]:
        return self._shape(self._source(key))

    def get(self, key: str, default=None):
        return self[key] if key in self._keys else default
