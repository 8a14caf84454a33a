"""DCP metadata as JSON (never a pickle): writing it, and reading it back with every check a
forged file needs before anything is allocated from it.

Pure functions plus :func:`read_metadata_json` / :func:`check_within_files`, which read a file
and file sizes; local.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_names import KEY_PREFIXES, LARGEST, checked_ints, our_name
from areal_ckpt.fsio import read_json_file, regular_file_size
from areal_ckpt.paths import METADATA_JSON
from areal_ckpt.tensors import DTYPES_BY_NAME

_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


def tensor_entry(metadata: Metadata, key: str, where: Path | str) -> TensorStorageMetadata:
    """The metadata entry of the tensor ``key``; raises CheckpointError naming ``where`` when
    the entry holds bytes (a pickled object), not a tensor. Pure."""
    entry = metadata.state_dict_metadata[key]
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"{where}: {key} is stored as bytes, not as a tensor")
    return entry


def tensor_entries(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """Every tensor entry of ``metadata`` by name (entries holding bytes are left out); pure."""
    return {
        key: entry for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)
    }


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """A JSON rendering of the tensor entries of DCP ``Metadata`` whose names follow
    :data:`~areal_ckpt.formats.dcp_names.STORED_PREFIXES`; entries that are not tensors (kept
    for stock readers) are left out."""
    tensors = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        tensors[fqn] = tensor_json(entry, entry.chunks)
    storage = [storage_entry(index, info) for index, info in metadata.storage_data.items()]
    return {"version": metadata.version, "key_prefixes": KEY_PREFIXES, "tensors": tensors, "storage": storage}


def tensor_json(entry: TensorStorageMetadata, chunks: list[ChunkStorageMetadata]) -> dict[str, Any]:
    """The JSON entry of one tensor (dtype, shape) listing ``chunks`` of it; pure."""
    return {
        "dtype": str(entry.properties.dtype).removeprefix("torch."),
        "requires_grad": entry.properties.requires_grad,
        "size": list(entry.size),
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in chunks],
    }


def storage_entry(index: MetadataIndex, info: _StorageInfo) -> dict[str, Any]:
    """The JSON entry saying where the stored chunk ``index`` lies (``info``); pure."""
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else list(index.offset),
        "index": index.index,
        "file": info.relative_path,
        "byte_offset": info.offset,
        "length": info.length,
        "transforms": list(info.transform_descriptors or []),
    }


def metadata_from_json(data: dict[str, Any], source: Path, complete: bool = True) -> Metadata:
    """Rebuild DCP ``Metadata`` from :func:`metadata_to_json`; raises CheckpointError naming
    ``source``. ``complete=False`` accepts tensors that only some of their chunks tile (a
    rank's slice of the metadata, :mod:`areal_ckpt.formats.dcp_slices`); every other check holds."""
    try:
        prefixes = data.get("key_prefixes", {})
        if not isinstance(prefixes, dict) or not all(isinstance(v, str) for v in prefixes.values()):
            raise ValueError(f"key_prefixes must map strings to strings, got {str(prefixes)[:200]}")
        tensors: dict[str, TensorStorageMetadata] = {}
        for fqn, entry in data["tensors"].items():
            tensors[our_name(fqn, prefixes)] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=DTYPES_BY_NAME[entry["dtype"]], requires_grad=bool(entry["requires_grad"])
                ),
                size=torch.Size(checked_ints(entry["size"])),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(checked_ints(c["offsets"])), sizes=torch.Size(checked_ints(c["sizes"]))
                    )
                    for c in entry["chunks"]
                ],
            )
        storage = {}
        for item in data["storage"]:
            if not isinstance(item["file"], str) or not _DATA_FILE.match(item["file"]):
                raise ValueError(f"data file name {item['file']!r} is not a DCP shard in this folder")
            if item["transforms"]:
                raise ValueError(f"transforms {item['transforms']!r} are not supported")
            offset = None if item["offset"] is None else torch.Size(checked_ints(item["offset"]))
            index = MetadataIndex(fqn=our_name(item["fqn"], prefixes), offset=offset, index=item["index"])
            storage[index] = _StorageInfo(
                relative_path=item["file"],
                offset=checked_ints([item["byte_offset"]])[0],
                length=checked_ints([item["length"]])[0],
            )
        _check_consistent(tensors, storage, complete)
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = dict(tensors)
        return Metadata(
            state_dict_metadata=entries,
            planner_data={fqn: (fqn,) for fqn in tensors},
            storage_data=storage,
            storage_meta=StorageMeta(),
            version=data.get("version"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{source}: malformed DCP metadata: {type(error).__name__}: {error}") from None


def _numel(sizes: Any) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def check_tiling(fqn: str, entry: TensorStorageMetadata, complete: bool = True) -> None:
    """Raise ValueError naming ``fqn`` unless its chunks tile the tensor exactly: each lies inside
    it, no two overlap, and together they hold its element count (so no element is left out;
    not checked when ``complete`` is False: chunks of a slice of the metadata). Pure; a sweep along the axis with the most distinct chunk starts, so the usual row- or
    column-sharded layouts cost O(chunks log chunks)."""
    size = list(entry.size)
    if _numel(size) > LARGEST:
        raise ValueError(f"{fqn}: shape {size} has more than 2**48 elements")
    covered = 0
    boxes = []
    for chunk in entry.chunks:
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise ValueError(f"{fqn}: chunk {offsets} / {sizes} has the wrong rank")
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise ValueError(f"{fqn}: chunk at {offsets} of {sizes} exceeds {size}")
        covered += _numel(sizes)
        if _numel(sizes):
            boxes.append((offsets, sizes))
    if complete and covered != _numel(size):
        raise ValueError(f"{fqn}: chunks hold {covered} elements, the tensor {_numel(size)}")
    if not size:
        return
    axis = max(range(len(size)), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    boxes.sort(key=lambda box: box[0][axis])
    open_boxes: list[tuple[list[int], list[int]]] = []
    for offsets, sizes in boxes:
        open_boxes = [(o, n) for o, n in open_boxes if o[axis] + n[axis] > offsets[axis]]
        for other_offsets, other_sizes in open_boxes:
            if all(a < c + m and c < a + n for a, n, c, m in zip(offsets, sizes, other_offsets, other_sizes)):
                raise ValueError(
                    f"{fqn}: chunks at {other_offsets} of {other_sizes} and at {offsets} of {sizes} overlap, "
                    "so part of the tensor is in none of them"
                )
        open_boxes.append((offsets, sizes))


def _check_consistent(
    tensors: dict[str, TensorStorageMetadata], storage: dict[MetadataIndex, _StorageInfo], complete: bool
) -> None:
    """Raise ValueError unless the chunks of every tensor tile it (:func:`check_tiling`; only
    lie inside it without overlapping when not ``complete``) and each
    stored chunk's byte length matches its shape and dtype. With the data files' sizes checked
    against the manifest, a forged shape can then never make a reader allocate more than the
    checkpoint holds, nor leave part of a tensor unread."""
    chunk_sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for fqn, entry in tensors.items():
        check_tiling(fqn, entry, complete)
        for chunk in entry.chunks:
            chunk_sizes[(fqn, tuple(chunk.offsets))] = tuple(chunk.sizes)
    for index, info in storage.items():
        sizes = chunk_sizes.get((index.fqn, tuple(index.offset or ())))
        if sizes is None:
            raise ValueError(f"{index.fqn}: stored chunk at {index.offset} is not a chunk of a known tensor")
        expected = _numel(sizes) * tensors[index.fqn].properties.dtype.itemsize
        if info.length != expected:
            raise ValueError(f"{index.fqn}: {info.length} stored bytes for a {list(sizes)} chunk ({expected} bytes)")


def read_metadata_json(folder: Path) -> Metadata:
    """DCP ``Metadata`` from ``folder``'s JSON; raises CheckpointError naming the file."""
    source = Path(folder) / METADATA_JSON
    _, data = read_json_file(source, "DCP metadata")
    if not isinstance(data, dict):
        raise CheckpointError(f"{source}: malformed DCP metadata: expected an object, got {type(data).__name__}")
    return metadata_from_json(data, source)


def check_within_files(metadata: Metadata, folder: Path) -> None:
    """Raise CheckpointError unless every stored chunk lies inside its data file; reads only the
    files' sizes. With :func:`metadata_from_json`'s checks this bounds every tensor a reader
    allocates by the bytes actually on disk."""
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if info.relative_path not in sizes:
            sizes[info.relative_path] = regular_file_size(folder / info.relative_path)
        if info.offset + info.length > sizes[info.relative_path]:
            raise CheckpointError(
                f"{folder / METADATA_JSON}: places {index.fqn} at bytes {info.offset}-{info.offset + info.length} of "
                f"{info.relative_path}, which holds {sizes[info.relative_path]} bytes"
            )
