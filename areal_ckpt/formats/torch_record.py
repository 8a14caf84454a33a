"""``torch.save`` records around raw tensor bytes, so stock tools read what we write raw.

A record is the zip archive ``torch.save`` writes for one contiguous CPU tensor: ``data.pkl``
(a pickle that rebuilds the tensor from storage ``0``), ``byteorder``, ``data/0`` (the raw
bytes, stored uncompressed) and ``version``, then the zip's central directory. The payload sits
at a known offset inside the record, so a record is written as ``head + raw bytes + tail`` with
no copy of the tensor, and our own reader reads the raw bytes at that offset and never looks at
the pickle. Stock ``torch.load(weights_only=True)`` (what DCP's ``FileSystemReader`` calls on
each record) rebuilds the tensor from it.

The payload's zip CRC-32 field is 0, as ``torch.save`` writes it with
``torch.utils.serialization.config.save.compute_crc32 = False`` (torch's reader does not check
it); the bytes are covered by the data file's CRC-32 in the checkpoint's manifest instead, so
no second pass over the tensors is spent on it. Pure functions; no I/O.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from areal_ckpt.errors import CheckpointError

ALIGNMENT = 64  # payloads and records start at multiples of this inside a data file
_ARCHIVE = "archive"
_ZIP64_LIMIT = 0xFFFFFFFF
_PADDING_FIELD = 0x4246  # a private zip extra-field id carrying alignment padding


@dataclass(frozen=True)
class RecordFrame:
    """The bytes around one tensor's payload: ``head + payload + tail`` is a ``torch.save`` file.

    ``head`` is padded so that a record starting at a multiple of :data:`ALIGNMENT` has its
    payload at one too, and ``tail`` so that the record's length is a multiple of it.
    """

    head: bytes
    tail: bytes

    def length(self, payload: int) -> int:
        """The whole record's length for a payload of ``payload`` bytes."""
        return len(self.head) + payload + len(self.tail)


def frame_for(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordFrame:
    """The record frame of a contiguous tensor of ``dtype`` and ``shape``; raises CheckpointError
    for a dtype ``torch.save`` has no typed storage for."""
    return _frame(dtype, tuple(shape), _ZIP64_LIMIT)


@functools.lru_cache(maxsize=4096)
def _frame(dtype: torch.dtype, shape: tuple[int, ...], zip64_from: int) -> RecordFrame:
    """See :func:`frame_for`; sizes and offsets from ``zip64_from`` on take zip64 fields."""
    storage = torch.storage._dtype_to_storage_type_map().get(dtype)
    if storage is None:
        raise CheckpointError(f"tensors of dtype {dtype} cannot be stored as torch.save records")
    numel = 1
    for size in shape:
        numel *= size
    payload = numel * dtype.itemsize
    small = [
        (f"{_ARCHIVE}/data.pkl", _rebuild_pickle(getattr(torch, storage), numel, shape)),
        (f"{_ARCHIVE}/byteorder", b"little"),
    ]
    head = bytearray()
    entries: list[tuple[str, int, int, int, bool]] = []  # name, crc, size, local header offset, zip64 size
    for name, data in small:
        entries.append((name, zlib.crc32(data), len(data), len(head), False))
        head += _local_header(name, zlib.crc32(data), len(data), b"") + data
    name = f"{_ARCHIVE}/data/0"
    zip64 = payload >= zip64_from
    fixed = len(_local_header(name, 0, payload, b"", zip64)) + 4  # + the padding field's own header
    padding = -(len(head) + fixed) % ALIGNMENT
    entries.append((name, 0, payload, len(head), zip64))
    head += _local_header(name, 0, payload, struct.pack("<HH", _PADDING_FIELD, padding) + b"Z" * padding, zip64)
    version = b"3\n"
    tail = bytearray(_local_header(f"{_ARCHIVE}/version", zlib.crc32(version), len(version), b"")) + version
    entries.append((f"{_ARCHIVE}/version", zlib.crc32(version), len(version), len(head) + payload, False))
    directory_start = len(head) + payload + len(tail)
    directory = b"".join(_central_header(*entry, zip64_from) for entry in entries)
    tail += directory
    end = _end_records(len(entries), len(directory), directory_start, len(head) + payload + len(tail), zip64_from)
    comment = -(len(head) + payload + len(tail) + len(end)) % ALIGNMENT
    tail += end[:-2] + struct.pack("<H", comment) + b"\0" * comment
    return RecordFrame(head=bytes(head), tail=bytes(tail))


class _StorageRef:
    """Stands for storage ``0`` in the pickle: written as a persistent id, never as an object."""

    def __init__(self, storage_type: type, numel: int) -> None:
        self.storage_type = storage_type
        self.numel = numel


class _TensorRef:
    """Pickles as torch's own call that rebuilds a contiguous tensor over storage ``0``."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage = storage
        self.shape = shape

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        stride = []
        step = 1
        for size in reversed(self.shape):
            stride.append(step)
            step *= size
        stride.reverse()
        args: tuple[Any, ...] = (
            self.storage,
            0,
            torch.Size(self.shape),
            tuple(stride),
            False,
            collections.OrderedDict(),
        )
        return torch._utils._rebuild_tensor_v2, args


class _RecordPickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> tuple[object, ...] | None:
        if isinstance(obj, _StorageRef):
            return ("storage", obj.storage_type, "0", "cpu", obj.numel)
        return None


def _rebuild_pickle(storage_type: type, numel: int, shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    _RecordPickler(out, protocol=2).dump(_TensorRef(_StorageRef(storage_type, numel), shape))
    return out.getvalue()


def _local_header(name: str, crc: int, size: int, extra: bytes, zip64: bool = False) -> bytes:
    encoded = name.encode()
    if zip64:
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) + extra
        sizes = (_ZIP64_LIMIT, _ZIP64_LIMIT)
    else:
        sizes = (size, size)
    return (
        struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0x0800, 0, 0, 0x21, crc, *sizes, len(encoded), len(extra)
        )
        + encoded
        + extra
    )


def _central_header(name: str, crc: int, size: int, offset: int, zip64_size: bool, zip64_from: int) -> bytes:
    encoded = name.encode()
    extra = b""
    fields: list[int] = []
    if zip64_size:
        fields += [size, size]
    if offset >= zip64_from:
        fields.append(offset)
    if fields:
        extra = struct.pack(f"<HH{len(fields)}Q", 0x0001, 8 * len(fields), *fields)
    stored_size = _ZIP64_LIMIT if zip64_size else size
    stored_offset = _ZIP64_LIMIT if offset >= zip64_from else offset
    return (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            45,
            45 if fields else 20,
            0x0800,
            0,
            0,
            0x21,
            crc,
            stored_size,
            stored_size,
            len(encoded),
            len(extra),
            0,
            0,
            0,
            0,
            stored_offset,
        )
        + encoded
        + extra
    )


def _end_records(count: int, directory_size: int, directory_start: int, position: int, zip64_from: int) -> bytes:
    """The end-of-directory records (zip64 ones first when an offset needs them), ending with
    the classic record's comment length (patched by the caller)."""
    records = b""
    if directory_start >= zip64_from:
        records += struct.pack(
            "<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, directory_size, directory_start
        )
        records += struct.pack("<IIQI", 0x07064B50, 0, position, 1)
        directory_start = _ZIP64_LIMIT
    return records + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, directory_size, directory_start, 0)
