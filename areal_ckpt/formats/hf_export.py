"""HuggingFace export format: sharded safetensors + index, config, generation config, tokenizer.

The shard plan comes from ``huggingface_hub``'s splitter, so file names and the index are what
``save_pretrained`` would write. Files are dealt out to ranks round-robin; each rank writes its
own files, so a multi-rank export is written in parallel, and each tensor goes to its file as
soon as it is whole: a rank holds at most two gathered tensors at a time (the one it writes
and the next, in flight), whatever the shard size.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from huggingface_hub.serialization import split_state_dict_into_shards_factory

from areal_ckpt import dist
from areal_ckpt.errors import CollectiveError
from areal_ckpt.formats.safetensors_io import write_safetensors
from areal_ckpt.fsio import FileRecord, FileWriter, write_file_durably
from areal_ckpt.tensors import TensorSpec, export_dtype_for

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class TensorSource(Protocol):
    """Full tensors by name, the way shard files are written from them.

    ``gather_round(files)`` takes one round of files, ``files[i]`` the tensor names rank ``i``
    writes, and yields ``(name, full tensor)`` for this rank's entry, in order (nothing when
    the round has none for it); a tensor may be on an accelerator (copied to host memory once,
    where it is written) and is valid until the next one is taken. A sharded source makes each
    tensor whole on its owner alone, so the network carries it once, not once per rank; its
    steps are collective, so every rank passes the same ``files`` and exhausts the iterator.
    """

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class ExportPlan:
    """Which tensors go to which file (a path relative to the export folder); identical on
    every rank. Tensors are planned under source names; ``specs[name].name`` is the key the
    tensor is stored under in its file (the same name, except in a PEFT adapter file)."""

    files: dict[str, list[str]]
    weight_map: dict[str, str]  # the model index: stored key -> file, for the model's files only
    total_size: int
    specs: dict[str, TensorSpec]  # every exported tensor as written (stored key, export dtype)

    @property
    def is_sharded(self) -> bool:
        """True when the model is split over several files and needs an index."""
        return len(set(self.weight_map.values())) > 1

    def files_of_rank(self, rank: int, world_size: int) -> list[str]:
        """Files written by ``rank``: file i goes to rank i mod world size."""
        return [name for index, name in enumerate(self.files) if index % world_size == rank]


def plan_export(specs: Sequence[TensorSpec], max_shard_size: int, dtype: torch.dtype | None) -> ExportPlan:
    """Split tensors (in state-dict order) into safetensors files no larger than ``max_shard_size``."""
    exported = {spec.name: TensorSpec(spec.name, spec.shape, export_dtype_for(spec.dtype, dtype)) for spec in specs}
    split = split_state_dict_into_shards_factory(
        exported,
        get_storage_size=lambda spec: spec.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    return ExportPlan(
        files={name: list(tensors) for name, tensors in split.filename_to_tensors.items()},
        weight_map=dict(split.tensor_to_filename),
        total_size=sum(spec.nbytes for spec in exported.values()),
        specs=exported,
    )


def write_rank_shards(
    source: TensorSource,
    plan: ExportPlan,
    folder: Path,
    rank: int,
    world_size: int,
    dtype: torch.dtype | None,
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
    durable: bool = True,
    open_writer: Callable[[str], FileWriter] | None = None,
) -> tuple[dict[str, FileRecord], BaseException | None]:
    """Write this rank's shard files into ``folder``; returns their records and any write error.

    ``progress`` wraps the iteration over rounds of files (e.g. a tqdm bar in the CLI).

    Collective when the source is sharded: every rank walks the files in rounds of
    ``world_size`` (one file per rank) and takes part in making every tensor whole, so one
    rank's failed write never leaves the others waiting; the error is returned for the caller
    to agree on and raise. Within a round the files advance together, one tensor of each at a
    time, so all ranks write at once, each the tensor it has just received while the next one
    moves: a rank holds at most two gathered tensors, not a shard file's worth; a rank that
    failed to write keeps receiving its file's tensors and drops them. Each file is fsync'd
    before this returns, unless ``durable`` is False (files staged for an upload).
    ``open_writer`` makes, from a file's name, the writer that takes its bytes instead of a
    local file (an object uploaded from memory: the file is uploaded when its write returns).
    """
    records: dict[str, FileRecord] = {}
    error: BaseException | None = None
    file_names = list(plan.files)
    for start in progress(range(0, len(file_names), world_size)):
        round_files = file_names[start : start + world_size]
        tensors = source.gather_round([plan.files[name] for name in round_files])
        if rank < len(round_files) and error is None:
            file_name = round_files[rank]
            try:
                records[file_name] = write_safetensors(
                    folder / file_name,
                    [plan.specs[name] for name in plan.files[file_name]],
                    ((plan.specs[name].name, _to_dtype(tensor, dtype).cpu()) for name, tensor in tensors),
                    durable=durable,
                    writer=None if open_writer is None else open_writer(file_name),
                )
            except CollectiveError:
                raise
            except Exception as exc:  # reported to every rank by the caller
                error = exc
        for _ in tensors:  # the rest of the round's steps (all of them when this rank writes none)
            pass
    return records, error


def names_of_rank(files: Sequence[Sequence[str]]) -> Sequence[str]:
    """This rank's entry of a round's ``files`` (empty when the round has none for it); local."""
    rank = dist.rank()
    return files[rank] if rank < len(files) else ()


def _to_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(export_dtype_for(tensor.dtype, dtype))


CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
#: Files of a base model folder that are weights, not assets (never copied into an export).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


class FolderFiles(Protocol):
    """The files of an export besides its tensors, written into its staging folder."""

    def write(self, folder: Path) -> None: ...


@dataclass(frozen=True)
class HFFiles:
    """The files besides tensors that make a loadable HF folder: config, generation config,
    tokenizer, processor, and the non-weight files of a base model folder (``assets``).
    Picklable, so a background writer can write them."""

    config: Any | None  # None: no model here (a PEFT adapter folder), so no config.json
    generation_config: Any | None
    tokenizer: Any | None
    processor: Any | None = None
    assets: str | None = None

    def write(self, folder: Path) -> None:
        """Write into ``folder``: first the base model's non-weight files (tokenizer and
        processor files, generation config, remote code...) when ``assets`` names a folder,
        then config.json (always the trained model's), generation_config.json (the model's, for
        models that generate, unless the base folder had one: a model built from a config
        carries only defaults), the tokenizer's and the processor's files, which replace
        same-named copies. Without a config (an adapter folder) neither config.json nor the
        base folder's copy of it is written. Local, not fsync'd (the commit does that). Only regular files are
        created, each by us; nothing is written through a link."""
        skip = () if self.config is not None else (CONFIG_FILE,)
        copied = copy_base_model_assets(Path(self.assets), folder, skip) if self.assets is not None else []
        if self.config is not None:
            self.config.save_pretrained(folder)
        if self.generation_config is not None and GENERATION_CONFIG_FILE not in copied:
            self.generation_config.save_pretrained(folder)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder)
        if self.processor is not None:
            self.processor.save_pretrained(folder)


def copy_base_model_assets(base: Path, folder: Path, skip: Sequence[str] = ()) -> list[str]:
    """Copy the regular top-level files of ``base`` that are not weights (nor a weight index,
    nor another checkpoint's manifest, nor named in ``skip``) into ``folder``; returns their
    names. Local. Links in
    ``base`` are read through (an HF cache snapshot is made of them); files in ``folder`` are
    created fresh, never opened through a link."""
    copied = []
    for source in sorted(base.iterdir()):
        name = source.name
        if name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json") or name == "areal_ckpt_manifest.json":
            continue
        if name.startswith(".") or name in skip or not source.is_file():
            continue
        target = folder / name
        if target.is_symlink():
            target.unlink()
        with open(source, "rb") as reader, open(target, "xb") as writer:
            while chunk := reader.read(1 << 20):
                writer.write(chunk)
        copied.append(name)
    return copied


def hf_files(
    config: Any,
    generation_config: Any | None,
    architecture: str,
    specs: Sequence[TensorSpec],
    dtype: torch.dtype | None,
    tokenizer: Any | None = None,
    processor: Any | None = None,
    assets: str | None = None,
) -> HFFiles:
    """The HF files of a model: a copy of its ``config`` with ``architectures`` and the exported
    ``dtype`` (the stored one of ``specs`` when ``dtype`` is None and all floats share one),
    its ``generation_config``, plus ``tokenizer``, ``processor`` and the base model folder
    ``assets`` (see :class:`HFFiles`); local."""
    config = copy.deepcopy(config)
    config.architectures = [architecture]
    if dtype is not None:
        config.dtype = dtype
    else:
        float_dtypes = {spec.dtype for spec in specs if spec.dtype.is_floating_point}
        if len(float_dtypes) == 1:
            config.dtype = float_dtypes.pop()
    return HFFiles(config, generation_config, tokenizer, processor, assets)


def write_metadata(plan: ExportPlan, folder: Path, files: FolderFiles) -> None:
    """Write ``files`` (config, tokenizer, ...) and the shard index (when sharded); local.

    Files are fsync'd later, when the commit writes the manifest.
    """
    files.write(folder)
    if plan.is_sharded:
        index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(plan.weight_map.items()))}
        write_file_durably(folder / INDEX_FILE, json.dumps(index, indent=2).encode())
