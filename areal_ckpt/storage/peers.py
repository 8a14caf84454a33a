"""Whole files sent between ranks over the job's process group: the transport of a tiered
trial's local tiers (a node that lacks files of a generation receives them from a node that
holds them; peer copies).

A transfer sends one file, whole, from rank ``source`` to rank ``target`` in
:data:`TRANSFER_CHUNK` messages (:func:`~areal_ckpt.dist.send_bytes`: through the GPU under
NCCL). The sender reads the next message from disk while one crosses; the receiver writes one
while the next arrives (each side into the other of two buffers it reuses for all its
transfers: a fresh buffer per message halves the rate of gloo on loopback), into a new file
beside its place that takes its name only once its size and CRC-32 match what the transfer says
(never through a link), durably: a crash at any instant leaves whole files. Which files go where is the caller's plan; every function here is local to
the pair of ranks a transfer names.
"""

from __future__ import annotations

import os
import secrets
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import (
    ChecksummedWriter,
    FileRecord,
    fsync_dir,
    helper_threads,
    link_on_path,
    open_regular_file,
)

#: Bytes one message of a file transfer carries.
TRANSFER_CHUNK = 64 << 20


@dist.exchanged
@dataclass(frozen=True)
class Transfer:
    """One file of a generation sent whole from rank ``source`` to rank ``target``: into a file
    there, or, ``into_load``, into the load that reads it (:mod:`areal_ckpt.storage.peer_reads`)."""

    name: str
    size: int
    crc32: int
    source: int
    target: int
    into_load: bool = False


def run_transfers(folder: Path, transfers: list[Transfer]) -> int:
    """This rank's share of the transfers, in the global order (so no pair waits on another);
    each one runs to its end even after a failure, keeping its peer in step. Raises the first
    failure once all are done; returns the bytes received."""
    received = 0
    failure: BaseException | None = None
    largest = max((move.size for move in transfers), default=0)
    buffers = [torch.empty(min(TRANSFER_CHUNK, largest), dtype=torch.uint8) for _ in range(2)]
    for move in transfers:
        try:
            if move.source == dist.rank():
                send_file(folder, move, buffers)
            else:
                _receive(folder, move, buffers)
                received += move.size
        except (OSError, CheckpointError) as error:
            failure = failure or error
    if failure is not None:
        raise failure
    return received


def pieces(size: int) -> list[tuple[int, int]]:
    """(offset, length) of each message of a ``size``-byte file."""
    return [(offset, min(TRANSFER_CHUNK, size - offset)) for offset in range(0, size, TRANSFER_CHUNK)]


def send_file(folder: Path, move: Transfer, buffers: list[torch.Tensor]) -> None:
    """Send ``move``'s file in :data:`TRANSFER_CHUNK` messages, the next one read from disk (on
    a helper thread, into the other of the two ``buffers``) while this one is sent; after a
    read error the rest goes as zeros (the receiver's check refuses it) and the error is raised
    at the end. The receiver takes it whole into a file (:func:`run_transfers`) or straight into
    a load (:mod:`areal_ckpt.storage.peer_reads`)."""
    failure: OSError | None = None
    try:
        source: BinaryIO | None = open_regular_file(folder / move.name)
    except OSError as error:
        source, failure = None, error
    parts = pieces(move.size)

    def read(index: int, broken: bool) -> OSError | None:
        piece = buffers[index % 2][: parts[index][1]]
        if source is None or broken:
            piece.zero_()
            return None
        try:
            view = piece.numpy().data.cast("B")
            got = 0
            while got < len(view):
                count = os.preadv(source.fileno(), [view[got:]], parts[index][0] + got)
                if not count:
                    break
                got += count
            view[got:] = bytes(len(view) - got)
            return None
        except OSError as error:
            piece.zero_()
            return error

    reader = helper_threads("transfer-read", 1)
    pending = reader.submit(read, 0, False) if parts else None
    try:
        for index, (_, length) in enumerate(parts):
            assert pending is not None
            failure = failure or pending.result()
            if index + 1 < len(parts):
                pending = reader.submit(read, index + 1, failure is not None)
            dist.send_bytes(buffers[index % 2][:length], move.target)
    finally:
        if pending is not None:
            wait([pending])  # no read left running on a file about to be closed
        if source is not None:
            source.close()
    if failure is not None:
        raise CheckpointError(f"{folder / move.name}: cannot send it to rank {move.target}: {failure}")


def _receive(folder: Path, move: Transfer, buffers: list[torch.Tensor]) -> None:
    """Receive ``move``'s file into a new file beside its place, each message written (on a
    helper thread, from one of the two ``buffers``) while the next one arrives in the other,
    then give it its name (never through a link) once its size and CRC-32 match the manifest;
    durable. After a write error the rest is received and dropped, and the error is raised at
    the end."""
    path = folder / move.name
    link = link_on_path(path, folder)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
    writer: ChecksummedWriter | None = None
    failure: Exception | None = None
    try:
        if link is not None:
            raise CheckpointError(f"{link}: a link in the local tier; not writing through it")
        path.parent.mkdir(parents=True, exist_ok=True)
        writer = ChecksummedWriter(temporary)
    except (OSError, CheckpointError) as error:
        failure = error

    def write(chunk: torch.Tensor) -> OSError | None:
        try:
            assert writer is not None
            writer.write(chunk.numpy().data)
            writer.wait_checksummed()  # its buffer is received into again next but one message
            return None
        except OSError as error:
            return error

    written: Future[OSError | None] | None = None
    for index, (_, length) in enumerate(pieces(move.size)):
        chunk = buffers[index % 2][:length]
        dist.receive_bytes(chunk, move.source)
        if written is not None:
            failure = failure or written.result()
        written = helper_threads("transfer-write", 1).submit(write, chunk) if writer and failure is None else None
    if written is not None:
        failure = failure or written.result()
    if writer is not None and failure is None:
        failure = _finish(writer, temporary, path, FileRecord(move.size, move.crc32))
    elif writer is not None:
        writer.abort()
        temporary.unlink(missing_ok=True)
    if failure is not None:
        raise CheckpointError(f"{path}: cannot receive it from rank {move.source}: {failure}")


def _finish(writer: ChecksummedWriter, temporary: Path, path: Path, expected: FileRecord) -> Exception | None:
    """Close the received file and give it ``path``'s name when it matches ``expected``; else
    remove it and return why."""
    try:
        record = writer.close()
        if record == expected:
            os.replace(temporary, path)
            fsync_dir(path.parent)
            return None
        failure: Exception = CheckpointError(
            f"{record.size} bytes with CRC-32 {record.crc32:#010x} received, "
            f"the manifest lists {expected.size} bytes with {expected.crc32:#010x}"
        )
    except OSError as error:
        failure = error
    temporary.unlink(missing_ok=True)
    return failure
