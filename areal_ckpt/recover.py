"""RecoverHandler: full-state recovery checkpoints, resumed automatically and bit-exactly.

RecoverHandler = schedule (when) + engines (model / optimizer / scheduler state through DCP) +
state (RNG, dataloader, component states as JSON) + recover_store (atomic generations).
Job-safe for one job per trial; process-safe within it: every rank calls ``dump`` / ``load``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from areal_ckpt import dist
from areal_ckpt._version import __version__
from areal_ckpt.commit import check_files, read_manifest
from areal_ckpt.config import RecoverConfig
from areal_ckpt.errors import CheckpointError, CollectiveError, RankMismatchError
from areal_ckpt.formats.dcp_io import load_tensors, save_tensors
from areal_ckpt.formats.hf_export import write_config
from areal_ckpt.fsio import FileRecord, record_of, write_file_durably
from areal_ckpt.layout import ENGINE_STATE_FILE, HF_FILES, RECOVER_INFO, RECOVER_MANIFEST, default_user, trial_root
from areal_ckpt.lock import acquire_trial_lock, release_trial_lock
from areal_ckpt.recover_store import RecoverStore
from areal_ckpt.schedule import TriggerSchedule
from areal_ckpt.state import safe_json
from areal_ckpt.state.components import Stateful, capture_components, dataloader_state, restore_components
from areal_ckpt.state.recover_info import RecoverInfo, read_recover_info, write_global_info, write_rank_state
from areal_ckpt.state.rng import capture_rng_state, restore_rng_state
from areal_ckpt.step import FinetuneSpec, StepInfo

logger = logging.getLogger("areal_ckpt.recover")

RECOVER_FORMAT = "areal_ckpt.recover"
RECOVER_FORMAT_VERSION = 1
_OPTIMIZER_PREFIX = "optim."


class _AttemptFailed(Exception):
    """A dump attempt failed on some rank; every rank raises it (retried by ``dump``)."""


def _enabled(config: RecoverConfig) -> bool:
    return config.mode in ("on", "auto")


def _store_of(config: RecoverConfig) -> RecoverStore:
    return RecoverStore(trial_root(config.fileroot, config.user or default_user(), config.experiment_name, config.trial_name))


def check_if_recover(config: RecoverConfig) -> bool:
    """True when mode is on/auto and the trial has a committed recovery checkpoint; local.

    Raises CheckpointError when a commit record exists but is broken, so a launcher never
    mistakes a damaged checkpoint for a fresh trial. Checksums are verified by ``load``.
    """
    if not _enabled(config):
        return False
    store = _store_of(config)
    generation = store.committed()
    if generation is None:
        return False
    read_manifest(store.path(generation), RECOVER_MANIFEST)
    return True


class RecoverHandler:
    """Dumps and restores everything a training job needs to continue as if never stopped.

    One committed copy per trial, replaced on each dump by an atomic switch (see
    :mod:`areal_ckpt.recover_store` and docs/recovery.md for why a kill at any instant leaves
    the previous or the new checkpoint, whole). Creating one (mode on/auto) takes the trial's
    lock on rank 0: a second job on the same trial is refused.
    """

    def __init__(self, config: RecoverConfig, ft_spec: FinetuneSpec) -> None:
        self.config = config
        self.ft_spec = ft_spec
        self.enabled = _enabled(config)
        self.store = _store_of(config)
        self._schedule = TriggerSchedule(config.freq_epochs, config.freq_steps, config.freq_secs)
        self._generation: str | None = None  # committed generation this process loaded or wrote
        self._fingerprints: dict[str, list[int]] = {}
        self.last_metrics: dict[str, float] = {}
        self._locked = self.enabled and dist.rank() == 0
        if self._locked:
            acquire_trial_lock(self.store.trial)

    def close(self) -> None:
        """Release the trial's lock (held from construction on rank 0); local, idempotent."""
        if self._locked:
            release_trial_lock(self.store.trial)
            self._locked = False

    # -- dump -------------------------------------------------------------------------------

    def dump(
        self,
        engine: Any,
        step_info: StepInfo,
        saver: Stateful | None = None,
        dataloader: Stateful | None = None,
        evaluator: Stateful | None = None,
        stats_logger: Stateful | None = None,
        client_state: Mapping[str, Any] | None = None,
        tokenizer: Any | None = None,
        force: bool = False,
    ) -> str | None:
        """Write a recovery checkpoint after ``step_info`` when the schedule says so (or ``force``).

        Collective: every rank calls it after every step, with its own dataloader and client
        state. The model's HF config (and ``tokenizer``, if given) are recorded so that
        ``areal-ckpt export`` can turn the checkpoint into a HuggingFace folder. Blocking; returns the committed generation's path, durable, or None when no dump
        was due (or mode is off). A failed write is retried ``retries`` times with back-off, then
        raised; the previous checkpoint survives every failure.
        """
        if not self.enabled:
            return None
        due = self._schedule.should_fire(self.ft_spec.is_epoch_last_step(step_info.epoch_step))
        if not (due or force):
            return None
        if force and not due:
            self._schedule.mark_fired()
        engines = dict(engine) if isinstance(engine, Mapping) else {"default": engine}
        components = {
            **capture_components(saver, evaluator, stats_logger),
            "checkpoint_info": self._schedule.state_dict(),
        }
        rank_state = {
            "dataloader": dataloader_state(dataloader, self.ft_spec.is_epoch_last_step(step_info.epoch_step)),
            "rng": capture_rng_state(),
            "client_state": dict(client_state or {}),
        }
        start = time.perf_counter()
        for attempt in range(self.config.retries + 1):
            try:
                path, size = self._dump_once(engines, step_info, components, rank_state, tokenizer)
                break
            except CollectiveError as lost:  # retrying without the other ranks cannot succeed
                raise CollectiveError(
                    f"{self.store.root}: recovery dump at global step {step_info.global_step} stopped: {lost}. "
                    "The committed checkpoint is untouched; restart the job to resume from it."
                ) from lost
            except _AttemptFailed as failure:
                if attempt == self.config.retries:
                    raise CheckpointError(
                        f"{self.store.root}: recovery dump at global step {step_info.global_step} failed "
                        f"after {attempt + 1} attempts: {failure}; the previous checkpoint is intact"
                    ) from failure
                delay = min(0.5 * 2**attempt, 10.0)
                logger.warning("recovery dump attempt %d failed (%s); retrying in %.1f s", attempt + 1, failure, delay)
                time.sleep(delay)
        seconds = time.perf_counter() - start
        self.last_metrics = {"time/saving": seconds, "bytes": float(size), "gbps": size / seconds / 1e9}
        logger.info("recovery checkpoint at global step %d: %s (%.3f GB in %.2f s)", step_info.global_step, path, size / 1e9, seconds)
        return str(path)

    def _dump_once(
        self,
        engines: dict[str, Any],
        step_info: StepInfo,
        components: dict[str, Any],
        rank_state: dict[str, Any],
        tokenizer: Any,
    ) -> tuple[Path, int]:
        rank = dist.rank()
        names = sorted(engines)
        tags = dist.all_gather_objects([step_info.global_step, names])
        if any(tag != tags[0] for tag in tags):
            raise RankMismatchError(f"RecoverHandler.dump: ranks disagree on (global_step, models): {tags}")
        begun = self._begin(step_info.global_step, names) if rank == 0 else None
        kind, generation = dist.broadcast_object(begun, src=0)
        if kind == "refused":
            raise CheckpointError(generation)
        if kind == "failed":
            raise _AttemptFailed(f"cannot create a generation folder: {generation}")
        folder = self.store.path(generation)
        records: dict[str, FileRecord] = {}
        fingerprints: dict[str, list[int]] = {}
        local_error: str | None = None
        try:
            for name in names:
                if engines[name].is_frozen:
                    fingerprints[name] = engines[name].fingerprint()
                records.update(self._dump_engine(engines[name], name, generation, fingerprints.get(name), tokenizer))
            if rank == 0:
                write_global_info(folder / RECOVER_INFO, step_info, components)
            file_name, record = write_rank_state(folder / RECOVER_INFO, rank, rank_state)
            records[f"{RECOVER_INFO}/{file_name}"] = record
        except (RankMismatchError, CollectiveError):
            raise
        except Exception as error:  # DCP raises on every rank; local failures are agreed below
            local_error = f"rank {rank}: {type(error).__name__}: {error}"
        outcomes = dist.all_gather_objects(local_error or {k: (r.size, r.crc32) for k, r in records.items()})
        errors = [o for o in outcomes if isinstance(o, str)]
        result = None
        if rank == 0:
            result = self._finish(generation, names, errors, outcomes, step_info)
        result = dist.broadcast_object(result, src=0)
        if result.startswith("error:"):
            raise _AttemptFailed(result.removeprefix("error:"))
        self._generation = generation
        self._fingerprints.update(fingerprints)
        total = sum(size for o in outcomes for size, _ in o.values())
        return self.store.path(generation), total

    def _begin(self, global_step: int, names: list[str]) -> tuple[str, str]:
        """Rank 0: ("created", generation) | ("refused", why) | ("failed", OS error, retried)."""
        try:
            committed = self.store.committed()
        except CheckpointError as error:
            return "refused", str(error)
        if committed is not None and committed != self._generation:
            return "refused", (
                f"{self.store.path(committed)} is a recovery checkpoint this job has not loaded; "
                "call RecoverHandler.load() first (or use another trial_name) so it is not overwritten"
            )
        try:
            self.store.remove_debris(keep=committed)
            return "created", self.store.create(global_step, names)
        except OSError as error:
            return "failed", str(error)

    def _dump_engine(
        self, engine: Any, name: str, generation: str, fingerprint: list[int] | None, tokenizer: Any
    ) -> dict[str, FileRecord]:
        folder = self.store.path(generation) / name
        previous = self._fingerprints.get(name)
        unchanged = fingerprint is not None and previous == fingerprint
        if dist.all_true(unchanged) and self._generation is not None:
            return self.store.link_model(self._generation, generation, name) if dist.rank() == 0 else {}
        include_optimizer = not self.config.no_save_optim
        tensors, extra = engine.recover_state(include_optimizer)
        save_tensors(tensors, folder)
        records = {
            f"{name}/{path.name}": record_of(path) for path in sorted(folder.glob(f"__{dist.rank()}_*.distcp"))
        }
        if dist.rank() == 0:
            extra["optimizer_saved"] = include_optimizer and not engine.is_frozen
            records[f"{name}/{ENGINE_STATE_FILE}"] = write_file_durably(folder / ENGINE_STATE_FILE, safe_json.dumps(extra))
            # what `areal-ckpt export` needs to turn these shards into a loadable HF folder
            (folder / HF_FILES).mkdir()
            write_config(engine, folder / HF_FILES, None)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder / HF_FILES)
        return records

    def _finish(
        self, generation: str, names: list[str], errors: list[str], outcomes: list[Any], step_info: StepInfo
    ) -> str:
        if errors:
            self.store.discard(generation)
            return "error:" + "; ".join(errors)
        records = {k: FileRecord(size, crc) for o in outcomes for k, (size, crc) in o.items()}
        header = {
            "format": RECOVER_FORMAT,
            "format_version": RECOVER_FORMAT_VERSION,
            "areal_ckpt_version": __version__,
            "torch_version": torch.__version__,
            "world_size": dist.world_size(),
            "models": names,
            "step": step_info.model_dump(),
        }
        try:
            self.store.commit(generation, records, header, names)
        except Exception as error:
            if self._committed_or_none() != generation:  # never delete what got committed
                self.store.discard(generation)
            return f"error: commit failed: {error}"
        return str(self.store.path(generation))

    # -- load -------------------------------------------------------------------------------

    def load(
        self,
        engine: Any,
        saver: Stateful | None = None,
        dataloader: Stateful | None = None,
        evaluator: Stateful | None = None,
        stats_logger: Stateful | None = None,
        drop_rank_state: bool = False,
    ) -> RecoverInfo | None:
        """Restore the committed checkpoint into ``engine`` and the given objects, if there is one.

        Collective: every rank calls it before training. Returns None when mode is off or the
        trial has no checkpoint. A checkpoint that exists but cannot be loaded raises
        CheckpointError naming the file and cause; nothing is deleted or overwritten then.
        RNG streams are restored last, so nothing after ``load`` returns perturbs them.
        """
        if not self.enabled:
            return None
        found: str | None = None
        if dist.rank() == 0:
            found = self._find_committed()
        found = dist.broadcast_object(found, src=0)
        if found is None:
            return None
        if found.startswith("error:"):
            raise CheckpointError(found.removeprefix("error:"))
        folder = self.store.path(found)
        manifest = self._verify(folder)
        engines = dict(engine) if isinstance(engine, Mapping) else {"default": engine}
        if sorted(engines) != manifest["models"]:
            raise CheckpointError(
                f"{folder}: checkpoint holds models {manifest['models']}, load was given {sorted(engines)}"
            )
        for name in sorted(engines):
            self._load_engine(engines[name], folder / name)
        info = read_recover_info(
            folder / RECOVER_INFO, dist.rank(), dist.world_size(), manifest["world_size"], drop_rank_state
        )
        restore_components(info.path, {
            "saver": info.saver_info, "evaluator": info.evaluator_info,
            "stats_logger": info.stats_logger_info, "dataloader": info.dataloader_info,
        }, {"saver": saver, "evaluator": evaluator, "stats_logger": stats_logger, "dataloader": dataloader})
        if info.checkpoint_info is not None:
            self._schedule.load_state_dict(info.checkpoint_info)
        self._generation = found
        for name in sorted(engines):
            if engines[name].is_frozen:
                self._fingerprints[name] = engines[name].fingerprint()
        if info.rng_state is not None:
            restore_rng_state(info.rng_state)
        logger.info(
            "resuming from global step %d (epoch %d, step %d of the epoch): %s",
            info.last_step_info.global_step, info.last_step_info.epoch, info.last_step_info.epoch_step, folder,
        )
        return info

    def _committed_or_none(self) -> str | None:
        try:
            return self.store.committed()
        except CheckpointError:
            return None

    def _find_committed(self) -> str | None:
        try:
            committed = self.store.committed()
        except CheckpointError as error:
            return f"error:{error}"
        removed = self.store.remove_debris(keep=committed)
        if removed:
            logger.warning("removed uncommitted recovery generations (interrupted dumps): %s", removed)
        return committed

    def _verify(self, folder: Path) -> dict[str, Any]:
        manifest = read_manifest(folder, RECOVER_MANIFEST)
        if manifest.get("format") != RECOVER_FORMAT or manifest.get("format_version") != RECOVER_FORMAT_VERSION:
            raise CheckpointError(
                f"{folder / RECOVER_MANIFEST}: format {manifest.get('format')!r} version "
                f"{manifest.get('format_version')!r} cannot be read by areal_ckpt {__version__} "
                f"(reads {RECOVER_FORMAT!r} version {RECOVER_FORMAT_VERSION})"
            )
        files = manifest["files"]
        mine = [name for index, name in enumerate(sorted(files)) if index % dist.world_size() == dist.rank()]
        problems = [p for part in dist.all_gather_objects(check_files(folder, files, mine)) for p in part]
        if problems:
            raise CheckpointError(f"{folder}: recovery checkpoint is damaged: " + "; ".join(problems))
        return manifest

    def _load_engine(self, engine: Any, folder: Path) -> None:
        try:
            extra = safe_json.loads((folder / ENGINE_STATE_FILE).read_bytes(), str(folder / ENGINE_STATE_FILE))
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        include_optimizer = bool(extra.get("optimizer_saved")) and not self.config.no_load_optim
        if engine.optimizer is not None and not include_optimizer:
            logger.warning("%s: optimizer state not restored (%s)", folder,
                           "no_load_optim is set" if self.config.no_load_optim else "it was not saved")
        template = engine.recover_template(include_optimizer and extra.get("optimizer_has_state", True))
        load_tensors(template, folder, optional_prefixes=() if include_optimizer else (_OPTIMIZER_PREFIX,))
        try:
            engine.load_recover_state(template, extra, include_optimizer)
        except (KeyError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{folder / ENGINE_STATE_FILE}: cannot restore optimizer / scheduler: {error}") from None
