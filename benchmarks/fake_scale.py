"""Setup at scale without the hardware: one CPU process plays rank 0 of W ranks (torch's fake
process group), shards a meta-built model of a public LLM's exact shapes layer by layer and then
at the root, and reports setup seconds and peak live tensor bytes against the shard size.

The fake group runs no communication: its collectives return at once and leave their outputs as
they are. So every collective of setup "runs" (the plan agreement, the per-bucket moves of the root
call), but what it would have received is not there; values are meaningless (the model is meta-built
anyway) and only time and memory are measured.

    python benchmarks/fake_scale.py --model llama3-70b --world-size 1024
    python benchmarks/fake_scale.py --model deepseek-v3 --world-size 1024 --num-layers 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _out import out_dir  # noqa: E402

import fsdp_optim  # noqa: E402
from fsdp_optim._testing import LiveBytes  # noqa: E402
from fsdp_optim.optimizers import adamw_rule, muon_rule  # noqa: E402
from fsdp_optim.sharding.plan import preset_shapes  # noqa: E402

MB = 1e6


def build_meta(model: str, num_layers: int | None) -> tuple[nn.Module, list[nn.Module]]:
    """A module tree with the preset's parameter names and shapes on meta; returns (root, layers)."""
    root = nn.Module()
    layers = []
    for bucket, params in preset_shapes(model):
        if num_layers is not None and bucket.startswith("layers.") and int(bucket.split(".")[1]) >= num_layers:
            continue
        for fqn, shape in params:
            *path, leaf = fqn.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(torch.empty(shape, device="meta")))
    if hasattr(root, "model") and hasattr(root.model, "layers"):
        layers = list(root.model.layers.children())
    return root, layers


def _skip_all_to_all() -> None:
    """The fake group emulates ``all_to_all_single`` by copying this rank's own input into the output
    chunk by chunk (it cannot see the peers'), which costs far more than the transfer would (a rank
    that sends little but receives a whole matrix loops millions of times) and refuses an empty input
    with a non-empty output, which a real backend accepts. The values are meaningless here, so the
    call is skipped: time and memory of everything else in setup are measured."""

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if sum(output_split_sizes or [output.numel()]) != output.numel():
            raise AssertionError("all_to_all_single: output split sizes do not cover the output")
        if sum(input_split_sizes or [input.numel()]) != input.numel():
            raise AssertionError("all_to_all_single: input split sizes do not cover the input")

    dist.all_to_all_single = all_to_all_single


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--world-size", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=None, help="first N layers only (default: all)")
    ap.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    _skip_all_to_all()
    rule = muon_rule() if args.optimizer == "muon" else adamw_rule
    root, layers = build_meta(args.model, args.num_layers)
    numel = sum(p.numel() for p in root.parameters())
    t0 = time.perf_counter()
    error = None
    with LiveBytes() as live:
        try:
            for layer in layers:
                fsdp_optim.fully_shard(layer, blocks=rule)
            t_layers = time.perf_counter() - t0
            fsdp_optim.fully_shard(root, blocks=rule)
        except Exception as e:  # noqa: BLE001 - reported: where the fake group cannot run setup
            error = f"{type(e).__name__}: {e}"
            t_layers = float("nan")
    seconds = time.perf_counter() - t0
    shard = sum(p.to_local().numel() * p.element_size() for p in root.parameters() if p.device.type != "meta")
    row = dict(
        model=args.model, world_size=args.world_size, num_layers=len(layers), optimizer=args.optimizer,
        num_params=numel, even_shard_mb=numel * 4 / args.world_size / MB, rank0_shard_mb=shard / MB,
        peak_live_mb=live.peak / MB, setup_s=seconds, layer_calls_s=t_layers, error=error,
    )
    print(json.dumps(row, indent=1))
    dest = out_dir(ap, args)
    dest.mkdir(parents=True, exist_ok=True)
    name = f"fake_scale_{args.model}_w{args.world_size}{'' if args.num_layers is None else f'_l{args.num_layers}'}.json"
    (dest / name).write_text(json.dumps(row, indent=1))
    dist.destroy_process_group()
    if error is not None:
        sys.exit(1)


if __name__ == "__main__":
    main()
