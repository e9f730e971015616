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
The export is written into ``<path>.tmp`` and then replaces ``path`` (see [Note: atomic Hugging
Face export]); ``load_hf`` opens every file (headers only) before the first broadcast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .._dist import agree_on_error, is_distributed, rank_and_world_size
from .._runtime import buckets_of
from .._dtensor import RaggedDTensor
from ._entry import every_rank_entered
from ._files import PublishError, foreign_entries, fsync, normalize, publish
from ._full_state import load_full_state_dict, whole_tensors
from ._state import torch_names

__all__ = ["export_hf", "load_hf"]

_INDEX = "model.safetensors.index.json"

Convert = Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Persistent state under the model's ``state_dict()`` keys, first key only for tied tensors."""
    out, seen = [], set()
    keys = torch_names(model)  # [Note: state-dict names] in _state.py
    for prefix, m in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((keys.get(pre + name, pre + name), p))
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out.append((keys.get(pre + name, pre + name), b))
    return out


def export_hf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    config: object | None = None,
    convert: Convert | None = None,
    timeout: float | None = None,
) -> None:
    """Write a ``transformers.AutoModelForCausalLM.from_pretrained``-loadable directory (collective).

    ``model``: a sharded ``transformers`` model (its ``.config`` is saved), or any sharded module with
    ``config`` (a ``PretrainedConfig``) and ``convert(name, tensor) -> (hf_name, hf_tensor)`` mapping
    its names and layouts to the Hub's (e.g. the recipes' Llama: ``recipes/model.py``). Every rank
    calls it; rank 0 writes. See [Note: streaming Hugging Face checkpoints].

    Atomic, as ``save_checkpoint`` (see [Note: atomic Hugging Face export]): the export is written to
    ``<path>.tmp`` and, once every rank agrees it succeeded, replaces ``path`` as a whole, so no file
    of an older export or ``save_pretrained`` survives (``from_pretrained`` would prefer a stale
    ``model.safetensors`` to the new index). On failure every rank raises a ``ValueError``, ``path``
    is left as it was and ``<path>.tmp`` is removed.

    ``path`` must be absent, an empty folder or a folder holding only a model export's files
    (``config.json``, ``generation_config.json``, ``model.safetensors``, ``model-*-of-*.safetensors``,
    ``model.safetensors.index.json``, the older ``pytorch_model*.bin`` and their index). Anything else
    (a tokenizer, a README, a subfolder), a symbolic link or a file is refused with a ``ValueError``
    on every rank before anything is written, rather than deleted: export to a new folder, or move
    those files out (save a tokenizer after the export). Leftover ``<path>.tmp`` / ``<path>.old`` of
    an interrupted export are removed under the same rule.

    The files get the mode a plain ``open()`` gives (0644 under the usual umask 022), as
    ``config.json``: safetensors' ``save_file`` alone leaves 0600, which other users cannot read.

    Every rank must call it: one that waits more than ``timeout`` seconds (default: the
    ``FSDP_OPTIM_CHECKPOINT_TIMEOUT`` environment variable, else 60) for the others raises a
    ``TimeoutError`` naming them, before anything is written (see [Note: every rank calls it]).
    """
    every_rank_entered("export_hf", timeout=timeout)
    config = config if config is not None else getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError(
            f"export_hf: {type(model).__name__} has no .config; pass config= (a transformers PretrainedConfig)"
        )
    job = _Export(path=normalize(path, caller="export_hf"), rank=rank_and_world_size()[0], convert=convert)
    job.on_rank0(lambda: job.prepare(config), f"creating {job.tmp}")
    job.agree()
    named = _named_tensors(model)
    names = {id(t): n for n, t in named}
    buckets = []
    for b in buckets_of(model):
        mine = [(names.get(id(sp)), sp) for sp in b.sharded]
        if any(n for n, _ in mine):
            buckets.append((b, mine))
    # One file per bucket holding a named tensor, one for the rest if any: the count in every name.
    num_files = len(buckets) + any(not isinstance(t, RaggedDTensor) for _, t in named)

    def fname(k: int) -> str:
        return f"model-{k:05d}-of-{num_files:05d}.safetensors"

    for k, (b, mine) in enumerate(buckets, start=1):
        b.settle()
        whole = whole_tensors(b, rank0_only=True)
        if job.rank == 0 and whole is not None:
            views = [(n, sp, view) for (n, sp), view in zip(mine, whole) if n is not None]
            job.on_rank0(lambda: job.write_file(fname(k), views), f"writing {job.path} (into {job.tmp})")
        del whole
    job.on_rank0(lambda: job.write_rest_and_index(model, fname(num_files)), f"writing {job.path} (into {job.tmp})")
    job.agree()  # also the barrier: the whole export is in tmp
    job.on_rank0(job.publish, f"replacing {job.path} by {job.tmp}")
    job.agree()


class _Refused(Exception):
    """A target ``export_hf`` must not replace; its message is the whole error."""


@dataclasses.dataclass
class _Export:
    """One ``export_hf``: rank 0 does every step through ``on_rank0``, keeping its first failure while
    the other ranks go on joining the gathers; ``agree`` then raises it on every rank."""

    path: str
    rank: int
    convert: Convert | None
    err: BaseException | None = None
    made_tmp: bool = False  # rank 0 created tmp (and so may remove it)
    left: str | None = None  # what a failure left on disk, when it is not "path unchanged"
    weight_map: dict[str, str] = dataclasses.field(default_factory=dict)
    written: set[int] = dataclasses.field(default_factory=set)

    @property
    def tmp(self) -> str:
        return self.path + ".tmp"

    def on_rank0(self, fn: Callable[[], None], what: str) -> None:
        if self.rank != 0 or self.err is not None:
            return
        try:
            fn()
        except _Refused as e:
            self.err = ValueError(str(e))
        except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
            self.left = getattr(e, "left", None) if isinstance(e, PublishError) else None
            self.err = ValueError(f"export_hf: {what} failed on rank 0: {type(e).__name__}: {e}")

    def agree(self) -> None:
        """Raise on every rank if a step failed: rank 0 cleans up and tells every rank what is on disk."""
        try:
            agree_on_error(self.err, what="export_hf")
        except Exception as e:  # noqa: BLE001 - raised below on every rank, with rank 0's outcome
            box = [f"{e}; {self._cleanup()}" if self.rank == 0 else None]
            if is_distributed():
                dist.broadcast_object_list(box, src=0)
            raise ValueError(box[0]) from None

    def _cleanup(self) -> str:
        """Rank 0, after a failure: remove the temporary folder; say what is on disk now."""
        note = self.left if self.left is not None else f"{self.path} was not changed"
        if self.made_tmp and os.path.lexists(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)
            gone = not os.path.lexists(self.tmp)
            note += f" and {self.tmp} was removed" if gone else f"; {self.tmp} could not be removed, delete it"
        return note

    def prepare(self, config: object) -> None:
        old = self.path + ".old"
        for folder in (self.path, self.tmp, old):
            why = _refusal(folder, self.path)
            if why is not None:
                raise _Refused(why)
        for leftover in (self.tmp, old):  # of an interrupted export (checked above: export files only)
            if os.path.lexists(leftover):
                shutil.rmtree(leftover)
        os.makedirs(self.tmp)
        self.made_tmp = True
        config.save_pretrained(self.tmp)

    def write_file(self, fname: str, tensors: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Write ``(name, original, value)`` triples (converted) as one safetensors file in tmp."""
        from safetensors.torch import save_file

        out = {}
        for name, orig, value in tensors:
            hf_name, t = self.convert(name, value.detach()) if self.convert else (name, value.detach())
            out[hf_name] = t.to("cpu", copy=True).contiguous()
            self.written.add(id(orig))
        save_file(out, os.path.join(self.tmp, fname), metadata={"format": "pt"})
        fsync(os.path.join(self.tmp, fname))
        self.weight_map.update({n: fname for n in out})

    def write_rest_and_index(self, model: nn.Module, fname: str) -> None:
        """The tensors no bucket holds (unsharded parameters, buffers), then the index; files get ``open()``'s mode."""
        rest = [(n, t, t) for n, t in _named_tensors(model) if not isinstance(t, RaggedDTensor) and id(t) not in self.written]
        if rest:
            self.write_file(fname, rest)
        files = sorted(set(self.weight_map.values()))
        total = sum(os.path.getsize(os.path.join(self.tmp, f)) for f in files)
        index = os.path.join(self.tmp, _INDEX)
        with open(index, "w") as f:
            body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.weight_map.items()))}
            json.dump(body, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        mode = stat.S_IMODE(os.stat(index).st_mode)  # what open() gives under this process's umask
        for f in files:
            os.chmod(os.path.join(self.tmp, f), mode)

    def publish(self) -> None:
        try:
            publish(self.tmp, self.path, refusal=lambda folder: _refusal(folder, self.path))
        except ValueError as e:  # publish's refusal: files appeared at path since prepare()
            raise _Refused(str(e)) from None
        self.made_tmp = False  # tmp is path now: a failure below must not remove it


# [Note: atomic Hugging Face export]
# ``export_hf`` follows ``save_checkpoint``: rank 0 checks the target and writes the config and every
# bucket into ``<path>.tmp``; the ranks agree (one collective) after the setup, after the writes, and
# after rank 0 published ``<path>.tmp`` as ``path`` (``publish``, see [Note: atomic publish]: if the
# rename fails the previous export is moved back). So a failed export leaves ``path`` as it was, a
# successful one leaves exactly its own files (no stale ``model.safetensors`` that ``from_pretrained``
# would load instead of the index), and every rank raises the same ``ValueError`` saying what is on
# disk. Only folders holding nothing but a model export's files are ever replaced or removed, so a
# user's other files (or a folder that is not an export at all) are refused, never deleted.
_EXPORT_FILE = re.compile(
    r"config\.json|generation_config\.json|model\.safetensors(\.index\.json)?|model-\d+-of-\d+\.safetensors"
    r"|pytorch_model\.bin(\.index\.json)?|pytorch_model-\d+-of-\d+\.bin"
)


def _refusal(folder: str, path: str) -> str | None:
    """Why ``export_hf`` to ``path`` may not replace or remove ``folder`` (``None``: it may)."""
    what = "the target" if folder == path else f"the temporary folder of an export to {path}"
    if os.path.islink(folder):
        return (
            f"export_hf: {folder} ({what}) is a symbolic link (to {os.readlink(folder)}); an export replaces the "
            "folder at its path, so it would replace the link, not the export it points to. Export to a real "
            f"folder (e.g. {os.path.realpath(folder)}) and point the link at it"
        )
    if not os.path.lexists(folder):
        return None
    if not os.path.isdir(folder):
        return f"export_hf: {folder} ({what}) exists and is not a folder; remove it or export to another path"
    shown = foreign_entries(folder, _EXPORT_FILE)
    if shown is None:
        return None
    return (
        f"export_hf: {folder} ({what}) holds files that are not part of a Hugging Face model export ({shown}); an "
        "export replaces the whole folder, so export to a new folder or move those files out (a tokenizer: "
        "save it into the folder after the export)"
    )


def load_hf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    convert: Callable[[str], tuple[str, Callable[[torch.Tensor], torch.Tensor]]] | None = None,
    timeout: float | None = None,
) -> None:
    """Load a Hugging Face safetensors directory (single file or sharded with an index) into a sharded
    model (collective), e.g. one built on meta and sharded: rank 0 reads lazily and broadcasts one
    bucket at a time (see the Note). Tied names missing from the files are fine. ``convert(name) ->
    (hf_name, from_hf)`` maps a model name to the file's name and a function turning the file's tensor
    into the model's layout (the inverse of ``export_hf``'s ``convert``). It is called on rank 0 for
    every ``model.state_dict()`` name (parameters and persistent buffers; not for non-persistent
    buffers such as rotary ``inv_freq``, which no file holds). ``from_hf`` is first applied to a meta
    tensor of the file's shape and dtype, so a wrong shape is refused before anything is loaded (one
    that needs real data, e.g. numpy, is checked when read; see [Note: broadcasting from rank 0] in
    ``_full_state.py``). An error in ``convert``, ``from_hf`` or a file raises a ``ValueError`` on
    every rank, naming the tensor. Every rank must call it (``timeout``: as ``export_hf``'s)."""
    every_rank_entered("load_hf", timeout=timeout)
    path = os.fspath(path)
    lazy, err = None, None
    if rank_and_world_size()[0] == 0:
        try:
            keys, getter, metas = _lazy_reader(path)
        except Exception as e:  # noqa: BLE001 - told to every rank below, so none waits for rank 0
            err = f"load_hf({path}): rank 0 cannot read the checkpoint: {type(e).__name__}: {e}"
        if err is None and convert is not None:
            try:
                keys, getter, metas = _converted(_state_names(model), convert, keys, getter, metas)
            except Exception as e:  # noqa: BLE001 - told to every rank below
                why = str(e) if isinstance(e, _ConvertError) else f"{type(e).__name__}: {e}"
                err = f"load_hf({path}): {why}"
    agree_on_error(None if err is None else ValueError(err), what="load_hf")
    if rank_and_world_size()[0] == 0:
        lazy = _LazyDict(keys, getter, metas, tied_names=_tied_aliases(model))
    load_full_state_dict(model, lazy, strict=strict, broadcast_from_rank0=is_distributed())


def _state_names(model: nn.Module) -> list[str]:
    """The keys of ``model.state_dict()`` (tied aliases included): parameters and persistent buffers."""
    keys = torch_names(model)  # [Note: state-dict names] in _state.py
    out = []
    for prefix, m in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        out += [pre + n for n, p in m._parameters.items() if p is not None]
        out += [pre + n for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set]
    return [keys.get(n, n) for n in out]


class _ConvertError(Exception):
    """The user's ``convert`` failed for a name; its message is the whole error."""


def _converted(names: list[str], convert, keys: set[str], file_get, file_meta):
    """``load_hf``'s reader under the model's names through ``convert``: names, tensor getter, meta getter."""
    mapping = {}
    for n in names:
        try:
            m = convert(n)
        except Exception as e:  # noqa: BLE001
            raise _ConvertError(f"convert({n!r}) raised {type(e).__name__}: {e}") from None
        if not (isinstance(m, tuple | list) and len(m) == 2 and isinstance(m[0], str) and callable(m[1])):
            raise _ConvertError(f"convert({n!r}) returned {m!r}, not a pair (hf_name, from_hf)")
        if m[0] in keys:
            mapping[n] = m

    def get(n: str) -> torch.Tensor:
        hf_name, from_hf = mapping[n]
        return from_hf(file_get(hf_name))

    def meta(n: str) -> torch.Tensor | None:
        """What ``from_hf`` gives, on meta; ``None`` when that needs real data (checked when read): the
        file's own shape would wrongly refuse a ``from_hf`` that permutes."""
        hf_name, from_hf = mapping[n]
        try:
            out = from_hf(file_meta(hf_name))
        except Exception:  # noqa: BLE001 - e.g. numpy: see the docstring
            return None
        return out if torch.is_tensor(out) and out.is_meta else None

    return set(mapping), get, meta


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for tied parameters (a file may hold either name)."""
    first: dict[int, str] = {}
    out = {}
    keys = torch_names(model)  # [Note: state-dict names] in _state.py
    for name, t in model.named_parameters(remove_duplicate=False):
        n = keys[name]
        if id(t) in first:
            out[n] = first[id(t)]
        else:
            first[id(t)] = n
    return out


def _lazy_reader(path: str) -> tuple[set[str], Callable[[str], torch.Tensor], Callable[[str], torch.Tensor]]:
    """Names, a tensor getter and a meta getter (the tensor's shape and dtype) for the safetensors files at ``path``.

    Every file is opened (its header read and checked against the file's length: safetensors does)
    and checked to hold the names the index gives it here, before any tensor is read: ``load_hf``
    agrees on this verdict, so a missing, truncated or corrupt file raises on every rank, naming the
    file, instead of failing on rank 0 in the middle of the broadcasts.
    """
    from safetensors import safe_open

    index = os.path.join(path, _INDEX)
    single = os.path.join(path, "model.safetensors")
    handles: dict[str, object] = {}

    def open_checked(fname: str, listed_in: str | None):
        file = os.path.join(path, fname)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"load_hf: {file} is missing (listed in {listed_in})")
        try:
            return safe_open(file, framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError: a bad header or a short file
            raise ValueError(
                f"load_hf: {file} is truncated or corrupt ({os.path.getsize(file)} bytes; safetensors: {e}); "
                "export or download it again"
            ) from None

    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("'weight_map' is not a mapping of tensor names to file names")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"load_hf: {index} is not a safetensors index (JSON with a 'weight_map' of tensor name -> file): "
                f"{type(e).__name__}: {e}; export or download it again"
            ) from None
        for fname in sorted(set(weight_map.values())):
            handles[fname] = h = open_checked(fname, index)
            present = set(h.keys())
            missing = sorted(n for n, f in weight_map.items() if f == fname and n not in present)
            if missing:
                raise ValueError(
                    f"load_hf: {os.path.join(path, fname)} lacks {len(missing)} tensor(s) that {index} lists in it "
                    f"({', '.join(missing[:5])}); the index and the files are of different exports, export or "
                    "download them again"
                )
    elif os.path.isfile(single):
        handles["model.safetensors"] = h = open_checked("model.safetensors", None)
        weight_map = {k: "model.safetensors" for k in h.keys()}
    else:
        raise FileNotFoundError(f"load_hf: neither {index} nor {single} exists")

    def get(name: str) -> torch.Tensor:
        return handles[weight_map[name]].get_tensor(name)

    def meta(name: str) -> torch.Tensor:
        sl = handles[weight_map[name]].get_slice(name)
        dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
        if dtype is None:
            raise ValueError(f"load_hf: {name} in {os.path.join(path, weight_map[name])} is {sl.get_dtype()}, "
                             "a dtype torch does not have")
        return torch.empty(tuple(sl.get_shape()), dtype=dtype, device="meta")

    return set(weight_map), get, meta


_SAFETENSORS_DTYPES = {
    k: getattr(torch, v) for k, v in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
        "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
    }.items() if hasattr(torch, v)
}


class _LazyDict(dict):
    """A read-only mapping whose tensors are read on access (rank 0 of ``load_hf``); a tied alias
    missing from the files reads its first name's tensor."""

    def __init__(self, keys: set[str], getter, metas, *, tied_names: dict[str, str]) -> None:
        super().__init__()
        self._tied = {a: first for a, first in tied_names.items() if a not in keys and first in keys}
        self._keys = set(keys) | set(self._tied)
        self._get, self._meta = getter, metas

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

    def meta_of(self, key: str) -> torch.Tensor | None:
        """A meta tensor with the shape and dtype reading ``key`` gives (reads nothing); ``None`` when
        only reading can tell (a ``from_hf`` that needs real data)."""
        return self._meta(self._source(key))

    def get(self, key: str, default=None):
        return self[key] if key in self._keys else default
