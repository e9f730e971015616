"""NorMuon: Muon followed by a per-neuron (row) second-moment normalization, on block-aligned shards.

[Note: NorMuon]
NorMuon (Z. Li, L. Liu, C. Liang, W. Chen, T. Zhao, arXiv:2510.05491, Algorithm 1; the authors'
``normuon.py``, github.com/zichongli5/NorMuon) takes Muon's orthogonalized update ``O`` of an
``[m, n]`` matrix and, per row (output neuron) ``i``, keeps ``v_i <- beta2 v_i + (1 - beta2)
mean_j O_ij^2``, divides row ``i`` of ``O`` by ``sqrt(v_i) + eps`` and rescales the result to
``O``'s Frobenius norm (the authors' code: the update's size stays Muon's; rows whose updates have
been large shrink, small ones grow). The step is then Muon's: decoupled weight decay and
``param -= adjusted_lr * O_normalized`` with torch.optim.Muon's shape-based ``adjust_lr_fn``
(the authors' code uses ``"original"``'s ``sqrt(max(1, m / n))``).

Everything but ``v`` is Muon's, so this is a ``Muon`` that normalizes each orthogonalized stack as it
comes out of Newton–Schulz (``_orthogonalize``), before Muon adds it. ``v`` has one entry per row of
each matrix: per-head / fused-QKV sub-matrices and experts have their own rows, which are rows of the
parameter, so the state's global flat form is one entry per row of the parameter in its global order
(``numel / cols`` entries) and this rank's part is the rows of its range ([Note: checkpoint-shaped
optimizer state]). The row statistic needs only the row, but the norm rescale needs the whole matrix,
which a ragged plan puts on one rank: the step stays free of collectives. Matrices cut across ranks
(a plan that records ``LocalShard.split``: ``PlanConfig(balance="auto")`` cuts matrices where whole ones
cannot balance, at large W) are refused: their rows' ``v`` would live on other ranks than the owner
that normalizes them; ``PlanConfig(balance="whole")`` never cuts one.

[Note: NorMuon under tensor parallelism]
A TP-sharded matrix (``ColwiseParallel``: TP dim 0, ``RowwiseParallel``: TP dim 1) is orthogonalized
once, at its home TP rank, as Muon's ([Note: Muon under tensor parallelism]); NorMuon normalizes it
there, on the assembled global ``[m, n]`` result, with the global ``v``. The invariant: every TP rank
holds ``v`` of its TP-local rows, bitwise the entries unsharded NorMuon holds for those rows --
``ColwiseParallel``: its ``m / T`` rows; ``RowwiseParallel``: every row spans all T ranks, so each
keeps all ``m`` entries (a copy, equal on every TP rank; tiny next to the matrix). It travels in the
same two all-to-alls as the matrix: out, a ``ColwiseParallel`` slice's ``v`` rows follow its bf16
slice (the home concatenates them in TP order; a ``RowwiseParallel`` home uses its own copy, so
nothing extra travels); back, each rank's rows of the updated ``v`` follow its slice of the
normalized update. ``v`` (the parameter's dtype) and the normalized update (fp32, what unsharded
NorMuon adds) travel bit for bit, reinterpreted as 2-byte slots of the bf16 buffers, not rounded to
bf16: the home's ``normalize_rows`` sees the same ``[1, m, n]`` / ``[1, m, 1]`` inputs unsharded
NorMuon sees, and each rank adds the same fp32 values (element-wise ``add_``: a slice gets the whole
matrix's bits); low-precision parameters get the new values from the home's whole-matrix ``add_``.
So NorMuon under TP is bitwise unsharded NorMuon given bitwise-equal gradients, with Muon's two
collectives per step. ``state_shards`` names each TP rank's ``v`` rows (``StateShard.rows``): checkpoints
store the vector of the matrix's global rows (``Shard(0)`` over TP under ``ColwiseParallel``, a replica
on every TP rank under ``RowwiseParallel``), as without TP, so it loads at any TP size and without TP.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from ._base import StateShard, checked_param_info, state_range
from ._muon import Muon
from ._muon_tp import TPHomed, tp_assembles

__all__ = ["NorMuon", "normalize_rows"]

_KEYS = ("beta2", "norm_eps")


def normalize_rows(o: Tensor, v: Tensor, *, beta2: float, eps: float) -> Tensor:
    """NorMuon's normalization of orthogonalized updates ``o`` (``[..., m, n]``, any float dtype) with
    their row second moments ``v`` (``[..., m, 1]``, updated in place): fp32 ``o / (sqrt(v) + eps)``
    scaled back to ``o``'s Frobenius norm (``eps`` also guards that division)."""
    o = o.float()
    norm = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
    v.lerp_(o.square().mean(dim=-1, keepdim=True).to(v.dtype), 1 - beta2)
    o.mul_(1 / (v.sqrt() + eps))
    return o.mul_(norm / (torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True) + eps))


class NorMuon(Muon):
    """NorMuon (arXiv:2510.05491) for hidden matrices, AdamW for the rest, on sharded or plain parameters.

    ``Muon`` (every argument, the parameter groups, the AdamW fallback, ``orthogonalize`` and
    ``coefficients``) plus, per group:

    Args:
        beta2: decay of the per-row second moment of the orthogonalized update (default 0.95, the
            authors').
        norm_eps: added to ``sqrt(v)`` and to the rescale's norm (default 1e-10, the authors').

    State per Muon parameter: ``momentum_buffer`` (as Muon) and ``second_momentum_buffer``, one entry per
    matrix row, in the parameter's dtype (as the authors' ``zeros_like(p[..., 0:1])``). See [Note: NorMuon].
    Matrices must lie whole on one rank (a ragged plan with ``Muon.blocks``); split ones are a ``ValueError``.
    TP-sharded 2-D matrices are assembled over TP as Muon's ([Note: NorMuon under tensor parallelism]).
    """

    _tp_result_dtype = torch.float32  # the normalized update, sent back unrounded

    def __init__(self, params: Iterable[Any], *, beta2: float = 0.95, norm_eps: float = 1e-10, **kwargs: Any) -> None:
        _check(beta2, norm_eps)
        self._normuon_defaults = dict(beta2=beta2, norm_eps=norm_eps)
        self._param_of: dict[int, Tensor] = {}
        super().__init__(params, **kwargs)
        self.defaults.update(self._normuon_defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Muon's split into a Muon and an AdamW part; ``beta2`` / ``norm_eps`` go to the Muon part."""
        own = {k: param_group[k] for k in _KEYS if k in param_group}
        n = len(self.param_groups)
        super().add_param_group({k: v for k, v in param_group.items() if k not in _KEYS})
        for group in self.param_groups[n:]:
            if group["use_muon"]:
                for k, default in self._normuon_defaults.items():
                    group[k] = own.get(k, default)
                _check(group["beta2"], group["norm_eps"])
            elif own and param_group.get("use_muon") is False:
                warnings.warn(f"NorMuon: {sorted(own)} ignored in a use_muon=False group (they configure the "
                              "NorMuon part)", stacklevel=2)  # fmt: skip

    def _init_state(self, p: Tensor, use_muon: bool) -> None:
        super()._init_state(p, use_muon)
        if not use_muon:
            return
        plan = self._plans[p]
        info = plan.info
        if plan.split:
            raise ValueError(
                f"NorMuon: parameter {info.fqn or '<unnamed>'} (shape {info.shape}, world size {info.world_size}) "
                "has matrices cut across ranks; NorMuon needs every matrix whole on one rank: shard with "
                "fully_shard(..., blocks=Muon.blocks, plan_config=PlanConfig(balance='whole')), which never cuts one"
            )
        cols = info.shape[-1]
        if any(c != cols for _, _, c in info.spec.matrices(info.shape)) or info.start % cols or info.end % cols:
            raise AssertionError(f"NorMuon: {info.fqn}: matrices of {info.spec} are not rows of {info.shape}")
        rows = (info.end - info.start) // cols
        self.state[p].setdefault("second_momentum_buffer", torch.zeros(rows, dtype=p.dtype, device=p.device))

    def _info(self, p: Tensor, name: str | None) -> Any:
        return checked_param_info(
            p, self._rule, optimizer="NorMuon", blocks="Muon.blocks", name=name or "", whole_blocks=True,
            tp_assembles=tp_assembles,
        )

    def _tp_row_state(self, p: Tensor) -> Tensor | None:
        return self.state[p].get("second_momentum_buffer")

    def state_shards(self, p: Tensor) -> dict[str, StateShard]:
        """Muon's, plus ``second_momentum_buffer``: this rank's rows of the parameter's rows (under TP: of
        its TP-local rows, [Note: NorMuon under tensor parallelism])."""
        shards = super().state_shards(p)
        if self._plans[p].use_muon:
            info = self._plans[p].info
            cols = info.shape[-1]
            v = state_range(info, lambda b: b // cols)  # (bounds fall on rows)
            # a TP-cut matrix: a vector of its global rows in checkpoints, which loads at any TP size
            shards["second_momentum_buffer"] = v._replace(rows=True) if info.tp is not None else v
        return shards

    # ---- the step: Muon's, each orthogonalized stack normalized before it is added ---------------
    def _local_jobs(self, updates: dict, group_of: dict) -> list:
        self._param_of = {id(u): p for p, u in updates.items()}
        return super()._local_jobs(updates, group_of)

    def _orthogonalize(self, jobs: list) -> Iterator[list[tuple[int, Tensor]]]:
        for done in super()._orthogonalize(jobs):
            yield [(i, self._normalize(jobs[i], res)) for i, res in done]

    def _normalize(self, job: Any, res: Tensor) -> Tensor:
        if isinstance(job.owned, TPHomed):  # assembled at its TP home, with its whole v (sent back by Muon)
            v = job.row_state
            return normalize_rows(res, v.view(1, job.rows, 1), beta2=job.group["beta2"], eps=job.group["norm_eps"])
        if job.update is None:
            raise AssertionError("NorMuon: a split matrix reached the step (refused at construction)")
        p = self._param_of[id(job.update)]
        row = job.offset // job.cols
        v = self.state[p]["second_momentum_buffer"][row : row + job.count * job.rows]
        return normalize_rows(res, v.view(job.count, job.rows, 1), beta2=job.group["beta2"], eps=job.group["norm_eps"])


def _check(beta2: float, norm_eps: float) -> None:
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
    if not norm_eps >= 0.0:
        raise ValueError(f"norm_eps must be >= 0, got {norm_eps}")
