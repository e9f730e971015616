"""Every optimizer's ``step()`` is named in a profiler trace (``fsdp_optim::optimizer_step(<class>)``) and
never synchronizes with the device: the only scalars it reads on the host (``.item()``) are 0-dim state
scalars such as the ``step`` counters, which live on the CPU in every job (as in torch's non-capturable optimizers), never a value
computed from parameters or gradients, which on a GPU would stall the CPU until the kernels finish."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_optim.optimizers import SOAP, AdamW, AdamW4bit, AdamW8bit, Muon, Shampoo, WholeTensorOptimizer

OPTIMIZERS = {
    "AdamW": lambda ps: AdamW(ps, lr=1e-3),
    "AdamW8bit": lambda ps: AdamW8bit(ps, lr=1e-3),
    "AdamW4bit": lambda ps: AdamW4bit(ps, lr=1e-3),
    "Muon": lambda ps: Muon(ps, lr=1e-3),
    "Shampoo": lambda ps: Shampoo(ps, lr=1e-3, precondition_frequency=1, start_preconditioning_step=1),
    "SOAP": lambda ps: SOAP(ps, lr=1e-3, precondition_frequency=1),
    # (torch.optim.Adafactor reads parameter norms with .item() by its own design; NAdam does not.)
    "WholeTensorOptimizer": lambda ps: WholeTensorOptimizer([p for _, p in ps], torch.optim.NAdam, lr=1e-3),
}
COMPILED = ("AdamW8bit", "AdamW4bit")  # one compiled kernel per step: a dispatch mode cannot run inside


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.read: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.read.append(args[0])
        return func(*args, **(kwargs or {}))


def _step_counters(opt) -> set[int]:
    """The 0-dim state scalars (``step``; NAdam's ``mu_product``): kept on the CPU by design, as torch does."""
    states = [opt.state] + ([opt.optim.state] if hasattr(opt, "optim") else [])  # WholeTensorOptimizer: its inner one
    return {
        id(v) for state in states for st in state.values() if isinstance(st, dict)
        for v in st.values() if torch.is_tensor(v) and v.dim() == 0
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_is_named_and_reads_no_device_value_on_the_host(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(33, 96), nn.Linear(96, 160), nn.ReLU(), nn.Linear(160, 96))
    opt = OPTIMIZERS[name](list(model.named_parameters()))

    def backward():
        model(torch.arange(12).reshape(3, 4)).square().mean().backward()

    for _ in range(2):  # the first step builds state (host logic allowed there)
        backward()
        opt.step()
        opt.zero_grad()
    backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = [e.name for e in prof.events()]
    assert names.count(f"fsdp_optim::optimizer_step({type(opt).__name__})") == 1
    if name in COMPILED:
        assert "aten::_local_scalar_dense" not in names
        return
    opt.zero_grad()
    backward()
    with _HostReads() as reads:
        opt.step()
    counters = _step_counters(opt)
    bad = [(tuple(t.shape), t.device.type) for t in reads.read if id(t) not in counters or t.device.type != "cpu"]
    assert not bad, f"{name}.step() reads values other than its CPU step counters on the host: {bad}"
