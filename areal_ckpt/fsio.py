"""Durable file primitives: write-and-fsync, directory fsync, checksums.

Everything here is local to one process and blocking; nothing is collective.
"""

from __future__ import annotations

import collections
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 64 << 20
_crc_pool: tuple[int, ThreadPoolExecutor] | None = None  # (owning pid, pool): a forked child makes its own


def _crc_executor() -> ThreadPoolExecutor:
    global _crc_pool
    if _crc_pool is None or _crc_pool[0] != os.getpid():
        _crc_pool = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="areal_ckpt-crc"))
    return _crc_pool[1]


class RunningCrc:
    """CRC-32 of a byte stream, computed on a helper thread while the caller does I/O.

    zlib releases the GIL while it checksums, so writing (or reading) one piece overlaps with
    checksumming the previous one. Pieces are checksummed in the order given; each must stay
    unchanged until :meth:`value` returns. ``max_pending`` bounds the pieces queued (use it
    when the pieces are fresh buffers rather than views of memory that exists anyway).
    """

    def __init__(self, max_pending: int | None = None) -> None:
        self._value = 0
        self._pending: collections.deque[Future[None]] = collections.deque()
        self._max_pending = max_pending

    def update(self, data: memoryview | bytes) -> None:
        """Queue ``data`` to be checksummed after everything queued before it."""
        if self._max_pending is not None:
            while len(self._pending) >= self._max_pending:
                self._pending.popleft().result()
        self._pending.append(_crc_executor().submit(self._advance, data))

    def _advance(self, data: memoryview | bytes) -> None:
        self._value = zlib.crc32(data, self._value)

    def value(self) -> int:
        """The CRC-32 of everything queued; blocks until it is computed."""
        while self._pending:
            self._pending.popleft().result()
        return self._value


@dataclass(frozen=True)
class FileRecord:
    """Size and CRC-32 of one written file, as stored in a checkpoint manifest."""

    size: int
    crc32: int


class ChecksummedWriter:
    """Binary writer that tracks size and CRC-32 of what it writes and fsyncs on close.

    Durable once :meth:`close` returns (data and file metadata are fsync'd; the directory entry
    is not: fsync the parent directory, as :mod:`areal_ckpt.commit` does before publishing).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size = 0
        self._crc = RunningCrc(max_pending=4)  # bounds what a streamed (freshly made) tensor keeps alive

    def write(self, data: memoryview | bytes) -> None:
        """Write all of ``data`` (looping over short writes); it is checksummed meanwhile on a
        helper thread, so it must not change until :meth:`close` returns."""
        view = memoryview(data).cast("B")
        while view:
            written = os.write(self._fd, view[:_CHUNK])
            self._crc.update(view[:written])  # checksummed while the next piece is written
            view = view[written:]
            self._size += written

    def close(self) -> FileRecord:
        """fsync and close the file; returns its record."""
        try:
            os.fsync(self._fd)
            crc = self._crc.value()
        finally:
            os.close(self._fd)
        return FileRecord(size=self._size, crc32=crc)

    def abort(self) -> None:
        """Close without fsync (the caller discards the file)."""
        os.close(self._fd)


def record_of(path: Path) -> FileRecord:
    """Read ``path`` once and return its size and CRC-32 (blocking, read-only; reading the
    next piece overlaps with checksumming the last)."""
    crc = RunningCrc(max_pending=2)
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(_CHUNK):
            crc.update(chunk)
            size += len(chunk)
    return FileRecord(size=size, crc32=crc.value())


def fsync_file(path: Path) -> None:
    """fsync an existing file's data and metadata (blocking)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory so that entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> FileRecord:
    """Create or truncate ``path`` with ``data`` and fsync it; returns its record."""
    writer = ChecksummedWriter(path)
    try:
        writer.write(data)
    except BaseException:
        writer.abort()
        raise
    return writer.close()
