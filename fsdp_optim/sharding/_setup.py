"""Building a root: mesh, discovery, validation, agreement, planning, absorbing earlier roots.

``build_runtime`` runs inside ``fully_shard``. Every user error is found before any collective and
agreed on by every rank (``_agree``), so a bad call raises on all ranks instead of hanging one.

[Note: meta-device initialization]
``fully_shard`` accepts a model built under ``torch.device("meta")``. A bucket whose parameters are
all meta-built and that absorbs nothing is *lazy*: its sharded parameters are views of a segment
with no memory, so the provisional plans of inner calls, and the root's own bucket, cost nothing
at setup (the peak stays at the final shard: ``benchmarks/fake_scale.py``). It gets its memory,
zero-filled and in place (the same ``Parameter`` objects, so whoever holds them sees it), at its
first use: a gather (forward), ``init_weights``, a state dict, checkpoint or export, an optimizer
of ours at construction, a torch optimizer at its first step. Do not read such parameters
directly before that (they have no values yet, as on meta). When a root absorbs a lazy bucket,
its pieces are sent as zeros, so every rank issues the same collectives whatever it allocated.
Then call ``init_weights(model)`` (``fsdp_optim.init_weights``): for each
module in ``model.modules()`` order it materializes the module's *own* parameters at full shape,
runs ``init_fn(module)`` (default ``module.reset_parameters()``) and keeps this rank's piece. With
the same seed on every rank the result equals the same initialization run unsharded, bitwise.
Element-wise in-place initialization of the flat shards (``p.normal_()``) draws from each rank's
own generator: with the same seed on every rank, every rank's piece of a tensor gets the same
numbers (duplicated rows), so seed each rank differently (``torch.manual_seed(seed + rank)``), or
use ``init_weights`` to equal the unsharded initialization. On a meta-built model do it after
``init_weights`` or a first forward (a lazy bucket's shards have no memory before).
``model.to_empty(device=...)`` is not needed (if called, values are moved back into the segments
at the next use).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ._bucket import BucketConfig, _Bucket
from ._context import CommContext, Streams
from ._dist import agree_on_error, backend_device, same_group
from ._expert_parallel import expert_shard
from ._mixed_precision import MixedPrecisionPolicy
from ._runtime import _STATE, _ModuleState, _Runtime
from ._dtensor import RaggedDTensor, ragged_spec
from ._placement import RaggedShard
from ._tensor_parallel import TensorParallel, join_meshes, tensor_parallel_of, tp_cuts_blocks
from ._replaced import replacement_of, was_replaced
from .plan import BlockKind, BlockSpec, Plan, PlanConfig, RaggedLayout, TensorSpec, config_for_rules, default_rule, plan_model, whole

logger = logging.getLogger(__name__)  # a child of "fsdp_optim": logging.getLogger("fsdp_optim").setLevel(...)


# ---------------------------------------------------------------------------------------------
# Mesh
# ---------------------------------------------------------------------------------------------
class ResolvedMesh(NamedTuple):
    """What ``fully_shard``'s ``mesh`` argument resolves to."""

    group: dist.ProcessGroup
    """The shard group (the planner's ranks)."""
    rank: int
    world_size: int
    device: torch.device
    replicate_group: dist.ProcessGroup | None
    num_replicas: int
    device_mesh: DeviceMesh
    """The sharded parameters' ``DeviceMesh`` (1-D, or HSDP's 2-D)."""
    shard_dim: int
    """The mesh dimension their ``RaggedShard`` placement lies on."""


def _no_process_group_error() -> ValueError:
    env_world = os.environ.get("WORLD_SIZE", "1")
    launched = env_world.isdigit() and int(env_world) > 1
    return ValueError(
        (f"fully_shard: WORLD_SIZE={env_world} in the environment (launched by torchrun?) but no process group is "
         "initialized; call torch.distributed.init_process_group(...) before fully_shard (or pass mesh=...)")
        if launched else
        ("fully_shard: no process group is initialized. A sharded parameter is a DTensor, which lives on a "
         "DeviceMesh: call torch.distributed.init_process_group(...) first (under torchrun), or for one process "
         "torch.distributed.init_process_group('gloo', store=torch.distributed.HashStore(), rank=0, world_size=1)")
    )  # fmt: skip


def _resolve_mesh(mesh: Any) -> ResolvedMesh:
    """``fully_shard``'s ``mesh``: None (the world), a ``ProcessGroup``, or a 1-D / 2-D ``DeviceMesh``."""
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized:
        raise _no_process_group_error()
    if mesh is None or isinstance(mesh, dist.ProcessGroup):
        group = dist.group.WORLD if mesh is None else mesh
        device = backend_device(group)
        device_mesh = DeviceMesh.from_group(group, device.type)
        return ResolvedMesh(group, dist.get_rank(group), dist.get_world_size(group), device, None, 1, device_mesh, 0)
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
            return ResolvedMesh(mesh.get_group(), mesh.get_local_rank(), mesh.size(), device, None, 1, mesh, 0)
        names = tuple(mesh.mesh_dim_names or ())
        by_name = {"replicate", "shard"} <= set(names)
        rep, shard = (names.index("replicate"), names.index("shard")) if by_name else (0, 1)
        return ResolvedMesh(
            mesh.get_group(shard), mesh.get_local_rank(shard), mesh.size(shard), device,
            mesh.get_group(rep), mesh.size(rep), mesh, shard,
        )  # fmt: skip
    raise ValueError(
        f"mesh must be a 1-D or 2-D (replicate, shard) DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}"
    )


def _is_separate_root(st: _ModuleState, root: _ModuleState) -> bool:
    """[Note: separate roots]
    An earlier root whose mesh differs from this call's (another process group, e.g. the experts of
    a mixture-of-experts layer sharded over the ranks that hold the same experts under expert
    parallelism) is not absorbed: it keeps its own plan, buckets and hooks, and this call plans the
    rest. Its forward gathers and its backward reduces over its own group; each root queues its own
    end-of-backward callback. Only a root that asked for it (``separate_root``: set for the
    experts of ``expert_parallel``) is kept apart: any other call over another mesh is an error
    (``_validate``), since a module whose gradients are not averaged over the data-parallel ranks
    would silently drift."""
    rt = st.runtime
    if rt is None or rt.root_state is not st or not st.separate_root:
        return False
    return st.world_size != root.world_size or not same_group(st.group, root.group) or (
        st.num_replicas != root.num_replicas
        or (root.num_replicas > 1 and not same_group(st.replicate_group, root.replicate_group))
    )


def _is_managed_inside(module: nn.Module, p: torch.Tensor) -> bool:
    """``p`` belongs to a root whose module lies inside ``module`` (it will be absorbed)."""
    for m in module.modules():
        st = getattr(m, _STATE, None)
        if st is not None and st.runtime is not None and st.runtime.root_state is st:
            if any(sp is p for b in st.runtime.buckets for sp in b.sharded):
                return True
    return False


# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Discovery, validation, agreement
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
    tp: TensorParallel | None = None  # a tensor-parallel parameter ([Note: FSDP x TP])
    tp_blocks: BlockSpec | None = None  # its global blocks, where the TP cut splits them


def _discover(root: _ModuleState) -> tuple[list[_ModuleState], list[_Entry]]:
    """Recorded modules under ``root`` (pre-order, root first) and every parameter with the
    innermost recorded module that contains all of its registrations."""
    states: list[_ModuleState] = []
    seen_states: set[int] = set()
    regs: dict[int, list] = {}
    order: list[torch.Tensor] = []
    mapped: dict[int, tuple[str, torch.Tensor]] = {}  # replacements reached through a registered original
    direct: set[int] = set()  # parameters registered as themselves
    # A group root (``fully_shard([a, b])`` with no enclosing call) names its modules' parameters
    # "0.", "1.", ... as an ``nn.ModuleList`` of them would.
    prefixes = [f"{i}." for i in range(len(root.modules))] if root.is_group else [""]
    stack = [(m, prefix, ()) for m, prefix in reversed(list(zip(root.modules, prefixes)))]
    seen_mod: set[tuple[int, tuple]] = set()
    while stack:
        m, prefix, chain = stack.pop()
        st = getattr(m, _STATE, None)
        if st is not None and st is not root and _is_separate_root(st, root):
            continue  # sharded over another group (e.g. experts under expert parallelism): stays its own root
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
            r = replacement_of(p)
            if r is not None:
                # A module outside an earlier fully_shard call still holds the parameter that call
                # replaced (a weight tied across the call's boundary): it is the same parameter.
                mapped[id(r)] = (prefix + name, r)
                p = r
            elif was_replaced(p):
                raise ValueError(
                    f"fully_shard: {prefix + name} holds a parameter that an earlier fully_shard call replaced and "
                    "freed; register the sharded parameter (or shard the model before replacing parameters)"
                )
            else:
                direct.add(id(p))
            if id(p) not in regs:
                regs[id(p)] = []
                order.append(p)
            regs[id(p)].append((m, name, prefix + name, chain))
        for name, c in reversed(list(m._modules.items())):
            if c is not None:
                stack.append((c, f"{prefix}{name}.", chain))
    for pid, (where, r) in mapped.items():
        if pid not in direct:  # the call that replaced it is not under this one
            raise ValueError(
                f"fully_shard: {where} (shape {tuple(r.shape)}) shares its parameter with a module "
                "sharded by a separate fully_shard call, not nested in this one. "
                "Modules sharing a parameter (e.g. a tied embedding and output head) must be sharded by one call "
                "containing all of them: call fully_shard on their common parent (e.g. the root) and not on each"
            )
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


def _tp_blocks(e: _Entry, rule: Any, root: _ModuleState) -> BlockSpec | None:
    """The block rule's spec of a TP parameter's global tensor if the TP cut splits its blocks
    (``RaggedShard.tp_blocks``), else ``None``."""
    tp = e.tp
    probe = nn.Parameter(torch.empty(tp.global_shape, dtype=e.dtype, device="meta"), requires_grad=e.requires_grad)
    spec = rule(e.fqn, probe, e.owners[0][0])
    try:
        spec.check(tp.global_shape, e.fqn)
    except ValueError as err:
        raise ValueError(f"fully_shard: {err} (global shape of a tensor-parallel parameter); fix the block rule") from None
    cut = tp_cuts_blocks(spec, tp.global_shape, e.spec, tp.local_shape, tp.dim, tp.mesh.size(), fqn=e.fqn)
    return spec if cut else None


def _tp_of_sharded(states: list[_ModuleState]) -> dict[int, TensorParallel]:
    """The TP layouts of parameters earlier roots under this call sharded (their owners keep them)."""
    return {
        id(sp.sharded): sp.tp
        for st in states if st.runtime is not None and st.runtime.root_state is st
        for b in st.runtime.buckets for sp in b.params if sp.tp is not None
    }  # fmt: skip


def _validate(root: _ModuleState, states: list[_ModuleState], entries: list[_Entry]) -> None:
    """Every user error, before any collective (raised on every rank after ``_agree``)."""
    tps = _tp_of_sharded(states)
    for st in states:
        if st is root:
            continue
        same_shape = (st.world_size, st.num_replicas) == (root.world_size, root.num_replicas)
        if (
            st.world_size != root.world_size
            or not same_group(st.group, root.group)
            or st.num_replicas != root.num_replicas
            or (root.num_replicas > 1 and not same_group(st.replicate_group, root.replicate_group))
        ):
            raise ValueError(
                f"fully_shard: {_describe(st)} was sharded over a mesh of world size {st.world_size} "
                f"({st.num_replicas} replicas) but its root {_describe(root)} over world size "
                f"{root.world_size} ({root.num_replicas} replicas)"
                + (" over other process groups" if same_shape else "")
                + (
                    "; only an expert_parallel experts module may be sharded over fewer ranks than its root: for "
                    "experts, the order is expert_parallel first, then fully_shard (groups = "
                    "expert_parallel_groups(ep); expert_parallel(experts, group=groups.ep); fully_shard(experts, "
                    "mesh=groups.replicas)); otherwise pass the same mesh (the same DeviceMesh object) to every "
                    "fully_shard call of a model"
                    if st.world_size * st.num_replicas < root.world_size * root.num_replicas
                    else "; pass the same mesh (the same DeviceMesh object) to every fully_shard call of a model"
                )
            )
        if st.plan_config is not None and st.plan_config != root.plan_config:
            warnings.warn(
                f"fully_shard: plan_config of the inner call on {_describe(st)} is ignored; the root's "
                "plan_config plans the whole model",
                stacklevel=4,
            )
    for e in entries:
        p = e.param
        if expert_shard(p) is not None and not e.state.separate_root:
            raise ValueError(
                f"fully_shard: {e.fqn} (local shape {tuple(p.shape)}) belongs to an expert_parallel module that "
                f"{_describe(e.state)}'s call would plan with the rest of the model over world size "
                f"{root.world_size}; call fully_shard on the experts module itself first, over the ranks that hold "
                "the same experts (expert_parallel_groups(...).replicas), then on the enclosing modules"
            )
        if isinstance(p, RaggedDTensor):  # sharded by an inner call: planned again here
            e.tp = tps.get(id(p))
            e.shape, e.requires_grad = p.local_shape, p.requires_grad
            e.dtype = p.dtype
            probe = torch.empty(e.shape, dtype=p.dtype, device="meta")
            probe = nn.Parameter(probe, requires_grad=p.requires_grad)
        else:
            e.tp = tensor_parallel_of(p, e.fqn)  # a DTensor of parallelize_module: its TP-local tensor is planned
            e.shape, e.requires_grad, e.dtype = tuple(p.shape), p.requires_grad, p.dtype
            probe = p
            if e.tp is not None:
                e.shape = e.tp.local_shape
                probe = nn.Parameter(torch.empty(e.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
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
        if e.tp is not None and e.tp.dim is not None:
            e.tp_blocks = _tp_blocks(e, rule, root)
            if e.tp_blocks is not None and e.tp.dim == 0 and e.tp_blocks.kind is BlockKind.ROWS:
                # a TP cut on rows through row strips: a global strip spans TP-local tensors, which only a
                # whole TP-local tensor keeps on one data-parallel coordinate of every TP rank ([Note:
                # preconditioner blocks under tensor parallelism] in optimizers/_tp_runs.py)
                e.spec = whole()
        fp8 = e.state.fp8_all_gather or root.fp8_all_gather
        e.align_rows = fp8.tile_shape[0] if fp8 is not None and fp8.eligible(e.shape) else None
    meshes = {id(e.tp.mesh): e for e in entries if e.tp is not None}
    if len(meshes) > 1:
        a, b = list(meshes.values())[:2]
        raise ValueError(
            f"fully_shard: {a.fqn} and {b.fqn} are tensor-parallel over different meshes ({a.tp.mesh} and "
            f"{b.tp.mesh}); parallelize the model over one TP mesh (mesh['tp'])"
        )
    if meshes and root.separate_root:
        e = next(iter(meshes.values()))
        raise ValueError(
            f"fully_shard: {e.fqn} is tensor-parallel inside an expert_parallel experts module; expert parallelism "
            "with tensor-parallel experts is not supported (docs/tensor-parallel.md): keep the experts out of the TP "
            "plan"
        )
    by_bucket: dict[int, list[_Entry]] = {}
    for e in entries:
        by_bucket.setdefault(id(e.state), []).append(e)
    for es in by_bucket.values():
        dtypes = {e.dtype for e in es}
        if len(dtypes) > 1:
            names = ", ".join(f"{e.fqn}: {e.dtype}" for e in es[:4])
            raise ValueError(
                f"fully_shard: the bucket of {_describe(es[0].state)} mixes parameter dtypes ({names}); "
                "one bucket is one flat buffer: cast the module to one dtype (use mp_policy for bf16 compute)"
            )


_FINGERPRINT_PARTS = {
    "layout": "the planned layout (parameter names, shapes, dtypes or block specs)",
    "plan_config": "plan_config",
    "mp_policy": "a bucket's mp_policy (param_dtype, reduce_dtype, output_dtype or cast_forward_inputs)",
    "reshard_after_forward": "a bucket's reshard_after_forward",
    "fp8_all_gather": "a bucket's fp8_all_gather",
    "experts": "the experts they hold (shard an expert_parallel module over the ranks that hold the same "
    "experts: expert_parallel_groups(...).replicas)",
}


def _fingerprint(root: _ModuleState, plan: Plan, bucket_states: list[_ModuleState]) -> dict[str, str]:
    """Digests, by what a user sets, of everything that decides which collectives a bucket issues and
    their sizes: the plan itself (not only its inputs), and the per-call settings the buckets are
    built from (the wire mode follows from the plan, ``plan_config.wire`` and ``param_dtype``). Ranks
    that differ in any must not enter mismatched collectives (a hang, or gloo aborting the process
    on a size mismatch); hashed so it stays small at any W."""

    def digest(x: Any) -> str:
        return hashlib.sha256(repr(x).encode()).hexdigest()[:32]

    return {
        "layout": digest(
            [
                (b.name, b.layout.value, b.itemsize, tuple(b.rank_bounds),
                 [(p.name, p.shape, str(p.spec), p.offset) for p in b.placements])
                for b in plan.buckets
            ]  # fmt: skip
        ),
        "plan_config": digest(root.plan_config or PlanConfig()),
        "mp_policy": digest([st.mp_policy or root.mp_policy for st in bucket_states]),
        "reshard_after_forward": digest([_reshard_after_forward(st, root) for st in bucket_states]),
        "fp8_all_gather": digest([st.fp8_all_gather or root.fp8_all_gather for st in bucket_states]),
        "experts": digest(
            [(es.first_expert, es.num_local_experts) for m in root.modules for p in m.parameters() if (es := expert_shard(p))]
        ),
    }


def _differences(mine: dict[str, str] | None, theirs: dict[str, str] | None) -> str:
    if mine is None or theirs is None:
        return "the planned layout"
    return ", ".join(_FINGERPRINT_PARTS[k] for k in mine if mine[k] != theirs.get(k)) or "the planned layout"


def _agree(err: BaseException | None, root: _ModuleState, fingerprint: Any, world_payload: Any = None) -> list[Any] | None:
    """All ranks exchange their verdict (and a plan fingerprint) so an error raises everywhere.

    HSDP: first within the shard group, then the shard group's verdict across the replicate group,
    so every rank of the 2-D mesh learns of any rank's failure, and every replica must see the
    same model (hence plan the same layout)."""
    problem = err
    if root.world_size > 1:
        try:
            prints = agree_on_error(err, group=root.group, what="fully_shard", payload=fingerprint)
            bad = [r for r, fp in enumerate(prints) if fp != fingerprint]
            if bad:
                problem = ValueError(
                    f"fully_shard: ranks {bad} of {root.world_size} differ from rank {root.rank} in "
                    f"{_differences(fingerprint, prints[bad[0]])}; build the same model and pass the same block "
                    "rule and the same fully_shard arguments (plan_config, mp_policy, reshard_after_forward, "
                    "fp8_all_gather) on every rank"
                )
        except Exception as e:  # noqa: BLE001 - agreed within the shard group; the replicas learn it next
            problem = e
    if root.num_replicas > 1:
        try:
            prints = agree_on_error(problem, group=root.replicate_group, what="fully_shard (replica)", payload=fingerprint)
            bad = [r for r, fp in enumerate(prints) if fp != fingerprint]
            if bad:
                me = dist.get_rank(root.replicate_group)
                problem = ValueError(
                    f"fully_shard: replicas {bad} of {root.num_replicas} differ from replica {me} in "
                    f"{_differences(fingerprint, prints[bad[0]])}; every replica must build the same model and "
                    "pass the same block rule and fully_shard arguments"
                )
        except Exception as e:  # noqa: BLE001
            problem = e
    if root.separate_root:  # (expert parallel: the world also learns each rank's experts' layouts)
        return agree_on_error(problem, group=None, what="fully_shard (experts)", payload=world_payload)
    if problem is not None:
        raise problem
    return None


# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Planning and absorbing
# ---------------------------------------------------------------------------------------------
def build_runtime(root: _ModuleState) -> _Runtime:
    """Plan everything under ``root`` at once, absorb earlier roots under it, return its runtime."""
    # An earlier root under this module may still be gathered (a forward without backward): swap
    # its sharded parameters back first (local, no collective) so discovery sees those.
    for m in (m for top in root.modules for m in top.modules()):
        st = getattr(m, _STATE, None)
        if st is not None and st.runtime is not None and st.runtime.root_state is st:
            for b in st.runtime.buckets:
                b.reshard()
    states, entries, bucket_states, plan = _plan_under(root)
    ctx = CommContext(group=root.group, world_size=root.world_size, device=root.device, streams=Streams(root.device))
    old = [st.runtime for st in states if st.runtime is not None and st.runtime.root_state is st]
    buckets = _build_buckets(root, entries, bucket_states, plan, old, ctx)
    for rt in old:
        rt.detach()
    rt = _Runtime(root, plan, buckets, ctx)
    for st in states:
        st.runtime = rt
        st.bucket = None
        st.to_run = set()
    rt.group_states = [st for st in states if st.is_group]
    for st, b in zip(bucket_states, buckets):
        st.bucket = b
    for m in root.modules:
        _move_buffers(m, root.device)
    _log_plan(root, plan, buckets, absorbed=len(old))
    return rt


def _plan_under(root: _ModuleState) -> tuple[list[_ModuleState], list[_Entry], list[_ModuleState], Plan]:
    """Discover, validate and plan every parameter under ``root``; agreed on by every rank (a user
    error raises everywhere, see [Note: agreeing on errors]). Returns the recorded modules, the
    parameters, the modules that own a bucket (plan order) and the plan."""
    err: BaseException | None = None
    fingerprint = mine = None
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
        plan = plan_model(specs, world_size=root.world_size, config=_plan_config(root, states))
        fingerprint = _fingerprint(root, plan, bucket_states)
        mine = _expert_layout_of(root, entries, plan) if root.separate_root else None
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        err = e
    tp_mesh = _tp_mesh_under(root)
    if tp_mesh is None:
        every = _agree(err, root, fingerprint, mine)
        root.param_spec = _expert_param_spec(root, every) if root.separate_root else _param_spec(root)
        return states, entries, bucket_states, plan
    try:
        _agree(err, root, fingerprint, mine)
    except Exception as e:  # noqa: BLE001 - the TP ranks learn it next
        err = e
    else:
        err = None
    joined = _agree_tp(err, root, tp_mesh, fingerprint)
    root.param_spec = _param_spec(root, tps={e.fqn: (e.tp, e.tp_blocks) for e in entries if e.tp is not None}, joined=joined)
    return states, entries, bucket_states, plan


def _tp_mesh_under(root: _ModuleState) -> DeviceMesh | None:
    """The TP mesh of the tensor-parallel parameters under ``root`` (read without raising, so every rank
    of a TP group knows it joins the TP agreement even when its own validation failed)."""
    states_tp = None
    for m in root.modules:
        for p in m.parameters():
            if isinstance(p, RaggedDTensor):
                if states_tp is None:
                    states_tp = {}
                    for sub in m.modules():
                        st = getattr(sub, _STATE, None)
                        if st is not None and st.runtime is not None:
                            states_tp.update(_tp_of_sharded([st.runtime.root_state]))
                tp = states_tp.get(id(p))
                if tp is not None:
                    return tp.mesh
            elif isinstance(p, DTensor) and p.device_mesh.ndim == 1:
                return p.device_mesh
    return None


def _agree_tp(err: BaseException | None, root: _ModuleState, tp_mesh: DeviceMesh, fingerprint: Any) -> DeviceMesh:
    """Agree over the TP group: an error anywhere raises on every TP rank, every TP rank must have
    planned the same layout ([Note: FSDP x TP]), and each rank's data-parallel mesh gives the grid of
    the joined (dp..., tp) mesh."""
    group = tp_mesh.get_group(0)
    payload = (fingerprint, root.device_mesh.mesh.tolist())
    every = agree_on_error(err, group=group, what="fully_shard (tensor parallel)", payload=payload)
    prints = [fp for fp, _ in every]
    bad = [t for t, fp in enumerate(prints) if fp != fingerprint]
    if bad:
        raise ValueError(
            f"fully_shard: TP ranks {bad} of {len(prints)} planned another layout than TP rank "
            f"{tp_mesh.get_local_rank()} ({_differences(fingerprint, prints[bad[0]])}); every TP rank must build the "
            "same model with the same TP plan and fully_shard arguments (TP-local shapes must be equal)"
        )
    return join_meshes(root.device_mesh, tp_mesh, [grid for _, grid in every])


def _plan_config(root: _ModuleState, states: list[_ModuleState]) -> PlanConfig:
    """The root's ``PlanConfig`` for the block rules in use (``config_for_rules``: balance by split
    matrices only where the optimizer takes them)."""
    rules = {id(r): r for r in [st.blocks or root.blocks or default_rule for st in states]}
    config = config_for_rules(root.plan_config or PlanConfig(), rules.values())
    if config.balance == "auto" and _tp_mesh_under(root) is not None:
        # Tensor parallel: matrices stay whole on one data-parallel rank, so an optimizer assembling a
        # TP-sharded matrix does so inside one TP group only ([Note: FSDP x TP]).
        config = dataclasses.replace(config, balance="whole")
    return config


def _build_buckets(
    root: _ModuleState,
    entries: list[_Entry],
    bucket_states: list[_ModuleState],
    plan: Plan,
    old: list[_Runtime],
    ctx: CommContext,
) -> list[_Bucket]:
    """One bucket per planned bucket. Pieces of the earlier roots ``old`` move shard to shard into
    the new plan (see [Note: absorbing without the full model]); the others are sliced locally."""
    for rt in old:
        for b in rt.buckets:
            b.wait_reduces()
    sources: dict[int, nn.Parameter] = {id(sp): sp for rt in old for b in rt.buckets for sp in b.sharded}
    old_bucket_of = {id(sp): b for rt in old for b in rt.buckets for sp in b.sharded}
    unmoved = {id(b): len(b.sharded) for rt in old for b in rt.buckets}
    for e in entries:
        e.full = None if id(e.param) in sources else e.param
        if e.full is not None and e.tp is not None:
            e.full = e.full.to_local()  # (a TP DTensor: its TP-local tensor is what the bucket holds)
        if e.full is not None and e.full.device.type == "meta":
            e.full = None

    # Buckets that absorb old pieces are built first, so the absorbed ones are freed before the
    # buckets allocated afresh (the root's own parameters, meta-built or new) take their memory.
    ordered_entries = []
    for st, bp in zip(bucket_states, plan.buckets):
        es = {e.fqn: e for e in entries if e.state is st}
        ordered_entries.append([es[pl.name] for pl in bp.placements])
    absorbs = [any(id(e.param) in sources for e in es) for es in ordered_entries]
    build_order = _interleaved_by_gainer(
        [i for i in range(len(plan.buckets)) if absorbs[i]], plan, ordered_entries, sources
    ) + [i for i in range(len(plan.buckets)) if not absorbs[i]]
    buckets: list[_Bucket | None] = [None] * len(plan.buckets)
    for i in build_order:
        st, bp, ordered = bucket_states[i], plan.buckets[i], ordered_entries[i]
        old_pieces = [sources.get(id(e.param)) for e in ordered]
        lazy = not absorbs[i] and all(e.full is None for e in ordered)  # meta-built, nothing to move in
        b = _Bucket(index=i, plan=bp, entries=ordered, config=_bucket_config(st, root), ctx=ctx, lazy=lazy)
        if absorbs[i]:
            _move_pieces(b, old_pieces, old_bucket_of)
        b.adopt_moved()
        buckets[i] = b
        # Free each absorbed bucket as soon as all of its pieces have moved: the old and the new
        # shards are never both alive whole (setup peak ~ one shard plus a few buckets).
        for sp in old_pieces:
            if sp is not None:
                ob = old_bucket_of[id(sp)]
                unmoved[id(ob)] -= 1
                if unmoved[id(ob)] == 0:
                    ob.release()
        del old_pieces
    return buckets


def _interleaved_by_gainer(
    order: list[int], plan: Plan, ordered_entries: list[list], sources: dict[int, nn.Parameter]
) -> list[int]:
    """The absorbing buckets in an order where no rank's memory only grows for a long run.

    Absorbing bucket ``i`` adds its new segment on each rank and, once its pieces have moved, frees
    the old ones: rank ``r`` gains ``new_r - old_r``. When the new plan gives whole matrices to
    their owners (Muon's rule) and the inner calls had split them, the owner of the first layers
    gains on every one of its buckets before the others' buckets give memory back: measured with
    ``benchmarks/setup_memory.py`` (24 x Linear(2048, 2048), W = 2, CPU-built), rank 0 held 104 MiB
    of live bytes above its shard in the root call. So buckets are taken round-robin over the rank
    that gains most from each (ties: the lowest rank), keeping each one's own order; one rank's
    gain is followed by another's loss. Every rank computes the same order from the layouts alone,
    so the collectives stay in the same order everywhere."""
    if len(order) <= 2:
        return order
    queues: dict[int, list[int]] = {}
    for i in order:
        bp = plan.buckets[i]
        gain = np.diff(np.asarray(bp.rank_bounds, dtype=np.int64))
        for e in ordered_entries[i]:
            sp = sources.get(id(e.param))
            old = np.diff(np.asarray(sp.ragged.bounds, dtype=np.int64)) if sp is not None else None
            if old is not None and len(old) == len(gain):  # (a mismatch is refused when moving)
                gain = gain - old
        queues.setdefault(int(np.argmax(gain)), []).append(i)
    out: list[int] = []
    lists = [queues[k] for k in sorted(queues)]
    for j in range(max(len(q) for q in lists)):
        out += [q[j] for q in lists if j < len(q)]
    return out


def _reshard_after_forward(st: _ModuleState, root: _ModuleState) -> bool:
    """The call's setting; ``None`` (the default, as FSDP2): ``False`` for the root, ``True`` inside. A
    separate root ([Note: separate roots]: the experts of an expert-parallel layer) lies inside the
    model, as FSDP2 would see it: ``True`` (it used to stay gathered from its forward to its backward)."""
    if st.reshard_after_forward is not None:
        return st.reshard_after_forward
    return st is not root or st.separate_root


def _param_spec(root: _ModuleState, *, tps: dict[str, tuple] | None = None, joined: DeviceMesh | None = None):
    """A planned tensor's ``DTensorSpec`` on the root's mesh: ``RaggedShard`` on the shard dimension,
    ``Replicate()`` on the replicas'. Tensor parallel (``tps``: by name): on the ``joined`` (dp..., tp)
    mesh, the TP placement last, of the global shape ([Note: FSDP x TP])."""
    mesh, dim = root.device_mesh, root.shard_dim
    tps = tps or {}

    def spec(pl, dtype: torch.dtype):
        placements = [Replicate()] * mesh.ndim
        tp, tp_blocks = tps.get(pl.name, (None, None))
        placements[dim] = RaggedShard(pl.shard, pl.spec, split=pl.split, tp_blocks=tp_blocks)
        if tp is None:
            return ragged_spec(mesh, placements, pl.shape, dtype)
        return ragged_spec(joined, [*placements, tp.placement], tp.global_shape, dtype)

    return spec


def _expert_layout_of(root: _ModuleState, entries: list[_Entry], plan: Plan) -> dict[str, Any]:
    """This rank's share of an expert-parallel root: its EP coordinate, its shard rank over the ranks
    holding the same experts, and each tensor's first expert and slice bounds (for ``_expert_param_spec``)."""
    es = {e.fqn: expert_shard(e.param) for e in entries}
    first = next(iter(es.values()))
    if root.num_replicas > 1:
        raise ValueError(
            f"fully_shard: the experts module {_describe(root)} was given a 2-D (HSDP) mesh; shard it over the "
            "ranks holding the same experts, a 1-D group: fully_shard(experts, mesh=expert_parallel_groups(ep)"
            ".replicas) (the rest of the model may use HSDP)"
        )
    return {
        "ep_rank": first.ep_rank,
        "ep_size": first.ep_size,
        "shard_rank": root.rank,
        "shard_size": root.world_size,
        "tensors": {
            pl.name: (es[pl.name].first_expert, es[pl.name].global_shape, tuple(pl.shard.bounds))
            for b in plan.buckets for pl in b.placements
        },  # fmt: skip
    }


def _expert_param_spec(root: _ModuleState, every: list[dict[str, Any]]):
    """[Note: expert-parallel parameters as DTensors]
    An expert-parallel weight is one DTensor of its whole ``[E, ...]`` shape: the experts of EP rank
    ``e`` are split again over the ranks holding them (shard rank ``d``), so the world holds it as
    one flat, contiguous partition ordered by ``(e, d)``: coordinate ``e * R + d`` holds
    ``first_expert(e) * row + slice_bounds_e[d]`` onward (``row`` = one expert's elements). Its mesh
    is the world in that order (``DeviceMesh.from_group`` of the world group with that rank order),
    with one ``RaggedShard`` of those global bounds: ``full_tensor``, norms, checkpoints and optimizer
    state all use global coordinates, as for any other sharded parameter. Gathers and reductions of
    the runtime stay within the shard group (the bucket's plan is the slice's). Built from the world's
    layouts, exchanged once at setup (the world-wide agreement of the experts' call)."""
    world = len(every)
    ep_size, shard_size = every[0]["ep_size"], every[0]["shard_size"]
    cells = sorted((info["ep_rank"], info["shard_rank"], r) for r, info in enumerate(every))
    if ep_size * shard_size != world or [(e, d) for e, d, _ in cells] != [
        (e, d) for e in range(ep_size) for d in range(shard_size)
    ]:
        raise ValueError(
            f"fully_shard: the experts' ranks do not tile the world ({world} ranks; ep_size {ep_size} x "
            f"{shard_size} ranks per expert): shard every rank's experts module over expert_parallel_groups(ep)"
            ".replicas, with every rank of the world in one EP group"
        )
    order = [r for _, _, r in cells]
    mesh = DeviceMesh.from_group(
        [dist.group.WORLD], root.device.type, mesh=torch.tensor(order), mesh_dim_names=("expert_shard",)
    )
    layouts: dict[str, RaggedShard] = {}

    def spec(pl, dtype: torch.dtype):
        rs = layouts.get(pl.name)
        if rs is None:
            _, shape, _ = every[order[0]]["tensors"][pl.name]
            row = math.prod(shape[1:])
            starts = []
            for r in order:
                first, _, bounds = every[r]["tensors"][pl.name]
                starts.append(first * row + bounds[every[r]["shard_rank"]])
            layout = RaggedLayout(tuple(shape), (*starts, math.prod(shape)))
            rs = layouts[pl.name] = RaggedShard(layout, pl.spec, split=pl.split)
        return ragged_spec(mesh, [rs], rs.shape, dtype)

    return spec


def _bucket_config(st: _ModuleState, root: _ModuleState) -> BucketConfig:
    """A bucket's settings: its own call's, else the root's (plan-wide ones are the root's)."""
    return BucketConfig(
        param_spec=root.param_spec,
        is_expert=root.separate_root,
        group=root.group,
        device=root.device,
        mp_policy=st.mp_policy or root.mp_policy or MixedPrecisionPolicy(),
        reshard_after_forward=_reshard_after_forward(st, root),
        is_root=st is root,
        fp8_all_gather=st.fp8_all_gather or root.fp8_all_gather,
        wire=(root.plan_config or PlanConfig()).wire,
        replicate_group=root.replicate_group,
        num_replicas=root.num_replicas,
    )


def _log_plan(root: _ModuleState, plan, buckets: list[_Bucket], *, absorbed: int) -> None:
    """Setup decisions under the ``fsdp_optim`` logger: one INFO line per root call, one DEBUG line
    per bucket (rank 0 of the shard group only, so a W-rank job logs each once)."""
    if root.rank != 0 or not logger.isEnabledFor(logging.INFO):
        return
    st = plan.stats()
    name = _describe(root)
    logger.info(
        "fully_shard(%s): %d buckets (%d even, %d ragged), %d tensors, %s parameters over %d ranks%s; "
        "padding %.3f%%, per-rank bytes max/mean %.3f, optimizer cost max/mean %.3f; planned in %.3f s; "
        "absorbed %d earlier root(s); %d bucket(s) left unallocated until first use (meta-built)%s",
        name, st.num_buckets, st.num_even_buckets, st.num_ragged_buckets, st.num_tensors,
        f"{st.param_numel:,}", root.world_size, f" x {root.num_replicas} replicas" if root.num_replicas > 1 else "",
        100 * st.padding_ratio, st.bytes_max_over_mean, st.cost_max_over_mean, st.plan_seconds, absorbed,
        sum(not b.is_materialized for b in buckets), f"; balance: {plan.balance_note}" if plan.balance_note else "",
    )  # fmt: skip
    if logger.isEnabledFor(logging.DEBUG):
        for b in buckets:
            sizes = b.plan.segment_sizes
            logger.debug(
                "bucket %d %r: layout %s, %d tensors, %d elements, segment max %d / mean %.1f elements, "
                "wire %s, %s, param %s / reduce %s%s",
                b.index, b.plan.name, b.plan.layout.value, len(b.plan.placements), b.plan.total_numel, max(sizes),
                sum(sizes) / len(sizes), b.buffer.wire.value if not b.buffer.is_even else "even",
                "reshard after forward" if b.reshard_after_forward else "kept after forward",
                b.param_dtype, b.reduce_dtype, ", FP8 all-gather" if b.fp8_gather is not None else "",
            )  # fmt: skip


def _move_pieces(bucket: _Bucket, old: list[nn.Parameter | None], old_bucket_of: dict[int, _Bucket]) -> None:
    """Fill ``bucket``'s segment from the sharded parameters of absorbed roots, shard to shard.

    [Note: absorbing without the full model]
    A root call absorbs the roots of earlier (inner) calls and plans everything again. Rather than
    gathering those parameters back to full tensors (the whole model on every rank at once), each
    rank sends every other rank the part of its old piece that falls in that rank's new range: one
    ``all_to_all_single`` per absorbed tensor, with split sizes computed from the old and new layouts
    alone (the same on every rank). Per tensor, both sides are contiguous and in rank order (a
    RaggedLayout's ranges are), so the collective reads the old piece and writes the new piece in
    place: no staging buffer, which matters where one rank's piece of a bucket is most of its shard
    (whole matrices at large W). Each absorbed bucket is freed once all of its pieces have moved, and
    gathered buffers are made at a bucket's first gather, so the peak is about one shard plus a
    few tensors (tests/sharding/test_setup_memory.py). Meta-built models move their (uninitialized)
    zeros the same way, so every rank issues the same collectives whatever the values.
    """
    rank, world = bucket.rank, bucket.buffer.world_size
    new_views = bucket.buffer.local_views()
    dtype, device = bucket.buffer.dtype, bucket.buffer.device
    for i, (sp, pl) in enumerate(zip(old, bucket.plan.placements)):
        if sp is None:
            continue
        old_layout = sp.ragged.layout
        if old_layout.bounds[-1] != pl.shard.bounds[-1] or old_layout.world_size != world:
            raise AssertionError(f"absorbing {pl.name}: old layout {old_layout} does not match the new world")
        if not old_bucket_of[id(sp)].is_materialized:  # never used: uninitialized, sent as zeros (the same collectives)
            piece = torch.zeros(sp._local_tensor.numel(), dtype=dtype, device=device)
        else:
            piece = sp._local_tensor.detach().reshape(-1).to(device=device, dtype=dtype)
        with torch.no_grad():
            if world == 1:
                new_views[i].copy_(piece)
                continue
            old_b = np.asarray(old_layout.bounds, dtype=np.int64)
            new_b = np.asarray(pl.shard.bounds, dtype=np.int64)
            (a_old, b_old), (a_new, b_new) = old_layout.range(rank), pl.shard.range(rank)
            in_sizes = np.clip(np.minimum(b_old, new_b[1:]) - np.maximum(a_old, new_b[:-1]), 0, None)
            out_sizes = np.clip(np.minimum(old_b[1:], b_new) - np.maximum(old_b[:-1], a_new), 0, None)
            dist.all_to_all_single(
                new_views[i], piece.contiguous(), out_sizes.tolist(), in_sizes.tolist(), group=bucket.buffer.group
            )
        del piece


def _bucket_name(root: _ModuleState, st: _ModuleState) -> str:
    if st is root:
        return "<root>"
    names: dict[int, str] = {}
    for top in root.modules:
        for name, m in top.named_modules():
            names.setdefault(id(m), name)  # a module registered twice: its first name
    found = [names.get(id(m), _class_name(m)) for m in st.modules]
    return f"[{', '.join(found)}]" if st.is_group else found[0]


def _class_name(m: nn.Module) -> str:
    """The user's class name (not ``fully_shard``'s ``Sharded...`` subclass)."""
    cls = type(m)
    return cls.__bases__[-1].__name__ if cls.__name__ == f"Sharded{cls.__bases__[-1].__name__}" else cls.__name__


def _describe(st: _ModuleState) -> str:
    """A call's module class, or ``[A, B]`` for a group, for messages."""
    names = [_class_name(m) for m in st.modules]
    return f"[{', '.join(names)}]" if st.is_group else names[0]


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for m in module.modules():
        for k, v in list(m._buffers.items()):
            if v is not None and v.device.type != "meta" and v.device != device:
                m._buffers[k] = v.to(device)


