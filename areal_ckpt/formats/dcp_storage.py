"""A DCP storage layer of our own: stock-readable records, JSON metadata, checksums on the fly.

``torch.distributed.checkpoint`` keeps planning, deduplication and resharding; this module only
decides how bytes land. Each rank writes one file ``__{rank}_0.distcp`` holding one
``torch.save`` record per tensor chunk (:mod:`areal_ckpt.formats.torch_record`: a small zip
head, the chunk's raw little-endian bytes, a small zip tail), then the records of non-tensor
entries meant for stock readers only, with the CRC-32 computed on a helper thread while writing.
Rank 0 writes ``dcp_metadata.json`` (which chunk's raw bytes lie at which offset) and DCP's
standard ``.metadata`` (a pickle: which record lies where), so stock ``dcp.load`` and
``dcp_to_torch_save`` read the folder too. Our reader (:mod:`areal_ckpt.formats.dcp_reader`)
reads only the JSON and the raw bytes, never a pickle.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_metadata import metadata_to_json
from areal_ckpt.formats.dcp_slices import INDEX_JSON, chunks_file_for, chunks_to_json, index_to_json
from areal_ckpt.formats.torch_record import frame_for
from areal_ckpt.fsio import ChecksummedWriter, FileRecord, FileWriter, write_file_durably
from areal_ckpt.paths import METADATA_JSON, STOCK_METADATA, data_file_of
from areal_ckpt.tensors import tensor_bytes


@dist.exchanged
@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one written entry lies in its data file: its whole ``torch.save`` record (what
    stock DCP reads) and, for a tensor chunk, its raw bytes inside that record (what we read)."""

    record: _StorageInfo
    payload: _StorageInfo | None


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


def _as_tensor(data: torch.Tensor | io.BytesIO) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(f"DCP planned bytes ({type(data).__name__}) where a tensor was expected")
    return data


def _as_bytes_io(data: torch.Tensor | io.BytesIO) -> io.BytesIO:
    if not isinstance(data, io.BytesIO):
        raise CheckpointError(f"DCP planned a {type(data).__name__} where a torch.save record was expected")
    return data
