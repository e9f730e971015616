"""8-bit / 4-bit AdamW under tensor parallelism: what the block rule does at a TP cut.

Quantization blocks (256 elements for 8-bit, 128 for 4-bit, as torchao) are formed on each TP rank's
TP-local tensor, flattened: for ``ColwiseParallel`` (``Shard(0)``) a TP-local weight is whole rows, so
its blocks are the global tensor's blocks (when the TP-local size is a multiple of the block); for
``RowwiseParallel`` (``Shard(1)``) they are blocks of the column slice, as torchao's optimizer forms
them on the local tensor of a TP shard. Reference: ``torchao.optim.AdamW8bit`` / ``AdamW4bit`` stepping
each TP rank's TP-local tensor as a plain tensor with the same (gathered) gradient: bitwise.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_optim
from fsdp_optim._testing import run_distributed
from fsdp_optim.optimizers import AdamW4bit, AdamW8bit
from fsdp_optim.sharding.contract import local_shard
from tests.optimizers.test_adamw8bit import dynamo_disabled

warnings.filterwarnings("ignore", message=".*KernelPreference.*")
torchao_optim = pytest.importorskip("torchao.optim")


def _run(kind: str, dp: int, tp: int):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256, bias=False), nn.Tanh(), nn.Linear(256, 128, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    ours_cls, theirs_cls = {"8bit": (AdamW8bit, torchao_optim.AdamW8bit), "4bit": (AdamW4bit, torchao_optim.AdamW4bit)}[kind]
    fsdp_optim.fully_shard(model, mesh=mesh["dp"], blocks=ours_cls.blocks)
    opt = ours_cls(model.parameters(), lr=1e-2, compile=False)
    t = mesh.get_coordinate()[1]
    # torchao on this TP rank's cut: the TP-local tensors as plain parameters
    ref = [nn.Parameter(p.full_tensor().chunk(tp, dim=d)[t].contiguous()) for p, d in zip(model.parameters(), (0, 1))]
    ref_opt = theirs_cls(ref, lr=1e-2)
    r = mesh.get_coordinate()[0]
    with dynamo_disabled():
        for s in range(3):
            x = torch.randn(4 * dp, 128, generator=torch.Generator().manual_seed(s))[4 * r : 4 * r + 4]
            model(x).square().sum().backward()
            for q, p, d in zip(ref, model.parameters(), (0, 1)):
                q.grad = p.grad.full_tensor().chunk(tp, dim=d)[t].contiguous()
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
    same = [torch.equal(p.full_tensor().chunk(tp, dim=d)[t], q.detach()) for p, q, d in zip(model.parameters(), ref, (0, 1))]
    quantized = [any(k.endswith("codes") for k in opt.state[p]) for p in model.parameters()]
    return same, quantized, [local_shard(p).shape for p in model.parameters()]


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
@pytest.mark.parametrize("dp,tp", [(2, 2), (1, 4)])
def test_quantized_adamw_on_a_tp_cut_equals_torchao_on_the_tp_local_tensor(kind, dp, tp):
    for same, quantized, shapes in run_distributed(lambda: _run(kind, dp, tp), world_size=dp * tp, timeout=300):
        assert all(same), same
        assert shapes == [(256 // tp, 128), (128, 256 // tp)]
        assert any(quantized)
