"""Host shared-memory staging of tensors for background writes.

An asynchronous save first copies the state into one shared-memory buffer (the *arena*) and
returns; a background process then writes from the same pages (no second copy, no pickling of
tensor data). The arena is allocated once, grown only when a save needs more room, reused by
every later save and freed with its owner. What a background process needs to find each tensor
in it is a :class:`ArenaLayout`: plain data (offsets, dtypes, shapes, DTensor placements).

On CUDA the arena is registered as pinned memory and copies are issued non-blocking, then
synchronized once; on CPU (no pinned memory) they are plain memory copies.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Placement

from areal_ckpt import agree
from areal_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)

_SHM = "/dev/shm"
_ALIGNMENT = 64  # bytes: every tensor starts on a cache line, so any dtype view is aligned


@dataclass(frozen=True)
class ShardInfo:
    """How a staged local shard becomes a DTensor again: mesh ranks, placements, global shape."""

    mesh: list[Any]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class StagedTensor:
    """Where one tensor lives in the arena."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: ShardInfo | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the arena."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ArenaLayout:
    """Name -> :class:`StagedTensor` for one save, in insertion order; picklable plain data."""

    tensors: dict[str, StagedTensor]

    @property
    def nbytes(self) -> int:
        """Total tensor bytes staged (what the background process will write)."""
        return sum(entry.nbytes for entry in self.tensors.values())

    @property
    def end(self) -> int:
        """Arena bytes the layout spans (with alignment padding)."""
        return max((e.offset + e.nbytes for e in self.tensors.values()), default=0)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _entries(items: Iterable[tuple[str, torch.dtype, tuple[int, ...], ShardInfo | None]]) -> ArenaLayout:
    entries: dict[str, StagedTensor] = {}
    offset = 0
    for name, dtype, shape, shard in items:
        entries[name] = StagedTensor(offset, dtype, shape, shard)
        offset += -(-entries[name].nbytes // _ALIGNMENT) * _ALIGNMENT
    return ArenaLayout(entries)


def arena_layout_of(tensors: Mapping[str, torch.Tensor]) -> ArenaLayout:
    """The layout for staging ``tensors`` as they are (a DTensor stages its local shard)."""
    items = []
    for name, tensor in tensors.items():
        shard = None
        if isinstance(tensor, DTensor):
            shard = ShardInfo(
                mesh=tensor.device_mesh.mesh.tolist(),
                placements=tuple(tensor.placements),
                shape=tuple(tensor.shape),
                stride=tuple(tensor.stride()),
            )
        local = _local(tensor)
        items.append((name, local.dtype, tuple(local.shape), shard))
    return _entries(items)


def arena_layout_of_specs(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> ArenaLayout:
    """The layout for plain tensors known by name, dtype and shape before they exist."""
    return _entries((name, dtype, shape, None) for name, dtype, shape in specs)


class StagingArena:
    """A reusable shared-memory buffer that holds one save's tensors; owned by one process.

    Memory: the arena is as large as the largest save staged so far (each tensor rounded up to
    64 bytes); it is kept between saves and freed by :meth:`release`. The views of the last
    layout are kept too: a loop saves the same layout again and again, and building ~500 views
    costs about as much as copying 30 MiB.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self._pinned = False
        self._views: tuple[ArenaLayout, dict[str, torch.Tensor]] | None = None

    @property
    def capacity(self) -> int:
        """Bytes currently allocated (0 before the first save and after :meth:`release`)."""
        return 0 if self.buffer is None else self.buffer.numel()

    def stage(self, layout: ArenaLayout, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each ``(name, tensor)`` (CPU or CUDA, plain or DTensor) to its place in ``layout``.

        Collective: every rank calls it, and all agree that their arenas could be allocated
        before any copy (or gather, when ``tensors`` is a generator that gathers) starts; if
        one could not, every rank raises CheckpointError. Blocking: on return every copy has
        completed. As a generator, ``tensors`` needs at most one source tensor alive besides
        the arena.
        """
        agree.on_every_rank(lambda: self._ensure_capacity(layout.end), "staging tensors in shared memory failed")
        views = self._views_of(layout)
        for name, tensor in tensors:
            local = _local(tensor).detach()
            views[name].copy_(local, non_blocking=local.is_cuda)
        if self._pinned:
            torch.cuda.synchronize()

    def _views_of(self, layout: ArenaLayout) -> dict[str, torch.Tensor]:
        if self._views is None or self._views[0] != layout:
            buffer = self.buffer
            if buffer is None:
                raise CheckpointError("staging: the shared-memory arena is not allocated")
            self._views = (layout, {name: view(buffer, entry) for name, entry in layout.tensors.items()})
        return self._views[1]

    def _ensure_capacity(self, nbytes: int) -> None:
        if self.buffer is not None and self.buffer.numel() >= max(nbytes, 1):
            return
        self.release()
        free = shared_memory_free()
        if free is not None and free < nbytes:
            raise CheckpointError(
                f"{_SHM}: staging an asynchronous save needs {nbytes / 2**20:.1f} MiB of shared memory, "
                f"{free / 2**20:.1f} MiB are free; enlarge {_SHM} (e.g. docker --shm-size) or use mode: sync"
            )
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8).share_memory_()
        if torch.cuda.is_available():  # GPU sources: pinned memory makes the copies asynchronous
            torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            self._pinned = True
        logger.info("staging arena: %.1f MiB of shared memory", self.buffer.numel() / 2**20)

    def release(self) -> None:
        """Free the arena (the background process must have dropped its reference); idempotent."""
        if self.buffer is not None and self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer = None
        self._views = None
        self._pinned = False


def shared_memory_free() -> int | None:
    """Bytes free in POSIX shared memory (/dev/shm), None where there is no such mount.

    Checked before allocating: a shared-memory page that cannot be backed kills the writing
    process with SIGBUS instead of raising an error.
    """
    try:
        stats = os.statvfs(_SHM)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def view(buffer: torch.Tensor, entry: StagedTensor) -> torch.Tensor:
    """The tensor ``entry`` describes, as a view into ``buffer`` (no copy)."""
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    return raw.view(entry.dtype).reshape(entry.shape)


class StagedTensors:
    """The background side: rebuilds the staged tensors (DTensors on a CPU mesh) from the arena.

    Meshes are created once per distinct rank layout and reused; building one is collective
    over the background processes' group when it is not the whole world.
    """

    def __init__(self) -> None:
        self._meshes: dict[str, DeviceMesh] = {}

    def materialize(self, buffer: torch.Tensor, layout: ArenaLayout) -> dict[str, torch.Tensor]:
        """Name -> tensor view (or DTensor over a view) for every entry of ``layout``."""
        result: dict[str, torch.Tensor] = {}
        for name, entry in layout.tensors.items():
            local = view(buffer, entry)
            if entry.shard is None:
                result[name] = local
                continue
            result[name] = DTensor.from_local(
                local,
                self._mesh(entry.shard.mesh),
                entry.shard.placements,
                run_check=False,
                shape=torch.Size(entry.shard.shape),
                stride=entry.shard.stride,
            )
        return result

    def _mesh(self, ranks: list[Any]) -> DeviceMesh:
        key = repr(ranks)
        if key not in self._meshes:
            if not torch.distributed.is_initialized():
                # a one-rank job's writer has no group, and a mesh needs one: a group of its own
                # (in memory), never torch's rendezvous on the job's MASTER_PORT (EADDRINUSE)
                torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
            self._meshes[key] = DeviceMesh("cpu", ranks)
        return self._meshes[key]
