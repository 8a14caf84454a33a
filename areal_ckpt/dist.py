"""Thin helpers over torch.distributed that also work when it is not initialized.

Functions that are collective say so: every rank of the default process group must call them,
in the same order. Without an initialized process group they act as a world of one.

Every collective of the package goes through here (DCP's planning too: see
:mod:`areal_ckpt.formats.dcp_save`), and each one adds what this rank sends and receives to
:func:`traffic`, so the per-rank cost of a dump or load is measured, not guessed. The counts
are logical payloads (what the rank contributes and what it gets back), independent of the
backend's algorithm. Object collectives pickle over the process group, like torch's own, only
small in-process values, never anything read from a checkpoint; and they unpickle with an
allow-list (:class:`_PeerUnpickler`: plain data, DCP's plan and metadata dataclasses and enums,
the classes this package marks with :func:`exchanged`, torch's sizes, dtypes and layouts), so
not even a peer can make a rank run code or import a module. None of them
moves O(world size) bytes to or from a rank except :func:`all_gather_objects`, which the
package calls only on failure paths, and rank 0's side of :func:`gather_objects` /
:func:`scatter_objects`. The pairwise :func:`send_bytes` / :func:`receive_bytes` move a
checkpoint file's bytes between two nodes (a tiered trial's local tiers, before a load).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import io
import logging
import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from areal_ckpt.errors import CollectiveError
from areal_ckpt.tensors import TORCH_INERT_VALUES

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T", bound=type)


@dataclasses.dataclass
class Traffic:
    """What this process moved through collectives: calls, and payload bytes sent and received."""

    calls: int = 0
    sent: int = 0
    received: int = 0

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.calls - other.calls, self.sent - other.sent, self.received - other.received)


_TRAFFIC = Traffic()


def traffic() -> Traffic:
    """A snapshot of this process's collective traffic since it started; subtract two snapshots
    to measure one operation. Local."""
    return dataclasses.replace(_TRAFFIC)


def _count(sent: int, received: int) -> None:
    _TRAFFIC.calls += 1
    _TRAFFIC.sent += sent
    _TRAFFIC.received += received


def _collective(function: _F) -> _F:
    """Turn a backend failure (a peer died: gloo reports "Connection closed by peer" at once;
    otherwise the process group's timeout bounds the wait) into a CollectiveError."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except RuntimeError as error:
            raise CollectiveError(
                f"rank {rank()}: {function.__name__} across {world_size()} ranks failed "
                f"(another rank died or the network broke): {error}"
            ) from error

    return wrapper  # type: ignore[return-value]


def is_distributed() -> bool:
    """True when a default process group is initialized."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (0 without distributed)."""
    return torch_dist.get_rank() if is_distributed() else 0


def job_info() -> int:
    """The level of a line every rank would log alike (a save committed, the data resumed):
    INFO on rank 0, DEBUG on the others, so a job of N ranks says it once, not N times."""
    return logging.INFO if rank() == 0 else logging.DEBUG


def world_size() -> int:
    """Number of ranks in the default group (1 without distributed)."""
    return torch_dist.get_world_size() if is_distributed() else 1


@_collective
def barrier() -> None:
    """Collective: wait for every rank."""
    if is_distributed():
        _count(0, 0)
        torch_dist.barrier()


def _flag_device() -> torch.device:
    if is_distributed() and torch_dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@_collective
def broadcast_flag(flag: bool, src: int = 0) -> bool:
    """Collective: every rank returns rank ``src``'s ``flag``."""
    if not is_distributed():
        return flag
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device())
    _broadcast(tensor, src)
    return bool(tensor.item())


@_collective
def all_true(flag: bool) -> bool:
    """Collective: True only when ``flag`` is True on every rank."""
    if not is_distributed():
        return flag
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device())
    _all_reduce(tensor, torch_dist.ReduceOp.MIN)
    return bool(tensor.item())


@_collective
def all_reduce_ints(values: Sequence[int], op: str) -> list[int]:
    """Collective: the element-wise ``"min"`` or ``"max"`` of every rank's ``values`` (int64,
    the same length on every rank)."""
    if not is_distributed():
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.int64, device=_flag_device())
    _all_reduce(tensor, {"min": torch_dist.ReduceOp.MIN, "max": torch_dist.ReduceOp.MAX}[op])
    return [int(value) for value in tensor.tolist()]


@_collective
def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Collective: every rank returns rank ``src``'s small in-process ``obj``."""
    if not is_distributed():
        return obj
    payload = _encode(obj) if rank() == src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=_flag_device())
    _broadcast(length, src)
    buffer = _as_tensor(payload, int(length.item()))
    _broadcast(buffer, src)
    return obj if rank() == src else _decode(buffer)


@_collective
def gather_objects(obj: Any, dst: int = 0) -> list[Any] | None:
    """Collective: rank ``dst`` returns every rank's small in-process ``obj``, indexed by rank;
    the others return None. A non-``dst`` rank sends its object (padded to the largest one) and
    receives 8 bytes, however many ranks there are."""
    if not is_distributed():
        return [obj]
    payload = _encode(obj)
    width = all_reduce_ints([len(payload)], "max")[0]
    buffer = _as_tensor(payload, width)
    if rank() != dst:
        _count(buffer.numel(), 0)
        torch_dist.gather(buffer, None, dst=dst)
        return None
    pieces = [torch.empty_like(buffer) for _ in range(world_size())]
    _count(0, buffer.numel() * (world_size() - 1))
    torch_dist.gather(buffer, pieces, dst=dst)
    return [obj if index == dst else _decode(piece) for index, piece in enumerate(pieces)]


@_collective
def scatter_objects(objs: list[Any] | None, src: int = 0) -> Any:
    """Collective: rank ``src`` passes one small in-process object per rank (others pass None);
    every rank returns its own. A non-``src`` rank receives its object padded to the largest."""
    if rank() == src and (objs is None or len(objs) != world_size()):
        raise ValueError(f"scatter_objects: rank {src} must pass one object per rank ({world_size()})")
    if not is_distributed():
        return objs[0]  # type: ignore[index]
    payloads = [_encode(obj) for obj in objs] if rank() == src and objs is not None else []
    width = torch.tensor([max(map(len, payloads), default=0)], dtype=torch.int64, device=_flag_device())
    _broadcast(width, src)
    buffer = torch.empty(max(int(width.item()), _HEADER), dtype=torch.uint8, device=_flag_device())
    if rank() == src:
        pieces = [_as_tensor(payload, int(width.item())) for payload in payloads]
        _count(buffer.numel() * (world_size() - 1), 0)
        torch_dist.scatter(buffer, pieces, src=src)
        return objs[src]  # type: ignore[index]
    _count(0, buffer.numel())
    torch_dist.scatter(buffer, None, src=src)
    return _decode(buffer)


@_collective
def send_bytes(data: torch.Tensor, dst: int) -> None:
    """Pairwise: send ``data`` (a uint8 CPU tensor) to rank ``dst``, which calls
    :func:`receive_bytes` with the same length at the same point; blocking. Through the
    accelerator when the backend needs it (NCCL)."""
    device = _flag_device()
    _count(data.numel(), 0)
    torch_dist.send(data if device.type == "cpu" else data.to(device), dst=dst)


@_collective
def receive_bytes(into: torch.Tensor, src: int) -> None:
    """Pairwise: fill ``into`` (a contiguous uint8 CPU tensor, which a caller may reuse from
    message to message) with the bytes rank ``src`` sends with :func:`send_bytes`; blocking.
    Through the accelerator when the backend needs it (NCCL)."""
    device = _flag_device()
    _count(0, into.numel())
    if device.type == "cpu":
        torch_dist.recv(into, src=src)
        return
    arrived = torch.empty(into.numel(), dtype=torch.uint8, device=device)
    torch_dist.recv(arrived, src=src)
    into.copy_(arrived)


@_collective
def all_gather_objects(obj: Any) -> list[Any]:
    """Collective: every rank's small in-process ``obj``, indexed by rank. Every rank receives
    O(world size) bytes: for failure paths and one-time set-up, not for every dump."""
    if not is_distributed():
        return [obj]
    payload = _encode(obj)
    width = all_reduce_ints([len(payload)], "max")[0]
    buffer = _as_tensor(payload, width)
    pieces = [torch.empty_like(buffer) for _ in range(world_size())]
    _count(buffer.numel(), buffer.numel() * (world_size() - 1))
    torch_dist.all_gather(pieces, buffer)
    return [obj if index == rank() else _decode(piece) for index, piece in enumerate(pieces)]


_HEADER = 8  # each object payload is prefixed with its length, so padding can follow it


def _encode(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(_HEADER, "little") + data


def _as_tensor(payload: bytes, width: int) -> torch.Tensor:
    """``payload`` (from :func:`_encode`, or empty) in a uint8 tensor of ``width`` bytes."""
    buffer = torch.zeros(max(width, _HEADER), dtype=torch.uint8)
    if payload:
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buffer.to(_flag_device())


def _decode(buffer: torch.Tensor) -> Any:
    data = buffer.cpu().numpy().tobytes()
    length = int.from_bytes(data[:_HEADER], "little")
    return _PeerUnpickler(io.BytesIO(data[_HEADER : _HEADER + length])).load()


#: Every global a peer's message may name, by (module, qualified name), with the object it
#: stands for: DCP's save plans and write results (what dcp_save exchanges), torch's Size and
#: layouts, OrderedDict, and the classes registered by :func:`exchanged`.
_EXCHANGED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


def exchanged(cls: _T) -> _T:
    """Class decorator: ranks may send each other instances of ``cls``, a dataclass or enum of
    plain fields. Registers its exact module and qualified name with the peer unpickler; a
    name not registered is refused without importing anything. Local; at import time."""
    if not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
        raise TypeError(f"{cls.__qualname__}: only dataclasses and enums travel between ranks")
    _EXCHANGED[(cls.__module__, cls.__qualname__)] = cls
    return cls


for _dcp_class in (
    SavePlan,
    WriteItem,
    WriteItemType,
    TensorWriteData,
    WriteResult,
    _StorageInfo,
    MetadataIndex,
    ChunkStorageMetadata,
    TensorProperties,
    _MEM_FORMAT_ENCODING,
):
    exchanged(_dcp_class)


class _PeerUnpickler(pickle.Unpickler):
    """Builds what ranks send each other and nothing else: containers and scalars, the globals
    in ``_EXCHANGED`` and torch's dtypes and memory formats. Any other global is refused by name
    without importing its module or walking its attributes, so no payload runs code."""

    def find_class(self, module: str, name: str) -> Any:
        found = _EXCHANGED.get((module, name))
        if found is None and module == "torch":
            found = TORCH_INERT_VALUES.get(name)
        if found is None:
            raise pickle.UnpicklingError(f"refused global {module}.{name}: ranks exchange only plain data")
        return found


def _broadcast(tensor: torch.Tensor, src: int) -> None:
    size = tensor.numel() * tensor.element_size()
    if rank() == src:
        _count(size, 0)
    else:
        _count(0, size)
    torch_dist.broadcast(tensor, src=src)


def _all_reduce(tensor: torch.Tensor, op: Any) -> None:
    size = tensor.numel() * tensor.element_size()
    _count(size, size)
    torch_dist.all_reduce(tensor, op=op)
