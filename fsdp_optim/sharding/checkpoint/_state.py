"""What a checkpoint holds of a model and an optimizer: the optimizer contracts (``ShardedState``,
``OwnedState``), the kinds of optimizer state, and collecting both as DCP-ready state dicts.

[Note: checkpoint layout]
- ``model.<name>``: every entry of ``model.state_dict()`` under the model's own names, sharded
  parameters as their global N-D tensors (no padding), buffers and unsharded parameters as plain
  (replicated) tensors.
- ``optim.state.<param name>.<key>``: sharded optimizer state (``state_shards``, see
  [Note: checkpoint-shaped optimizer state]; for torch's optimizers, state made from the parameter,
  a RaggedDTensor of its layout) as its global flat vector,
  shaped like the parameter when it has one element per parameter element; other replicated
  tensors as they are. ``optim.scalars``: step counters and other 0-dim / non-tensor state, one
  blob. ``optim.param_groups``: hyperparameters, with parameter names instead of ids.
- ``scheduler``, ``extra`` (rank 0's, returned to every rank) and ``rng.rank<r>`` (per rank;
  restored only at the same world size) as opaque ``torch.save`` bytes.
- ``fsdp_optim.json``: the manifest (world size, optimizer class, state schema, group names,
  checksums), written last by rank 0, so it is read first to check a load before any tensor is touched.

A rank with an empty piece writes nothing for it. HSDP (a 2-D mesh, see [Note: HSDP] in
``_fully_shard``): every replica holds the same ranges, so the replicas offer DCP identical write
items (same key, same chunk offsets) and DCP's ``dedup_save_plans`` keeps one of each, spreading
the writes over the replicas: one copy on disk (tested in tests/sharding/test_hsdp.py).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from .._dtensor import RaggedDTensor, ragged_spec
from .._placement import RaggedShard
from .._tensor_parallel import tp_slice
from .._runtime import reshard_all
from ..plan import RaggedLayout

__all__ = [
    "OwnedState",
    "ShardedState",
    "StateKind",
    "check_keys",
    "class_name",
    "ensure_sharded",
    "fmt_keys",
    "gather_owned_schema",
    "model_state_dict",
    "optim_state",
    "owned_optim_state",
    "param_groups_by_name",
    "param_names",
    "state_kinds",
    "state_tensor",
    "StatePlace",
    "local_piece",
    "torch_names",
]


@runtime_checkable
class ShardedState(Protocol):
    """An optimizer that says where each sharded state tensor lies (every fsdp_optim optimizer; see
    [Note: checkpoint-shaped optimizer state]): checkpoints reshard the keys it lists."""

    def state_shards(self, p: torch.Tensor) -> dict[str, Any]:
        """``{key: StateShard(global_numel, start, end)}`` (``fsdp_optim.optimizers._base``) per sharded key."""


@runtime_checkable
class OwnedState(Protocol):
    """An optimizer whose state lives whole on each parameter's owner rank (``WholeTensorOptimizer``,
    see [Note: whole-tensor checkpoints]): checkpoints save each owner's tensors whole."""

    optim: torch.optim.Optimizer

    def owns(self, p: torch.Tensor) -> bool: ...

    def owned_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]: ...

    def install_state(self, p: torch.Tensor, state: dict[str, torch.Tensor]) -> None: ...


class StatePlace(NamedTuple):
    """Where one sharded state tensor lies, as checkpoints and torch's helpers see it (``state_tensor``)."""

    shape: tuple[int, ...]
    """Its global shape."""
    bounds: tuple[int, ...]
    """Every shard rank's (or ``mesh`` cell's) start in its flat local layout, then its length."""
    mesh: Any = None
    """``StateShard.mesh``: the merged (dp, tp) mesh of state TP ranks own in runs; ``None``: the parameter's."""
    rows: bool = False
    """``StateShard.rows``: one entry per row of the parameter."""


class StateKind(enum.StrEnum):
    """How a checkpoint holds one optimizer-state key (the manifest's schema stores the value)."""

    SHARDED = "sharded"  # a global flat vector (or the parameter's shape), resharded on load
    REPLICATED = "replicated"  # a tensor equal on every rank
    SCALAR = "scalar"  # a step counter or other 0-dim / non-tensor value, in the ``optim.scalars`` blob
    OWNED = "owned"  # a whole tensor of its owner rank (OwnedState)


def ensure_sharded(model: nn.Module) -> None:
    """Swap the sharded parameters back in where ``fully_shard`` left a bucket gathered (e.g. the
    root's after a forward without backward), as FSDP2 does before a state dict."""
    reshard_all(model)


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every bucket resharded first: sharded parameters are their
    ``RaggedDTensor`` objects (DCP-ready, no gather)."""
    ensure_sharded(model)
    return model.state_dict()


# [Note: state-dict names]
# Every name this package writes or matches (full state dicts, checkpoints' model and optimizer
# entries, Hugging Face exports and loads) is the key ``model.state_dict()`` writes, never the
# attribute path ``named_parameters()`` gives. They differ under modules whose state-dict hooks rename
# keys: torch's activation-checkpoint wrapper (``checkpoint_wrapper``, as torchtitan applies it)
# holds its layer as ``_checkpoint_wrapped_module`` and drops that component from its keys, as do
# torch's ``get_model_state_dict`` and DCP; so a checkpoint does not depend on whether activation
# checkpointing was on. The names are read from torch's own hooks, not from a list of prefixes:
# ``model.state_dict(keep_vars=True)`` maps each key to the parameter or buffer object itself, and
# each object's keys pair, in order, with the names ``named_parameters`` / ``named_buffers`` give it
# (``remove_duplicate=False``; both walk the modules depth-first, so a tied parameter's names and
# keys come in the same order). A name with no key (a non-persistent buffer, a hook dropping it)
# keeps its attribute path.
def torch_names(model: nn.Module) -> dict[str, str]:
    """``{attribute path: state-dict key}`` for every parameter and buffer of ``model`` (see
    [Note: state-dict names]); resharded first, as ``model.state_dict()`` is."""
    ensure_sharded(model)
    keys: dict[int, list[str]] = {}
    for key, v in model.state_dict(keep_vars=True).items():
        keys.setdefault(id(v), []).append(key)
    out: dict[str, str] = {}
    for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        for name, t in named:
            mine = keys.get(id(t))
            out[name] = mine.pop(0) if mine else name
    return out


def state_tensor(
    p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...], bounds: tuple[int, ...], mesh: DeviceMesh | None = None,
    rows: bool = False,
) -> torch.Tensor:
    """One sharded optimizer-state tensor as checkpoints and torch's helpers see it (the fields of a
    ``StatePlace``): for a sharded parameter, a ``RaggedDTensor`` of its global ``shape`` laid out by
    ``bounds`` on the parameter's mesh, or on ``mesh`` where the state says so (``StateShard.mesh``: its
    last dim ragged, the others replicated); per-row state (``rows``) with the parameter's placements but
    a TP cut on another dim than 0 replicated. The local piece is viewed, not copied. For a plain
    parameter, the tensor in ``shape``."""
    if isinstance(local, RaggedDTensor):
        return local
    if rows and isinstance(p, RaggedDTensor):
        placements = [Shard(0) if isinstance(q, Shard) and q.dim == 0 else Replicate() for q in p.placements]
        placements[p.ragged_dim] = RaggedShard(RaggedLayout((p.ragged.shape[0],), tuple(bounds)))
        return RaggedDTensor._from_local_and_spec(local.reshape(-1), ragged_spec(p.device_mesh, placements, shape, local.dtype))
    if mesh is not None:
        placements = [Replicate()] * (mesh.ndim - 1) + [RaggedShard(RaggedLayout(tuple(shape), tuple(bounds)))]
        return RaggedDTensor._from_local_and_spec(local.reshape(-1), ragged_spec(mesh, placements, shape, local.dtype))
    if not isinstance(p, RaggedDTensor):
        return local.reshape(shape)
    placements = list(p.placements)
    if tuple(shape) == tuple(p.shape):
        layout_shape = p.ragged.shape  # (TP-local under tensor parallelism, [Note: FSDP x TP])
    elif len(shape) == 2 and _tp_shards(p) > 1:  # per-block state of a TP parameter: this TP rank's row
        placements = [Shard(0) if isinstance(q, Shard) else q for q in placements]
        layout_shape = (1, shape[1])
    else:  # (a TP Shard here is over one TP rank, a size-1 mesh dim: nothing to split)
        placements = [Replicate() if isinstance(q, Shard) else q for q in placements]
        layout_shape = tuple(shape)
    placements[p.ragged_dim] = RaggedShard(RaggedLayout(tuple(layout_shape), tuple(bounds)))
    spec = ragged_spec(p.device_mesh, placements, shape, local.dtype)
    return RaggedDTensor._from_local_and_spec(local.reshape(-1), spec)


def local_piece(p: torch.Tensor, full: torch.Tensor, where: StatePlace) -> torch.Tensor:
    """This rank's flat piece of the *full* state tensor ``full`` (``where.shape``), laid out as ``where``
    says: the TP-local part first (the parameter's TP slice; a per-block ``[tp, n]`` tensor's row; the
    rows of per-row state cut on dim 0), then this rank's range of it."""
    flat = full.reshape(where.shape)
    if where.mesh is not None:  # runs: the global vector over the merged (dp, tp) cells
        me = where.mesh.get_local_rank(where.mesh.ndim - 1)
    else:
        me = p.shard_rank if isinstance(p, RaggedDTensor) else 0
        if isinstance(p, RaggedDTensor) and _tp_shards(p) > 1:
            mesh_shape, coord = tuple(p.device_mesh.shape), p.device_mesh.get_coordinate()
            if where.rows:
                rows = [q if isinstance(q, Shard) and q.dim == 0 else Replicate() for q in p.placements]
                flat = tp_slice(flat, rows, mesh_shape, coord)
            elif tuple(where.shape) == tuple(p.shape):
                flat = tp_slice(flat, p.placements, mesh_shape, coord)
            else:  # per-block state: this TP rank's row
                (t,) = [c for c, q in zip(coord, p.placements) if isinstance(q, Shard)]
                flat = flat[t]
    return flat.reshape(-1)[where.bounds[me] : where.bounds[me + 1]]


# [Note: per-block state under TP]
# Per-element optimizer state of a tensor-parallel parameter is checkpointed with the parameter's
# global shape and placements, so it loads at any (dp, tp) layout, as the parameter does. Per-block
# state (8-bit scales, Shampoo factors) describes blocks of each TP rank's TP-local tensor, which
# another TP size forms differently (a RowwiseParallel shard's quantization blocks are pieces of
# columns): it is saved as a ``[tp, n]`` tensor, row t for TP rank t (``Shard(0)`` on the TP dim), so
# a load at another TP size finds another shape and DCP refuses it instead of attaching scales to the
# wrong blocks; any data-parallel layout at the same TP size loads.
def _tp_shards(p: RaggedDTensor) -> int:
    """How many TP ranks split ``p`` (1 without tensor parallelism)."""
    n = 1
    for d, q in enumerate(p.placements):
        if isinstance(q, Shard):
            n *= p.device_mesh.size(d)
    return n


def param_names(model: nn.Module | None, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """``id(param) -> name``: the model's first state-dict key for each parameter (the sharded parameter's own
    name without a model)."""
    names: dict[int, str] = {}
    if model is not None:
        keys = torch_names(model)  # the state-dict key: [Note: state-dict names]
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), keys[name])
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            if id(p) in names:
                continue
            fqn = getattr(p, "_fqn", "")
            if model is not None or not fqn:
                raise ValueError(
                    f"optimizer parameter {pi} of param group {gi} (shape {tuple(p.shape)}) is not a parameter "
                    f"of the model passed; pass the model the optimizer was built on"
                )
            names[id(p)] = fqn
    return names


def state_kinds(optimizer: torch.optim.Optimizer, p: torch.Tensor, name: str) -> dict[str, tuple[str, Any]]:
    """``key -> (kind, where)`` for the state of ``p``: sharded keys carry ``(global_shape, bounds)``, the
    global state vector's shape and every shard rank's start in it (see ``StateShard``)."""
    state = optimizer.state.get(p, {})
    shards = optimizer.state_shards(p) if isinstance(optimizer, ShardedState) else None
    ragged = isinstance(p, RaggedDTensor)
    out: dict[str, tuple[str, Any]] = {}
    for key, v in state.items():
        if shards is not None and key in shards:
            ss = shards[key]
            if not torch.is_tensor(v) or v.numel() != ss.end - ss.start:
                raise ValueError(
                    f"{type(optimizer).__name__}.state_shards: state {key!r} of {name} has "
                    f"{v.numel() if torch.is_tensor(v) else 'no'} elements but its StateShard says {ss.end - ss.start}"
                )
            bounds = ss.bounds if ss.bounds is not None else (0, ss.global_numel)
            if ss.mesh is not None:  # runs owned by TP ranks: the global vector on the merged (dp, tp) cells
                cells = ss.mesh.size(ss.mesh.ndim - 1)
                if len(bounds) != cells + 1:
                    raise ValueError(
                        f"{type(optimizer).__name__}.state_shards: state {key!r} of {name} gives {len(bounds) - 1} "
                        f"ranges for {cells} cells of {ss.mesh}"
                    )
                shape = tuple(p.shape) if ss.global_numel == math.prod(p.shape) else (ss.global_numel,)
                out[key] = (StateKind.SHARDED, StatePlace(shape, tuple(bounds), ss.mesh))
                continue
            if ragged and len(bounds) != p.ragged.num_shards + 1:
                raise ValueError(
                    f"{type(optimizer).__name__}.state_shards: state {key!r} of {name} gives {len(bounds) - 1} shard "
                    f"ranges for a parameter sharded over {p.ragged.num_shards} ranks; StateShard.bounds must hold every "
                    "shard rank's start"
                )
            param_shape = tuple(p.shape)
            local_shape = p.ragged.shape if ragged else param_shape  # (TP-local under tensor parallelism)
            if ss.rows:  # one entry per row: a vector of the global rows
                out[key] = (StateKind.SHARDED, StatePlace(param_shape[:1], tuple(bounds), rows=True))
                continue
            if ss.global_numel == math.prod(local_shape):
                shape = param_shape  # per-element state: the parameter's shape and placements
            elif ragged and _tp_shards(p) > 1:
                # per-block state of a TP parameter: one row per TP rank, [Note: per-block state under TP]
                shape = (_tp_shards(p), ss.global_numel)
            else:  # per-block state: one vector
                shape = (ss.global_numel,)
            out[key] = (StateKind.SHARDED, StatePlace(shape, tuple(bounds)))
        elif shards is None and isinstance(v, RaggedDTensor):  # a torch optimizer's state: made from the parameter
            out[key] = (StateKind.SHARDED, StatePlace(tuple(v.shape), tuple(v.ragged.bounds)))
        elif shards is None and ragged and torch.is_tensor(v) and v.ndim > 0:
            raise ValueError(
                f"state {key!r} of {name} (shape {tuple(v.shape)}) is a plain tensor of a sharded parameter, and "
                f"{type(optimizer).__name__} has no state_shards() saying where it lies; checkpoints cannot reshard it. "
                "Make per-element state from the parameter (torch.zeros_like(p)), as torch's optimizers do"
            )
        elif torch.is_tensor(v) and v.ndim > 0:
            out[key] = (StateKind.REPLICATED, None)
        else:  # step counters and other scalars: one small blob for all of them
            out[key] = (StateKind.SCALAR, None)
    return out


def optim_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    """The DCP-ready ``{name: {key: tensor}}`` state, the scalars ``{name: {key: value}}`` (0-dim
    tensors and numbers, replicated) and the schema ``{name: {key: kind}}``."""
    state, scalars, schema = {}, {}, {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = names[id(p)]
            kinds = state_kinds(optimizer, p, name)
            if not kinds:
                continue
            st = optimizer.state[p]
            entry, small = {}, {}
            for key, (kind, where) in kinds.items():
                v = st[key]
                if kind == StateKind.SHARDED:
                    entry[key] = state_tensor(p, v.detach(), *where)
                elif kind == StateKind.REPLICATED:
                    entry[key] = v.detach()
                else:
                    small[key] = v.detach().cpu() if torch.is_tensor(v) else v
            if entry:
                state[name] = entry
            if small:
                scalars[name] = small
            schema[name] = {k: kind for k, (kind, _) in kinds.items()}
    return state, scalars, schema


def owned_optim_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> tuple[dict[str, dict[str, Any]], dict, dict[str, dict[str, str]]]:
    """A whole-tensor optimizer's state: each owner's tensors whole, plain (no blob of scalars), and
    this rank's schema; no collective (``gather_owned_schema`` merges the ranks' schemas)."""
    state = {names[id(p)]: {k: v.detach() for k, v in st.items()} for p, st in optimizer.owned_state().items()}
    mine = {name: {k: StateKind.OWNED for k in entry} for name, entry in state.items()}
    return state, {}, mine


def gather_owned_schema(mine: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Every rank's owned-state schema, merged (one ``all_gather_object``, a collective). Called after
    the ranks agreed that each built its state, so it pairs with the same gather on every rank."""
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    schema: dict[str, dict[str, str]] = {}
    for part in every:
        for name, keys in part.items():
            schema.setdefault(name, {}).update(keys)
    return schema


def param_groups_by_name(
    optimizer: torch.optim.Optimizer, names: dict[int, str], *, renames: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Hyperparameters of each group, with parameter names instead of the parameters. ``renames``
    (``torch_names(model)``): a group's ``param_names`` (torch's named-parameter groups, given
    ``model.named_parameters()``'s attribute paths) are written as the state-dict keys of those paths
    ([Note: state-dict names]); other names the user gave stay as they are."""
    out = []
    for g in optimizer.param_groups:
        group = {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        if renames and isinstance(group.get("param_names"), list):
            group["param_names"] = [renames.get(n, n) if isinstance(n, str) else n for n in group["param_names"]]
        out.append(group)
    return out


def class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def fmt_keys(keys: Iterable[str], n: int = 8) -> str:
    keys = sorted(keys)
    more = f" (and {len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def check_keys(missing: Iterable[str], unexpected: Iterable[str], *, strict: bool, what: str) -> None:
    """Under ``strict``, raise ``ValueError("<what>: missing keys: ...; unexpected keys: ...")``: the one
    strict-keys check of model, optimizer-state and full-state-dict loads."""
    missing, unexpected = sorted(missing), sorted(unexpected)
    if strict and (missing or unexpected):
        parts = ([f"missing keys: {fmt_keys(missing)}"] if missing else []) + (
            [f"unexpected keys: {fmt_keys(unexpected)}"] if unexpected else []
        )
        raise ValueError(f"{what}: " + "; ".join(parts))
