"""``fully_shard``: the FSDP runtime over ``DistributedBuffer`` (one flat buffer per bucket).

Usage (as with PyTorch FSDP2)::

    for layer in model.layers:
        fully_shard(layer, blocks=rule)
    fully_shard(model, blocks=rule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

Each module passed to ``fully_shard`` is one *bucket*: one flat buffer, one all-gather, one
reduce-scatter. A list of modules is one bucket for all of them (``fully_shard([model.norm,
model.output])``, as FSDP2 and torchtitan: gathered before the first of them runs, freed or kept
after the last; [Note: module groups] in ``_runtime.py``). The root's bucket holds the parameters no
inner bucket holds (embeddings, final norm, head). After sharding, each managed parameter is a
``RaggedDTensor`` parameter of the global shape (docs/dtensor.md) whose local piece is this rank's
flat range, a view into the bucket's segment; after backward its ``.grad`` is the matching
``RaggedDTensor`` over the gradient segment. Each has one owner, a ``ShardedParam`` (``_param.py``).

[Note: which call is the root]
Balance is global, so the planner must see every bucket of a model at once. Every call shards
what it is given right away, and a call on a module that contains modules sharded by earlier calls
*absorbs* them: everything under the new call is planned again, at once, with ``plan_model``, and
the absorbed parameters' pieces move shard to shard into the new buckets (one ``all_to_all_single``
per bucket; never the whole model on a rank: [Note: absorbing without the full model]); the sharded
parameter objects stay the same, re-laid out in place. Build the optimizer after the outermost call:
one built on the original parameters (before the first call) would train nothing, so its first step
raises (a guard through torch's global optimizer hooks), and fsdp_optim's optimizers, which plan
their state from the layout, raise if a parameter was re-laid out after they were built. The
outermost call is
therefore the root: in the usage above ``layers.0`` is provisionally a root until
``fully_shard(model)`` absorbs every layer. Calls on two disjoint modules make two independent
roots (e.g. a student and a teacher model). Inner calls' settings (``blocks``, ``mp_policy``,
``reshard_after_forward``) stay per bucket; an inner ``blocks=None`` / ``mp_policy=None`` takes the
root's. The plan config and the mesh come from the root.

The implementation: ``_setup.py`` (mesh, validation, planning, absorbing), ``_runtime.py`` (hooks,
ordering, guards; [Note: runtime], [Note: HSDP], [Note: stale gathers]) and ``_bucket.py`` (one
flat buffer and its collectives; [Note: bucket lifecycle], [Note: FP8 all-gather]).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from .plan import BlockRule
from ._float8 import Float8AllGather
from ._mixed_precision import MixedPrecisionPolicy, as_mp_policy, check_offload_policy
from .plan import Plan, PlanConfig
from .checkpoint import register_state_dict_hooks
from ._expert_parallel import expert_shard
from ._runtime import _STATE, _buckets_under, _ModuleState, _runtime_of
from ._setup import _class_name, _is_managed_inside, _resolve_mesh, build_runtime
from ._dtensor import RaggedDTensor

__all__ = ["fully_shard", "ShardedModule", "sharded_plan"]


def _check_reshard_after_forward(value: Any, *, allow_none: bool = True) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        raise ValueError(
            f"reshard_after_forward must be {'True, False or None' if allow_none else 'True or False'}, got "
            f"{value!r}; FSDP2's int form (reshard to a smaller world size after forward) is not offered: pass "
            "True (free the gathered parameters after forward) or False (keep them for backward)"
            + ("; None (the default) is True for inner modules and False for the root" if allow_none else "")
        )


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: Any = None,
    blocks: BlockRule | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | Any | None = None,
    plan_config: PlanConfig | None = None,
    fp8_all_gather: Float8AllGather | None = None,
    offload_policy: Any = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh`` with block-aligned ragged layouts. ``module`` may be
    a list of modules that share one bucket (as FSDP2's ``fully_shard([norm, output])``).

    ``mesh``: a 1-D ``DeviceMesh`` or a ``ProcessGroup`` (default: the world; without an initialized
    process group, one rank), or a 2-D ``DeviceMesh`` for HSDP: shard over one dimension, replicate
    over the other (dims named ``"replicate"`` and ``"shard"`` are found by name; otherwise dim 0
    replicates and dim 1 shards, as in FSDP2; see [Note: HSDP]). ``blocks``: an optimizer's block
    rule ``rule(fqn, param, module) -> BlockSpec`` (default: element granularity, plain FSDP).
    ``reshard_after_forward``: free the gathered parameters after forward and gather again in
    backward (``True``) or keep them for backward (``False``); ``None`` (as FSDP2): ``True`` for inner
    modules, ``False`` for the root, whose backward starts at once. ``True`` on the root frees its
    gathered parameters (embeddings, head) while the loss is computed and gathers them again for the
    head's backward: less memory at the loss, one more all-gather. ``mp_policy``: compute and
    reduction dtypes, a ``MixedPrecisionPolicy`` (ours) or FSDP2's
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` (taken as ours with the same meaning:
    ``as_mp_policy``). ``offload_policy``: FSDP2's, for FSDP2 code: ``None`` or ``OffloadPolicy()`` (no
    offload); ``CPUOffloadPolicy`` is refused. ``plan_config``: planner knobs (root only). ``fp8_all_gather``: gather eligible
    (2-D) parameters as block-wise scaled ``float8_e4m3fn`` codes and dequantize them to the compute
    dtype (opt-in; see [Note: FP8 all-gather] below and ``Float8AllGather``); an inner ``None`` takes
    the root's. Returns ``module`` (each module's class now also derives from :class:`ShardedModule`).
    See the module docstring for the root rule.
    """
    modules = _as_modules(module)
    mp_policy = as_mp_policy(mp_policy)  # ours, or FSDP2's with the same meaning
    check_offload_policy(offload_policy)
    _check_arguments(blocks, reshard_after_forward, mp_policy, plan_config, fp8_all_gather)
    resolved = _resolve_mesh(mesh)
    for m in modules:
        existing = getattr(m, _STATE, None)
        if existing is not None:
            raise ValueError(
                f"fully_shard: module {_class_name(m)} was already passed to fully_shard (world size "
                f"{existing.world_size}); call fully_shard once per module, inner modules first, the root last"
            )
        for name, p in m.named_parameters():
            if isinstance(p, RaggedDTensor) and not _is_managed_inside(m, p):
                raise ValueError(
                    f"fully_shard: parameter {name} (shape {tuple(p.shape)}) of {_class_name(m)} is already "
                    f"sharded (as {getattr(p, '_fqn', '')}) by a fully_shard call on a module outside this one: either an "
                    "enclosing module (call fully_shard on inner modules before their root) or another model sharing "
                    "this module (e.g. a student and a teacher: shard one module containing both, or give each its "
                    "own copy)"
                )
    state = _ModuleState(
        modules=modules,
        group=resolved.group,
        rank=resolved.rank,
        world_size=resolved.world_size,
        device=resolved.device,
        replicate_group=resolved.replicate_group,
        num_replicas=resolved.num_replicas,
        device_mesh=resolved.device_mesh,
        shard_dim=resolved.shard_dim,
        blocks=blocks,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        plan_config=plan_config,
        fp8_all_gather=fp8_all_gather,
        separate_root=_is_experts(modules),
    )
    ep_size = next((expert_shard(p).ep_size for m in modules for p in m.parameters()), 1) if state.separate_root else 1
    classes = [type(m) for m in modules]
    for m, cls in zip(modules, classes):
        if not issubclass(cls, ShardedModule):
            m.__class__ = _sharded_class(cls)
    try:
        build_runtime(state)  # validates on every rank and agrees before any collective
    except BaseException:
        state.remove()  # a failed call leaves no trace
        for m, cls in zip(modules, classes):
            m.__class__ = cls
        raise
    for m in modules:
        register_state_dict_hooks(m)  # load_state_dict() of full tensors; assign=True keeps the runtime's objects
    if state.separate_root:
        # The experts' owners receive tokens from every rank of their EP group: their gradients are
        # averaged over the whole data-parallel world, not only over this call's mesh.
        modules[0].set_gradient_divide_factor(resolved.world_size * resolved.num_replicas * ep_size)
    return module


def _as_modules(module: Any) -> tuple[nn.Module, ...]:
    """``module``, or the modules of a list / tuple (one bucket for all of them, as FSDP2's
    ``fully_shard([norm, output])``), checked: distinct, none inside another."""
    if isinstance(module, nn.Module):
        return (module,)
    if not isinstance(module, (list, tuple)) or not module or not all(isinstance(m, nn.Module) for m in module):
        got = type(module).__name__ if not isinstance(module, (list, tuple)) else (
            "an empty list" if not module else f"a list of {', '.join(sorted({type(m).__name__ for m in module}))}"
        )  # fmt: skip
        raise ValueError(f"fully_shard expects an nn.Module or a non-empty list of them, got {got}")
    modules = tuple(module)
    for i, m in enumerate(modules):
        for j, other in enumerate(modules):
            if i != j and (m is other or any(sub is m for sub in other.modules())):
                raise ValueError(
                    f"fully_shard: module {i} of the list ({type(m).__name__}) "
                    + ("appears twice" if m is other else f"lies inside module {j} ({type(other).__name__})")
                    + "; list modules that do not contain one another (an inner module gets its own call first)"
                )
    return modules


def _is_experts(modules: tuple[nn.Module, ...]) -> bool:
    """Every parameter under ``modules`` was sharded by ``expert_parallel``: it is planned as its own
    root over ``mesh`` (the ranks holding the same experts; [Note: separate roots])."""
    marks = [expert_shard(p) is not None for m in modules for p in m.parameters()]
    return bool(marks) and all(marks)


def _check_arguments(
    blocks: Any,
    reshard_after_forward: Any,
    mp_policy: Any,
    plan_config: Any,
    fp8_all_gather: Any,
) -> None:
    """The arguments' types (a user error names the argument and what it takes)."""
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a MixedPrecisionPolicy or None, got {type(mp_policy).__name__}")
    if plan_config is not None and not isinstance(plan_config, PlanConfig):
        raise ValueError(f"plan_config must be a PlanConfig or None, got {type(plan_config).__name__}")
    if fp8_all_gather is not None and not isinstance(fp8_all_gather, Float8AllGather):
        raise ValueError(
            f"fp8_all_gather must be a Float8AllGather or None (e.g. Float8AllGather(tile='128x128')), got "
            f"{type(fp8_all_gather).__name__}"
        )
    _check_reshard_after_forward(reshard_after_forward)
    if blocks is not None and not callable(blocks):
        raise ValueError(
            f"blocks must be a block rule rule(fqn, param, module) -> BlockSpec (e.g. muon_rule()), got {blocks!r}"
        )


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
        """Free (``True``) or keep (``False``) the gathered parameters between forward and backward,
        the root's too (as FSDP2; see ``fully_shard``). Call it on every rank alike: it decides which
        all-gathers backward issues."""
        _check_reshard_after_forward(reshard_after_forward, allow_none=False)
        for b in _buckets_under(self, recurse):
            b.reshard_after_forward = reshard_after_forward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: do not gather this module's bucket again in backward (as FSDP2's): its
        gradients arrive without it, saving one all-gather per step and the gathered buffer at the
        end of backward. Only for a bucket whose parameters are all ``nn.Embedding`` weights (its
        backward reads the indices, not the weight); anything else raises, since a backward that
        read a freed parameter would crash. Call it on every rank alike."""
        if not isinstance(unshard_in_backward, bool):
            raise ValueError(f"set_unshard_in_backward: expects True or False, got {unshard_in_backward!r}")
        bucket = getattr(self, _STATE).bucket
        if bucket is None:
            return
        if not unshard_in_backward:
            for e in bucket.params:
                sp = e.sharded
                for owner, _ in e.owners:
                    if not _reads_no_weight_in_backward(owner):
                        raise ValueError(
                            f"set_unshard_in_backward(False): parameter {e.fqn} (shape "
                            f"{tuple(sp.shape)}) of {_class_name(owner)} is in this bucket; only "
                            "nn.Embedding weights can skip the gather in backward (an embedding's backward reads "
                            "the indices only). Give the embedding its own fully_shard call and set it there"
                        )
        bucket.unshard_in_backward = unshard_in_backward
    def set_gradient_divide_factor(self, factor: float, *, recurse: bool = True) -> None:
        """Divide the summed gradients by ``factor`` instead of averaging over this module's shard
        group (and replicas), as FSDP2's ``set_gradient_divide_factor``: e.g. experts sharded over the
        ranks that hold the same experts under expert parallelism receive tokens from every rank,
        so their gradients are averaged over the whole data-parallel world. Applied as one
        multiplication of each bucket's unsharded gradients by ``group size / factor`` before the
        reduction (exact when that ratio is a power of two)."""
        factor = float(factor)
        if not factor > 0 or factor == float("inf"):
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, got {factor}")
        for b in _buckets_under(self, recurse):
            b.grad_premul = None if factor == b.buffer.world_size * b.num_replicas else b.buffer.world_size * b.num_replicas / factor

    def unshard(self) -> None:
        """Gather this module's bucket now (its next forward uses this gather instead of issuing one);
        freed as after any forward (``reshard_after_forward``), by ``reshard()``, or, if an optimizer
        stepped since, before the next forward gathers the new values ([Note: stale gathers])."""
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


def _reads_no_weight_in_backward(module: nn.Module) -> bool:
    """An ``nn.Embedding`` running ``nn.Embedding.forward`` (``F.embedding``, whose backward saves the
    indices and the weight's size only), its weight not parametrized."""
    return (
        isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        and not hasattr(module, "parametrizations")
    )


@functools.cache
def _sharded_class(cls: type) -> type:
    return type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
