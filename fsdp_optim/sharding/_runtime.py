"""The runtime of one root: per-iteration hooks, ordering, reductions in flight, guards.

``_setup.py`` builds a ``_Runtime`` (one per root) and its ``_Bucket`` s; this file runs them: the
module hooks (``_ModuleState``), the root's pre/post-forward, the end-of-backward callback, the
post-backward autograd Function and the guards through torch's global optimizer hooks.

[Note: runtime]
- Forward pre-hook: all-gather the bucket (one collective, in ``param_dtype``) into a persistent
  flat buffer and swap the owners' parameters to global-shape views into it; issue the all-gather
  of the next bucket in the previous iteration's forward order before this bucket computes.
- Forward post-hook: free the gathered buffer (``reshard_after_forward``; by default the root's
  bucket is kept, as FSDP2 does, since backward needs it at once) and hook the outputs for backward.
- Pre-backward (a hook on the outputs): re-gather if freed, prefetch the bucket whose backward
  comes next (reverse post-forward order).
- Unsharded gradients are copied into one flat buffer in ``reduce_dtype`` once the bucket's backward
  is done (one ``_foreach_copy_``, ``_foreach_add_`` when accumulating without sync; the gathered
  parameters are freed first), as FSDP2 copies them: a buffer made before the backward would raise
  its peak (see ``_Bucket._copy_in_grads``).
- Post-backward (an identity autograd Function on the module's inputs, whose backward runs once the
  module's backward is done, as FSDP2 does; or the end of backward): reduce-scatter the flat buffer
  (one collective, AVG over ranks, so a per-rank mean loss gives the gradient of the mean over the
  global batch) straight into the gradient segment; each sharded parameter's ``.grad`` becomes its
  view into it. The previous bucket's reduction is waited for when the next one is issued, so one
  reduction overlaps the next bucket's backward (see ``_Runtime.issue_reduce``).
- A callback queued on the autograd engine at the end of backward runs what did not run yet
  (bucket order, the same on every rank), waits for the reductions and reshards everything.
- ``set_requires_gradient_sync(False)``: unsharded gradients are summed locally into the bucket's
  flat reduction buffer (no collective); the next synced backward reduces the sum once.

[Note: HSDP]
``mesh`` may be a 2-D ``DeviceMesh`` ``(replicate, shard)`` (``init_device_mesh(device, (R, S),
mesh_dim_names=("replicate", "shard"))``; dims found by those names, else dim 0 replicates and dim 1
shards). Invariant: *every replica holds the same layout and the same values*. The planner runs
over the shard axis only (plan world size S; a sharded parameter's placements are ``(Replicate(),
RaggedShard(...))`` on the 2-D mesh, the ``RaggedShard`` coordinates being the shard ranks),
identically on every replica (the plan fingerprint is agreed across replicas at setup), so shard rank s of every replica stores the same segment. All-gathers and the
reduce-scatter stay inside the shard group; after the reduce-scatter (AVG over S) each rank
all-reduces its reduced segment, 1/S of the bucket, with the ranks holding the same segment in
the other replicas (AVG over R, one collective per bucket; skipped where the segment is empty, on
every replica alike): the result is the mean over all R * S ranks, bit-identical on every replica,
so the optimizers, which read only the ragged dimension (``local_shard``), run unchanged, without
communication, and keep the replicas equal. With gradient accumulation without sync neither
collective runs until the synced backward. The all-reduce of bucket i is issued once its
reduce-scatter is done, when bucket i+1's reduce-scatter is issued, and waited for one bucket
later. Norms (``clip_grad_norm_``) are ``Partial`` on the shard dimension only (replicas hold equal
gradients); checkpoints write one copy because every replica offers DCP the same chunks under the same keys
and DCP keeps one of each (``dedup_save_plans``); a load reads this rank's range whatever the
mesh.

Collective order is the same on every rank because it follows the autograd graph, which is the
same on every rank (same model, same code). A rank may leave parameters of a module every rank
runs without a gradient ([Note: unused parameters]); skipping a whole sharded module on one rank
(e.g. an expert in its own ``fully_shard`` call) is not supported.
"""

from __future__ import annotations

import copy
import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._bucket import BucketPhase, BucketState, _Bucket, run_post_accumulate_grad_hooks
from ._context import CommContext, TrainingState
from ._float8 import Float8AllGather
from ._mixed_precision import MixedPrecisionPolicy
from .plan import Plan, PlanConfig
from ._dtensor import RaggedDTensor
from ._replaced import check_not_replaced

if TYPE_CHECKING:
    from .plan import BlockRule

_STATE = "_fsdp_optim_state"


# ---------------------------------------------------------------------------------------------
# Per-module state: the hooks of one fully_shard call
# ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True, eq=False)
class _ModuleState:
    """What ``fully_shard`` recorded for one call: one module, or a group of modules sharing one bucket."""

    modules: tuple[nn.Module, ...]
    """The call's module, or its modules (``fully_shard([norm, output])``: one bucket, as FSDP2's group)."""
    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    replicate_group: dist.ProcessGroup | None = None
    num_replicas: int = 1
    device_mesh: DeviceMesh
    """The sharded parameters' mesh (``RaggedShard`` on ``shard_dim``, ``Replicate()`` on the other)."""
    shard_dim: int = 0
    param_spec: Callable | None = None
    """How a planned tensor becomes a ``DTensorSpec`` (set by setup at this call's planning)."""
    blocks: BlockRule | None
    reshard_after_forward: bool | None
    """``None``: ``True`` for an inner bucket, ``False`` for the root (resolved at setup)."""
    mp_policy: MixedPrecisionPolicy | None
    plan_config: PlanConfig | None
    fp8_all_gather: Float8AllGather | None = None
    separate_root: bool = False
    """Kept as its own root by an enclosing call over another mesh ([Note: separate roots])."""
    runtime: _Runtime | None = None
    bucket: _Bucket | None = None
    handles: list = field(default_factory=list)
    to_run: set[int] = field(default_factory=set)
    """A group: the modules (ids) that have not run forward yet in this pass ([Note: module groups])."""

    def __post_init__(self) -> None:
        for m in self.modules:
            setattr(m, _STATE, self)
            self.handles += [
                m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
                m.register_forward_hook(self._post_forward, prepend=False),
            ]

    @property
    def module(self) -> nn.Module:
        """The call's (first) module."""
        return self.modules[0]

    @property
    def is_group(self) -> bool:
        return len(self.modules) > 1

    def remove(self) -> None:
        """Undo ``__post_init__`` (a ``fully_shard`` call that failed validation leaves no trace)."""
        for h in self.handles:
            h.remove()
        for m in self.modules:
            m.__dict__.pop(_STATE, None)

    # [Note: module groups]
    # ``fully_shard([norm, output])`` (as FSDP2, and torchtitan's wrapping of the final norm and the
    # head) makes one bucket for several modules: one gather before the first of them runs forward,
    # the post-forward (free or keep) after the last of them. ``to_run`` holds the modules yet to run
    # in this pass: the first pre-forward of a pass fills it, each post-forward takes its module out,
    # the last one completes the pass. A pass another forward interrupts is completed there: a
    # module of the group that already ran and runs again (one module called twice, or the next
    # pass after a module that never ran) completes it and starts a new one (a free and a new
    # gather, as for a single module called twice), and the root's post-forward completes every
    # group left incomplete (a module that did not run this time). In backward each module call
    # registers its pre-backward hook on its outputs and counts towards the bucket's post-backward,
    # as for a single module; and the post-backward also waits until every module of the group
    # called with grad has begun its backward (``awaiting_backward``): a tied group [embedding,
    # norm, head] is reduced once, at the end of backward, not after the head's backward and again
    # after the embedding's. Recomputation (activation checkpointing) runs outside all this: every
    # call gathers if needed, none frees.
    def _recomputing(self) -> bool:
        return self.runtime.ctx.state is TrainingState.PRE_BACKWARD and torch._C._current_graph_task_id() != -1

    def _starts_pass(self, module: nn.Module) -> bool:
        if not self.is_group or self._recomputing():
            return True
        if id(module) in self.to_run:
            return False  # a later module of the group in this pass: the bucket is gathered
        if self.to_run:
            self.complete_pass()  # this module ran already in this pass: a new one starts
        self.to_run = {id(m) for m in self.modules}
        return True

    def _ends_pass(self, module: nn.Module) -> bool:
        if not self.is_group or self._recomputing():
            return True
        self.to_run.discard(id(module))
        return not self.to_run

    def complete_pass(self) -> None:
        """A group's post-forward, for a pass whose modules did not all run (``to_run`` not empty)."""
        self.to_run = set()
        if self.bucket is not None:
            self.bucket.post_forward()
        if self.runtime.root_state is self:
            self.runtime.root_post_forward()

    def _group_pre_backward(self, module_id: int, grad: torch.Tensor) -> torch.Tensor:
        self.bucket.awaiting_backward.discard(module_id)  # this module's backward begins
        return self.bucket.pre_backward_hook(grad)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rt = self.runtime
        if rt is None:
            return args, kwargs
        if self._starts_pass(module):
            if rt.root_state is self:
                rt.root_pre_forward()
            if self.bucket is not None:
                self.bucket.pre_forward()
        mp = self.effective_mp
        if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
            args, kwargs = _cast_tensors((args, kwargs), mp.param_dtype)
        if self.bucket is not None and torch.is_grad_enabled() and rt.ctx.state is TrainingState.FORWARD:
            args, kwargs = _register_post_backward(self.bucket, args, kwargs)
            if self.is_group:
                self.bucket.awaiting_backward.add(id(module))
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        rt = self.runtime
        if rt is None:
            return output
        last = self._ends_pass(module)
        if self.bucket is not None:
            if last:
                self.bucket.post_forward()
            if torch.is_grad_enabled():
                hook = (functools.partial(self._group_pre_backward, id(module)) if self.is_group
                        else self.bucket.pre_backward_hook)
                output = _register_on_tensors(output, hook)
        if rt.root_state is self and last:
            rt.root_post_forward()
        mp = self.effective_mp
        if mp is not None and mp.output_dtype is not None:
            output = _cast_tensors(output, mp.output_dtype)
        return output

    @property
    def effective_mp(self) -> MixedPrecisionPolicy | None:
        if self.mp_policy is not None or self.runtime is None:
            return self.mp_policy
        return self.runtime.root_state.mp_policy


def _buckets_under(module: nn.Module, recurse: bool) -> list[_Bucket]:
    mods = module.modules() if recurse else [module]
    out = []
    for m in mods:
        st = getattr(m, _STATE, None)
        if st is not None and st.bucket is not None and not any(b is st.bucket for b in out):
            out.append(st.bucket)  # (a group's modules share one)
    return out


def _runtime_of(module: nn.Module) -> _Runtime:
    st = getattr(module, _STATE, None)
    if st is not None and st.runtime is not None:
        return st.runtime
    for m in module.modules():
        st = getattr(m, _STATE, None)
        if st is not None and st.runtime is not None:
            return st.runtime
    raise ValueError(f"module {type(module).__name__} is not sharded: call fsdp_optim.fully_shard on it first")


def _runtimes_under(module: nn.Module) -> list[_Runtime]:
    out: list[_Runtime] = []
    for m in module.modules():
        st = getattr(m, _STATE, None)
        if st is not None and st.runtime is not None and not any(st.runtime is r for r in out):
            out.append(st.runtime)
    return out


def buckets_of(module: nn.Module) -> list[_Bucket]:
    """Every bucket of every root under ``module`` (or of the root managing it): the buckets a
    state dict, checkpoint or initialization of ``module`` touches."""
    rts = _runtimes_under(module) or [_runtime_of(module)]
    return [b for rt in rts for b in rt.buckets]


def reshard_all(module: nn.Module) -> None:
    """Free every gathered bucket under ``module`` and make its sharded values readable (local;
    before its parameters are read or replaced, e.g. by a checkpoint)."""
    for m in module.modules():
        st = getattr(m, _STATE, None)
        if st is not None and st.bucket is not None:
            st.bucket.reshard()
            st.bucket.settle()


def materialize_all() -> None:
    """Allocate every lazy (meta-built, not yet used) bucket of every live root (local). Called when an
    optimizer first sees sharded parameters still on meta, so its state is made on the real device."""
    for rt in list(_LIVE_RUNTIMES):
        for b in rt.buckets:
            b.materialize()


# ---------------------------------------------------------------------------------------------
# Runtime of one root
# ---------------------------------------------------------------------------------------------
class _Runtime:
    """Everything one root manages: its plan, one ``_Bucket`` per bucket, per-iteration state."""

    def __init__(self, root: _ModuleState, plan: Plan, buckets: list[_Bucket], ctx: CommContext) -> None:
        self.root_state = root
        self.plan = plan
        self.buckets = buckets
        self.group = root.group
        self.rank = root.rank
        self.world_size = root.world_size
        self.device = root.device
        self.ctx = ctx  # shared with the buckets: iteration state, streams, reductions in flight
        self.group_states: list[_ModuleState] = []  # calls on module groups ([Note: module groups])
        ctx.backward_finished = self.final_callback
        self._arrival_work: tuple[Any, torch.Tensor] | None = None
        _LIVE_RUNTIMES.add(self)
        _install_optimizer_hooks()

    def detach(self) -> None:
        """Drop this (absorbed) runtime's storage now rather than at the next cyclic GC."""
        _LIVE_RUNTIMES.discard(self)
        for b in self.buckets:
            b.release()
        self.buckets = []

    # ---- per-iteration hooks --------------------------------------------------------------
    def root_pre_forward(self) -> None:
        if self.ctx.state is TrainingState.PRE_BACKWARD:
            if torch._C._current_graph_task_id() != -1:
                return  # recomputation inside backward (activation checkpointing)
            self.abandon_backward()  # the last backward raised before its end-of-backward callback
        self.ctx.finish_reduces()
        self.ctx.prev_forward_order = self.ctx.forward_order
        self.ctx.forward_order, self.ctx.post_forward_order = [], []
        for st in self.group_states:
            if st is not self.root_state:
                st.to_run = set()  # a pass a raised forward left incomplete: this one starts afresh
        for b in self.buckets:
            b.rebind()  # (allocates a lazy bucket)
            b.used = False
            # [Note: stale gathers] A bucket still gathered here was gathered by a forward whose
            # backward never ran (an evaluation forward with grad enabled, or a dropped graph), or by
            # an explicit ``unshard()``. Its values may predate an optimizer step, so it is freed and
            # gathered again by this forward: always for the former, and for an explicit gather if
            # an optimizer stepped after it was issued. Steps are counted by torch's global
            # optimizer step hook, which runs on every rank alike (every rank steps the same
            # optimizers), so every rank decides the same and the collectives stay matched.
            if b.is_gathered and (not b.explicit_unshard or b.gathered_at_step != self.ctx.num_optimizer_steps):
                b.reshard()
            if b.phase is not BucketPhase.IDLE:
                b.phase = BucketPhase.IDLE  # left by a forward whose graph was dropped
        self.ctx.state = TrainingState.FORWARD

    def root_post_forward(self) -> None:
        if self.ctx.state is TrainingState.PRE_BACKWARD:
            return
        for st in self.group_states:
            if st is not self.root_state and st.to_run:
                st.complete_pass()  # a module of the group did not run this time
        for b in self.buckets:
            if b.where is BucketState.GATHERING and not b.used:
                b.reshard()  # a prefetched bucket that did not run this time (waits for the gather)
        if not torch.is_grad_enabled():
            for b in self.buckets:
                b.reshard()
        self.ctx.state = TrainingState.IDLE

    def final_callback(self) -> None:
        for b in self.buckets:
            if b.phase is not BucketPhase.REDUCED:
                b.post_backward()
            elif b.has_unreduced_grads:  # gradients that reached it after its reduction: added
                b.phase = BucketPhase.BACKWARD
                b.post_backward()
        self.ctx.finish_reduces()
        self.settle_unarrived()
        for b in self.buckets:
            b.backward_finished()
        self.ctx.generation += 1  # calls registered by graphs that backward did not reach no longer count
        self.ctx.callback_queued = False
        self.ctx.state = TrainingState.IDLE

    def settle_unarrived(self) -> None:
        """[Note: unused parameters]
        A trainable parameter that got no gradient in a backward keeps ``.grad = None``, as in plain
        PyTorch and FSDP2, so optimizers skip it (no weight decay, no momentum, no step count):
        a layer skipped in a step, an auxiliary head, ``torch.autograd.grad`` alone. The bucket
        still reduces (zeros where a rank has no gradient), so the collectives match whatever each
        rank computed. Whether a parameter got a gradient is decided for the whole world, as DDP's
        ``find_unused_parameters`` does: if any rank's backward reached it (a graph that depends on
        the data, an expert no token of this rank was routed to), every rank's piece of the
        averaged gradient becomes its ``.grad``, as the single-process run over the global batch
        has it, even where that piece is exactly zero (embedding rows nobody looked up). So at the
        end of every backward that reduced, the ranks sum one flag per reduced parameter: one small
        asynchronous ``all_reduce`` (two under HSDP: shard group, then replicas). Only a rank with a
        parameter it has no gradient for waits for it and reads the sums on the host; the others
        never wait (the common step, where every parameter gets one, reads nothing), and the
        collective is waited for at the next backward's end. An empty piece (the parameter lies on
        other ranks) gets its (empty) ``.grad`` by the same agreement, so every rank's optimizer
        steps the same parameters (per-parameter step counts stay equal across ranks and replicas,
        which a checkpoint's scalar state relies on)."""
        arrivals, self.ctx.arrivals = self.ctx.arrivals, []
        pending, self.ctx.unarrived = self.ctx.unarrived, []
        if self._arrival_work is not None:  # the previous backward's agreement: long done
            self._arrival_work[0].wait()
            self._arrival_work = None
        counts = None
        replicas = self.root_state.replicate_group if self.root_state.num_replicas > 1 else None
        if (self.world_size > 1 or replicas is not None) and arrivals:
            arrivals.sort(key=lambda a: a[0].index)  # the same order on every rank
            flags = torch.tensor([int(h) for _, _, has in arrivals for h in has], dtype=torch.int32)
            if self.device.type != "cpu":
                flags = flags.pin_memory().to(self.device, non_blocking=True)
            work = None
            if self.world_size > 1:
                work = dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            if replicas is not None:
                if work is not None:
                    work.wait()  # on NCCL a stream wait, not a host sync
                work = dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=replicas, async_op=True)
            self._arrival_work = (work, flags)
            counts = flags
        if not pending or counts is None:
            return  # (no other rank: nobody else could have reached them)
        self._arrival_work[0].wait()
        self._arrival_work = None
        summed = counts.tolist()
        at: dict[tuple[int, int], list[int]] = {}
        pos = 0
        for b, trainable, _ in arrivals:
            for i in trainable:
                at.setdefault((id(b), i), []).append(pos)
                pos += 1
        received = []
        for b, i, view in pending:
            if any(summed[q] > 0 for q in at.get((id(b), i), ())):
                b.sharded[i].grad = b.grad_view(i, view)
                received.append(b.sharded[i])
        run_post_accumulate_grad_hooks(received, self.ctx.streams, None)

    def abandon_backward(self) -> None:
        """A backward raised (e.g. a caught out-of-memory error) before its end-of-backward callback,
        which autograd then drops: let the reductions it left in flight finish without attaching
        them, drop the gradients it left on gathered parameters and reset, so the next forward and
        backward run normally. (Reductions done before it raised attached their ``.grad``, as plain
        PyTorch accumulates before an error; ``zero_grad`` clears them.)"""
        self.ctx.pending_reduces = []
        self.ctx.unarrived, self.ctx.arrivals = [], []
        for b in self.buckets:
            b.abandon_backward()
        self.ctx.generation += 1
        self.ctx.callback_queued = False
        self.ctx.state = TrainingState.IDLE


# ---------------------------------------------------------------------------------------------
# Helpers on nested inputs / outputs; the post-backward Function
# ---------------------------------------------------------------------------------------------
def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], _memo: dict | None = None) -> Any:
    """``obj`` with every tensor ``t`` in it replaced by ``fn(t)``, in a fixed order: pytree
    containers (tuples, lists, dicts, named tuples, registered types) and dataclass instances, which
    pytree treats as leaves (a plain ``@dataclass`` output or input, as FSDP2 accepts); a dataclass
    is copied with the new field values, or returned as is when none changed.

    ``fn`` runs once per distinct tensor: one object in is one object out wherever it appears, so a
    module that tests identity (``nn.MultiheadAttention``'s ``query is key`` fast path for
    self-attention) takes the same path as without ``fully_shard``."""
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {} if _memo is None else _memo
    leaves, spec = tree_flatten(obj)
    out = []
    for x in leaves:
        if torch.is_tensor(x):
            if id(x) not in memo:
                memo[id(x)] = (x, fn(x))  # (x kept alive so its id is not reused meanwhile)
            x = memo[id(x)][1]
        elif is_dataclass(x) and not isinstance(x, type):
            values = {f.name: getattr(x, f.name) for f in fields(x) if hasattr(x, f.name)}
            new = {k: _map_tensors(v, fn, memo) for k, v in values.items()}
            if any(new[k] is not values[k] for k in values):
                x = copy.copy(x)
                set_field = object.__setattr__ if x.__dataclass_params__.frozen else setattr
                for k, v in new.items():
                    set_field(x, k, v)
        out.append(x)
    return tree_unflatten(out, spec)


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every distinct tensor in ``obj``, in ``_map_tensors``'s order."""
    found: list[torch.Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) or t)
    return found


def _cast_tensors(obj: Any, dtype: torch.dtype) -> Any:
    return _map_tensors(obj, lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's backward is done (the
    node is created before any op of the module, so the engine runs it after them, and after the
    parameters' AccumulateGrad nodes, which it always runs first; as FSDP2 does)."""

    @staticmethod
    def forward(ctx, call: _PendingCall, *inputs: torch.Tensor):
        ctx.call = call
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        call = ctx.call
        b = call.bucket
        b.ctx.queue_final_callback()
        call.finish()
        # The module's last use is done (a group: and every module of it called with grad began its
        # backward; one whose inputs need no gradient, an embedding, is done at the end of backward).
        if b.num_pending_calls <= 0 and b.phase is not BucketPhase.REDUCED and not b.awaiting_backward:
            b.post_backward()
        return (None, *grads)


class _PendingCall:
    """One grad-enabled call of a bucket's module whose backward has not run yet.

    A module called k times reduces after its k-th backward, so each call raises the bucket's
    count and its backward lowers it. The object lives in the autograd graph (``ctx``): if the
    graph is dropped without a backward (an evaluation forward with grad enabled), it is freed and
    lowers the count then, so the next backward still reduces each bucket as soon as it is done
    instead of deferring every reduction to the end of backward. Calls from before the last end of
    backward (an older generation) no longer count."""

    __slots__ = ("bucket", "generation", "done")

    def __init__(self, bucket: _Bucket) -> None:
        self.bucket = bucket
        self.generation = bucket.ctx.generation
        self.done = False
        bucket.num_pending_calls += 1

    def finish(self) -> None:
        if not self.done:
            self.done = True
            if self.generation == self.bucket.ctx.generation:
                self.bucket.num_pending_calls -= 1

    def __del__(self) -> None:
        try:
            self.finish()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _register_post_backward(bucket: _Bucket, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    inputs = [x for x in _tensors_in((args, kwargs)) if x.requires_grad]
    if not inputs:
        return args, kwargs
    outs = dict(zip(map(id, inputs), _PostBackward.apply(_PendingCall(bucket), *inputs)))
    return _map_tensors((args, kwargs), lambda x: outs.get(id(x), x))


# ---------------------------------------------------------------------------------------------
# Guards through torch's global optimizer hooks
# ---------------------------------------------------------------------------------------------
_LIVE_RUNTIMES: weakref.WeakSet = weakref.WeakSet()
_HOOKS_INSTALLED = False
_CHECKED_OPTIMIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _optimizer_pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Checked once per optimizer (again after add_param_group): O(number of groups) per later step.
    num_params = sum(len(g["params"]) for g in optimizer.param_groups)
    if _CHECKED_OPTIMIZERS.get(optimizer) == num_params:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    check_not_replaced(params, owner=f"{type(optimizer).__name__} (at its first step)")
    materialize_all()  # lazy (meta-built, unused) buckets: the optimizer's state goes on the real device
    multi = [p for p in params if isinstance(p, RaggedDTensor) and p.ragged.num_shards > 1]
    if multi:
        plain = [p for p in params if not isinstance(p, DTensor) and p.requires_grad]
        if plain:
            warnings.warn(
                f"{type(optimizer).__name__}: {len(plain)} trainable parameter(s) (shapes "
                f"{[tuple(p.shape) for p in plain[:4]]}{' ...' if len(plain) > 4 else ''}) are not managed by "
                f"fully_shard while others are sharded over {multi[0].ragged.num_shards} ranks: their gradients are "
                "not averaged across ranks and the ranks will drift apart. Call fully_shard on the model's root "
                "module too (it shards every parameter the inner calls did not)",
                stacklevel=3,
            )
    _CHECKED_OPTIMIZERS[optimizer] = num_params


def _optimizer_post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Every rank runs the same optimizer steps, so marking every live runtime keeps the decision in
    # root_pre_forward the same on every rank (see [Note: stale gathers]).
    for rt in list(_LIVE_RUNTIMES):
        rt.ctx.num_optimizer_steps += 1


def _install_optimizer_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_optimizer_pre_step)
    register_optimizer_step_post_hook(_optimizer_post_step)
    _HOOKS_INSTALLED = True


def _register_on_tensors(obj: Any, hook: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    for x in _tensors_in(obj):
        if x.requires_grad:
            x.register_hook(hook)
    return obj
