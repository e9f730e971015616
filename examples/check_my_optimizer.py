"""Check your own optimizer sharded against unsharded with fsdp_optim.testing (docs/testing.md).

Runs on CPU in about ten seconds, from any directory (forks its own gloo ranks; no torchrun):

    python examples/check_my_optimizer.py

The optimizer below is a small research preconditioner: momentum, then each matrix's update scaled to
unit RMS by its own Frobenius norm (a per-matrix global quantity, as Muon's Newton-Schulz is), AdamW-free
plain momentum SGD for vectors. Its math needs each matrix whole on one rank, which its block rule
says (``whole()`` for matrices); fully_shard then lays the model out so every rank holds whole
matrices and the step needs no communication. The check proves it: bitwise equal to the unsharded
run at W = 1..4 and under HSDP, no collective in ``step()``. Then the same optimizer with the wrong
block rule (elements: matrices cut anywhere) shows what a bug looks like.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

from fsdp_optim.sharding import elements, whole
from fsdp_optim.sharding.contract import local_tensor
from fsdp_optim.testing import check_sharded_equals_unsharded


class ScaledMomentum(torch.optim.Optimizer):
    """``m = beta * m + g``; a matrix moves by ``-lr * m / rms(m)``, anything else by ``-lr * m``."""

    def __init__(self, params, *, lr: float = 0.02, beta: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, beta=beta))

    @staticmethod
    def blocks(fqn: str, param: torch.Tensor, module: nn.Module | None):
        """The block rule for fully_shard: what must stay on one rank."""
        return whole() if param.ndim == 2 else elements(1)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                # This rank's piece (the whole tensor when unsharded); p.ndim is the global one.
                x, g = local_tensor(p), local_tensor(p.grad)
                m = self.state[p].setdefault("momentum", torch.zeros_like(x))
                m.mul_(group["beta"]).add_(g)
                scale = 1.0
                if p.ndim == 2 and m.numel():  # a whole matrix here (or an empty piece)
                    scale = 1.0 / m.square().mean().sqrt().clamp_min(1e-12).item()
                x.add_(m, alpha=-group["lr"] * scale)


class Model(nn.Module):
    """Dims that divide nothing (vocab 101, hidden 24, MLP 37), so every layout at W = 2..4 is uneven."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(101, 24)
        self.up = nn.Linear(24, 37)
        self.down = nn.Linear(37, 24, bias=False)
        self.norm = nn.RMSNorm(24)
        self.head = nn.Linear(24, 101, bias=False)


def main() -> int:
    torch.set_num_threads(1)
    # Whole matrices of this small model cannot balance 4 ranks within the planner's cap; it says so
    # (a UserWarning per rank), which does not matter for an equality check.
    warnings.filterwarnings("ignore", message=r"PlanConfig\(balance=")
    report = check_sharded_equals_unsharded(
        make_model=Model,
        make_optimizer=lambda model: ScaledMomentum(model.parameters(), lr=0.02),
        blocks=ScaledMomentum.blocks,
        world_sizes=(1, 2, 3, 4),
        hsdp=[(2, 2)],
        steps=3,
        tolerance="bitwise",
    )
    print(report)

    # The same optimizer sharded at element granularity: matrices are cut across ranks, and each rank
    # scales by its own piece's RMS. The check must catch it.
    try:
        check_sharded_equals_unsharded(
            make_model=Model,
            make_optimizer=lambda model: ScaledMomentum(model.parameters(), lr=0.02),
            blocks=None,
            world_sizes=(2, 3),
            hsdp=False,
            tolerance="measured",
        )
    except AssertionError as e:
        print("planted bug caught:\n" + str(e))
        return 0
    print("the wrong block rule went unnoticed", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
