"""Saver: HuggingFace exports on epoch / step / time triggers, published atomically.

Saver = schedule (when) + engine (what) + formats.hf_export (how bytes are laid out) +
commit (how a folder becomes visible). Process-safe within one job: every rank calls
:meth:`Saver.save` and rank 0 alone publishes. Not safe for two jobs writing one trial.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from areal_ckpt import dist
from areal_ckpt._version import __version__
from areal_ckpt.commit import publish, remove_folder, remove_stale, write_manifest
from areal_ckpt.config import SaverConfig
from areal_ckpt.errors import CheckpointError, RankMismatchError
from areal_ckpt.fsio import FileRecord
from areal_ckpt.formats.hf_export import ExportPlan, ExportSource, plan_export, write_metadata, write_rank_shards
from areal_ckpt.layout import (
    EXPORT_STAGING_PREFIX,
    EXPORT_TRASH_PREFIX,
    MANIFEST_NAME,
    default_user,
    export_leaf,
    export_staging,
    export_trash,
    model_root,
    parse_export_leaf,
    trial_root,
)
from areal_ckpt.schedule import NamedSchedules, TriggerSchedule
from areal_ckpt.step import FinetuneSpec
from areal_ckpt.tensors import EXPORT_DTYPES

logger = logging.getLogger("areal_ckpt.saver")

_STATE_VERSION = 1


class Saver:
    """Exports a model as a HuggingFace folder when its schedule says so.

    Each model name (``actor``, ``critic``...) has its own schedule and its own folder under
    ``{fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}/{name}/``. An export is
    written to a staging folder, fsync'd, given a manifest and renamed into place, so a folder
    named ``epoch{E}epochstep{S}globalstep{G}`` is always complete.
    """

    def __init__(self, config: SaverConfig, ft_spec: FinetuneSpec) -> None:
        if config.mode == "async":
            raise NotImplementedError(
                "saver.mode: 'async' is not implemented yet; use 'sync' or 'auto' (auto is sync for now)"
            )
        self.config = config
        self.ft_spec = ft_spec
        self.trial_root = trial_root(
            config.fileroot, config.user or default_user(), config.experiment_name, config.trial_name
        )
        self._schedules = NamedSchedules(
            lambda: TriggerSchedule(config.freq_epochs, config.freq_steps, config.freq_secs)
        )
        self._dtype = EXPORT_DTYPES[config.export_dtype] if config.export_dtype else None
        self.last_metrics: dict[str, float] = {}
        if dist.rank() == 0 and self.trial_root.is_dir():
            remove_stale(
                (p for p in self.trial_root.iterdir() if p.is_dir() and not p.is_symlink()),
                (EXPORT_STAGING_PREFIX, EXPORT_TRASH_PREFIX),
            )

    def export_root(self, name: str = "default") -> Path:
        """Folder holding every export of model ``name`` (no side effects)."""
        return model_root(self.trial_root, name)

    def save(
        self,
        engine: ExportSource,
        epoch: int,
        epoch_step: int,
        global_step: int,
        name: str = "default",
        tokenizer: Any | None = None,
        force: bool = False,
    ) -> str | None:
        """Export ``engine``'s model if the schedule of ``name`` says so (or ``force``).

        Collective: every rank calls it with the same arguments after each training step.
        Blocking; when it returns a path, that folder is complete and durable. Returns None when
        no export was due. On failure the previous exports are untouched and an error is raised
        on every rank.
        """
        schedule = self._schedules[name]
        due = schedule.should_fire(self.ft_spec.is_epoch_last_step(epoch_step))
        if not (due or force):
            return None
        if force and not due:
            schedule.mark_fired()
        return str(self._export(engine, epoch, epoch_step, global_step, name, tokenizer))

    def _export(
        self, engine: ExportSource, epoch: int, epoch_step: int, global_step: int, name: str, tokenizer: Any
    ) -> Path:
        start = time.perf_counter()
        rank, world = dist.rank(), dist.world_size()
        tag = (name, epoch, epoch_step, global_step)
        tags = dist.all_gather_objects(list(tag))
        if any(tuple(other) != tag for other in tags):
            raise RankMismatchError(f"Saver.save: ranks disagree on (name, epoch, epoch_step, global_step): {tags}")
        final = self.export_root(name) / export_leaf(epoch, epoch_step, global_step)
        staging = export_staging(final)
        prepared = True
        if rank == 0:
            prepared = self._prepare_staging(staging)
        if not dist.all_true(prepared):
            raise CheckpointError(f"{staging}: could not create the staging folder (see rank 0's log)")
        plan = plan_export(engine.export_specs(), self.config.max_shard_size, self._dtype)
        records, error = write_rank_shards(engine, plan, staging, rank, world, self._dtype)
        if error is not None:
            logger.error("rank %d: writing export shards into %s failed: %s", rank, staging, error)
        all_records = dist.all_gather_objects(
            {file: (rec.size, rec.crc32) for file, rec in records.items()} if error is None else None
        )
        if any(part is None for part in all_records):
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            failed = [r for r, part in enumerate(all_records) if part is None]
            raise CheckpointError(f"{final}: export failed on rank(s) {failed}; previous exports are intact") from error
        committed: str | None = None
        if rank == 0:
            committed = self._commit(engine, plan, staging, final, tokenizer, all_records, tag)
        committed = dist.broadcast_object(committed, src=0)
        if committed is None or committed.startswith("error:"):
            raise CheckpointError(f"{final}: commit failed on rank 0: {committed}")
        seconds = time.perf_counter() - start
        self.last_metrics = {
            "time/saving": seconds,
            "bytes": float(plan.total_size),
            "gbps": plan.total_size / seconds / 1e9 if seconds > 0 else 0.0,
        }
        logger.info("exported %s (%.3f GB in %.2f s, %.2f GB/s)", final, plan.total_size / 1e9, seconds, self.last_metrics["gbps"])
        if rank == 0 and self.config.keep_last is not None:
            self._apply_retention(final)
        dist.barrier()
        return final

    def _prepare_staging(self, staging: Path) -> bool:
        try:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
            return True
        except OSError as error:
            logger.error("cannot create staging folder %s: %s", staging, error)
            return False

    def _commit(
        self,
        engine: ExportSource,
        plan: ExportPlan,
        staging: Path,
        final: Path,
        tokenizer: Any,
        all_records: list[dict[str, tuple[int, int]]],
        tag: tuple[str, int, int, int],
    ) -> str:
        try:
            write_metadata(engine, plan, staging, self._dtype, tokenizer)
            records = {
                file: FileRecord(size, crc)
                for part in all_records
                for file, (size, crc) in part.items()
            }
            header = {
                "format": "areal_ckpt.hf_export",
                "areal_ckpt_version": __version__,
                "torch_version": torch.__version__,
                "world_size": dist.world_size(),
                "name": tag[0],
                "step": {"epoch": tag[1], "epoch_step": tag[2], "global_step": tag[3]},
            }
            write_manifest(staging, MANIFEST_NAME, records, header)
            publish(staging, final, export_trash(final))
            return str(final)
        except Exception as error:  # reported to every rank, which all raise
            logger.error("commit of %s failed: %s", final, error)
            shutil.rmtree(staging, ignore_errors=True)
            return f"error: {error}"

    def _apply_retention(self, newest: Path) -> None:
        exports = sorted(
            (parsed[2], parsed[0], parsed[1], path)
            for path in newest.parent.iterdir()
            if path.is_dir() and (parsed := parse_export_leaf(path.name)) is not None
        )
        surplus = len(exports) - self.config.keep_last
        for _, _, _, path in exports[: max(surplus, 0)]:
            if path == newest:
                continue
            try:
                remove_folder(path, export_trash(path))
                logger.info("retention (keep_last=%d): removed %s", self.config.keep_last, path)
            except OSError as error:
                logger.warning("retention: could not remove %s: %s", path, error)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable schedule state of every model name (for the RecoverHandler)."""
        return {"version": _STATE_VERSION, "schedules": self._schedules.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedules saved by :meth:`state_dict` so a resumed run keeps its cadence."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"saver state: unsupported version {state.get('version')!r}")
        self._schedules.load_state_dict(state["schedules"])

    def finalize(self) -> None:
        """Finish outstanding work; in sync mode every export is already durable, so this is a
        local no-op kept for API parity with async mode. Idempotent."""
