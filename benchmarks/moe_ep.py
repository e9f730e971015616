"""The recipe's MoE training step under expert parallelism: ``parallel.ep`` = 1 vs 2 vs 4 at W = 4.

One launch of W = 4 forked gloo ranks, 1 thread each. ``recipes/configs/moe-tiny.toml`` (Muon, 8
experts, top-2, fp32 on CPU, the recipes' corpus), built, sharded and optimized by the recipe's own
``shard_model`` / ``build_optimizer`` / ``Backend.clip_grads`` for each ep (one model per ep, same seed), the
three trained side by side on the same batches, one step of each in turn (so a load spike on the
shared cores hits all three). Per ep:

- the training step (forward, backward, grad clipping, ``optimizer.step()``): the slowest rank's
  median over ``--steps`` steps after ``--warmup``, and tokens/s = the global batch / that median;
- expert-compute slots per step: the token rows that go through the experts' matmuls (one row is
  one token-expert assignment; each row goes through w1, w3 and w2 in every design, so the counts
  compare as they are), counted with ``fsdp_optim.sharding._grouped_mm.count_grouped_mm()`` in the
  forward, summed over the MoE layers: summed over ranks, and the busiest rank's (under EP a rank
  computes the rows that arrive for its experts from its EP group). The recipe's old MoE packed
  each rank's routed rows into an ``[E, C_max, dim]`` batch for ``torch.bmm`` (C_max = the busiest
  expert's count on that rank, nothing dropped); that code is gone, so its slots are reproduced
  from the same routing: E x C_max per layer and rank;
- the losses of the first steps (ep moves experts, it does not change the model: equal to rounding).

Absolute CPU times are noise (2 shared cores); quote the ratios to ep = 1 in the same run.

    python benchmarks/moe_ep.py            # -> benchmarks/results/moe_ep.json
    python benchmarks/moe_ep.py --quick    # 1 warm-up + 3 steps -> runs/bench-quick/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "recipes"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _out import out_dir  # noqa: E402

CONFIG = Path(_ROOT) / "recipes" / "configs" / "moe-tiny.toml"
WORLD = 4
EPS = (1, 2, 4)


def _build(cfg, ep: int):
    from model import build_model
    from _backend import build_optimizer, shard_model

    cfg.parallel.ep = ep
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    shard_model(model, "fsdp_optim", cfg.optim.name, torch.float32, max_preconditioner_dim=cfg.optim.max_preconditioner_dim,
                ep=ep)  # fmt: skip
    routed: list[torch.Tensor] = []  # this rank's [E] counts per MoE layer, as the experts are called
    for layer in model.layers:
        layer.feed_forward.experts.register_forward_pre_hook(lambda m, args: routed.append(args[1].detach().clone()))
    return model, build_optimizer(model, cfg, "fsdp_optim"), routed


def _run(a):
    from config import load_config
    from data import Sampler
    from fsdp_optim.sharding._grouped_mm import count_grouped_mm
    from _backend import BACKENDS
    from _checks import load_data

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(CONFIG, a.set)
    _, _, windows = load_data(cfg, world)
    built = {ep: _build(cfg, ep) for ep in EPS}
    sampler = Sampler(windows, cfg.train.batch_size, rank, world, cfg.train.seed)
    out = {ep: {"step_s": [], "slots": [], "padded_slots": [], "routed": [], "loss": []} for ep in EPS}
    for i in range(a.warmup + a.steps):
        x, y = sampler.next()  # the same batch for every ep
        for ep in EPS:
            model, opt, routed = built[ep]
            routed.clear()
            dist.barrier()
            t0 = time.perf_counter()
            with count_grouped_mm() as counter:
                logits = model(x)
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            (ce + cfg.model.moe_aux_loss * model.aux_loss()).backward()
            BACKENDS["fsdp_optim"].clip_grads(model, cfg.train.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            r = out[ep]
            r["loss"].append(ce.item())
            if i >= a.warmup:
                r["step_s"].append(t1 - t0)
                r["slots"].append(counter.rows // 3)  # w1, w3, w2: 3 grouped matmuls per row
                r["padded_slots"].append(sum(c.numel() * int(c.max()) for c in routed))  # E x C_max per layer
                r["routed"].append(sum(int(c.sum()) for c in routed))
    for ep in EPS:
        del built[ep]
    return out


def main(argv=None) -> dict:
    from fsdp_optim._testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a moe-tiny key, as the recipe's --set (a partial run)")
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 3 steps at dim 64, seq 64 (a smoke run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dest = out_dir(ap, a)
    if a.quick:
        a.steps, a.warmup = 3, 1
        a.set = ["model.dim=64", "model.moe_ffn_dim=64", "data.seq_len=64", "train.batch_size=2", *a.set]
    per_rank = run_distributed(lambda: _run(a), world_size=WORLD, timeout=1800)
    from config import load_config

    cfg = load_config(CONFIG, a.set)
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * WORLD
    rows = {}
    for ep in EPS:
        steps = [max(r[ep]["step_s"][i] for r in per_rank) for i in range(a.steps)]  # the slowest rank sets the pace
        slots = [[r[ep]["slots"][i] for r in per_rank] for i in range(a.steps)]
        padded = [[r[ep]["padded_slots"][i] for r in per_rank] for i in range(a.steps)]
        routed = [sum(r[ep]["routed"][i] for r in per_rank) for i in range(a.steps)]
        rows[ep] = {
            "step_s_median": statistics.median(steps),
            "tokens_per_s": tokens_per_step / statistics.median(steps),
            "slots_per_step_total": statistics.fmean(sum(s) for s in slots),
            "slots_per_step_busiest_rank": statistics.fmean(max(s) for s in slots),
            "padded_bmm_slots_per_step_total": statistics.fmean(sum(s) for s in padded),
            "padded_bmm_slots_per_step_busiest_rank": statistics.fmean(max(s) for s in padded),
            "routed_rows_per_step": statistics.fmean(routed),
            "slots_equal_routed_rows": all(sum(s) == n for s, n in zip(slots, routed)),
            "losses": per_rank[0][ep]["loss"][: a.warmup + a.steps],
        }
    base = rows[1]
    for ep, r in rows.items():
        r["step_over_ep1"] = r["step_s_median"] / base["step_s_median"]
        r["tokens_per_s_over_ep1"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["busiest_rank_slots_over_ep1"] = r["slots_per_step_busiest_rank"] / base["slots_per_step_busiest_rank"]
        r["padded_over_dropless_total"] = r["padded_bmm_slots_per_step_total"] / r["slots_per_step_total"]
        r["max_rel_loss_diff_vs_ep1"] = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], base["losses"]))
    print(f"moe-tiny{' ' + ' '.join(a.set) if a.set else ''}, W={WORLD}, {tokens_per_step} tokens/step, "
          f"median of {a.steps} steps (slowest rank); slots = token rows through the experts per step, all MoE layers")
    head = (f"{'ep':>3} {'step ms':>9} {'x ep1':>6} {'tokens/s':>9} {'x ep1':>6} {'slots (all ranks)':>18} "
            f"{'busiest rank':>13} {'x ep1':>6} {'old padded bmm':>15} {'padded/dropless':>16} {'max loss diff':>14}")
    print(head)
    for ep, r in rows.items():
        print(f"{ep:>3} {r['step_s_median'] * 1e3:9.1f} {r['step_over_ep1']:6.2f} {r['tokens_per_s']:9.0f} "
              f"{r['tokens_per_s_over_ep1']:6.2f} {r['slots_per_step_total']:18.0f} {r['slots_per_step_busiest_rank']:13.0f} "
              f"{r['busiest_rank_slots_over_ep1']:6.2f} {r['padded_bmm_slots_per_step_total']:15.0f} "
              f"{r['padded_over_dropless_total']:16.2f} {r['max_rel_loss_diff_vs_ep1']:14.1e}")
    result = {"config": {**vars(a), "world_size": WORLD, "tokens_per_step": tokens_per_step}, "rows": rows}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "moe_ep.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {dest / 'moe_ep.json'}")
    return result


if __name__ == "__main__":
    main()
