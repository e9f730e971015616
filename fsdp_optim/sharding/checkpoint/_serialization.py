"""Bytes a checkpoint may hold, and reading them without running code: the small ``torch.save``
entries (optimizer scalars, param groups, scheduler, RNG and ``extra``), DCP's ``.metadata`` pickle
and DCP's byte records (see [Note: loading runs no code]); and the RNG state saved per rank."""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = [
    "SafeLoadPlanner",
    "SafeReader",
    "from_bytes",
    "numbers_from_numpy",
    "rng_state",
    "root_cause",
    "set_rng_state",
    "to_bytes",
    "type_name",
]


def to_bytes(obj: Any, what: str) -> bytes:
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
            f"save_checkpoint: {where} is a {type_name(bad)}, which load_checkpoint cannot load "
            f"({_load_refusal(e)}); checkpoints load only tensors, numbers, strings, lists, tuples and dicts: "
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


def type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _load_refusal(e: BaseException) -> str:
    """The useful line of a ``torch.load(weights_only=True)`` error (the refused global), without ANSI codes."""
    text = _ANSI.sub("", str(e))
    for marker in ("WeightsUnpickler error:", "Unsupported global:"):
        if marker in text:
            line = text[text.index(marker) :].splitlines()[0].strip()
            line = line.split(" by default.")[0]  # (torch's advice follows; ours is in the caller's message)
            return f"{type(e).__name__}: {line}"[:600]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:600] if lines else ''}"


def numbers_from_numpy(obj: Any) -> Any:
    """``obj`` with numpy scalars (``np.float64`` from a numpy LR schedule) as the equal Python numbers."""
    if isinstance(obj, np.generic) and isinstance(obj, np.number | np.bool_):
        return obj.item()
    if type(obj) is dict:
        return {k: numbers_from_numpy(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(numbers_from_numpy(v) for v in obj)
    return obj


def from_bytes(data: Any, what: str) -> Any:
    if not isinstance(data, bytes | bytearray):
        raise RuntimeError(f"checkpoint entry {what!r} was not loaded")
    # See [Note: loading runs no code]: tensors, numbers, strings and containers only.
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - refused (a class or callable) or undecodable
        raise ValueError(
            f"checkpoint entry {what!r} cannot be loaded safely: {_load_refusal(e)}. Only tensors, numbers, strings, "
            "lists, tuples and dicts are loaded (a checkpoint of another writer; save_checkpoint refuses such values), "
            "unless the class is allowed with torch.serialization.add_safe_globals([...]), if you trust it"
        ) from None


# [Note: loading runs no code]
# A checkpoint is data: loading one must not run code, whoever wrote it. Three places would unpickle:
# our small entries (optimizer scalars, param groups, scheduler state, RNG states, ``extra``), which
# are read with ``torch.load(weights_only=True)`` (tensors and plain containers only); DCP's own byte
# records that carry them, which DCP's default load planner reads with ``weights_only=False`` and
# ``SafeLoadPlanner`` reads with ``weights_only=True``; and DCP's ``.metadata`` file, a plain pickle,
# which ``SafeReader`` reads through an unpickler that resolves only DCP's metadata classes and the
# few torch and pathlib names they use (``_METADATA_GLOBALS``). Anything else raises a clear error.
# ``save_checkpoint`` reads each small entry back the same way before writing (``to_bytes``), so it
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


class SafeReader(dcp.FileSystemReader):
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


def root_cause(e: CheckpointException) -> str:
    """The first failing rank's own exception inside DCP's ``CheckpointException`` (whose failures are
    ``(exception, traceback)`` pairs), as ``Type: message``; an ``OSError`` says its cause in words
    (``no space left on device``, ``file too large``) even when raised with an errno alone."""
    for failure in e.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
        if isinstance(inner, CheckpointException):
            return root_cause(inner)
        text = str(inner)
        if isinstance(inner, OSError) and inner.errno:
            cause = os.strerror(inner.errno).lower()
            text = text if cause in text.lower() else f"{cause} ({text})"
        return f"{type(inner).__name__}: {text}"
    return str(e)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading byte records with ``weights_only=True`` (see the Note)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"checkpoint byte record {fqn!r} cannot be loaded safely: {_load_refusal(e)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
