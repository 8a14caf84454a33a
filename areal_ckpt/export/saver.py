"""Saver: HuggingFace exports on epoch / step / time triggers, published atomically.

Saver = schedule (when) + engine (what) + export (an atomic HF folder) + retention (how many),
written in the caller's process or by a background writer (:mod:`areal_ckpt.jobs.background`).
Process-safe within one job: every rank calls :meth:`Saver.save` and rank 0 alone publishes.
Two jobs on one trial are refused: by the trial lock on a folder, by the commit on object storage.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_ckpt import agree, dist
from areal_ckpt.config import SaverConfig
from areal_ckpt.engines.accept import HFAssets, as_engine, check_engines
from areal_ckpt.engines.contract import Engine, EngineLike
from areal_ckpt.engines.peft_export import export_source
from areal_ckpt.export.job import ExportTarget, StagedExportSource, begin_export, finish_export, stage_export
from areal_ckpt.jobs.lifecycle import SaveLifecycle, resolve_async
from areal_ckpt.jobs.shm_arena import ArenaLayout
from areal_ckpt.paths import (
    EXPORT_STAGING_PREFIX,
    EXPORT_TRASH_PREFIX,
    default_user,
    export_leaf,
    model_root,
    parse_export_leaf,
    recover_checkpoint_link,
    trial_root,
)
from areal_ckpt.publish import TrashCollector, remove_stale
from areal_ckpt.schedule import NamedSchedules, TriggerSchedule, warn_if_never_due
from areal_ckpt.state.rng import python_random_kept
from areal_ckpt.step import FinetuneSpec
from areal_ckpt.storage.location import remove_trash, retain
from areal_ckpt.storage.retention import KeepLast
from areal_ckpt.storage.trials import export_trial
from areal_ckpt.tensors import EXPORT_DTYPES

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


class Saver:
    """Exports a model as a HuggingFace folder when its schedule says so.

    Creating one takes the trial's lock on rank 0 (see :mod:`areal_ckpt.lock`): a second job on
    the same trial is refused. On object storage, where no lock dies with its holder, an export
    whose commit would follow another job's commit since this Saver started is refused instead
    (:class:`~areal_ckpt.storage.object_location.ObjectLocation`).

    Each model name (``actor``, ``critic``...) has its own schedule and its own folder under
    ``{fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}/{name}/``. An export is
    written to a staging folder, fsync'd, given a manifest and renamed into place, so a folder
    named ``epoch{E}epochstep{S}globalstep{G}`` is always complete.
    """

    @python_random_kept()  # its check of object storage may be retried (botocore's jitter)
    def __init__(self, config: SaverConfig | Any, ft_spec: FinetuneSpec) -> None:
        self.config = config = SaverConfig.of(config)
        self.ft_spec = ft_spec
        user = config.user or default_user()
        #: Where the trial's exports live (a folder, or a prefix of an object store staged locally).
        self.trial = export_trial(
            config.fileroot, ("checkpoints", user, config.experiment_name, config.trial_name), config.staging_dir
        )
        self.trial_root = self.trial.staging
        self.trial.make_staging()
        agree.decided_by_rank0(self.trial.open, f"Saver: cannot use {self.trial.where()}")
        self._schedules = NamedSchedules(
            lambda: TriggerSchedule(config.freq_epochs, config.freq_steps, config.freq_secs)
        )
        warn_if_never_due("saver", config.freq_epochs, config.freq_steps, config.freq_secs)
        self._dtype = EXPORT_DTYPES[config.export_dtype] if config.export_dtype else None
        self._jobs = SaveLifecycle("saver", self.trial_root, lock=dist.rank() == 0)
        self._went_async = False  # an export of this Saver was written in the background
        self._trash = TrashCollector()  # deletes exports that retention removed, on a helper thread
        if dist.rank() == 0:
            remove_stale(
                (p for p in self.trial_root.iterdir() if p.is_dir() and not p.is_symlink()),
                (EXPORT_STAGING_PREFIX, EXPORT_TRASH_PREFIX),
            )

    @property
    def last_metrics(self) -> dict[str, float]:
        """The last export's ``time/saving``, ``time/background``, ``bytes`` and ``gbps``."""
        return self._jobs.last_metrics

    def export_root(self, name: str = "default") -> Path:
        """Folder holding every export of model ``name`` (no side effects)."""
        return model_root(self.trial_root, name)

    # -- AReaL's static path helpers: our layout's paths; unlike AReaL's, they create nothing --

    @staticmethod
    def get_save_root(experiment_name: str, trial_name: str, fileroot: str) -> str:
        """``{fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}`` for the login user
        (the config's ``user:`` is not an argument here, as in AReaL); a URL when ``fileroot``
        is one; pure."""
        return export_trial(fileroot, ("checkpoints", default_user(), experiment_name, trial_name), None).where()

    @staticmethod
    def get_model_save_root(experiment_name: str, trial_name: str, fileroot: str, name: str = "default") -> str:
        """Folder (or URL) of model ``name``'s exports; pure."""
        root = Saver.get_save_root(experiment_name, trial_name, fileroot)
        return f"{root}/{model_root(Path(), name).name}"

    @staticmethod
    def get_model_save_path(
        experiment_name: str,
        trial_name: str,
        fileroot: str,
        epoch: int,
        step: int,
        globalstep: int,
        name: str = "default",
    ) -> str:
        """Folder of one export, ``.../{name}/epoch{E}epochstep{S}globalstep{G}``; pure."""
        root = Saver.get_model_save_root(experiment_name, trial_name, fileroot, name)
        return f"{root}/{export_leaf(epoch, step, globalstep)}"

    @staticmethod
    def get_recover_checkpoint_path(experiment_name: str, trial_name: str, fileroot: str, name: str = "default") -> str:
        """``.../{name}/recover_checkpoint``: the link to model ``name``'s folder of the committed
        recovery generation (see docs/layout.md); pure."""
        root = trial_root(fileroot, default_user(), experiment_name, trial_name)  # a URL is refused: no links there
        return str(recover_checkpoint_link(root, name))

    @python_random_kept()  # a retried request to object storage draws from it (botocore's jitter)
    def save(
        self,
        engine: EngineLike,
        epoch: int,
        step: int,
        global_step: int,
        name: str = "default",
        tokenizer: Any | None = None,
        processor: Any | None = None,
        base_model_path: str | None = None,
        *,
        force: bool = False,
    ) -> str | None:
        """Export ``engine``'s model if the schedule of ``name`` says so (or ``force``).

        AReaL's call: ``step`` is the step within ``epoch`` (both from 0). ``engine`` is any
        engine :mod:`areal_ckpt.engines.contract` accepts. ``tokenizer`` and ``processor`` are
        saved into the export with ``save_pretrained``; ``base_model_path`` (default: an
        AReaL-shaped engine's ``config.path``) is a model folder whose non-weight files
        (tokenizer and processor files, generation config, remote code) are copied first, so the
        export loads like the base model did; what this call writes replaces same-named copies.

        Collective: every rank calls it with the same arguments after each training step.
        Returns None when no export was due, else the export's folder. Synchronous mode blocks
        until that folder is complete and durable. Asynchronous mode (see
        :func:`areal_ckpt.jobs.lifecycle.resolve_async`) first waits for the export in flight, then
        blocks only while the tensors are copied to shared memory; the folder appears, complete,
        when the background commit finishes (:meth:`wait`). On failure the previous exports are
        untouched and an error is raised on every rank: by this call when synchronous, by the
        next due ``save``, :meth:`wait` or :meth:`finalize` when asynchronous.
        """
        check_engines(engine, "Saver.save")  # a wrong argument fails at the first call, due or not
        schedule = self._schedules[name]
        due = schedule.should_fire(self.ft_spec.is_epoch_last_step(step))
        if not (due or force):
            return None
        exported = as_engine(engine, "Saver.save")
        assets = HFAssets.of(engine, tokenizer, processor, base_model_path)
        return str(self._export(exported, epoch, step, global_step, name, assets))

    def _export(
        self, engine: Engine, epoch: int, epoch_step: int, global_step: int, name: str, assets: HFAssets
    ) -> str:
        start = time.perf_counter()
        self._jobs.wait()
        tag = (name, epoch, epoch_step, global_step)
        agree.require_same(list(tag), "Saver.save: ranks disagree on (name, epoch, epoch_step, global_step)")
        final = self.export_root(name) / export_leaf(epoch, epoch_step, global_step)
        header = {"name": name, "step": {"epoch": epoch, "epoch_step": epoch_step, "global_step": global_step}}
        source = export_source(engine, self.config.lora, assets.base_model_path)
        target = begin_export(
            source,
            final,
            max_shard_size=self.config.max_shard_size,
            dtype=self._dtype,
            header=header,
            tokenizer=assets.tokenizer,
            processor=assets.processor,
            assets=assets.base_model_path,
            series=self.trial.series(model_root(Path(), name).name),
        )
        if resolve_async(self.config.mode, source.on_accelerator):
            self._went_async = True
            try:
                layout = stage_export(source, target, self._jobs.arena)
            except BaseException:
                if dist.rank() == 0:
                    shutil.rmtree(target.staging, ignore_errors=True)
                raise
            job = _ExportJob(target, layout, self.config.keep_last)
            self._jobs.submit(
                job, time.perf_counter() - start, target.plan.total_size, lambda _: f"exported {target.location}"
            )
            return target.location
        written = finish_export(source, target)
        if dist.rank() == 0 and self.config.keep_last is not None:  # deleted after the commit, off this path
            self._trash.delete(apply_retention(target, self.config.keep_last))
        dist.barrier()
        self._jobs.finished(time.perf_counter() - start, written, f"exported {target.location}")
        return target.location

    @property
    def is_async(self) -> bool:
        """True when exports are written in the background: mode ``async``, or ``auto`` once an
        export was (its model is on an accelerator); AReaL's trainers skip a barrier then. Local."""
        return self.config.mode == "async" or self._went_async

    def maybe_wait_for_staging(self) -> None:
        """AReaL calls this before a training step changes the weights. Here ``save`` returns
        only after the tensors it exports are copied (staged) out of the model, so there is
        nothing to wait for: returns at once; local."""

    @property
    def saving_in_background(self) -> bool:
        """True while an asynchronous export is still being written; local, non-blocking."""
        return self._jobs.busy

    def wait(self) -> None:
        """Block until the export in flight (async mode) is committed; no-op otherwise.

        Call it on every rank. Raises the background error, if the export failed.
        """
        self._jobs.wait()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable schedule state of every model name (for the RecoverHandler)."""
        return saver_state(self._schedules.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedules saved by :meth:`state_dict` so a resumed run keeps its cadence."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"saver state: unsupported version {state.get('version')!r}")
        self._schedules.load_state_dict(state["schedules"])

    def finalize(self) -> None:
        """Wait for the export in flight, stop the background writer, free its shared memory,
        finish deleting what retention removed and release the trial's lock. Call it on every
        rank; idempotent. Raises the background error of the last export, after releasing
        everything. AReaL's name; :meth:`close` is the same, as on the RecoverHandler."""
        self._jobs.close(then=self._trash.close)

    close = finalize


@dataclass(frozen=True)
class _ExportJob:
    """The background half of an asynchronous export: shards, commit, retention."""

    target: ExportTarget
    layout: ArenaLayout
    keep_last: int | None

    def run(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Collective over the writers: write, publish, apply retention (rank 0)."""
        written = finish_export(StagedExportSource(tensors), self.target)
        if dist.rank() == 0 and self.keep_last is not None:  # the writer is off the loop's path already
            remove_trash(apply_retention(self.target, self.keep_last))
        dist.barrier()
        return {"path": self.target.location, "bytes": written}


def apply_retention(newest: ExportTarget, count: int) -> list[Path]:
    """Rank 0, after ``newest`` was committed: remove all but the newest ``count`` exports of its
    series (by global step, then commit order; the :class:`~areal_ckpt.storage.retention.KeepLast`
    policy), never ``newest`` itself, so that no reader finds them any more. Returns the local
    trash folders for the caller to delete (off the training loop's path). Failures are logged,
    not raised: the export they follow is already committed."""
    try:
        series = newest.series
        doomed, trash = retain(series, KeepLast(count), newest.reserved, _step_of)
    except Exception as error:
        logger.warning("retention: could not remove old exports beside %s: %s", newest.location, error)
        return []
    for entry in doomed:
        logger.info("retention (keep_last=%d): removed %s", count, series.where(entry.name))
    return trash


def _step_of(name: str) -> int | None:
    """The global step of an export folder's name (None for any other name)."""
    parsed = parse_export_leaf(name)
    return None if parsed is None else parsed[2]


def saver_state(schedules: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The state :meth:`Saver.load_state_dict` takes: each model name's schedule state; pure."""
    return {"version": _STATE_VERSION, "schedules": schedules}
