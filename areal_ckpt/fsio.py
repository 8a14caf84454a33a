"""Durable file primitives: write-and-fsync, directory fsync, checksums.

Everything here is local to one process and blocking; nothing is collective.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 64 << 20


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
        self._crc = 0

    def write(self, data: memoryview | bytes) -> None:
        """Write all of ``data`` (looping over short writes)."""
        view = memoryview(data).cast("B")
        self._crc = zlib.crc32(view, self._crc)
        while view:
            written = os.write(self._fd, view[:_CHUNK])
            view = view[written:]
            self._size += written

    def close(self) -> FileRecord:
        """fsync and close the file; returns its record."""
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
        return FileRecord(size=self._size, crc32=self._crc)

    def abort(self) -> None:
        """Close without fsync (the caller discards the file)."""
        os.close(self._fd)


def record_of(path: Path) -> FileRecord:
    """Read ``path`` once and return its size and CRC-32 (blocking, read-only)."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileRecord(size=size, crc32=crc)


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
