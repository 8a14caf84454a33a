"""Filling the page cache in the background with the files a load read around it.

A cold load reads its data files with ``O_DIRECT`` (:mod:`areal_ckpt.formats.range_read`):
faster than through the page cache, and nothing it reads stays cached, so a job that
crash-loops would read the same checkpoint from the disk on every restart. Once a restart's
load has finished on every rank (``load_tensors(..., fill_page_cache=True)``), the files this
process read around the cache are brought into it by one background thread with ``sendfile``
to ``/dev/null``: the kernel reads them ahead into the cache and nothing is copied to this
process (about 0.03 s of CPU per GB measured here), so the next load finds them cached and
reads them at memory speed. The thread is a daemon: a process
that exits does not wait for it.

Reads come first: the fill waits while this process has a read around the cache open. It is
skipped when the files exceed a share of the memory the kernel reports available
(:func:`fill_budget`), so it never pushes a node's working set out of memory; it stops at the
first error (a file gone, a file system without ``sendfile``), which it logs, and never raises:
it is a speed-up, never needed for a correct load. Local to one process, never collective;
nothing here writes or deletes a file.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes sent per call: a read around the cache that opens meanwhile waits at most this long
_SHARE_OF_AVAILABLE = 4  # the files a node's ranks fill may take a quarter of its available memory


@dataclass
class _ProcessState:
    """This process's files read around the cache, not yet filled, and its open direct reads
    (a forked child starts afresh: the parent's threads and reads are not its own)."""

    pid: int
    noted: dict[Path, int] = field(default_factory=dict)  # path -> size
    open_reads: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)
    waiting: threading.Event = field(default_factory=threading.Event)  # set while a fill waits for reads
    fills: queue.Queue[list[Path]] = field(default_factory=queue.Queue)
    worker: threading.Thread | None = None


_state = _ProcessState(os.getpid())


def _current() -> _ProcessState:
    global _state
    if _state.pid != os.getpid():
        _state = _ProcessState(os.getpid())
    return _state


def direct_read_opened() -> None:
    """Record that a read around the page cache started in this process: fills wait for it."""
    state = _current()
    with state.changed:
        state.open_reads += 1


def direct_read_closed(path: Path, size: int) -> None:
    """Record that a read around the page cache of ``path`` (``size`` bytes) ended, and note
    the file for the next :func:`fill_noted`."""
    state = _current()
    with state.changed:
        state.open_reads -= 1
        state.noted[path] = size
        state.changed.notify_all()


def fill_budget() -> int | None:
    """The bytes one process may bring into the page cache: a quarter of the memory the kernel
    reports available (``MemAvailable``) shared by the node's ranks (``LOCAL_WORLD_SIZE``, as
    torchrun sets it; 1 without it or when it is not a number); None where the kernel does not
    say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return available // (_SHARE_OF_AVAILABLE * ranks)


def fill_noted() -> None:
    """Start bringing the files noted since the last call into the page cache, in the
    background; returns at once. Call it when a load has finished (every rank done reading)."""
    state = _current()
    with state.changed:
        noted, state.noted = state.noted, {}
    if not noted:
        return
    total, budget = sum(noted.values()), fill_budget()
    if budget is None or total > budget:
        logger.info(
            "not filling the page cache with the %d file(s) just loaded (%.2f GB): above %s",
            len(noted), total / 1e9, "an unknown memory budget" if budget is None else "the share of available memory",
        )  # fmt: skip
        return
    state.fills.put(sorted(noted))
    if state.worker is None:
        state.worker = threading.Thread(target=_work, args=(state,), name="areal_ckpt-cache-fill", daemon=True)
        state.worker.start()


def forget_noted() -> None:
    """Drop the files noted since the last :func:`fill_noted` (a load that failed)."""
    state = _current()
    with state.changed:
        state.noted.clear()


def wait_for_fills() -> None:
    """Block until every fill started in this process has finished (benchmarks and tests)."""
    _current().fills.join()


def fill_waiting() -> threading.Event:
    """Set while a fill of this process waits for a read around the cache to close."""
    return _current().waiting


def _work(state: _ProcessState) -> None:
    """The fill thread: the fills :func:`fill_noted` started, one after the other."""
    while True:
        paths = state.fills.get()
        try:
            _fill(state, paths)
        finally:
            state.fills.task_done()


def _fill(state: _ProcessState, paths: list[Path]) -> None:
    """Send each of ``paths`` to /dev/null in chunks, waiting before each for the reads around
    the cache in this process to close; stops at the first error, logged."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError as error:
        logger.info("not filling the page cache: %s: %s", os.devnull, error)
        return
    try:
        for path in paths:
            try:
                _fill_file(state, path, null)
            except OSError as error:
                logger.info("stopped filling the page cache at %s: %s", path, error)
                return
        logger.debug("filled the page cache with %d file(s) a load read around it", len(paths))
    finally:
        os.close(null)


def _fill_file(state: _ProcessState, path: Path, null: int) -> None:
    """Send ``path`` to ``null``; what is not a regular file by now (a FIFO put in its place,
    which would block the thread forever) is skipped, logged; opening never blocks."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            logger.info("not filling the page cache with %s: not a regular file", path)
            return
        size, offset = status.st_size, 0
        while offset < size:
            with state.changed:
                while state.open_reads:
                    state.waiting.set()
                    state.changed.wait()
                state.waiting.clear()
            sent = os.sendfile(null, fd, offset, min(_CHUNK, size - offset))
            if not sent:
                return
            offset += sent
    finally:
        os.close(fd)
