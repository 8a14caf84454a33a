"""Streaming safetensors writer with a running checksum.

The bytes follow the safetensors format exactly (8-byte little-endian header length, JSON
header padded to 8 bytes, then raw little-endian tensor data) and load with the ``safetensors``
library. We write the format ourselves rather than through ``safetensors.torch.save_file`` so
that each tensor goes to disk straight from its own memory (no second copy of the shard), and
the CRC-32 for the manifest is computed on the way out instead of by reading the file back.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Sequence

import torch

from areal_ckpt.fsio import ChecksummedWriter, FileRecord
from areal_ckpt.tensors import SAFETENSORS_DTYPES, tensor_bytes

if sys.byteorder != "little":
    raise ImportError("areal_ckpt writes safetensors from memory and needs a little-endian host")


def safetensors_header(tensors: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """The header (length prefix + padded JSON) for ``tensors`` laid out in the given order."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} cannot be stored in safetensors")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_safetensors(
    path: Path, tensors: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None
) -> FileRecord:
    """Write ``tensors`` (CPU) to ``path`` in safetensors format and fsync it; local, blocking.

    Durable on return (the file; its directory entry is fsync'd at commit). On error the
    partial file is left for the caller's staging folder to discard.
    """
    writer = ChecksummedWriter(path)
    try:
        writer.write(safetensors_header(tensors, metadata or {"format": "pt"}))
        for _, tensor in tensors:
            writer.write(tensor_bytes(tensor))
    except BaseException:
        writer.abort()
        raise
    return writer.close()
