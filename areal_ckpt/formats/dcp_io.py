"""torch.distributed.checkpoint (DCP) shards without pickle on the load path.

DCP writes each rank's tensors into ``__{rank}_{i}.distcp`` files (read back with
``torch.load(weights_only=True)``) and a ``.metadata`` file that is a pickle. We never read the
pickle: rank 0 also writes ``dcp_metadata.json``, a JSON rendering of the same metadata, and
:class:`SafeFileSystemReader` rebuilds DCP's Metadata from it. Only tensors are stored (no
BYTE_IO items, which DCP would unpickle on load); non-tensor state goes to JSON elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import write_file_durably

METADATA_JSON = "dcp_metadata.json"
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """A JSON rendering of DCP ``Metadata`` for tensor-only checkpoints."""
    tensors = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"DCP entry {fqn!r} is not a tensor; only tensors are stored through DCP")
        tensors[fqn] = {
            "dtype": str(entry.properties.dtype).removeprefix("torch."),
            "requires_grad": entry.properties.requires_grad,
            "size": list(entry.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in entry.chunks],
        }
    storage = [
        {
            "fqn": index.fqn,
            "offset": None if index.offset is None else list(index.offset),
            "index": index.index,
            "file": info.relative_path,
            "byte_offset": info.offset,
            "length": info.length,
            "transforms": list(info.transform_descriptors or []),
        }
        for index, info in metadata.storage_data.items()
    ]
    return {"version": metadata.version, "tensors": tensors, "storage": storage}


def metadata_from_json(data: dict[str, Any], source: Path) -> Metadata:
    """Rebuild DCP ``Metadata`` from :func:`metadata_to_json`; raises CheckpointError naming ``source``."""
    try:
        tensors = {}
        for fqn, entry in data["tensors"].items():
            tensors[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_DTYPES[entry["dtype"]], requires_grad=bool(entry["requires_grad"])),
                size=torch.Size(_ints(entry["size"])),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(_ints(c["offsets"])), sizes=torch.Size(_ints(c["sizes"])))
                    for c in entry["chunks"]
                ],
            )
        storage = {}
        for item in data["storage"]:
            if not isinstance(item["file"], str) or not _DATA_FILE.match(item["file"]):
                raise ValueError(f"data file name {item['file']!r} is not a DCP shard in this folder")
            if item["transforms"]:
                raise ValueError(f"transforms {item['transforms']!r} are not supported")
            offset = None if item["offset"] is None else torch.Size(_ints(item["offset"]))
            index = MetadataIndex(fqn=item["fqn"], offset=offset, index=item["index"])
            storage[index] = _StorageInfo(
                relative_path=item["file"], offset=_ints([item["byte_offset"]])[0], length=_ints([item["length"]])[0]
            )
        return Metadata(
            state_dict_metadata=tensors,
            planner_data={fqn: (fqn,) for fqn in tensors},
            storage_data=storage,
            storage_meta=StorageMeta(),
            version=data.get("version"),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{source}: malformed DCP metadata: {error}") from None


def _ints(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"expected non-negative integers, got {values!r}")
    return values


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that takes metadata from our JSON instead of unpickling ``.metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        source = Path(self.path) / METADATA_JSON
        try:
            data = json.loads(source.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{source}: missing (DCP metadata)") from None
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{source}: unreadable DCP metadata: {error}") from None
        metadata = metadata_from_json(data, source)
        metadata.storage_meta.load_id = self.load_id
        return metadata


def save_tensors(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Collective: every rank saves its part of ``tensors`` (flat name -> Tensor / DTensor) into ``folder``.

    Each rank writes and fsyncs its own ``__{rank}_0.distcp``; rank 0 also writes ``.metadata``
    (DCP's pickle, never read by us) and ``dcp_metadata.json``. Blocking; the folder's entries
    are made durable by the caller's commit.
    """
    non_tensors = [name for name, value in tensors.items() if not isinstance(value, torch.Tensor)]
    if non_tensors:
        raise CheckpointError(f"only tensors go through DCP; not tensors: {non_tensors[:5]}")
    writer = FileSystemWriter(folder, single_file_per_rank=True, sync_files=True)
    try:
        with _single_process_quiet():
            metadata = dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_distributed())
    except CheckpointException as error:  # a BaseException in DCP: make it an ordinary error
        raise CheckpointError(
            f"{folder}: writing DCP shards failed: {_failures(error)} ({_free_space(folder)})"
        ) from None
    if dist.rank() == 0:
        write_file_durably(folder / METADATA_JSON, json.dumps(metadata_to_json(metadata)).encode())


def read_tensor_index(folder: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Names, dtypes and full shapes stored in a DCP folder, from its JSON metadata; local."""
    metadata = SafeFileSystemReader(folder).read_metadata()
    return {
        fqn: (entry.properties.dtype, tuple(entry.size))
        for fqn, entry in metadata.state_dict_metadata.items()
    }


def load_tensors(
    template: dict[str, torch.Tensor], folder: Path, optional_prefixes: tuple[str, ...] = ()
) -> None:
    """Collective: fill ``template`` (flat name -> Tensor / DTensor, in place) from ``folder``.

    Resharding across a different world size is DCP's. Names must match exactly, except that
    stored names starting with ``optional_prefixes`` may be left unread: missing or unexpected
    names, and shape or dtype changes, raise CheckpointError naming them.
    """
    stored = read_tensor_index(folder)
    missing = sorted(set(template) - set(stored))
    unexpected = sorted(name for name in set(stored) - set(template) if not name.startswith(optional_prefixes))
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: checkpoint does not match the model: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}"
        )
    for name, tensor in template.items():
        dtype, shape = stored[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(
                f"{folder}: {name}: checkpoint has {dtype} {list(shape)}, model has {tensor.dtype} {list(tensor.shape)}"
            )
    try:
        with _single_process_quiet():
            dcp.load(template, storage_reader=SafeFileSystemReader(folder), no_dist=not dist.is_distributed())
    except CheckpointException as error:
        raise CheckpointError(f"{folder}: reading DCP shards failed: {_failures(error)}") from None


def _free_space(folder: Path) -> str:
    """DCP's tensor writer reports a full disk as a zip-format error; say how much room there is."""
    try:
        stats = os.statvfs(folder)
    except OSError as error:
        return f"cannot stat the filesystem: {error.strerror}"
    free = stats.f_bavail * stats.f_frsize
    hint = ": no space left on device" if free < (1 << 20) else ""
    return f"{free} bytes free on the filesystem{hint}"


def _failures(error: CheckpointException) -> str:
    parts = []
    for rank, failure in sorted(error.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    return "; ".join(parts)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group (intended for one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
