"""One bucket: a flat buffer (``DistributedBuffer``), its parameters, its collectives, its lifecycle.

A bucket is what one ``fully_shard`` call manages: the sharded parameters (views into this rank's
segment), the gathered buffer in the compute dtype with the unsharded parameters as views into it,
and the gradient reduction into the segment. The runtime (``_runtime.py``) decides *when*; this
file does *what* and keeps the state explicit.

[Note: bucket lifecycle]
Three enums, checked and moved at every entry point (an unexpected state is an internal error,
``AssertionError``, never a silent continue):

* ``TrainingState`` (per root): ``IDLE`` between iterations, ``FORWARD`` from the root's pre-forward
  to its post-forward, ``PRE_BACKWARD`` from the first pre-backward hook to the end of backward (a
  forward seen then is activation-checkpoint recomputation).
* ``BucketState`` (per bucket: where the values are)::

      SHARDED --unshard()--> GATHERING --wait_unshard()--> UNSHARDED --reshard()--> SHARDED
      GATHERING --reshard()--> SHARDED                      (waits for the gather first)
      UNSHARDED --post_backward(), synced--> REDUCING --wait_reduces()--> SHARDED
      REDUCING --unshard()--> (wait_reduces) SHARDED --> GATHERING
      any --release()--> RELEASED                           (absorbed by a newer root; final)

  The gathered buffer's storage exists only in GATHERING and UNSHARDED (it is resized to 0 in
  every other state); the modules show the unsharded parameters only while UNSHARDED and the
  module computes (between passes they show the sharded ones).
* ``BucketPhase`` (per bucket: where it is in the iteration)::

      IDLE --pre_forward (grad enabled)--> FORWARD --pre-backward hook--> BACKWARD
      BACKWARD --post_backward--> REDUCED --end of backward--> IDLE
      FORWARD|BACKWARD --end of backward--> (post_backward) REDUCED --> IDLE

  The end of backward (a callback queued on the autograd engine) runs ``post_backward`` for every
  bucket not yet REDUCED, in bucket order, so every rank issues the same reductions even for a
  bucket whose module did not run; then waits for all reductions and moves every bucket to
  SHARDED / IDLE. A grad-enabled forward whose backward never runs (an evaluation forward without
  ``no_grad``) leaves buckets in FORWARD and possibly UNSHARDED: the next root pre-forward frees
  them and gathers again ([Note: stale gathers] in ``_runtime.py``), and ``_PendingCall`` returns
  the dropped graph's pending count, so the next backward reduces each bucket as soon as it is done.

[Note: FP8 all-gather]
``fully_shard(..., fp8_all_gather=Float8AllGather(tile="128x128" | "1x128"))`` (opt-in; default off,
nothing changes without it). Eligible parameters (2-D, >= ``min_numel`` elements, decided on the
global shape) are planned with ``TensorSpec.align_rows`` = the tile height, so no quantization tile
crosses a rank boundary; in the forward pre-hook each rank quantizes its fp32 master pieces locally
(``float8_e4m3fn`` codes, one fp32 scale per tile), packs them with the bucket's other pieces (in
``param_dtype``) into one byte region, and the bucket moves in ONE collective (the byte regions,
gathered by a ``uint8`` ``DistributedBuffer``); on wait every rank dequantizes into the
``param_dtype`` gathered buffer. Invariant: the gathered parameters equal quantizing each full
tensor unsharded with the same tiles and dequantizing, bitwise, for every world size and plan
(see ``_float8.py``). Master weights, gradients, the reduce-scatter and checkpoints are unchanged.
Matrices that a forced even layout splits are cut on tile rows too (the split unit is coarsened
alike); a parameter whose shard would still cut a tile is sent in ``param_dtype`` (a pure check
of its placement, the same on every rank).

Internal API used outside the runtime (``_init`` and the ``checkpoint`` package):
``sharded`` (this rank's parameters, bucket order), ``plan``, ``rank``, ``settle()`` (finish any
pending reduction), ``gather_full()`` (the full flat buffer in the master dtype, on every rank),
``full_views(flat)`` and ``reshard()``.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.profiler import record_function

from ._buffer import CollectiveHandle, DistributedBuffer, zero_ranges
from ._context import CommContext, Streams, TrainingState
from ._float8 import Float8AllGather, Float8Gather, tile_aligned
from ._mixed_precision import MixedPrecisionPolicy
from ._dtensor import RaggedDTensor
from ._param import ShardedParam, local_grads
from .plan import BucketPlan, Placement, WireMode, choose_wire_mode

__all__ = ["BucketConfig", "BucketEntry", "BucketPhase", "BucketState", "run_post_accumulate_grad_hooks"]


@dataclass(frozen=True, kw_only=True)
class BucketConfig:
    """One bucket's settings as setup resolved them (its own ``fully_shard`` call's over the root's)."""

    group: dist.ProcessGroup | None
    device: torch.device
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool
    is_root: bool
    fp8_all_gather: Float8AllGather | None
    wire: str
    """``PlanConfig.wire``: how ragged segments travel (see [Note: wire format])."""
    replicate_group: dist.ProcessGroup | None = None
    num_replicas: int = 1
    param_spec: Callable[[Placement, torch.dtype], DTensorSpec] | None = None
    """A placement's ``DTensorSpec``: the sharded parameter's mesh and ``RaggedShard`` (set by setup)."""
    is_expert: bool = False
    """An expert-parallel root's bucket: its tensors' DTensor layouts span the world (global coordinates)."""


class BucketEntry(Protocol):
    """What a bucket reads of each managed parameter that setup found (``_setup._Entry``)."""

    fqn: str
    param: torch.Tensor
    owners: list[tuple[nn.Module, str]]
    dtype: torch.dtype
    requires_grad: bool
    full: torch.Tensor | None
    tp: Any
    """A tensor-parallel parameter's ``TensorParallel`` (``None`` otherwise)."""


class BucketState(enum.Enum):
    """Per bucket: where its values are (see [Note: bucket lifecycle])."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"
    REDUCING = "reducing"
    RELEASED = "released"


class BucketPhase(enum.Enum):
    """Per bucket: where it is in the iteration (see [Note: bucket lifecycle])."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    REDUCED = "reduced"


def _invariant(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"fully_shard internal error: {what}")


class _Bucket:
    """One flat buffer: sharded parameters (views into the segment), the gathered buffer and the
    unsharded parameters (views into it), and the gradient reduction."""

    def __init__(
        self,
        *,
        index: int,
        plan: BucketPlan,
        entries: list[BucketEntry],
        config: BucketConfig,
        ctx: CommContext,
        lazy: bool = False,
    ) -> None:
        self.index = index
        self.plan = plan
        self.ctx = ctx
        self.is_root = config.is_root
        self.is_expert = config.is_expert
        mp = config.mp_policy
        master = entries[0].dtype
        self.param_dtype = mp.param_dtype or master
        self.reduce_dtype = mp.reduce_dtype or master
        self.reshard_after_forward = config.reshard_after_forward
        self.unshard_in_backward = True  # ShardedModule.set_unshard_in_backward (embeddings only)
        self.requires_sync = True
        self.grad_premul: float | None = None  # set_gradient_divide_factor: multiplies the gradients before the averaging
        fp8 = config.fp8_all_gather
        # Meta-built and nothing to move in: the segment has no memory until the bucket is first used, so provisional plans of inner calls cost no memory (see [Note: meta-device
        # initialization]). FP8 buckets are allocated at once (their byte buffers are made here).
        self._lazy = lazy and fp8 is None
        backend = str(dist.get_backend(config.group)) if dist.is_available() and dist.is_initialized() else None
        wire = choose_wire_mode(plan.segment_sizes, element_size=self.param_dtype.itemsize, wire=config.wire, backend=backend)
        self.buffer = DistributedBuffer(
            plan, group=config.group, device=config.device, dtype=master, allocate=not self._lazy, wire=wire
        )
        self.rank = self.buffer.rank
        # HSDP: the replicas of this rank's segment (see [Note: HSDP]).
        self.num_replicas = config.num_replicas
        self.replicate_group = config.replicate_group if config.num_replicas > 1 else None
        self._native_avg = self.replicate_group is not None and "nccl" in str(dist.get_backend(self.replicate_group))
        self.params: list[ShardedParam] = self._shard_entries(entries, config)
        self.sharded: list[nn.Parameter] = [sp.sharded for sp in self.params]
        """The sharded parameters (``RaggedDTensor`` s viewing the segment), in plan order."""
        if self._lazy:
            self.buffer.drop_segment()
        # Gathered buffer (compute dtype) and unsharded parameters: views into its ``.data``, so the
        # collective's writes do not bump the version counter autograd saved for backward. Both are
        # made at the first gather (setup never allocates a bucket at full size); afterwards the
        # storage is freed (resized to 0) and re-allocated in place, so the views stay valid.
        self.gathered: torch.Tensor | None = None
        self.unsharded: list[nn.Parameter] | None = None
        """The unsharded parameters (views of the gathered buffer), once gathered."""
        self._gathered_nbytes = self.buffer.total_numel * self.param_dtype.itemsize
        self._device = config.device
        # FP8 all-gather (opt-in): which parameters travel as codes + scales (see [Note: FP8 all-gather]).
        self.fp8_gather: Float8Gather | None = None
        if fp8 is not None:
            flags = [fp8.eligible(pl.shape) and tile_aligned(pl, fp8.tile_shape[0]) for pl in plan.placements]
            if any(flags):
                self.fp8_gather = Float8Gather(
                    plan=plan, fp8=flags, config=fp8, param_dtype=self.param_dtype, group=config.group,
                    device=config.device, even=self.buffer.is_even,
                )
        self._range_name = f"{index}:{plan.name}"
        # Lifecycle (see [Note: bucket lifecycle]).
        self.where = BucketState.SHARDED
        self.phase = BucketPhase.IDLE
        self.gather_handle: CollectiveHandle | None = None
        self.reduce_handle: CollectiveHandle | None = None
        self.flat_grad: torch.Tensor | None = None  # unsharded gradients, flat, in reduce_dtype
        self.flat_views: list[torch.Tensor] | None = None
        self.grad_seg: torch.Tensor | None = None  # the segment a pending reduction writes
        self.replica_work: dist.Work | None = None  # HSDP: the pending all-reduce across replicas
        self._replica_out: tuple[torch.Tensor, bool] | None = None  # (reduced shard, add it to grad_seg)
        self._grad_seg_ref: weakref.ref | None = None  # see [Note: gradient segment lifetime]
        self.used = False  # ran forward in this iteration
        self.explicit_unshard = False  # gathered by ShardedModule.unshard(), not by a forward
        self.gathered_at_step = -1  # the runtime's optimizer step count when the last gather was issued
        self.num_pending_calls = 0
        self.awaiting_backward: set[int] = set()
        """A group's modules called with grad whose backward has not begun ([Note: module groups])."""
        self._arrived: list[bool] | None = None  # which parameters got a gradient since the last reduction
        self._reduced_arrived: list[bool] | None = None  # the same, for the reduction in flight
        self._show_sharded()

    def __repr__(self) -> str:
        return f"_Bucket({self.plan.name!r}, {self.where.value}, {self.phase.value})"

    def _shard_entries(self, entries: list[BucketEntry], config: BucketConfig) -> list[ShardedParam]:
        """One ``ShardedParam`` per entry: this rank's piece as a sharded parameter viewing the segment
        (the entries' full tensors dropped, the originals marked replaced). A parameter an absorbed root
        sharded keeps its object: it is re-laid out (``adopt_moved``) once its piece moved here."""
        params = []
        self._to_adopt: list[tuple[ShardedParam, torch.Tensor, DTensorSpec]] = []
        for i, (e, pl, view) in enumerate(zip(entries, self.plan.placements, self.buffer.local_views())):
            spec = config.param_spec(pl, self.buffer.dtype)
            if isinstance(e.param, RaggedDTensor):
                sp = ShardedParam.adopted(fqn=e.fqn, owners=e.owners, index=i, param=e.param, tp=e.tp)
                self._to_adopt.append((sp, view, spec))
            else:
                a, b = pl.shard.range(self.rank)
                sp = ShardedParam.shard(
                    fqn=e.fqn, owners=e.owners, index=i, param=e.param, full=e.full, view=view, spec=spec,
                    start=a, end=b, requires_grad=e.requires_grad, tp=e.tp,
                )  # fmt: skip
            e.full = None
            e.param = sp.sharded  # drop the original (full) tensor: it is not kept alive by the runtime
            params.append(sp)
        return params

    def grad_view(self, i: int, view: torch.Tensor) -> RaggedDTensor:
        """Parameter ``i``'s gradient: its flat view of the gradient segment, with the parameter's layout."""
        return self.params[i].grad_view(view)

    def adopt_moved(self) -> None:
        """Point the parameters of absorbed roots at this bucket's segment and layout, once their pieces
        moved here: the same objects (whoever holds them sees the new layout), their old gradients dropped."""
        for sp, view, spec in self._to_adopt:
            sp.adopt(view, spec)
        self._to_adopt = []

    @property
    def trainable_local(self) -> list[int]:
        """Indices of the parameters that take gradients now: ``requires_grad`` of the sharded
        parameters is read at every use, so freezing or unfreezing after ``fully_shard`` works."""
        return [i for i, sp in enumerate(self.sharded) if sp.requires_grad]

    @property
    def num_trainable(self) -> int:
        return sum(1 for sp in self.sharded if sp.requires_grad)

    @property
    def is_gathered(self) -> bool:
        """The gathered buffer holds (or is receiving) the parameters."""
        return self.where in (BucketState.GATHERING, BucketState.UNSHARDED)

    def release(self) -> None:
        """Drop this (absorbed) bucket's storage. Its parameters now view the absorbing buckets' segments
        (``adopt_moved``) and its modules hold them (it was resharded at the start of the new root's
        build), so nothing is re-registered."""
        if self.where is BucketState.RELEASED:
            return
        if self.where is BucketState.REDUCING:
            self.wait_reduces()
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None
        self.buffer = self.gathered = self.flat_grad = self.flat_views = self.grad_seg = self.fp8_gather = None
        self.params, self.sharded, self.unsharded = [], [], []
        self.where = BucketState.RELEASED

    # ---- internal API for _init and checkpoint/ ---------------------------------------------------
    def settle(self) -> None:
        """Make the sharded values readable and writable: allocate a lazy (meta-built) segment and
        finish a pending gradient reduction (its ``.grad`` views are set). Local, idempotent."""
        self.materialize()
        self.rebind()  # values assigned with ``p.data = ...`` since the last forward
        if self.where is BucketState.REDUCING:
            self.wait_reduces()

    @property
    def is_materialized(self) -> bool:
        return not self._lazy

    def materialize(self) -> None:
        """Allocate a lazy bucket's segment (zeros) in place: the sharded parameters are views of it,
        so they (and any optimizer holding them) see it without being replaced."""
        if not self._lazy or self.where is BucketState.RELEASED:
            return
        self.buffer.allocate_segment()
        for sp in self.params:  # the storage moved
            sp.expected_ptr = sp.sharded._local_tensor.data_ptr()
        self._lazy = False

    def gather_full(self) -> torch.Tensor:
        """The bucket's full flat buffer in the master dtype on every rank (a collective)."""
        _invariant(self.where is not BucketState.RELEASED, f"gather of released bucket {self.plan.name}")
        self.settle()
        return self.buffer.all_gather()

    def full_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Global-shape views of ``flat`` (a full flat buffer of this bucket), one per parameter."""
        return self.buffer.full_views(flat)

    # ---- parameters -------------------------------------------------------------------------
    def _show_sharded(self) -> None:
        for sp in self.params:
            sp.to_sharded()

    def _show_unsharded(self) -> None:
        for sp in self.params:
            sp.to_unsharded()

    def _free_gathered(self) -> None:
        if self.gathered is not None:
            self.gathered.untyped_storage().resize_(0)

    @torch._dynamo.disable  # runs eagerly even inside a compiled module's hooks (it makes Parameters)
    def _alloc_gathered(self) -> None:
        if self.gathered is None:
            # Never an inference tensor, even when the first forward runs under inference_mode: the
            # buffer is kept and later training forwards write into it.
            with torch.inference_mode(False):
                self.gathered = torch.empty(self.buffer.total_numel, dtype=self.param_dtype, device=self._device)
                for sp, view in zip(self.params, self.buffer.full_views(self.gathered.data)):
                    sp.init_unsharded(view)
                self.unsharded = [sp.unsharded for sp in self.params]
        elif self.gathered.untyped_storage().nbytes() == 0:
            self.gathered.untyped_storage().resize_(self._gathered_nbytes)

    def rebind(self) -> None:
        """Re-point sharded parameters whose local piece ``nn.Module._apply`` swapped (``module.to_empty``
        / ``.to``; ``ShardedParam.rebind``), or materialize a lazy bucket (``to_empty`` gave uninitialized
        memory: the zeros stand for it)."""
        if self._lazy:
            self.materialize()
            return
        if all(sp.sharded._local_tensor.data_ptr() == sp.expected_ptr for sp in self.params):
            if all(sp.sharded._spec.tensor_meta.dtype == self.buffer.dtype for sp in self.params):
                return
        for sp, view in zip(self.params, self.buffer.local_views()):
            sp.rebind(view)

    # ---- gather / free ---------------------------------------------------------------------
    def unshard(self) -> None:
        """SHARDED (or REDUCING, after waiting) -> GATHERING: issue the all-gather (async). No-op
        when already gathering or gathered."""
        _invariant(self.where is not BucketState.RELEASED, f"unshard of released bucket {self.plan.name}")
        if self.is_gathered:
            return
        self.settle()
        self.ctx.check_collective(self.plan.name, "all_gather")
        self._alloc_gathered()
        self.gathered_at_step = self.ctx.num_optimizer_steps
        seg = self.buffer.segment
        streams = self.ctx.streams
        with streams.on(streams.all_gather), record_function(f"fsdp_optim::all_gather({self._range_name})"):
            if self.fp8_gather is not None:
                inner = self.fp8_gather.buffer.all_gather(src=self.fp8_gather.pack(seg), async_op=True)
                self.gather_handle = _Float8Handle(self.fp8_gather, inner, self.gathered, self.buffer.full_padding)
            else:
                src = seg if seg.dtype == self.param_dtype else seg.to(self.param_dtype)
                self.gather_handle = self.buffer.all_gather(src=src, out=self.gathered, async_op=True)
        self.where = BucketState.GATHERING

    def _finish_gather(self) -> None:
        if self.where is BucketState.GATHERING:
            streams = self.ctx.streams
            with streams.on(streams.all_gather), record_function(f"fsdp_optim::all_gather_wait({self._range_name})"):
                self.gather_handle.wait()
            streams.compute_waits_for(streams.all_gather)
            self.gather_handle = None
            self.where = BucketState.UNSHARDED

    def wait_unshard(self) -> None:
        """GATHERING -> UNSHARDED; the modules now show the unsharded parameters."""
        self._finish_gather()
        _invariant(self.where is BucketState.UNSHARDED, f"{self!r}: wait_unshard without unshard")
        self._show_unsharded()

    def reshard(self) -> None:
        """GATHERING / UNSHARDED -> SHARDED: free the gathered buffer; the modules show the sharded
        parameters. (REDUCING and SHARDED stay as they are.)"""
        self._finish_gather()
        if self.where is BucketState.RELEASED:
            return
        self._show_sharded()
        self.explicit_unshard = False
        if self.where is BucketState.UNSHARDED:
            self._free_gathered()
            self.where = BucketState.SHARDED

    # ---- forward ----------------------------------------------------------------------------
    def pre_forward(self) -> None:
        ctx = self.ctx
        if ctx.state is TrainingState.PRE_BACKWARD:  # recomputation (activation checkpointing)
            self.unshard()
            self.wait_unshard()
            return
        self.used = True
        if torch.is_grad_enabled():
            self.phase = BucketPhase.FORWARD
        ctx.forward_order.append(self)
        self.unshard()
        nxt = ctx.next_in_forward(self)
        if nxt is not None:
            nxt.unshard()  # prefetch: issued before this bucket computes
        self.wait_unshard()

    def post_forward(self) -> None:
        ctx = self.ctx
        if ctx.state is TrainingState.PRE_BACKWARD:
            return
        ctx.post_forward_order.append(self)
        if self.reshard_after_forward:
            self.reshard()
        else:
            self._show_sharded()  # the module shows its sharded parameters between passes

    # ---- backward ---------------------------------------------------------------------------
    def pre_backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        ctx.queue_final_callback()
        if self.phase is BucketPhase.BACKWARD:
            return grad
        # IDLE, or REDUCED: the module's backward runs again after its gradients were reduced (a
        # module called k times whose calls the count no longer covers: ``retain_graph`` or two
        # forwards before their backwards). Gather again; what comes is reduced and added.
        self.phase = BucketPhase.BACKWARD
        ctx.state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:  # (False: an embedding's backward reads no weight)
            self.unshard()
        nxt = ctx.next_in_backward(self)
        if nxt is not None and nxt.unshard_in_backward:
            nxt.unshard()  # prefetch the bucket whose backward runs next
        if self.unshard_in_backward:
            self.wait_unshard()
        return grad

    def _ensure_flat_grad(self) -> None:
        if self.flat_grad is None:
            self.flat_grad = torch.zeros(self.buffer.total_numel, dtype=self.reduce_dtype, device=self.buffer.device)
            self.flat_views = self.buffer.full_views(self.flat_grad)

    def _copy_in_grads(self, *, accumulate: bool) -> None:
        """Move the unsharded gradients into the flat reduction buffer with one ``_foreach_copy_``
        (casting under mixed precision), or one ``_foreach_add_`` onto the sum of earlier
        micro-batches (``accumulate``, no sync), then drop them. No per-parameter Python op.

        Why not let autograd accumulate straight into views of the flat buffer (no copy): the buffer
        must then exist before the bucket's backward starts, and it adds a whole bucket of gradients
        to the peak of that backward, whose temporaries (activation gradients) are largest early,
        when few parameter gradients exist. ``benchmarks/step_memory.py`` measured the peak at 1.03x
        (W=2) and 1.05x (W=4) FSDP2's with the views, 0.99x and 1.00x with this copy (fp32)."""
        dst, src, params = [], [], []
        if self._arrived is None:
            self._arrived = [False] * len(self.sharded)
        for i, up in enumerate(self.unsharded or ()):
            g = up.grad
            if g is None:
                continue
            self._arrived[i] = True
            dst.append(self.flat_views[i])
            src.append(g)
            params.append(self.params[i])
            up.grad = None
        with torch.no_grad(), record_function(f"fsdp_optim::copy_in({self._range_name})"):
            src = local_grads(params, src)  # (tensor parallel: DTensor gradients to TP-local tensors)
            if dst:
                (torch._foreach_add_ if accumulate else torch._foreach_copy_)(dst, src)

    def post_backward(self) -> None:
        """Reduce-scatter this bucket's gradients (or accumulate them without sync) and reshard:
        phase -> REDUCED; UNSHARDED -> REDUCING (synced) or SHARDED."""
        _invariant(self.phase is not BucketPhase.REDUCED, f"{self!r}: post_backward twice in one backward")
        self.phase = BucketPhase.REDUCED
        if self.num_trainable == 0:
            self.reshard()
            return
        # Free the gathered parameters before the flat buffer is made: the copy-in reads only the
        # gradients, so the two buffers are never alive together.
        self.reshard()
        fresh = self.flat_grad is None  # else it holds earlier micro-batches' sum (no sync)
        if fresh and self.requires_sync and self._owner_chunks():
            self._reduce_by_owner()
            return
        self._ensure_flat_grad()
        flat = self.flat_grad
        self._copy_in_grads(accumulate=not fresh)
        if not self.requires_sync:
            return  # keep summing into flat_grad (gradient accumulation without sync)
        self.flat_grad = self.flat_views = None
        if self.grad_premul is not None:
            flat.mul_(self.grad_premul)
        self._reduced_arrived, self._arrived = self._arrived, None
        self.settle()  # a second synced backward before the previous reduction was waited for
        self.ctx.check_collective(self.plan.name, "reduce_scatter")
        accumulate = self._prepare_grad_segment()
        out = self.grad_seg
        if self.replicate_group is not None and (accumulate or self.reduce_dtype != self.buffer.dtype):
            # The replicas all-reduce only this backward's reduced shard, in reduce_dtype; it is added
            # to (or cast into) the gradient segment afterwards.
            out = torch.empty(self.buffer.segment_numel, dtype=self.reduce_dtype, device=self.buffer.device)
        streams = self.ctx.streams
        streams.record(flat, streams.reduce_scatter)  # made on the compute stream, read there ([Note: streams])
        if out is not self.grad_seg:
            streams.record(out, streams.reduce_scatter)
        with streams.on(streams.reduce_scatter), record_function(f"fsdp_optim::reduce_scatter({self._range_name})"):
            self.reduce_handle = self.buffer.reduce_scatter(
                flat, out=out, op=dist.ReduceOp.AVG, accumulate=accumulate and out is self.grad_seg, async_op=True,
                consume=True,
            )
        self._replica_out = (out, accumulate) if self.replicate_group is not None else None
        self.where = BucketState.REDUCING
        self.ctx.issue_reduce(self)

    def _owner_chunks(self) -> bool:
        """Whether this synced, fresh reduction goes one owner segment at a time
        ([Note: per-owner reduction under mixed precision] in ``_buffer.py``): the gradients are in
        another dtype than the reduction's (the cast needs a new buffer anyway), there are no replicas
        (HSDP keeps the flat buffer) and more than one rank. On NCCL only where the bucket moves per
        owner anyway (a ragged bucket on the ``grouped`` wire): an even or padded bucket keeps its one
        reduce-scatter, since W reduces would cost W latencies per bucket at scale."""
        if self.replicate_group is not None or self.buffer.world_size < 2 or self.buffer.backend is None:
            return False
        if "nccl" in self.buffer.backend and (self.buffer.is_even or self.buffer.wire is not WireMode.GROUPED):
            return False
        return any(up.grad is not None and up.grad.dtype != self.reduce_dtype for up in self.unsharded or ())

    def _reduce_by_owner(self) -> None:
        """``post_backward``'s synced path without the flat buffer: each owner's segment is cast into
        ``reduce_dtype`` and reduced on its own, and each unsharded gradient is dropped once cast."""
        if self._arrived is None:
            self._arrived = [False] * len(self.sharded)
        grads: list[torch.Tensor | None] = []
        for i, up in enumerate(self.unsharded or ()):
            g = up.grad
            if g is not None:
                self._arrived[i] = True
                up.grad = None
            grads.append(g)
            del g
        arrived = [i for i, g in enumerate(grads) if g is not None]
        for i, g in zip(arrived, local_grads([self.params[i] for i in arrived], [grads[i] for i in arrived])):
            grads[i] = g if g.is_contiguous() else g.contiguous()  # read per owner through a flat view: one copy
        self._reduced_arrived, self._arrived = self._arrived, None
        self.settle()  # a second synced backward before the previous reduction was waited for
        self.ctx.check_collective(self.plan.name, "reduce_scatter")
        accumulate = self._prepare_grad_segment()
        out = self.grad_seg
        streams = self.ctx.streams
        with record_function(f"fsdp_optim::reduce_scatter({self._range_name})"):
            self.reduce_handle = self.buffer.reduce_scatter_owners(
                grads, dtype=self.reduce_dtype, out=out, op=dist.ReduceOp.AVG, scale=self.grad_premul,
                accumulate=accumulate, streams=streams,
            )
        self._replica_out = None
        self.where = BucketState.REDUCING
        self.ctx.issue_reduce(self)

    def _prepare_grad_segment(self) -> bool:
        """Choose the gradient segment the reduction writes; returns whether it adds to it.

        [Note: gradient segment lifetime]
        The runtime keeps only a weak reference to the gradient segment once the sharded ``.grad``
        views are set, so ``zero_grad(set_to_none=True)`` frees it, as it frees gradients in plain
        PyTorch. If every parameter's ``.grad`` is still our view (``set_to_none=False``, or no
        ``zero_grad``), the reduction adds into that segment, as autograd accumulates in place; if
        all are ``None`` a new segment is allocated and overwritten. Otherwise (some set to ``None``
        or replaced, e.g. two optimizers zeroing at different times) a new zeroed segment takes a
        copy of the gradients still held: a view the user may still hold after setting its ``.grad``
        to ``None`` keeps its values, as a dropped gradient does in plain PyTorch."""
        seg = self._grad_seg_ref() if self._grad_seg_ref is not None else None
        trainable = self.trainable_local  # (read once: a property over every parameter)
        grads = [self.sharded[i].grad for i in trainable]
        if all(g is None for g in grads):
            self.grad_seg = torch.empty(self.buffer.segment_numel, dtype=self.buffer.dtype, device=self.buffer.device)
            return False
        views = self.buffer.local_views(seg) if seg is not None else None
        if views is None or not all(
            views[i].numel() == 0 or (g is not None and _same_view(g, views[i])) for i, g in zip(trainable, grads)
        ):
            seg = torch.zeros(self.buffer.segment_numel, dtype=self.buffer.dtype, device=self.buffer.device)
            views = self.buffer.local_views(seg)
        with torch.no_grad():
            for i, g in zip(trainable, grads):
                view = views[i]
                if view.numel() == 0 or (g is not None and _same_view(g, view)):
                    continue
                if g is None:
                    view.zero_()
                else:
                    view.copy_((g._local_tensor if isinstance(g, RaggedDTensor) else g).reshape(-1))
        self.grad_seg = seg
        return True

    def start_replica_reduce(self) -> None:
        """HSDP: once the reduce-scatter is done, issue the all-reduce of the reduced shard across the
        replicas (async; no-op without replicas, or when already issued or done)."""
        if self.reduce_handle is None or self._replica_out is None or self.replica_work is not None:
            return
        streams = self.ctx.streams
        with streams.on(streams.reduce_scatter):  # the reduce-scatter stream waits for it, not compute
            self.reduce_handle.wait()
        out = self._replica_out[0]
        if out.numel() == 0:  # every replica of this shard rank holds the same (empty) segment
            self.replica_work = _DONE
            return
        op = dist.ReduceOp.AVG if self._native_avg else dist.ReduceOp.SUM
        streams.waits(streams.all_reduce, streams.reduce_scatter)
        streams.record(out, streams.all_reduce)
        with streams.on(streams.all_reduce), record_function(f"fsdp_optim::all_reduce({self._range_name})"):
            self.replica_work = dist.all_reduce(out, op=op, group=self.replicate_group, async_op=True)

    def wait_reduces(self, *, sync_compute: bool = True) -> None:
        """REDUCING -> SHARDED: the sharded parameters' ``.grad`` are views into the reduced segment.
        ``sync_compute=False``: the compute stream does not wait yet (the runtime makes it wait once
        at the end of backward; see [Note: streams])."""
        if self.where is not BucketState.REDUCING:
            return
        streams = self.ctx.streams
        last = streams.all_reduce if self._replica_out is not None else streams.reduce_scatter
        with streams.on(streams.reduce_scatter), record_function(f"fsdp_optim::reduce_wait({self._range_name})"):
            self.reduce_handle.wait()
        with streams.on(last):
            if self._replica_out is not None:
                self.start_replica_reduce()
                self.replica_work.wait()
                out, accumulate = self._replica_out
                if not self._native_avg and out.numel():
                    out.div_(self.num_replicas)
                if out is not self.grad_seg:
                    if accumulate:
                        self.grad_seg.add_(out)
                    else:
                        self.grad_seg.copy_(out)
                self.replica_work = self._replica_out = None
        self.reduce_handle = None
        seg, self.grad_seg = self.grad_seg, None
        views = self.buffer.local_views(seg)
        arrived, self._reduced_arrived = self._reduced_arrived, None
        received, trainable = [], self.trainable_local
        has_grad = []  # per trainable parameter: whether this rank has a gradient for it
        for i in trainable:
            sp = self.sharded[i]
            got = arrived is not None and arrived[i]
            has_grad.append(sp.grad is not None or got)
            if sp.grad is None and not got:
                # No gradient on this rank: settled at the end of backward ([Note: unused parameters]).
                self.ctx.unarrived.append((self, i, views[i]))
                continue
            if sp.grad is None or not _same_view(sp.grad, views[i]):
                sp.grad = self.grad_view(i, views[i])
            if got:
                received.append(sp)
        self.ctx.arrivals.append((self, trainable, has_grad))
        self._grad_seg_ref = weakref.ref(seg)
        self.where = BucketState.SHARDED
        if sync_compute:
            streams.compute_waits_for(last)
        run_post_accumulate_grad_hooks(received, streams, last)

    @property
    def has_unreduced_grads(self) -> bool:
        """Gradients accumulated on the gathered parameters and not reduced yet."""
        return any(up.grad is not None for up in self.unsharded or ())

    def abandon_backward(self) -> None:
        """The last backward raised before its end: drop the gradients it left on the gathered
        parameters and a reduction still in flight (neither reached ``.grad`` before the user's
        ``zero_grad``, which must not be undone now), then reshard."""
        if self.where is BucketState.REDUCING:
            streams = self.ctx.streams
            with streams.on(streams.reduce_scatter):
                self.reduce_handle.cancel()
                if self.replica_work is not None:
                    self.replica_work.wait()
            streams.compute_waits_for(streams.all_reduce)
            streams.compute_waits_for(streams.reduce_scatter)
            self.reduce_handle = self.replica_work = self._replica_out = self.grad_seg = None
            self._reduced_arrived = None
            self.where = BucketState.SHARDED
        for up in self.unsharded or ():
            up.grad = None
        self.reshard()
        self.phase = BucketPhase.IDLE
        self.num_pending_calls = 0
        self.awaiting_backward = set()

    def backward_finished(self) -> None:
        """The end-of-backward callback, after every reduction was waited for: -> SHARDED / IDLE."""
        self.reshard()
        _invariant(self.where is BucketState.SHARDED, f"{self!r} at the end of backward")
        self.phase = BucketPhase.IDLE
        self.num_pending_calls = 0
        self.awaiting_backward = set()


class _Float8Handle:
    """A pending FP8 all-gather: ``wait()`` waits for the byte collective, then dequantizes every
    rank's region into the compute-dtype gathered buffer (padding zeroed) and returns it."""

    def __init__(self, fp8: Float8Gather, inner: CollectiveHandle, out: torch.Tensor, padding) -> None:
        self._fp8, self._inner, self._out, self._padding = fp8, inner, out, padding
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            recv = self._inner.wait()
            self._fp8.unpack(recv, self._out)
            zero_ranges(self._out, self._padding)
            self._done, self._inner = True, None
        return self._out

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()


class _Done:
    """A completed ``dist.Work`` stand-in (a collective every peer skips too)."""

    def wait(self) -> bool:
        return True


_DONE = _Done()


def run_post_accumulate_grad_hooks(params: list[nn.Parameter], streams: Streams, last) -> None:
    """Run the hooks registered with ``register_post_accumulate_grad_hook`` on sharded parameters
    whose ``.grad`` was just set (as FSDP2 does: e.g. an optimizer step inside backward). The compute
    stream first waits for the reduction, since the hooks run there."""
    hooked = [p for p in params if getattr(p, "_post_accumulate_grad_hooks", None)]
    if not hooked:
        return
    streams.compute_waits_for(last)
    for p in hooked:
        for hook in list(p._post_accumulate_grad_hooks.values()):
            hook(p)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` (a gradient: a RaggedDTensor) views exactly ``b`` (a flat view of the gradient segment)."""
    if isinstance(a, RaggedDTensor):
        a = a._local_tensor
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
