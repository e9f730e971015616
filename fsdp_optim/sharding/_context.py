"""What one root shares with its buckets: the iteration state, the side streams, the reduction
schedule and the collective check (as FSDP2's ``FSDPCommContext``, which ``_fsdp_state.py`` hands to
each parameter group).

The root's runtime (``_runtime.py``) owns one ``CommContext`` and passes it to every bucket
(``_bucket.py``) at construction; a bucket reads and moves the shared state through it and never
sees the runtime, so the runtime imports the bucket and not the other way around.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

__all__ = ["CommContext", "Streams", "TrainingState"]


class TrainingState(enum.Enum):
    """Per root: where the iteration is (see [Note: bucket lifecycle])."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"


class Streams:
    """The side streams of one root (CUDA only; on the CPU every field is ``None`` and every use
    below is a no-op, so the same code runs).

    [Note: streams]
    As FSDP2 (``_fsdp_param_group.py``), collectives and their local pre/post-processing run off the
    compute stream, so the next bucket's gather and the previous bucket's reduction overlap compute:

    * ``all_gather``: waits for the compute stream (the segment's latest values: an optimizer step,
      a checkpoint load), then casts or packs (FP8) the segment and issues the all-gather; waiting for
      it (``wait_unshard``) runs the finish (dequantize, zero padding) on it, then the compute
      stream waits for it (an event wait on the GPU, not the host).
    * ``reduce_scatter``: waits for the compute stream (the gradients of the bucket's backward),
      issues the reduce-scatter, and runs its finish (divide, accumulate, cast into the gradient
      segment, zero padding); the compute stream waits for it only at the end of backward (and
      before anyone reads the gradients: ``settle``), not when the next bucket's reduction is
      issued, so backward compute never stalls on a reduction.
    * ``all_reduce`` (HSDP): waits for the reduce-scatter stream, all-reduces the reduced shard
      across replicas and adds or casts it into the gradient segment.

    Lifetimes: the gathered buffer and the gradient segment are allocated on the compute stream
    before the side stream waits for it, so their use is ordered after the allocation, and they are
    freed on the compute stream after it waited for the side stream. The flat gradient buffer is
    made on the compute stream (the gradients are copied into it there) but read by the reduce-scatter
    stream, so it is marked with ``record_stream`` before its last reference is dropped: the
    allocator does not hand its memory out again until that stream's work is done. Buffers made
    inside a side-stream context (casts, FP8 packs, receive buffers) live and die on that stream.
    """

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda" and torch.cuda.is_available()
        self.all_gather = torch.cuda.Stream(device, priority=-1) if cuda else None
        self.reduce_scatter = torch.cuda.Stream(device, priority=-1) if cuda else None
        self.all_reduce = torch.cuda.Stream(device) if cuda else None

    def on(self, stream: torch.cuda.Stream | None):
        """``with streams.on(s):`` run on side stream ``s`` after it waited for the current stream."""
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        return torch.cuda.stream(stream)

    def compute_waits_for(self, stream: torch.cuda.Stream | None) -> None:
        """The current (compute) stream waits for ``stream``'s work so far (a GPU-side wait)."""
        if stream is not None:
            torch.cuda.current_stream(stream.device).wait_stream(stream)

    def waits(self, waiter: torch.cuda.Stream | None, waitee: torch.cuda.Stream | None) -> None:
        if waiter is not None and waitee is not None:
            waiter.wait_stream(waitee)

    def record(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """``tensor``, made on another stream, is used by ``stream``: its memory is not reused before."""
        if stream is not None:
            tensor.record_stream(stream)


@dataclass(kw_only=True, eq=False)
class CommContext:
    """One root's state shared with its buckets. Buckets appear here only through what they do
    (``plan.name``, ``replicate_group``, ``start_replica_reduce``, ``wait_reduces``), not their type."""

    group: dist.ProcessGroup | None
    world_size: int
    device: torch.device
    streams: Streams
    backward_finished: Callable[[], None] | None = None
    """The root's end-of-backward callback (queued on the autograd engine once per backward; set by
    the runtime that owns this context)."""
    state: TrainingState = TrainingState.IDLE
    prev_forward_order: list[Any] = field(default_factory=list)
    forward_order: list[Any] = field(default_factory=list)
    post_forward_order: list[Any] = field(default_factory=list)
    callback_queued: bool = False
    pending_reduces: list[Any] = field(default_factory=list)
    unarrived: list[tuple[Any, int, torch.Tensor]] = field(default_factory=list)
    """(bucket, index, reduced view) of trainable parameters without a gradient on this rank in the
    reduction just waited for; settled at the end of backward ([Note: unused parameters])."""
    arrivals: list[tuple[Any, list[int], list[bool]]] = field(default_factory=list)
    """(bucket, trainable indices, whether this rank has a gradient for each) of every reduction
    waited for in this backward."""
    generation: int = 0
    """Bumped at the end of every backward (see ``_PendingCall``)."""
    num_optimizer_steps: int = 0
    """Steps of any optimizer since setup (see [Note: stale gathers])."""
    debug: bool = field(default_factory=lambda: os.environ.get("FSDP_OPTIM_DEBUG", "0") not in ("", "0"))
    num_collectives: int = 0

    # ---- order -------------------------------------------------------------------------------
    def next_in_forward(self, b: Any) -> Any | None:
        """The bucket that ran after ``b`` in the previous forward (the one to prefetch)."""
        order = self.prev_forward_order
        for i, x in enumerate(order[:-1]):
            if x is b:
                return order[i + 1]
        return None

    def next_in_backward(self, b: Any) -> Any | None:
        """The bucket whose backward runs after ``b``'s: the one before it in post-forward order."""
        order = self.post_forward_order
        for i in range(len(order) - 1, 0, -1):
            if order[i] is b:
                return order[i - 1]
        return None

    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            if self.backward_finished is None:
                raise AssertionError("fully_shard internal error: a context without its runtime's callback")
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self.backward_finished)

    # ---- collectives -------------------------------------------------------------------------
    def check_collective(self, bucket_name: str, op: str) -> None:
        """Debug mode (``FSDP_OPTIM_DEBUG=1``): before each collective, all ranks agree on what it is
        (bucket and operation), so a rank whose sequence differs (it skipped a module's forward, or
        backward) raises on every rank, naming it, instead of hanging or mixing up buckets."""
        if not self.debug or self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        self.num_collectives += 1
        mine = (bucket_name, op, self.num_collectives)
        every: list = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self.group)
        bad = [r for r, x in enumerate(every) if x[:2] != mine[:2]]
        if bad:
            raise RuntimeError(
                "fully_shard (FSDP_OPTIM_DEBUG): ranks disagree on the next collective: "
                + "; ".join(f"rank {r}: {x[1]} of bucket {x[0]!r} (collective #{x[2]})" for r, x in enumerate(every))
                + ". Every rank must run the same sharded modules' forward and backward in the same order "
                "(a rank that skips a module or a backward hangs the others without this check)"
            )

    def issue_reduce(self, b: Any) -> None:
        """Track ``b``'s reduction in flight.

        With side streams (CUDA) waiting is not a host wait (the reduce-scatter stream waits for
        the collective and runs its finish; the compute stream waits only at the end of backward),
        so the reduction is waited for at once and its flat buffer goes back to the allocator,
        marked for the reduce-scatter stream, as soon as that stream is done with it: the next
        bucket's backward never finds it still referenced. On the CPU, where gloo's threads run the
        reduction, it is waited for at once too (as FSDP2 does there): keeping it in flight while
        the next bucket's backward computes held its flat buffer and gloo's staging copy (two
        buckets) on top of that backward's gathered parameters and gradients. The owner of whole
        matrices receives whole gradients (Muon's rule): measured with ``benchmarks/setup_memory.py``
        (24 x Linear(2048, 2048), W = 2, CPU-built), the rank owning the last layers peaked at
        108 MiB RSS growth in backward with one reduction in flight (FSDP2: 80)."""
        if b.replicate_group is None:
            self.pending_reduces.append(b)
            while self.pending_reduces:
                self.pending_reduces.pop(0).wait_reduces(sync_compute=False)
            return
        # HSDP: the previous bucket's reduce-scatter is done by now (its all-reduce across replicas
        # goes out while this bucket's reduce-scatter runs); the one before it completes.
        for prev in self.pending_reduces:
            prev.start_replica_reduce()
        self.pending_reduces.append(b)
        while len(self.pending_reduces) > 2:
            self.pending_reduces.pop(0).wait_reduces(sync_compute=False)

    def finish_reduces(self) -> None:
        """Wait for every reduction; then the compute stream waits for the side streams once."""
        while self.pending_reduces:
            self.pending_reduces.pop(0).wait_reduces(sync_compute=False)
        self.streams.compute_waits_for(self.streams.reduce_scatter)
        self.streams.compute_waits_for(self.streams.all_reduce)
