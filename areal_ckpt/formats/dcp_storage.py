"""A DCP storage layer of our own: stock-readable records, JSON metadata, checksums on the fly.

``torch.distributed.checkpoint`` keeps planning, deduplication and resharding; this module only
decides how bytes land. Each rank writes one file ``__{rank}_0.distcp`` holding one
``torch.save`` record per tensor chunk (:mod:`areal_ckpt.formats.torch_record`: a small zip
head, the chunk's raw little-endian bytes, a small zip tail), then the records of non-tensor
entries meant for stock readers only, with the CRC-32 computed on a helper thread while writing.
Rank 0 writes ``dcp_metadata.json`` (which chunk's raw bytes lie at which offset) and DCP's
standard ``.metadata`` (a pickle: which record lies where), so stock ``dcp.load`` and
``dcp_to_torch_save`` read the folder too. Our reader reads only the JSON and the raw bytes,
never a pickle: it fills the destination tensors straight from the file (one copy, none when no
resharding is needed), reading the small record frames between them into scratch buffers so
that the file's CRC-32 is checked against the manifest in the same pass.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_metadata import (
    METADATA_JSON,
    STOCK_METADATA,
    metadata_to_json,
    read_metadata_json,
    tensor_entries,
    tensor_entry,
)
from areal_ckpt.formats.dcp_slices import INDEX_JSON, chunks_file_for, chunks_to_json, index_to_json
from areal_ckpt.formats.range_read import PeerFiles, RangeReader, open_ranges
from areal_ckpt.formats.torch_record import frame_for
from areal_ckpt.fsio import ChecksummedWriter, FileRecord, FileWriter, record_of, write_file_durably
from areal_ckpt.tensors import tensor_bytes

logger = logging.getLogger(__name__)

_RUN_BYTES = 64 << 20  # one read fills tensors stored back to back up to this size
_RUN_ITEMS = 512  # and at most this many buffers (the kernel takes up to IOV_MAX = 1024)
_FILLER = 64 << 10  # bytes between two read tensors (record frames) read along, not skipped
_TRAILER = 16 << 20  # bytes after the last read tensor read along so the file's CRC-32 is complete


@dist.exchanged
@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one written entry lies in its data file: its whole ``torch.save`` record (what
    stock DCP reads) and, for a tensor chunk, its raw bytes inside that record (what we read)."""

    record: _StorageInfo
    payload: _StorageInfo | None


def data_file_of(rank: int) -> str:
    """The name of ``rank``'s data file."""
    return f"__{rank}_0.distcp"


class RawStorageWriter(StorageWriter):
    """Writes each rank's tensors raw into its own file in ``folder``; metadata as JSON.

    After ``dcp.save`` returns, :attr:`records` maps this rank's files to their size and
    CRC-32: its data file and, when it holds chunks of sharded tensors, its chunk file
    (:mod:`areal_ckpt.formats.dcp_slices`, written locally and fsync'd).
    ``open_writer``, when given, makes the writer of this rank's data file from its path (an
    object uploaded from memory, see :class:`~areal_ckpt.fsio.FileWriter`: no local file is
    written then); by default a local file, fsync'd.
    """

    def __init__(self, folder: Path, open_writer: Callable[[Path], FileWriter] | None = None) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.open_writer = open_writer
        self.records: dict[str, FileRecord] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Nothing to reset: the folder is fixed at construction."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """No per-save set-up is needed."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan as DCP made it."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give plan *i* (rank *i*) its data file."""
        return [dataclasses.replace(plan, storage_data=data_file_of(index)) for index, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's records into its file and fsync it: tensor chunks first, then the
        entries only stock readers read; blocking (the future is done)."""
        file_name = plan.storage_data
        path = self.folder / file_name
        writer = ChecksummedWriter(path) if self.open_writer is None else self.open_writer(path)
        results = []
        chunks: list[tuple[WriteItem, _StorageInfo]] = []
        offset = 0
        ordered = sorted(plan.items, key=lambda item: item.type == WriteItemType.BYTE_IO)
        try:
            for item in ordered:
                if item.type == WriteItemType.BYTE_IO:
                    record = _as_bytes_io(planner.resolve_data(item)).getvalue()  # a torch.save record by DCP
                    writer.write(record)
                    placement = Placement(_StorageInfo(file_name, offset, len(record)), None)
                    results.append(WriteResult(index=item.index, size_in_bytes=len(record), storage_data=placement))
                    offset += len(record)
                    continue
                tensor = _as_tensor(planner.resolve_data(item)).detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                data = tensor_bytes(tensor)
                frame = frame_for(tensor.dtype, tuple(tensor.shape))
                writer.write(frame.head)
                writer.write(data)
                writer.write(frame.tail)
                payload = _StorageInfo(file_name, offset + len(frame.head), len(data))
                placement = Placement(record=_StorageInfo(file_name, offset, frame.length(len(data))), payload=payload)
                chunks.append((item, payload))
                results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data=placement))
                offset += frame.length(len(data))
        except BaseException:
            writer.abort()
            raise
        self.records = {file_name: writer.close()}
        listed = chunks_to_json(chunks)
        if listed is not None:
            name = chunks_file_for(file_name)
            self.records[name] = write_file_durably(self.folder / name, json.dumps(listed).encode())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write ``dcp_metadata.json`` (raw byte positions, tensors only), its
        index ``dcp_index.json`` and the standard ``.metadata`` (record positions, every entry)
        durably."""
        placements = {result.index: result.storage_data for part in results for result in part}
        metadata.storage_data = {index: p.payload for index, p in placements.items() if p.payload is not None}
        ours = metadata_to_json(metadata)
        stock = dataclasses.replace(metadata, storage_data={index: p.record for index, p in placements.items()})
        write_file_durably(self.folder / STOCK_METADATA, pickle.dumps(stock))
        write_file_durably(self.folder / METADATA_JSON, json.dumps(ours).encode())
        write_file_durably(self.folder / INDEX_JSON, json.dumps(index_to_json(metadata)).encode())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any folder path."""
        return True


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


def _as_tensor(data: torch.Tensor | io.BytesIO) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(f"DCP planned bytes ({type(data).__name__}) where a tensor was expected")
    return data


def _as_bytes_io(data: torch.Tensor | io.BytesIO) -> io.BytesIO:
    if not isinstance(data, io.BytesIO):
        raise CheckpointError(f"DCP planned a {type(data).__name__} where a torch.save record was expected")
    return data


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
