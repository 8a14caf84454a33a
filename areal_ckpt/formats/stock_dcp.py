"""Reading checkpoints written by stock ``torch.distributed.checkpoint`` without running code.

A stock DCP folder (``dcp.save`` with its default ``FileSystemWriter``: AReaL's
``recover_checkpoint/``, a torchtitan step folder) holds a pickled ``.metadata`` and
``__{rank}_{i}.distcp`` files of ``torch.save`` records. ``.metadata`` is read here with an
unpickler that builds only DCP's metadata classes and the torch values they hold (sizes, dtypes,
layouts), refusing any other global by name; records are read by torch's own reader with
``torch.load(weights_only=True)``. A planted ``__reduce__`` payload never runs.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
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
from areal_ckpt.formats.dcp_io import interruption_in
from areal_ckpt.formats.dcp_metadata import check_tiling, tensor_entry
from areal_ckpt.formats.hf_export import names_of_rank
from areal_ckpt.fsio import read_regular_file, regular_file_size
from areal_ckpt.paths import STOCK_METADATA
from areal_ckpt.state.plain_pickle import REFUSED_PICKLE
from areal_ckpt.tensors import TORCH_INERT_VALUES, TensorSpec

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: every global outside the allow-list (and torch's
    dtypes and memory formats, inert values) is refused by name."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name in TORCH_INERT_VALUES:
            return TORCH_INERT_VALUES[name]
        raise pickle.UnpicklingError(f"refused global {module}.{name}: not part of DCP's metadata")


def read_stock_metadata(folder: Path) -> Metadata:
    """``folder``'s DCP ``Metadata``, unpickled with the allow-list above; CheckpointError
    naming ``.metadata`` and the refused global (or other cause). Local, read-only."""
    path = Path(folder) / STOCK_METADATA
    try:
        metadata = _MetadataUnpickler(io.BytesIO(read_regular_file(path))).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (stock DCP metadata)") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error.strerror}") from None
    except REFUSED_PICKLE as error:
        raise CheckpointError(f"{path}: refused: {error}; nothing in it was run") from None
    except RecursionError:
        raise CheckpointError(f"{path}: refused: nested too deeply") from None
    if (
        not isinstance(metadata, Metadata)
        or not isinstance(metadata.state_dict_metadata, dict)
        or not isinstance(metadata.storage_data, dict)
    ):
        raise CheckpointError(f"{path}: refused: not DCP metadata (got {type(metadata).__name__})")
    _check_structure(metadata, path)
    return metadata


def _is_shape(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(type(v) is int and v >= 0 for v in value)


def _check_structure(metadata: Metadata, path: Path) -> None:
    """Raise CheckpointError naming ``path`` and the entry unless every entry has the types DCP
    itself writes (names as strings, shapes as ``torch.Size``, dtypes, chunk lists, storage keys
    as ``MetadataIndex`` and records as file, offset and length), so every later reader can rely
    on them. Pure."""
    for key, entry in metadata.state_dict_metadata.items():
        where = f"{path}: entry {key!r}"
        if not isinstance(key, str):
            raise CheckpointError(f"{where}: its name is not a string")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{where}: {type(entry).__name__} is neither a tensor nor a bytes entry")
        if not isinstance(entry.properties, TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype):
            raise CheckpointError(f"{where}: properties {entry.properties!r} name no dtype")
        if not _is_shape(entry.size):
            raise CheckpointError(f"{where}: size {entry.size!r} is not a torch.Size of non-negative integers")
        chunks = entry.chunks if isinstance(entry.chunks, list) else None
        if chunks is None or not all(
            isinstance(c, ChunkStorageMetadata) and _is_shape(c.offsets) and _is_shape(c.sizes) for c in chunks
        ):
            raise CheckpointError(f"{where}: chunks {str(entry.chunks)[:200]} are not DCP chunk records")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise CheckpointError(f"{path}: storage key {str(index)[:200]} is not a MetadataIndex")
        relative = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(relative, str) or "/" in relative or not (type(offset) is int and type(length) is int):
            raise CheckpointError(f"{path}: malformed storage entry for {index.fqn}")
        if offset < 0 or length < 0:
            raise CheckpointError(f"{path}: storage entry for {index.fqn} at {offset} of {length} bytes")


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` with the metadata read by :func:`read_stock_metadata`
    (its records are read with ``torch.load(weights_only=True)`` already)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The folder's metadata, unpickled with the allow-list."""
        metadata = read_stock_metadata(Path(self.path))
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def model_prefix(metadata: Metadata, names: Sequence[str], source: Path) -> str:
    """The key prefix under which ``names`` (a model's state-dict keys) are stored: ``""``,
    ``model.``, ``app.model.``, ``dcp.model.``...; CheckpointError listing what is there when
    no prefix holds them all."""
    tensors = {key for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}
    if not names:
        raise CheckpointError(f"{source}: the model config names no tensors")
    first = names[0]
    candidates = sorted({key[: len(key) - len(first)] for key in tensors if key.endswith(first)}, key=len)
    for prefix in candidates:
        if prefix and not prefix.endswith("."):
            continue
        if all(prefix + name in tensors for name in names):
            return prefix
    sample = sorted(tensors)[:5]
    raise CheckpointError(
        f"{source}: holds no complete set of the model's tensors under one prefix "
        f"(looked for {first!r}; stored keys start {sample})"
    )


class StockDcpModelSource:
    """A model stored in a stock DCP folder, as an export source (see ``formats.hf_export``);
    its HF config comes from elsewhere (``config``, e.g. the base model's)."""

    def __init__(self, folder: Path, config: Any, names: Sequence[str], architecture: str) -> None:
        self.folder = Path(folder)
        self.config = config
        self.generation_config = None
        self.architecture = architecture
        self.on_accelerator = False
        self._metadata = read_stock_metadata(self.folder)
        self._prefix = model_prefix(self._metadata, names, self.folder)
        self._names = list(names)
        check_sizes(self._metadata, self.folder, [self._prefix + name for name in self._names])

    def export_specs(self) -> list[TensorSpec]:
        """Every model tensor's name, shape and dtype, from the metadata alone; local."""
        specs = []
        for name in self._names:
            entry = tensor_entry(self._metadata, self._prefix + name, self.folder)
            specs.append(TensorSpec(name, tuple(entry.size), entry.properties.dtype))
        return specs

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each name of this rank's entry of ``files`` with its tensor, read by torch's reader
        (weights-only records) in one load; local."""
        wanted = names_of_rank(files)
        if not wanted:
            return
        template = {}
        for name in wanted:
            entry = tensor_entry(self._metadata, self._prefix + name, self.folder)
            template[self._prefix + name] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                dcp.load(template, storage_reader=SafeFileSystemReader(str(self.folder)), no_dist=True)
        except CheckpointError:
            raise
        except BaseException as error:  # DCP wraps the reader's failures in a BaseException
            interruption = interruption_in(error)
            if interruption is not None:  # Ctrl-C / SystemExit: never converted
                raise interruption from None
            raise CheckpointError(f"{self.folder}: reading stock DCP records failed: {error}") from None
        for name in wanted:
            yield name, template.pop(self._prefix + name)


def check_sizes(metadata: Metadata, folder: Path, keys: Sequence[str]) -> None:
    """Raise CheckpointError unless each of ``keys`` has chunks that tile it and at least its
    bytes in records that lie inside their files: a forged shape can then never make a reader
    allocate more than is on disk, nor leave part of a tensor unread. Reads only file sizes."""
    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        relative, offset, length = info.relative_path, info.offset, info.length  # typed by read_stock_metadata
        if relative not in sizes:
            sizes[relative] = regular_file_size(folder / relative)
        if offset + length > sizes[relative]:
            raise CheckpointError(f"{folder / STOCK_METADATA}: places {index.fqn} past the end of {relative}")
        stored[index.fqn] = stored.get(index.fqn, 0) + length
        spans.setdefault(relative, []).append((offset, offset + length, index.fqn))
    for relative, placed in spans.items():  # records never share bytes: together they fit in their files
        placed.sort()
        for (_, end, first), (start, _, second) in zip(placed, placed[1:]):
            if start < end:
                raise CheckpointError(
                    f"{folder / STOCK_METADATA}: the records of {first} and {second} share bytes of {relative}"
                )
    for key in keys:
        entry = tensor_entry(metadata, key, folder)
        try:
            check_tiling(key, entry)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{folder / STOCK_METADATA}: {error}") from None
        needed = entry.size.numel() * entry.properties.dtype.itemsize
        if needed > stored.get(key, 0):
            raise CheckpointError(
                f"{folder / STOCK_METADATA}: {key} claims {needed} bytes, its records hold {stored.get(key, 0)}"
            )
