"""Run a function on W gloo ranks in forked processes (tests and small benchmarks).

``run_distributed(fn, world_size=W)`` forks W children on localhost, each of which joins a
gloo process group through a ``FileStore`` and calls ``fn()``. It returns the W return
values in rank order. If any rank raises, the others are killed and the first error is
re-raised here with the rank's traceback; if the group does not finish within ``timeout``
seconds, every rank is killed and a ``TimeoutError`` names the ranks still running.
Forking (rather than spawning) keeps the per-group overhead to a few tens of milliseconds,
and lets ``fn`` be a closure.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .sharding import BlockSpec
    from .sharding.plan import RaggedLayout

__all__ = ["run_distributed", "DistributedTestError", "LiveBytes", "emulated_mesh", "make_sharded_param", "random_block_layout", "seeded_tensors", "sharded_grad", "train_steps"]


_ECHOES = ("Connection closed by peer", "Connection reset by peer", "Socket Timeout", "timed out after")


class DistributedTestError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _child(fn: Callable[[], Any], rank: int, world_size: int, store_path: str, conn, backend: str) -> None:
    status, payload = "ok", None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        try:
            payload = fn()
            # No rank may exit while a peer is still connecting or communicating: gloo reports a
            # peer that closed its sockets early as "Connection closed by peer" on the others.
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        status, payload = "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    try:
        data = pickle.dumps((status, payload))
    except Exception as e:  # noqa: BLE001
        data = pickle.dumps(("err", f"rank {rank}: return value is not picklable: {e}"))
    conn.send_bytes(data)
    conn.close()
    os._exit(0)


def run_distributed(
    fn: Callable[[], Any], *, world_size: int, timeout: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """Call ``fn()`` on ``world_size`` forked gloo ranks; return their results in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="fsdp_optim_pg_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs, conns = [], {}
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(fn, rank, world_size, store_path, child_conn, backend), daemon=True)
            p.start()
            child_conn.close()
            procs.append(p)
            conns[parent_conn] = rank
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = dict(conns)
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"distributed test timed out after {timeout:.0f}s on world size {world_size}; "
                        f"ranks still running: {sorted(pending.values())}"
                        + (f"\nfirst error (rank {next(iter(errors))}):\n{next(iter(errors.values()))}" if errors else "")
                    )
                for c in wait(list(pending), timeout=left):
                    rank = pending.pop(c)
                    try:
                        status, payload = pickle.loads(c.recv_bytes())
                    except EOFError:
                        status, payload = "err", f"rank {rank} died without reporting (exit code {procs[rank].exitcode})"
                    if status == "ok":
                        results[rank] = payload
                    else:
                        errors[rank] = payload
                if errors:
                    # A rank failed; the others may be waiting in a collective for it. Give them a
                    # moment to report their own errors, then kill the group.
                    grace = time.monotonic() + 2.0
                    while pending and time.monotonic() < grace:
                        for c in wait(list(pending), timeout=max(0.0, grace - time.monotonic())):
                            rank = pending.pop(c)
                            try:
                                status, payload = pickle.loads(c.recv_bytes())
                            except EOFError:
                                continue
                            (results if status == "ok" else errors)[rank] = payload
                    break
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
            for c in conns:
                c.close()
        if errors:
            # Report the root cause: a rank's own error, not a peer's "connection closed" echo of it.
            first = min(errors, key=lambda r: (any(m in errors[r] for m in _ECHOES), list(errors).index(r)))
            raise DistributedTestError(
                f"rank {first} of {world_size} failed (ranks with errors: {sorted(errors)}):\n{errors[first]}"
            )
        return [results[r] for r in range(world_size)]


def make_sharded_param(
    full: "torch.Tensor",
    *,
    spec: "BlockSpec",
    layout: "RaggedLayout",
    fqn: str = "",
    split: bool = False,
    mesh: Any = None,
    rank: int | None = None,
    local: "torch.Tensor | None" = None,
) -> "torch.nn.Parameter":
    """This rank's piece of ``full`` as a sharded parameter (a ``RaggedDTensor`` laid out by ``layout``
    on ``mesh``, default the world), as ``fully_shard`` would make it (for optimizer tests that need
    no model). Call inside an initialized process group. ``rank``: emulate that rank of
    ``layout.world_size`` in this one process (``emulated_mesh``; for steps that issue no collective).
    ``local``: the tensor to hold as this rank's piece (a view stays a view, as a bucket segment's)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from .sharding import RaggedShard, distribute_ragged

    if rank is not None:
        mesh = emulated_mesh(layout.world_size, rank)
    elif mesh is None:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    from .sharding import RaggedDTensor

    placements = [RaggedShard(layout, spec, split=split)]
    if local is not None:
        p = torch.nn.Parameter(RaggedDTensor.from_local(local, mesh, placements))
        p._local_tensor = local  # (Parameter() took a detached alias: keep the view itself)
    else:
        p = torch.nn.Parameter(distribute_ragged(full.detach(), mesh, placements))
    p._fqn = fqn
    return p


def emulated_mesh(world_size: int, rank: int) -> Any:
    """A 1-D ``DeviceMesh`` of ``world_size`` coordinates on which this process stands at ``rank``, with
    no process group behind it: every rank of a sharded step emulated in one process (a step that
    issues no collective; asking the mesh for its group raises). Built with DeviceMesh's ``_rank``
    argument (torch 2.13; ``tests/test_testing.py`` pins it)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    if not 0 <= rank < world_size:
        raise ValueError(f"emulated_mesh: rank {rank} is not in a world of {world_size}")
    return DeviceMesh("cpu", torch.arange(world_size), _init_backend=False, _rank=rank)


def random_block_layout(shape, world_size: int, seed: int, *, block: int, empty_first: bool = False) -> "RaggedLayout":
    """Random contiguous ranges of ``shape`` over ``world_size`` ranks, cut on multiples of ``block``
    elements (some may be empty; ``empty_first``: rank 0's is empty when there is a cut)."""
    import math
    import random

    from .sharding.plan import RaggedLayout

    rng = random.Random(seed)
    numel = math.prod(shape)
    num_blocks = -(-numel // block)
    cuts = sorted(min(rng.randrange(0, num_blocks + 1) * block, numel) for _ in range(world_size - 1))
    if empty_first and cuts:
        cuts[0] = 0
    return RaggedLayout(tuple(shape), (0, *cuts, numel))


def sharded_grad(p: Any, g: "torch.Tensor") -> "torch.Tensor":
    """The full gradient ``g`` as ``p``'s gradient: ``p``'s own layout for a sharded ``p`` (this rank's
    piece), a copy for a plain one."""
    from .sharding import RaggedDTensor, distribute_ragged

    if isinstance(p, RaggedDTensor):
        return distribute_ragged(g.detach(), p.device_mesh, p.placements)
    return g.detach().clone()


def _grad_like(p: Any, g: "torch.Tensor", layout: Any, rank: int) -> "torch.Tensor":
    """``g`` (a full gradient) as ``p``'s gradient: its piece under ``p``'s layout for a sharded ``p``."""
    from .sharding import RaggedDTensor, distribute_ragged

    if isinstance(p, RaggedDTensor):
        return distribute_ragged(g, p.device_mesh, p.placements)
    return (layout.shard(g, rank) if layout is not None else g).clone()


def seeded_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, "torch.Tensor"]:
    """``{name: torch.randn(shape)}`` from one generator seeded with ``seed`` (test inputs and gradients)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def train_steps(opt: Any, params: list, grads: list[list["torch.Tensor"]], *, scheduler: Any = None, layouts: list | None = None) -> None:
    """For each step's gradients: set every parameter's ``.grad`` (a clone, or this rank's piece under
    ``layouts``), ``opt.step()``, then ``scheduler.step()`` if one is given."""
    rank = 0
    if layouts is not None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    for gs in grads:
        for i, (p, g) in enumerate(zip(params, gs)):
            p.grad = _grad_like(p, g, layouts[i] if layouts is not None else None, rank)
        opt.step()
        if scheduler is not None:
            scheduler.step()


class LiveBytes:
    """Count live tensor bytes (not RSS) while a block runs: ``with LiveBytes() as m: ...; m.peak``.

    A ``TorchDispatchMode`` sees every op's outputs; their storages are tracked through weak
    references, so a storage counts from the op that made it until it is freed, and storages shrunk
    or grown in place (``untyped_storage().resize_``, as FSDP2 frees its gathered parameters) count
    at their current size. Storages made before the block (the model's, say) are not
    counted, even when an op inside it views or writes them: only storages first seen as an op's new
    output are. ``peak`` is the largest total seen after any op;
    ``current`` the total at exit. Collectives write into outputs made by ops, so their buffers are
    counted; allocations made outside torch's dispatcher (a backend's internal staging) are not.
    """

    def __init__(self) -> None:
        self.peak = 0
        self.current = 0
        self._live: dict[int, Any] = {}

    def __enter__(self) -> "LiveBytes":
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer._track(out, (args, kwargs))
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.current = self._total()

    def _track(self, out: Any, inputs: Any = ()) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_leaves

        # Outputs that alias an input (views such as detach(), in-place and out= ops) are not new
        # storages: a storage made before the block must not start counting when an op touches it.
        aliased = set()
        for t in tree_leaves(inputs):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    aliased.add(t.untyped_storage().data_ptr())
                except RuntimeError:
                    pass
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                s = t.untyped_storage()
                key = s.data_ptr() if s.nbytes() else id(s)
            except RuntimeError:  # a wrapper subclass (DTensor): its local tensors' ops are seen too
                continue
            if s.nbytes() and key in aliased and key not in self._live:
                continue
            if key not in self._live or self._live[key]() is None:
                self._live[key] = weakref.ref(s)
        self.peak = max(self.peak, self._total())

    def _total(self) -> int:
        total = 0
        for key, ref in list(self._live.items()):
            s = ref()
            if s is None:
                del self._live[key]
            else:
                total += s.nbytes()
        return total
