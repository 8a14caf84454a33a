"""Saver: HuggingFace exports on epoch / step / time triggers, published atomically.

Saver = schedule (when) + engine (what) + export (an atomic HF folder) + retention (how many). Process-safe within one job: every rank calls
:meth:`Saver.save` and rank 0 alone publishes. Not safe for two jobs writing one trial.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from areal_ckpt import dist
from areal_ckpt.commit import remove_folder, remove_stale
from areal_ckpt.config import SaverConfig
from areal_ckpt.errors import RankMismatchError
from areal_ckpt.export import write_export
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
        self._finalized = False
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
        tag = (name, epoch, epoch_step, global_step)
        tags = dist.all_gather_objects(list(tag))
        if any(tuple(other) != tag for other in tags):
            raise RankMismatchError(f"Saver.save: ranks disagree on (name, epoch, epoch_step, global_step): {tags}")
        final = self.export_root(name) / export_leaf(epoch, epoch_step, global_step)
        header = {"name": name, "step": {"epoch": epoch, "epoch_step": epoch_step, "global_step": global_step}}
        result = write_export(
            engine, final, max_shard_size=self.config.max_shard_size, dtype=self._dtype, tokenizer=tokenizer,
            header=header,
        )
        self.last_metrics = {
            "time/saving": result.seconds,
            "bytes": float(result.bytes),
            "gbps": result.bytes / result.seconds / 1e9 if result.seconds > 0 else 0.0,
        }
        logger.info("exported %s (%.3f GB in %.2f s, %.2f GB/s)", final, result.bytes / 1e9, result.seconds,
                    self.last_metrics["gbps"])
        if dist.rank() == 0 and self.config.keep_last is not None:
            self._apply_retention(final)
        dist.barrier()
        return final

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
        """Finish outstanding work and release the trial's lock; local, idempotent. In sync mode
        every export is already durable when ``save`` returns."""
        if dist.rank() == 0 and not self._finalized:
            release_trial_lock(self.trial_root)
        self._finalized = True
