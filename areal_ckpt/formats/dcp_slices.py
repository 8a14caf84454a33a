"""The metadata one rank needs to reload its own shards, without ``dcp_metadata.json``.

``dcp_metadata.json`` lists every chunk of every rank: O(ranks x tensors), and a load that
parsed it on every rank cost each rank that much. Two smaller files make the usual load cheap:

- ``dcp_index.json`` (rank 0): every tensor's dtype and shape, and where each tensor stored
  whole lies (one chunk spanning it: a replicated or unsharded tensor); O(tensors).
- ``__{rank}_0.chunks.json`` (each rank, beside its data file): the other chunks of that data
  file, i.e. the rank's shards of sharded tensors; O(its own tensors). Not written when the
  rank holds no such chunk.

A load reads the index and its own rank's chunk file. When the chunks found there fill every
element this rank loads (the same world size and sharding: a restart), nothing else is read;
otherwise (another world size, another sharding) it reads ``dcp_metadata.json`` as before. On
object storage these files, like the data files, come down only when read, so a rank resuming
at the same world size downloads two small files instead of everyone's metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_metadata import (
    metadata_from_json,
    read_metadata_json,
    storage_entry,
    tensor_entries,
    tensor_json,
)
from areal_ckpt.formats.dcp_names import KEY_PREFIXES
from areal_ckpt.fsio import read_json_file
from areal_ckpt.paths import DATA_SUFFIX, METADATA_JSON, STOCK_METADATA

INDEX_JSON = "dcp_index.json"
CHUNKS_SUFFIX = ".chunks.json"
_DCP_FILES = (METADATA_JSON, STOCK_METADATA, INDEX_JSON)


def chunks_file_for(data_file: str) -> str:
    """The name of the chunk file beside the data file ``data_file`` (``__1_0.distcp`` ->
    ``__1_0.chunks.json``)."""
    return data_file.removesuffix(DATA_SUFFIX) + CHUNKS_SUFFIX


def read_when_needed(name: str) -> bool:
    """True for the files of a DCP folder (path ``name`` in a checkpoint) that a load reads only
    when it needs them: data files, chunk files and metadata. A local copy of a checkpoint on
    object storage brings these down as they are read, not up front."""
    base = name.rpartition("/")[2]
    return base.endswith((DATA_SUFFIX, CHUNKS_SUFFIX)) or base in _DCP_FILES


def _is_whole(offsets: Iterable[int], sizes: Iterable[int], size: Iterable[int]) -> bool:
    return all(o == 0 for o in offsets) and list(sizes) == list(size)


def index_to_json(metadata: Metadata) -> dict[str, Any]:
    """The index of the global ``metadata`` (its storage the raw payload positions): every
    tensor's dtype and shape, and its whole chunk's position when it has one; pure."""
    tensors = {}
    whole = {}
    for fqn, entry in tensor_entries(metadata).items():
        spanning = [chunk for chunk in entry.chunks if _is_whole(chunk.offsets, chunk.sizes, entry.size)][:1]
        tensors[fqn] = tensor_json(entry, spanning)
        if spanning:
            whole[fqn] = tuple(spanning[0].offsets)
    storage = [
        storage_entry(index, info)
        for index, info in metadata.storage_data.items()
        if whole.get(index.fqn) == tuple(index.offset or ())
    ]
    return {"version": metadata.version, "key_prefixes": KEY_PREFIXES, "tensors": tensors, "storage": storage}


def chunks_to_json(written: list[tuple[WriteItem, _StorageInfo]]) -> dict[str, Any] | None:
    """The chunk file of one data file: its chunks of tensors not stored whole, given each
    written tensor item and where its raw bytes lie; None when there are none. Pure."""
    chunks: dict[str, list[dict[str, list[int]]]] = {}
    storage = []
    for item, info in written:
        data = item.tensor_data
        if data is None or _is_whole(data.chunk.offsets, data.chunk.sizes, data.size):
            continue
        chunks.setdefault(item.index.fqn, []).append(
            {"offsets": list(data.chunk.offsets), "sizes": list(data.chunk.sizes)}
        )
        storage.append(storage_entry(item.index, info))
    return {"chunks": chunks, "storage": storage} if storage else None


def rank_metadata(
    folder: Path, rank: int, fetch: Callable[[Path], None] | None = None
) -> tuple[Metadata, Callable[[], Metadata] | None]:
    """(metadata for ``rank``'s load, what reads the whole metadata), local, blocking.

    From ``folder``'s index and ``rank``'s chunk file when the folder has an index: the second
    item then reads ``dcp_metadata.json`` for a load the slice does not cover. Otherwise (a
    folder written before the index existed) the whole metadata and None. ``fetch`` is called
    with each file's path before it is read (see :class:`~areal_ckpt.formats.dcp_reader.RawStorageReader`).
    Raises CheckpointError naming a malformed file; the checks of
    :func:`~areal_ckpt.formats.dcp_metadata.metadata_from_json` hold for the slice but
    completeness, which the load checks for what it reads (a slice that does not fill a
    tensor sends it to the whole metadata).
    """
    bring = fetch or (lambda path: None)

    def whole() -> Metadata:
        bring(folder / METADATA_JSON)
        return read_metadata_json(folder)

    index_path = folder / INDEX_JSON
    bring(index_path)
    if not index_path.is_file():
        return whole(), None
    index = _json_object(index_path, "DCP index")
    chunks_path = folder / chunks_file_for(f"__{rank}_0{DATA_SUFFIX}")
    bring(chunks_path)
    source = index_path
    if chunks_path.is_file():
        source = Path(f"{index_path} + {chunks_path.name}")  # what an error names: either may be at fault
        _merge(index, _json_object(chunks_path, "DCP chunk file"), source)
    return metadata_from_json(index, source, complete=False), whole


def data_files_read_by(checkpoint: Path, names: Iterable[str], rank: int) -> set[str] | None:
    """The data files (paths in the checkpoint folder ``checkpoint``, among ``names``) that
    ``rank``'s load reads at the world size the checkpoint was written with: those its slice
    names in each DCP folder (:func:`rank_metadata`). None when that cannot be told from the
    index and the rank's chunk file (a folder written before the index, one that does not
    read): then any may be read. A load whose model is sharded otherwise than when saved reads
    beyond its slice. Local, read-only; the index and chunk files must be in place."""
    wanted: set[str] = set()
    for folder in sorted({name.rpartition("/")[0] for name in names if name.endswith(DATA_SUFFIX)}):
        prefix = f"{folder}/" if folder else ""
        if not (checkpoint / folder / INDEX_JSON).is_file():
            return None
        try:
            metadata, _ = rank_metadata(checkpoint / folder, rank)
        except CheckpointError:
            return None
        wanted |= {prefix + info.relative_path for info in metadata.storage_data.values()}
    return wanted


def _json_object(path: Path, what: str) -> dict[str, Any]:
    _, data = read_json_file(path, what)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: malformed {what}: expected an object, got {type(data).__name__}")
    return data


def _merge(index: dict[str, Any], chunks: dict[str, Any], source: Path) -> None:
    """Add the chunk file's chunks and positions to the index (in place); CheckpointError
    naming ``source`` when the chunk file names a tensor the index lacks or either is malformed."""
    try:
        tensors = index["tensors"]
        for fqn, listed in chunks["chunks"].items():
            if fqn not in tensors or not isinstance(listed, list):
                raise ValueError(f"chunks of {fqn!r}, which the index does not list")
            tensors[fqn]["chunks"] = [*tensors[fqn]["chunks"], *listed]
        index["storage"] = [*index["storage"], *chunks["storage"]]
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{source}: malformed DCP metadata: {type(error).__name__}: {error}") from None
