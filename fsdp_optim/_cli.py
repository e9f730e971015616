"""The ``fsdp-optim`` command line."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings

__all__ = ["main", "optimizer_balance", "optimizer_rule"]

DESCRIPTION = (
    "fsdp_optim command line tools. 'fsdp-optim plan' lays out a public model's weights (shapes only, no "
    "download) over W simulated ranks and reports padding, split matrices, per-rank balance and planner time."
)
EPILOG = (
    "Example: fsdp-optim plan --model llama3-70b --world-size 1024 --optimizer muon; "
    "fsdp-optim plan --model llama3-70b --world-size 16384 --optimizer muon --suggest --memory-per-rank 80GB"
)

OPTIMIZERS = ("adamw", "adamw8bit", "muon", "shampoo")


def optimizer_rule(name: str):
    """The block rule ``fsdp-optim plan --optimizer name`` plans with.

    Shampoo preconditions each routed expert as its own matrix (``per_expert=True``), blocks of
    ``max_preconditioner_dim = 1024`` rows otherwise.
    """
    from .optimizers._rules import adamw8bit_rule, adamw_rule, muon_rule, shampoo_rule

    rules = {
        "adamw": lambda: adamw_rule,
        "adamw8bit": lambda: adamw8bit_rule(),
        "muon": lambda: muon_rule(),
        "shampoo": lambda: shampoo_rule(1024, per_expert=True),
    }
    if name not in rules:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return rules[name]()


def optimizer_balance(name: str) -> str:
    """``PlanConfig.balance`` for ``--optimizer name``: ``"auto"`` where the optimizer accepts blocks
    split on rows (Muon's matrices, Shampoo's strips; AdamW and 8-bit AdamW have none), ``"whole"``
    where it refuses them; the rule decides, as in ``fully_shard`` (``config_for_rules``)."""
    from .sharding.plan import PlanConfig, config_for_rules

    return config_for_rules(PlanConfig(), [optimizer_rule(name)]).balance


# ---- plan ---------------------------------------------------------------------------
def _add_plan(sub) -> None:
    from .sharding.plan import preset_names

    p = sub.add_parser(
        "plan",
        help="plan a model preset at a world size and print the layout figures",
        description="Plan a public model's shapes (no weights) over W simulated ranks: padding, split "
        "matrix blocks, per-rank bytes and optimizer cost balance, planner time.",
    )
    p.add_argument("--model", required=True, choices=preset_names(), help="model preset")
    p.add_argument("--world-size", type=int, required=True, help="total number of ranks")
    p.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="HSDP: ranks per shard group (must divide --world-size); the plan is made over these ranks and "
        "replicated world-size / shard-size times (default: the world size, pure FSDP)",
    )
    p.add_argument("--optimizer", required=True, choices=OPTIMIZERS, help="whose block rule to plan with")
    p.add_argument("--layout", default="auto", choices=("even", "ragged", "auto"), help="bucket layout (default auto)")
    p.add_argument("--bucket-layers", type=int, default=1, help="transformer layers per bucket (default 1)")
    p.add_argument("--padding-cap", type=float, default=None, help="even layout: padding tolerated to keep matrices whole")
    p.add_argument("--align", type=int, default=None, help="even layout: segment size multiple (elements)")
    p.add_argument("--itemsize", type=int, default=4, help="bytes per element (default 4: fp32 master weights)")
    p.add_argument("--wire", choices=["auto", "grouped", "padded"], default="auto",
                   help="ragged buckets on the wire (as PlanConfig.wire; auto: the alpha-beta model on NCCL)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--suggest", action="store_true",
                   help="choose the HSDP shape (replicas x shard size), and for an MoE model the expert-parallel degree "
                   "(ep), with the least modeled step time whose busiest rank fits --memory-per-rank, and print every "
                   "candidate's figures (suggest_mesh)")
    p.add_argument("--memory-per-rank", default=None,
                   help="with --suggest: bytes per rank for sharded state and gathered buckets (80e9, 80GB or 80GiB)")
    p.add_argument("--tokens-per-rank", type=int, default=8192,
                   help="with --suggest on an MoE model: tokens per rank per step, for the expert-parallel token "
                   "exchanges (default 8192)")
    p.set_defaults(func=_run_plan)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _parse_bytes(text: str) -> float:
    """``80e9``, ``80GB`` (1e9) or ``80GiB`` (2**30) as bytes; ValueError naming the flag otherwise."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()] if m else math.nan
    except (ValueError, KeyError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--memory-per-rank must be a positive size in bytes (80e9, 80GB or 80GiB), got {text!r}")
    return value


def _run_suggest(args: argparse.Namespace, config, itemsize: int) -> int:
    from .sharding.plan import suggest_mesh

    if args.memory_per_rank is None:
        raise ValueError("--suggest needs --memory-per-rank (bytes per rank, e.g. 80GB)")
    if args.shard_size is not None:
        warnings.warn(f"--shard-size {args.shard_size} is ignored with --suggest (it chooses the shard size)", stacklevel=2)
    mem = _parse_bytes(args.memory_per_rank)
    if args.tokens_per_rank < 1:
        raise ValueError(f"--tokens-per-rank must be a positive number of tokens, got {args.tokens_per_rank}")
    s = suggest_mesh(model=args.model, world_size=args.world_size, rule=optimizer_rule(args.optimizer),
                     memory_per_rank=mem, config=config, itemsize=itemsize, tokens_per_rank=args.tokens_per_rank)  # fmt: skip
    if args.json:
        cands = [{**c._asdict(), "collective_seconds": c.collective_seconds if c.planned else None,
                  "balance_ratio": c.balance_ratio if c.planned else None} for c in s.candidates]  # fmt: skip
        out = {"model": args.model, "optimizer": args.optimizer, "world_size": args.world_size, "memory_per_rank": mem,
               "shard_size": s.shard_size, "num_replicas": s.num_replicas, "ep": s.ep, "tp": s.tp,
               "max_rank_bytes": s.max_rank_bytes,
               "collective_seconds": s.collective_seconds, "candidates": cands}  # fmt: skip
        print(json.dumps(out, allow_nan=False))
        return 0
    print(f"model {args.model}, optimizer {args.optimizer}, world size {args.world_size}, {mem / 1e9:.1f} GB per rank")
    shape = (f"expert parallel {s.ep} (each rank's experts sharded over the {args.world_size // s.ep} ranks holding the "
             f"same experts), the rest pure FSDP over {s.shard_size} ranks" if s.ep > 1
             else f"{s.num_replicas} replicas x shard size {s.shard_size}")  # fmt: skip
    if s.tp > 1:
        shape = (f"tensor parallel {s.tp} (each block's heads, FFN and the vocabulary split over {s.tp} ranks), "
                 f"{shape} over the {args.world_size // s.tp} data-parallel ranks")  # fmt: skip
    print(f"suggested: {shape} (busiest rank {s.max_rank_bytes / 1e9:.2f} GB, collectives {s.collective_seconds:.3f} s "
          "per step, modeled)")  # fmt: skip
    print(f"{'ep':>4} {'shard':>7} {'replicas':>8} {'rank GB':>9} {'fits':>5} {'comm s/step':>12} {'bytes max/mean':>15} "
          f"{'split':>6} {'tp':>4}")  # fmt: skip
    for c in s.candidates:
        secs = f"{c.collective_seconds:12.3f}" if c.planned else f"{'-':>12}"
        ratio = f"{c.balance_ratio:>15.3f}" if c.planned else f"{'-':>15}"
        print(f"{c.ep:>4} {c.shard_size:>7} {c.num_replicas:>8} {c.max_rank_bytes / 1e9:>9.2f} {'yes' if c.fits else 'no':>5} "
              f"{secs} {ratio} {c.num_split_blocks if c.planned else '-':>6} {c.tp:>4}")  # fmt: skip
    print("memory: 16 B per sharded element (fp32 parameter, gradient, 2 moments) + the rule's per-block state (Shampoo's "
          "factors and roots) + 2 gathered buckets (bf16 + fp32 grad); time: all-gather x2 + reduce-scatter per bucket, "
          "split-block exchanges, HSDP all-reduce (alpha-beta, "
          "5 us, 400 Gb/s, no overlap); '-': not planned, its memory lower bound does not fit"
          + ("; ep > 1: the routed experts split whole over ep ranks and sharded over the W / ep holding the same "
             f"experts, the rest pure FSDP (no HSDP with EP yet), plus 4 token all-to-alls per MoE layer at "
             f"{args.tokens_per_rank} tokens per rank" if any(c.ep > 1 for c in s.candidates) else "")
          + ("; tp > 1 (tried when no data-parallel shape fits): torchtitan's Llama TP plan, the split matrices 1 / tp "
             "per rank, the rest replicated; TP's activation collectives are not modeled, the least fitting tp wins"
             if any(c.tp > 1 for c in s.candidates) else ""))  # fmt: skip
    return 0


def _wire_of(bucket, itemsize: int, wire: str) -> str:
    """What a bucket uses on NCCL: ``even`` (one tensor collective), or the ragged wire mode."""
    from .sharding.plan import choose_wire_mode

    sizes = bucket.segment_sizes
    if len(set(sizes)) <= 1:
        return "even"
    return choose_wire_mode(sizes, element_size=itemsize, wire=wire, backend="nccl").value


def _run_plan(args: argparse.Namespace) -> int:
    from .sharding.plan import PlanConfig
    from .sharding.plan import plan_model
    from .sharding.plan import preset_buckets

    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    shard_size = args.world_size if args.shard_size is None else args.shard_size
    if shard_size < 1 or args.world_size % shard_size:
        raise ValueError(
            f"--shard-size must be a positive divisor of --world-size {args.world_size} (a (replicate, shard) mesh "
            f"of world-size / shard-size replicas), got {shard_size}"
        )
    num_replicas = args.world_size // shard_size
    if args.bucket_layers < 1:
        raise ValueError(f"--bucket-layers must be >= 1, got {args.bucket_layers}")
    if args.itemsize < 1:
        raise ValueError(f"--itemsize must be >= 1 (bytes per element: 4 for fp32, 2 for bf16), got {args.itemsize}")
    if args.align is not None and args.align < 1:
        raise ValueError(f"--align must be >= 1 (a segment size multiple, in elements), got {args.align}")
    if args.padding_cap is not None and not (args.padding_cap >= 0 and math.isfinite(args.padding_cap)):  # NaN, inf
        raise ValueError(
            f"--padding-cap must be >= 0 and finite (the padding ratio tolerated; a large value such as 1e9 "
            f"tolerates any padding), got {args.padding_cap}"
        )
    if args.memory_per_rank is not None and not args.suggest:
        warnings.warn("--memory-per-rank is ignored without --suggest", stacklevel=2)
    kw = {"layout": args.layout, "wire": args.wire, "balance": optimizer_balance(args.optimizer)}
    if args.padding_cap is not None:
        kw["padding_cap"] = args.padding_cap
    if args.align is not None:
        kw["align"] = args.align
    config = PlanConfig(**kw)
    if args.suggest:
        return _run_suggest(args, config, args.itemsize)
    buckets = preset_buckets(
        args.model, rule=optimizer_rule(args.optimizer), bucket_layers=args.bucket_layers, itemsize=args.itemsize
    )
    # HSDP: every replica holds the same layout, so the per-rank figures are those of the shard group.
    plan = plan_model(buckets, world_size=shard_size, config=config)
    if args.json:
        out = {
            "model": args.model,
            "optimizer": args.optimizer,
            "layout": args.layout,
            "bucket_layers": args.bucket_layers,
            "padding_cap": config.padding_cap,
            "align": config.align,
            "balance": config.balance,
            "balance_cap": config.balance_cap,
            "balance_note": plan.balance_note,
            **plan.stats().as_dict(),
            **_block_state_figures(plan, args.optimizer),
            "world_size": args.world_size,
            "shard_size": shard_size,
            "num_replicas": num_replicas,
            "wire": args.wire,
            "buckets": [
                {"name": b.name, "layout": b.layout.value, "wire": _wire_of(b, args.itemsize, args.wire)}
                for b in plan.buckets
            ],
        }
        print(json.dumps(out, allow_nan=False))  # strict JSON: a NaN / Infinity here is a bug, raised
    else:
        print(f"model {args.model}, optimizer {args.optimizer}")
        if num_replicas > 1:
            print(
                f"HSDP: world size {args.world_size} = {num_replicas} replicas x shard size {shard_size}; "
                f"planned over the {shard_size} ranks of a shard group (the same layout on every replica)"
            )
        print(plan.report())
        fig = _block_state_figures(plan, args.optimizer)
        if fig:
            print(f"per-block optimizer state (Shampoo's factors and inverse roots, fp32, on the rank holding each "
                  f"strip's first element): busiest rank {fig['block_state_max_bytes'] / 2**20:.1f} MiB, "
                  f"{fig['block_state_max_over_mean']:.3f} x the mean (not balanced by the plan, which balances "
                  "parameter bytes; suggest_mesh prices it)")  # fmt: skip
    return 0


def _block_state_figures(plan, optimizer: str) -> dict:
    """The busiest rank's per-block optimizer state (a rule's ``block_state_bytes``: Shampoo's factors),
    in bytes and over the mean; empty for rules without."""
    from .sharding.plan import block_state_per_rank

    rule = optimizer_rule(optimizer)
    if getattr(rule, "block_state_bytes", None) is None:
        return {}
    per_rank = block_state_per_rank(plan, rule)
    mean = float(per_rank.mean())
    return {"block_state_max_bytes": int(per_rank.max()),
            "block_state_max_over_mean": float(per_rank.max()) / mean if mean else 1.0}  # fmt: skip


# ---- entry point ----------------------------------------------------------------------
_COMMANDS = [_add_plan]
"""Each adds one subcommand (``sub.add_parser(...)``, ``set_defaults(func=run)``, ``run(args) -> int``)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-optim", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"fsdp-optim {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
