"""QK-clip with heads split over tensor-parallel ranks (``ColwiseParallel`` wq / wk): each TP rank records
its own heads' max logits, which go to their global positions before the MAX over the world, and each
rank scales the rows of its heads. Reference: the same model in one process, clipped by ``qk_clip_``
(maxima equal to fp32 rounding of the TP-local matmuls: rtol 1e-5; clipped weights rtol 1e-5)."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import attention_with_max_logits, qk_clip_
from tests._models import TPAttention, TPConfig, TPTransformer, make_batch, tp_plan

TAU = 0.5


class _Recording(TPAttention):
    def __init__(self, cfg: TPConfig) -> None:
        super().__init__(cfg)
        self.n_heads = cfg.num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = attention_with_max_logits(self, q, k, v, causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def _model() -> TPTransformer:
    torch.manual_seed(0)
    model = TPTransformer()
    for block in model.layers:
        old = block.attention
        block.attention = _Recording(model.cfg)
        block.attention.load_state_dict(old.state_dict())
    return model


def _tokens():
    return make_batch(batch_size=2, seq_len=8, vocab_size=TPConfig().vocab_size, seed=0)[0]


def _clip_tp(dp: int, tp: int):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _model()
    tp_plan(model, mesh["tp"], loss_parallel=False, sequence_parallel=False)
    for block in model.layers:
        fsdp_optim.fully_shard(block, mesh=mesh["dp"])
    fsdp_optim.fully_shard(model, mesh=mesh["dp"])
    model(_tokens()).sum()  # every rank the same batch: the maxima are the one process's
    stats = qk_clip_(model, tau=TAU)
    weights = {n: p.full_tensor() for n, p in model.named_parameters() if ".wq." in n or ".wk." in n}
    return stats, weights


def test_qk_clip_with_heads_split_over_tp_ranks_equals_one_process():
    ref = _model()
    ref(_tokens()).sum()
    want = qk_clip_(ref, tau=TAU)
    assert want.num_clipped > 0
    for stats, weights in run_distributed(lambda: _clip_tp(2, 2), world_size=4):
        assert stats.num_clipped == want.num_clipped
        torch.testing.assert_close(torch.tensor(stats.layer_max), torch.tensor(want.layer_max), rtol=1e-5, atol=0)
        for n, p in ref.named_parameters():
            if ".wq." in n or ".wk." in n:
                torch.testing.assert_close(weights[n], p.detach(), rtol=1e-5, atol=1e-7)
