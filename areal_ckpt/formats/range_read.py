"""Filling tensors from byte ranges of one file: through the page cache, or around it.

A data file is read in file order, run by run (a run: tensors stored back to back), by one of
two readers with the same interface:

- :class:`DirectRanges` (file not in the page cache, file system accepts ``O_DIRECT``): aligned
  2 MiB blocks are read with ``O_DIRECT`` by four helper threads, eight blocks queued ahead of
  the copy (so four requests stay at the disk while the caller copies), into ten reused
  buffers (20 MiB), and copied once into the tensors. The buffers sit in one mapping the
  kernel is asked to back with transparent huge pages, so a request lands in physically
  contiguous memory and reaches the disk whole rather than split by scattered 4 KiB pages.
  Nothing read this way enters the page cache while the load runs (the measurements behind
  these choices: docs/benchmarks.md, "Reading and capturing state"); after a restart's load,
  :mod:`areal_ckpt.formats.cache_fill` brings the file into the cache in the background, so a
  load right after it reads from memory.
- :class:`BufferedRanges` (otherwise: a warm cache serves it at memory speed): one ``preadv``
  per run straight into the tensors, asking the kernel to read 64 MiB ahead.

Both checksum the bytes stored contiguously from the start of the file while they read, so a
file read whole needs no second pass. Local and blocking; nothing here is collective.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
from collections.abc import Callable, Collection
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats import cache_fill
from areal_ckpt.fsio import RunningCrc, helper_threads
from areal_ckpt.tensors import tensor_bytes

logger = logging.getLogger(__name__)

BLOCK = 2 << 20  # a multiple of 4096: O_DIRECT offsets, lengths and buffers are aligned to it
IN_FLIGHT = 8  # blocks submitted ahead of the copy
READ_THREADS = 4  # threads reading them: requests at the disk at once
_PROBE = 4096
_READ_AHEAD = 64 << 20
_CRC_PENDING = 2  # blocks queued for the checksum; a buffer is reused only once its CRC is done
_HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and 4 KiB-page arm64


class RangeReader(Protocol):
    """Fills tensors from a file in file order; see the module docstring."""

    covered: int  # bytes from the start of the file checksummed so far, without a gap

    def fill(self, buffers: list[torch.Tensor], offset: int) -> None:
        """Fill contiguous CPU ``buffers`` with the bytes stored back to back from ``offset``."""

    def checksum(self) -> int:
        """CRC-32 of the first :attr:`covered` bytes; blocks until computed."""

    def close(self) -> None:
        """Release the file and any buffers; waits for reads in flight."""


class PeerFiles(Protocol):
    """Data files a load receives from other ranks as it reads them instead of reading them
    from disk (:class:`areal_ckpt.storage.peer_reads.PeerReads`)."""

    def exchange(
        self, folder: Path, reads: Collection[str], read: Callable[[str, RangeReader], None]
    ) -> Callable[[], None]:
        """Start this rank's transfers of the data files in ``folder``, in their agreed order:
        each received file named in ``reads`` is handed to ``read`` as a reader of its bytes in
        file order; returns what waits for every transfer to end, which raises CheckpointError
        naming the file when one failed."""


def open_ranges(path: Path, spans: list[tuple[int, int]]) -> RangeReader:
    """A reader for the (offset, length) ``spans`` of ``path`` (sorted, not overlapping), which
    the calls to ``fill`` will ask for in that order: buffered when at least half of the pages
    the spans cover are in the page cache (:func:`_is_cached`) or the file system refuses
    O_DIRECT, else direct. ``spans`` not empty."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _is_cached(fd, spans):
            return BufferedRanges(fd, path)
        direct = _open_direct(path, spans[0][0])
    except BaseException:
        os.close(fd)
        raise
    if direct is None:
        return BufferedRanges(fd, path)
    os.close(fd)
    try:
        return DirectRanges(direct, path, spans)
    except BaseException:  # e.g. no memory for the buffers, which come before any read
        os.close(direct)
        raise


def _is_cached(fd: int, spans: list[tuple[int, int]]) -> bool:
    """Whether at least half of the pages from the first span's start to the last span's end
    are in the page cache: then the cache serves most of the read at memory speed (a load right
    after a load), else the disk does and reading around the cache is faster. Asked of the
    kernel with ``mincore`` over a mapping of the file, which reads and caches nothing (a probe
    read would start read-ahead, so that a cold load left a few cached pages behind); when that
    cannot be asked, a read of the first span's start that may not wait for I/O decides."""
    start, end = spans[0][0] // mmap.PAGESIZE * mmap.PAGESIZE, spans[-1][0] + spans[-1][1]
    fraction = _resident_fraction(fd, start, end - start)
    if fraction is not None:
        return fraction >= 0.5
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return True  # cannot tell: keep the page cache
    try:
        os.preadv(fd, [bytearray(1)], spans[0][0], nowait)
    except BlockingIOError:
        return False
    except OSError:  # the file system does not take the flag
        return True
    return True


def _resident_fraction(fd: int, offset: int, length: int) -> float | None:
    """The fraction of the pages of ``fd`` in [offset, offset + length) that are in the page
    cache (``offset`` page-aligned), or None when the kernel cannot be asked. Reads nothing.
    Linux answers truly only for a file the process owns or may write (else it says every page
    is resident): None for any other."""
    if (
        length <= 0
        or _libc is None
        or not (os.fstat(fd).st_uid == os.geteuid() or os.access(f"/proc/self/fd/{fd}", os.W_OK))
    ):
        return None
    address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if address is None or address == _MAP_FAILED:
        return None
    try:
        pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        residency = ctypes.create_string_buffer(pages)
        if _libc.mincore(ctypes.c_void_p(address), length, residency) != 0:
            return None
        return (pages - residency.raw[:pages].count(0)) / pages
    finally:
        _libc.munmap(ctypes.c_void_p(address), length)


def _load_libc() -> ctypes.CDLL | None:
    """libc with the signatures of mmap, munmap and mincore set; None where it has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load_libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def _open_direct(path: Path, offset: int) -> int | None:
    """An O_DIRECT descriptor of ``path`` after one aligned test read, or None when the file
    system refuses direct I/O."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    probe = mmap.mmap(-1, _PROBE)
    try:
        os.preadv(fd, [probe], offset // _PROBE * _PROBE)
    except OSError:
        os.close(fd)
        return None
    finally:
        probe.close()
    return fd


class BufferedRanges:
    """Reads through the page cache: one ``preadv`` per run (not per tensor) into the tensors
    themselves, the kernel asked to read 64 MiB ahead (a little peak speed traded for
    steadiness; docs/benchmarks.md, "Reading and capturing state")."""

    def __init__(self, fd: int, path: Path) -> None:
        self.covered = 0
        self._fd = fd
        self._path = path
        self._crc = RunningCrc()
        self._prefetched = 0  # the kernel has been asked to read ahead up to here

    def fill(self, buffers: list[torch.Tensor], offset: int) -> None:
        """See :class:`RangeReader`; the buffers are checksummed in place, so they must not
        change until :meth:`checksum` returns."""
        views = [tensor_bytes(buffer) for buffer in buffers]
        end = offset + sum(len(view) for view in views)
        if end + _READ_AHEAD > self._prefetched + _READ_AHEAD // 2:
            start = max(self._prefetched, offset)
            self._prefetched = end + _READ_AHEAD
            os.posix_fadvise(self._fd, start, self._prefetched - start, os.POSIX_FADV_WILLNEED)
        _read_exactly(self._fd, views, offset, self._path)
        for view in views:
            if offset == self.covered:
                self._crc.update(view)
                self.covered += len(view)
            offset += len(view)

    def checksum(self) -> int:
        """See :class:`RangeReader`."""
        return self._crc.value()

    def close(self) -> None:
        """See :class:`RangeReader`."""
        try:
            self._crc.value()
        finally:
            os.close(self._fd)


class DirectRanges:
    """Reads with O_DIRECT, :data:`IN_FLIGHT` blocks ahead of the copy, around the page cache;
    only the blocks that hold a byte of ``spans`` are read, in file order."""

    def __init__(self, fd: int, path: Path, spans: list[tuple[int, int]]) -> None:
        self.covered = 0
        self._fd = fd
        self._path = path
        self._crc = RunningCrc(max_pending=_CRC_PENDING)
        self._slots, self._slot_tensors = _huge_page_slots(IN_FLIGHT + _CRC_PENDING)
        self._blocks: list[int] = []  # offsets of the blocks to read, in file order
        for offset, length in spans:
            if not length:
                continue
            first = offset // BLOCK * BLOCK
            if self._blocks and first <= self._blocks[-1]:
                first = self._blocks[-1] + BLOCK
            self._blocks.extend(range(first, offset + length, BLOCK))
        self._submitted = 0
        self._pending: collections.deque[tuple[int, int, Future[int]]] = collections.deque()
        self._current: tuple[int, int, int] | None = None  # (offset, slot, bytes) being copied from
        while self._submitted < min(IN_FLIGHT, len(self._blocks)):
            self._submit()
        cache_fill.direct_read_opened()

    def fill(self, buffers: list[torch.Tensor], offset: int) -> None:
        """See :class:`RangeReader`."""
        for buffer in buffers:
            destination = buffer.reshape(-1).view(torch.uint8)
            done = 0
            while done < destination.numel():
                start, slot, length = self._block_holding(offset + done)
                inside = offset + done - start
                take = min(destination.numel() - done, length - inside)
                destination[done : done + take].copy_(self._slot_tensors[slot][inside : inside + take])
                done += take
            offset += destination.numel()

    def checksum(self) -> int:
        """See :class:`RangeReader`."""
        return self._crc.value()

    def close(self) -> None:
        """See :class:`RangeReader`."""
        try:
            for _, _, future in self._pending:
                future.exception()
            self._crc.value()
        finally:
            cache_fill.direct_read_closed(self._path, os.fstat(self._fd).st_size)
            os.close(self._fd)
            self._pending.clear()
            self._slot_tensors.clear()

    def _submit(self) -> None:
        offset = self._blocks[self._submitted]
        slot = self._submitted % len(self._slots)
        future = helper_threads("read", READ_THREADS).submit(_read_block, self._fd, self._slots[slot], offset)
        self._pending.append((offset, slot, future))
        self._submitted += 1

    def _block_holding(self, position: int) -> tuple[int, int, int]:
        """(offset, slot, bytes read) of the block holding ``position``, waiting for it."""
        while self._current is None or not self._current[0] <= position < self._current[0] + BLOCK:
            if not self._pending:
                raise CheckpointError(f"{self._path}: read past the announced ranges at byte {position}")
            offset, slot, future = self._pending.popleft()
            try:
                length = future.result()
            except OSError as error:
                raise CheckpointError(f"{self._path}: read failed at byte {offset}: {error}") from None
            self._current = (offset, slot, length)
            if offset == self.covered:
                self._crc.update(self._slots[slot][:length])
                self.covered += length
            else:  # past a gap the checksum goes unused, but queued pieces must finish before
                self._crc.value()  # their buffers are read into again
            if self._submitted < len(self._blocks):
                self._submit()
        if position >= self._current[0] + self._current[2]:
            raise CheckpointError(f"{self._path}: ends early (truncated)")
        return self._current


def _huge_page_slots(count: int) -> tuple[list[memoryview], list[torch.Tensor]]:
    """``count`` buffers of :data:`BLOCK` bytes, back to back from a huge-page boundary of one
    private mapping (page-aligned, as O_DIRECT needs), as views to read into and as tensors to
    copy from. The kernel is asked to back them with transparent huge pages (see the module
    docstring); where it cannot, they stay in 4 KiB pages: slower, same bytes."""
    area = mmap.mmap(-1, count * BLOCK + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            area.madvise(advice, start, count * BLOCK)
        except OSError as error:  # a kernel built without transparent huge pages
            logger.debug("read buffers stay in small pages: %s", error)
    view = memoryview(area)
    bounds = [(start + index * BLOCK, start + (index + 1) * BLOCK) for index in range(count)]
    return [view[low:high] for low, high in bounds], [whole[low:high] for low, high in bounds]


def _read_block(fd: int, slot: memoryview, offset: int) -> int:
    """Read up to one block at ``offset`` into ``slot``; fewer bytes only at the end of the file."""
    done = 0
    while done < BLOCK:
        count = os.preadv(fd, [slot[done:]], offset + done)
        if not count:
            break
        done += count
    return done


def _read_exactly(fd: int, views: list[memoryview], offset: int, path: Path) -> None:
    """Fill ``views`` from the bytes of ``fd`` stored back to back from ``offset``, with as few
    reads as the kernel allows; a short file is reported as truncated."""
    pending = [view.cast("B") for view in views if len(view)]
    while pending:
        count = os.preadv(fd, pending, offset)
        if not count:
            raise CheckpointError(f"{path}: ends early (truncated)")
        offset += count
        while pending and count >= len(pending[0]):
            count -= len(pending.pop(0))
        if count:
            pending[0] = pending[0][count:]
