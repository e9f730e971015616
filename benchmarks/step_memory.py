"""Step memory: fsdp_optim.fully_shard vs PyTorch FSDP2, both with torch.optim.AdamW, measured the same way.

One launch per world size (gloo on CPU, forked), the model of ``bench_fsdp_adamw.py`` (a TinyTransformer,
per-layer buckets plus the root, ``reshard_after_forward=True``), in two precisions: plain fp32, and bf16
compute with fp32 reduction (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``). Each runtime
in turn (the first one alternates; both ran once before, unmeasured, so first-use costs of libraries and
gloo are in the baseline) is built from scratch, takes one step (optimizer state made), then
``--steps`` steps are measured, each after a barrier, a short sleep and ``gc.collect()``:

- ``persistent``: RSS before a measured step minus RSS before the model was built (sharded parameters,
  optimizer state, runtime buffers), the median over the measured steps;
- ``peak``: the peak RSS during a step (``VmHWM``, reset through ``/proc/self/clear_refs`` just before
  the step) minus the same baseline, the median over the measured steps (``peaks_mib`` lists them).

The script pins glibc's mmap threshold at 128 KiB (``mallopt``, what ``MALLOC_MMAP_THRESHOLD_=131072``
does at start-up) before the ranks fork: every allocation of 128 KiB or more is its own mapping, returned to the OS when freed, so RSS follows live
tensor memory, whichever thread frees it. Why not the profiler's allocation events: they miss frees
made on other threads. gloo's worker threads often drop the last reference to a finished collective's
tensors, so a profiler count keeps those buffers "alive" forever, at random, in either runtime (seen
as 24 MiB swings between identical runs; a 6-line check: allocate under ``profile(profile_memory=True)``,
drop the tensor on another thread, and no free event is recorded).

The breakdown beside them is computed from sizes, the same way for both runtimes (RSS cannot be split
by purpose): sharded parameters and their gradients (this rank's elements, FSDP2's dim-0 padding
included), optimizer state (AdamW: two fp32 tensors per parameter), gathered parameters at the busiest
moment (the root's bucket plus two layer buckets, current and prefetched, in the compute dtype), one
layer's flat reduction buffer (reduce dtype), and the rest of the peak (activations, autograd
temporaries, the loss, allocator slack): ``peak - (the others)``.

Live tensor bytes beside RSS: one more step per runtime under a dispatch counter
(``fsdp_optim._testing.LiveBytes``, weak references, so frees on gloo's threads are seen), the
forward+backward and the optimizer step apart, plus the persistent sharded parameters and optimizer
state; gathered buffers grown again in place (``storage.resize_``, both runtimes) are added while
allocated. At each new peak the live storages are split by purpose: gathered parameters, gradients
(sharded and unsharded), reduction buffers, and the rest, by what the runtime's attributes point to,
else by size (FSDP2 keeps its unsharded gradients and reduce-scatter input in locals). The counter
does not see allocations inside a collective (gloo's staging copies) nor DTensor's own temporaries
(FSDP2's optimizer-step temporaries): RSS does.

``--recipe``: the recipe's setting only, bf16 compute, fp32 reduction and per-layer activation
checkpointing (``checkpoint_wrapper`` on every layer before sharding, as torchtitan), W = 4 and 8, in
each of four wrappings (``WRAPS``, the same calls in both runtimes): per-layer calls then the root
(``root``, the default elsewhere), the same with the root resharded after forward (``root_reshard``),
the embedding and head as units of their own (``units``: FSDP2's smallest peak), and torchtitan's
(``torchtitan``: the embedding's own call, ``[norm, output]`` as one unit kept after forward); writes
``step_memory_recipe.json``.

The floor: from the model's output until its gradient arrives (the loss and its backward), the live
bytes that are not the runtime's own (gathered parameters, gradients, reduction buffers), plus the
persistent sharded parameters and optimizer state: AdamW's state, the fp32 logits' temporaries and
the activations saved for backward, the same in both runtimes. No runtime holding the same sharded
parameters and AdamW state can peak under it; ``floor / FSDP2's peak`` is the lowest ratio any
runtime could show, printed beside the measured one.

Where each runtime peaks: ``--trace`` runs one step per runtime with RSS read at every module's
forward pre/post hook and at the start of its backward (a hook on its output's gradient), and prints,
per event, RSS now and the peak since the previous event, both runtimes side by side (rank 0). It
tells *where* each runtime peaks and what is alive then; the peak and ratio above are the measured
figures (the trace's absolute values run a few MiB higher: one step, the hooks' own reads).

    python benchmarks/step_memory.py                   # W = 2 and 4, both precisions
    python benchmarks/step_memory.py --quick           # W = 2, a smaller model; writes runs/bench-quick/
    python benchmarks/step_memory.py --trace           # W = 2, both precisions: the per-event trace
    python benchmarks/step_memory.py --recipe          # bf16 / fp32 reduce / activation checkpointing, W = 4 and 8,
                                                       # four wrappings (--wraps root units: some of them)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _out import RESULTS, SCRATCH, out_dir  # noqa: E402
from bench_fsdp_adamw import _settle  # noqa: E402

import fsdp_optim  # noqa: E402
from fsdp_optim._testing import LiveBytes, run_distributed  # noqa: E402
from tests._models import TinyConfig, TinyTransformer, make_batch  # noqa: E402

MIB = 2**20
PRECISIONS = ("fp32", "bf16_fp32_reduce")


RECIPE = "bf16_fp32_reduce_ac"
"""The recipe's setting (``--recipe``): bf16 compute, fp32 reduction, per-layer activation checkpointing."""

WRAPS = ("root", "root_reshard", "units", "torchtitan")
"""How the model is wrapped, the same calls in both runtimes: ``root``: per-layer calls, then the root
(which holds the embedding, final norm and head, kept gathered from forward to backward: the default of
both); ``root_reshard``: the same with ``reshard_after_forward=True`` on the root (freed after forward,
gathered again for the head's backward); ``units``: the embedding and the head also get calls of
their own (freed after forward, each gathered for its own backward; the norm stays in the root);
``torchtitan``: torchtitan's wrapping, the embedding's own call and ``[norm, output]`` as one unit kept
after forward (``reshard_after_forward=False``: its backward comes first)."""


def _wrapped_name(model, name: str) -> str:
    """``layers.0.x`` -> ``layers.0._checkpoint_wrapped_module.x`` where the layer is wrapped."""
    parts = name.split(".")
    if parts[0] == "layers" and hasattr(model.layers[int(parts[1])], "_checkpoint_wrapped_module"):
        return ".".join([*parts[:2], "_checkpoint_wrapped_module", *parts[2:]])
    return name


def _policies(precision: str):
    if precision == "fp32":
        return None, None
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    ours = fsdp_optim.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return ours, TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build(runtime: str, cfg: TinyConfig, full_sd: dict, precision: str, mesh, wrap: str = "root"):
    ours_mp, torch_mp = _policies(precision)
    root_kw = {"reshard_after_forward": True} if wrap == "root_reshard" else {}
    model = TinyTransformer(cfg)
    if precision == RECIPE:  # per-layer activation checkpointing, applied before sharding (as torchtitan)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
        full_sd = {_wrapped_name(model, k): v for k, v in full_sd.items()}
    units = [*model.layers, *((model.embed, model.output) if wrap == "units" else ())]
    units += [model.embed, [model.norm, model.output]] if wrap == "torchtitan" else []
    unit_kw = {"reshard_after_forward": False} if wrap == "torchtitan" else {}  # (only lists: [norm, output])
    if runtime == "fsdp_optim":
        for unit in units:
            fsdp_optim.fully_shard(unit, mp_policy=ours_mp, **(unit_kw if isinstance(unit, list) else {}))
        fsdp_optim.fully_shard(model, mp_policy=ours_mp, **root_kw)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.data = full_sd[name]  # (a full tensor: each rank keeps its range)
        return model
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh} | ({"mp_policy": torch_mp} if torch_mp is not None else {})
    for unit in units:
        fully_shard(unit, **kw, **(unit_kw if isinstance(unit, list) else {}))
    fully_shard(model, **kw, **root_kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            chunk = full_sd[name].chunk(mesh.size(), dim=0)
            if mesh.get_local_rank() < len(chunk):
                local.copy_(chunk[mesh.get_local_rank()][: local.shape[0]])
    return model


def _breakdown(model, runtime: str, precision: str, peak: int, wrap: str = "root") -> dict:
    """Sizes by purpose (bytes), computed alike for both runtimes (see the module docstring). Gathered
    at the busiest moment: the root's bucket and two layers' (``units``: the two largest units)."""
    compute = 2 if precision != "fp32" else 4
    local = sum(p.to_local().numel() for p in model.parameters()) * 4
    def numel(p):  # global elements (both: a DTensor of the global shape)
        return p.numel()

    root = sum(numel(p) for n, p in model.named_parameters() if not n.startswith("layers."))
    layer = sum(numel(p) for p in model.layers[0].parameters())
    head = max(sum(numel(p) for p in m.parameters()) for m in (model.embed, model.output))
    gathered = root + 2 * layer if wrap not in ("units", "torchtitan") else 2 * max(layer, head)
    out = {
        "sharded_params": local,
        "grads": local,
        "optimizer_state": 2 * local,
        "gathered_params": gathered * compute,
        "reduction_buffers": layer * 4,
    }
    out["activations_and_rest"] = peak - sum(out.values())
    return out


def _storage_key(t) -> int | None:
    if t is None:
        return None
    t = getattr(t, "_local_tensor", t)  # a DTensor: its local tensor
    try:
        s = t.untyped_storage()
    except RuntimeError:
        return None
    return s.data_ptr() if s.nbytes() else None


def _persistent_keys(model, opt) -> tuple[set, set]:
    """Storages alive between steps: sharded parameters, and optimizer state."""
    params = {_storage_key(p) for p in model.parameters()}
    state = {_storage_key(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)}
    return params - {None}, state - {None}


def _gathered_and_grads(model) -> tuple[set, set]:
    """Storages of gathered (unsharded) parameters and of gradients now, in either runtime: the
    parameters the modules show (gathered ones during their forward and backward), the runtime's
    own gathered buffers (prefetched ones too), and every ``.grad`` (sharded and unsharded)."""
    gathered, grads = set(), set()
    tensors = [t for m in model.modules() for t in m._parameters.values() if t is not None]
    for m in model.modules():
        st = getattr(m, "_fsdp_optim_state", None)  # ours: the root's buckets
        rt = getattr(st, "runtime", None)
        for b in getattr(rt, "buckets", ()) or ():
            if b.gathered is not None:
                gathered.add(_storage_key(b.gathered))
            tensors += list(b.unsharded or ()) + list(b.sharded)
        get = getattr(m, "_get_fsdp_state", None)  # FSDP2: each group's all-gather outputs
        pg = getattr(get(), "_fsdp_param_group", None) if get is not None else None
        for fp in getattr(pg, "fsdp_params", ()) or ():
            for t in getattr(fp, "all_gather_outputs", ()) or ():
                gathered.add(_storage_key(t))
            up = getattr(fp, "_unsharded_param", None)
            if up is not None:
                gathered.add(_storage_key(up))
                tensors.append(up)
            tensors.append(fp.sharded_param)
        res = getattr(pg, "_all_gather_result", None)
        if res is not None:
            gathered.add(_storage_key(getattr(res, "all_gather_output", None)))
    for t in tensors:
        grads.add(_storage_key(t.grad))
    return gathered, grads


def _global_shape(p) -> tuple:
    return tuple(p.shape)  # (a DTensor of the global shape in both runtimes)


class _LivePeak(LiveBytes):
    """LiveBytes over one step that, at each new peak, splits what is live by purpose; and, while
    ``phase == "loss"`` (from the model's output to its gradient: the loss and its backward), records
    the largest live total outside the runtime's own bytes (gathered parameters, gradients and
    reduction buffers): with the persistent state, the floor neither runtime can go under."""

    OWN = ("gathered_params", "grads", "reduction_buffers")

    def __init__(self, model, persistent: set) -> None:
        super().__init__()
        self.model, self.persistent, self.at_peak, self._seen = model, persistent, {}, -1
        self.phase, self.loss_rest = None, 0
        # Storages no attribute points to at the peak (FSDP2 keeps its unsharded gradients and its
        # reduce-scatter input in locals) are told by size: one sharding unit's flat reduction buffer
        # (fp32: the root's parameters outside ``layers`` (or the embedding's, the head's, the rest's
        # where they are units of their own), or one layer's), or one parameter's gradient.
        numels = {n: math.prod(_global_shape(p)) for n, p in model.named_parameters()}
        outside = {n: v for n, v in numels.items() if not n.startswith("layers.")}
        units = [sum(outside.values()), *outside.values()]
        units += [sum(v for n, v in outside.items() if not n.startswith(("embed.", "output.")))]
        units += [sum(v for n, v in outside.items() if not n.startswith("embed."))]  # [norm, output]
        units += [sum(v for n, v in numels.items() if n.startswith(f"layers.{i}.")) for i in range(len(model.layers))]
        self.reduce_sizes = {4 * u for u in units}
        self.by_size = True  # off in the optimizer step, whose per-parameter temporaries have those sizes too
        self.grad_sizes = {k * v for v in numels.values() for k in (2, 4)}
        # Gathered buffers made in an earlier step and grown again in place (``storage.resize_``: ours'
        # flat gathered buffers, FSDP2's per-parameter all-gather outputs) are no op's new output, so
        # the counter alone misses them: they are added while their storage is allocated.
        self.regrown = []
        for m in model.modules():
            rt = getattr(getattr(m, "_fsdp_optim_state", None), "runtime", None)
            self.regrown += [b.gathered for b in getattr(rt, "buckets", ()) or () if b.gathered is not None]
            get = getattr(m, "_get_fsdp_state", None)
            pg = getattr(get(), "_fsdp_param_group", None) if get is not None else None
            for fp in getattr(pg, "fsdp_params", ()) or ():
                self.regrown += list(getattr(fp, "all_gather_outputs", ()) or ())

    def _regrown_bytes(self) -> int:
        seen = {}
        for t in self.regrown:
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in self._live:
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def _total(self) -> int:
        return super()._total() + self._regrown_bytes()

    def _split(self) -> dict[str, int]:
        """What is live now (outside the persistent state), by purpose."""
        gathered, grads = _gathered_and_grads(self.model)
        cats = {"gathered_params": self._regrown_bytes(), "grads": 0, "reduction_buffers": 0, "activations_and_rest": 0}
        for key, ref in list(self._live.items()):
            st = ref()
            if st is None or key in self.persistent:
                continue
            n = st.nbytes()
            cat = (
                "grads" if key in grads else "gathered_params" if key in gathered
                else "reduction_buffers" if self.by_size and n in self.reduce_sizes
                else "grads" if self.by_size and n in self.grad_sizes
                else "activations_and_rest"
            )  # fmt: skip
            cats[cat] += n
        return cats

    def _track(self, out, inputs=()) -> None:
        super()._track(out, inputs)
        if self.peak > self._seen:
            self._seen = self.peak
            self.at_peak = self._split()
        if self.phase == "loss":
            cats = self._split()
            self.loss_rest = max(self.loss_rest, sum(v for k, v in cats.items() if k not in self.OWN))


def _rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS since the last reset) of this process in MiB, from /proc."""
    status = open("/proc/self/status").read()
    kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in status.splitlines() if ":" in line)
           if k in ("VmRSS", "VmHWM")}  # fmt: skip
    return kib["VmRSS"] / 1024, kib["VmHWM"] / 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the current RSS (Linux)
        f.write("5")


def _train_step(model, opt, batch) -> None:
    x, y = batch
    F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _traced_step(model, opt, batch, base: float) -> list[tuple[str, float, float]]:
    """One training step with RSS read at every module event: ``(event, RSS now, peak since the
    previous event)`` in MiB above ``base``. The same hooks (and so the same overhead) on both runtimes."""
    events: list[tuple[str, float, float]] = []

    def mark(name: str) -> None:
        now, peak = _rss_mib()
        events.append((name, now - base, peak - base))
        _reset_peak_rss()

    mods = [("embed", model.embed), *((f"layers.{i}", m) for i, m in enumerate(model.layers)),
            ("norm", model.norm), ("output", model.output)]  # fmt: skip
    handles = []
    for name, m in mods:
        def post(_m, _args, out, name=name):
            mark(f"forward done: {name}")
            if torch.is_tensor(out) and out.requires_grad:
                out.register_hook(lambda g, name=name: mark(f"backward of {name}") or None)

        handles.append(m.register_forward_pre_hook(lambda _m, _args, name=name: mark(f"forward of {name}")))
        handles.append(m.register_forward_hook(post))
    x, y = batch
    _reset_peak_rss()
    mark("step start")
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    mark("loss")
    loss.backward()
    mark("end of backward")
    opt.step()
    mark("optimizer step")
    opt.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    return events


def _setup(a):
    """(config, full state dict, mesh, this rank's two batches): the same for every measurement."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    w, r = dist.get_world_size(), dist.get_rank()
    cfg = TinyConfig(vocab_size=a.vocab, dim=a.dim, num_heads=a.heads, num_layers=a.layers, mlp_dim=a.mlp,
                     tie_embeddings=False, frozen=False)  # fmt: skip
    torch.manual_seed(0)
    full_sd = {k: v.detach().clone() for k, v in TinyTransformer(cfg).state_dict().items()}
    mesh = init_device_mesh("cpu", (w,))
    data = [make_batch(batch_size=a.batch * w, seq_len=a.seq, vocab_size=a.vocab, seed=s) for s in range(2)]
    data = [(x[r * a.batch : (r + 1) * a.batch], y[r * a.batch : (r + 1) * a.batch]) for x, y in data]
    return cfg, full_sd, mesh, data


def _run_trace(a):
    cfg, full_sd, mesh, data = _setup(a)
    out = {}
    for precision in PRECISIONS:
        for n, runtime in enumerate(("fsdp_optim", "fsdp2") * 2):  # the first pass of each is a warm-up
            _settle()
            base, _ = _rss_mib()
            model = _build(runtime, cfg, full_sd, precision, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            _train_step(model, opt, data[0])  # optimizer state made
            _settle()
            events = _traced_step(model, opt, data[1], base)
            if n >= 2:
                out[f"{precision}|{runtime}"] = events
            del model, opt
    return out


def _print_trace(trace: dict, w: int) -> None:
    for precision in PRECISIONS:
        ours, peer = trace[f"{precision}|fsdp_optim"], trace[f"{precision}|fsdp2"]
        print(f"\nW={w} {precision}, rank 0: RSS now / peak since the previous event (MiB above the baseline)")
        print(f"{'event':<26} {'fsdp_optim':>17} {'FSDP2':>17}")
        for (name, now, peak), (name2, now2, peak2) in zip(ours, peer):
            assert name == name2, (name, name2)
            print(f"{name:<26} {now:8.1f} /{peak:7.1f} {now2:8.1f} /{peak2:7.1f}")
        top, top2 = max(ours, key=lambda e: e[2]), max(peer, key=lambda e: e[2])
        print(f"{'peak of the step':<26} {top[2]:17.1f} {top2[2]:17.1f}   (ours / FSDP2 {top[2] / top2[2]:.3f}; "
              f"ours just before {top[0]!r}, FSDP2 just before {top2[0]!r})")  # fmt: skip


def _unique_bytes(keys_and_tensors) -> int:
    seen = {}
    for t in keys_and_tensors:
        t = getattr(t, "_local_tensor", t)
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _live_step(model, opt, batch) -> dict:
    """One step under a live-bytes counter: the total peak (the persistent sharded parameters and
    optimizer state, plus the step's largest live total) and, at that moment, its split by purpose."""
    params, state = _persistent_keys(model, opt)
    p_bytes = _unique_bytes(model.parameters())
    s_bytes = _unique_bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.numel())
    const = {"sharded_params": p_bytes, "optimizer_state": s_bytes}
    x, y = batch
    with _LivePeak(model, params | state) as live:
        logits = model(x)
        live.phase = "loss"
        logits.register_hook(lambda g: setattr(live, "phase", "backward"))  # the loss's backward is done
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        del logits  # as in ``_train_step``: nothing else holds the logits
        loss.backward()
        del loss
        fb_peak, fb_at = live.peak, live.at_peak
        live.peak, live._seen, live.by_size = live._total(), -1, False  # the optimizer step's own peak
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"peak": p_bytes + s_bytes + max(fb_peak, live.peak), "floor": p_bytes + s_bytes + live.loss_rest,
            "forward_backward_peak": p_bytes + s_bytes + fb_peak, "at_forward_backward_peak": {**const, **fb_at},
            "optimizer_step_peak": p_bytes + s_bytes + live.peak, "at_optimizer_step_peak": {**const, **live.at_peak}}


def _run(a, settings):
    """Each ``(precision, wrap)`` of ``settings``, both runtimes; keys ``precision|wrap|runtime``."""
    cfg, full_sd, mesh, data = _setup(a)
    for precision, wrap in settings:  # warm-up: first-use costs (libraries, gloo, autograd threads) leave RSS
        for runtime in ("fsdp_optim", "fsdp2"):
            model = _build(runtime, cfg, full_sd, precision, mesh, wrap)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for batch in data:
                _train_step(model, opt, batch)
            del model, opt
    out = {}
    for n, (precision, wrap) in enumerate(settings):
        order = ("fsdp_optim", "fsdp2") if n % 2 == 0 else ("fsdp2", "fsdp_optim")  # neither always first
        for runtime in order:
            _settle()
            base, _ = _rss_mib()
            model = _build(runtime, cfg, full_sd, precision, mesh, wrap)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            before, peaks = [], []
            for i in range(1 + a.steps):
                if i >= 1:
                    _settle()
                    before.append(_rss_mib()[0] - base)
                    _reset_peak_rss()
                _train_step(model, opt, data[i % len(data)])
                if i >= 1:
                    peaks.append(_rss_mib()[1] - base)
            peak = int(statistics.median(peaks) * MIB)
            breakdown = _breakdown(model, runtime, precision, peak, wrap)
            _settle()
            live = _live_step(model, opt, data[0])
            out[(precision, wrap, runtime)] = {
                "persistent": int(statistics.median(before) * MIB), "peak": peak, "peaks_mib": peaks,
                "breakdown": breakdown, "live_peak": live["peak"], "live": live,
            }
            del model, opt
    return {"|".join(k): v for k, v in out.items()}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 else "n/a"


def _pin_mmap_threshold(num_bytes: int = 131072) -> None:
    """glibc ``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, as ``MALLOC_MMAP_THRESHOLD_=131072`` does at
    start-up: every larger allocation is its own mapping, unmapped when freed (forked ranks inherit it)."""
    import ctypes

    if not ctypes.CDLL("libc.so.6").mallopt(-3, num_bytes):  # -3: M_MMAP_THRESHOLD
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: RSS would not follow freed tensors")


def main(argv=None) -> None:
    _pin_mmap_threshold()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="measured steps; the median step is reported")
    ap.add_argument("--quick", action="store_true", help="W = 2, dim 256, 2 layers, 2 measured steps")
    ap.add_argument("--trace", action="store_true",
                    help="per-event RSS of one step, both runtimes (W = the first of --world-sizes)")
    ap.add_argument("--recipe", action="store_true",
                    help="the recipe's setting only (bf16 compute, fp32 reduction, per-layer activation "
                    "checkpointing), W = 4 and 8 unless --world-sizes is given; writes step_memory_recipe.json")
    ap.add_argument("--wraps", nargs="+", choices=WRAPS, default=None,
                    help="how both runtimes wrap the model (default: root; with --recipe: all three)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    recipe_default = a.recipe and a.world_sizes == [2, 4]
    if recipe_default:
        a.world_sizes = [4, 8]
    dest = out_dir(ap, a, keep=("recipe", "world_sizes") if recipe_default else ("recipe",))
    a.wraps = a.wraps or (list(WRAPS) if a.recipe else ["root"])
    if a.quick:
        a.world_sizes, a.dim, a.heads, a.layers, a.mlp, a.vocab, a.steps = [2], 256, 4, 2, 1024, 4096, 2
    if a.trace:
        w = a.world_sizes[0]
        trace = run_distributed(lambda: _run_trace(a), world_size=w, timeout=1800)[0]
        _print_trace(trace, w)
        dest = SCRATCH if dest == RESULTS else dest  # a trace is a diagnosis, not a committed result
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "step_memory_trace.json").write_text(json.dumps({"config": vars(a), "trace": trace}, indent=1))
        print(f"wrote {dest / 'step_memory_trace.json'}")
        return
    settings = [(RECIPE, wrap) for wrap in a.wraps] if a.recipe else [(p, wrap) for p in PRECISIONS for wrap in a.wraps]
    rows = []
    print(f"{'W':>2} {'precision / wrap':<32} {'runtime':<10} {'persist MiB':>11} {'peak MiB':>9}  breakdown of the peak (MiB)")
    for w in a.world_sizes:
        per_rank = run_distributed(lambda: _run(a, settings), world_size=w, timeout=1800)
        for key in per_rank[0]:
            precision, wrap, runtime = key.split("|")
            worst = max(per_rank, key=lambda o: o[key]["peak"])[key]  # the largest rank
            rows.append({"world_size": w, "precision": precision, "wrap": wrap, "runtime": runtime, **worst})
            bd = " ".join(f"{k}={v / MIB:.1f}" for k, v in worst["breakdown"].items())
            print(f"{w:>2} {precision + ' / ' + wrap:<32} {runtime:<10} {worst['persistent'] / MIB:>11.1f} "
                  f"{worst['peak'] / MIB:>9.1f}  {bd}")
            top = max(per_rank, key=lambda o: o[key]["live_peak"])[key]
            rows[-1].update(live_peak=top["live_peak"], live=top["live"])
            for where in ("forward_backward", "optimizer_step"):
                cats = " ".join(f"{k}={v / MIB:.1f}" for k, v in top["live"][f"at_{where}_peak"].items())
                print(f"{'':>2} {'':<32} {'':<10} {'live ' + where[:8]:>20} {top['live'][where + '_peak'] / MIB:>9.1f}  "
                      f"at its peak: {cats}")
        for precision, wrap in settings:
            ours, peer = (next(r for r in rows if (r["world_size"], r["precision"], r["wrap"], r["runtime"])
                               == (w, precision, wrap, rt)) for rt in ("fsdp_optim", "fsdp2"))  # fmt: skip
            floor = min(ours["live"]["floor"], peer["live"]["floor"])
            print(f"   W={w} {precision} / {wrap}: peak ours / FSDP2 = RSS {_ratio(ours['peak'], peer['peak'])}, "
                  f"live bytes {_ratio(ours['live_peak'], peer['live_peak'])} (forward+backward "
                  f"{_ratio(ours['live']['forward_backward_peak'], peer['live']['forward_backward_peak'])}); "
                  f"persistent {_ratio(ours['persistent'], peer['persistent'])}; floor {floor / MIB:.1f} MiB "
                  f"(persistent state + the loss's temporaries and saved activations, held by both): no runtime under "
                  f"{_ratio(floor, peer['live_peak'])} x FSDP2 in live bytes")
    dest.mkdir(parents=True, exist_ok=True)
    name = "step_memory_recipe.json" if a.recipe else "step_memory.json"
    (dest / name).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=1))
    print(f"wrote {dest / name}")


if __name__ == "__main__":
    main()
