"""8-bit AdamW: ours on 256-block-aligned RaggedLayout params vs FSDP2 + torchao.optim.AdamW8bit.

One launch of W (default 2) forked gloo ranks, one model, one data stream. Gradients come from an
unsharded replica (forward/backward on the same batch on every rank, outside any timed region) and
are fed to every side, so all see the same gradients:

- ``fsdp2+torchao``: ``torch.distributed.fsdp.fully_shard`` (Shard(0) row chunks) +
  ``torchao.optim.AdamW8bit`` (compiled step, as shipped);
- ``ours``: our ``AdamW8bit`` (compiled step) on params cut into whole 256-element blocks
  (nearly equal block counts per rank: what the planner's elements(256) spec gives one tensor);
- the reference: unsharded ``torchao.optim.AdamW8bit`` on full replicas (rank 0).

Then, like for like, both sides again on only the tensors both quantize on every rank (on CPU
an 8-bit step costs ~10x an fp32 one, so the whole-model time mostly counts how many tensors each
side quantizes).

Reports per side: optimizer step time (the slowest rank's, median over the steps after
``--warmup``; each step times the two sides in alternating order so a load spike on the shared
machine hits both), per-rank optimizer-state bytes (codes, scales, qmaps, fp32 moments, step), which
tensors got 8-bit state on each rank, and after 5 steps the max-abs distance of every weight to the
unsharded reference, relative to the reference's largest weight.

The model's dims are chosen so every weight torchao quantizes unsharded has a size that is a
multiple of 256 but whose FSDP2 row chunk at W=2 is not (rows = 2 x odd, cols = 384), as with
vocabularies and FFN widths in the wild; ``pos_embeddings`` has a size no W makes a multiple of
256 (torchao keeps it fp32 even unsharded; we quantize its partial last block, so we differ from
the reference there by design).

    python benchmarks/bench_adamw8bit.py     # -> benchmarks/results/bench_adamw8bit.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fsdp_optim._testing import make_sharded_param, run_distributed, sharded_grad  # noqa: E402
from fsdp_optim.optimizers import AdamW8bit  # noqa: E402
from fsdp_optim.sharding.plan import RaggedLayout
from fsdp_optim.sharding import elements  # noqa: E402

warnings.filterwarnings("ignore")
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BLOCK = 256


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.wo(att @ v)
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self, *, vocab: int, dim: int, hidden: int, num_layers: int, max_len: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(num_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) + self.pos_embeddings[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def block_layout(shape: tuple[int, ...], world_size: int) -> RaggedLayout:
    """Whole 256-blocks, nearly equal counts per rank (the last block may be partial)."""
    numel = torch.Size(shape).numel()
    num_blocks = -(-numel // BLOCK)
    base, extra = divmod(num_blocks, world_size)
    bounds, acc = [0], 0
    for r in range(world_size):
        acc += base + (r < extra)
        bounds.append(min(acc * BLOCK, numel))
    return RaggedLayout(tuple(shape), tuple(bounds))


def state_bytes(state: dict) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for v in state.values():
        if isinstance(v, DTensor):
            v = v.to_local()
        if hasattr(v, "codes"):  # torchao OptimState8bit: codes + scale + its own qmap copy
            total += v.codes.nbytes + v.scale.nbytes + v.qmap.nbytes
        elif isinstance(v, torch.Tensor):
            total += v.nbytes
    return total


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _all_ranks(flag: bool) -> list[bool]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, flag)
    return out


def main(args: argparse.Namespace) -> dict:
    cfg = dict(vocab=args.vocab, dim=args.dim, hidden=args.hidden, num_layers=args.layers, max_len=args.seq)

    def fn():
        import torchao.optim as tao
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        rank, world = dist.get_rank(), dist.get_world_size()
        # One compile cache per rank. With a shared one, FSDP2 + torchao crashes here ("'Tensor' object
        # has no attribute 'codes'"): ranks compile the same DTensor step with 8-bit state on one rank
        # and fp32 on the other (pos_embeddings), and one rank loads the other's cached graph.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache_dir, f"rank{rank}")
        torch.manual_seed(0)
        replica = Model(**cfg)
        names = [n for n, _ in replica.named_parameters()]
        init = {n: p.detach().clone() for n, p in replica.named_parameters()}
        num_steps = 5 + args.warmup + args.steps
        grads = []  # same data on every rank
        for t in range(5):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(t))
            replica.zero_grad()
            logits = replica(tokens)
            nn.functional.cross_entropy(logits[:, :-1].reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)).backward()
            grads.append({n: p.grad.detach().clone() for n, p in replica.named_parameters()})

        # -- FSDP2 + torchao
        mesh = init_device_mesh("cpu", (world,))
        fsdp_model = Model(**cfg)
        fsdp_model.load_state_dict(replica.state_dict())
        for layer in fsdp_model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(fsdp_model, mesh=mesh)
        fsdp_params = dict(fsdp_model.named_parameters())
        theirs = tao.AdamW8bit([fsdp_params[n] for n in names], **HP)

        # -- ours
        layouts = {n: block_layout(tuple(init[n].shape), world) for n in names}
        ours_params = {n: make_sharded_param(init[n], spec=elements(BLOCK), layout=layouts[n], fqn=n) for n in names}
        ours = AdamW8bit([ours_params[n] for n in names], **HP, compile=True)

        def feed(t: int) -> None:
            g = grads[t % len(grads)]
            for n in names:
                fsdp_params[n].grad = distribute_tensor(g[n], mesh, [Shard(0)], src_data_rank=None)
                ours_params[n].grad = sharded_grad(ours_params[n], g[n])

        times = {"fsdp2+torchao": [], "ours": []}
        sides = {"fsdp2+torchao": theirs, "ours": ours}
        for t in range(num_steps):
            feed(t)
            order = list(sides) if t % 2 == 0 else list(reversed(sides))
            for side in order:
                dist.barrier()
                t0 = time.perf_counter()
                sides[side].step()
                times[side].append(time.perf_counter() - t0)
            if t == 4:  # after 5 steps: snapshot both sides' full weights
                snap_theirs = {n: fsdp_params[n].full_tensor().clone() for n in names}
                snap_ours = {n: ours_params[n].to_local().clone() for n in names}

        # -- like for like: only the tensors both sides quantize on every rank (fresh optimizers)
        both = [n for n in names if ours.is_quantized(ours_params[n])
                and all(x for x in _all_ranks(hasattr(_local(theirs.state[fsdp_params[n]]["exp_avg"]), "codes")))]
        sides_ll = {
            "fsdp2+torchao": tao.AdamW8bit([fsdp_params[n] for n in both], **HP),
            "ours": AdamW8bit([ours_params[n] for n in both], **HP, compile=True),
        }
        times_ll = {side: [] for side in sides_ll}
        for t in range(args.warmup + args.steps):
            feed(t)
            for side in (list(sides_ll) if t % 2 == 0 else list(reversed(sides_ll))):
                dist.barrier()
                t0 = time.perf_counter()
                sides_ll[side].step()
                times_ll[side].append(time.perf_counter() - t0)

        # -- which tensors got 8-bit state, and per-rank state bytes
        quant = {}
        for n in names:
            st = theirs.state[fsdp_params[n]]["exp_avg"]
            st = st.to_local() if isinstance(st, DTensor) else st
            quant[n] = {
                "numel": init[n].numel(),
                "fsdp2_local_numel": fsdp_params[n].to_local().numel(),
                "fsdp2_torchao_8bit": hasattr(st, "codes"),
                "ours_local_numel": ours_params[n].to_local().numel(),
                "ours_8bit": ours.is_quantized(ours_params[n]),
            }
        bytes_ = {
            "fsdp2+torchao": sum(state_bytes(theirs.state[fsdp_params[n]]) for n in names),
            "ours": sum(state_bytes(ours.state[ours_params[n]]) for n in names),
        }

        ref = None
        if rank == 0:  # unsharded torchao on full replicas, same gradients
            ref_params = {n: nn.Parameter(init[n].clone()) for n in names}
            ref_opt = tao.AdamW8bit([ref_params[n] for n in names], **HP)
            for t in range(5):
                for n in names:
                    ref_params[n].grad = grads[t][n].clone()
                ref_opt.step()
            ref = {
                "params": {n: p.detach() for n, p in ref_params.items()},
                "8bit": {n: hasattr(ref_opt.state[ref_params[n]]["exp_avg"], "codes") for n in names},
                "bytes": sum(state_bytes(ref_opt.state[ref_params[n]]) for n in names),
            }
        return dict(
            times=times,
            times_ll=times_ll,
            both=both,
            bytes=bytes_,
            quant=quant,
            snap_theirs=snap_theirs if rank == 0 else None,
            snap_ours=snap_ours,
            ref=ref,
        )

    out = run_distributed(fn, world_size=args.world_size, timeout=3600)
    names = list(out[0]["quant"])
    ref = out[0]["ref"]
    layouts = {n: block_layout(tuple(ref["params"][n].shape), args.world_size) for n in names}
    warm = 5 + args.warmup

    def median_slowest(side: str) -> float:
        per_step = [max(o["times"][side][t] for o in out) for t in range(warm, warm + args.steps)]
        return statistics.median(per_step)

    tensors = {}
    for n in names:
        r = ref["params"][n]
        scale = r.abs().max().item()
        ours_full = layouts[n].unshard([o["snap_ours"][n] for o in out])
        theirs_full = out[0]["snap_theirs"][n]
        tensors[n] = {
            "shape": list(r.shape),
            "torchao_unsharded_8bit": ref["8bit"][n],
            "fsdp2_torchao_8bit_per_rank": [o["quant"][n]["fsdp2_torchao_8bit"] for o in out],
            "fsdp2_local_numel_per_rank": [o["quant"][n]["fsdp2_local_numel"] for o in out],
            "ours_8bit": out[0]["quant"][n]["ours_8bit"],
            "ours_local_numel_per_rank": [o["quant"][n]["ours_local_numel"] for o in out],
            "dist_fsdp2_torchao": (theirs_full - r).abs().max().item() / scale,
            "dist_ours": (ours_full - r).abs().max().item() / scale,
        }
    times = {side: median_slowest(side) for side in ("fsdp2+torchao", "ours")}
    times_ll = {
        side: statistics.median(max(o["times_ll"][side][t] for o in out) for t in range(args.warmup, args.warmup + args.steps))
        for side in ("fsdp2+torchao", "ours")
    }
    left_fp32 = [n for n, t in tensors.items() if t["torchao_unsharded_8bit"] and not all(t["fsdp2_torchao_8bit_per_rank"])]
    same_rule = [n for n, t in tensors.items() if t["torchao_unsharded_8bit"]]
    result = {
        "config": vars(args) | {"hp": HP, "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count()},
        "step_time_s_median_slowest_rank": times,
        "step_time_ratio_ours_over_fsdp2_torchao": times["ours"] / times["fsdp2+torchao"],
        "like_for_like": {
            "tensors": out[0]["both"],
            "step_time_s_median_slowest_rank": times_ll,
            "ratio_ours_over_fsdp2_torchao": times_ll["ours"] / times_ll["fsdp2+torchao"],
        },
        "state_bytes_per_rank": {side: [o["bytes"][side] for o in out] for side in ("fsdp2+torchao", "ours")},
        "state_bytes_unsharded_torchao": ref["bytes"],
        "torchao_fp32_under_fsdp2_but_8bit_unsharded": left_fp32,
        "max_dist_after_5_steps_where_torchao_quantizes_unsharded": {
            "fsdp2+torchao": max(tensors[n]["dist_fsdp2_torchao"] for n in same_rule),
            "ours": max(tensors[n]["dist_ours"] for n in same_rule),
        },
        "tensors": tensors,
    }
    print_table(result)
    return result


def print_table(res: dict) -> None:
    print(f"\n{'tensor':<28}{'shape':>14}{'ao-full':>9}{'fsdp2+ao':>12}{'ours':>6}{'dist fsdp2+ao':>15}{'dist ours':>11}")
    for n, t in res["tensors"].items():
        fs = "/".join("8" if q else "32" for q in t["fsdp2_torchao_8bit_per_rank"])
        print(
            f"{n:<28}{str(tuple(t['shape'])):>14}{'8' if t['torchao_unsharded_8bit'] else '32':>9}{fs:>12}"
            f"{'8' if t['ours_8bit'] else '32':>6}{t['dist_fsdp2_torchao']:>15.3e}{t['dist_ours']:>11.3e}"
        )
    ts = res["step_time_s_median_slowest_rank"]
    ll = res["like_for_like"]
    print(f"like for like ({len(ll['tensors'])} tensors both quantize on every rank): fsdp2+torchao "
          f"{ll['step_time_s_median_slowest_rank']['fsdp2+torchao'] * 1e3:.2f} ms, ours "
          f"{ll['step_time_s_median_slowest_rank']['ours'] * 1e3:.2f} ms (ours/theirs {ll['ratio_ours_over_fsdp2_torchao']:.2f}x)")
    by = res["state_bytes_per_rank"]
    print(f"\nstep time (median, slowest rank): fsdp2+torchao {ts['fsdp2+torchao'] * 1e3:.2f} ms, "
          f"ours {ts['ours'] * 1e3:.2f} ms (ours/theirs {res['step_time_ratio_ours_over_fsdp2_torchao']:.2f}x)")
    print(f"state bytes per rank: fsdp2+torchao {by['fsdp2+torchao']}, ours {by['ours']} "
          f"(ours/theirs {max(by['ours']) / max(by['fsdp2+torchao']):.3f}x at the largest rank); "
          f"unsharded torchao {res['state_bytes_unsharded_torchao']}")
    print(f"torchao left fp32 under FSDP2 though it quantizes them unsharded: {res['torchao_fp32_under_fsdp2_but_8bit_unsharded']}")
    print(f"max distance to unsharded torchao after 5 steps (tensors torchao quantizes unsharded): "
          f"{res['max_dist_after_5_steps_where_torchao_quantizes_unsharded']}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=5002)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--hidden", type=int, default=1030)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=67)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--cache-dir", default="/tmp/fsdp_optim_bench_adamw8bit_inductor")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_adamw8bit.json"))
    args = ap.parse_args()
    res = main(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
