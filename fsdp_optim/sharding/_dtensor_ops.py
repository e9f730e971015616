"""The ops a ``RaggedDTensor`` supports, each computed on the local flat piece; every other op raises.

[Note: op coverage]
A ``RaggedDTensor``'s local piece is a flat, possibly uneven, possibly empty range of the row-major
flattened tensor (``[Note: RaggedShard placement]``). What can be computed on such pieces alone,
equal to the unsharded op, is handled here; the rest raises ``NotImplementedError`` naming the op
and the way out (``full_tensor()``, ``to_local()``, ``redistribute(placements=[Shard(0)])``):

- *element-wise*: every ATen op tagged ``pointwise`` (``add``, ``mul_``, ``lerp_``, ``addcdiv_``,
  ``sqrt``, ``where``, ``clamp``, comparisons...), ``copy_``, ``zero_``, ``fill_``, ``clone``,
  ``detach``, ``to(dtype / device)`` and the ``*_like`` factories. Every ragged operand must have
  the same layout (shape, bounds, mesh); the others must be scalars: numbers, 0-dim tensors, or 0-dim
  DTensors (``Replicate``, or ``Partial`` which is reduced first, as DTensor does). A replicated
  DTensor of the same global shape is sliced to this rank's range (no communication);
- the same per position of a ``_foreach_*`` op's lists (one kernel call for the whole list, as
  torch's foreach path) and of the fused optimizer kernels (``_fused_adam_``, ``_fused_adamw_``,
  ``_fused_sgd_``, ``_fused_adagrad_``), whose plain step / lr / scale tensors pass through;
- *reductions to one global value* (``sum``, ``mean``, ``max``, ``min``, ``amax``, ``amin`` over every
  dim, ``linalg.vector_norm`` / ``norm`` / ``_foreach_norm`` of the whole tensor, ``_foreach_max``):
  the local result of this rank's piece, returned as a plain torch ``DTensor`` that is ``Partial``
  on the ragged mesh dimension (``Replicate`` on the others), so the cross-rank reduction runs when
  the value is used, as for FSDP2's parameters. Norms are taken through torch's own ``DTensor``
  norm (the local piece seen as a ``Shard(0)`` piece of the flattened tensor), so their ``Partial``
  is torch's norm reduction. An empty piece contributes the reduction's identity (``max``: -inf).
  ``all`` / ``any`` reduce at once (one all-reduce) and return a replicated value; ``torch.equal`` /
  ``allclose`` of two tensors of one layout return every rank's agreed answer (one all-reduce).

Why no op is left to torch's sharding propagation: it does not know the placement (see
[Note: RaggedShard placement]), and a wrong answer is worse than an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ._tensor_parallel import has_tp, tp_slice
from ._placement import RaggedShard, ragged_dim

__all__ = ["dispatch", "spec_with_dtype", "unsupported"]

aten = torch.ops.aten


def unsupported(func: Any, why: str = "") -> NotImplementedError:
    name = getattr(func, "__name__", str(func))
    return NotImplementedError(
        f"{name} is not supported on a RaggedDTensor (a sharded parameter, its gradient or optimizer state: each "
        f"rank holds a flat, possibly uneven range of the tensor){': ' + why if why else ''}. Supported: "
        "element-wise ops, _foreach_* and fused optimizer ops, copy_/zero_/fill_/clone/detach/to, and reductions of "
        "the whole tensor (sum, mean, max, min, norm). Otherwise use t.full_tensor() (the whole tensor on every "
        "rank), t.to_local() (this rank's flat piece), or t.redistribute(placements=[Shard(0)]) (torch's row-sharded "
        "DTensor, on which every DTensor op works)"
    )


# ---- specs -----------------------------------------------------------------------------------
_DTYPE_SPECS: dict[tuple[int, torch.dtype], tuple[DTensorSpec, DTensorSpec]] = {}


def spec_with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    """``spec`` with another dtype in its tensor meta (cached per spec object)."""
    if spec.tensor_meta.dtype == dtype:
        return spec
    key = (id(spec), dtype)
    hit = _DTYPE_SPECS.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    meta = spec.tensor_meta
    new = DTensorSpec(spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))
    if len(_DTYPE_SPECS) > 4096:
        _DTYPE_SPECS.clear()
    _DTYPE_SPECS[key] = (spec, new)  # (the spec is kept alive with its entry, so its id is not reused)
    return new


def _same_layout(a: DTensorSpec, b: DTensorSpec) -> bool:
    if a is b:
        return True
    if a.mesh != b.mesh or tuple(a.tensor_meta.shape) != tuple(b.tensor_meta.shape):
        return False
    if len(a.placements) != len(b.placements):
        return False
    for pa, pb in zip(a.placements, b.placements):
        if isinstance(pa, RaggedShard):
            if not (isinstance(pb, RaggedShard) and pa.same_layout(pb)):
                return False
        elif isinstance(pb, RaggedShard) or pa != pb:
            return False
    return True


def _describe(spec: DTensorSpec) -> str:
    return f"shape {tuple(spec.tensor_meta.shape)}, placements {spec.placements}, mesh {spec.mesh}"


# ---- operands ----------------------------------------------------------------------------------
class _Operands:
    """Unwraps the tensor arguments of one call: ragged ones to their local pieces (all of one layout),
    scalar ones to plain 0-dim tensors, replicated DTensors of the same shape to this rank's range."""

    __slots__ = ("cls", "func", "spec")

    def __init__(self, cls: type, func: Any) -> None:
        self.cls, self.func, self.spec = cls, func, None

    def __call__(self, x: Any) -> Any:
        if isinstance(x, self.cls):
            if self.spec is None:
                self.spec = x._spec
            elif not _same_layout(self.spec, x._spec):
                raise unsupported(
                    self.func,
                    f"its operands are laid out differently ({_describe(self.spec)} vs {_describe(x._spec)}); "
                    "redistribute one to the other's placements first",
                )
            return x._local_tensor
        if isinstance(x, DTensor):
            return self._stock(x)
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            raise unsupported(
                self.func,
                f"it mixes a RaggedDTensor with a plain tensor of shape {tuple(x.shape)} (only 0-dim tensors and numbers "
                "broadcast against a ragged piece); make it a DTensor, or use .full_tensor() / .to_local()",
            )
        return x

    def _stock(self, x: DTensor) -> torch.Tensor:
        if x.dim() == 0:
            if any(isinstance(p, Partial) for p in x.placements):
                x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
            return x._local_tensor
        if all(isinstance(p, Replicate) for p in x.placements) and self.spec is not None:
            if tuple(x.shape) == tuple(self.spec.tensor_meta.shape):
                return _local_range(x._local_tensor, self.spec)
        raise unsupported(
            self.func,
            f"it mixes a RaggedDTensor with a DTensor of shape {tuple(x.shape)} and placements {x.placements}; "
            "redistribute it to the RaggedDTensor's placements (fsdp_optim.sharding.distribute_ragged) first",
        )


def _local_range(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's flat range of a full tensor (global shape) under ``spec``'s ragged placement."""
    dim = ragged_dim(spec.placements)
    coord = spec.mesh.get_coordinate()
    a, b = spec.placements[dim].range(coord[dim])
    if has_tp(spec.placements):
        full = tp_slice(full, spec.placements, tuple(spec.mesh.shape), coord)
    return full.reshape(-1)[a:b]


def _unwrap_all(ops: _Operands, args: Any, kwargs: dict) -> tuple[Any, dict]:
    # (flat arguments first: the common case of a torch.optim step, which pays this per op)
    args = tuple(ops(a) if isinstance(a, torch.Tensor) else _tree(ops, a) if isinstance(a, (list, tuple)) else a
                 for a in args)
    if kwargs:
        kwargs = {k: _tree(ops, v) for k, v in kwargs.items()}
    return args, kwargs


def _tree(ops: _Operands, x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_tree(ops, y) for y in x)
    if isinstance(x, torch.Tensor):
        return ops(x)
    return x


def _rewrap(cls: type, spec: DTensorSpec, out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return cls._from_local_and_spec(out, spec_with_dtype(spec, out.dtype))
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(cls, spec, o) for o in out)
    return out


# ---- handlers ----------------------------------------------------------------------------------
def _elementwise(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    if "out" in kwargs:
        raise unsupported(func, "out= is not supported; assign the result instead")
    ops = _Operands(cls, func)
    # the first ragged operand decides the layout (found before replicated ones are sliced)
    for a in (*args, *kwargs.values()):
        if isinstance(a, cls):
            ops.spec = a._spec
            break
    largs, lkwargs = _unwrap_all(ops, args, kwargs)
    out = func(*largs, **lkwargs)
    if func._schema.is_mutable:
        return args[0]
    return _rewrap(cls, ops.spec, out)


def _copy(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    if not isinstance(args[0], cls):
        raise unsupported(func, "copying a RaggedDTensor into a plain tensor; copy from .full_tensor() or .to_local()")
    return _elementwise(cls, func, args, kwargs)


def _like(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    local = func(x._local_tensor, *args[1:], **kwargs)
    return cls._from_local_and_spec(local, spec_with_dtype(x._spec, local.dtype))


def _new_sized(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    x, size = args[0], tuple(args[1])
    if size != tuple(x.shape):
        raise unsupported(func, f"a new tensor of size {size} from a RaggedDTensor of shape {tuple(x.shape)}")
    local = func(x._local_tensor, [x._local_tensor.numel()], *args[2:], **kwargs)
    return cls._from_local_and_spec(local, spec_with_dtype(x._spec, local.dtype))


def _check_lists(func: Any, cls: type, args: tuple, kwargs: dict) -> list[DTensorSpec | None]:
    """Per list position: the layout of its ragged tensors (all equal), or ``None`` if none is ragged."""
    lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    n = max((len(x) for x in lists), default=0)
    specs: list[DTensorSpec | None] = [None] * n
    for lst in lists:
        for i, t in enumerate(lst):
            if isinstance(t, cls):
                if specs[i] is None:
                    specs[i] = t._spec
                elif not _same_layout(specs[i], t._spec):
                    raise unsupported(
                        func,
                        f"position {i} of its lists mixes layouts ({_describe(specs[i])} vs {_describe(t._spec)})",
                    )
    return specs


def _unwrap_listwise(func: Any, cls: type, x: Any, specs: list[DTensorSpec | None]) -> Any:
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        out = []
        for i, t in enumerate(x):
            if isinstance(t, cls):
                out.append(t._local_tensor)
            elif isinstance(t, DTensor) or (t.dim() > 0 and specs[i] is not None):
                ops = _Operands(cls, func)
                ops.spec = specs[i]
                out.append(ops(t))
            else:
                out.append(t)
        return type(x)(out)
    if isinstance(x, torch.Tensor):
        ops = _Operands(cls, func)
        return ops(x)
    return x


def _listwise(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    if "out" in kwargs:
        raise unsupported(func, "out= is not supported")
    specs = _check_lists(func, cls, args, kwargs)
    largs = tuple(_unwrap_listwise(func, cls, a, specs) for a in args)
    lkwargs = {k: _unwrap_listwise(func, cls, v, specs) for k, v in kwargs.items()}
    out = func(*largs, **lkwargs)
    if out is None or func._schema.is_mutable:
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(
            cls._from_local_and_spec(o, spec_with_dtype(s, o.dtype)) if s is not None and isinstance(o, torch.Tensor) else o
            for o, s in zip(out, specs)
        )
    return out


# ---- reductions --------------------------------------------------------------------------------
def _partial_spec(spec: DTensorSpec, reduce_op: str, dtype: torch.dtype, shape: tuple[int, ...] = ()) -> DTensorSpec:
    placements = tuple(Partial(reduce_op) if isinstance(p, (RaggedShard, Shard)) else p for p in spec.placements)
    stride = tuple(int(s) for s in torch.empty(shape, device="meta").stride())
    return DTensorSpec(spec.mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def _stock(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    return DTensor(local, spec, requires_grad=False)


def _all_dims(x: torch.Tensor, dim: Any) -> bool:
    if dim is None:
        return True
    dims = [dim] if isinstance(dim, int) else list(dim)
    return not dims or sorted(d % max(x.dim(), 1) for d in dims) == list(range(x.dim()))


_IDENTITY = {"max": -math.inf, "min": math.inf}


def _extreme(cls: type, func: Any, args: tuple, kwargs: dict, op: str) -> DTensor:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not _all_dims(x, dim):
        raise unsupported(func, "a reduction over some dims only")
    local = x._local_tensor
    if local.numel():
        val = local.amax() if op == "max" else local.amin()
    elif local.dtype.is_floating_point:
        val = local.new_full((), _IDENTITY[op])
    else:
        info = torch.iinfo(local.dtype)
        val = local.new_full((), info.min if op == "max" else info.max)
    shape = (1,) * x.dim() if keepdim else ()
    return _stock(val.reshape(shape), _partial_spec(x._spec, op, val.dtype, shape))


def _sum_or_mean(cls: type, func: Any, args: tuple, kwargs: dict, mean: bool) -> DTensor:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
    if func in (aten.sum.default, aten.mean.default):
        dim, keepdim, dtype = None, False, args[1] if len(args) > 1 else kwargs.get("dtype")
    if not _all_dims(x, dim):
        raise unsupported(func, "a reduction over some dims only")
    val = x._local_tensor.sum(dtype=dtype)
    if mean:
        val = val / x.numel()
    shape = (1,) * x.dim() if keepdim else ()
    return _stock(val.reshape(shape), _partial_spec(x._spec, "sum", val.dtype, shape))


def _as_flat_shard(x: Any, cls: type) -> DTensor:
    """``x``'s local piece as torch's ``Shard(0)`` piece of the flattened tensor (metadata only), so
    torch's own DTensor norm computes the local norm and marks it with its norm ``Partial``."""
    spec = x._spec
    local = x._local_tensor
    placements = [Shard(0) if isinstance(p, (RaggedShard, Shard)) else p for p in spec.placements]
    return DTensor.from_local(local.reshape(-1), spec.mesh, placements, run_check=False, shape=torch.Size((x.numel(),)), stride=(1,))


def _norm_local_fix(x: Any, ord: float) -> Any:
    """An empty piece has no inf / -inf norm: give it the identity's single element instead."""
    if x._local_tensor.numel() or not (ord in (math.inf, -math.inf)):
        return x
    fill = 0.0 if ord == math.inf else math.inf
    local = x._local_tensor.new_full((1,), fill)
    return type(x)._from_local_and_spec(local, x._spec)


def _vector_norm(cls: type, func: Any, args: tuple, kwargs: dict) -> DTensor:
    x = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    if not _all_dims(x, dim) or keepdim:
        raise unsupported(func, "a norm over some dims only (or keepdim=True)")
    flat = _as_flat_shard(_norm_local_fix(x, float(ord)), cls)
    return torch.linalg.vector_norm(flat, ord, dtype=dtype)


def _norm(cls: type, func: Any, args: tuple, kwargs: dict) -> DTensor:
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if not _all_dims(x, dim) or keepdim:
        raise unsupported(func, "a norm over some dims only (or keepdim=True)")
    ord = 2.0 if p is None else float(p)
    flat = _as_flat_shard(_norm_local_fix(x, ord), cls)
    return torch.linalg.vector_norm(flat, ord, dtype=kwargs.get("dtype"))


def _foreach_norm(cls: type, func: Any, args: tuple, kwargs: dict) -> list:
    tensors = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    ord = float(ord)
    stock = [(_as_flat_shard(_norm_local_fix(t, ord), cls) if isinstance(t, cls) else t) for t in tensors]
    return list(torch._foreach_norm(stock, ord, dtype=dtype))


def _foreach_max(cls: type, func: Any, args: tuple, kwargs: dict) -> list:
    return [_extreme(cls, aten.max.default, (t,), {}, "max") for t in args[0]]


def _all_any(cls: type, func: Any, args: tuple, kwargs: dict, op: str) -> DTensor:
    x = args[0]
    if len(args) > 1 or kwargs.get("dim") is not None:
        raise unsupported(func, "a reduction over some dims only")
    local = x._local_tensor
    val = (local.all() if op == "all" else local.any()).to(torch.int32)
    for dim in _sharded_dims(x._spec):
        group = x._spec.mesh.get_group(dim)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(val, op=dist.ReduceOp.MIN if op == "all" else dist.ReduceOp.MAX, group=group)
    spec = x._spec
    placements = tuple(Replicate() for _ in spec.placements)
    return _stock(val.bool(), DTensorSpec(spec.mesh, placements, tensor_meta=TensorMeta(torch.Size(()), (), torch.bool)))


def _agree(x: Any, local: bool) -> bool:
    """``local`` for every rank of ``x``'s ragged mesh dimension (one all-reduce)."""
    val = torch.tensor(int(local), dtype=torch.int32, device=x._local_tensor.device)
    for dim in _sharded_dims(x._spec):
        if x._spec.mesh.size(dim) == 1:
            continue
        try:
            group = x._spec.mesh.get_group(dim)
        except RuntimeError as e:  # a mesh without process groups (fsdp_optim._testing.emulated_mesh)
            raise NotImplementedError(
                f"{e}: this answer needs every rank's piece; compare the pieces (t.to_local()) instead"
            ) from None
        dist.all_reduce(val, op=dist.ReduceOp.MIN, group=group)
    return bool(val.item())


def _sharded_dims(spec: DTensorSpec) -> list[int]:
    """The mesh dims whose ranks hold different parts (the ragged one, tensor-parallel ``Shard`` ones)."""
    return [i for i, p in enumerate(spec.placements) if isinstance(p, (RaggedShard, Shard))]


def _equal(cls: type, func: Any, args: tuple, kwargs: dict) -> bool:
    """``torch.equal`` / ``torch.allclose`` of two tensors of one layout: every rank's answer, agreed
    (one all-reduce; DTensor answers them globally too)."""
    a, b = args[0], args[1]
    if tuple(a.shape) != tuple(b.shape):
        return False
    ops = _Operands(cls, func)
    ops.spec = next(t._spec for t in (a, b) if isinstance(t, cls))
    la, lb = ops(a), ops(b)
    local = func(la, lb, *args[2:], **kwargs)
    x = a if isinstance(a, cls) else b
    return _agree(x, bool(local))


# ---- the table -----------------------------------------------------------------------------------
_FUSED = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}
_LISTWISE_EXTRA = {"_foreach_copy_", "_foreach_zero_"}
_HANDLERS: dict[Any, Callable] = {}


def _table() -> dict[Any, Callable]:
    def with_op(fn, op):
        return lambda cls, func, args, kwargs: fn(cls, func, args, kwargs, op)

    t: dict[Any, Callable] = {
        aten.copy_.default: _copy,
        aten.zero_.default: _elementwise,
        aten.fill_.Scalar: _elementwise,
        aten.fill_.Tensor: _elementwise,
        aten.detach.default: _like,
        aten.alias.default: _like,
        aten._to_copy.default: _like,
        aten.zeros_like.default: _like,
        aten.ones_like.default: _like,
        aten.empty_like.default: _like,
        aten.full_like.default: _like,
        aten.new_zeros.default: _new_sized,
        aten.new_ones.default: _new_sized,
        aten.new_empty.default: _new_sized,
        aten.new_full.default: _new_sized,
        aten.sum.default: with_op(_sum_or_mean, False),
        aten.sum.dim_IntList: with_op(_sum_or_mean, False),
        aten.mean.default: with_op(_sum_or_mean, True),
        aten.mean.dim: with_op(_sum_or_mean, True),
        aten.max.default: with_op(_extreme, "max"),
        aten.min.default: with_op(_extreme, "min"),
        aten.amax.default: with_op(_extreme, "max"),
        aten.amin.default: with_op(_extreme, "min"),
        aten.linalg_vector_norm.default: _vector_norm,
        aten.norm.Scalar: _norm,
        aten.norm.ScalarOpt_dim: _norm,
        aten._foreach_norm.Scalar: _foreach_norm,
        aten.all.default: with_op(_all_any, "all"),
        aten.equal.default: _equal,
        aten.allclose.default: _equal,
        aten.any.default: with_op(_all_any, "any"),
    }
    if hasattr(aten, "_foreach_max"):
        t[aten._foreach_max.default] = _foreach_max
    return t


def _is_pointwise_foreach(name: str) -> bool:
    base = name[len("_foreach_"):].rstrip("_")
    packet = getattr(aten, base, None)
    if packet is None:
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _returns_tensors(func: Any) -> bool:
    """Only tensors come out (``aten.equal`` is tagged pointwise but returns one bool: a local answer)."""
    return torch.Tag.data_dependent_output not in func.tags and all(
        str(r.type) in ("Tensor", "List[Tensor]") for r in func._schema.returns
    )


def _classify(func: Any) -> Callable:
    if not _HANDLERS:
        _HANDLERS.update(_table())
        hit = _HANDLERS.get(func)
        if hit is not None:
            return hit
    name = func._schema.name.split("::")[-1]
    if not _returns_tensors(func):
        return _refuse
    if name in _FUSED or name in _LISTWISE_EXTRA or (name.startswith("_foreach_") and _is_pointwise_foreach(name)):
        return _listwise
    if torch.Tag.pointwise in func.tags:
        return _elementwise
    return _refuse


def _refuse(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    raise unsupported(func)


def dispatch(cls: type, func: Any, args: tuple, kwargs: dict | None) -> Any:
    """``RaggedDTensor.__torch_dispatch__``: the op's handler from the table (classified once per op)."""
    handler = _HANDLERS.get(func)
    if handler is None:
        handler = _classify(func)
        _HANDLERS[func] = handler
    return handler(cls, func, args, kwargs or {})
