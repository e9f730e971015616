"""Quality of Muon's orthogonalizations on the recipe's model: distance to the exact polar factor on real
gradients, and the loss after N training steps (3 seeds), each method next to torch's Newton–Schulz.

The model, data and optimizer settings are the recipe's ``recipes/configs/tiny.toml`` (imported, not
changed: ``recipes/model.py``, ``recipes/data.py``, the embedded corpus, byte tokens), trained here in
one process, fp32, one thread: Muon lr 0.02, momentum 0.95, AdamW fallback 3e-3 with betas (0.9, 0.95)
on embeddings, head and norms, weight decay 0.1 on >= 2-D parameters, linear warmup then cosine to 0.1,
gradient clipping at 1.0; ``--batch-size`` 16 sequences of 128 tokens (the recipe's global batch at W = 2).

1. ``polar``: a torch-NS run (seed 0) stops at steps ``--capture`` and hands every hidden matrix's
   Newton–Schulz input (the Nesterov update) to each method. For each: ``|O - U V^T|_F / |U V^T|_F``
   against the exact polar factor (float64 SVD of the input ``G = U S V^T``), and over the spectrum:
   ``d_i = u_i^T O v_i`` (what the method made of singular value ``s_i``; 1 is exact) averaged as
   ``|d_i - 1|`` in bands of ``s_i / s_max``, and the part of ``O`` outside ``U diag(d) V^T`` (rounding,
   not the polynomial). ``exact ...`` rows: the same polynomial in float64 (what the coefficients give
   with no rounding).
2. ``loss``: every method trains ``--steps`` steps from the same init and batches, for each of 3 seeds:
   the held-out loss at the end (the first ``--eval-batches`` batches of the held-out split) and the
   mean training loss of the last 10 steps; mean, min and max over seeds and the paired difference to
   torch NS per seed.

    python benchmarks/orthogonalize_quality.py          # -> benchmarks/results/orthogonalize_quality.{json,md}
    python benchmarks/orthogonalize_quality.py --quick  # -> runs/bench-quick/ (6 steps, 1 seed)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))  # model.py imports `config`

from _out import ROOT, out_dir  # noqa: E402
from config import load_config  # noqa: E402  (recipes/config.py)
from data import TokenWindows, Sampler, build_tokenizer, load_tokens, val_batches  # noqa: E402  (recipes/data.py)
from model import build_model  # noqa: E402  (recipes/model.py)

from fsdp_optim.optimizers import Muon  # noqa: E402
from fsdp_optim.optimizers._orthogonalize import POLAR_EXPRESS, gram_newton_schulz, newton_schulz, schedule  # noqa: E402

METHODS = {
    "torch NS": {},
    "Polar Express": dict(coefficients="polar_express"),
    "Gram NS fp16": dict(orthogonalize="gram_newton_schulz"),
    "Gram NS bf16": dict(orthogonalize="gram_newton_schulz", gram_dtype=torch.bfloat16),
    "Gram + PE fp16": dict(orthogonalize="gram_newton_schulz", coefficients="polar_express"),
    "Gram + PE bf16": dict(orthogonalize="gram_newton_schulz", coefficients="polar_express", gram_dtype=torch.bfloat16),
}
TORCH = schedule((3.4445, -4.7750, 2.0315))
BANDS = ((1e-1, 1.0), (1e-2, 1e-1), (1e-3, 1e-2), (0.0, 1e-3))


def orthogonalize(method: str, g: torch.Tensor) -> torch.Tensor:
    """What ``Muon(**METHODS[method])`` applies to one matrix's update."""
    kw = METHODS[method]
    coeffs = POLAR_EXPRESS if kw.get("coefficients") == "polar_express" else TORCH
    if kw.get("orthogonalize") == "gram_newton_schulz":
        return gram_newton_schulz(g, coefficients=coeffs, dtype=kw.get("gram_dtype", torch.float16))
    return newton_schulz(g, coefficients=coeffs)


def exact_polynomial(g: torch.Tensor, coeffs) -> torch.Tensor:
    x = g.double()
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / (x.norm() + 1e-7)
    for a, b, c in coeffs:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def setup(seed: int):
    cfg = load_config(ROOT / "recipes" / "configs" / "tiny.toml")
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    cfg.model.vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    data = TokenWindows(load_tokens(cfg.data.path, tokenizer), cfg.data.seq_len, cfg.data.val_fraction)
    torch.manual_seed(seed)
    model = build_model(cfg.model)
    return cfg, data, model


def make_optimizer(model, cfg, kw: dict) -> tuple[Muon, torch.optim.lr_scheduler.LambdaLR]:
    named = list(model.named_parameters())
    wd = cfg.optim.weight_decay
    groups = [
        {"params": [(n, p) for n, p in named if p.ndim >= 2], "weight_decay": wd, "adamw_weight_decay": wd},
        {"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0, "adamw_weight_decay": 0.0},
    ]
    opt = Muon(groups, lr=0.02, momentum=cfg.optim.momentum, adamw_lr=3e-3, adamw_betas=cfg.optim.betas,
               adamw_eps=cfg.optim.eps, **kw)  # fmt: skip
    t = cfg.train

    def factor(step: int) -> float:  # the recipe's schedule (recipes/pretrain.py)
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train(args, seed: int, kw: dict, capture: tuple[int, ...] = ()) -> dict:
    """``args.steps`` steps of the recipe's model; ``capture``: steps at which every hidden matrix's
    Newton–Schulz input is kept (the Nesterov update, as Muon computes it)."""
    cfg, data, model = setup(seed)
    cfg.train.steps = args.steps
    opt, sched = make_optimizer(model, cfg, kw)
    sampler = Sampler(data, args.batch_size, 0, 1, seed)
    losses, captured = [], {}
    for step in range(args.steps):
        x, y = sampler.next()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        if step in capture:
            for g in opt.param_groups:
                if not g["use_muon"]:
                    continue
                for name, p in zip(g["param_names"], g["params"]):
                    buf = opt.state[p]["momentum_buffer"].lerp(p.grad, 1 - g["momentum"])
                    captured[f"{step}:{name}"] = p.grad.lerp(buf, g["momentum"]).detach().clone()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        held = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                for x, y in val_batches(data, args.batch_size, 0, 1, args.eval_batches)]  # fmt: skip
    return {"held_out_loss": statistics.fmean(held), "train_loss_last10": statistics.fmean(losses[-10:]),
            "captured": captured, "muon_params": [n for g in opt.param_groups if g["use_muon"] for n in g["param_names"]]}  # fmt: skip


def polar_distances(updates: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    names = [*METHODS, "exact torch polynomial", "exact PE polynomial"]
    per: dict[str, dict[str, list[float]]] = {m: {} for m in names}
    for g in updates.values():
        u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
        polar = u @ vh
        rel_s = s / s[0]
        for m in names:
            if m.startswith("exact"):
                o = exact_polynomial(g, TORCH if "torch" in m else POLAR_EXPRESS)
            else:
                o = orthogonalize(m, g).double()
            d = torch.einsum("ij,ik,kj->j", u, o, vh.mT)  # u_i^T O v_i
            rec = per[m]
            rec.setdefault("rel_frobenius", []).append(((o - polar).norm() / polar.norm()).item())
            rec.setdefault("off_spectrum", []).append(((o - u @ torch.diag(d) @ vh).norm() / polar.norm()).item())
            for lo, hi in BANDS:
                sel = (rel_s >= lo) & (rel_s <= hi) if hi == 1.0 else (rel_s >= lo) & (rel_s < hi)
                if sel.any():
                    rec.setdefault(f"band {lo:g}-{hi:g}", []).append((d[sel] - 1).abs().mean().item())
            rec.setdefault("share_of_spectrum_below_1e-3", []).append((rel_s < 1e-3).float().mean().item())
    for m in names:
        row = {"method": m, "matrices": len(updates)}
        for k, v in per[m].items():
            row[k] = statistics.median(v)
        row["rel_frobenius_max"] = max(per[m]["rel_frobenius"])
        rows.append(row)
    return rows


def markdown(res: dict) -> str:
    lines = [f"# Orthogonalization quality on the recipe's model (`{res['command']}`)", "",
             f"{res['platform']}, torch {res['torch']}; {res['config']['steps']} steps, batch {res['config']['batch_size']} x 128 "
             f"tokens, 1 thread. Distance to the polar factor: {res['polar'][0]['matrices']} hidden-matrix updates "
             f"(steps {res['config']['capture']} of a torch-NS run, seed 0); medians over them.", "",
             "| method | rel. distance to U V^T (median / max) | mean abs(d_i - 1), s_i/s_max >= 0.1 | 0.01-0.1 | 0.001-0.01 | < 0.001 | off-spectrum (rounding) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["polar"]:
        bands = [r.get(f"band {lo:g}-{hi:g}", float("nan")) for lo, hi in BANDS]
        lines.append(f"| {r['method']} | {r['rel_frobenius']:.3f} / {r['rel_frobenius_max']:.3f} | "
                     + " | ".join(f"{b:.3f}" for b in bands) + f" | {r['off_spectrum']:.4f} |")  # fmt: skip
    lines += ["", f"Loss after {res['config']['steps']} steps, seeds {res['config']['seeds']} (same init and batches per seed):", "",
              "| method | held-out loss mean [min, max] | minus torch NS per seed | train loss (last 10) mean [min, max] |",
              "|---|---|---|---|"]  # fmt: skip
    for m, r in res["loss"].items():
        h, t = r["held_out_loss"], r["train_loss_last10"]
        diff = ", ".join(f"{d:+.4f}" for d in r["held_out_minus_torch_ns"])
        lines.append(f"| {m} | {statistics.fmean(h):.4f} [{min(h):.4f}, {max(h):.4f}] | {diff} | "
                     f"{statistics.fmean(t):.4f} [{min(t):.4f}, {max(t):.4f}] |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--capture", type=int, nargs="*", default=[1, 50, 99], help="steps whose updates are measured")
    ap.add_argument("--quick", action="store_true", help="6 steps, 1 seed, batch 4: a smoke run")
    ap.add_argument("--out", default=None, help="output directory")
    args = ap.parse_args(argv)
    folder = out_dir(ap, args)
    if args.quick:
        args.steps, args.seeds, args.batch_size, args.eval_batches, args.capture = 6, [0], 4, 1, [1, 5]
    torch.set_num_threads(1)
    t0 = time.time()
    res: dict = {"command": "python benchmarks/orthogonalize_quality.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
                 "config": {k: v for k, v in vars(args).items() if k != "out"}, "torch": torch.__version__,
                 "platform": platform.platform(), "loss": {}}  # fmt: skip
    runs: dict[str, list[dict]] = {}
    for m, kw in METHODS.items():
        for seed in args.seeds:
            capture = tuple(args.capture) if (m, seed) == ("torch NS", args.seeds[0]) else ()
            runs.setdefault(m, []).append(train(args, seed, kw, capture))
            print(f"[orthogonalize_quality] {m}, seed {seed}: held-out {runs[m][-1]['held_out_loss']:.4f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    first = runs["torch NS"][0]
    res["muon_params"] = first["muon_params"]
    res["polar"] = polar_distances(first["captured"])
    for m in METHODS:
        h = [r["held_out_loss"] for r in runs[m]]
        res["loss"][m] = {"held_out_loss": h, "train_loss_last10": [r["train_loss_last10"] for r in runs[m]],
                          "held_out_minus_torch_ns": [a - r["held_out_loss"] for a, r in zip(h, runs["torch NS"])]}  # fmt: skip
    res["wall_s"] = time.time() - t0
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "orthogonalize_quality.json").write_text(json.dumps(res, indent=1) + "\n")
    (folder / "orthogonalize_quality.md").write_text(markdown(res))
    print(f"[orthogonalize_quality] {res['wall_s']:.0f} s -> {folder / 'orthogonalize_quality.json'}")
    return res


if __name__ == "__main__":
    main()
