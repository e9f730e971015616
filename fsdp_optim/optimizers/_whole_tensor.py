"""Any per-tensor optimizer on whole-tensor shards: each rank steps the tensors it owns whole.

[Note: whole-tensor optimizer]
A per-tensor optimizer (Adafactor, NAdam, torch.optim.Muon, Lion, ...) computes each parameter's
update from that parameter's own gradient and state only. With ``WholeTensorOptimizer.blocks``
(``whole()`` for every tensor) the planner keeps every parameter on one rank, so after the
reduce-scatter each rank holds whole gradients for the parameters it owns and nothing for the
rest. Each rank then runs ``optimizer_class`` on *global-shape views* of its owned parameters and
gradients (views of the flat shards: no copy), exactly as the unsharded optimizer would step them,
and skips the others: the result equals ``optimizer_class`` unsharded, bitwise, with no collective.
(The signature follows ``torch.distributed.optim.ZeroRedundancyOptimizer``; unlike ZeRO-1 there is
no broadcast after the step: FSDP's next all-gather moves the parameters anyway.)

``param_groups`` are this optimizer's (every parameter, owned or not), so LR schedulers and
``add_param_group`` work; before each step and each ``state_dict()`` their hyperparameters are
copied into the inner optimizer's groups, and ``load_state_dict()`` copies the loaded ones back
(so a round trip restores ``lr`` and the rest, as with ``optimizer_class`` itself). After each step
they are copied back too: some optimizers keep state in their groups (pytorch_optimizer's SOAP
counts ``group["step"]``), and a stale outer copy pushed before the next step or ``state_dict()``
would rewind it. The round trip of state is torch's own (``Optimizer.state_dict`` /
``load_state_dict`` on the inner optimizer), so any structure it keeps (nested lists, tuples,
dicts, empty lists, ``None``, ints, tensors of any shape) comes back as the unsharded optimizer's
would. Plain
(unsharded) parameters are owned by every rank. A parameter whose layout cuts it across ranks
(a plan that had to split it, or other block rules) is rejected with the parameter's name. State
lives in the inner optimizer (lazily, as torch's optimizers create it); ``self.state[p]`` mirrors it
for owned parameters after each step. ``state_dict()`` / ``load_state_dict()`` are the inner
optimizer's per rank (same world size and plan).

[Note: whole-tensor optimizer under TP]
A tensor that tensor parallelism splits (``LocalShard.tp``: a TP-local piece of a ``whole()`` block)
is stepped at one *home* TP rank (round-robin over the TP ranks in parameter order, the same on
every TP rank since the plan is): each step one ``all_to_all_single`` over the TP group sends every
rank's slice of the values and of the gradient to the home, which concatenates them along the TP
dim into a global-shape copy and steps it with ``optimizer_class`` as the unsharded optimizer would;
a second sends each rank its slice of the new values. The state of such a tensor lives on its home
only (it is the owner: checkpoints save it whole there, [Note: whole-tensor checkpoints]). The
copy's values are re-read every step, so anything that changed the parameter since (a load, a clip)
is seen. A TP-local tensor that is itself cut across data-parallel ranks is refused.

[Note: whole-tensor checkpoints]
``save_checkpoint`` / ``load_checkpoint`` reshard this optimizer across world sizes and plans.
Every state tensor of a parameter is saved whole by the rank that owns the parameter, under
``optim.state.<param name>.<key>`` (0-dim step counters included: no replicated blob of scalars,
whose values only the owner knows). The keys, shapes and dtypes are agreed at save (one
``all_gather_object``) and stored in the manifest with the inner optimizer's class. A load reads, on
the parameter's new owner, each saved tensor at the shape and dtype DCP's metadata gives (0-dim
counters on the CPU, as torch keeps them; the rest on the parameter's device) and installs it into
the inner optimizer; a rank that owns nothing reads nothing. Loading into another inner class, or a
checkpoint missing a parameter's state under ``strict``, raises on every rank before anything is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..sharding.contract import (
    BlockSpec,
    LocalShard,
    RaggedDTensor,
    elements,
    local_shard,
    local_tensor,
    whole,
)
from ._base import profiled_step, record_layouts, tp_cut_error

__all__ = ["WholeTensorOptimizer", "whole_tensor_rule"]


def whole_tensor_rule(fqn: str, param: Tensor, module: nn.Module | None) -> BlockSpec:
    """Every tensor is one block (a 0-dim tensor is a single element anyway)."""
    return whole() if param.ndim >= 1 else elements(1)


class WholeTensorOptimizer(torch.optim.Optimizer):
    """Run ``optimizer_class`` on the parameters each rank owns whole; see [Note: whole-tensor optimizer].

    Args:
        params: parameters (sharded with ``blocks=WholeTensorOptimizer.blocks``, or plain) or param groups.
        optimizer_class: any ``torch.optim.Optimizer`` subclass whose update of a parameter depends
            only on that parameter (not a global norm across parameters).
        **defaults: keyword arguments for ``optimizer_class`` (e.g. ``lr``).
    """

    blocks = staticmethod(whole_tensor_rule)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        **defaults: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(
                f"WholeTensorOptimizer: optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
            )
        self.optimizer_class = optimizer_class
        self._views: dict[Tensor, Tensor] = {}  # owned sharded parameter -> its global-shape view
        self._tp: dict[Tensor, tuple[LocalShard, int]] = {}  # TP-split parameter -> (layout, home TP coordinate)
        self._tp_count = 0
        groups = list(params)
        if not groups:
            raise ValueError("WholeTensorOptimizer: optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": list(g["params"]) if not torch.is_tensor(g["params"]) else [g["params"]]} for g in groups]
        # The inner optimizer holds this rank's owned views, one inner group per group (maybe empty).
        self.optim = optimizer_class(
            [{**g, "params": self._owned_views(g["params"])} for g in groups], **defaults
        )
        super().__init__(groups, dict(self.optim.defaults))
        for g, inner in zip(self.param_groups, self.optim.param_groups):
            for k, v in inner.items():  # hyperparameters the inner optimizer filled in
                if k != "params":
                    g.setdefault(k, v)
        self._ready = True
        record_layouts(self)

    # ---- ownership -----------------------------------------------------------------------
    def _owned_views(self, params: list[Tensor]) -> list[Tensor]:
        views = []
        for p in params:
            view = self._view(p)
            if view is not None:
                views.append(view)
        return views

    def _view(self, p: Tensor) -> Tensor | None:
        """The global-shape view of ``p`` if this rank owns it whole, ``None`` if it holds none of it."""
        if p in self._views:
            return self._views[p]
        if not isinstance(p, RaggedDTensor):
            self._views[p] = p  # a plain parameter: every rank holds (and steps) it
            return p
        info = local_shard(p)
        if info.tp is not None:
            return self._tp_view(p, info)
        if info.local_numel == 0 and info.numel > 0:
            return None
        _check_whole(p, info)
        view = nn.Parameter(local_tensor(p).detach().view(info.shape), requires_grad=p.requires_grad)
        self._views[p] = view
        return view

    def _tp_view(self, p: Tensor, info: LocalShard) -> Tensor | None:
        """A tensor TP splits ([Note: whole-tensor optimizer under TP]): its home TP rank steps a
        global-shape copy assembled each step; the other TP ranks own nothing of it."""
        if p in self._tp:
            return self._views.get(p)
        if info.local_numel == 0 and info.numel > 0:
            return None  # held by another data-parallel coordinate (its TP group steps it)
        if info.local_numel != info.numel:
            raise tp_cut_error(info, optimizer="WholeTensorOptimizer", supported="its TP-local tensor is itself cut "
                               "across data-parallel ranks")  # fmt: skip
        home = self._tp_count % info.tp.size  # round-robin over the TP ranks, in parameter order (the same everywhere)
        self._tp_count += 1
        self._tp[p] = (info, home)
        if home != info.tp.rank:
            return None
        view = nn.Parameter(torch.empty(info.tp.global_shape, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
        self._views[p] = view
        return view

    def _tp_exchange(self, *, out: bool) -> None:
        """``out``: every TP rank sends its slice of each TP-split tensor (values, then gradient) to the
        tensor's home, which assembles them into its copy; else the home sends each rank its slice of the
        stepped copy. One ``all_to_all_single`` per TP group and dtype each way."""
        by_group: dict[tuple, list] = {}
        for p, (info, home) in self._tp.items():
            by_group.setdefault((id(info.tp.group), p.dtype), []).append((p, info, home))
        for items in by_group.values():
            tp = items[0][1].tp
            g, size, me = tp.group_ranks(), tp.size, tp.rank
            k = 2 if out else 1
            dtype = items[0][0].dtype
            send_sizes, recv_sizes, send, recv_at = [0] * size, [0] * size, [], []
            for t in sorted(range(size), key=lambda t: g[t]):  # buffers in group-rank order
                for p, info, home in items:
                    n = info.local_numel
                    if out and home == t:
                        grad = p.grad
                        send += [local_tensor(p).reshape(-1), torch.zeros(n, dtype=dtype, device=p.device) if grad is None
                                 else local_tensor(grad).reshape(-1).to(dtype)]  # fmt: skip
                        send_sizes[g[t]] += k * n
                    if not out and home == me:
                        chunk = self._views[p].detach().chunk(size, dim=info.tp.dim)[t]
                        send.append(chunk.reshape(-1))
                        send_sizes[g[t]] += n
                    if (out and home == me) or (not out and home == t):
                        recv_at.append((t, p, info, home))
                        recv_sizes[g[t]] += k * n
            device = items[0][0].device
            buf = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
            payload = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
            dist.all_to_all_single(buf, payload, recv_sizes, send_sizes, group=tp.group)
            pos, parts = 0, {}
            for t, p, info, home in recv_at:
                n = info.local_numel
                parts.setdefault(p, {})[t] = buf[pos : pos + k * n]
                pos += k * n
            for p, info, home in items:
                if out and home == me:
                    n, shape, dim = info.local_numel, tuple(info.shape), info.tp.dim
                    view = self._views[p]
                    pieces = [parts[p][t] for t in range(size)]
                    view.data.copy_(torch.cat([x[:n].view(shape) for x in pieces], dim=dim))
                    view.grad = None if p.grad is None else torch.cat([x[n:].view(shape) for x in pieces], dim=dim)
                elif not out:
                    local_tensor(p).reshape(-1).copy_(parts[p][home])

    def owns(self, p: Tensor) -> bool:
        """Whether this rank steps ``p`` (holds it whole)."""
        return self._view(p) is not None

    # ---- torch.optim.Optimizer API ---------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            g = self.param_groups[-1]
            self.optim.add_param_group({**g, "params": self._owned_views(g["params"])})

    @profiled_step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_hyperparameters()
        if self._tp:
            self._tp_exchange(out=True)
        for g in self.param_groups:
            for p in g["params"]:
                view = self._view(p)
                if view is None or view is p or p in self._tp:
                    continue
                local = local_tensor(p)
                if view.data_ptr() != local.data_ptr() or view.device != local.device or view.dtype != local.dtype:
                    view.data = local.detach().view(view.shape)  # the runtime moved the shard: follow it
                view.grad = None if p.grad is None else local_tensor(p.grad).view(view.shape)
        try:
            self.optim.step()
        finally:
            for p, view in self._views.items():
                if view is not p:
                    view.grad = None  # no extra reference to the gradient segment
        if self._tp:
            self._tp_exchange(out=False)
        self._pull_hyperparameters()  # group-level state the inner step advanced (see the Note)
        self._mirror_state()
        return loss

    def _push_hyperparameters(self) -> None:
        """Copy this optimizer's hyperparameters (set by the user or a scheduler) into the inner groups."""
        for g, inner in zip(self.param_groups, self.optim.param_groups):
            for k, v in g.items():
                if k != "params":
                    inner[k] = v

    def _pull_hyperparameters(self) -> None:
        """Make this optimizer's groups hold exactly the inner groups' hyperparameters (after a load)."""
        for g, inner in zip(self.param_groups, self.optim.param_groups):
            params = g["params"]
            g.clear()
            g["params"] = params
            g.update({k: v for k, v in inner.items() if k != "params"})

    def _mirror_state(self) -> None:
        for p, view in self._views.items():
            if view in self.optim.state:
                self.state[p] = self.optim.state[view]

    # ---- checkpoints (see [Note: whole-tensor checkpoints]) ----------------------------------
    def owned_state(self) -> dict[Tensor, dict[str, Tensor]]:
        """The state of every parameter this rank steps, as the inner optimizer keeps it (tensors of
        any shape: Adafactor's row and column factors, 0-dim step counters)."""
        out = {}
        for p, view in self._views.items():
            st = self.optim.state.get(view)
            if st:
                for key, v in st.items():
                    if not torch.is_tensor(v):
                        raise ValueError(
                            f"WholeTensorOptimizer({self.optimizer_class.__name__}): state {key!r} is a "
                            f"{type(v).__name__}, not a tensor; checkpoints of this optimizer need tensor state"
                        )
                out[p] = dict(st)
        return out

    def install_state(self, p: Tensor, state: dict[str, Tensor]) -> None:
        """Give the inner optimizer the loaded state of ``p`` (a parameter this rank owns)."""
        view = self._view(p)
        if view is None:
            raise AssertionError("install_state of a parameter this rank does not own")
        self.optim.state[view] = dict(state)
        self._mirror_state()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict on this rank (this rank's owned parameters only), with
        this optimizer's current hyperparameters (``lr`` as a scheduler left it)."""
        self._push_hyperparameters()
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an inner state dict (from ``state_dict()``): state and hyperparameters, as torch's optimizers do."""
        self.optim.load_state_dict(state_dict)
        self._pull_hyperparameters()
        self._mirror_state()

    def __repr__(self) -> str:
        return f"WholeTensorOptimizer({self.optimizer_class.__name__}, {len(self._views)} local parameters)"


def _check_whole(p: Tensor, info: LocalShard) -> None:
    if info.local_numel != info.numel:
        raise ValueError(
            f"WholeTensorOptimizer: parameter {info.fqn or '<unnamed>'} (shape {info.shape}, world size "
            f"{info.world_size}) is cut across ranks ({info.spec} blocks, {info.local_numel} of {info.numel} "
            f"elements on rank {info.rank}); shard the model with fully_shard(..., "
            "blocks=WholeTensorOptimizer.blocks) and a layout that keeps whole tensors "
            "(PlanConfig(layout='ragged', balance='whole'), or a padding_cap that never splits)"
        )
    if local_tensor(p).numel() != info.numel:
        raise ValueError(
            f"WholeTensorOptimizer: parameter {info.fqn or '<unnamed>'} holds {local_tensor(p).numel()} elements but its "
            f"layout gives rank {info.rank} {info.local_numel}"
        )

