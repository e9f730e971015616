"""Muon on tensor-parallel matrices ([Note: Muon under tensor parallelism]).

Reference: ``torch.optim.Muon`` on the unsharded matrices, fed the sharded run's own reduced
gradients (gathered), so Newton–Schulz sees bitwise the same input: asserted bitwise (the rule of
tests/optimizers/test_muon.py), fp32 and bf16 parameters, at (dp, tp) = (2, 2) and (1, 4).
Also: one Newton–Schulz per matrix in the whole job (summed over the ranks), homes spread over the
TP ranks, and the step's only data collectives are two all-to-alls inside the TP group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import Muon
from tests._models import TPConfig, TPTransformer, feed_gradients, tp_backward, tp_sharded

LR, WD, STEPS = 0.02, 0.1, 3
HIDDEN = ("attention.w", "feed_forward.w")


def _is_hidden(name: str) -> bool:
    return any(h in name for h in HIDDEN)


def _run(dp: int, tp: int, dtype: torch.dtype):
    rule = Muon.rule(embedding_and_head=["tok_embeddings", "output"])
    mesh, model, ref = tp_sharded(dp, tp, rule, make=lambda: TPTransformer().to(dtype), plan=True)
    opt = Muon(model.parameters(), lr=LR, weight_decay=WD)
    hidden_ref = [p for n, p in ref.named_parameters() if _is_hidden(n)]
    ropt = torch.optim.Muon(hidden_ref, lr=LR, weight_decay=WD)
    orthogonalized = []
    run = opt._run

    def counting(x, key):
        orthogonalized.append(tuple(x.shape))
        return run(x, key)

    opt._run = counting
    a2a = []
    real = dist.all_to_all_single

    def recording(out, inp, *args, group=None, **kw):
        a2a.append((tuple(dist.get_process_group_ranks(group)), out.numel() * out.element_size()))
        return real(out, inp, *args, group=group, **kw)

    for step in range(STEPS):
        tp_backward(model, mesh, step)
        feed_gradients(model, ref, keep=_is_hidden)
        dist.all_to_all_single = recording
        try:
            opt.step()
        finally:
            dist.all_to_all_single = real
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    diffs = {n: (a.full_tensor().float() - b.float()).abs().max().item()
             for (n, a), b in zip(((n, a) for n, a in model.named_parameters() if _is_hidden(n)), hidden_ref)}  # fmt: skip
    tp_group = tuple(mesh["tp"].mesh.tolist())
    return diffs, orthogonalized, a2a, tp_group


@pytest.mark.parametrize(
    "dp,tp,dtype",
    [(2, 2, torch.float32), (1, 4, torch.float32), (3, 1, torch.float32), (2, 2, torch.bfloat16)],
    ids=["2x2", "1x4", "3x1", "2x2-bf16"],
)
def test_muon_on_tp_sharded_matrices_equals_torch_muon_bitwise_with_one_ns_per_matrix(dp, tp, dtype):
    out = run_distributed(lambda: _run(dp, tp, dtype), world_size=dp * tp)
    n_matrices = 7 * TPConfig().num_layers
    per_rank = []
    for diffs, orthogonalized, a2a, tp_group in out:
        assert len(diffs) == n_matrices
        assert all(d == 0.0 for d in diffs.values()), diffs
        per_rank.append(sum(s[0] for s in orthogonalized))
        # the step's exchanges: two all-to-alls per step, inside this rank's TP group only (none without TP)
        assert len(a2a) == (2 * STEPS if tp > 1 else 0), a2a
        assert all(ranks == tp_group for ranks, _ in a2a), (a2a, tp_group)
    # one Newton-Schulz per matrix and step in the whole job, spread over the TP ranks
    assert sum(per_rank) == n_matrices * STEPS, per_rank
    for d in range(dp):
        group = per_rank[d * tp : (d + 1) * tp]
        assert max(group) - min(group) <= 2 * STEPS, group


def _per_head_blocks():
    # wq's per-head sub-matrices (head dim 8): ColwiseParallel keeps each head on one TP rank, so they
    # are orthogonalized where they are; the other six matrices per block are whole() and travel
    rule = Muon.rule(embedding_and_head=["tok_embeddings", "output"], head_dims={"attention.wq.weight": 8})
    _, model, _ = tp_sharded(1, 2, rule)
    opt = Muon(model.parameters(), lr=LR)
    wq = model.layers[0].attention.wq.weight
    return wq.ragged.tp_blocks is None, len(opt._tp_exchanges[0].sends)


def test_per_head_blocks_that_tp_keeps_whole_need_no_exchange():
    out = run_distributed(_per_head_blocks, world_size=2)
    for kept_whole, n_sends in out:
        assert kept_whole
        assert n_sends == 6 * TPConfig().num_layers  # wq's heads are local; the 6 other matrices travel
