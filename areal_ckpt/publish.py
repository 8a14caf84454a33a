"""Durable, atomic publication of a staged checkpoint folder, and safe removal of old ones.

The protocol: write every file into a staging folder beside the final name, fsync each file,
write a manifest (sizes + CRC-32) last, fsync the staging folder, then switch it in with one
rename and fsync the parent. A reader therefore sees either no folder or a complete one; a crash
leaves only a staging folder, which :func:`remove_stale` deletes on the next start. Old folders
are renamed to a trash name before deletion so a half-deleted folder is never visible.

All functions are local and blocking; in a multi-rank job exactly one rank calls them for a
given folder, after the others have finished writing (see the Saver).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError, CommitError
from areal_ckpt.fsio import FileRecord, fsync_dir, fsync_file, read_json_file, record_of, write_file_durably

logger = logging.getLogger(__name__)

MANIFEST_FORMAT_VERSION = 1
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def write_manifest(folder: Path, manifest_name: str, records: dict[str, FileRecord], header: dict[str, Any]) -> None:
    """Write ``manifest_name`` into ``folder`` listing every file in it; durable on return.

    ``records`` are files already fsync'd with known checksums (e.g. written by other ranks);
    any other file found in ``folder`` (config, tokenizer) is read, checksummed and fsync'd here.
    """
    complete = dict(records)
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if path.is_file() and relative not in complete and relative != manifest_name:
            complete[relative] = record_of(path)
            fsync_file(path)
    for path in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        fsync_dir(path)
    manifest = {
        **header,
        "manifest_version": MANIFEST_FORMAT_VERSION,
        "created_unix": time.time(),
        "files": {name: {"size": rec.size, "crc32": rec.crc32} for name, rec in sorted(complete.items())},
    }
    write_file_durably(folder / manifest_name, render_manifest(manifest))
    fsync_dir((folder / manifest_name).parent)  # the manifest's own entry (it may sit in a subfolder)
    fsync_dir(folder)


def render_manifest(manifest: dict[str, Any]) -> bytes:
    """The bytes a manifest is stored as: canonical JSON carrying its own CRC-32 (computed with the field set to 0), so a damaged
    manifest is named as such rather than blamed on the file whose entry it garbled."""
    body = {key: value for key, value in manifest.items() if key != "manifest_crc32"}
    draft = json.dumps({**body, "manifest_crc32": 0}, indent=1, sort_keys=True).encode()
    return json.dumps({**body, "manifest_crc32": zlib.crc32(draft)}, indent=1, sort_keys=True).encode()


def _exchange(first: Path, second: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # no exchange on this filesystem
        return False
    raise OSError(error, os.strerror(error), str(first))


def publish(staging: Path, final: Path, trash: Path) -> None:
    """Make the complete folder ``staging`` visible as ``final``; durable on return.

    If ``final`` already exists (the same step saved again) the two are exchanged atomically
    where the filesystem allows, so ``final`` always names a complete folder; elsewhere the old
    one is first renamed to ``trash``. The replaced folder is then deleted.
    """
    parent = final.parent
    try:
        if not final.exists():
            os.rename(staging, final)
        elif _exchange(staging, final):
            remove_folder(staging, trash)
        else:
            if trash.exists():
                shutil.rmtree(trash)
            os.rename(final, trash)
            os.rename(staging, final)
            fsync_dir(parent)
            shutil.rmtree(trash)
        fsync_dir(parent)
    except OSError as error:
        raise CommitError(f"{final}: could not publish staged folder {staging.name}: {error}") from error


def remove_folder(folder: Path, trash: Path) -> None:
    """Delete ``folder`` so that it disappears at once: rename to ``trash``, fsync, then delete."""
    hide_folder(folder, trash)
    shutil.rmtree(trash)


def hide_folder(folder: Path, trash: Path) -> None:
    """Make ``folder`` disappear at once by renaming it to ``trash`` (durable on return); the
    caller deletes ``trash`` later (a crash leaves it for :func:`remove_stale`). Never follows
    a link: a link named ``folder`` or ``trash`` is refused with OSError."""
    if folder.is_symlink():
        raise OSError(errno.ELOOP, f"{folder} is a symbolic link; not deleting through it")
    if trash.is_symlink():
        trash.unlink()
    elif trash.exists():  # left by a crash during an earlier deletion
        shutil.rmtree(trash)
    os.rename(folder, trash)
    fsync_dir(folder.parent)


class TrashCollector:
    """Deletes what a commit superseded on one helper thread, off the caller's path, in the
    order queued; errors are logged, never raised (what is deleted was already superseded).
    Freeing a large file is not free: unlinking a fresh 450 MB file took ~0.3 s here."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="areal_ckpt-trash")
        self._pending: list[concurrent.futures.Future[None]] = []

    def delete(self, folders: Iterable[Path]) -> None:
        """Queue hidden ``folders`` (see :func:`hide_folder`) for deletion; returns at once."""
        self._pending += [self._pool.submit(_delete_logged, folder) for folder in folders]

    def run(self, task: Callable[[], None]) -> None:
        """Queue ``task`` (a deletion that logs its own errors); returns at once."""
        self._pending = [future for future in self._pending if not future.done()]
        self._pending.append(self._pool.submit(task))

    def wait(self) -> None:
        """Block until every queued deletion has finished."""
        pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)

    def close(self) -> None:
        """Finish the queued deletions and stop the thread."""
        self.wait()
        self._pool.shutdown(wait=True)


def _delete_logged(folder: Path) -> None:
    try:
        shutil.rmtree(folder)
    except OSError as error:
        logger.warning("could not delete %s: %s (it is removed at the next start)", folder, error)


def remove_stale(parents: Iterable[Path], prefixes: tuple[str, ...]) -> list[Path]:
    """Delete leftovers (staging / trash folders named with ``prefixes``) inside ``parents``.

    Call only while no other process writes there. Returns what was removed.
    """
    removed = []
    for parent in parents:
        if not parent.is_dir():
            continue
        stale = [e for e in sorted(parent.iterdir()) if e.name.startswith(prefixes) and e.is_dir()]
        for entry in stale:
            if entry.is_symlink():
                entry.unlink()
            else:
                shutil.rmtree(entry)
            removed.append(entry)
        if stale:
            fsync_dir(parent)
    for path in removed:
        logger.warning("removed unfinished checkpoint folder %s (left by an interrupted save)", path)
    return removed


def switch_symlink(pointer: Path, target: str) -> None:
    """Atomically make symlink ``pointer`` point to ``target`` (relative); durable on return.

    A new symlink is created beside it and renamed over it, so readers see the old or the new
    target, never neither. Raises CheckpointError, replacing nothing, when ``pointer`` or the
    temporary name beside it holds anything but a link (a file or folder of someone else's).
    """
    temporary = pointer.with_name(f".{pointer.name}.new")
    if temporary.is_symlink():  # left by an interrupted switch
        temporary.unlink()
    elif temporary.exists():
        raise CheckpointError(f"{temporary}: exists and is not a link areal_ckpt made; not replacing it")
    if pointer.exists() and not pointer.is_symlink():
        raise CheckpointError(f"{pointer}: exists and is not a link areal_ckpt made; not replacing it")
    os.symlink(target, temporary)
    os.rename(temporary, pointer)
    fsync_dir(pointer.parent)


def read_manifest(folder: Path, manifest_name: str) -> dict[str, Any]:
    """Parse a checkpoint manifest; raises CheckpointError naming the file when it is unusable."""
    path = folder / manifest_name
    raw, manifest = read_json_file(path, "manifest", "missing: the checkpoint is incomplete")
    if not isinstance(manifest, dict) or render_manifest(manifest) != raw:
        raise CheckpointError(f"{path}: checksum mismatch (manifest corrupted or edited)")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: manifest has no file list")
    for name, entry in files.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts:
            raise CheckpointError(f"{path}: manifest names a file outside the checkpoint: {name!r}")
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), int) for k in ("size", "crc32")):
            raise CheckpointError(f"{path}: manifest entry for {name!r} is malformed")
    return manifest


def check_files(
    folder: Path, files: dict[str, dict[str, int]], names: Iterable[str], checksum: bool = True
) -> list[str]:
    """Check ``names`` (keys of a manifest's file list) against their size and CRC-32; local.

    Returns one line per problem (missing, not a regular file, wrong size, checksum mismatch),
    each naming the file; an empty list means every named file is intact. With ``checksum``
    False only what needs no reading is checked (the caller checksums while it reads).
    """
    problems = []
    root = folder.resolve()
    for name in names:
        path = folder / name
        expected = files[name]
        if path.is_symlink() or (path.exists() and not path.is_file()):
            problems.append(f"{path}: not a regular file")
            continue
        if path.exists() and not path.resolve().is_relative_to(root):
            problems.append(f"{path}: resolves outside the checkpoint (a folder on its path is a link)")
            continue
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != expected["size"]:
            problems.append(f"{path}: size {size} bytes, manifest says {expected['size']} (truncated or replaced)")
            continue
        if checksum and record_of(path).crc32 != expected["crc32"]:
            problems.append(f"{path}: checksum mismatch (file corrupted)")
    return problems
