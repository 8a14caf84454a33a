"""Write one HuggingFace export folder, atomically: the I/O the Saver and the converter share.

Policy (when to export, which folder, how many to keep) belongs to the callers; this module
only makes a complete, checksummed, durable checkpoint join its series
(a :class:`~areal_ckpt.storage.location.Location`, wherever it lives): the small files are
written to the local staging folder, the shards there or straight to the store as the series
says, and rank 0 commits. The staging folder is gone once the commit is made.
"""

from __future__ import annotations

import functools
import itertools
import logging
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from areal_ckpt import agree, dist
from areal_ckpt._version import __version__
from areal_ckpt.engines.accept import export_files
from areal_ckpt.engines.contract import ExportSource, SelfPlannedExport
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.hf_export import (
    ExportPlan,
    FolderFiles,
    TensorSource,
    names_of_rank,
    plan_export,
    write_metadata,
    write_rank_shards,
)
from areal_ckpt.formats.hf_keys import check_loadable
from areal_ckpt.fsio import FileRecord, make_dirs
from areal_ckpt.jobs.shm_arena import ArenaLayout, StagingArena, arena_layout_of_specs
from areal_ckpt.paths import EXPORT_FORMAT, MANIFEST_NAME, export_staging
from areal_ckpt.publish import write_manifest
from areal_ckpt.storage.folder_location import FolderLocation
from areal_ckpt.storage.location import Location

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    """A committed export: where it is, how many tensor bytes it holds, how long it took."""

    path: Path
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ExportTarget:
    """A begun export (staging folder made, metadata written); plain, picklable data.

    ``series`` is where the model's exports live (``final``, in the local staging root, is
    where this one is staged, and where it lands when the series is that folder);
    ``reserved`` the name it is committed under (``final``'s name, or on object storage that
    with ``.{n}`` appended when an earlier export of the same step left objects there)."""

    final: Path
    plan: ExportPlan
    dtype: torch.dtype | None
    header: dict[str, Any]
    series: Location
    reserved: str = ""

    @property
    def staging(self) -> Path:
        """The folder the shards are written into before the publish."""
        return export_staging(self.final)

    @property
    def location(self) -> str:
        """Where the committed export is: its folder, or its URL on object storage."""
        return self.series.where(self.reserved)


class StagedExportSource:
    """An export source whose tensors are already full and local (staged, or a converter's)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each name of this rank's entry of ``files`` with its tensor; local, no copy."""
        for name in names_of_rank(files):
            yield name, self.tensors[name]


def write_export(
    source: ExportSource,
    final: Path,
    *,
    max_shard_size: int,
    dtype: torch.dtype | None,
    header: dict[str, Any],
    tokenizer: Any | None = None,
    processor: Any | None = None,
    assets: str | None = None,
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
    series: Location | None = None,
) -> ExportResult:
    """Export ``source`` to the folder ``final``, replacing a folder of that name whole.

    Collective: every rank calls it; each writes its shard files, rank 0 writes the metadata
    and publishes. Blocking; on return the folder is complete and durable on every rank's view.
    On failure nothing is published, the staging folder is removed and every rank raises.
    ``tokenizer``, ``processor`` and ``assets`` (a base model folder) are as in :class:`HFFiles`;
    ``series`` as in :func:`begin_export`.
    """
    start = time.perf_counter()
    target = begin_export(
        source,
        final,
        max_shard_size=max_shard_size,
        dtype=dtype,
        header=header,
        tokenizer=tokenizer,
        processor=processor,
        assets=assets,
        series=series,
    )
    written = finish_export(source, target, progress)
    return ExportResult(path=final, bytes=written, seconds=time.perf_counter() - start)


def begin_export(
    source: ExportSource,
    final: Path,
    *,
    max_shard_size: int,
    dtype: torch.dtype | None,
    header: dict[str, Any],
    tokenizer: Any | None = None,
    processor: Any | None = None,
    assets: str | None = None,
    series: Location | None = None,
) -> ExportTarget:
    """Plan the export and have rank 0 create the staging folder with the config, index,
    tokenizer, processor and base model assets in it (see :class:`HFFiles`). Collective;
    blocking; raises on every rank if rank 0 could not, and on every rank before anything is
    written when ``from_pretrained`` would not load the export's names (:func:`check_loadable`,
    or the source's own check when it plans its own folder: a PEFT model's). ``series`` (default:
    the folder holding ``final``) is where the export is committed, under the name rank 0
    reserves here (on object storage never one an earlier export used)."""
    files: Callable[[], FolderFiles]
    if isinstance(source, SelfPlannedExport):
        source.check(str(final))
        plan = source.plan(max_shard_size, dtype)
        files = functools.partial(source.folder_files, dtype, tokenizer, processor, assets)
    else:
        specs = source.export_specs()
        if source.config is not None:  # without one, export_files below says how to export
            check_loadable(source.config, source.architecture, [spec.name for spec in specs], str(final))
        plan = plan_export(specs, max_shard_size, dtype)
        files = functools.partial(export_files, source, dtype, tokenizer, processor, assets)
    target = ExportTarget(
        final=final,
        plan=plan,
        dtype=dtype,
        header={
            "format": EXPORT_FORMAT,
            "areal_ckpt_version": __version__,
            "torch_version": torch.__version__,
            "world_size": dist.world_size(),
            **header,
        },
        series=FolderLocation(final.parent) if series is None else series,
    )
    reserved = agree.decided_by_rank0(
        lambda: _prepare_staging(target, files),
        f"{target.staging}: could not prepare the export (nothing was published)",
    )
    return replace(target, reserved=reserved)


def stage_export(source: ExportSource, target: ExportTarget, arena: StagingArena) -> ArenaLayout:
    """Copy the tensors of this rank's files of ``target`` into ``arena``; collective (ranks
    agree the arena could be allocated; a sharded source gathers every tensor in turn).
    Blocking."""
    mine = target.plan.files_of_rank(dist.rank(), dist.world_size())
    specs = {spec.name: spec for spec in source.export_specs()}
    names = [name for file_name in mine for name in target.plan.files[file_name]]
    layout = arena_layout_of_specs((name, specs[name].dtype, specs[name].shape) for name in names)
    files, world = list(target.plan.files.values()), dist.world_size()
    gathered = itertools.chain.from_iterable(  # every round of files in plan order
        source.gather_round(files[start : start + world]) for start in range(0, len(files), world)
    )
    arena.stage(layout, gathered)
    return layout


def finish_export(
    source: TensorSource,
    target: ExportTarget,
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
) -> int:
    """Write this rank's shard files, then rank 0 writes the manifest and publishes.

    Collective over the current process group (the job's, or the background writers');
    blocking. Returns the export's tensor bytes. On failure the staging folder is removed,
    nothing is published and every rank raises.
    """
    rank, world = dist.rank(), dist.world_size()

    def write_shards() -> dict[str, tuple[int, int]]:
        open_writer = target.series.writer_of(target.reserved)  # to the store from memory, or staged
        target.series.join_staging(target.staging)
        records, error = write_rank_shards(  # staged for upload: durable once the store holds them
            source,
            target.plan,
            target.staging,
            rank,
            world,
            target.dtype,
            progress,
            open_writer=open_writer,
        )
        if error is not None:
            logger.error("rank %d: writing export shards into %s failed: %s", rank, target.staging, error)
            raise CheckpointError(error)
        return {file: (record.size, record.crc32) for file, record in records.items()}

    try:
        agree.gathered_then_decided(
            write_shards,
            lambda every: _publish(target, every),
            f"{target.final}: export failed (nothing was published)",
        )
    except BaseException:
        shutil.rmtree(target.staging, ignore_errors=True)
        if rank == 0:
            target.series.discard(target.reserved)
        raise
    if target.staging.exists():  # a copy left after an upload (a folder's commit renamed it away)
        shutil.rmtree(target.staging, ignore_errors=True)
    return target.plan.total_size


def _prepare_staging(target: ExportTarget, files: Callable[[], FolderFiles]) -> str:
    """Rank 0: a fresh staging folder holding the metadata files; removed again if that failed.
    Returns the name the series reserved for the export."""
    try:
        if target.staging.exists():
            shutil.rmtree(target.staging)
        make_dirs(target.staging.parent)  # the model's folder, durably: the publish renames into it
        target.staging.mkdir()
        write_metadata(target.plan, target.staging, files())
        return target.series.reserve(target.final.name)
    except Exception as error:  # every rank raises it (see begin_export)
        logger.error("cannot prepare staging folder %s: %s", target.staging, error)
        shutil.rmtree(target.staging, ignore_errors=True)
        raise


def _publish(target: ExportTarget, every: list[dict[str, tuple[int, int]]]) -> None:
    """Rank 0: manifest, commit (the caller removes the staging folder if this fails)."""
    records = {file: FileRecord(size, crc) for part in every for file, (size, crc) in part.items()}
    write_manifest(target.staging, MANIFEST_NAME, records, target.header)
    body = {"name": target.final.name, "step": target.header.get("step")}
    target.series.commit(target.staging, target.reserved, set(records), body)
