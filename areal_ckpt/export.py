"""Write one HuggingFace export folder, atomically: the I/O the Saver and the converter share.

Policy (when to export, which folder, how many to keep) belongs to the callers; this module
only makes a complete, checksummed, durable folder appear under its final name.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from areal_ckpt import dist
from areal_ckpt._version import __version__
from areal_ckpt.commit import publish, write_manifest
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.hf_export import ExportPlan, ExportSource, plan_export, write_metadata, write_rank_shards
from areal_ckpt.fsio import FileRecord
from areal_ckpt.layout import MANIFEST_NAME, export_staging, export_trash

logger = logging.getLogger("areal_ckpt.export")

EXPORT_FORMAT = "areal_ckpt.hf_export"


@dataclass(frozen=True)
class ExportResult:
    """A committed export: where it is, how many tensor bytes it holds, how long it took."""

    path: Path
    bytes: int
    seconds: float


def write_export(
    source: ExportSource,
    final: Path,
    *,
    max_shard_size: int,
    dtype: torch.dtype | None,
    tokenizer: Any | None,
    header: dict[str, Any],
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
) -> ExportResult:
    """Export ``source`` to the folder ``final``, replacing a folder of that name whole.

    Collective: every rank calls it; each writes its shard files, rank 0 writes the metadata
    and publishes. Blocking; on return the folder is complete and durable on every rank's view.
    On failure nothing is published, the staging folder is removed and every rank raises.
    """
    start = time.perf_counter()
    rank, world = dist.rank(), dist.world_size()
    staging = export_staging(final)
    prepared = _prepare_staging(staging) if rank == 0 else True
    if not dist.all_true(prepared):
        raise CheckpointError(f"{staging}: could not create the staging folder (see rank 0's log)")
    plan = plan_export(source.export_specs(), max_shard_size, dtype)
    records, error = write_rank_shards(source, plan, staging, rank, world, dtype, progress)
    if error is not None:
        logger.error("rank %d: writing export shards into %s failed: %s", rank, staging, error)
    all_records = dist.all_gather_objects(
        {file: (rec.size, rec.crc32) for file, rec in records.items()} if error is None else None
    )
    if any(part is None for part in all_records):
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        failed = [r for r, part in enumerate(all_records) if part is None]
        raise CheckpointError(f"{final}: export failed on rank(s) {failed}: {error}; nothing was published")
    outcome = None
    if rank == 0:
        outcome = _commit(source, plan, staging, final, tokenizer, dtype, all_records, header)
    outcome = dist.broadcast_object(outcome, src=0)
    if outcome is not None:
        raise CheckpointError(f"{final}: commit failed on rank 0: {outcome}; nothing was published")
    return ExportResult(path=final, bytes=plan.total_size, seconds=time.perf_counter() - start)


def _prepare_staging(staging: Path) -> bool:
    try:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        return True
    except OSError as error:
        logger.error("cannot create staging folder %s: %s", staging, error)
        return False


def _commit(
    source: ExportSource,
    plan: ExportPlan,
    staging: Path,
    final: Path,
    tokenizer: Any,
    dtype: torch.dtype | None,
    all_records: list[dict[str, tuple[int, int]]],
    header: dict[str, Any],
) -> str | None:
    """Rank 0: metadata, manifest, publish. Returns None on success, else the error text."""
    try:
        write_metadata(source, plan, staging, dtype, tokenizer)
        records = {file: FileRecord(size, crc) for part in all_records for file, (size, crc) in part.items()}
        full_header = {
            "format": EXPORT_FORMAT,
            "areal_ckpt_version": __version__,
            "torch_version": torch.__version__,
            "world_size": dist.world_size(),
            **header,
        }
        write_manifest(staging, MANIFEST_NAME, records, full_header)
        publish(staging, final, export_trash(final))
        return None
    except Exception as error:  # reported to every rank, which all raise
        logger.error("commit of %s failed: %s", final, error)
        shutil.rmtree(staging, ignore_errors=True)
        return str(error)
