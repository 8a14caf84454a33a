"""Any checkpoint we read, as named sets of tensors read a few at a time (``areal-ckpt diff``).

A checkpoint is one or more *sections* (a recovery checkpoint's models, an export's model, a
DeepSpeed tag's model), each a :class:`TensorSet`: an index of names, dtypes and shapes from
metadata alone, and :meth:`TensorSet.read` of some names at a time, so a comparison holds a
bounded batch in memory. Names follow the recovery layout: ``model.<parameter>`` for weights,
``optim.<parameter>.<state>`` for optimizer state, so an export and a dump of the same model
line up. Every file with a manifest is checked against it (size and CRC-32) before it is read;
nothing read can run code. Local, read-only, single process.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_io import load_tensors, tensor_index
from areal_ckpt.formats.dcp_metadata import check_within_files, read_metadata_json
from areal_ckpt.generations.store import resolve_recovery
from areal_ckpt.paths import FROZEN_PART, MANIFEST_NAME, MODEL_PREFIX, RECOVER_MANIFEST
from areal_ckpt.publish import check_files, read_manifest
from areal_ckpt.tools.inspection import deepspeed_folder, kind_of

Index = dict[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass(frozen=True)
class TensorSet:
    """One section's tensors: ``index`` (name -> dtype, shape) and ``read``, which yields each of
    the names asked for with its tensor (on the CPU, in any order); ``concurrent``: ``read`` may
    run on one thread while another set's reads on another (plain file reads, no process-wide
    state)."""

    index: Index
    read: Callable[[Sequence[str]], Iterator[tuple[str, torch.Tensor]]]
    concurrent: bool = True


def _checked(folder: Path, manifest_name: str, prefix: str = "") -> dict[str, Any]:
    """The manifest of the checkpoint ``folder``; CheckpointError naming every damaged file
    under ``prefix``."""
    manifest = read_manifest(folder, manifest_name)
    names = [name for name in manifest["files"] if name.startswith(prefix)]
    problems = check_files(folder, manifest["files"], names)
    if problems:
        raise CheckpointError(f"{folder}: damaged: " + "; ".join(problems))
    return manifest


def _dcp_set(folders: Sequence[Path]) -> TensorSet:
    """The tensors of our DCP folders (a model's, and its frozen part's), read through their
    JSON metadata."""
    homes: dict[str, tuple[Path, Metadata]] = {}
    index: Index = {}
    for folder in folders:
        metadata = read_metadata_json(folder)
        check_within_files(metadata, folder)
        for name, spec in tensor_index(metadata).items():
            index[name] = spec
            homes[name] = (folder, metadata)

    def read(names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for folder in folders:
            template = {
                name: torch.empty(index[name][1], dtype=index[name][0]) for name in names if homes[name][0] == folder
            }
            if template:
                load_tensors(template, folder, optional_prefixes=("",), metadata=homes[next(iter(template))][1])
                yield from template.items()

    return TensorSet(index, read)


def _safetensors_set(folder: Path) -> TensorSet:
    """An HF export's safetensors files, every name prefixed ``model.`` (the recovery layout)."""
    from safetensors import safe_open

    homes: dict[str, Path] = {}
    index: Index = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                sliced = handle.get_slice(name)
                dtype = getattr(torch, _SAFETENSORS_DTYPES.get(sliced.get_dtype(), "uint8"))
                index[MODEL_PREFIX + name] = (dtype, tuple(sliced.get_shape()))
                homes[MODEL_PREFIX + name] = shard

    def read(names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for shard in sorted({homes[name] for name in names}):
            with safe_open(shard, framework="pt") as handle:
                for name in names:
                    if homes[name] == shard:
                        yield name, handle.get_tensor(name[len(MODEL_PREFIX) :])

    return TensorSet(index, read)


_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip


def _state_dict_set(tensors: dict[str, torch.Tensor]) -> TensorSet:
    """Tensors already in memory (a DeepSpeed checkpoint of DeepSpeed's own layout)."""
    index = {MODEL_PREFIX + name: (value.dtype, tuple(value.shape)) for name, value in tensors.items()}
    return TensorSet(index, lambda names: ((name, tensors[name[len(MODEL_PREFIX) :]]) for name in names))


def _stock_dcp_set(folder: Path) -> TensorSet:
    """A stock DCP folder (``dcp.save``'s format), its metadata read with the allow-listed
    unpickler and its records with torch's weights-only reader; names as stored."""
    import torch.distributed.checkpoint as dcp

    from areal_ckpt.formats.stock_dcp import SafeFileSystemReader, check_sizes, read_stock_metadata

    metadata = read_stock_metadata(folder)
    index = tensor_index(metadata)
    check_sizes(metadata, folder, sorted(index))

    def read(names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        template = {name: torch.empty(index[name][1], dtype=index[name][0]) for name in names}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                dcp.load(template, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
        except BaseException as error:  # DCP wraps its reader's failures in a BaseException
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"{folder}: reading stock DCP records failed: {error}") from None
        yield from template.items()

    return TensorSet(index, read, concurrent=False)  # DCP's own loader: not known to be thread-safe


#: The kinds whose sections are made with plain file reads only (every file checked against its
#: manifest, metadata parsed as JSON), so two can be made at once on two threads.
CONCURRENT_KINDS = ("recover", "export")


def tensor_sets(path: Path) -> tuple[str, dict[str, TensorSet]]:
    """What the checkpoint at ``path`` is (``recover``, ``export``, ``deepspeed``, ``dcp``) and
    its sections by name. CheckpointError naming the path when it is none we read, or a file
    is damaged. Local, read-only; may run beside another call on another thread when both
    checkpoints are of :data:`CONCURRENT_KINDS`."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder")
    kind = kind_of(path)
    if kind == "recover":
        generation, only = resolve_recovery(path)
        manifest = read_manifest(generation, RECOVER_MANIFEST)
        sections = {}
        for model in manifest["models"] if only is None else [only]:
            _checked(generation, RECOVER_MANIFEST, f"{model}/")
            folders = [
                generation / model,
                *([generation / model / FROZEN_PART] if (generation / model / FROZEN_PART).is_dir() else []),
            ]
            sections[model] = _dcp_set(folders)
        return kind, sections
    if kind == "export":
        name = _checked(path, MANIFEST_NAME).get("name") if (path / MANIFEST_NAME).is_file() else None
        return kind, {name if isinstance(name, str) and name else "model": _safetensors_set(path)}
    if kind == "deepspeed":
        folder = deepspeed_folder(path)
        if folder is None:
            raise CheckpointError(f"{path}: no DeepSpeed checkpoint tag here any more")
        if (folder / MANIFEST_NAME).is_file():  # ours
            _checked(folder, MANIFEST_NAME, "model/")
            return kind, {"model": _dcp_set([folder / "model"])}
        from areal_ckpt.formats.deepspeed_pickles import weights_only_deepspeed_loads
        from areal_ckpt.tools.convert import zero0_module_states
        from areal_ckpt.tools.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_deepspeed_loads():
            tensors = zero0_module_states(folder)
        if tensors is None:  # ZeRO 1-3: the fp32 masters, as zero_to_fp32 rebuilds them
            tensors = get_fp32_state_dict_from_zero_checkpoint(folder.parent, folder.name)
        return kind, {"model": _state_dict_set(tensors)}
    if kind == "dcp":
        return kind, {"model": _stock_dcp_set(path)}
    raise CheckpointError(f"{path}: neither an HF export, a recovery checkpoint, a DeepSpeed checkpoint nor stock DCP")
