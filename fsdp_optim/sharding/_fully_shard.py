"""``fully_shard``: the FSDP runtime over ``DistributedBuffer`` (one flat buffer per bucket).

Usage (as with PyTorch FSDP2)::

    for layer in model.layers:
        fully_shard(layer, blocks=rule)
    fully_shard(model, blocks=rule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

Each module passed to ``fully_shard`` is one *bucket*: one flat buffer, one all-gather, one
reduce-scatter. The root's bucket holds the parameters no inner bucket holds (embeddings, final
norm, head). After sharding, each managed parameter is an ``nn.Parameter`` holding this rank's
flat 1-D piece of the global tensor, a view into the bucket's segment, with a ``ShardInfo``
(``shard_info(p)``); after backward its ``.grad`` is the matching view into the gradient segment.

[Note: which call is the root]
Balance is global, so the planner must see every bucket of a model at once. Every call shards
what it is given right away, and a call on a module that contains modules sharded by earlier calls
*absorbs* them: everything under the new call is planned again, at once, with ``plan_model``, into
new ``nn.Parameter`` objects, and the absorbed parameters' pieces move shard to shard into them (one
``all_to_all_single`` per bucket; never the whole model on a rank: [Note: absorbing without the full
model]). Build the optimizer after the outermost call: one built earlier holds the replaced
parameters, which would train nothing, so its first step raises (a guard through torch's global
optimizer hooks; ours check at construction). The outermost call is
therefore the root: in the usage above ``layers.0`` is provisionally a root until
``fully_shard(model)`` absorbs every layer. Calls on two disjoint modules make two independent
roots (e.g. a student and a teacher model). Inner calls' settings (``blocks``, ``mp_policy``,
``reshard_after_forward``) stay per bucket; an inner ``blocks=None`` / ``mp_policy=None`` takes the
root's. The plan config and the mesh come from the root.

[Note: runtime]
- Forward pre-hook: all-gather the bucket (one collective, in ``param_dtype``) into a persistent
  flat buffer and swap the owners' parameters to global-shape views into it; issue the all-gather
  of the next bucket in the previous iteration's forward order before this bucket computes.
- Forward post-hook: free the gathered buffer (``reshard_after_forward=True``; the root's bucket is
  kept, as FSDP2 does, since backward needs it at once) and hook the outputs for backward.
- Pre-backward (a hook on the outputs): re-gather if freed, prefetch the bucket whose backward
  comes next (reverse post-forward order).
- Unsharded gradients land in one flat buffer in ``reduce_dtype``: when it equals ``param_dtype``
  the unsharded parameters' ``.grad`` are views into it before the bucket's backward (autograd
  accumulates in place: no copy-in), otherwise, and for the root's bucket, they are copied into it.
- Post-backward (an identity autograd Function on the module's inputs, whose backward runs once the
  module's backward is done, as FSDP2 does; or the end of backward): reduce-scatter the flat buffer
  (one collective, AVG over ranks, so a per-rank mean loss gives the gradient of the mean over the
  global batch) straight into the gradient segment; each sharded parameter's ``.grad`` becomes its
  view into it. The previous bucket's reduction is waited for when the next one is issued.
- A callback queued on the autograd engine at the end of backward runs what did not run yet
  (bucket order, the same on every rank), waits for the reductions and reshards everything.
- ``set_requires_gradient_sync(False)``: unsharded gradients are summed locally into the bucket's
  flat reduction buffer (no collective); the next synced backward reduces the sum once.

[Note: HSDP]
``mesh`` may be a 2-D ``DeviceMesh`` ``(replicate, shard)`` (``init_device_mesh(device, (R, S),
mesh_dim_names=("replicate", "shard"))``; dims found by those names, else dim 0 replicates and dim 1
shards). Invariant: *every replica holds the same layout and the same values*. The planner runs
over the shard axis only (plan world size S; ``ShardInfo.group`` / ``.rank`` are the shard group and
the shard rank), identically on every replica (the plan fingerprint is agreed across replicas at
setup), so shard rank s of every replica stores the same segment. All-gathers and the
reduce-scatter stay inside the shard group; after the reduce-scatter (AVG over S) each rank
all-reduces its reduced segment, 1/S of the bucket, with the ranks holding the same segment in
the other replicas (AVG over R, one collective per bucket; skipped where the segment is empty, on
every replica alike): the result is the mean over all R * S ranks, bit-identical on every replica,
so the optimizers, which see only ``ShardInfo`` (the shard group), run unchanged, without
communication, and keep the replicas equal. With gradient accumulation without sync neither
collective runs until the synced backward. The all-reduce of bucket i is issued once its
reduce-scatter is done, when bucket i+1's reduce-scatter is issued, and waited for one bucket
later. ``clip_grad_norm_`` reduces over ``ShardInfo.group`` only (replicas hold equal gradients);
checkpoints write one copy because every replica offers DCP the same chunks under the same keys
and DCP keeps one of each (``dedup_save_plans``); a load reads this rank's range whatever the
mesh.

Collective order is the same on every rank because it follows the autograd graph, which is the
same on every rank (same model, same code); a data-dependent graph (e.g. a rank skipping an expert)
is not supported.

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

[Note: meta-device initialization]
``fully_shard`` accepts a model built under ``torch.device("meta")``: segments are allocated on the
mesh's device (zeros). Then call ``init_weights(model)`` (``fsdp_optim.init_weights``): for each
module in ``model.modules()`` order it materializes the module's *own* parameters at full shape,
runs ``init_fn(module)`` (default ``module.reset_parameters()``) and keeps this rank's piece. With
the same seed on every rank the result equals the same initialization run unsharded, bitwise.
Element-wise in-place initialization of the flat shards (``p.normal_()``) also works;
``model.to_empty(device=...)`` is not needed (if called, values are moved back into the segments
at the next forward).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._blocks import BlockRule, BlockSpec, default_rule
from ._buffer import CollectiveHandle, DistributedBuffer, _zero_ranges
from ._float8 import Float8AllGather, Float8Gather, tile_aligned
from ._mixed_precision import MixedPrecisionPolicy
from ._plan import BucketPlan, Plan, PlanConfig, TensorSpec
from ._planner import plan_model
from ._shard_info import ShardInfo, check_not_replaced, mark_replaced, set_shard_info, shard_info

__all__ = ["fully_shard", "ShardedModule", "sharded_plan"]

_STATE = "_fsdp_optim_state"


class _TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------
def fully_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    blocks: BlockRule | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    plan_config: PlanConfig | None = None,
    fp8_all_gather: Float8AllGather | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` with block-aligned ragged layouts.

    ``mesh``: a 1-D ``DeviceMesh`` or a ``ProcessGroup`` (default: the world; without an initialized
    process group, one rank), or a 2-D ``DeviceMesh`` for HSDP: shard over one dimension, replicate
    over the other (dims named ``"replicate"`` and ``"shard"`` are found by name; otherwise dim 0
    replicates and dim 1 shards, as in FSDP2; see [Note: HSDP]). ``blocks``: an optimizer's block
    rule ``rule(fqn, param, module) -> BlockSpec`` (default: element granularity, plain FSDP).
    ``reshard_after_forward``: free the gathered parameters after forward and gather again in
    backward. ``mp_policy``: compute and reduction dtypes. ``plan_config``: planner knobs (root
    only). ``fp8_all_gather``: gather eligible (2-D) parameters as block-wise scaled
    ``float8_e4m3fn`` codes and dequantize them to the compute dtype (opt-in; see
    [Note: FP8 all-gather] below and ``Float8AllGather``); an inner ``None`` takes the root's. Returns ``module``, whose class now also derives from :class:`ShardedModule`. See the
    module docstring for the root rule.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a MixedPrecisionPolicy or None, got {type(mp_policy).__name__}")
    if plan_config is not None and not isinstance(plan_config, PlanConfig):
        raise ValueError(f"plan_config must be a PlanConfig or None, got {type(plan_config).__name__}")
    if fp8_all_gather is not None and not isinstance(fp8_all_gather, Float8AllGather):
        raise ValueError(
            f"fp8_all_gather must be a Float8AllGather or None (e.g. Float8AllGather(tile='128x128')), got "
            f"{type(fp8_all_gather).__name__}"
        )
    if blocks is not None and not callable(blocks):
        raise ValueError(
            f"blocks must be a block rule rule(fqn, param, module) -> BlockSpec (e.g. muon_rule()), got {blocks!r}"
        )
    group, rank, world_size, device, replicate_group, num_replicas = _resolve_mesh(mesh)
    existing = getattr(module, _STATE, None)
    if existing is not None:
        raise ValueError(
            f"fully_shard: module {type(module).__name__} was already passed to fully_shard (world size "
            f"{existing.world_size}); call fully_shard once per module, inner modules first, the root last"
        )
    for name, p in module.named_parameters():
        info = shard_info(p)
        if info is not None and not _is_managed_inside(module, p):
            raise ValueError(
                f"fully_shard: parameter {name} of {type(module).__name__} is already sharded by a call on an "
                f"enclosing module (as {info.fqn}); call fully_shard on inner modules before their root"
            )
    state = _ModuleState(
        module=module,
        group=group,
        rank=rank,
        world_size=world_size,
        device=device,
        replicate_group=replicate_group,
        num_replicas=num_replicas,
        blocks=blocks,
        reshard_after_forward=bool(reshard_after_forward),
        mp_policy=mp_policy,
        plan_config=plan_config,
        fp8_all_gather=fp8_all_gather,
    )
    try:
        _Runtime.build(state)  # validates on every rank and agrees before any collective
    except BaseException:
        state.remove()
        raise
    return module


def sharded_plan(module: nn.Module) -> Plan:
    """The plan of the root that manages ``module`` (for reports: ``plan_report(sharded_plan(m))``)."""
    return _runtime_of(module).plan


class ShardedModule:
    """Mixed into the class of every module passed to ``fully_shard`` (as FSDP2's ``FSDPModule``)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward accumulates unsharded gradients locally, no collective (gradient
        accumulation); the next backward with ``True`` reduces the sum once. ``recurse``: also every
        bucket under this module."""
        for b in _buckets_under(self, recurse):
            b.requires_sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Free (``True``) or keep (``False``) the gathered parameters between forward and backward."""
        for b in _buckets_under(self, recurse):
            b.reshard_after_forward = bool(reshard_after_forward) and not b.is_root

    def unshard(self) -> None:
        """Gather this module's bucket now (e.g. before a no-grad forward loop); freed at the next reshard."""
        st = getattr(self, _STATE)
        if st.bucket is not None:
            st.bucket.unshard()
            st.bucket.wait_unshard()
            st.bucket.explicit_unshard = True

    def reshard(self) -> None:
        """Free this module's gathered parameters and swap the sharded ones back."""
        st = getattr(self, _STATE)
        if st.bucket is not None:
            st.bucket.reshard()


# ---------------------------------------------------------------------------------------------
# Per-module state
# ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True, eq=False)
class _ModuleState:
    """What ``fully_shard`` recorded for one module (one bucket)."""

    module: nn.Module
    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    replicate_group: dist.ProcessGroup | None = None
    num_replicas: int = 1
    blocks: BlockRule | None
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy | None
    plan_config: PlanConfig | None
    fp8_all_gather: Float8AllGather | None = None
    runtime: _Runtime | None = None
    bucket: _Bucket | None = None
    handles: list = field(default_factory=list)

    def __post_init__(self) -> None:
        setattr(self.module, _STATE, self)
        cls = type(self.module)
        if not issubclass(cls, ShardedModule):
            self.module.__class__ = _sharded_class(cls)
        self.handles = [
            self.module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
            self.module.register_forward_hook(self._post_forward, prepend=False),
        ]

    def remove(self) -> None:
        """Undo ``__post_init__`` (a ``fully_shard`` call that failed validation leaves no trace)."""
        for h in self.handles:
            h.remove()
        self.module.__dict__.pop(_STATE, None)
        cls = type(self.module)
        if issubclass(cls, ShardedModule) and cls.__bases__[0] is ShardedModule:
            self.module.__class__ = cls.__bases__[1]

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rt = self.runtime
        if rt is None:
            return args, kwargs
        if rt.root_state is self:
            rt.root_pre_forward()
        if self.bucket is not None:
            self.bucket.pre_forward()
        mp = self.effective_mp
        if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
            args, kwargs = _cast_tensors((args, kwargs), mp.param_dtype)
        if self.bucket is not None and torch.is_grad_enabled() and rt.state is _TrainingState.FORWARD:
            args, kwargs = _register_post_backward(self.bucket, args, kwargs)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        rt = self.runtime
        if rt is None:
            return output
        if self.bucket is not None:
            self.bucket.post_forward()
            if torch.is_grad_enabled():
                output = _register_on_tensors(output, self.bucket.pre_backward_hook)
        if rt.root_state is self:
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


@functools.cache
def _sharded_class(cls: type) -> type:
    return type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})


def _buckets_under(module: nn.Module, recurse: bool) -> list[_Bucket]:
    mods = module.modules() if recurse else [module]
    out = []
    for m in mods:
        st = getattr(m, _STATE, None)
        if st is not None and st.bucket is not None:
            out.append(st.bucket)
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


def _is_managed_inside(module: nn.Module, p: torch.Tensor) -> bool:
    """``p`` belongs to a root whose module lies inside ``module`` (it will be absorbed)."""
    for m in module.modules():
        st = getattr(m, _STATE, None)
        if st is not None and st.runtime is not None and st.runtime.root_state is st:
            if any(sp is p for b in st.runtime.buckets for sp in b.sharded):
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Mesh
# ---------------------------------------------------------------------------------------------
def _resolve_mesh(
    mesh: Any,
) -> tuple[dist.ProcessGroup | None, int, int, torch.device, dist.ProcessGroup | None, int]:
    """``(shard group, shard rank, shard size, device, replicate group, number of replicas)``."""
    from torch.distributed.device_mesh import DeviceMesh

    initialized = dist.is_available() and dist.is_initialized()
    if mesh is None:
        if not initialized:
            env_world = os.environ.get("WORLD_SIZE", "1")
            if env_world.isdigit() and int(env_world) > 1:
                raise ValueError(
                    f"fully_shard: WORLD_SIZE={env_world} in the environment (launched by torchrun?) but no process "
                    "group is initialized, so every rank would train alone as a world of one; call "
                    "torch.distributed.init_process_group(...) before fully_shard (or pass mesh=...)"
                )
            return None, 0, 1, torch.device("cpu"), None, 1
        group = dist.group.WORLD
        return group, dist.get_rank(group), dist.get_world_size(group), _device_of_backend(group), None, 1
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"fully_shard needs a 1-D (shard) or 2-D (replicate, shard) DeviceMesh, got a {mesh.ndim}-D mesh of "
                f"shape {tuple(mesh.shape)} (dims {mesh.mesh_dim_names}); pass mesh['shard'] for FSDP or "
                "mesh['replicate', 'shard'] for HSDP"
            )
        device = torch.device(mesh.device_type)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        if mesh.ndim == 1:
            return mesh.get_group(), mesh.get_local_rank(), mesh.size(), device, None, 1
        names = tuple(mesh.mesh_dim_names or ())
        by_name = {"replicate", "shard"} <= set(names)
        rep, shard = (names.index("replicate"), names.index("shard")) if by_name else (0, 1)
        return (
            mesh.get_group(shard), mesh.get_local_rank(shard), mesh.size(shard), device,
            mesh.get_group(rep), mesh.size(rep),
        )  # fmt: skip
    if isinstance(mesh, dist.ProcessGroup):
        return mesh, dist.get_rank(mesh), dist.get_world_size(mesh), _device_of_backend(mesh), None, 1
    raise ValueError(
        f"mesh must be a 1-D or 2-D (replicate, shard) DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}"
    )


def _device_of_backend(group: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    if a is b:
        return True
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return (a if a is not None else world) is (b if b is not None else world)


# ---------------------------------------------------------------------------------------------
# Building a root: discovery, validation, planning, absorbing earlier roots
# ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True, eq=False)
class _Entry:
    """One managed parameter: its first name, its registrations and its bucket."""

    fqn: str
    param: torch.Tensor
    owners: list[tuple[nn.Module, str]]
    state: _ModuleState
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    requires_grad: bool = True
    spec: BlockSpec | None = None
    align_rows: int | None = None  # FP8 all-gather: rank boundaries on multiples of the tile height
    full: torch.Tensor | None = None  # the values to shard (None: uninitialized, e.g. meta)


def _discover(root: _ModuleState) -> tuple[list[_ModuleState], list[_Entry]]:
    """Recorded modules under ``root`` (pre-order, root first) and every parameter with the
    innermost recorded module that contains all of its registrations."""
    states: list[_ModuleState] = []
    seen_states: set[int] = set()
    regs: dict[int, list] = {}
    order: list[torch.Tensor] = []
    stack = [(root.module, "", ())]
    seen_mod: set[tuple[int, tuple]] = set()
    while stack:
        m, prefix, chain = stack.pop()
        st = getattr(m, _STATE, None)
        if st is not None:
            chain = (*chain, st)
            if id(st) not in seen_states:
                seen_states.add(id(st))
                states.append(st)
        key = (id(m), tuple(id(s) for s in chain))
        if key in seen_mod:
            continue
        seen_mod.add(key)
        for name, p in m._parameters.items():
            if p is None:
                continue
            if id(p) not in regs:
                regs[id(p)] = []
                order.append(p)
            regs[id(p)].append((m, name, prefix + name, chain))
        for name, c in reversed(list(m._modules.items())):
            if c is not None:
                stack.append((c, f"{prefix}{name}.", chain))
    entries = []
    for p in order:
        rs = regs[id(p)]
        common = rs[0][3]
        for r in rs[1:]:
            n = 0
            while n < min(len(common), len(r[3])) and common[n] is r[3][n]:
                n += 1
            common = common[:n]
        owners, seen_o = [], set()
        for m, name, _, _ in rs:
            if (id(m), name) not in seen_o:
                seen_o.add((id(m), name))
                owners.append((m, name))
        entries.append(_Entry(fqn=rs[0][2], param=p, owners=owners, state=common[-1]))
    return states, entries


def _validate(root: _ModuleState, states: list[_ModuleState], entries: list[_Entry]) -> None:
    """Every user error, before any collective (raised on every rank after ``_agree``)."""
    for st in states:
        if st is root:
            continue
        same_shape = (st.world_size, st.num_replicas) == (root.world_size, root.num_replicas)
        if (
            st.world_size != root.world_size
            or not _same_group(st.group, root.group)
            or st.num_replicas != root.num_replicas
            or (root.num_replicas > 1 and not _same_group(st.replicate_group, root.replicate_group))
        ):
            raise ValueError(
                f"fully_shard: {type(st.module).__name__} was sharded over a mesh of world size {st.world_size} "
                f"({st.num_replicas} replicas) but its root {type(root.module).__name__} over world size "
                f"{root.world_size} ({root.num_replicas} replicas)"
                + (" over other process groups" if same_shape else "")
                + "; pass the same mesh (the same DeviceMesh object) to every fully_shard call of a model"
            )
        if st.plan_config is not None and st.plan_config != root.plan_config:
            warnings.warn(
                f"fully_shard: plan_config of the inner call on {type(st.module).__name__} is ignored; the root's "
                "plan_config plans the whole model",
                stacklevel=4,
            )
    for e in entries:
        p = e.param
        info = shard_info(p)
        if info is not None:
            e.shape, e.requires_grad = tuple(info.shape), p.requires_grad
            e.dtype = p.dtype
            probe = torch.empty(e.shape, dtype=p.dtype, device="meta")
            probe = nn.Parameter(probe, requires_grad=p.requires_grad)
        else:
            e.shape, e.requires_grad, e.dtype = tuple(p.shape), p.requires_grad, p.dtype
            probe = p
        if not e.dtype.is_floating_point:
            raise ValueError(
                f"fully_shard: parameter {e.fqn} has dtype {e.dtype}; only floating-point parameters can be "
                "sharded (make it a buffer)"
            )
        rule = e.state.blocks or root.blocks or default_rule
        spec = rule(e.fqn, probe, e.owners[0][0])
        if not isinstance(spec, BlockSpec):
            raise ValueError(
                f"fully_shard: the block rule {getattr(rule, '__qualname__', rule)!r} returned {spec!r} "
                f"({type(spec).__name__}) for parameter {e.fqn} (shape {e.shape}); a rule must return a BlockSpec "
                "such as elements(1), rows(k), whole() or expert()"
            )
        try:
            spec.check(e.shape, e.fqn)
        except ValueError as err:
            raise ValueError(
                f"fully_shard: {err} (world size {root.world_size}); fix the block rule for this parameter"
            ) from None
        e.spec = spec
        fp8 = e.state.fp8_all_gather or root.fp8_all_gather
        e.align_rows = fp8.tile_shape[0] if fp8 is not None and fp8.eligible(e.shape) else None
    by_bucket: dict[int, list[_Entry]] = {}
    for e in entries:
        by_bucket.setdefault(id(e.state), []).append(e)
    for es in by_bucket.values():
        dtypes = {e.dtype for e in es}
        if len(dtypes) > 1:
            names = ", ".join(f"{e.fqn}: {e.dtype}" for e in es[:4])
            raise ValueError(
                f"fully_shard: the bucket of {type(es[0].state.module).__name__} mixes parameter dtypes ({names}); "
                "one bucket is one flat buffer: cast the module to one dtype (use mp_policy for bf16 compute)"
            )


def _agree(err: BaseException | None, root: _ModuleState, fingerprint: Any) -> None:
    """All ranks exchange their verdict (and a plan fingerprint) so an error raises everywhere.

    HSDP: first within the shard group, then the shard group's verdict across the replicate group,
    so every rank of the 2-D mesh learns of any rank's failure, and every replica must see the
    same model (hence plan the same layout)."""
    if not (dist.is_available() and dist.is_initialized()) or root.world_size * root.num_replicas == 1:
        if err is not None:
            raise err
        return
    problem: str | None = None
    if root.world_size > 1:
        mine = (None if err is None else f"{type(err).__name__}: {err}", fingerprint)
        out: list = [None] * root.world_size
        dist.all_gather_object(out, mine, group=root.group)
        failed = [(r, msg) for r, (msg, _) in enumerate(out) if msg is not None]
        bad = [r for r, (_, fp) in enumerate(out) if fp != fingerprint]
        if failed:
            r, msg = failed[0]
            problem = f"fully_shard failed on rank {r} of {root.world_size}: {msg}"
        elif bad:
            problem = (
                f"fully_shard: ranks {bad} plan a different layout than rank {root.rank} (parameter names, shapes, "
                "dtypes, block specs or plan_config differ); build the same model and pass the same block rule and "
                "plan_config on every rank"
            )
    elif err is not None:
        problem = f"fully_shard failed on shard rank 0 of 1: {type(err).__name__}: {err}"
    if root.num_replicas > 1:
        out = [None] * root.num_replicas
        dist.all_gather_object(out, (problem, fingerprint), group=root.replicate_group)
        me = dist.get_rank(root.replicate_group)
        if problem is None:
            failed = [(r, p) for r, (p, _) in enumerate(out) if p is not None]
            bad = [r for r, (_, fp) in enumerate(out) if fp != fingerprint]
            if failed:
                problem = f"replica {failed[0][0]} of {root.num_replicas}: {failed[0][1]}"
            elif bad:
                problem = (
                    f"fully_shard: replicas {bad} see a different model than replica {me} (parameter names, "
                    "shapes or block specs differ); every replica must build the same model and block rule"
                )
    if err is not None:
        raise err
    if problem is not None:
        raise ValueError(problem)


# ---------------------------------------------------------------------------------------------
# Runtime of one root
# ---------------------------------------------------------------------------------------------
class _Runtime:
    """Everything one root manages: its plan, one ``_Bucket`` per bucket, per-iteration state."""

    def __init__(self, root: _ModuleState, plan: Plan, buckets: list[_Bucket]) -> None:
        self.root_state = root
        self.plan = plan
        self.buckets = buckets
        self.group = root.group
        self.rank = root.rank
        self.world_size = root.world_size
        self.device = root.device
        self.state = _TrainingState.IDLE
        self.prev_forward_order: list[_Bucket] = []
        self.forward_order: list[_Bucket] = []
        self.post_forward_order: list[_Bucket] = []
        self.callback_queued = False
        self.pending_reduces: list[_Bucket] = []
        self.generation = 0  # bumped at the end of every backward (see _PendingCall)
        self.params_stepped = False  # an optimizer stepped since the last forward (see [Note: stale gathers])
        self.debug = os.environ.get("FSDP_OPTIM_DEBUG", "0") not in ("", "0")
        self.num_collectives = 0
        _LIVE_RUNTIMES.add(self)
        _install_optimizer_hooks()

    # ---- construction ----------------------------------------------------------------------
    @staticmethod
    def build(root: _ModuleState) -> _Runtime:
        err: BaseException | None = None
        fingerprint = None
        # An earlier root under this module may still be gathered (a forward without backward): swap
        # its sharded parameters back first (local, no collective) so discovery sees those.
        for m in root.module.modules():
            st = getattr(m, _STATE, None)
            if st is not None and st.runtime is not None and st.runtime.root_state is st:
                for b in st.runtime.buckets:
                    b.reshard()
        try:
            states, entries = _discover(root)
            _validate(root, states, entries)
            bucket_states = [st for st in states if any(e.state is st for e in entries)]
            specs = [
                (
                    _bucket_name(root, st),
                    [
                        TensorSpec(
                            name=e.fqn, shape=e.shape, spec=e.spec, itemsize=e.dtype.itemsize, align_rows=e.align_rows
                        )
                        for e in entries
                        if e.state is st
                    ],
                )
                for st in bucket_states
            ]
            plan = plan_model(specs, world_size=root.world_size, config=root.plan_config or PlanConfig())
            # A digest of the plan itself (not only its inputs): ranks that differ in dtypes or plan
            # config must not enter mismatched collectives; hashed so it stays small at any W.
            fingerprint = hashlib.sha256(
                repr(
                    [
                        (b.name, b.layout.value, b.itemsize, tuple(b.rank_bounds),
                         [(p.name, p.shape, str(p.spec), p.offset) for p in b.placements])
                        for b in plan.buckets
                    ]  # fmt: skip
                ).encode()
            ).hexdigest()
        except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
            err = e
        _agree(err, root, fingerprint)

        # Absorb earlier roots under this module: their parameters move shard to shard into the new
        # plan (see [Note: absorbing without the full model]); the others are sliced locally.
        old = [st.runtime for st in states if st.runtime is not None and st.runtime.root_state is st]
        for rt in old:
            for b in rt.buckets:
                b.wait_reduces()
        sources: dict[int, nn.Parameter] = {id(sp): sp for rt in old for b in rt.buckets for sp in b.sharded}
        old_bucket_of = {id(sp): b for rt in old for b in rt.buckets for sp in b.sharded}
        unmoved = {id(b): len(b.sharded) for rt in old for b in rt.buckets}
        for e in entries:
            e.full = None if id(e.param) in sources else e.param
            if e.full is not None and e.full.device.type == "meta":
                e.full = None

        buckets = []
        for i, (st, bp) in enumerate(zip(bucket_states, plan.buckets)):
            es = {e.fqn: e for e in entries if e.state is st}
            ordered = [es[pl.name] for pl in bp.placements]
            old_pieces = [sources.get(id(e.param)) for e in ordered]
            b = _Bucket(index=i, state=st, plan=bp, entries=ordered, root=root)
            if any(sp is not None for sp in old_pieces):
                _move_pieces(b, old_pieces)
            buckets.append(b)
            # Free each absorbed bucket as soon as all of its pieces have moved: the old and the new
            # shards are never both alive whole (setup peak ~ one shard plus a few buckets).
            for sp in old_pieces:
                if sp is not None:
                    ob = old_bucket_of[id(sp)]
                    unmoved[id(ob)] -= 1
                    if unmoved[id(ob)] == 0:
                        ob.release()
            del old_pieces
        for rt in old:
            rt._detach()
        rt = _Runtime(root, plan, buckets)
        for st in states:
            st.runtime = rt
            st.bucket = None
        for b in buckets:
            b.state.bucket = b
            b.runtime = rt
        _move_buffers(root.module, root.device)
        try:
            from ._checkpoint import register_state_dict_hooks
        except ImportError:  # pragma: no cover - the checkpoint module is optional
            register_state_dict_hooks = None
        if register_state_dict_hooks is not None:
            register_state_dict_hooks(root.module)
        return rt

    def _detach(self) -> None:
        """Drop this (absorbed) runtime's storage now rather than at the next cyclic GC."""
        _LIVE_RUNTIMES.discard(self)
        for b in self.buckets:
            b.release()
        self.buckets = []

    # ---- per-iteration hooks --------------------------------------------------------------
    def root_pre_forward(self) -> None:
        if self.state is _TrainingState.PRE_BACKWARD:
            return  # recomputation inside backward
        self.finish_reduces()
        self.prev_forward_order = self.forward_order
        self.forward_order, self.post_forward_order = [], []
        stepped, self.params_stepped = self.params_stepped, False
        for b in self.buckets:
            b.rebind()
            b.used = False
            # [Note: stale gathers] A bucket still gathered here was gathered by a forward whose
            # backward never ran (an evaluation forward with grad enabled, or a dropped graph), or by
            # an explicit ``unshard()``. Its values predate any optimizer step since then, so it is
            # freed and gathered again by this forward: always for the former, and for explicit
            # gathers once an optimizer has stepped (torch's global step hook, which runs on every
            # rank alike, so every rank decides the same and the collectives stay matched).
            if (b.is_unsharded or b.gather_handle is not None) and (stepped or not b.explicit_unshard):
                b.reshard()
        self.state = _TrainingState.FORWARD

    def root_post_forward(self) -> None:
        if self.state is _TrainingState.PRE_BACKWARD:
            return
        for b in self.buckets:
            if b.gather_handle is not None and not b.used:
                b.wait_unshard()  # a prefetched bucket that did not run this time
                b.reshard()
        if not torch.is_grad_enabled():
            for b in self.buckets:
                b.reshard()
        self.state = _TrainingState.IDLE

    def next_in_forward(self, b: _Bucket) -> _Bucket | None:
        order = self.prev_forward_order
        for i, x in enumerate(order[:-1]):
            if x is b:
                return order[i + 1]
        return None

    def next_in_backward(self, b: _Bucket) -> _Bucket | None:
        order = self.post_forward_order
        for i in range(len(order) - 1, 0, -1):
            if order[i] is b:
                return order[i - 1]
        return None

    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self.final_callback)

    def final_callback(self) -> None:
        for b in self.buckets:
            if not b.post_backward_done:
                b.post_backward()
        self.finish_reduces()
        for b in self.buckets:
            b.reshard()
            b.post_backward_done = False
            b.pre_backward_done = False
            b.num_pending_calls = 0
        self.generation += 1  # calls registered by graphs that backward did not reach no longer count
        self.callback_queued = False
        self.state = _TrainingState.IDLE

    def check_collective(self, b: _Bucket, op: str) -> None:
        """Debug mode (``FSDP_OPTIM_DEBUG=1``): before each collective, all ranks agree on what it is
        (bucket and operation), so a rank whose sequence differs (it skipped a module's forward, or
        backward) raises on every rank, naming it, instead of hanging or mixing up buckets."""
        if not self.debug or self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        self.num_collectives += 1
        mine = (b.plan.name, op, self.num_collectives)
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

    def issue_reduce(self, b: _Bucket) -> None:
        if b.replicate_group is None:
            self.pending_reduces.append(b)
            while len(self.pending_reduces) > 1:  # one reduction in flight, as FSDP2
                self.pending_reduces.pop(0).wait_reduces()
            return
        # HSDP: the previous bucket's reduce-scatter is done by now (its all-reduce across replicas
        # goes out while this bucket's reduce-scatter runs); the one before it completes.
        for prev in self.pending_reduces:
            prev.start_replica_reduce()
        self.pending_reduces.append(b)
        while len(self.pending_reduces) > 2:
            self.pending_reduces.pop(0).wait_reduces()

    def finish_reduces(self) -> None:
        while self.pending_reduces:
            self.pending_reduces.pop(0).wait_reduces()


def _move_pieces(bucket: _Bucket, old: list[nn.Parameter | None]) -> None:
    """Fill ``bucket``'s segment from the sharded parameters of absorbed roots, shard to shard.

    [Note: absorbing without the full model]
    A root call absorbs the roots of earlier (inner) calls and plans everything again. Rather than
    gathering those parameters back to full tensors (the whole model on every rank at once), each
    rank sends every other rank the part of its old piece that falls in that rank's new range: one
    ``all_to_all_single`` per new bucket, with split sizes computed from the old and new layouts
    alone (the same on every rank). Each absorbed bucket is freed once all of its pieces have moved,
    and gathered buffers are made at a bucket's first gather, so the peak is about one shard plus a
    few buckets (tests/sharding/test_setup_memory.py). Meta-built models move their (uninitialized)
    zeros the same way, so every rank issues the same collectives whatever the values.
    """
    rank, world = bucket.rank, bucket.buffer.world_size
    new_views = bucket.buffer.local_views()
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    recv: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in range(world)]  # (dst view, offset, size)
    for i, (sp, pl) in enumerate(zip(old, bucket.plan.placements)):
        if sp is None:
            continue
        old_layout = shard_info(sp).layout
        if old_layout.bounds[-1] != pl.shard.bounds[-1] or old_layout.world_size != world:
            raise AssertionError(f"absorbing {pl.name}: old layout {old_layout} does not match the new world")
        a_old, b_old = old_layout.range(rank)
        a_new, b_new = pl.shard.range(rank)
        piece = sp.detach().reshape(-1)
        for peer in range(world):
            lo, hi = max(a_old, pl.shard.bounds[peer]), min(b_old, pl.shard.bounds[peer + 1])
            if hi > lo:
                send[peer].append(piece[lo - a_old : hi - a_old])
            lo, hi = max(old_layout.bounds[peer], a_new), min(old_layout.bounds[peer + 1], b_new)
            if hi > lo:
                recv[peer].append((new_views[i], lo - a_new, hi - lo))
    dtype, device = bucket.buffer.dtype, bucket.buffer.device
    in_sizes = [sum(t.numel() for t in ts) for ts in send]
    out_sizes = [sum(n for _, _, n in rs) for rs in recv]
    pieces = [t.to(device=device, dtype=dtype) for ts in send for t in ts]
    inp = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(out_sizes), dtype=dtype, device=device)
    if world > 1:
        dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=bucket.buffer.group)
    else:
        out.copy_(inp)
    pos = 0
    with torch.no_grad():
        for rs in recv:
            for view, offset, n in rs:
                view[offset : offset + n].copy_(out[pos : pos + n])
                pos += n


def _bucket_name(root: _ModuleState, st: _ModuleState) -> str:
    if st is root:
        return "<root>"
    for name, m in root.module.named_modules():
        if m is st.module:
            return name
    return type(st.module).__name__


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for m in module.modules():
        for k, v in list(m._buffers.items()):
            if v is not None and v.device.type != "meta" and v.device != device:
                m._buffers[k] = v.to(device)


# ---------------------------------------------------------------------------------------------
# One bucket
# ---------------------------------------------------------------------------------------------
class _Bucket:
    """One flat buffer: sharded parameters (views into the segment), the gathered buffer and the
    unsharded parameters (views into it), and the gradient reduction."""

    def __init__(
        self, *, index: int, state: _ModuleState, plan: BucketPlan, entries: list[_Entry], root: _ModuleState
    ) -> None:
        self.index = index
        self.state = state
        self.plan = plan
        self.entries = entries
        self.is_root = state is root
        self.runtime: _Runtime | None = None
        mp = state.mp_policy or root.mp_policy or MixedPrecisionPolicy()
        master = entries[0].dtype
        self.param_dtype = mp.param_dtype or master
        self.reduce_dtype = mp.reduce_dtype or master
        self.reshard_after_forward = state.reshard_after_forward and not self.is_root
        self.requires_sync = True
        self.buffer = DistributedBuffer(plan, group=root.group, device=root.device, dtype=master)
        self.rank = self.buffer.rank
        # HSDP: the replicas of this rank's segment (see [Note: HSDP]).
        self.num_replicas = root.num_replicas
        self.replicate_group = root.replicate_group if root.num_replicas > 1 else None
        self._native_avg = self.replicate_group is not None and "nccl" in str(dist.get_backend(self.replicate_group))
        # Sharded parameters: flat views into the segment.
        self.sharded: list[nn.Parameter] = []
        with torch.no_grad():
            for e, pl, view in zip(entries, plan.placements, self.buffer.local_views()):
                if e.full is not None:
                    a, b = pl.shard.range(self.rank)
                    view.copy_(e.full.detach().reshape(-1)[a:b])
                sp = nn.Parameter(view, requires_grad=e.requires_grad)
                set_shard_info(
                    sp,
                    ShardInfo(
                        fqn=e.fqn, shape=pl.shape, spec=pl.spec, layout=pl.shard, rank=self.rank,
                        group=root.group, bucket=index, split=pl.split,
                    ),
                )
                self.sharded.append(sp)
                e.full = None
                if e.param is not sp:
                    mark_replaced(e.param, e.fqn)
                e.param = sp  # drop the original (full) tensor: it is not kept alive by the runtime
        self.expected_ptrs = [sp.data_ptr() for sp in self.sharded]
        # Gathered buffer (compute dtype) and unsharded parameters: views into its ``.data`` so the
        # collective's writes do not bump the version counter autograd saved (see the Note above).
        # Both are made at the first gather (setup never allocates a bucket at full size): then the
        # storage is freed (resized to 0) and re-allocated in place, so the views stay valid.
        self.gathered: torch.Tensor | None = None
        self.unsharded: list[nn.Parameter] | None = None
        self._gathered_nbytes = self.buffer.total_numel * self.param_dtype.itemsize
        self._device = root.device
        # FP8 all-gather (opt-in): which parameters travel as codes + scales (see [Note: FP8 all-gather]).
        fp8 = state.fp8_all_gather or root.fp8_all_gather
        self.fp8_gather: Float8Gather | None = None
        if fp8 is not None:
            flags = [fp8.eligible(pl.shape) and tile_aligned(pl, fp8.tile_shape[0]) for pl in plan.placements]
            if any(flags):
                self.fp8_gather = Float8Gather(
                    plan=plan, fp8=flags, config=fp8, param_dtype=self.param_dtype, group=root.group,
                    device=root.device, even=self.buffer.is_even,
                )
        self.num_trainable = sum(1 for e in entries if e.requires_grad)
        self.trainable_local = [i for i, e in enumerate(entries) if e.requires_grad]
        # Per-iteration state.
        self.is_unsharded = False
        self.gather_handle: CollectiveHandle | None = None
        self.reduce_handle: CollectiveHandle | None = None
        self.flat_grad: torch.Tensor | None = None  # unsharded gradients, flat, in reduce_dtype
        self.flat_views: list[torch.Tensor] | None = None
        self.attached = [False] * len(entries)
        self.grad_seg: torch.Tensor | None = None  # the segment a pending reduction writes
        self.replica_work: dist.Work | None = None  # HSDP: the pending all-reduce across replicas
        self._replica_out: tuple[torch.Tensor, bool] | None = None  # (reduced shard, add it to grad_seg)
        self._grad_seg_ref: weakref.ref | None = None  # see [Note: gradient segment lifetime]
        self.used = False
        self.explicit_unshard = False  # gathered by ShardedModule.unshard(), not by a forward
        self.pre_backward_done = False
        self.post_backward_done = False
        self.num_pending_calls = 0
        self._set_params(self.sharded)

    def release(self) -> None:
        """Drop this (absorbed) bucket's storage. Its modules already hold the new root's parameters
        (it was resharded at the start of the new root's build), so nothing is re-registered."""
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None
        for sp in self.sharded:
            mark_replaced(sp, shard_info(sp).fqn)
            sp.data = sp.data.new_empty(0)  # the segment is freed even if someone holds the parameter
        self.buffer = self.gathered = self.flat_grad = self.flat_views = self.grad_seg = self.fp8_gather = None
        self.sharded, self.unsharded, self.entries = [], [], []

    # ---- parameters -------------------------------------------------------------------------
    def _set_params(self, params: list[nn.Parameter]) -> None:
        for e, p in zip(self.entries, params):
            for m, name in e.owners:
                m._parameters[name] = p

    def _free_gathered(self) -> None:
        if self.gathered is not None:
            self.gathered.untyped_storage().resize_(0)

    @torch._dynamo.disable  # runs eagerly even inside a compiled module's hooks (it makes Parameters)
    def _alloc_gathered(self) -> None:
        if self.gathered is None:
            self.gathered = torch.empty(self.buffer.total_numel, dtype=self.param_dtype, device=self._device)
            self.unsharded = [
                nn.Parameter(view, requires_grad=e.requires_grad)
                for e, view in zip(self.entries, self.buffer.full_views(self.gathered.data))
            ]
        elif self.gathered.untyped_storage().nbytes() == 0:
            self.gathered.untyped_storage().resize_(self._gathered_nbytes)

    def rebind(self) -> None:
        """Re-point sharded parameters whose ``.data`` was replaced (``module.to_empty`` / ``.to``)."""
        for i, (sp, ptr) in enumerate(zip(self.sharded, self.expected_ptrs)):
            if sp.data_ptr() != ptr and sp.numel() > 0:
                view = self.buffer.local_views()[i]
                with torch.no_grad():
                    if sp.data.device.type != "meta":
                        view.copy_(sp.data.reshape(-1))
                sp.data = view

    # ---- gather / free ---------------------------------------------------------------------
    def unshard(self) -> None:
        """Issue the all-gather (async); no-op when gathered or in flight."""
        if self.is_unsharded or self.gather_handle is not None:
            return
        self.runtime.check_collective(self, "all_gather")
        self._alloc_gathered()
        seg = self.buffer.segment
        if self.fp8_gather is not None:
            self.gather_handle = _Float8Handle(self.fp8_gather, self.fp8_gather.buffer.all_gather(
                src=self.fp8_gather.pack(seg), async_op=True), self.gathered, self.buffer._full_padding)
            return
        src = seg if seg.dtype == self.param_dtype else seg.to(self.param_dtype)
        self.gather_handle = self.buffer.all_gather(src=src, out=self.gathered, async_op=True)

    def wait_unshard(self) -> None:
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None
            self.is_unsharded = True
        if self.is_unsharded:
            self._set_params(self.unsharded)

    def reshard(self) -> None:
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None
            self.is_unsharded = True
        self._set_params(self.sharded)
        self.explicit_unshard = False
        if self.is_unsharded:
            self._free_gathered()
            self.is_unsharded = False

    # ---- forward ----------------------------------------------------------------------------
    def pre_forward(self) -> None:
        rt = self.runtime
        if rt.state is _TrainingState.PRE_BACKWARD:  # recomputation (activation checkpointing)
            self.unshard()
            self.wait_unshard()
            return
        self.used = True
        rt.forward_order.append(self)
        self.unshard()
        nxt = rt.next_in_forward(self)
        if nxt is not None:
            nxt.unshard()  # prefetch: issued before this bucket computes
        self.wait_unshard()

    def post_forward(self) -> None:
        rt = self.runtime
        if rt.state is _TrainingState.PRE_BACKWARD:
            return
        rt.post_forward_order.append(self)
        if self.reshard_after_forward:
            self.reshard()
        else:
            self._set_params(self.sharded)  # the module shows its sharded parameters between passes

    # ---- backward ---------------------------------------------------------------------------
    def pre_backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        rt.queue_final_callback()
        if self.pre_backward_done:
            return grad
        self.pre_backward_done = True
        rt.state = _TrainingState.PRE_BACKWARD
        self.unshard()
        nxt = rt.next_in_backward(self)
        if nxt is not None:
            nxt.unshard()  # prefetch the bucket whose backward runs next
        self.wait_unshard()
        self._attach_grad_views()
        return grad

    def _ensure_flat_grad(self) -> None:
        if self.flat_grad is None:
            self.flat_grad = torch.zeros(self.buffer.total_numel, dtype=self.reduce_dtype, device=self.buffer.device)
            self.flat_views = self.buffer.full_views(self.flat_grad)

    def _attach_grad_views(self) -> None:
        """Zero copy: make each unsharded parameter's ``.grad`` a view into the flat reduction buffer,
        so autograd accumulates into it in place and the bucket reduces without a copy-in (and
        without the unsharded gradients and the flat buffer both alive). Only where the compute
        and reduction dtypes agree; otherwise ``post_backward`` copies (casting) instead. Not for the
        root's bucket: its gradients arrive across the whole backward (head first, embedding last),
        so a flat buffer held from the start would outweigh the copy at the end."""
        if self.num_trainable == 0 or self.param_dtype != self.reduce_dtype or self.is_root:
            return
        self._ensure_flat_grad()
        for i, up in enumerate(self.unsharded):
            if up.requires_grad and up.grad is None:
                up.grad = self.flat_views[i]
                self.attached[i] = True

    def post_backward(self) -> None:
        """Reduce-scatter this bucket's gradients (or accumulate them without sync) and reshard."""
        self.post_backward_done = True
        if self.num_trainable == 0:
            self.reshard()
            return
        self._ensure_flat_grad()
        flat = self.flat_grad
        with torch.no_grad():
            for i, up in enumerate(self.unsharded):
                g = up.grad
                if g is None:
                    continue
                view = self.flat_views[i]
                if not _same_view(g, view):
                    if self.attached[i]:
                        view.copy_(g)  # autograd accumulated out of place: g = view + new
                    else:
                        view.add_(g)  # a cast (mixed precision) or a gradient we did not attach
                up.grad = None
        self.attached = [False] * len(self.entries)
        self.reshard()
        if not self.requires_sync:
            return  # keep summing into flat_grad (gradient accumulation without sync)
        self.flat_grad = self.flat_views = None
        self.runtime.check_collective(self, "reduce_scatter")
        accumulate = self._prepare_grad_segment()
        out = self.grad_seg
        if self.replicate_group is not None and (accumulate or self.reduce_dtype != self.buffer.dtype):
            # The replicas all-reduce only this backward's reduced shard, in reduce_dtype; it is added
            # to (or cast into) the gradient segment afterwards.
            out = torch.empty(self.buffer.segment_numel, dtype=self.reduce_dtype, device=self.buffer.device)
        self.reduce_handle = self.buffer.reduce_scatter(
            flat, out=out, op=dist.ReduceOp.AVG, accumulate=accumulate and out is self.grad_seg, async_op=True
        )
        self._replica_out = (out, accumulate) if self.replicate_group is not None else None
        self.runtime.issue_reduce(self)

    def _prepare_grad_segment(self) -> bool:
        """Choose the gradient segment the reduction writes; returns whether it adds to it.

        [Note: gradient segment lifetime]
        The runtime keeps only a weak reference to the gradient segment once the sharded ``.grad``
        views are set, so ``zero_grad(set_to_none=True)`` frees it, as it frees gradients in plain
        PyTorch. If the parameters' ``.grad`` are still our views (``set_to_none=False``, or no
        ``zero_grad``), the reduction adds into that segment; if all are ``None`` a new segment is
        allocated and overwritten (a segment someone else still references is never reused)."""
        seg = self._grad_seg_ref() if self._grad_seg_ref is not None else None
        grads = [self.sharded[i].grad for i in self.trainable_local]
        if all(g is None for g in grads):
            self.grad_seg = torch.empty(self.buffer.segment_numel, dtype=self.buffer.dtype, device=self.buffer.device)
            return False
        views = self.buffer.local_views(seg) if seg is not None else None
        if views is None or not any(g is not None and _same_view(g, views[i]) for i, g in zip(self.trainable_local, grads)):
            seg = torch.zeros(self.buffer.segment_numel, dtype=self.buffer.dtype, device=self.buffer.device)
            views = self.buffer.local_views(seg)
        with torch.no_grad():
            for i, g in zip(self.trainable_local, grads):
                view = views[i]
                if view.numel() == 0 or (g is not None and _same_view(g, view)):
                    continue
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g.reshape(-1))
        self.grad_seg = seg
        return True

    def start_replica_reduce(self) -> None:
        """HSDP: once the reduce-scatter is done, issue the all-reduce of the reduced shard across the
        replicas (async; no-op without replicas, or when already issued or done)."""
        if self.reduce_handle is None or self._replica_out is None or self.replica_work is not None:
            return
        self.reduce_handle.wait()
        out = self._replica_out[0]
        if out.numel() == 0:  # every replica of this shard rank holds the same (empty) segment
            self.replica_work = _DONE
            return
        op = dist.ReduceOp.AVG if self._native_avg else dist.ReduceOp.SUM
        self.replica_work = dist.all_reduce(out, op=op, group=self.replicate_group, async_op=True)

    def wait_reduces(self) -> None:
        if self.reduce_handle is None:
            return
        self.reduce_handle.wait()
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
        for i in self.trainable_local:
            sp = self.sharded[i]
            if sp.grad is None or not _same_view(sp.grad, views[i]):
                sp.grad = views[i]
        self._grad_seg_ref = weakref.ref(seg)


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
            _zero_ranges(self._out, self._padding)
            self._done, self._inner = True, None
        return self._out

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()


class _Done:
    """A completed ``dist.Work`` stand-in (a collective every peer skips too)."""

    def wait(self) -> bool:
        return True


_DONE = _Done()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


# ---------------------------------------------------------------------------------------------
# Helpers on nested inputs / outputs
# ---------------------------------------------------------------------------------------------
def _cast_tensors(obj: Any, dtype: torch.dtype) -> Any:
    leaves, spec = tree_flatten(obj)
    leaves = [x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() and x.dtype != dtype else x for x in leaves]
    return tree_unflatten(leaves, spec)


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
        b.runtime.queue_final_callback()
        call.finish()
        if b.num_pending_calls <= 0 and not b.post_backward_done:  # the module's last use is done
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
        self.generation = bucket.runtime.generation
        self.done = False
        bucket.num_pending_calls += 1

    def finish(self) -> None:
        if not self.done:
            self.done = True
            if self.generation == self.bucket.runtime.generation:
                self.bucket.num_pending_calls -= 1

    def __del__(self) -> None:
        try:
            self.finish()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _register_post_backward(bucket: _Bucket, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    leaves, spec = tree_flatten((args, kwargs))
    idx = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
    if idx:
        outs = _PostBackward.apply(_PendingCall(bucket), *(leaves[i] for i in idx))
        for i, o in zip(idx, outs):
            leaves[i] = o
    return tree_unflatten(leaves, spec)


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
    sharded = [shard_info(p) for p in params]
    multi = [i for i in sharded if i is not None and i.world_size > 1]
    if multi:
        plain = [p for p, i in zip(params, sharded) if i is None and p.requires_grad]
        if plain:
            warnings.warn(
                f"{type(optimizer).__name__}: {len(plain)} trainable parameter(s) (shapes "
                f"{[tuple(p.shape) for p in plain[:4]]}{' ...' if len(plain) > 4 else ''}) are not managed by "
                f"fully_shard while others are sharded over {multi[0].world_size} ranks: their gradients are not "
                "averaged across ranks and the ranks will drift apart. Call fully_shard on the model's root module "
                "too (it shards every parameter the inner calls did not)",
                stacklevel=3,
            )
    _CHECKED_OPTIMIZERS[optimizer] = num_params


def _optimizer_post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Every rank runs the same optimizer steps, so marking every live runtime keeps the decision in
    # root_pre_forward the same on every rank (see [Note: stale gathers]).
    for rt in list(_LIVE_RUNTIMES):
        rt.params_stepped = True


def _install_optimizer_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_optimizer_pre_step)
    register_optimizer_step_post_hook(_optimizer_post_step)
    _HOOKS_INSTALLED = True


def _register_on_tensors(obj: Any, hook: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    leaves, _ = tree_flatten(obj)
    for x in leaves:
        if torch.is_tensor(x) and x.requires_grad:
            x.register_hook(hook)
    return obj
