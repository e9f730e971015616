"""The run folder: its checkpoints (saved, found, pruned, resumed from) and what a rerun may do with it.

Checkpoint folders: OUT/checkpoints/step_<digits>/, complete once rank 0 has written the DONE marker
(after every rank's files). Anything else there (a killed save's step_N.tmp, a folder without a
readable marker) is not a checkpoint: never resumed from, counted or pruned.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from _backend import Backend, pick_backend
from _logging import current_rank, read_metrics, summary
from config import Config, to_dict
from data import fingerprint

__all__ = ["DONE", "check_resume_config", "check_resume_data", "check_unfinished", "complete_checkpoints",
           "data_identity", "finished_run", "latest_checkpoint", "prune_checkpoints", "resume_from", "save_checkpoint",
           "write_atomic"]

DONE = "recipe_done.json"
_warned: set[Path] = set()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and ``os.replace``: a reader (or a kill) never
    sees a torn file, only the old one or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def done_step(ckpt: Path) -> int | None:
    """The step in ``ckpt``'s DONE marker; None if there is none, or it is unreadable (warned once)."""
    marker = ckpt / DONE
    if not marker.is_file():
        return None
    try:
        step = json.loads(marker.read_text())["step"]
        if not isinstance(step, int) or f"step_{step:06d}" != ckpt.name:
            raise ValueError(f"it says step {step!r}, not the folder's")
        return step
    except (OSError, ValueError, KeyError, TypeError) as e:
        if marker not in _warned and current_rank() == 0:
            print(f"warning: {marker} is unreadable ({e}); {ckpt.name} counts as incomplete, so the previous "
                  "complete checkpoint (if any) is used", file=sys.stderr, flush=True)
        _warned.add(marker)
        return None


def complete_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the complete checkpoints in ``out``, by step number (step_1000000 after step_999999)."""
    found = []
    for ckpt in (out / "checkpoints").glob("step_*"):
        if re.fullmatch(r"step_\d+", ckpt.name) and ckpt.is_dir() and (step := done_step(ckpt)) is not None:
            found.append((step, ckpt))
    return sorted(found)


def latest_checkpoint(out: Path) -> Path | None:
    done = complete_checkpoints(out)
    return done[-1][1] if done else None


def prune_checkpoints(out: Path, keep: int, saved: Path) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (0: none), never ``saved`` (the one just
    written); anything that is not a complete checkpoint is left alone."""
    for _, old in complete_checkpoints(out)[:-keep]:
        if old != saved:
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(out: Path, step: int, model, optimizer, scheduler, extra: dict, backend: Backend,
                    keep: int) -> None:
    """Save ``OUT/checkpoints/step_<step>`` (every rank), then rank 0 marks it complete and prunes to the
    ``keep`` newest (0: keep all)."""
    path = out / "checkpoints" / f"step_{step:06d}"
    if current_rank() == 0 and path.exists():
        shutil.rmtree(path)  # an incomplete save of this step from a killed run
    dist.barrier()
    backend.save(path, model, optimizer, scheduler, extra)
    dist.barrier()
    if dist.get_rank() == 0:  # the marker that makes this checkpoint "complete" for --resume
        write_atomic(path / DONE, json.dumps({"step": extra["step"]}))
    dist.barrier()
    if current_rank() == 0 and keep > 0:
        prune_checkpoints(out, keep, saved=path)


def resume_from(path: Path, model, optimizer, scheduler, backend: Backend) -> dict:
    """``backend.load``, its failures (a missing or corrupt file, other keys) as one ``ValueError`` line
    that names the checkpoint and the way out (the loads raise on every rank alike)."""
    try:
        return backend.load(path, model, optimizer, scheduler)
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        why = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"cannot resume from checkpoint {path}: {type(e).__name__}: {why}; delete {path / DONE} to resume from "
            "the previous complete checkpoint instead, or use another --out to start afresh"
        ) from None


# ---- what a rerun in the same --out may do --------------------------------------------------------
def finished_run(out: Path, cfg: Config) -> str | None:
    """A report line when ``out`` holds a complete checkpoint at or past ``train.steps`` (nothing to train)."""
    complete = complete_checkpoints(out)
    if not complete:
        return None
    done, ckpt = complete[-1]
    if done < cfg.train.steps:
        return None
    last = next((r for r in reversed(read_metrics(out / "metrics.jsonl")) if r["step"] == done), {})
    return (
        f"[pretrain] {out} already holds a finished run: {summary(last, done)}; checkpoint {ckpt}. "
        f"Nothing to train: --resume --steps N (N > {done}) continues it, --export-hf DIR exports it, another "
        "--out starts afresh."
    )


def check_unfinished(out: Path, cfg: Config, resume: bool) -> None:
    """An unfinished run in ``out`` continues only with ``--resume`` (never overwritten silently)."""
    ckpt = latest_checkpoint(out)
    if ckpt is not None and not resume:
        raise ValueError(
            f"{out} already holds checkpoints (latest {ckpt.name}, train.steps {cfg.train.steps}); pass --resume to "
            "continue, or use another --out"
        )


# What a resume may not change: the model and optimizer settings (the checkpoint holds their state; a
# changed key fails to load, or is silently replaced by the saved value, as the saved param groups
# replace lr, betas and weight decay), the backend (the checkpoint's format), and what a data window is
# (the sampler's saved position counts windows). The rest (steps, batch size, grad_accum, world size,
# the LR schedule, clipping, dtype, logging) may change on resume, and so may [parallel] (parallel.ep
# is a layout: checkpoints save at one (ep, W) and load at any other) and optim.qk_clip_tau (applied
# after each step, no state).
RESUME_FIXED = ("model.", "optim.", "data.", "train.seed", "train.backend")
RESUME_FREE = ("model.moe_aux_loss", "model.meta_init", "model.max_seq_len", "optim.qk_clip_tau")


def _resume_keys(d: dict) -> dict:
    """The RESUME_FIXED values of a ``to_dict`` config, train.backend resolved (``auto`` -> its pick)."""
    flat = {f"{s}.{k}": v for s, sub in d.items() for k, v in sub.items()}
    probe = Config()
    probe.train.backend, probe.optim.name = flat["train.backend"], flat["optim.name"]
    flat["train.backend"] = pick_backend(probe)
    return {k: v for k, v in flat.items() if k.startswith(RESUME_FIXED) and k not in RESUME_FREE}


def check_resume_config(out: Path, cfg: Config) -> None:
    """Refuse to resume the run in ``out`` with other RESUME_FIXED settings than its ``config.json``
    (call after ``load_data``, which resolves model.vocab_size, as the saved config has it)."""
    path = out / "config.json"
    try:
        saved = _resume_keys(json.loads(path.read_text()))
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, AttributeError) as e:
        if current_rank() == 0:
            print(f"warning: {path} is unreadable ({e}); the settings of the run are not compared", file=sys.stderr)
        return
    now = _resume_keys(json.loads(json.dumps(to_dict(cfg))))  # through JSON: tuples compare as the saved lists
    diff = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k, now[k]) != now[k]]
    if diff:
        raise ValueError(
            f"--out {out} holds a run with other settings: {', '.join(diff)}; a resume cannot change them (its "
            "checkpoint and data position depend on them): set them back, or use another --out for a new run"
        )


def data_identity(tokens) -> dict:
    """What identifies the token stream a run trains on: its length and a hash of its content."""
    return {"tokens": int(tokens.size), "fingerprint": fingerprint(tokens)}


def check_resume_data(out: Path, tokens) -> None:
    """Refuse to resume the run in ``out`` on other data than it started with (``OUT/data.json``): a
    file appended to, or rewritten at the same size, would give the saved data position other windows."""
    path = out / "data.json"
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:  # (a run from before data.json)
        return
    except (OSError, ValueError) as e:
        if current_rank() == 0:
            print(f"warning: {path} is unreadable ({e}); the data of the run is not compared", file=sys.stderr)
        return
    now = data_identity(tokens)
    if saved != now:
        what = "its length" if saved.get("tokens") != now["tokens"] else "its content (same length)"
        raise ValueError(
            f"--out {out} holds a run on other data: the token stream of data.path changed in {what} "
            f"({saved.get('tokens')} tokens, fingerprint {saved.get('fingerprint')} -> {now['tokens']} tokens, "
            f"{now['fingerprint']}); a resume would continue at a position in other windows: restore the data, "
            "or use another --out for a new run"
        )
