"""The checkpoint folder on disk: paths, the manifest, what a save may replace, and one atomic publish
(``<path>.tmp`` swapped in for ``path``) shared by ``save_checkpoint`` and ``export_hf``."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "PublishError",
    "explain_write_failure",
    "foreign_entries",
    "free_bytes",
    "lock_save",
    "fsync",
    "normalize",
    "own_file",
    "publish",
    "read_manifest",
    "resolve_path",
    "save_refusal",
    "unlock_save",
    "write_facts",
    "write_manifest",
]

MANIFEST = "fsdp_optim.json"
FORMAT_VERSION = 1


def normalize(path: str | os.PathLike, *, caller: str) -> str:
    """The absolute ``path`` without a trailing separator (``ck/`` is ``ck``), so ``<path>.tmp`` is its sibling."""
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{caller}: path is empty; pass a directory path")
    return os.path.abspath(path)


# [Note: what a save replaces]
# A save replaces the folder at ``path`` as a whole (rename aside, rename ``<path>.tmp`` in, remove the
# old one) and first removes a leftover ``<path>.tmp`` of a crashed save; a crash between the renames
# leaves ``<path>.old``, removed by the next save. Each of the three is only replaced or removed when
# it is absent, empty or holds nothing but the files a save writes: the manifest, DCP's ``.metadata``
# file (and its ``.metadata.tmp`` of a save killed while writing it) and ``__<rank>_<n>.distcp``
# files. Anything else (a user's notes or evaluation results put inside a checkpoint, a folder that
# merely has a ``.metadata`` entry, a subfolder, a symbolic link) is refused on every rank before
# anything is written, naming the entries: a save never deletes what it did not write. The check
# runs again just before the renames, in case entries appeared meanwhile.
_CHECKPOINT_FILE = re.compile(rf"{re.escape(MANIFEST)}|\.metadata(\.tmp)?|__\d+_\d+\.distcp")


def foreign_entries(folder: str, ours: re.Pattern[str], n: int = 5) -> str | None:
    """``folder``'s entries other than plain files named as ``ours`` matches, shown as ``a, b/ and 3 more``
    (a subfolder with a trailing ``/``); ``None`` when there are none (only such files, or empty)."""
    foreign = sorted(
        e.name + ("/" if e.is_dir(follow_symlinks=False) else "")
        for e in os.scandir(folder)
        if not (e.is_file(follow_symlinks=False) and ours.fullmatch(e.name))
    )
    if not foreign:
        return None
    return ", ".join(foreign[:n]) + (f" and {len(foreign) - n} more" if len(foreign) > n else "")


def save_refusal(folder: str, path: str) -> str | None:
    """Why a save to ``path`` may not replace or remove ``folder`` (``None``: it may; see the Note)."""
    if not os.path.lexists(folder):
        return None
    if folder == path:
        if not os.path.isdir(folder):
            return (
                f"save_checkpoint: {path} exists and is not a checkpoint (not a folder); save to a new path or remove it"
            )
        shown = foreign_entries(folder, _CHECKPOINT_FILE)
        if shown is None:
            return None
        return (
            f"save_checkpoint: {path} exists and is not a checkpoint (or files were added to one): it holds entries "
            f"a save did not write ({shown}); a save replaces the whole folder and would delete them, so save to a new "
            "path or move them out (keep notes or evaluation results next to a checkpoint, not inside it)"
        )
    what = f"left by an interrupted save to {path}, which removes it"
    if os.path.islink(folder):
        return (
            f"save_checkpoint: {folder} ({what}) is a symbolic link (to {os.readlink(folder)}); remove or rename "
            "the link, or save to another path"
        )
    if not os.path.isdir(folder):
        return f"save_checkpoint: {folder} ({what}) is not a folder; remove or rename it, or save to another path"
    shown = foreign_entries(folder, _CHECKPOINT_FILE)
    if shown is None:
        return None
    return (
        f"save_checkpoint: {folder} ({what}) holds entries a save did not write ({shown}), which removing it "
        "would delete; move them out or rename the folder, or save to another path"
    )


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def fsync(path: str) -> None:
    """Flush a file's or a directory's (its entries') writes to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve_path(path: str) -> str:
    if os.path.isdir(path):
        return path
    old = path + ".old"
    if os.path.isfile(os.path.join(old, MANIFEST)):
        warnings.warn(f"checkpoint {path} is missing; a save was interrupted while replacing it, loading {old}")
        return old
    raise FileNotFoundError(f"no checkpoint at {path}")


# [Note: a load reads only its own files]
# A checkpoint names the files a load opens in two places: the manifest's checksums and DCP's
# ``.metadata`` (``storage_data[*].relative_path``). Either could point anywhere (``../other/__0_0.distcp``,
# ``/etc/passwd``, a symbolic link out of the folder): a load would then read another checkpoint's
# tensors without a word, or print the size and CRC32 of a file it has no business with. So every
# name is checked before the file is opened: its real path (symbolic links followed) must lie inside
# the checkpoint folder's real path, and every file the metadata names must be listed with a checksum
# in the manifest (when it has checksums). Anything else is refused on every rank (agreed on with the
# load's other checks, before any tensor is read), naming the entry and nothing of the file it points to.
def own_file(folder: str, name: object, *, entry: str) -> str:
    """``folder/name``, refused (``ValueError`` naming ``entry``) unless it resolves, symbolic links
    followed, to a path inside ``folder`` (see [Note: a load reads only its own files])."""
    fix = "a load reads only the checkpoint's own files: restore the checkpoint, or load another one"
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"checkpoint {folder}: {entry} is {name!r}, not a file name; refused ({fix})")
    root = os.path.realpath(folder)
    real = os.path.realpath(os.path.join(folder, name))
    if real == root or os.path.commonpath([root, real]) != root:
        raise ValueError(
            f"checkpoint {folder}: {entry} {name!r} points outside the checkpoint folder; refused before reading "
            f"anything ({fix})"
        )
    return os.path.join(folder, name)


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint folder ``path``, refused unless this fsdp_optim reads its format."""
    mpath = os.path.join(path, MANIFEST)
    if os.path.lexists(mpath):
        own_file(path, MANIFEST, entry="the manifest")
    if not os.path.isfile(mpath):
        raise FileNotFoundError(
            f"{mpath} is missing: {path} is not a complete fsdp_optim checkpoint (save_checkpoint writes it last)"
        )
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the checkpoint manifest {mpath}: {e}") from e
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ValueError(
            f"{mpath}: checkpoint format version {version} was written by a newer fsdp_optim (this one reads "
            f"version {FORMAT_VERSION}); upgrade fsdp_optim to load it"
        )
    if version != FORMAT_VERSION:
        raise ValueError(f"{mpath}: checkpoint format version {version!r} is not {FORMAT_VERSION}")
    return manifest


# [Note: atomic publish]
# ``save_checkpoint`` and ``export_hf`` write everything into ``<path>.tmp``, then ``publish`` swaps it in:
# the refusal check runs again on ``path`` and ``<path>.old`` (entries may have appeared since the
# writes began), the previous folder is renamed to ``<path>.old``, ``<path>.tmp`` to ``path``, the parent
# directory is fsynced (the renames are durable when ``publish`` returns) and ``<path>.old`` is removed.
# If the second rename fails, the previous folder is moved back, so ``path`` is as it was; a crash
# between the renames leaves ``<path>.old``, which ``load_checkpoint`` falls back to. A failed directory
# fsync raises (the new folder is in place but may not survive a crash: the caller says so).
class PublishError(OSError):
    """``publish`` failed; ``left`` says what is on disk when it is not "``path`` unchanged"."""

    def __init__(self, msg: str, *, left: str | None = None) -> None:
        super().__init__(msg)
        self.left = left


def publish(tmp: str, path: str, *, refusal: Callable[[str], str | None]) -> None:
    """Replace the folder ``path`` by ``tmp`` atomically (see [Note: atomic publish]); one process.

    ``refusal(folder)``: why ``folder`` (``path`` or ``<path>.old``) may not be replaced or removed,
    raised as a ``ValueError`` before anything moves (``None``: it may).
    """
    old = path + ".old"
    for folder in (path, old):
        why = refusal(folder)
        if why is not None:
            raise ValueError(why)
    if os.path.lexists(old):
        shutil.rmtree(old)  # (holds our files only: checked above)
    moved = False
    if os.path.lexists(path):
        os.rename(path, old)
        moved = True
    try:
        os.rename(tmp, path)
    except OSError as e:
        if moved:
            try:
                os.rename(old, path)  # put the previous one back
            except OSError as back:
                raise PublishError(
                    f"moving {tmp} to {path} failed: {e}",
                    left=f"the previous one is at {old} (moving it back to {path} failed: {back})",
                ) from e
        raise
    parent = os.path.dirname(path)
    try:
        fsync(parent)
    except OSError as e:
        raise PublishError(
            f"{path} is in place but fsync of its folder {parent} failed ({e}): the rename may not survive a crash",
            left=f"the new one is at {path}" + (f" and the previous one at {old}" if moved else ""),
        ) from e
    shutil.rmtree(old, ignore_errors=True)


def lock_save(path: str) -> int:
    """Hold ``<path>.lock`` (an exclusive ``flock``: the kernel releases it however the process ends) for
    a save to ``path``; refused with a ``ValueError`` while another process holds it. Returns its fd."""
    lock = path + ".lock"
    os.makedirs(os.path.dirname(path), exist_ok=True)  # (a save creates the parent folder)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise ValueError(
            f"save_checkpoint: another save to {path} is in progress ({lock} is locked by another process); "
            "wait for it to finish, or save to another path"
        ) from None
    return fd


def unlock_save(path: str, fd: int) -> None:
    """Release ``lock_save``'s lock and remove the lock file."""
    try:
        os.unlink(path + ".lock")
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)  # (closing releases the flock)


def free_bytes(folder: str) -> int | None:
    """Bytes an unprivileged writer may still use on ``folder``'s file system; None if unknown."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def write_facts(folder: str, free_before: int | None) -> dict[str, Any]:
    """What this rank sees of a failed write into ``folder`` (before it is removed): the largest file there,
    the free bytes before and now, this process's file-size limit (``ulimit -f``; None: unlimited)."""
    import resource

    sizes = []
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        try:
            sizes.append(os.path.getsize(os.path.join(folder, name)))
        except OSError:
            pass
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return {"largest": max(sizes, default=0), "free_before": free_before, "free_after": free_bytes(folder),
            "limit": None if limit == resource.RLIM_INFINITY else limit}


_FULL = 1 << 20
"""A write that stopped short with less than this free on its file system (the writer's buffer) found it full."""


def explain_write_failure(why: str, folder: str, facts: list[dict[str, Any]], *, tensor_bytes: int) -> str:
    """``why`` (the writer's failure as ``Type: message``) in words where a file-size limit or a full file
    system caused it, from every rank's ``write_facts`` (the same words on every rank). torch's zip writer
    reports both causes alike, as a short write without an errno ("[enforce fail at inline_container.cc:...]
    . unexpected pos A vs B"); the facts tell them apart: a file at the limit, or no room left. Anything
    else is returned as it is. ``tensor_bytes``: what the save's tensors take (its files take more)."""
    short = "inline_container" in why and "unexpected pos" in why
    low = why.lower()
    limits = [f["limit"] for f in facts if f["limit"] is not None]
    largest = max(f["largest"] for f in facts)
    if "file too large" in low or (short and limits and largest >= min(limits)):
        return (
            f"file too large: a file reached the file-size limit (ulimit -f) of {min(limits):,} bytes ({why}); raise "
            f"the limit (ulimit -f unlimited) or give the state more ranks (each rank writes its own file; the "
            f"save's tensors take {tensor_bytes:,} bytes in all)"
            if limits
            else f"file too large ({why}): a file outgrew what the file system allows; save elsewhere or use more ranks"
        )
    before = [f["free_before"] for f in facts if f["free_before"] is not None]
    after = [f["free_after"] for f in facts if f["free_after"] is not None]
    if "no space left" in low or (short and after and min(after) < _FULL):
        room = (f"{folder} had {min(before):,} bytes free before the save and {min(after):,} when the write failed, "
                if before and after else f"{folder} is full, ")  # fmt: skip
        return (
            f"no space left on device: {room}for a save whose tensors alone take {tensor_bytes:,} bytes ({why}); free "
            "space there or save elsewhere"
        )
    return why
