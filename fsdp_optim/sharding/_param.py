"""``ShardedParam``: one sharded parameter's owner (FSDP2's ``FSDPParam``).

A bucket (``_bucket.py``) owns one ``ShardedParam`` per parameter it manages. Everything that is about
one parameter lives here: its name and the module attributes that register it, the sharded parameter
(a ``RaggedDTensor`` viewing the bucket's segment, the one object users and optimizers hold), the
unsharded parameter shown while the bucket is gathered (a view of the gathered buffer), which of the
two the modules show, its gradient as a view of the gradient segment, and re-pointing it after a root
re-laid it out or ``nn.Module._apply`` swapped its local piece. The bucket does what concerns all of
its parameters at once (the flat buffers and their collectives).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ._dtensor import RaggedDTensor
from ._replaced import mark_replaced, rename_replaced
from ._tensor_parallel import TensorParallel

__all__ = ["ShardedParam", "local_grads"]


@dataclass(eq=False, kw_only=True)
class ShardedParam:
    """One managed parameter of a bucket (see the module docstring)."""

    fqn: str
    """The first name from the root (tied parameters: their first name)."""
    owners: list[tuple[nn.Module, str]]
    """Every ``(module, attribute)`` registering it."""
    index: int
    """Its position in the bucket's plan."""
    sharded: nn.Parameter
    """The ``RaggedDTensor`` parameter; its local piece is ``view`` (a slice of the bucket's segment)."""
    unsharded: nn.Parameter | None = None
    """While gathered: the global-shape view of the gathered buffer the modules compute with."""
    expected_ptr: int = field(default=0)
    """Where the local piece starts in memory (a moved piece is copied back: ``rebind``)."""
    tp: TensorParallel | None = None
    """A tensor-parallel parameter's TP mesh and placement ([Note: FSDP x TP]): the bucket holds its
    TP-local tensor, and the unsharded parameter is a torch ``DTensor`` on the TP mesh."""

    @classmethod
    def shard(cls, *, fqn: str, owners, index: int, param: torch.Tensor, full: torch.Tensor | None,
              view: torch.Tensor, spec: DTensorSpec, start: int, end: int, requires_grad: bool,
              tp: TensorParallel | None = None) -> ShardedParam:  # fmt: skip
        """A new sharded parameter viewing ``view`` (this rank's ``[start, end)`` of ``full``, copied
        in when given); the original ``param`` is marked replaced."""
        if full is not None:
            with torch.no_grad():
                view.copy_(full.detach().reshape(-1)[start:end])
        sp = nn.Parameter(RaggedDTensor._from_local_and_spec(view, spec), requires_grad=requires_grad)
        sp._local_tensor = view  # (Parameter() took a detached alias: keep the segment view itself)
        sp._fqn = fqn
        mark_replaced(param, fqn, replacement=sp)
        return cls(fqn=fqn, owners=owners, index=index, sharded=sp, expected_ptr=view.data_ptr(), tp=tp)

    @classmethod
    def adopted(cls, *, fqn: str, owners, index: int, param: RaggedDTensor, tp: TensorParallel | None = None) -> ShardedParam:
        """An earlier root's sharded parameter, kept as the same object: ``adopt`` re-lays it out once its
        piece moved into this bucket."""
        return cls(fqn=fqn, owners=owners, index=index, sharded=param, expected_ptr=param._local_tensor.data_ptr(), tp=tp)

    # ---- which one the modules show ---------------------------------------------------------------
    def to_sharded(self) -> None:
        for m, name in self.owners:
            m._parameters[name] = self.sharded

    def to_unsharded(self) -> None:
        if self.unsharded.requires_grad != self.sharded.requires_grad:  # frozen or unfrozen since the last gather
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        for m, name in self.owners:
            m._parameters[name] = self.unsharded

    def init_unsharded(self, view: torch.Tensor) -> None:
        """The unsharded parameter: a view of the gathered buffer (made once; the buffer's storage is
        freed and re-allocated in place, so the view stays valid). Tensor parallel: torch's ``DTensor`` of
        the TP mesh and placement over that view, as ``parallelize_module`` made it."""
        if self.tp is not None:
            tp = self.tp
            stride = torch.empty(tp.global_shape, device="meta").stride()
            view = DTensor.from_local(view, tp.mesh, [tp.placement], run_check=False, shape=tp.global_shape, stride=stride)
        self.unsharded = nn.Parameter(view, requires_grad=self.sharded.requires_grad)

    # ---- where its piece lives --------------------------------------------------------------------
    def adopt(self, view: torch.Tensor, spec: DTensorSpec) -> None:
        """View this bucket's segment with this plan's layout (the same object; its old gradient dropped)."""
        sp = self.sharded
        sp.grad = None
        sp._local_tensor = view
        sp._spec = spec
        sp._fqn = self.fqn
        rename_replaced(sp, self.fqn)
        self.expected_ptr = view.data_ptr()

    def rebind(self, view: torch.Tensor) -> None:
        """After ``nn.Module._apply`` (``model.to``, ``to_empty``) swapped the local piece: copy its values
        into the segment ``view`` and view it again. A dtype or device the bucket does not keep raises
        (the module was converted after sharding)."""
        sp = self.sharded
        new = sp._local_tensor
        if new.data_ptr() == self.expected_ptr and new.dtype == view.dtype == sp._spec.tensor_meta.dtype:
            return
        if new.dtype != view.dtype or (new.device != view.device and new.device.type != "meta"):
            raise ValueError(
                f"fully_shard: parameter {self.fqn!r} (shape {tuple(sp.shape)}) was converted to {new.dtype} on "
                f"{new.device} after sharding, but its bucket keeps {view.dtype} on {view.device} "
                "(module.to(dtype) / .double() / .to(device) after fully_shard). Convert or move the model before "
                "calling fully_shard, or compute in another dtype with "
                "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...))"
            )
        if new.numel() and new.device.type != "meta" and new.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(new.reshape(-1))
        sp._local_tensor = view

    def grad_view(self, view: torch.Tensor) -> RaggedDTensor:
        """Its gradient: ``view`` (of the gradient segment) with the parameter's layout."""
        spec = self.sharded._spec
        if spec.tensor_meta.dtype != view.dtype:  # (the segment has the parameter's dtype)
            raise AssertionError(
                f"fully_shard internal error: gradient segment {view.dtype} for {self.fqn} ({spec.tensor_meta.dtype})"
            )
        return RaggedDTensor._from_local_and_spec(view, spec)


def local_grads(params: list[ShardedParam], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The unsharded gradients ``grads`` of ``params`` as the bucket reduces them: tensors of the gathered
    views' shapes. A TP gradient is a ``DTensor``; one that is ``Partial(sum)`` where its parameter is
    ``Replicate()`` (a norm weight under sequence parallelism) is summed over TP first, as FSDP2 does,
    with one ``all_reduce`` per TP group for all such gradients of the bucket, not one per tensor;
    another placement mismatch is redistributed."""
    out = list(grads)
    partial: dict[int, tuple[Any, list[int]]] = {}
    for i, (sp, g) in enumerate(zip(params, grads)):
        if sp.tp is None or not isinstance(g, DTensor):
            continue
        if tuple(g.placements) == (sp.tp.placement,):
            out[i] = g.to_local()
        elif isinstance(sp.tp.placement, Replicate) and g.placements[0] == Partial("sum"):
            out[i] = g.to_local()
            partial.setdefault(id(sp.tp.mesh), (sp.tp.mesh, []))[1].append(i)
        else:
            out[i] = g.redistribute(g.device_mesh, [sp.tp.placement]).to_local()
    for mesh, idx in partial.values():
        flat = torch.cat([out[i].reshape(-1) for i in idx])
        dist.all_reduce(flat, group=mesh.get_group(0))
        out_views = flat.split([out[i].numel() for i in idx])
        for i, v in zip(idx, out_views):
            out[i] = v.view(out[i].shape)
    return out
