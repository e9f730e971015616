"""The optimizer's share of a recipe training step: AdamW, Muon, Shampoo and SOAP on the recipe's model.

One launch of W (default 2) forked gloo ranks, 1 thread each. The default recipe config
(``recipes/config.py``: the tiny Llama, bf16 compute, the recipes' corpus's tokenizer vocabulary),
sharded as ``recipes/pretrain.py`` shards it with each optimizer's block rule, the recipe's
optimizer settings (Shampoo: Adam grafting; SOAP: ``block_size`` = the recipe's
``max_preconditioner_dim``, its precondition frequency). Per optimizer: forward + backward and
``optimizer.step()`` timed separately on random tokens, the slowest rank's median over ``--steps``
steps after ``--warmup`` and the mean over whole precondition periods (which include the
eigendecompositions). Printed: each optimizer's step, its share of the training step
(``step / (fwd_bwd + step)``) and its step over AdamW's.

    python benchmarks/recipe_step_share.py            # -> benchmarks/results/recipe_step_share.json
    python benchmarks/recipe_step_share.py --quick    # 2 warm-up + 5 steps -> runs/bench-quick/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "recipes"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _out import out_dir  # noqa: E402

NAMES = ("adamw", "muon", "shampoo", "soap", "soap_looped")  # soap: batched (the default); soap_looped: batched=False


def _build(name: str, cfg, world: int):
    import fsdp_optim
    from fsdp_optim import optimizers

    from model import build_model
    from _backend import build_optimizer, shard_model

    torch.manual_seed(0)
    model = build_model(cfg.model)
    o = cfg.optim
    if name in ("soap", "soap_looped"):
        mp = fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        rule = optimizers.SOAP.rule(block_size=o.max_preconditioner_dim) if hasattr(optimizers.SOAP, "rule") else None
        for layer in model.layers:
            fsdp_optim.fully_shard(layer, blocks=rule, mp_policy=mp)
        fsdp_optim.fully_shard(model, blocks=rule, mp_policy=mp)
        groups = fsdp_optim.param_groups(model, weight_decay=o.weight_decay)
        opt = optimizers.SOAP(groups, lr=3e-3, block_size=o.max_preconditioner_dim,
                              precondition_frequency=o.precondition_frequency,
                              batched=False if name == "soap_looped" else None)  # fmt: skip
        return model, opt
    cfg.optim.name = name
    shard_model(model, "fsdp_optim", name, torch.bfloat16, max_preconditioner_dim=o.max_preconditioner_dim)
    return model, build_optimizer(model, cfg, "fsdp_optim")


def _run(a):
    from config import load_config

    from _checks import load_data

    torch.set_num_threads(1)
    world = dist.get_world_size()
    cfg = load_config(None, [])
    load_data(cfg, world)  # sets the vocabulary size from the corpus's tokenizer
    seq, batch = cfg.data.seq_len, cfg.train.batch_size
    g = torch.Generator().manual_seed(dist.get_rank())
    out = {}
    for name in NAMES:
        model, opt = _build(name, cfg, world)
        fb, st = [], []
        for i in range(a.warmup + a.steps):
            x = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(x[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if i >= a.warmup:
                fb.append(t1 - t0)
                st.append(t2 - t1)
        out[name] = {"fwd_bwd": fb, "step": st}
        del model, opt
    return out


def main(argv=None) -> None:
    from fsdp_optim._testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dest = out_dir(ap, a)
    if a.quick:
        a.steps, a.warmup = 5, 2
    per_rank = run_distributed(lambda: _run(a), world_size=a.world_size, timeout=1800)
    rows = {}
    for name in NAMES:
        # the slowest rank at each step sets the pace
        fb = [max(r[name]["fwd_bwd"][i] for r in per_rank) for i in range(a.steps)]
        st = [max(r[name]["step"][i] for r in per_rank) for i in range(a.steps)]
        rows[name] = {
            "fwd_bwd_s_median": statistics.median(fb), "step_s_median": statistics.median(st),
            "step_s_mean": statistics.fmean(st), "fwd_bwd_s_mean": statistics.fmean(fb),
        }  # fmt: skip
        r = rows[name]
        r["share_median"] = r["step_s_median"] / (r["step_s_median"] + r["fwd_bwd_s_median"])
        r["share_mean"] = r["step_s_mean"] / (r["step_s_mean"] + r["fwd_bwd_s_mean"])
    for name, r in rows.items():
        r["step_over_adamw_median"] = r["step_s_median"] / rows["adamw"]["step_s_median"]
        r["step_over_adamw_mean"] = r["step_s_mean"] / rows["adamw"]["step_s_mean"]
        print(f"{name:8s} fwd+bwd {r['fwd_bwd_s_median'] * 1e3:8.1f} ms  step {r['step_s_median'] * 1e3:8.1f} ms "
              f"(mean {r['step_s_mean'] * 1e3:8.1f})  share of the training step {r['share_median']:.2f} "
              f"(mean {r['share_mean']:.2f})  step / AdamW's {r['step_over_adamw_median']:.2f} "
              f"(mean {r['step_over_adamw_mean']:.2f})")  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "recipe_step_share.json").write_text(json.dumps({"config": vars(a), "rows": rows}, indent=1))
    print(f"wrote {dest / 'recipe_step_share.json'}")


if __name__ == "__main__":
    main()
