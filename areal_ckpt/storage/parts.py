"""An object written part by part from memory: the upload half every object store shares.

A :class:`PartWriter` is a :class:`~areal_ckpt.fsio.FileWriter` that uploads instead of writing
a local file. What :meth:`PartWriter.write` is given is not copied: each part is a list of
views of it (checksummed meanwhile), read by the upload straight from the caller's memory (as
the FileWriter Protocol allows: it stays unchanged until ``close``). Full parts go up on helper
threads, a bounded number at once, and ``write`` waits while that many are in flight, so what
the parts keep alive stays bounded. ``close`` sends the last part and completes the upload, so
the object appears whole or not at all; an object smaller than one part is one request at
``close``. A store supplies the four requests (:meth:`PartWriter._begin`, ``_upload_part``,
``_complete``, ``_put_whole``) and how to give up (``_discard``).
"""

from __future__ import annotations

import bisect
import io
import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import FileRecord, RunningCrc

logger = logging.getLogger(__name__)

PART_BYTES = 64 << 20
PART_WORKERS = 8


class PartWriter:
    """The shared part of every store's object writer (see the module docstring). Errors are
    the store's (CheckpointError / TransientError naming the key); after one, or on
    :meth:`abort`, the parts are discarded on the server where the store can. Used by one
    writing thread."""

    def __init__(self, key: str, part_bytes: int = PART_BYTES, workers: int = PART_WORKERS) -> None:
        self._key, self._part_bytes = key, part_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="areal_ckpt-part")
        self._slots = threading.BoundedSemaphore(workers)
        self._parts: list[Future[Any]] = []
        self._views: list[memoryview] = []  # the part being gathered
        self._filled, self._size = 0, 0
        self._crc = RunningCrc(max_pending=4)
        self._started = False

    def write(self, data: memoryview | bytes) -> None:
        """Append ``data`` (kept and read until :meth:`close` returns, never copied); blocks
        while the store's limit of parts is in flight. Raises the first failed part's error."""
        view = memoryview(data).cast("B")
        self._crc.update(view)
        self._size += len(view)
        while view:
            piece = view[: self._part_bytes - self._filled]
            self._views.append(piece)
            self._filled += len(piece)
            view = view[len(piece) :]
            if self._filled == self._part_bytes:
                self._send(self._views)
                self._views, self._filled = [], 0

    def close(self) -> FileRecord:
        """Upload what is left and complete the object; returns its size and CRC-32. Blocking;
        aborts the upload on failure."""
        try:
            if not self._started:
                self._put_whole(self._views)
            else:
                if self._filled:
                    self._send(self._views)
                self._complete([part.result() for part in self._parts])
                self._started = False
            return FileRecord(size=self._size, crc32=self._crc.value())
        except BaseException:
            self.abort()
            raise
        finally:
            self._pool.shutdown(cancel_futures=True)

    def abort(self) -> None:
        """Stop: queued parts cancelled, those in flight waited for, the upload discarded on the
        server where the store can (best effort: the next start removes what is left).
        Idempotent."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        started, self._started = self._started, False
        if started:
            try:
                self._discard()
            except CheckpointError as error:
                logger.warning("%s", error)

    def _send(self, part: list[memoryview]) -> None:
        for done in self._parts:  # fail early: a part that failed stops the writer at its next part
            if done.done() and done.exception() is not None:
                done.result()
        if not self._started:
            self._begin()
            self._started = True
        self._slots.acquire()
        self._parts.append(self._pool.submit(self._upload_released, len(self._parts) + 1, part))

    def _upload_released(self, number: int, views: list[memoryview]) -> Any:
        try:
            return self._upload_part(number, views)
        finally:
            self._slots.release()

    def _begin(self) -> None:
        """Start a multi-part upload of the key (the first full part is ready)."""
        raise NotImplementedError

    def _upload_part(self, number: int, views: list[memoryview]) -> Any:
        """Upload part ``number`` (from 1), the bytes of ``views`` end to end (read through
        :class:`Views`, which a retry may read again); returns what :meth:`_complete` needs of
        it. Runs on a helper thread."""
        raise NotImplementedError

    def _complete(self, parts: list[Any]) -> None:
        """Make the object out of ``parts`` (in order): it appears whole now."""
        raise NotImplementedError

    def _put_whole(self, views: list[memoryview]) -> None:
        """Write the object, the bytes of ``views``, in one request: it was smaller than one
        part."""
        raise NotImplementedError

    def _discard(self) -> None:
        """Drop the unfinished upload's parts on the server."""
        raise NotImplementedError


class Views(io.RawIOBase):
    """A seekable, read-only file over a list of memory views, end to end: the body of one
    part, read (and re-read on a retry) by the HTTP client without first copying it into one
    buffer."""

    def __init__(self, views: list[memoryview]) -> None:
        super().__init__()
        self._views = views
        self._starts = list(itertools.accumulate((len(view) for view in views), initial=0))
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._starts[-1]}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        copied = 0
        index = bisect.bisect_right(self._starts, self._position) - 1
        while copied < len(target) and index < len(self._views):
            view = self._views[index][self._position - self._starts[index] :]
            take = min(len(view), len(target) - copied)
            target[copied : copied + take] = view[:take]
            copied += take
            self._position += take
            index += 1
        return copied
