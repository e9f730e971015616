"""The recipe's two runtimes as one table: ``fsdp_optim`` (our fully_shard, optimizers and checkpoints)
or ``torch`` (PyTorch FSDP2, torch optimizers, DCP).

Everything that differs between them is a method or a capability of a ``Backend``: the recipe looks its
backend up once (``BACKENDS[pick_backend(cfg)]``) and never branches on the name. A capability the
torch backend lacks (block-wise FP8 all-gather, expert parallelism, QK-clip, Hugging Face import and
export, our optimizers, Muon's other orthogonalizations) is refused at start-up by
``_checks.resolve_config``, naming the key and the fix.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch
import torch.distributed as dist

from config import DEFAULT_LR, Config

__all__ = ["BACKENDS", "Backend", "FP8_TILES", "GRAM_DTYPES", "MUON_FAMILY", "OPTIMIZERS", "TORCH_PER_TENSOR",
           "build_optimizer", "describe_optimizer", "pick_backend", "shard_model"]

# optim.name -> the class in fsdp_optim.optimizers. "torch.<Name>": torch.optim.<Name> (a per-tensor
# optimizer) stepped whole on the rank that owns each tensor, by WholeTensorOptimizer.
TORCH_PER_TENSOR = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                    "Rprop", "SGD")
OPTIMIZERS = {
    "adamw": "AdamW", "adamw4bit": "AdamW4bit", "adamw8bit": "AdamW8bit", "muon": "Muon", "normuon": "NorMuon",
    "shampoo": "Shampoo", "soap": "SOAP", **{f"torch.{name}": "WholeTensorOptimizer" for name in TORCH_PER_TENSOR},
}  # fmt: skip
FP8_TILES = ("128x128", "1x128")  # train.fp8_all_gather / --fp8-allgather tiles (fsdp_optim.Float8AllGather)
MUON_FAMILY = ("muon", "normuon")  # the optim.name values that take optim.orthogonalize / coefficients / gram_dtype
GRAM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # optim.gram_dtype


class Backend:
    """What the training loop asks of a runtime. Capabilities (class attributes) say what it supports;
    the methods do the rest."""

    name: str
    optimizers: tuple[str, ...]  # the optim.name values it runs
    fp8_all_gather: bool  # train.fp8_all_gather / --fp8-allgather
    expert_parallel: bool  # parallel.ep > 1
    tensor_parallel: tuple[str, ...]  # the optim.name values it runs with parallel.tp > 1 (none: no TP)
    qk_clip: bool  # optim.qk_clip_tau > 0 (it scales the sharded weights)
    hf_io: bool  # --export-hf / --init-from-hf
    orthogonalize: tuple[str, ...]  # optim.orthogonalize values its Muon can run
    coefficients: tuple[str, ...]  # optim.coefficients names its Muon can run ("list": a list of (a, b, c) too)

    def shard(self, model: torch.nn.Module, opt_name: str, param_dtype: torch.dtype, fp8_all_gather: str = "off",
              max_preconditioner_dim: int = 1024, ep: int = 1, tp: int = 1) -> None:
        """Shard each decoder layer, then the root (embeddings, final norm, head), FSDP2-style. ``tp`` > 1:
        first the TP plan over the ``tp`` consecutive ranks of each group (``_tensor_parallel``), then the
        sharding over the data-parallel ranks (mesh["dp"])."""
        raise NotImplementedError

    def init_sharded(self, model: torch.nn.Module, device: torch.device) -> None:
        """Initialize a model built on the meta device and sharded (same values as an unsharded init)."""
        raise NotImplementedError

    def optimizer(self, groups: list[dict], cfg: Config, lr: float, adamw_lr: float) -> torch.optim.Optimizer:
        """``cfg.optim``'s optimizer over ``groups`` (``fsdp_optim.param_groups``)."""
        raise NotImplementedError

    def clip_grads(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip to global norm ``max_norm`` (0: no clipping, the norm is still measured); the norm."""
        return self._clip_grad_norm(model, max_norm if max_norm > 0 else math.inf)

    def _clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        raise NotImplementedError

    def max_logit(self, model: torch.nn.Module, layers: list[torch.nn.Module], tau: float) -> float:
        """After ``optimizer.step()``: the step's largest attention logit over all ranks (before clipping),
        QK-clip at ``tau`` applied (0: measure only); ``layers``: the recipe's attention modules."""
        raise NotImplementedError

    def save(self, path: Path, model, optimizer, scheduler, extra: dict) -> None:
        """Write the checkpoint (every rank calls it)."""
        raise NotImplementedError

    def load(self, path: Path, model, optimizer, scheduler) -> dict:
        """Load the checkpoint into the model, optimizer and scheduler; its ``extra``."""
        raise NotImplementedError


class FsdpOptimBackend(Backend):
    name = "fsdp_optim"
    optimizers = tuple(OPTIMIZERS)
    fp8_all_gather = expert_parallel = qk_clip = hf_io = True
    # Every optimizer: Muon / NorMuon assemble each TP-sharded matrix inside its TP group (fsdp_optim's
    # [Note: Muon under tensor parallelism]), Shampoo / SOAP the blocks a TP cut splits in runs over the
    # TP ranks ([Note: preconditioner blocks under tensor parallelism]), WholeTensorOptimizer (torch.<Name>)
    # steps a TP-split tensor whole at a home TP rank ([Note: whole-tensor optimizer under TP]).
    tensor_parallel = tuple(OPTIMIZERS)
    orthogonalize = ("newton_schulz", "gram_newton_schulz")
    coefficients = ("torch", "polar_express", "list")

    def shard(self, model, opt_name, param_dtype, fp8_all_gather="off", max_preconditioner_dim=1024, ep=1, tp=1):
        """With the optimizer's block rule (Shampoo's follows ``optim.max_preconditioner_dim``).
        ``fp8_all_gather``: ``off`` or a tile (``128x128``, ``1x128``) for the block-wise FP8 all-gather.
        ``ep`` > 1 (MoE): first each layer's experts are split whole over groups of ``ep`` ranks
        (``expert_parallel``) and each rank's slice sharded over the ranks holding the same experts
        (docs/expert-parallel.md); ``ep`` = 1 leaves them in their layer, sharded with it. NorMuon normalizes
        whole matrices on their owner, so its plan never cuts one (``balance="whole"``, ragged buckets)."""
        import fsdp_optim
        from fsdp_optim import optimizers
        from fsdp_optim.sharding import PlanConfig

        blocks = getattr(optimizers, OPTIMIZERS[opt_name]).blocks
        if opt_name == "shampoo":
            blocks = optimizers.Shampoo.rule(max_preconditioner_dim=max_preconditioner_dim)
        plan = PlanConfig(layout="ragged", balance="whole") if opt_name == "normuon" else None
        mp = None
        if param_dtype != torch.float32:
            mp = fsdp_optim.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        fp8 = None if fp8_all_gather == "off" else fsdp_optim.Float8AllGather(tile=fp8_all_gather)
        dp_mesh = _apply_tp(model, tp)  # None without TP: fully_shard's default (every rank)
        if ep > 1:
            from fsdp_optim.sharding import expert_parallel, expert_parallel_groups

            groups = expert_parallel_groups(ep)
            for layer in model.layers:  # the experts' own fully_shard comes before their layer's
                experts = layer.feed_forward.experts
                expert_parallel(experts, group=groups.ep)
                fsdp_optim.fully_shard(experts, mesh=groups.replicas, blocks=blocks, mp_policy=mp, fp8_all_gather=fp8,
                                       plan_config=plan)
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, mesh=dp_mesh, blocks=blocks, mp_policy=mp, fp8_all_gather=fp8,
                                   plan_config=plan)
        fsdp_optim.fully_shard(model, mesh=dp_mesh, blocks=blocks, mp_policy=mp, fp8_all_gather=fp8, plan_config=plan)

    def init_sharded(self, model, device):
        import fsdp_optim

        fsdp_optim.init_weights(model, model.init_module)

    def optimizer(self, groups, cfg, lr, adamw_lr):
        from fsdp_optim import optimizers

        o = cfg.optim
        if o.name == "adamw":
            return optimizers.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps)
        if o.name in ("adamw8bit", "adamw4bit"):  # compiled on GPUs, eager on CPU (compiling takes minutes there)
            cls = getattr(optimizers, OPTIMIZERS[o.name])
            return cls(groups, lr=lr, betas=o.betas, eps=o.eps, compile=torch.cuda.is_available())
        if o.name == "soap":
            return optimizers.SOAP(
                groups, lr=lr, betas=o.betas, eps=o.eps, precondition_frequency=o.precondition_frequency,
                max_precond_dim=o.max_preconditioner_dim,
            )
        if o.name.startswith("torch."):  # lr, and betas / eps where the class takes them in that form
            cls = getattr(torch.optim, o.name.removeprefix("torch."))
            takes = inspect.signature(cls).parameters  # (Adafactor's eps is a pair: left at its default)
            kw = {k: v for k, v in (("betas", o.betas), ("eps", o.eps))
                  if k in takes and isinstance(v, type(takes[k].default))}
            return optimizers.WholeTensorOptimizer(groups, cls, lr=lr, **kw)
        if o.name in MUON_FAMILY:  # matrices: (Nor)Muon; embeddings, head, norms: its AdamW fallback (own lr)
            for g in groups:
                g["adamw_weight_decay"] = g["weight_decay"]
            kw = dict(lr=lr, momentum=o.momentum, adamw_lr=adamw_lr, adamw_betas=o.betas, adamw_eps=o.eps,
                      orthogonalize=o.orthogonalize, coefficients=o.coefficients, gram_dtype=GRAM_DTYPES[o.gram_dtype])
            if o.name == "normuon":
                return optimizers.NorMuon(groups, beta2=o.normuon_beta2, norm_eps=o.normuon_eps, **kw)
            return optimizers.Muon(groups, **kw)
        return optimizers.Shampoo(  # Adam grafting: DistributedShampoo's default is none (docs/shampoo.md)
            groups, lr=lr, betas=o.betas, grafting="adam", grafting_epsilon=o.eps, max_preconditioner_dim=o.max_preconditioner_dim,
            precondition_frequency=o.precondition_frequency,
        )

    def _clip_grad_norm(self, model, max_norm):
        import fsdp_optim

        return float(fsdp_optim.clip_grad_norm_(model.parameters(), max_norm))

    def max_logit(self, model, layers, tau):
        from fsdp_optim.optimizers import qk_clip_

        return qk_clip_(model, tau=tau if tau > 0 else math.inf).max_logit

    def save(self, path, model, optimizer, scheduler, extra):
        import fsdp_optim

        fsdp_optim.save_checkpoint(str(path), model=model, optimizer=optimizer, scheduler=scheduler, extra=extra)

    def load(self, path, model, optimizer, scheduler):
        import fsdp_optim

        return fsdp_optim.load_checkpoint(str(path), model=model, optimizer=optimizer, scheduler=scheduler)


class TorchBackend(Backend):
    name = "torch"
    optimizers = ("adamw", "adamw8bit")
    fp8_all_gather = expert_parallel = qk_clip = hf_io = False
    tensor_parallel = ("adamw",)  # FSDP2 + TP, torchtitan's way (torch.optim.AdamW on the DTensors)
    # What torch.optim.Muon can do (its Newton–Schulz with one (a, b, c)), should Muon join ``optimizers``:
    # it has no Muon today, so _checks refuses any other value here before it refuses optim.name.
    orthogonalize = ("newton_schulz",)
    coefficients = ("torch",)

    def shard(self, model, opt_name, param_dtype, fp8_all_gather="off", max_preconditioner_dim=1024, ep=1, tp=1):
        if ep > 1:  # (resolve_config refuses it first; this guards direct callers)
            raise ValueError(f"parallel.ep = {ep} needs the fsdp_optim backend (train.backend); set parallel.ep=1")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        dp_mesh = _apply_tp(model, tp)
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)

    def init_sharded(self, model, device):
        model.to_empty(device=device)
        model.init_weights()  # FSDP2: on DTensors, so each rank draws its own shards

    def optimizer(self, groups, cfg, lr, adamw_lr):
        o = cfg.optim
        if o.name == "adamw":
            return torch.optim.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps)
        if o.name == "adamw8bit":
            from torchao.optim import AdamW8bit

            return AdamW8bit(groups, lr=lr, betas=o.betas, eps=o.eps)
        raise ValueError(needs_our_optimizer(o.name))

    def _clip_grad_norm(self, model, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def max_logit(self, model, layers, tau):
        # qk_clip_ refuses FSDP2's DTensor weights (resolve_config refuses tau > 0), so measure only.
        return measured_max_logit(layers)

    def save(self, path, model, optimizer, scheduler, extra):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        if dist.get_rank() == 0:
            torch.save({"scheduler": scheduler.state_dict(), "extra": extra}, path / "recipe_extra.pt")

    def load(self, path, model, optimizer, scheduler):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        saved = torch.load(path / "recipe_extra.pt", weights_only=True)
        scheduler.load_state_dict(saved["scheduler"])
        return saved["extra"]


BACKENDS: dict[str, Backend] = {b.name: b for b in (FsdpOptimBackend(), TorchBackend())}


def _apply_tp(model: torch.nn.Module, tp: int):
    """``tp`` > 1: the (dp, tp) mesh, the TP plan applied to ``model`` (kept as ``model.tp_mesh``); its
    data-parallel mesh (what fully_shard takes). ``tp`` = 1: ``None``, nothing done."""
    if tp == 1:
        return None
    from _tensor_parallel import apply_tensor_parallel, tp_mesh

    device = next(model.parameters()).device
    mesh = tp_mesh("cpu" if device.type == "meta" else device.type, dist.get_world_size(), tp)
    apply_tensor_parallel(model, mesh["tp"], loss_parallel=True)
    model.tp_mesh = mesh["tp"]
    return mesh["dp"]


def measured_max_logit(layers: list[torch.nn.Module]) -> float:
    """The largest logit the attention ``layers`` recorded this step over every head, layer and rank
    (each rank records the heads it computes), the records reset; no clipping."""
    from fsdp_optim.optimizers import recorded_max_logits

    recorded = [recorded_max_logits(m) for m in layers]
    top = torch.stack([r.max() for r in recorded]).max()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    for r in recorded:
        r.fill_(float("-inf"))  # a running max per step, as qk_clip_ resets it
    return top.item()


def needs_our_optimizer(opt_name: str) -> str:
    """The error for an optimizer the torch backend does not run."""
    return (
        f"optim.name = {opt_name!r} needs fsdp_optim.optimizers.{OPTIMIZERS[opt_name]} (train.backend = 'fsdp_optim'); "
        f"the torch backend (PyTorch FSDP2) runs {' and '.join(TorchBackend.optimizers)}"
    )


def describe_optimizer(cfg: Config) -> str:
    """``optim.name``, with the orthogonalization when it is not the default (the start line, the plot title)."""
    o = cfg.optim
    if o.name not in MUON_FAMILY or (o.orthogonalize, o.coefficients) == ("newton_schulz", "torch"):
        return o.name
    coefficients = o.coefficients if isinstance(o.coefficients, str) else f"{len(o.coefficients)} (a, b, c)"
    gram = f" {o.gram_dtype}" if o.orthogonalize == "gram_newton_schulz" else ""
    return f"{o.name} ({o.orthogonalize}{gram}, {coefficients} coefficients)"


def pick_backend(cfg: Config) -> str:
    """``train.backend``; ``auto``: fsdp_optim when it has the optimizer, else torch."""
    if cfg.train.backend in BACKENDS:
        return cfg.train.backend
    if cfg.train.backend != "auto":
        raise ValueError(f"train.backend must be auto, {' or '.join(BACKENDS)}, got {cfg.train.backend!r}")
    import fsdp_optim
    import fsdp_optim.optimizers as ours

    ready = all(hasattr(fsdp_optim, f) for f in ("fully_shard", "clip_grad_norm_", "save_checkpoint", "load_checkpoint"))
    return "fsdp_optim" if ready and hasattr(ours, OPTIMIZERS.get(cfg.optim.name, "")) else "torch"


def shard_model(model: torch.nn.Module, backend: str, opt_name: str, param_dtype: torch.dtype,
                fp8_all_gather: str = "off", max_preconditioner_dim: int = 1024, ep: int = 1, tp: int = 1) -> None:
    """``BACKENDS[backend].shard(...)`` (see ``Backend.shard``)."""
    BACKENDS[backend].shard(model, opt_name, param_dtype, fp8_all_gather, max_preconditioner_dim, ep, tp)


def build_optimizer(model: torch.nn.Module, cfg: Config, backend: str) -> torch.optim.Optimizer:
    """``cfg.optim``'s optimizer on ``backend``, with weight decay on matrices only (not norms, biases):
    nanoGPT's grouping, by the *global* shape (a sharded parameter is a flat 1-D piece, so p.ndim would
    say 1 for all of them)."""
    import fsdp_optim

    o = cfg.optim
    lr = o.lr if o.lr is not None else DEFAULT_LR.get(o.name, DEFAULT_LR["adamw"])
    adamw_lr = o.adamw_lr if o.adamw_lr is not None else DEFAULT_LR["adamw"]  # (0 is a setting: frozen)
    groups = fsdp_optim.param_groups(model, weight_decay=o.weight_decay)
    return BACKENDS[backend].optimizer(groups, cfg, lr, adamw_lr)
