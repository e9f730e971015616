"""Parameters ``fully_shard`` replaced: the original (full) ``nn.Parameter`` objects a module held before
its first ``fully_shard`` call are marked, so that an optimizer built on them (it would train nothing)
and a module outside the call still holding one (a weight tied across the call's boundary) are found.
A sharded parameter itself is never replaced again: a root that absorbs earlier roots re-lays out the
same ``RaggedDTensor`` objects in place."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

__all__ = ["check_not_replaced", "mark_replaced", "rename_replaced", "replacement_of", "was_replaced"]

_REPLACED = "_fsdp_optim_replaced_by"
_REPLACEMENT = "_fsdp_optim_replacement"
_ORIGINALS = "_fsdp_optim_replaced_originals"  # on a sharded parameter: weak references to what it replaced


def mark_replaced(original: object, fqn: str, *, replacement: torch.Tensor) -> None:
    """Mark ``original``, a parameter ``fully_shard`` replaced by the sharded ``replacement`` (kept as a
    weak reference, see ``replacement_of``)."""
    if not isinstance(original, torch.Tensor):
        return
    try:
        setattr(original, _REPLACED, fqn)
        setattr(original, _REPLACEMENT, weakref.ref(replacement))
        setattr(replacement, _ORIGINALS, [*getattr(replacement, _ORIGINALS, ()), weakref.ref(original)])
    except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - tensors that refuse attributes
        pass


def rename_replaced(replacement: torch.Tensor, fqn: str) -> None:
    """A root that absorbed an inner call names the parameter from the root (``layers.0.w``, not
    ``w``): so do the errors about the originals it replaced."""
    for ref in getattr(replacement, _ORIGINALS, ()):
        o = ref()
        if o is not None:
            setattr(o, _REPLACED, fqn)


def was_replaced(p: torch.Tensor) -> bool:
    """Whether ``fully_shard`` replaced the parameter object ``p``."""
    return getattr(p, _REPLACED, None) is not None


def replacement_of(p: torch.Tensor) -> torch.Tensor | None:
    """The live sharded parameter that replaced ``p``; ``None`` if ``p`` was not replaced or its
    replacement is gone. Keeps a parameter shared with a module outside an inner ``fully_shard`` call
    tied (that module still holds the original)."""
    ref = getattr(p, _REPLACEMENT, None)
    return ref() if ref is not None else None


def check_not_replaced(params: Iterable[torch.Tensor], *, owner: str) -> None:
    """``ValueError`` if any of ``params`` is a parameter object that ``fully_shard`` replaced."""
    for p in params:
        fqn = getattr(p, _REPLACED, None)
        if fqn is not None:
            raise ValueError(
                f"{owner} holds parameter {fqn or '<unnamed>'} (shape {tuple(p.shape)}) that fully_shard replaced "
                "with a sharded parameter: it would never be updated. Build the optimizer after the outermost "
                "fully_shard call (the root), from model.parameters()"
            )
