"""Saver: HuggingFace exports on epoch / step / time triggers, published atomically.

Saver = schedule (when) + engine (what) + export (an atomic HF folder) + retention (how many),
written in the caller's process or by a background writer (:mod:`areal_ckpt.background`).
Process-safe within one job: every rank calls :meth:`Saver.save` and rank 0 alone publishes.
Two jobs on one trial are refused by the trial lock.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_ckpt import dist
from areal_ckpt.background import BackgroundWriter, describe_metrics, resolve_async, saving_metrics
from areal_ckpt.commit import remove_folder, remove_stale
from areal_ckpt.config import SaverConfig
from areal_ckpt.errors import RankMismatchError
from areal_ckpt.export import ExportTarget, StagedExportSource, begin_export, finish_export, stage_export
from areal_ckpt.formats.hf_export import ExportSource
from areal_ckpt.layout import (
    EXPORT_STAGING_PREFIX,
    EXPORT_TRASH_PREFIX,
    default_user,
    export_leaf,
    export_trash,
    model_root,
    parse_export_leaf,
    trial_root,
)
from areal_ckpt.lock import acquire_trial_lock, release_trial_lock
from areal_ckpt.schedule import NamedSchedules, TriggerSchedule
from areal_ckpt.staging import StagedLayout
from areal_ckpt.step import FinetuneSpec
from areal_ckpt.tensors import EXPORT_DTYPES

logger = logging.getLogger("areal_ckpt.saver")

_STATE_VERSION = 1


class Saver:
    """Exports a model as a HuggingFace folder when its schedule says so.

    Creating one takes the trial's lock on rank 0 (see :mod:`areal_ckpt.lock`): a second job on
    the same trial is refused.

    Each model name (``actor``, ``critic``...) has its own schedule and its own folder under
    ``{fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}/{name}/``. An export is
    written to a staging folder, fsync'd, given a manifest and renamed into place, so a folder
    named ``epoch{E}epochstep{S}globalstep{G}`` is always complete.
    """

    def __init__(self, config: SaverConfig, ft_spec: FinetuneSpec) -> None:
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
        self._finalized = False
        self._writer = BackgroundWriter("saver", self.trial_root)
        self._pending: Path | None = None  # export in flight in the background
        if dist.rank() == 0:
            acquire_trial_lock(self.trial_root)
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
        Returns None when no export was due, else the export's folder. Synchronous mode blocks
        until that folder is complete and durable. Asynchronous mode (see
        :func:`areal_ckpt.background.resolve_async`) first waits for the export in flight, then
        blocks only while the tensors are copied to shared memory; the folder appears, complete,
        when the background commit finishes (:meth:`wait`). On failure the previous exports are
        untouched and an error is raised on every rank: by this call when synchronous, by the
        next due ``save``, :meth:`wait` or :meth:`finalize` when asynchronous.
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
        self._collect()
        tag = (name, epoch, epoch_step, global_step)
        tags = dist.all_gather_objects(list(tag))
        if any(tuple(other) != tag for other in tags):
            raise RankMismatchError(f"Saver.save: ranks disagree on (name, epoch, epoch_step, global_step): {tags}")
        final = self.export_root(name) / export_leaf(epoch, epoch_step, global_step)
        header = {"name": name, "step": {"epoch": epoch, "epoch_step": epoch_step, "global_step": global_step}}
        target = begin_export(engine, final, max_shard_size=self.config.max_shard_size, dtype=self._dtype,
                              tokenizer=tokenizer, header=header)
        if resolve_async(self.config.mode, engine.on_accelerator):
            try:
                layout = stage_export(engine, target, self._writer.arena)
            except BaseException:
                if dist.rank() == 0:
                    shutil.rmtree(target.staging, ignore_errors=True)
                raise
            self._writer.submit(_ExportJob(target, layout, self.config.keep_last))
            self._pending = final
            self.last_metrics = saving_metrics(time.perf_counter() - start, target.plan.total_size)
            return final
        written = finish_export(engine, target)
        if dist.rank() == 0 and self.config.keep_last is not None:
            apply_retention(final, self.config.keep_last)
        dist.barrier()
        self.last_metrics = saving_metrics(time.perf_counter() - start, written, background=0.0)
        logger.info("exported %s (%s)", final, describe_metrics(self.last_metrics))
        return final

    @property
    def saving_in_background(self) -> bool:
        """True while an asynchronous export is still being written; local, non-blocking."""
        return self._writer.busy

    def wait(self) -> None:
        """Block until the export in flight (async mode) is committed; no-op otherwise.

        Call it on every rank. Raises the background error, if the export failed.
        """
        self._collect()

    def _collect(self) -> None:
        outcome = self._writer.wait()
        if outcome is None:
            return
        final, self._pending = self._pending, None
        self.last_metrics = {**self.last_metrics, **saving_metrics(
            self.last_metrics["time/saving"], int(self.last_metrics["bytes"]), background=outcome.seconds)}
        logger.info("exported %s in the background (%s)", final, describe_metrics(self.last_metrics))

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable schedule state of every model name (for the RecoverHandler)."""
        return {"version": _STATE_VERSION, "schedules": self._schedules.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedules saved by :meth:`state_dict` so a resumed run keeps its cadence."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"saver state: unsupported version {state.get('version')!r}")
        self._schedules.load_state_dict(state["schedules"])

    def finalize(self) -> None:
        """Wait for the export in flight, stop the background writer, free its shared memory
        and release the trial's lock. Call it on every rank; idempotent. Raises the background
        error of the last export, after releasing everything."""
        try:
            self._collect()
        finally:
            self._writer.close()
            if dist.rank() == 0 and not self._finalized:
                release_trial_lock(self.trial_root)
            self._finalized = True


@dataclass(frozen=True)
class _ExportJob:
    """The background half of an asynchronous export: shards, commit, retention."""

    target: ExportTarget
    layout: StagedLayout
    keep_last: int | None

    def run(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Collective over the writers: write, publish, apply retention (rank 0)."""
        written = finish_export(StagedExportSource(tensors), self.target)
        if dist.rank() == 0 and self.keep_last is not None:
            apply_retention(self.target.final, self.keep_last)
        dist.barrier()
        return {"path": str(self.target.final), "bytes": written}


def apply_retention(newest: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` exports beside ``newest`` (by global step); local.

    Only folders named like exports are touched; ``newest`` is never removed. Failures are
    logged, not raised: the export they follow is already committed.
    """
    exports = sorted(
        (parsed[2], parsed[0], parsed[1], path)
        for path in newest.parent.iterdir()
        if path.is_dir() and (parsed := parse_export_leaf(path.name)) is not None
    )
    surplus = len(exports) - keep_last
    for _, _, _, path in exports[: max(surplus, 0)]:
        if path == newest:
            continue
        try:
            remove_folder(path, export_trash(path))
            logger.info("retention (keep_last=%d): removed %s", keep_last, path)
        except OSError as error:
            logger.warning("retention: could not remove %s: %s", path, error)
