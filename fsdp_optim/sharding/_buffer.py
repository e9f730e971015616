"""DistributedBuffer: one flat buffer per bucket, moved by one collective per direction.

A bucket (see ``BucketPlan``) lives in one *global* flat buffer of ``plan.total_numel``
elements; rank ``r`` persistently stores only its segment
``[plan.rank_bounds[r], plan.rank_bounds[r + 1])``. Local parameter and gradient shards are
views into the segment (zero copy), so an optimizer step on the shards writes the segment.

API (stable; the ``fully_shard`` runtime builds on it)::

    buf = DistributedBuffer(plan, group=None, device=None, dtype=torch.float32, uneven_gather="auto",
                            wire=WireMode.GROUPED)
    buf.segment                       # this rank's flat parameter segment (persistent, zeros at start)
    buf.grad_segment                  # flat gradient segment, None until alloc_grad_segment()
    buf.alloc_grad_segment()          # allocate (zeros) if needed and return it
    buf.free_grad_segment()           # drop it (zero_grad(set_to_none=True))
    buf.local_views(flat=None)        # per placement: this rank's flat piece, a view into flat (default segment)
    buf.full_views(full)              # per placement: a global-shape view into a gathered full buffer
    buf.new_full(dtype=None)          # zeros of total_numel (padding zero) for gathers / reductions
    buf.all_gather(src=None, out=None, async_op=False) -> Tensor | CollectiveHandle
    buf.reduce_scatter(full_grad, out=None, op=SUM, accumulate=False, async_op=False, consume=False)
        -> Tensor | CollectiveHandle

``all_gather`` sends ``src`` (default: the segment; pass e.g. ``segment.to(torch.bfloat16)`` for a
bf16 gather of an fp32 master) and returns the full flat buffer ``out`` (default: ``new_full`` in
``src``'s dtype). ``reduce_scatter`` reduces ``full_grad`` (flat, ``total_numel``) and writes this
rank's range into ``out`` (default: the gradient segment). The communication dtype is the input's;
when ``out`` has another dtype the result is cast into it after the collective (bf16 gather into
an fp32 buffer; an fp32 reduction into a bf16 gradient segment). With ``async_op=True`` both
return a ``CollectiveHandle`` whose ``wait()`` returns the output tensor (idempotent), so the
runtime can issue the next bucket's gather before using this one.

[Note: one collective per bucket per direction]
Segments of equal size (every EVEN bucket, and a RAGGED one that happens to be even) move with
``all_gather_single`` / ``reduce_scatter_single`` (the former ``all_gather_into_tensor`` /
``reduce_scatter_tensor``). Uneven segments:

- reduce-scatter: on gloo the list-form ``dist.reduce_scatter`` with uneven inputs; on NCCL one
  ``dist.reduce`` per non-empty segment to its owner (NCCL runs the list form as W reduces, empty
  ones included: at W = 1024 a Muon layer bucket has about 9 owners).
- all-gather (every backend): one group of per-owner ``dist.broadcast`` (only ranks whose segment is
  non-empty; each owner broadcasts straight from its slice of ``out``, every other rank receives
  into its slice: zero extra memory). gloo refuses an uneven list ``all_gather``, and NCCL runs it
  as W broadcasts, zero-size ones included. (The NCCL paths are written from these semantics; no
  GPU has run them yet.) ``PlanConfig.wire`` can move a ragged bucket padded instead ([Note: wire
  format] in ``_wire.py``).
  The alternative, ``all_to_all_single`` with split sizes, needs each rank to send its segment W
  times (a W x segment staging copy) and was 2.7-6x slower than the broadcast group in
  ``benchmarks/collectives.py`` (gloo, 8M float32, W = 2 and 4, medians; results in
  ``benchmarks/results/collectives.json``). Against the even forms on an even split of the same
  bytes: broadcast group 0.25-0.35x the time of ``all_gather_single``, ``all_to_all_single``
  0.74-1.19x, list ``reduce_scatter`` 0.41-0.87x of ``reduce_scatter_single`` (one empty rank and
  one at 3x the mean, or +-20%; a run at a higher machine load gave 0.18-0.23x, 0.66-1.10x and
  0.21-0.53x).
  So on gloo the uneven forms cost nothing; on NCCL (not measured here) the ring tensor forms
  are expected to be the fast path, which the planner's cost model weighs against padding.

[Note: even reduce-scatter on gloo]
gloo has no reduce-scatter of its own: ``reduce_scatter_single`` clones the whole input, all-reduces
the clone and copies this rank's chunk out (the clone shows as ``aten::clone`` under
``c10d::_reduce_scatter_base_`` in a profiler trace). When the caller gives the flat gradient up
(``reduce_scatter(..., consume=True)``, as the runtime does), an even bucket on gloo (CPU) is instead
all-reduced in place and this rank's range copied out: the same sums, so the same bits (checked
against ``reduce_scatter_single`` at W = 2..4 in ``tests/sharding/test_buffer.py``), without a
transient copy of the full bucket (24 MiB for the root bucket of ``benchmarks/step_memory.py``) and
in about half the time (five reductions of 2M float32 at W = 2: ``all_reduce`` 0.09 s,
``reduce_scatter_single`` 0.17 s). NCCL reduce-scatters natively and is not affected.

[Note: per-owner reduction under mixed precision]
When the gradients are in another dtype than the reduction (bf16 compute, fp32 reduce), the runtime
does not build the whole bucket in ``reduce_dtype`` before one collective: ``reduce_scatter_owners``
casts one owner's segment at a time into a ``reduce_dtype`` chunk, reduces it to its owner with one
``dist.reduce``, waits and drops it, and drops each unsharded gradient once its last piece is cast.
The transient is the bf16 gradients plus one segment in fp32 instead of the bf16 gradients plus a
full fp32 copy: in the recipe's setting of ``benchmarks/step_memory.py --recipe`` (root bucket:
embedding and head, 24 MiB in fp32) it removes the 24 MiB buffer from the peak at the end of backward
(live bytes 81.0 -> 76.0 MiB at W=4, 58.5 -> 56.8 at W=8; the peak is now at the loss, where both
runtimes hold the root's gathered parameters and the fp32 logits' temporaries). The cost: one
collective per non-empty segment instead of one per bucket, waited for in turn (the runtime waits for
each non-HSDP reduction as it is issued anyway, see ``CommContext.issue_reduce``), and the wire mode
does not apply. Sums: at W <= 2 the same bits (an addition of two is commutative); at W >= 3 gloo's
``reduce`` may add in another order than its all-reduce / reduce-scatter (close to fp32 rounding;
``tests/sharding/test_bucket.py`` compares both paths). Not used for HSDP, at W = 1, without a
process group, or when micro-batches were summed without sync (the flat buffer already exists); on
NCCL only for ragged buckets on the ``grouped`` wire (already one collective per owner): an even or
padded bucket keeps its one reduce-scatter (W reduces would cost W latencies per bucket at scale).

[Note: padding]
Padding elements of a bucket (between tensors of an EVEN bucket) are zero in whatever this
module returns: ``new_full`` and the segments start as zeros, and after every collective the
padding ranges of the output are zeroed again (a handful of small fills), so garbage in a
caller's padding (e.g. an ``empty``-allocated gradient buffer) never reaches a result, a
gradient norm over the segment, or a checkpoint.

ReduceOp: SUM and AVG on every backend. NCCL averages natively; elsewhere AVG is a SUM followed
by a division by W in the communication dtype (gloo in torch <= 2.7 raises "Cannot use ReduceOp.AVG
with Gloo"; torch 2.13's gloo accepts AVG, and the tests check that SUM-then-divide gives the
same bits as ``sum / W`` computed locally).
W = 1 and ranks with empty segments take the same code path. Without an initialized process
group a world-size-1 plan works locally (the collectives become copies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ._dist import backend_device
from .plan import BucketPlan
from .plan import WireMode

__all__ = ["DistributedBuffer", "CollectiveHandle", "UNEVEN_GATHER_MODES"]

# torch >= 2.13 renames the tensor forms and warns on the old names; use whichever exists.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

UNEVEN_GATHER_MODES = ("auto", "all_gather", "broadcast", "all_to_all")
"""How ``all_gather`` moves a bucket whose segments differ in size: ``auto`` picks ``broadcast``
(one per-owner broadcast per non-empty segment: zero-size operations skipped) on every backend;
``all_gather`` (the list form, which NCCL runs as W broadcasts, empty ones included) and
``all_to_all`` (``all_to_all_single`` with split sizes) are kept for benchmarks."""

UNEVEN_REDUCE_MODES = ("auto", "reduce_scatter", "reduce")
"""How ``reduce_scatter`` moves uneven segments: ``reduce`` (one per-owner ``reduce`` per non-empty
segment: zero-size operations skipped; ``auto`` on NCCL, whose list ``reduce_scatter`` runs W
reduces) or ``reduce_scatter`` (the list form; ``auto`` elsewhere: on gloo it took 0.4-0.9x the
tensor form's time)."""


class CollectiveHandle:
    """A pending collective of one bucket. ``wait()`` blocks until it is done, runs the local
    post-processing (cast, accumulate, zero padding) once, and returns the output tensor."""

    __slots__ = ("_works", "_finish", "_result", "_done", "_keep")

    def __init__(
        self, works: Sequence[dist.Work | None], finish: Callable[[], torch.Tensor], *, keep: tuple = ()
    ) -> None:
        self._works = [w for w in works if w is not None]
        self._keep = keep  # tensors the pending collective reads or writes stay alive until wait()
        self._finish = finish
        self._result: torch.Tensor | None = None
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            for w in self._works:
                w.wait()
            self._result = self._finish()
            self._works, self._finish, self._keep, self._done = [], None, (), True
        return self._result

    def cancel(self) -> None:
        """Wait for the communication (the peers take part in it) but skip the post-processing: the
        output is left as the collective wrote it, and nothing is added to an accumulation target."""
        if not self._done:
            for w in self._works:
                w.wait()
            self._works, self._finish, self._keep, self._done = [], None, (), True

    def is_completed(self) -> bool:
        """Whether ``wait()`` would return without blocking on communication."""
        return self._done or all(w.is_completed() for w in self._works)


class DistributedBuffer:
    """The flat storage of one bucket on this rank, and its two collectives (see module docstring)."""

    def __init__(
        self,
        plan: BucketPlan,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        uneven_gather: str = "auto",
        allocate: bool = True,
        wire: WireMode = WireMode.GROUPED,
        uneven_reduce: str = "auto",
    ) -> None:
        """``allocate=False``: the segment is left uninitialized (not zero-filled) so its owner can make
        views of it and then ``drop_segment()``; ``allocate_segment()`` gives it zeroed memory again,
        with every view still valid (a meta-built bucket before its first use)."""
        if uneven_gather not in UNEVEN_GATHER_MODES:
            raise ValueError(f"uneven_gather must be one of {UNEVEN_GATHER_MODES}, got {uneven_gather!r}")
        self.plan = plan
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            group_size = dist.get_world_size(group)
            self.backend: str | None = str(dist.get_backend(group))
            if self.rank < 0:
                raise ValueError(
                    f"bucket {plan.name!r}: global rank {dist.get_rank()} is not a member of the given group; "
                    "build the DistributedBuffer only on the ranks of its shard group"
                )
        else:
            self.rank, group_size, self.backend = 0, 1, None
        if plan.world_size != group_size:
            where = f"the process group has {group_size} ranks" if self.backend else "no process group is initialized"
            raise ValueError(
                f"bucket {plan.name!r} was planned for world size {plan.world_size} but {where}; "
                f"plan with world_size={group_size} or call torch.distributed.init_process_group first"
            )
        if device is None:
            device = backend_device(self.backend)
        self.device = torch.device(device)
        self.dtype = dtype
        self.sizes: list[int] = plan.segment_sizes
        self.is_even = len(set(self.sizes)) <= 1
        """Segments are equal-sized: the tensor collectives apply (see [Note: one collective ...])."""
        self.owners: list[int] = [r for r, n in enumerate(self.sizes) if n > 0]
        nccl = self.backend is not None and "nccl" in self.backend and self.device.type == "cuda"
        self._native_avg = nccl
        if uneven_reduce not in UNEVEN_REDUCE_MODES:
            raise ValueError(f"uneven_reduce must be one of {UNEVEN_REDUCE_MODES}, got {uneven_reduce!r}")
        if uneven_gather == "auto":
            uneven_gather = "broadcast"
        self.uneven_reduce = ("reduce" if nccl else "reduce_scatter") if uneven_reduce == "auto" else uneven_reduce
        if uneven_gather == "all_gather" and not self.is_even and not nccl and self.backend is not None:
            raise ValueError(
                f"bucket {plan.name!r}: uneven_gather='all_gather' needs NCCL; the {self.backend} backend refuses an "
                f"uneven list all_gather (segment sizes {self.sizes}); use 'auto' or 'broadcast'"
            )
        self.uneven_gather = uneven_gather
        self.wire = WireMode(wire)
        """Uneven segments: list forms (``GROUPED``) or one padded tensor collective ([Note: wire format])."""
        self.segment_start, self.segment_end = plan.segment(self.rank)
        # (allocate=False: uninitialized; on the CPU a large block is mapped and never touched before
        # drop_segment() frees it.)
        make = torch.zeros if allocate else torch.empty
        self.segment = make(self.segment_numel, dtype=dtype, device=self.device)
        self.is_allocated = True
        self.grad_segment: torch.Tensor | None = None
        self.full_padding = _padding_ranges(plan)
        self._seg_padding = [
            (max(a, self.segment_start) - self.segment_start, min(b, self.segment_end) - self.segment_start)
            for a, b in self.full_padding
            if min(b, self.segment_end) > max(a, self.segment_start)
        ]

    # ---- storage ----------------------------------------------------------------------
    def drop_segment(self) -> None:
        """Free the segment's memory; its shape and existing views stay (invalid until ``allocate_segment``)."""
        self.segment.untyped_storage().resize_(0)
        self.is_allocated = False

    def allocate_segment(self) -> None:
        """Give a dropped segment its memory again, zero-filled; every view of it stays valid."""
        if not self.is_allocated:
            self.segment.untyped_storage().resize_(self.segment_numel * self.segment.element_size())
            self.segment.zero_()
            self.is_allocated = True

    @property
    def total_numel(self) -> int:
        return self.plan.total_numel

    @property
    def segment_numel(self) -> int:
        return self.segment_end - self.segment_start

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def new_full(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zero flat buffer of ``total_numel`` elements (padding zero) on this buffer's device."""
        return torch.zeros(self.total_numel, dtype=dtype or self.dtype, device=self.device)

    def alloc_grad_segment(self) -> torch.Tensor:
        """The gradient segment, allocated as zeros on first use."""
        if self.grad_segment is None:
            self.grad_segment = torch.zeros_like(self.segment)
        return self.grad_segment

    def free_grad_segment(self) -> None:
        self.grad_segment = None

    def local_views(self, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Per placement, this rank's flat piece as a view into ``flat`` (default: the segment);
        an empty view where this rank holds none of the tensor."""
        flat = self.segment if flat is None else flat
        self._check_flat(flat, self.segment_numel, "flat")
        out = []
        for p in self.plan.placements:
            a, b = p.shard.range(self.rank)
            off = min(max(p.offset + a - self.segment_start, 0), self.segment_numel)
            out.append(flat[off : off + (b - a)])
        return out

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Per placement, the global-shape tensor as a view into the gathered flat ``full``."""
        self._check_flat(full, self.total_numel, "full")
        return [full[p.offset : p.offset + p.numel].view(p.shape) for p in self.plan.placements]

    # ---- collectives ------------------------------------------------------------------
    def all_gather(
        self, *, src: torch.Tensor | None = None, out: torch.Tensor | None = None, async_op: bool = False
    ) -> torch.Tensor | CollectiveHandle:
        """Gather every rank's segment into the full flat buffer (one collective; see the Notes)."""
        src = self.segment if src is None else src
        self._check_flat(src, self.segment_numel, "src")
        if out is None:
            out = self.new_full(src.dtype)
        self._check_flat(out, self.total_numel, "out")
        recv = out if out.dtype == src.dtype else torch.empty(self.total_numel, dtype=src.dtype, device=out.device)
        if self._padded_wire:
            works, stage, send = self._gather_padded(src)
        else:
            works, stage, send = self._gather_into(recv, src), None, None

        def finish() -> torch.Tensor:
            if stage is not None:
                self._copy_out_padded(stage, recv)
            if recv is not out:
                out.copy_(recv)
            zero_ranges(out, self.full_padding)
            return out

        handle = CollectiveHandle(works, finish, keep=(src, recv, stage, send))
        return handle if async_op else handle.wait()

    def reduce_scatter(
        self,
        full_grad: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        accumulate: bool = False,
        async_op: bool = False,
        consume: bool = False,
    ) -> torch.Tensor | CollectiveHandle:
        """Reduce the flat ``full_grad`` over ranks; this rank's range goes into ``out`` (default:
        the gradient segment), added to it when ``accumulate`` (one collective; see the Notes).
        ``consume=True``: ``full_grad`` may be used as scratch (per-owner reduces write into it)."""
        self._check_flat(full_grad, self.total_numel, "full_grad")
        if out is None:
            out = self.alloc_grad_segment()
        self._check_flat(out, self.segment_numel, "out")
        direct = out.dtype == full_grad.dtype and not accumulate
        recv = out if direct else torch.empty(self.segment_numel, dtype=full_grad.dtype, device=out.device)
        emulate_avg = op == dist.ReduceOp.AVG and not self._native_avg
        divide = emulate_avg and self.world_size > 1
        red_op = dist.ReduceOp.SUM if emulate_avg else op
        if self._padded_wire:
            works, stage, recv_padded = self._reduce_padded(full_grad, red_op)
        elif consume and self._gloo_even_reduce:
            # [Note: even reduce-scatter on gloo]: the same sum, in place, without gloo's clone.
            works = [dist.all_reduce(full_grad, op=red_op, group=self.group, async_op=True)]
            stage, recv_padded = None, full_grad[self.segment_start : self.segment_end]
        elif self._owner_reduce:
            # Each owner's slice is reduced in place (into a copy unless the caller gives full_grad up).
            scratch = full_grad if consume else full_grad.clone()
            works, stage = self._reduce_owners(scratch, red_op), scratch
            recv_padded = scratch[self.segment_start : self.segment_end]
        else:
            works, stage, recv_padded = self._reduce_into(recv, full_grad, red_op), None, None

        def finish() -> torch.Tensor:
            if recv_padded is not None:
                recv.copy_(recv_padded[: self.segment_numel])
            return self._finish_segment(recv, out, divide=divide, accumulate=accumulate)

        handle = CollectiveHandle(works, finish, keep=(full_grad, recv, stage, recv_padded))
        return handle if async_op else handle.wait()

    def reduce_scatter_owners(
        self,
        grads: list[torch.Tensor | None],
        *,
        dtype: torch.dtype,
        out: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        scale: float | None = None,
        accumulate: bool = False,
        streams=None,
    ) -> CollectiveHandle:
        """Reduce the bucket's gradients in ``dtype`` one owner segment at a time, never building the
        full flat buffer: per non-empty segment ``r`` the pieces of ``grads`` (per placement, its
        full-shape gradient or ``None`` for zeros, any dtype) that fall in ``r``'s range are cast
        into a ``dtype`` chunk of ``r``'s size (times ``scale``), which one ``dist.reduce`` sums on
        ``r``; the chunk is waited for and dropped before the next is made, and each entry of
        ``grads`` is set to ``None`` once its last piece is cast, so the transient is the gradients
        still held plus one chunk (see [Note: per-owner reduction under mixed precision]).
        ``out`` (this rank's segment, ``segment_numel``) is overwritten, or added to when
        ``accumulate``. ``streams`` (the runtime's
        ``Streams``): chunks are filled on the current stream and reduced on its reduce-scatter
        stream. Returns a completed handle whose ``wait()`` returns ``out``."""
        self._check_flat(out, self.segment_numel, "out")
        emulate_avg = op == dist.ReduceOp.AVG and not self._native_avg
        red_op = dist.ReduceOp.SUM if emulate_avg else op
        collective = self.backend is not None and self.world_size > 1
        side = streams.reduce_scatter if streams is not None else None
        order = sorted(range(len(self.plan.placements)), key=lambda i: self.plan.placements[i].offset)
        mine: torch.Tensor | None = None
        for r in self.owners:
            lo, hi = self.plan.segment(r)
            direct = r == self.rank and out.dtype == dtype and not accumulate
            chunk = out.zero_() if direct else torch.zeros(hi - lo, dtype=dtype, device=self.device)
            dst, src = [], []
            for i in order:
                p = self.plan.placements[i]
                a, b = max(p.offset, lo), min(p.offset + p.numel, hi)
                g = grads[i]
                if g is not None and b > a:
                    dst.append(chunk[a - lo : b - lo])
                    src.append(g.reshape(-1)[a - p.offset : b - p.offset])
                if g is not None and p.offset + p.numel <= hi:
                    grads[i] = None  # its last piece is (being) cast: the caller's reference is the last
            with torch.no_grad():
                if dst:
                    torch._foreach_copy_(dst, src)
                del dst, src
                if scale is not None:
                    chunk.mul_(scale)
            if collective:
                if streams is not None:
                    streams.record(chunk, side)
                with streams.on(side) if streams is not None else contextlib.nullcontext():
                    dist.reduce(chunk, group_dst=r, op=red_op, group=self.group, async_op=True).wait()
            if r == self.rank:
                mine = chunk
            del chunk
        if mine is None:  # this rank's segment is empty
            return CollectiveHandle([], lambda: out)
        with streams.on(side) if streams is not None else contextlib.nullcontext():
            self._finish_segment(mine, out, divide=emulate_avg and self.world_size > 1, accumulate=accumulate)
        return CollectiveHandle([], lambda: out)

    def _finish_segment(self, reduced: torch.Tensor, out: torch.Tensor, *, divide: bool, accumulate: bool) -> torch.Tensor:
        """This rank's reduced segment into ``out``: averaged over the group (``divide``), added to or
        copied into ``out``, padding zeroed ([Note: padding])."""
        if divide:
            reduced.div_(self.world_size)
        if accumulate:
            out.add_(reduced)
        elif reduced is not out:
            out.copy_(reduced)
        zero_ranges(out, self._seg_padding)
        return out

    # ---- internals --------------------------------------------------------------------
    @property
    def _owner_reduce(self) -> bool:
        return (
            self.uneven_reduce == "reduce" and not self.is_even and self.backend is not None
            and self.total_numel > 0 and self.world_size > 1
        )  # fmt: skip

    @property
    def _gloo_even_reduce(self) -> bool:
        return (
            self.is_even and self.backend is not None and "gloo" in self.backend and self.device.type == "cpu"
            and self.total_numel > 0 and self.world_size > 1
        )  # fmt: skip

    def _reduce_owners(self, full: torch.Tensor, op) -> list[dist.Work]:
        pieces = full.split(self.sizes)
        return [dist.reduce(pieces[r], group_dst=r, op=op, group=self.group, async_op=True) for r in self.owners]

    @property
    def _padded_wire(self) -> bool:
        return self.wire is WireMode.PADDED and not self.is_even and self.backend is not None and self.total_numel > 0

    def _padded_rows(self, stage: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per non-empty rank: its slice of the ragged flat layout's pieces and of the padded rows."""
        m = max(self.sizes)
        rows = stage.view(self.world_size, m)
        return [rows[r, :n] for r, n in enumerate(self.sizes) if n], [r for r, n in enumerate(self.sizes) if n]

    def _gather_padded(self, src: torch.Tensor) -> tuple[list[dist.Work], torch.Tensor, torch.Tensor]:
        m = max(self.sizes)
        send = torch.zeros(m, dtype=src.dtype, device=src.device)
        send[: self.segment_numel].copy_(src)
        stage = torch.empty(self.world_size * m, dtype=src.dtype, device=src.device)
        return [_all_gather_single(stage, send, group=self.group, async_op=True)], stage, send

    def _copy_out_padded(self, stage: torch.Tensor, out: torch.Tensor) -> None:
        rows, owners = self._padded_rows(stage)
        pieces = out.split(self.sizes)
        torch._foreach_copy_([pieces[r] for r in owners], rows)

    def _reduce_padded(self, full: torch.Tensor, op) -> tuple[list[dist.Work], torch.Tensor, torch.Tensor]:
        m = max(self.sizes)
        stage = torch.zeros(self.world_size * m, dtype=full.dtype, device=full.device)  # padding adds zeros
        rows, owners = self._padded_rows(stage)
        pieces = full.split(self.sizes)
        torch._foreach_copy_(rows, [pieces[r] for r in owners])
        recv = torch.empty(m, dtype=full.dtype, device=full.device)
        return [_reduce_scatter_single(recv, stage, op=op, group=self.group, async_op=True)], stage, recv

    def _gather_into(self, out: torch.Tensor, src: torch.Tensor) -> list[dist.Work | None]:
        if self.backend is None or self.total_numel == 0:
            out[self.segment_start : self.segment_end].copy_(src)
            return []
        g = self.group
        if self.is_even:
            return [_all_gather_single(out, src, group=g, async_op=True)]
        pieces = list(out.split(self.sizes))
        if self.uneven_gather == "all_gather":
            return [dist.all_gather(pieces, src, group=g, async_op=True)]
        if self.uneven_gather == "all_to_all":
            n = self.segment_numel
            send = src.repeat(self.world_size)
            return [
                dist.all_to_all_single(
                    out, send, output_split_sizes=self.sizes, input_split_sizes=[n] * self.world_size,
                    group=g, async_op=True,
                )
            ]
        pieces[self.rank].copy_(src)  # the owner broadcasts from its slice of ``out``
        return [dist.broadcast(pieces[r], group=g, group_src=r, async_op=True) for r in self.owners]

    def _reduce_into(self, out: torch.Tensor, full: torch.Tensor, op) -> list[dist.Work | None]:
        if self.backend is None or self.total_numel == 0:
            out.copy_(full[self.segment_start : self.segment_end])
            return []
        g = self.group
        if self.is_even:
            return [_reduce_scatter_single(out, full, op=op, group=g, async_op=True)]
        return [dist.reduce_scatter(out, list(full.split(self.sizes)), op=op, group=g, async_op=True)]

    def _check_flat(self, t: torch.Tensor, numel: int, what: str) -> None:
        if t.dim() != 1 or t.numel() != numel or (numel and t.stride(0) != 1):
            raise ValueError(
                f"bucket {self.plan.name!r}: {what} must be a flat contiguous tensor of {numel} elements on "
                f"rank {self.rank} of {self.world_size}, got shape {tuple(t.shape)} stride {tuple(t.stride())}"
            )
        if t.device != self.device:
            raise ValueError(
                f"bucket {self.plan.name!r}: {what} is on {t.device} but the buffer lives on {self.device}; "
                "move it first"
            )


def _padding_ranges(plan: BucketPlan) -> list[tuple[int, int]]:
    """The ``[a, b)`` ranges of the global flat buffer that hold no tensor element (pure)."""
    out, end = [], 0
    for p in sorted(plan.placements, key=lambda p: p.offset):
        if p.offset > end:
            out.append((end, p.offset))
        end = max(end, p.offset + p.numel)
    if plan.total_numel > end:
        out.append((end, plan.total_numel))
    return out


def zero_ranges(t: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> None:
    for a, b in ranges:
        t[a:b].zero_()
