"""One job per trial: an advisory lock that dies with the process that holds it.

Rank 0 of a job takes ``{trial}/.areal_ckpt.lock`` with ``flock`` when a Saver or
RecoverHandler is created and keeps it until ``Saver.finalize()`` / ``RecoverHandler.close()``
or the process exits. The kernel releases it when the
holder dies however it dies (SIGKILL included), so a crashed job never blocks its restart. Within
one process the lock is shared (a Saver and a RecoverHandler on one trial, or a handler made
again after a failed load).

An asynchronous job's background writers hold the lock too, and the kernel kills them when
their training process dies; that takes a moment (longer if a writer is inside an fsync). A job
restarted within that moment finds the lock held although the recorded holder is dead: when the
holder's pid, on this host, no longer runs, the lock is waited for (up to
:data:`ORPHAN_WAIT_SECONDS`) instead of refused. A live holder is refused at once.

``flock`` is honoured by local filesystems and most network ones; on a filesystem that ignores
it the lock is only as good as that filesystem.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import make_dirs

logger = logging.getLogger(__name__)

LOCK_NAME = ".areal_ckpt.lock"
ORPHAN_WAIT_SECONDS = 120.0  # how long a dead holder's writers may take to exit
_POLL_SECONDS = 0.05

_held: dict[Path, list[int]] = {}  # lock path -> [fd, number of holders in this process]


def _lock_path(trial: Path) -> Path:
    """The lock file of ``trial``, with the trial's own path resolved: two spellings of one trial
    (a symlinked ``fileroot``) share one lock. The lock file itself is never followed."""
    return Path(os.path.realpath(trial)) / LOCK_NAME


def acquire_trial_lock(trial: Path) -> None:
    """Take the trial's lock until a matching :func:`release_trial_lock` or the process ends.

    Local; counted within the process. Creates the trial folder if needed. Non-blocking when
    the lock is free or its recorded holder is alive: raises CheckpointError naming the holder
    (pid, host, since when). Blocks up to :data:`ORPHAN_WAIT_SECONDS` while the recorded
    holder is a dead process of this host (its background writers are still exiting). The lock
    file is opened without following a link and must be a regular file: a link or anything
    else planted under its name is refused by name, never written through. Any OS error
    (read-only or full disk) raises CheckpointError naming the path, and leaves nothing held.
    """
    path = _lock_path(trial)
    if path in _held:
        _held[path][1] += 1
        return
    try:
        make_dirs(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(
                f"{path}: the trial lock is a symbolic link; refusing to write through it "
                "(remove the link; areal_ckpt creates the lock as a regular file)"
            ) from None
        if error.errno == errno.EISDIR:
            raise CheckpointError(
                f"{path}: the trial lock is not a regular file; refusing to use it (remove it)"
            ) from None
        raise CheckpointError(f"{path}: cannot create the trial lock: {error.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: the trial lock is not a regular file; refusing to use it (remove it)")
        if not _try_lock(fd):
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            dead = _holder_is_dead(holder)
            if not (dead and _wait_for_orphans(fd, path, holder)):
                orphans = f"; its process is gone, its writers did not exit within {ORPHAN_WAIT_SECONDS:.0f} s"
                raise CheckpointError(
                    f"{trial}: another job is using this trial (lock {path} held by {holder}"
                    f"{orphans if dead else ''}); two jobs must not write one trial: stop the other job or use "
                    "another trial_name"
                )
        holder_record = {"pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time()}
        os.ftruncate(fd, 0)
        record = json.dumps(holder_record).encode()
        if os.pwrite(fd, record, 0) != len(record):
            raise OSError(errno.EFBIG, "short write (file size limit?)")
    except OSError as error:
        os.close(fd)
        raise CheckpointError(f"{path}: cannot record the trial lock's holder: {error.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    _held[path] = [fd, 1]


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder_is_dead(holder: str) -> bool:
    """True when ``holder`` (the lock file's JSON) names a process of this host that no longer
    runs (gone, or a zombie); False when it runs, cannot be read or is on another host."""
    try:
        record = json.loads(holder)
        pid, host = int(record["pid"]), record["host"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return False
    if host != socket.gethostname():
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")  # the state follows the command name


def _wait_for_orphans(fd: int, path: Path, holder: str) -> bool:
    """Poll for the lock until :data:`ORPHAN_WAIT_SECONDS` pass; True once it is taken."""
    logger.warning(
        "lock %s is held by the writers of a dead job (%s); waiting up to %.0f s for them to exit",
        path,
        holder,
        ORPHAN_WAIT_SECONDS,
    )
    deadline = time.monotonic() + ORPHAN_WAIT_SECONDS
    while time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
        if _try_lock(fd):
            return True
    return False


def release_trial_lock(trial: Path) -> None:
    """Give back one hold on the trial's lock; the last one unlocks it. Local; no-op if not held."""
    path = _lock_path(trial)
    if path not in _held:
        return
    _held[path][1] -= 1
    if _held[path][1] == 0:
        os.close(_held.pop(path)[0])  # closing the descriptor releases the flock


def held_lock_descriptor(trial: Path) -> int | None:
    """The descriptor of the trial's lock if this process holds it, else None; local.

    A child process given a duplicate of it keeps the lock alive as long as it runs (flock
    belongs to the open file, not to a process).
    """
    entry = _held.get(_lock_path(trial))
    return None if entry is None else entry[0]
