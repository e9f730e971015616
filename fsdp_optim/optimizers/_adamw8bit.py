"""8-bit AdamW on each rank's local quantization blocks, equal to torchao's AdamW8bit unsharded.

[Note: 8-bit state on ragged shards]
The moments are quantized in blocks of ``block_size`` (256) consecutive elements of the *global*
flat tensor: a signed dynamic map for ``exp_avg``, an unsigned one for ``exp_avg_sq`` and one
absmax scale per block (Dettmers et al., 8-bit Optimizers via Block-wise Quantization,
arXiv:2110.02861; the torchao/bitsandbytes scheme). The planner keeps those blocks whole
(``elements(256)`` spec), so every rank quantizes its own blocks with no communication and the
codes and scales are the ones an unsharded run computes.

Whether a tensor gets 8-bit state is decided on the global tensor (``numel >= 4096``, bitsandbytes'
and torchao's threshold), never on the shard, so state and results are the same for every world
size. torchao additionally keeps fp32 state when ``numel % block_size != 0`` -- applied per shard
under FSDP2, that makes precision depend on W (DESIGN.md). We quantize such tensors too: the final
partial block gets its own scale (absmax of its real elements; it is zero-padded to a full block
for the kernel and the padding is dropped). Where torchao quantizes (size a multiple of 256 and
>= 4096) the two agree bitwise, with or without ``torch.compile``, because the step *is* torchao's
``single_param_adam`` applied to this rank's blocks.

State keys, per parameter and the same on every rank: quantized tensors have
``exp_avg_codes``/``exp_avg_sq_codes`` (uint8, one per element) and ``exp_avg_scale``/
``exp_avg_sq_scale`` (fp32, one per block; ``max_exp_avg_sq_*`` with amsgrad); small tensors have
``exp_avg``/``exp_avg_sq`` in the parameter's dtype (as torchao). ``step`` is a replicated fp32 scalar.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..sharding._blocks import elements
from ..sharding._shard_info import ShardInfo
from ._base import StateShard, check_adam_hparams, checked_param_info, make_dcp_ready, require_spec
from ._rules import adamw8bit_rule

__all__ = ["AdamW8bit", "QUANTIZE_MIN_NUMEL", "quantize_blockwise", "dequantize_blockwise"]

QUANTIZE_MIN_NUMEL = 4096
"""Tensors with fewer elements keep fp32 moments (bitsandbytes' ``min_8bit_size``, torchao's rule)."""

_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False))  # (name, signed)


@cache
def _qmap_list(signed: bool) -> tuple[float, ...]:
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    return get_qmap_signed() if signed else get_qmap_unsigned()


@cache
def _qmap(signed: bool, device: torch.device) -> Tensor:
    return torch.tensor(_qmap_list(signed), dtype=torch.float32, device=device)


@cache
def _zero_code(signed: bool) -> int:
    """The code whose map value is exactly 0 (padding that does not move a block's absmax)."""
    return _qmap_list(signed).index(0.0)


def quantize_blockwise(x: Tensor, *, signed: bool, block_size: int = 256) -> tuple[Tensor, Tensor]:
    """``(codes, scale)`` of flat ``x``: absmax per block of ``block_size``, the last one may be partial.

    Uses torchao's ``scale_tensor`` and ``quantize_8bit_with_qmap`` on zero-padded blocks.
    """
    from torchao.optim.quant_utils import quantize_8bit_with_qmap, scale_tensor

    x = x.reshape(-1).float()
    n = x.numel()
    padded = x.new_zeros(-(-n // block_size) * block_size)
    padded[:n] = x
    scaled, scale = scale_tensor(padded, block_size)
    return quantize_8bit_with_qmap(scaled, _qmap(signed, x.device))[:n], scale


def dequantize_blockwise(codes: Tensor, scale: Tensor, *, signed: bool, block_size: int = 256) -> Tensor:
    """Flat fp32 values of ``codes`` (one per element) and per-block ``scale``; partial last block allowed."""
    n = codes.numel()
    qmap = _qmap(signed, codes.device)
    values = qmap[codes.reshape(-1).int()]
    return values * scale.repeat_interleave(block_size)[:n]


class _Kind(NamedTuple):
    quantized: bool
    info: ShardInfo


@cache
def _compiled_step():
    from torchao.optim.adam import single_param_adam

    # A wrapper of our own, so that dynamo keeps our graphs (plain flat shards) in a cache apart
    # from torchao's (which may hold DTensor graphs of the same function in the same process).
    def adamw8bit_step(*args):
        return single_param_adam(*args)

    return torch.compile(adamw8bit_step, fullgraph=True, dynamic=False)


def _step_fn(compile: bool):
    if compile:
        return _compiled_step()
    from torchao.optim.adam import single_param_adam

    return single_param_adam


class AdamW8bit(torch.optim.Optimizer):
    """torchao's ``AdamW8bit`` on sharded parameters: block-wise 8-bit moments, quantized locally.

    Needs every rank boundary of a quantized tensor on a ``block_size`` boundary of the global flat
    tensor (``AdamW8bit.blocks``); see [Note: 8-bit state on ragged shards]. ``compile=True``
    (torchao's behavior) runs the step through ``torch.compile``; ``False`` runs it eagerly (no
    compiler needed; numerics then equal torchao run with ``TORCHDYNAMO_DISABLE=1``, not compiled
    torchao: inductor contracts multiply-adds). Compiling builds one graph per distinct local shape
    (seconds each on CPU, first step only), as torchao does. ``amsgrad=True`` keeps the running max
    in 8 bits too (torchao's own step fails on an 8-bit max; see ``_step_quantized``). ``step()``
    issues no collectives.
    """

    blocks = staticmethod(adamw8bit_rule(256))

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        block_size: int = 256,
        compile: bool = True,
    ) -> None:
        check_adam_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.compile = compile
        if block_size != 256:
            self.blocks = adamw8bit_rule(block_size)  # instance override: what fully_shard must keep whole
        self._kinds: dict[Tensor, _Kind] = {}
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)
        self._state_ready = True
        make_dcp_ready(self)

    # ---- state ------------------------------------------------------------------------
    def _kind(self, p: Tensor) -> _Kind:
        kind = self._kinds.get(p)
        if kind is None:
            info = checked_param_info(p, self.blocks, optimizer="AdamW8bit", blocks="AdamW8bit.blocks")
            quantized = info.numel >= QUANTIZE_MIN_NUMEL
            if quantized:
                need = elements(self.block_size)
                require_spec(
                    info,
                    info.layout.is_aligned(need),
                    optimizer="AdamW8bit",
                    need=f"its rank boundaries on {need} quantization blocks of the global tensor",
                    blocks=f"AdamW8bit.blocks (adamw8bit_rule({self.block_size}))",
                )
            if not p.is_floating_point():
                raise ValueError(f"AdamW8bit: parameter {info.fqn or '<unnamed>'} is {p.dtype}; need floating point")
            if quantized and not p.is_contiguous():
                raise ValueError(
                    f"AdamW8bit: parameter {info.fqn or '<unnamed>'} (shape {tuple(p.shape)}) is not contiguous; "
                    "8-bit blocks are runs of the flat tensor, so pass contiguous parameters"
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
                state[f"{name}_codes"] = torch.zeros(p.numel(), dtype=torch.uint8, device=p.device)
                state[f"{name}_scale"] = torch.zeros(num_blocks, dtype=torch.float32, device=p.device)
            else:
                state[name] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_state_ready", False):  # __init__ creates the first groups' state itself
            group = self.param_groups[-1]
            for p in group["params"]:
                self._init_state(p, group)

    def is_quantized(self, p: Tensor) -> bool:
        """Whether ``p`` has 8-bit moments (decided on its global size, the same on every rank)."""
        return self._kind(p).quantized

    def state_shards(self, p: Tensor) -> dict[str, StateShard]:
        """Codes and fp32 moments: the parameter's range; scales: the range of this rank's blocks."""
        quantized, info = self._kind(p)
        elems = StateShard(info.numel, info.start, info.end)
        if not quantized:
            return {k: elems for k, _ in _MOMENTS if k in self.state[p]}
        bs = self.block_size
        blocks = StateShard(-(-info.numel // bs), -(-info.start // bs), -(-info.end // bs))
        out = {}
        for name, _ in _MOMENTS:
            if f"{name}_codes" in self.state[p]:
                out[f"{name}_codes"] = elems
                out[f"{name}_scale"] = blocks
        return out

    def dequantized_state(self, p: Tensor) -> dict[str, Tensor]:
        """This rank's moments of ``p`` as flat fp32 tensors (dequantized where 8-bit)."""
        quantized, _ = self._kind(p)
        state = self.state[p]
        out = {}
        for name, signed in _MOMENTS:
            if quantized and f"{name}_codes" in state:
                out[name] = dequantize_blockwise(
                    state[f"{name}_codes"], state[f"{name}_scale"], signed=signed, block_size=self.block_size
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

    # ---- step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fn = _step_fn(self.compile)
        with torch._dynamo.utils.disable_cache_limit():  # one graph per local shape, as torchao
            for group in self.param_groups:
                lr = group["lr"]
                lr = lr if isinstance(lr, Tensor) else torch.tensor(lr, dtype=torch.float32)
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("AdamW8bit does not support sparse gradients")
                    state = self.state[p]
                    state["step"] += 1
                    if p.numel() == 0:
                        continue
                    args = (lr, float(beta1), float(beta2), group["weight_decay"], group["eps"], True, False)
                    if self._kind(p).quantized:
                        self._step_quantized(fn, p, state, group["amsgrad"], args)
                    else:
                        fn(
                            p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                            state.get("max_exp_avg_sq"), *args,
                        )
        return loss

    def _step_quantized(self, fn, p: Tensor, state: dict[str, Tensor], amsgrad: bool, args: tuple) -> None:
        from torchao.optim.subclass_8bit import OptimState8bit

        bs = self.block_size
        flat = p.detach().view(-1)
        grad = p.grad.reshape(-1)
        n = flat.numel()
        n_full = n // bs * bs

        def moment(name: str, signed: bool, lo: int, hi: int, codes: Tensor | None = None) -> OptimState8bit:
            codes = state[f"{name}_codes"][lo:hi] if codes is None else codes
            scale = state[f"{name}_scale"][lo // bs : -(-hi // bs)]
            return OptimState8bit(codes, scale, _qmap(signed, p.device), signed, dtype=p.dtype)

        def run(p_part: Tensor, g_part: Tensor, lo: int, hi: int, codes: dict[str, Tensor] | None = None) -> None:
            m = moment("exp_avg", True, lo, hi, codes and codes["exp_avg"])
            v = moment("exp_avg_sq", False, lo, hi, codes and codes["exp_avg_sq"])
            vmax = None
            if amsgrad:
                # torchao's step cannot take an 8-bit max (torch.maximum is not implemented for
                # OptimState8bit): hand it the dequantized values and re-quantize what it wrote.
                vmax_q = moment("max_exp_avg_sq", False, lo, hi, codes and codes["max_exp_avg_sq"])
                vmax = vmax_q.dequantize(torch.float32)
            fn(p_part, g_part, state["step"], m, v, vmax, *args)
            if vmax is not None:
                c, sc = quantize_blockwise(vmax, signed=False, block_size=bs)
                vmax_q.codes.copy_(c)
                vmax_q.scale.copy_(sc)

        if n_full:
            run(flat[:n_full], grad[:n_full], 0, n_full)
        if n > n_full:  # the global tensor's final partial block: zero-pad it to a full block
            k = n - n_full
            p_pad = flat.new_zeros(bs)
            p_pad[:k] = flat[n_full:]
            g_pad = grad.new_zeros(bs)
            g_pad[:k] = grad[n_full:]
            codes = {}
            for name, signed in _MOMENTS:
                if f"{name}_codes" in state:
                    codes[name] = torch.full((bs,), _zero_code(signed), dtype=torch.uint8, device=p.device)
                    codes[name][:k] = state[f"{name}_codes"][n_full:]
            run(p_pad, g_pad, n_full, n, codes)
            flat[n_full:] = p_pad[:k]
            for name, c in codes.items():
                state[f"{name}_codes"][n_full:] = c[:k]
