"""Block-quantized AdamW on each rank's local quantization blocks (shared by AdamW8bit and AdamW4bit).

[Note: quantized state on ragged shards]
The moments are quantized in blocks of ``block_size`` consecutive elements of the *global* flat
tensor: a signed dynamic map for ``exp_avg``, an unsigned one for ``exp_avg_sq`` and one absmax
scale per block (Dettmers et al., 8-bit Optimizers via Block-wise Quantization, arXiv:2110.02861;
Li et al., Memory Efficient Optimizers with 4-bit States, arXiv:2309.01507; the torchao scheme:
8-bit codes one per byte with blocks of 256, 4-bit codes two per byte with blocks of 128). The
planner keeps those blocks whole (``elements(block_size)`` spec), so every rank quantizes its own
blocks with no communication and the codes and scales are the ones an unsharded run computes.

Whether a tensor gets quantized state is decided on the global tensor (``numel >= 4096``,
bitsandbytes' and torchao's threshold), never on the shard, so state and results are the same for
every world size. torchao additionally keeps fp32 state when ``numel % block_size != 0`` -- applied
per shard under FSDP2, that makes precision depend on W. We quantize such tensors too: the final
partial block gets its own scale (absmax of its real elements; it is padded to a full block for
the kernel and the padding is dropped). Padding codes never move a block's absmax: signed maps
and the 8-bit unsigned map pad with the code of 0; torchao's 4-bit unsigned map has no 0, so it
pads with its smallest value (1/16 of the scale), which after ``v = beta2 * v + (1 - beta2) * g^2``
(g = 0 there) stays below the real maximum ``>= beta2 * scale``. Where torchao quantizes (size a
multiple of ``block_size`` and >= 4096) the two agree bitwise, with or without ``torch.compile``,
because the step *is* torchao's ``single_param_adam`` applied to this rank's blocks.

State keys, per parameter and the same on every rank: quantized tensors have
``exp_avg_codes``/``exp_avg_sq_codes`` (uint8: one code per byte for 8 bits, two for 4 bits, high
nibble first as torchao packs) and ``exp_avg_scale``/``exp_avg_sq_scale`` (fp32, one per block;
``max_exp_avg_sq_*`` with amsgrad); small tensors have ``exp_avg``/``exp_avg_sq`` in the
parameter's dtype (as torchao). ``step`` is a replicated fp32 scalar.

[Note: runs]
Under ``fully_shard`` a bucket's local parameters are views into one flat segment, back to back, and
so are their gradients. Calling torchao's step once per parameter costs one call (and, compiled, one
graph per distinct local size) per parameter. With ``fuse_runs=True`` (the default) the parameters of a
group that lie back to back in one storage are grouped into *runs* at construction, each run's state
is re-homed into one buffer per key (every parameter's state entries stay views of it, so state dicts
and checkpoints are unchanged), and a step makes one call on the run's flat span. The arithmetic is
elementwise and a quantization block never straddles two parameters, so the bits are those of the
per-parameter calls:

- a run holds only quantized or only fp32-state parameters;
- in a quantized run every piece but the last ends on a ``block_size`` boundary (pieces start on one:
  the planner keeps blocks whole), so the run's blocks are the tensors' global blocks, and a tensor's
  partial final block can only end a run (it is padded there as for a single parameter);
- a run is split, at each step, around parameters without a gradient and between parameters whose
  step counters differ (``torch.equal`` on the CPU counters: no host read of device values);
- the spans are checked at every step (pointer arithmetic only): parameters no longer adjacent (their
  storage replaced) are stepped one by one, gradients that are not adjacent are concatenated, and
  state replaced from outside (a checkpoint load) is re-homed into one buffer first.

Separate tensors (no ``fully_shard``) form runs of one and behave as before. Measured in
``benchmarks/bench_adamw8bit_compile.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..sharding.contract import BlockRule, LocalShard, elements
from ._base import StateShard, check_adam_hparams, checked_param_info, local_tensor, make_dcp_ready, per_element, require_spec, profiled_step, state_range

__all__ = ["QUANTIZE_MIN_NUMEL", "QuantFormat", "FORMAT_8BIT", "FORMAT_4BIT", "quantize_blockwise", "dequantize_blockwise"]

QUANTIZE_MIN_NUMEL = 4096
"""Tensors with fewer elements keep fp32 moments (bitsandbytes' ``min_8bit_size``, torchao's rule)."""

_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False))  # (name, signed)


@dataclass(frozen=True, kw_only=True)
class QuantFormat:
    """One quantized-state format: code width and torchao's maps and state subclass for it."""

    bits: int  # 8: one code per byte; 4: two codes per byte, high nibble first
    module: str  # the torchao module holding get_qmap_signed / get_qmap_unsigned and the subclass
    state_class: str

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    def num_code_bytes(self, numel: int) -> int:
        return -(-numel // self.codes_per_byte)


FORMAT_8BIT = QuantFormat(bits=8, module="torchao.optim.subclass_8bit", state_class="OptimState8bit")
FORMAT_4BIT = QuantFormat(bits=4, module="torchao.optim.subclass_4bit", state_class="OptimState4bit")


def _torchao(fmt: QuantFormat):
    import importlib

    return importlib.import_module(fmt.module)


@cache
def _qmap_list(fmt: QuantFormat, signed: bool) -> tuple[float, ...]:
    mod = _torchao(fmt)
    return tuple(mod.get_qmap_signed() if signed else mod.get_qmap_unsigned())


@cache
def _qmap(fmt: QuantFormat, signed: bool, device: torch.device) -> Tensor:
    return torch.tensor(_qmap_list(fmt, signed), dtype=torch.float32, device=device)


@cache
def _pad_code(fmt: QuantFormat, signed: bool) -> int:
    """The code padding a partial block: the map's 0, or its smallest value where it has no 0
    (torchao's 4-bit unsigned map); see [Note: quantized state on ragged shards]."""
    qmap = _qmap_list(fmt, signed)
    return qmap.index(0.0) if 0.0 in qmap else min(range(len(qmap)), key=lambda i: abs(qmap[i]))


def _pad_byte(fmt: QuantFormat, signed: bool) -> int:
    c = _pad_code(fmt, signed)
    return c if fmt.bits == 8 else (c << 4) | c


def _pack(codes: Tensor, fmt: QuantFormat) -> Tensor:
    """One code per element (uint8) -> the stored bytes (4 bits: pairs, high nibble first, as torchao)."""
    if fmt.bits == 8:
        return codes
    if codes.numel() % 2:
        raise AssertionError("4-bit codes are packed from an even number of elements")
    return (codes[::2] << 4) | codes[1::2]


def _unpack(stored: Tensor, fmt: QuantFormat) -> Tensor:
    if fmt.bits == 8:
        return stored
    return torch.stack([stored >> 4, stored & 0b1111], dim=-1).reshape(-1)


def quantize_blockwise(
    x: Tensor, *, signed: bool, block_size: int = 256, fmt: QuantFormat = FORMAT_8BIT
) -> tuple[Tensor, Tensor]:
    """``(stored codes, scale)`` of flat ``x``: absmax per block of ``block_size``, the last one may
    be partial (padded with the format's padding code, which the absmax ignores).

    Uses torchao's ``scale_tensor`` and ``quantize_{8,4}bit_with_qmap`` on padded blocks.
    """
    from torchao.optim.quant_utils import quantize_4bit_with_qmap, quantize_8bit_with_qmap, scale_tensor

    x = x.reshape(-1).float()
    n = x.numel()
    padded = x.new_zeros(-(-n // block_size) * block_size)
    padded[:n] = x
    scaled, scale = scale_tensor(padded, block_size)
    quantize = quantize_8bit_with_qmap if fmt.bits == 8 else quantize_4bit_with_qmap
    codes = quantize(scaled, _qmap(fmt, signed, x.device))
    codes[n:] = _pad_code(fmt, signed)
    return _pack(codes, fmt)[: fmt.num_code_bytes(n)], scale


def dequantize_blockwise(
    codes: Tensor, scale: Tensor, *, signed: bool, block_size: int = 256, fmt: QuantFormat = FORMAT_8BIT,
    numel: int | None = None,
) -> Tensor:
    """Flat fp32 values of stored ``codes`` and per-block ``scale``; partial last block allowed
    (``numel``: the element count, needed for 4-bit codes of an odd count)."""
    values = _unpack(codes.reshape(-1), fmt)
    n = values.numel() if numel is None else numel
    values = _qmap(fmt, signed, codes.device)[values[:n].int()]
    return values * scale.repeat_interleave(block_size)[:n]


class _Kind(NamedTuple):
    quantized: bool
    info: LocalShard


@cache
def _compiled_step():
    from torchao.optim.adam import single_param_adam

    # A wrapper of our own, so that dynamo keeps our graphs (plain flat shards) in a cache apart
    # from torchao's (which may hold DTensor graphs of the same function in the same process).
    def adamw_quantized_step(*args):
        return single_param_adam(*args)

    return torch.compile(adamw_quantized_step, fullgraph=True, dynamic=False)


def _step_fn(compile: bool) -> Callable:
    if compile:
        return _compiled_step()
    from torchao.optim.adam import single_param_adam

    return single_param_adam


class QuantizedAdamW(torch.optim.Optimizer):
    """torchao's block-quantized AdamW on sharded parameters (base of AdamW8bit and AdamW4bit).

    Subclasses set ``_format``, ``_name`` and ``_default_block_size``. See [Note: quantized state on
    ragged shards]. ``step()`` issues no collectives.
    """

    _format: QuantFormat
    _name: str
    _default_block_size: int
    blocks: BlockRule

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        block_size: int | None = None,
        compile: bool = True,
        fuse_runs: bool = True,
    ) -> None:
        check_adam_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        block_size = self._default_block_size if block_size is None else block_size
        if block_size < 1 or block_size % self._format.codes_per_byte:
            raise ValueError(
                f"{self._name}: block_size must be a positive multiple of {self._format.codes_per_byte}, got {block_size}"
            )
        self.block_size = block_size
        self.compile = compile
        self.fuse_runs = fuse_runs
        self._runs: list[list[Tensor]] = []
        if block_size != self._default_block_size:
            self.blocks = _rule(block_size)  # instance override: what fully_shard must keep whole
        self._kinds: dict[Tensor, _Kind] = {}
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)
        self._state_ready = True
        self._build_runs()
        make_dcp_ready(self)

    # ---- state ------------------------------------------------------------------------
    def _kind(self, p: Tensor) -> _Kind:
        kind = self._kinds.get(p)
        if kind is None:
            name = self._name
            info = checked_param_info(p, self.blocks, optimizer=name, blocks=f"{name}.blocks")
            quantized = info.numel >= QUANTIZE_MIN_NUMEL
            if quantized:
                need = elements(self.block_size)
                require_spec(
                    info,
                    info.layout.is_aligned(need),
                    optimizer=name,
                    need=f"its rank boundaries on {need} quantization blocks of the global tensor",
                    blocks=f"{name}.blocks (elements({self.block_size}))",
                )
            if not p.is_floating_point():
                raise ValueError(f"{name}: parameter {info.fqn or '<unnamed>'} is {p.dtype}; need floating point")
            if quantized and not p.is_contiguous():
                raise ValueError(
                    f"{name}: parameter {info.fqn or '<unnamed>'} (shape {tuple(p.shape)}) is not contiguous; "
                    "quantization blocks are runs of the flat tensor, so pass contiguous parameters"
                )
            kind = self._kinds[p] = _Kind(quantized, info)
        return kind

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        quantized, info = self._kind(p)
        state = self.state[p]
        if state:
            return
        state["step"] = torch.tensor(0.0)  # as torchao: fp32 scalar on CPU
        bs = self.block_size
        num_blocks = -(-info.end // bs) - -(-info.start // bs)
        for name, _ in _MOMENTS:
            if name == "max_exp_avg_sq" and not group["amsgrad"]:
                continue
            if quantized:
                # As torchao's zeros(): code 0 everywhere, scale 0 (so every value is 0).
                state[f"{name}_codes"] = torch.zeros(
                    self._format.num_code_bytes(local_tensor(p).numel()), dtype=torch.uint8, device=p.device
                )
                state[f"{name}_scale"] = torch.zeros(num_blocks, dtype=torch.float32, device=p.device)
            else:
                state[name] = torch.zeros_like(local_tensor(p), memory_format=torch.contiguous_format)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_state_ready", False):  # __init__ creates the first groups' state itself
            group = self.param_groups[-1]
            for p in group["params"]:
                self._init_state(p, group)
            self._build_runs()

    # ---- runs ---------------------------------------------------------------------------
    def _build_runs(self) -> None:
        """Group adjacent parameters into runs and give each run contiguous state (see [Note: runs])."""
        self._runs = []
        for group in self.param_groups:
            for run in _adjacent_runs(group["params"], self._kind, self.block_size) if self.fuse_runs else []:
                if len(run) > 1:
                    self._share_state(run)
                    self._runs.append(run)
        self._run_of = {p: run for run in self._runs for p in run}

    def _share_state(self, run: list[Tensor]) -> None:
        """Re-home the run's state in one buffer per key, values kept (``step`` stays per parameter)."""
        for key in [k for k in self.state[run[0]] if k != "step"]:
            buf = torch.cat([self.state[p][key].reshape(-1) for p in run])
            off = 0
            for p in run:
                n = self.state[p][key].numel()
                self.state[p][key] = buf[off : off + n].view_as(self.state[p][key])
                off += n

    def is_quantized(self, p: Tensor) -> bool:
        """Whether ``p`` has quantized moments (decided on its global size, the same on every rank)."""
        return self._kind(p).quantized

    def state_shards(self, p: Tensor) -> dict[str, StateShard]:
        """Codes and fp32 moments: the parameter's range (in bytes for packed codes); scales: the
        range of this rank's blocks."""
        quantized, info = self._kind(p)
        elems = per_element(info)
        if not quantized:
            return {k: elems for k, _ in _MOMENTS if k in self.state[p]}
        cpb = self._format.codes_per_byte
        # A rank's range starts on a block boundary (a multiple of codes_per_byte) and ends on one or
        # at the tensor's end, so its codes are whole bytes of the global byte vector. An empty range
        # may sit at the end of a tensor of odd length: it holds no byte (not the half-used last one).
        # (as a function of a rank bound b: the bytes before b; the last bound, numel, counts a partial byte)
        code_bytes = state_range(info, lambda b: -(-b // cpb) if b == info.numel else b // cpb)
        bs = self.block_size
        blocks = state_range(info, lambda b: -(-b // bs))
        out = {}
        for name, _ in _MOMENTS:
            if f"{name}_codes" in self.state[p]:
                out[f"{name}_codes"] = code_bytes
                out[f"{name}_scale"] = blocks
        return out

    def dequantized_state(self, p: Tensor) -> dict[str, Tensor]:
        """This rank's moments of ``p`` as flat fp32 tensors (dequantized where quantized)."""
        quantized, _ = self._kind(p)
        state = self.state[p]
        out = {}
        for name, signed in _MOMENTS:
            if quantized and f"{name}_codes" in state:
                out[name] = dequantize_blockwise(
                    state[f"{name}_codes"], state[f"{name}_scale"], signed=signed, block_size=self.block_size,
                    fmt=self._format, numel=local_tensor(p).numel(),
                )
            elif name in state:
                out[name] = state[name].reshape(-1).float()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch.optim.Optimizer.load_state_dict casts every non-"step" state tensor to the parameter's
        # dtype, which would turn uint8 codes into floats and round fp32 scales of bf16 parameters;
        # put the saved codes and scales back with their own dtypes.
        keep = {
            (pid, key): value
            for pid, st in state_dict["state"].items()
            for key, value in st.items()
            if isinstance(key, str) and key.endswith(("_codes", "_scale"))
        }
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        id_to_param = dict(zip(saved_ids, params))
        for (pid, key), value in keep.items():
            p = id_to_param[pid]
            self.state[p][key] = value.to(device=p.device, copy=True)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)  # parameters the loaded state did not cover
        self._build_runs()  # the loaded tensors go back into contiguous run buffers

    # ---- step -------------------------------------------------------------------------
    @profiled_step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fn = _step_fn(self.compile)
        with torch._dynamo.utils.disable_cache_limit():  # one graph per distinct run / shape, as torchao
            for group in self.param_groups:
                lr = group["lr"]
                lr = lr if isinstance(lr, Tensor) else torch.tensor(lr, dtype=torch.float32)
                beta1, beta2 = group["betas"]
                args = (lr, float(beta1), float(beta2), group["weight_decay"], group["eps"], True, False)
                seen: set[int] = set()
                for p in group["params"]:
                    run = self._run_of.get(p)
                    if run is not None:
                        if id(run) not in seen:
                            seen.add(id(run))
                            self._step_run(fn, run, group["amsgrad"], args)
                        continue
                    if p.grad is None:
                        continue
                    self._check_grad(p)
                    self.state[p]["step"] += 1
                    if local_tensor(p).numel():
                        self._step_span(fn, [p], group["amsgrad"], args)
        return loss

    def _check_grad(self, p: Tensor) -> None:
        if p.grad.is_sparse:
            raise RuntimeError(f"{self._name} does not support sparse gradients")

    def _step_run(self, fn, run: list[Tensor], amsgrad: bool, args: tuple) -> None:
        """Step the parameters of ``run`` that have gradients: one call per maximal piece of adjacent
        equal step counters."""
        keys = [k for k in self.state[run[0]] if k != "step"]
        if not all(_adjacent([self.state[p][k] for p in run]) for k in keys):
            self._share_state(run)  # state tensors replaced from outside (a checkpoint load): re-home them
        pieces: list[list[Tensor]] = [[]]
        for p in run:
            if p.grad is None:
                pieces.append([])
                continue
            self._check_grad(p)
            cur = pieces[-1]
            if cur and not self._same_step(cur[0], p):
                pieces.append(cur := [])
            cur.append(p)
        for piece in pieces:
            if not piece:
                continue
            for q in piece:
                self.state[q]["step"] += 1
            self._step_span(fn, piece, amsgrad, args)

    def _same_step(self, a: Tensor, b: Tensor) -> bool:
        """Whether ``a`` and ``b`` have taken the same number of steps (``torch.equal`` of two CPU
        scalars: no host read of a device value). Each parameter keeps its own counter, so state
        built elsewhere (a checkpoint load) can never make one counter stand for two parameters."""
        sa, sb = self.state[a]["step"], self.state[b]["step"]
        return sa is sb or torch.equal(sa, sb)

    def _step_span(self, fn, piece: list[Tensor], amsgrad: bool, args: tuple) -> None:
        """One step call on the flat span of ``piece`` (adjacent parameters, contiguous state)."""
        state0 = self.state[piece[0]]
        step = state0["step"]
        if len(piece) > 1 and not _adjacent([local_tensor(p) for p in piece]):  # storage replaced since the runs were built
            for p in piece:
                self._step_span(fn, [p], amsgrad, args)
            return
        quantized = self._kind(piece[0]).quantized
        if len(piece) == 1 and not quantized:  # as torchao: the parameter's own shape and strides
            p, g = local_tensor(piece[0]), local_tensor(piece[0].grad)
            fn(p.detach(), g, step, state0["exp_avg"], state0["exp_avg_sq"], state0.get("max_exp_avg_sq"), *args)
            return
        flat = _span([local_tensor(p).detach() for p in piece])
        grads = [local_tensor(p.grad) for p in piece]
        grad = _span(grads) if _adjacent(grads) else torch.cat([g.reshape(-1) for g in grads])
        span_state = {k: _span([self.state[p][k] for p in piece]) for k in state0 if k != "step"}
        if quantized:
            self._step_quantized(fn, flat, grad, span_state, step, amsgrad, args)
        else:
            fn(flat, grad, step, span_state["exp_avg"], span_state["exp_avg_sq"], span_state.get("max_exp_avg_sq"), *args)

    def _state_tensor(self, codes: Tensor, scale: Tensor, signed: bool, numel: int, dtype: torch.dtype):
        """torchao's state subclass over ``numel`` elements' stored codes and their scales."""
        cls = getattr(_torchao(self._format), self._format.state_class)
        qmap = _qmap(self._format, signed, codes.device)
        if self._format.bits == 8:
            return cls(codes, scale, qmap, signed, dtype=dtype)
        return cls(codes, scale, qmap, signed, (numel,), dtype=dtype)

    def _step_quantized(
        self, fn, flat: Tensor, grad: Tensor, state: dict[str, Tensor], step: Tensor, amsgrad: bool, args: tuple
    ) -> None:
        """torchao's step on the flat span ``flat`` whose codes and scales are ``state``'s tensors."""
        bs = self.block_size
        fmt = self._format
        cpb = fmt.codes_per_byte
        n = flat.numel()
        n_full = n // bs * bs

        def moment(name: str, signed: bool, lo: int, hi: int, codes: Tensor | None = None):
            codes = state[f"{name}_codes"][lo // cpb : hi // cpb] if codes is None else codes
            scale = state[f"{name}_scale"][lo // bs : -(-hi // bs)]
            return self._state_tensor(codes, scale, signed, codes.numel() * cpb, flat.dtype)

        def run(p_part: Tensor, g_part: Tensor, lo: int, hi: int, codes: dict[str, Tensor] | None = None) -> None:
            m = moment("exp_avg", True, lo, hi, codes and codes["exp_avg"])
            v = moment("exp_avg_sq", False, lo, hi, codes and codes["exp_avg_sq"])
            vmax = None
            if amsgrad:
                # torchao's step cannot take a quantized max (torch.maximum is not implemented for
                # its state subclasses): hand it the dequantized values and re-quantize what it wrote.
                vmax_q = moment("max_exp_avg_sq", False, lo, hi, codes and codes["max_exp_avg_sq"])
                vmax = vmax_q.dequantize(torch.float32).reshape(-1)
            fn(p_part, g_part, step, m, v, vmax, *args)
            if vmax is not None:
                c, sc = quantize_blockwise(vmax, signed=False, block_size=bs, fmt=fmt)
                vmax_q.codes.copy_(c)
                vmax_q.scale.copy_(sc)

        if n_full:
            run(flat[:n_full], grad[:n_full], 0, n_full)
        if n > n_full:  # the global tensor's final partial block: pad it to a full block
            k = n - n_full
            p_pad = flat.new_zeros(bs)
            p_pad[:k] = flat[n_full:]
            g_pad = grad.new_zeros(bs)
            g_pad[:k] = grad[n_full:]
            codes = {}
            lo, hi = n_full // cpb, fmt.num_code_bytes(n)
            for name, signed in _MOMENTS:
                if f"{name}_codes" in state:
                    codes[name] = torch.full((bs // cpb,), _pad_byte(fmt, signed), dtype=torch.uint8, device=flat.device)
                    codes[name][: hi - lo] = state[f"{name}_codes"][lo:hi]
            run(p_pad, g_pad, n_full, n, codes)
            flat[n_full:] = p_pad[:k]
            for name, c in codes.items():
                state[f"{name}_codes"][lo:hi] = c[: hi - lo]


def _adjacent(tensors: list[Tensor]) -> bool:
    """Whether ``tensors`` are contiguous and follow each other in one storage, in this order."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors):
        return False
    if len(tensors) == 1:
        return True
    base = first.untyped_storage().data_ptr()
    end = first.data_ptr() + first.numel() * first.element_size()
    for t in tensors[1:]:
        if t.untyped_storage().data_ptr() != base or t.data_ptr() != end:
            return False
        end += t.numel() * t.element_size()
    return True


def _span(tensors: list[Tensor]) -> Tensor:
    """The flat view of adjacent contiguous ``tensors`` (see ``_adjacent``), writes going to them."""
    first = tensors[0]
    n = sum(t.numel() for t in tensors)
    return first.as_strided((n,), (1,), first.storage_offset())


def _adjacent_runs(params: list[Tensor], kind: Callable[[Tensor], _Kind], block_size: int) -> list[list[Tensor]]:
    """Maximal runs of ``params`` (one parameter group) adjacent in memory, in memory order, that one
    step call may cover ([Note: runs]): same dtype and kind; quantized ones must end on a block
    boundary except the run's last."""
    L = local_tensor  # (runs are found on the local pieces; the parameters stay the keys)
    items = [p for p in params if L(p).numel() > 0 and L(p).is_contiguous()]
    items.sort(key=lambda p: (p.device.type, p.device.index or 0, L(p).untyped_storage().data_ptr(), L(p).data_ptr()))
    runs: list[list[Tensor]] = []
    for p in items:
        run = runs[-1] if runs else None
        if (
            run is not None
            and _adjacent([L(run[-1]), L(p)])
            and kind(p).quantized == kind(run[-1]).quantized
            and (not kind(p).quantized or L(run[-1]).numel() % block_size == 0)
        ):
            run.append(p)
        else:
            runs.append([p])
    return runs


def _rule(block_size: int) -> BlockRule:
    from ._rules import adamw8bit_rule

    return adamw8bit_rule(block_size)
