"""Data files a restart's load reads as another rank sends them, never written first.

When a node of a tiered trial lacks a data file that exactly one of its ranks reads, the
restart's fill (:func:`~areal_ckpt.tier.nodes.fill_from_peers`) does not write it into the
node's local tier: the file crosses the process group while that rank's load runs, each
message copied from one of two reused buffers into the tensors it fills (:class:`ReceivedFile`,
the :class:`~areal_ckpt.formats.range_read.RangeReader` interface), so the restart neither fills
new page-cache pages with it nor reads it back (what bounded a restart from the copies here,
docs/benchmarks-peer-copies.md). The sender runs :func:`~areal_ckpt.storage.peers.send_file`,
as for a transfer into a file.

Each rank runs its share of these transfers in the plan's order, folder by folder, as the load
reaches them (:meth:`PeerReads.exchange`, from the DCP reader); the ones a load never reached
(a model not loaded, a load that failed before reading) run when it ends
(:meth:`PeerReads.settle`), received and dropped. A received file is checked against the
transfer's size and CRC-32 (the manifest's) once its last message arrived
(:meth:`ReceivedFile.checksum`, which the reader calls before the load completes): a mismatch
fails the load, so the tensors it filled are never used. Nothing here writes a file; with peer
copies, the background copies bring the file back to the node's tier after the load
(:meth:`~areal_ckpt.tier.upload.Uploads.resumed`). Pairwise between the ranks each transfer
names; blocking.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import RunningCrc, helper_threads
from areal_ckpt.storage import peers
from areal_ckpt.storage.peers import Transfer, pieces, send_file
from areal_ckpt.tensors import tensor_bytes

logger = logging.getLogger(__name__)


class ReceivedFile:
    """One file as rank ``move.source`` sends it, read in file order: each message arrives in
    one of two reused ``buffers`` and is copied from there into the tensors a :meth:`fill`
    names; the bytes no fill asks for are received and checksummed all the same."""

    def __init__(self, move: Transfer, buffers: list[torch.Tensor], where: Path) -> None:
        self.covered = 0  # bytes received so far, all checksummed
        self._move = move
        self._where = where
        self._buffers = buffers
        self._pieces = pieces(move.size)
        self._next = 0  # the message to receive next
        self._current: tuple[int, torch.Tensor] | None = None  # (offset, bytes) of the last one
        self._crc = RunningCrc(max_pending=1)  # a buffer is received into again only once checksummed

    def _advance(self) -> tuple[int, torch.Tensor]:
        if self._next >= len(self._pieces):
            raise CheckpointError(f"{self._where}: read past its {self._move.size} bytes")
        offset, length = self._pieces[self._next]
        chunk = self._buffers[self._next % 2][:length]
        dist.receive_bytes(chunk, self._move.source)
        self._crc.update(chunk.numpy().data)
        self._next += 1
        self.covered += length
        self._current = (offset, chunk)
        return self._current

    def fill(self, buffers: list[torch.Tensor], offset: int) -> None:
        """Fill contiguous CPU ``buffers`` with the bytes stored back to back from ``offset``
        (not before the bytes a fill took last), receiving messages as needed."""
        position = offset
        for buffer in buffers:
            view = torch.frombuffer(tensor_bytes(buffer), dtype=torch.uint8) if buffer.numel() else None
            done = 0
            while view is not None and done < view.numel():
                start, chunk = self._current or self._advance()
                if position < start:
                    raise CheckpointError(f"{self._where}: bytes at {position} asked for after those at {start}")
                while position >= start + chunk.numel():
                    start, chunk = self._advance()
                count = min(start + chunk.numel() - position, view.numel() - done)
                view[done : done + count].copy_(chunk[position - start : position - start + count])
                done += count
                position += count

    def checksum(self) -> int:
        """The CRC-32 of the whole file, the messages not received yet received first; raises
        CheckpointError naming the file and its sender when it is not the one the transfer
        (the manifest) lists."""
        self._drain()
        value = self._crc.value()
        if value != self._move.crc32:
            raise CheckpointError(
                f"{self._where}: received from rank {self._move.source} with CRC-32 {value:#010x}, the manifest "
                f"lists {self._move.crc32:#010x}; not used"
            )
        return value

    def close(self) -> None:
        """Receive what is left of the file (so the sender finishes), dropping it."""
        self._drain()
        self._crc.value()

    def _drain(self) -> None:
        while self._next < len(self._pieces):
            self._advance()


class PeerReads:
    """This rank's share of the transfers a restart's load reads as they arrive (sent and
    received), in the plan's order; ``generation``: the folder their names are relative to."""

    def __init__(self, generation: Path, transfers: list[Transfer]) -> None:
        self._generation = generation
        self._pending = list(transfers)
        largest = max((move.size for move in transfers), default=0)
        self._buffers = [torch.empty(min(peers.TRANSFER_CHUNK, largest), dtype=torch.uint8) for _ in range(2)]
        self.received = 0

    def exchange(
        self, folder: Path, reads: Collection[str], read: Callable[[str, ReceivedFile], None]
    ) -> Callable[[], None]:
        """Start this rank's transfers of the data files directly in ``folder``, in the plan's
        order: each file it receives is handed to ``read`` (its name in ``folder``, a
        :class:`ReceivedFile`) when the name is in ``reads``, else received and dropped; each it
        sends is sent. Returns what waits for them all. A rank that only sends in ``folder``
        sends on a helper thread, so its own reads overlap its sends (the plan's order holds
        for sends and receives apart, which keeps every pair in step); one that also receives
        runs them all before returning. Every transfer runs to its end even after a failure
        (its peer waits for it); the first failure is raised once all are done, by the returned
        wait (CheckpointError naming the file)."""
        mine = [move for move in self._pending if (self._generation / move.name).parent == folder]
        self._pending = [move for move in self._pending if move not in mine]
        if mine and all(move.source == dist.rank() for move in mine):
            sending = helper_threads("peer-send", 1).submit(self._run_all, mine, reads, read)
            return lambda: sending.result()
        self._run_all(mine, reads, read)
        return lambda: None

    def _run_all(
        self, moves: list[Transfer], reads: Collection[str], read: Callable[[str, ReceivedFile], None]
    ) -> None:
        failure: Exception | None = None
        for move in moves:
            try:
                self._run(move, reads, read)
            except Exception as error:  # kept for after the rest, which the peers wait for
                failure = failure or error
        if failure is not None:
            raise failure

    def settle(self) -> None:
        """The transfers no load reached (its model not loaded, or the load failed before
        reading): sent, or received and dropped, in the plan's order. Raises the first failure
        once all are done."""
        pending, self._pending = self._pending, []
        self._run_all(pending, (), lambda name, source: None)

    def _run(self, move: Transfer, reads: Collection[str], read: Callable[[str, ReceivedFile], None]) -> None:
        path = self._generation / move.name
        if move.source == dist.rank():
            send_file(self._generation, move, self._buffers)
            return
        source = ReceivedFile(move, self._buffers, path)
        try:
            if path.name in reads:
                read(path.name, source)
        finally:
            source.close()
            self.received += move.size
        if path.name in reads:
            logger.info("%s: received %d bytes from rank %d straight into the load", path, move.size, move.source)
        else:
            logger.info("%s: no load read it; its %d bytes from rank %d were dropped", path, move.size, move.source)
