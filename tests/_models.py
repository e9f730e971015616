"""A tiny decoder-only transformer for the sharding tests: dims that divide nothing.

Hidden 72 with 3 heads (head dim 24), MLP 200 wide with biases, vocab 1009 (prime), the
output head tied to the embedding. ``frozen=True`` freezes one parameter
(``layers.1.mlp_norm.weight``) so frozen and trainable tensors share a bucket.

``SwiGLUExperts``: plain-torch experts meeting ``expert_parallel``'s contract (the MoE tests' reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SwiGLUExperts", "TPConfig", "TPTransformer", "TinyConfig", "TinyTransformer", "feed_gradients", "full", "make_batch",
    "tp_backward", "tp_plan", "tp_sharded",
]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class TinyConfig:
    vocab_size: int = 1009
    dim: int = 72
    num_heads: int = 3
    num_layers: int = 2
    mlp_dim: int = 200
    tie_embeddings: bool = True
    frozen: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.num_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.mlp_dim)
        self.w2 = nn.Linear(cfg.mlp_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TinyConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or TinyConfig()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.embed.weight
        if cfg.frozen and cfg.num_layers > 1:
            self.layers[1].mlp_norm.weight.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` as a whole tensor: a sharded one (a DTensor) gathered (a collective)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def make_batch(
    *, batch_size: int, seq_len: int, vocab_size: int = 1009, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(tokens, targets)`` of shape ``[batch_size, seq_len]`` (same on every rank for a seed)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def assert_close_after_adamw(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, lr: float) -> None:
    """Parameters of a sharded AdamW run vs the single-process reference, after a few steps.

    The sharded run reduces gradients over ranks, a different summation order than one process, so
    gradients agree to float32 rounding (~1e-7 relative), and AdamW normalizes each element's update
    to about ``lr``: an element whose gradient is near zero (an embedding row hardly used) can move
    by up to ``lr`` differently. Hence: every element within ``lr / 10``, and 99.5% within 1e-5.
    """
    assert got.keys() == want.keys()
    for k in want:
        a, b = got[k], want[k]
        assert a.shape == b.shape and a.dtype == b.dtype, k
        diff = (a - b).abs()
        assert diff.max().item() <= lr / 10, (k, diff.max().item())
        assert (diff <= 1e-5).float().mean().item() >= 0.995, (k, diff.max().item())


class SwiGLUExperts(nn.Module):
    """SwiGLU experts ``w1, w3: [E, hidden, dim]``, ``w2: [E, dim, hidden]`` in plain torch, one expert's
    contiguous rows at a time (``forward(x sorted by expert, num_tokens_per_expert)``: the contract of
    ``fsdp_optim.sharding.expert_parallel``)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim**0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for e, n in enumerate(num_tokens_per_expert.tolist()):
            xe = x[start : start + n]
            out.append((F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)) @ self.w2[e].T)
            start += n
        return torch.cat(out)


# ---- a model for tensor parallelism (torchtitan's Llama layout, dims that divide by 1, 2 and 4) -----
@dataclass(frozen=True, kw_only=True)
class TPConfig:
    vocab_size: int = 128
    dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    ffn_dim: int = 64


class TPAttention(nn.Module):
    """Heads from the tensors' shapes (``view(..., -1, head_dim)``): TP-local heads under ``ColwiseParallel``."""

    def __init__(self, cfg: TPConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.num_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class TPFeedForward(nn.Module):
    def __init__(self, cfg: TPConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TPBlock(nn.Module):
    def __init__(self, cfg: TPConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = TPAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.feed_forward = TPFeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TPTransformer(nn.Module):
    """Untied embeddings and head (as torchtitan's Llama), so each can take its own TP placement."""

    def __init__(self, cfg: TPConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or TPConfig()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TPBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tp_plan(model: TPTransformer, tp_mesh, *, loss_parallel: bool = True, sequence_parallel: bool = True) -> None:
    """torchtitan's Llama TP plan (``parallelize_module``): attention / feed-forward inputs colwise, outputs
    rowwise, norms sequence-parallel, embeddings rowwise, the head colwise (loss parallel: vocab-sharded
    logits)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )  # fmt: skip

    seq = Shard(1) if sequence_parallel else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        ),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        plan = {
            "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)


def tp_sharded(dp: int, tp: int, blocks=None, *, make=None, plan: bool | None = None):
    """``(mesh, model, reference)``: ``make()`` (default ``TPTransformer()``, seeded) on a ``("dp", "tp")``
    mesh, the TP plan without sequence or loss parallelism (``plan``: default ``tp > 1``), ``fully_shard``
    per block and on the root with ``blocks``; ``reference`` is an unsharded copy made before (the same
    initial values)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_optim

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = make() if make is not None else TPTransformer()
    ref = copy.deepcopy(model)
    if plan if plan is not None else tp > 1:
        tp_plan(model, mesh["tp"], loss_parallel=False, sequence_parallel=False)
    for block in model.layers:
        fsdp_optim.fully_shard(block, mesh=mesh["dp"], blocks=blocks)
    fsdp_optim.fully_shard(model, mesh=mesh["dp"], blocks=blocks)
    return mesh, model, ref


def tp_backward(model: nn.Module, mesh, step: int, *, per_rank: int = 2) -> None:
    """Forward and backward of step ``step``'s batch: ``per_rank`` sequences per data-parallel rank (the
    TP ranks of one data-parallel coordinate read the same)."""
    dp, r = mesh.size(0), mesh.get_coordinate()[0]
    tok, tgt = make_batch(batch_size=per_rank * dp, seq_len=8, vocab_size=model.cfg.vocab_size, seed=step)
    rows = slice(per_rank * r, per_rank * (r + 1))
    F.cross_entropy(model(tok[rows]).flatten(0, 1).float(), tgt[rows].flatten()).backward()


def feed_gradients(model: nn.Module, ref: nn.Module, keep=lambda name: True) -> None:
    """Give the reference's parameters (those whose name ``keep`` takes) the sharded run's reduced
    gradients, gathered, so both optimizers see bitwise the same input."""
    sharded = dict(model.named_parameters())
    for n, b in ref.named_parameters():
        if keep(n):
            b.grad = sharded[n].grad.full_tensor().clone()


def save_state(path: str, how: str, model: nn.Module, opt) -> None:
    """Checkpoint ``model`` and ``opt`` with ``fsdp_optim.save_checkpoint`` (``how="fsdp_optim"``) or torch's
    ``dcp.save(get_state_dict(...))`` (``"torch_dcp"``)."""
    import fsdp_optim

    if how == "fsdp_optim":
        fsdp_optim.save_checkpoint(path, model=model, optimizer=opt)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load_state(path: str, how: str, model: nn.Module, opt) -> None:
    """``save_state``'s checkpoint into ``model`` and ``opt`` (torch's way: ``dcp.load`` + ``set_state_dict``)."""
    import fsdp_optim

    if how == "fsdp_optim":
        fsdp_optim.load_checkpoint(path, model=model, optimizer=opt)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
