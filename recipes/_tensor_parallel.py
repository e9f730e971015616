"""Tensor parallelism for the recipe's Llama (``parallel.tp``): the (dp, tp) mesh and the TP plan.

torchtitan's plan for Llama (Megatron-style TP with sequence parallelism), applied with torch's
``parallelize_module`` before ``fully_shard`` shards each block's TP-local tensors over the
data-parallel ranks (fsdp_optim's [Note: FSDP x TP]):

- per block: ``wq``, ``wk``, ``wv`` and ``w1``, ``w3`` column-wise (each rank computes its
  ``n_heads / tp`` query heads, ``n_kv_heads / tp`` key/value heads, ``ffn_dim / tp`` hidden units),
  ``wo`` and ``w2`` row-wise with the output reduce-scattered along the sequence (``Shard(1)``);
  the norms sequence-parallel (each rank normalizes its ``seq_len / tp`` positions), and the inputs
  of ``attention`` and ``feed_forward`` all-gathered back to the whole sequence
  (``PrepareModuleInput``). The residual stream between them stays sequence-sharded;
- the token embedding row-wise (vocabulary rows split, the output reduce-scattered along the
  sequence), the final norm sequence-parallel, the output head column-wise (the vocabulary split:
  rows of its weight, columns of the logits) with its logits ``Shard(-1)`` for loss parallelism (``loss_parallel``: the cross-entropy
  over vocabulary-sharded logits, no all-gather of the full ``[batch, seq, vocab]``), or
  ``Replicate()`` where the loss needs whole logits.

Mesh: ``init_device_mesh(device, (W // tp, tp), ("dp", "tp"))``, so the ranks of a TP group are
consecutive (rank = dp * tp + t) and a rank's data-parallel coordinate is ``rank // tp``: every TP
rank of one data-parallel coordinate reads the same batch (``data_parallel_rank``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["apply_tensor_parallel", "data_parallel_rank", "local", "loss_context", "tp_mesh"]


def tp_mesh(device_type: str, world: int, tp: int):
    """The 2-D ``("dp", "tp")`` mesh of ``world`` ranks (``tp`` must divide ``world``: checked before)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def data_parallel_rank(rank: int, world: int, tp: int) -> tuple[int, int]:
    """``(data-parallel rank, data-parallel size)`` of global ``rank`` on ``tp_mesh``'s layout."""
    return rank // tp, world // tp


def apply_tensor_parallel(model: nn.Module, mesh, *, loss_parallel: bool = True) -> None:
    """Parallelize the recipe's dense ``Transformer`` over ``mesh`` (1-D, the TP ranks) in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    })  # fmt: skip
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            # (x, cos, sin): x all-gathered along the sequence, the RoPE tables as they are
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })  # fmt: skip


def loss_context(model: nn.Module):
    """Where the loss is computed and differentiated: ``loss_parallel()`` for a model whose logits are
    vocabulary-sharded (``apply_tensor_parallel``), else a context that does nothing."""
    if getattr(model, "tp_mesh", None) is None:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def local(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under ``loss_parallel`` it is a ``DTensor``, replicated over TP)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
