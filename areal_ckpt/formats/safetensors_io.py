"""Streaming safetensors writer with a running checksum.

The bytes follow the safetensors format exactly (8-byte little-endian header length, JSON
header padded to 8 bytes, then raw little-endian tensor data) and load with the ``safetensors``
library. We write the format ourselves rather than through ``safetensors.torch.save_file`` so
that each tensor goes to disk straight from its own memory as it arrives (no copy of the
shard, and no need to hold it whole), and the CRC-32 for the manifest is computed on the way
out instead of by reading the file back.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from areal_ckpt.fsio import ChecksummedWriter, FileRecord, FileWriter
from areal_ckpt.tensors import SAFETENSORS_DTYPES, TensorSpec, tensor_bytes

if sys.byteorder != "little":
    raise ImportError("areal_ckpt writes safetensors from memory and needs a little-endian host")


def render_safetensors_header(specs: Sequence[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The header (length prefix + padded JSON) for tensors ``specs`` laid out in that order."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {spec.name!r}: dtype {spec.dtype} cannot be stored in safetensors")
        entries[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
    durable: bool = True,
    writer: FileWriter | None = None,
) -> FileRecord:
    """Write a safetensors file holding ``specs`` at ``path`` and fsync it; local, blocking.

    The header comes from ``specs``; the data from ``tensors`` (CPU), which must yield exactly
    those names, shapes and dtypes in that order. It may be a generator: each tensor is written
    as it arrives, so the whole file never has to be in memory. Durable on return (the file;
    its directory entry is fsync'd at commit); with ``durable`` False, not fsync'd (a copy
    staged for upload). ``writer``, when given, takes the bytes instead of a local file at
    ``path`` (an object uploaded from memory). On error the partial file is left for the
    caller's staging folder to discard (a ``writer`` is aborted).
    """
    writer = ChecksummedWriter(path, durable) if writer is None else writer
    try:
        writer.write(render_safetensors_header(specs, metadata or {"format": "pt"}))
        count = 0
        for (name, tensor), spec in zip(tensors, specs):
            if name != spec.name or tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"{path.name}: got {name} {tuple(tensor.shape)} {tensor.dtype} where the header "
                    f"says {spec.name} {tuple(spec.shape)} {spec.dtype}"
                )
            writer.write(tensor_bytes(tensor))
            count += 1
        if count != len(specs):
            raise ValueError(f"{path.name}: {count} tensors written, the header lists {len(specs)}")
    except BaseException:
        writer.abort()
        raise
    return writer.close()
