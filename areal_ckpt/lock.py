"""One job per trial: an advisory lock that dies with the process that holds it.

Rank 0 of a job takes ``{trial}/.areal_ckpt.lock`` with ``flock`` when a Saver or
RecoverHandler is created and keeps it until ``Saver.finalize()`` / ``RecoverHandler.close()``
or the process exits. The kernel releases it when the
holder dies however it dies (SIGKILL included), so a crashed job never blocks its restart. Within
one process the lock is shared (a Saver and a RecoverHandler on one trial, or a handler made
again after a failed load). ``flock`` is honoured by local filesystems and most network ones;
on a filesystem that ignores it the lock is only as good as that filesystem.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from areal_ckpt.errors import CheckpointError

LOCK_NAME = ".areal_ckpt.lock"

_held: dict[Path, list[int]] = {}  # lock path -> [fd, number of holders in this process]


def acquire_trial_lock(trial: Path) -> None:
    """Take the trial's lock until a matching :func:`release_trial_lock` or the process ends.

    Local, non-blocking; counted within the process. Creates the trial folder if needed.
    Raises CheckpointError naming the holder (pid, host, since when) if another process holds it.
    """
    path = (trial / LOCK_NAME).absolute()
    if path in _held:
        _held[path][1] += 1
        return
    trial.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise CheckpointError(
            f"{trial}: another job is using this trial (lock {path} held by {holder}); two jobs must not "
            "write one trial: stop the other job or use another trial_name"
        ) from None
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    _held[path] = [fd, 1]


def release_trial_lock(trial: Path) -> None:
    """Give back one hold on the trial's lock; the last one unlocks it. Local; no-op if not held."""
    path = (trial / LOCK_NAME).absolute()
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
    entry = _held.get((trial / LOCK_NAME).absolute())
    return None if entry is None else entry[0]
