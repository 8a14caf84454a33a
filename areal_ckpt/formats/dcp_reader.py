"""The reader of what :mod:`areal_ckpt.formats.dcp_storage` writes: JSON metadata and raw bytes
straight into the destination tensors, never a pickle.

Each data file is read in file order, in runs of tensors stored back to back (one copy, none when
no resharding is needed), the small record frames between them read into scratch buffers so
that the file's CRC-32 is checked against the manifest in the same pass; a file another rank
sends (a restart from the local tiers) is read the same way as it arrives.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_metadata import read_metadata_json, tensor_entries, tensor_entry
from areal_ckpt.formats.range_read import PeerFiles, RangeReader, open_ranges
from areal_ckpt.fsio import FileRecord, record_of

logger = logging.getLogger(__name__)

_RUN_BYTES = 64 << 20  # one read fills tensors stored back to back up to this size
_RUN_ITEMS = 512  # and at most this many buffers (the kernel takes up to IOV_MAX = 1024)
_FILLER = 64 << 10  # bytes between two read tensors (record frames) read along, not skipped
_TRAILER = 16 << 20  # bytes after the last read tensor read along so the file's CRC-32 is complete


class RawStorageReader(StorageReader):
    """Reads what :class:`RawStorageWriter` wrote, straight into the destination tensors.

    Each file is read in file order, in runs of tensors stored back to back (up to 64 MiB and
    512 tensors), by a reader of :mod:`areal_ckpt.formats.range_read`: around the page cache
    with ``O_DIRECT`` when the file is cold, through it when it is warm.

    ``expected`` maps data file names to their manifest records: a file this rank reads whole
    is checked against its CRC-32 while it is read; one read in part is checked with a full
    pass afterwards. Without ``expected`` nothing is checked (the caller verified already).
    ``metadata``, when given, is the folder's metadata already read by the caller.
    ``fetch``, when given, is called with a data file's path before it is opened (a local copy
    of a checkpoint on object storage brings the file down then). ``peers``, when given, sends
    and receives data files of the folder first (a restart from the local tiers): a file
    received is read as it arrives, never from disk, and checked the same way.
    """

    def __init__(
        self,
        folder: Path,
        expected: dict[str, FileRecord] | None = None,
        metadata: Metadata | None = None,
        fetch: Callable[[Path], None] | None = None,
        peers: PeerFiles | None = None,
    ) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.fetch = fetch
        self.peers = peers
        self.expected = expected
        self._given = metadata
        self._metadata: Metadata | None = None
        self._chunk_sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Nothing to reset: the folder is fixed at construction."""

    @property
    def _loaded(self) -> Metadata:
        """The metadata :meth:`set_up_storage_reader` was given (DCP calls it before reading)."""
        if self._metadata is None:
            raise CheckpointError(f"{self.folder}: read before the reader was set up")
        return self._metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The JSON metadata (never a pickle)."""
        return read_metadata_json(self.folder) if self._given is None else self._given

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Index the stored chunks' shapes."""
        self._metadata = metadata
        self._chunk_sizes = {
            (fqn, tuple(chunk.offsets)): tuple(chunk.sizes)
            for fqn, entry in tensor_entries(metadata).items()
            for chunk in entry.chunks
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan as DCP made it."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans as DCP made them."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fill this rank's destination tensors file by file, in file order, the files other
        ranks send first (``peers``); blocking."""
        per_file: dict[str, list[tuple[_StorageInfo, ReadItem]]] = {}
        for item in plan.items:
            info = self._loaded.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append((info, item))
        for items in per_file.values():
            items.sort(key=lambda pair: pair[0].offset)
        sent = (  # receives now, into the reads; sends maybe beside the reads below
            _nothing_sent
            if self.peers is None
            else self.peers.exchange(
                self.folder,
                set(per_file),
                lambda name, source: self._read_file(name, per_file.pop(name), planner, source),
            )
        )
        try:
            for file_name, items in per_file.items():
                self._read_file(file_name, items, planner)
        except Exception:
            try:
                sent()  # the receivers wait for these sends all the same
            except Exception as error:  # the failure of this rank's own read is the one to report
                logger.warning("%s: a file sent to another rank failed too: %s", self.folder, error)
            raise
        sent()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(
        self,
        file_name: str,
        items: list[tuple[_StorageInfo, ReadItem]],
        planner: LoadPlanner,
        received: RangeReader | None = None,
    ) -> None:
        """Fill the tensors of ``items`` from ``file_name`` (from ``received`` when it arrives
        from another rank), then check its CRC-32."""
        path = self.folder / file_name
        if received is None and self.fetch is not None:
            self.fetch(path)
        expected = None if self.expected is None else self.expected.get(file_name)
        segments = _segments(items, None if expected is None else expected.size)
        source = received or open_ranges(path, [(offset, length) for offset, length, _ in segments])
        try:
            for run in _adjacent_runs(segments, path):
                destinations = [
                    (torch.empty(length, dtype=torch.uint8), None)
                    if entry is None
                    else self._destination(entry[0], entry[1], planner, path)
                    for _, length, entry in run
                ]
                source.fill([buffer for buffer, _ in destinations], run[0][0])
                for (_, _, entry), (buffer, target) in zip(run, destinations):
                    if entry is None or target is None:
                        continue
                    item = entry[1]
                    if buffer is not target:
                        target.copy_(_region(buffer, item.storage_offsets, item.lengths))
                    planner.commit_tensor(item, target)
            self._check(path, file_name, source)
        finally:
            source.close()

    def _destination(
        self, info: _StorageInfo, item: ReadItem, planner: LoadPlanner, path: Path
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(buffer to read the stored chunk into, destination): the destination itself when it
        takes the whole chunk as is, else a temporary chunk-shaped buffer."""
        fqn = item.storage_index.fqn
        dtype = tensor_entry(self._loaded, fqn, self.folder).properties.dtype
        sizes = self._chunk_sizes.get((fqn, tuple(item.storage_index.offset or ())))
        if sizes is None:
            raise CheckpointError(f"{path}: no stored chunk of {fqn} at offsets {item.storage_index.offset}")
        numel = 1
        for size in sizes:
            numel *= size
        if numel * dtype.itemsize != info.length:
            raise CheckpointError(f"{path}: {fqn}: {info.length} stored bytes for {list(sizes)} {dtype}")
        target = planner.resolve_tensor(item).detach()
        whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == sizes
        if whole and target.is_contiguous() and target.device.type == "cpu" and target.dtype == dtype:
            return target, target
        return torch.empty(sizes, dtype=dtype), target

    def _check(self, path: Path, file_name: str, source: RangeReader) -> None:
        if self.expected is None:
            return
        expected = self.expected.get(file_name)
        if expected is None:
            raise CheckpointError(f"{path}: not listed in the checkpoint's manifest")
        running = source.checksum()  # a file received from another rank is then covered whole
        actual = running if source.covered == expected.size else record_of(path).crc32
        if actual != expected.crc32:
            raise CheckpointError(f"{path}: checksum mismatch (file corrupted)")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any folder path."""
        return True


def _nothing_sent() -> None:
    """What a read without peers waits for: nothing."""


def _region(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The view of ``tensor`` starting at ``offsets`` with ``lengths`` along each dimension."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


#: A stretch of a data file to read: (offset, length, the tensor it fills or None for a filler).
_Segment = tuple[int, int, "tuple[_StorageInfo, ReadItem] | None"]


def _segments(items: list[tuple[_StorageInfo, ReadItem]], file_size: int | None) -> list[_Segment]:
    """The stretches to read for ``items`` (sorted by offset): each tensor's raw bytes, and as
    fillers the small gaps before and between them (record frames, up to :data:`_FILLER`) and,
    when ``file_size`` is known, the rest of the file up to :data:`_TRAILER`, so that a rank
    reading every tensor of a file reads it whole, in one pass that also checks its CRC-32."""
    segments: list[_Segment] = []
    position = 0
    for info, item in items:
        gap = info.offset - position
        if 0 < gap <= _FILLER:
            segments.append((position, gap, None))
        segments.append((info.offset, info.length, (info, item)))
        position = info.offset + info.length
    if file_size is not None and 0 < file_size - position <= _TRAILER:
        segments.append((position, file_size - position, None))
    return segments


def _adjacent_runs(segments: list[_Segment], path: Path) -> Iterator[list[_Segment]]:
    """``segments`` in runs stored back to back, each at most :data:`_RUN_BYTES` (or one
    segment) and :data:`_RUN_ITEMS` long: one read fills a whole run."""
    run: list[_Segment] = []
    size = 0
    for segment in segments:
        offset, length, entry = segment
        if entry is not None and entry[1].type == LoadItemType.BYTE_IO:
            raise CheckpointError(f"{path}: {entry[1].storage_index.fqn} is not a tensor; refusing to read it")
        follows = bool(run) and run[-1][0] + run[-1][1] == offset
        if run and not (follows and size + length <= _RUN_BYTES and len(run) < _RUN_ITEMS):
            yield run
            run, size = [], 0
        run.append(segment)
        size += length
    if run:
        yield run
