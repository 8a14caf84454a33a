"""RecoverHandler: full-state recovery checkpoints, resumed automatically and bit-exactly.

RecoverHandler = schedule (when) + engines (model / optimizer / scheduler state through DCP) +
state (RNG, dataloader, component states as JSON) + recover_store (atomic generations).
Job-safe for one job per trial; process-safe within it: every rank calls ``dump`` / ``load``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping

import torch

from areal_ckpt import dist
from areal_ckpt._version import __version__
from areal_ckpt.background import BackgroundWriter, describe_metrics, resolve_async, saving_metrics
from areal_ckpt.commit import read_manifest
from areal_ckpt.config import RecoverConfig, check_path_component
from areal_ckpt.errors import CheckpointError, CollectiveError, RankMismatchError
from areal_ckpt.formats.hf_export import HFFiles, hf_files
from areal_ckpt.fsio import FileRecord
from areal_ckpt.layout import ENGINE_STATE_FILE, RECOVER_INFO, RECOVER_MANIFEST, default_user, trial_root
from areal_ckpt.lock import acquire_trial_lock, release_trial_lock
from areal_ckpt.recover_read import find_committed, load_engine, verify_checkpoint
from areal_ckpt.recover_store import RecoverStore
from areal_ckpt.recover_write import MODEL_SEPARATOR, RECOVER_FORMAT, RECOVER_FORMAT_VERSION, DumpJob
from areal_ckpt.schedule import TriggerSchedule
from areal_ckpt.staging import layout_of
from areal_ckpt.state import safe_json
from areal_ckpt.state.components import Stateful, capture_components, dataloader_state, restore_components
from areal_ckpt.state.recover_info import RecoverInfo, encode_global_info, encode_rank_state, read_recover_info
from areal_ckpt.state.rng import capture_rng_state, restore_rng_state
from areal_ckpt.step import FinetuneSpec, StepInfo

logger = logging.getLogger("areal_ckpt.recover")



class _AttemptFailed(Exception):
    """A dump attempt failed on some rank; every rank raises it (retried by ``dump``)."""


def _enabled(config: RecoverConfig) -> bool:
    return config.mode in ("on", "auto", "sync", "async")


def _store_of(config: RecoverConfig) -> RecoverStore:
    return RecoverStore(trial_root(config.fileroot, config.user or default_user(), config.experiment_name, config.trial_name))


def check_if_recover(config: RecoverConfig) -> bool:
    """True when recovery is enabled (mode on/auto/sync/async) and the trial has a committed recovery checkpoint; local.

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
    the previous or the new checkpoint, whole). Creating one (recovery enabled) takes the
    trial's lock on rank 0: a second job on the same trial is refused. Dumps are written in the
    calling process or, asynchronously, by a background writer (see ``dump``).
    """

    def __init__(self, config: RecoverConfig, ft_spec: FinetuneSpec) -> None:
        self.config = config
        self.ft_spec = ft_spec
        self.enabled = _enabled(config)
        self.store = _store_of(config)
        self._schedule = TriggerSchedule(config.freq_epochs, config.freq_steps, config.freq_secs)
        self._generation: str | None = None  # committed generation this process loaded or wrote
        self._tidied = False  # rank 0 removed the debris of earlier jobs (at load or first dump)
        self._fingerprints: dict[str, list[int]] = {}
        self.last_metrics: dict[str, float] = {}
        self._writer = BackgroundWriter("recover", self.store.trial)
        self._pending: tuple[str, dict[str, list[int]]] | None = None  # dump in flight
        self._locked = self.enabled and dist.rank() == 0
        if self._locked:
            acquire_trial_lock(self.store.trial)

    def close(self) -> None:
        """Wait for the dump in flight, stop the background writer, free its shared memory and
        release the trial's lock (held from construction on rank 0). Call it on every rank;
        idempotent. Raises the background error of the last dump, after releasing everything."""
        try:
            self._collect()
        finally:
            self._writer.close()
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
        ``areal-ckpt export`` can turn the checkpoint into a HuggingFace folder. Returns None
        when no dump was due (or mode is off), else the generation's path.

        Synchronous: blocks until that generation is committed and durable. Asynchronous (mode
        ``async``; ``auto`` / ``on`` when the model is on an accelerator): first waits for the
        dump in flight, encodes the small JSON files, copies the tensors to shared memory and
        returns; the background writer commits it later (:meth:`wait`, :meth:`close`). A failed
        write is retried ``retries`` times with back-off, then raised on every rank: by this
        call (sync), or by the next due dump, ``wait`` or ``close`` (async). The previous
        checkpoint survives every failure.
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
        self._collect()
        background = resolve_async(self.config.mode, any(e.on_accelerator for e in engines.values()))
        for attempt in range(self.config.retries + 1):
            try:
                job, tensors, fingerprints = self._prepare(engines, step_info, components, rank_state, tokenizer)
                break
            except CollectiveError as lost:  # retrying without the other ranks cannot succeed
                raise self._stopped(step_info, lost) from lost
            except _AttemptFailed as failure:
                if attempt == self.config.retries:
                    raise CheckpointError(
                        f"{self.store.root}: recovery dump at global step {step_info.global_step} failed "
                        f"after {attempt + 1} attempts: {failure}; the previous checkpoint is intact"
                    ) from failure
                delay = min(0.5 * 2**attempt, 10.0)
                logger.warning("recovery dump attempt %d failed (%s); retrying in %.1f s", attempt + 1, failure, delay)
                time.sleep(delay)
        if background:
            layout = layout_of(tensors)
            try:
                self._writer.arena.stage(layout, tensors.items())
            except BaseException:
                if dist.rank() == 0:
                    self.store.discard(job.generation)
                raise
            self._writer.submit(dataclasses.replace(job, layout=layout))
            self._pending = (job.generation, fingerprints)
            self.last_metrics = saving_metrics(time.perf_counter() - start, layout.nbytes)
            return str(self.store.path(job.generation))
        try:
            result = job.run(tensors)
        except CollectiveError as lost:
            raise self._stopped(step_info, lost) from lost
        self._committed(job.generation, fingerprints)
        self.last_metrics = saving_metrics(time.perf_counter() - start, result["bytes"], background=0.0)
        logger.info("recovery checkpoint at global step %d: %s (%s)", step_info.global_step, result["path"],
                    describe_metrics(self.last_metrics))
        return result["path"]

    def _stopped(self, step_info: StepInfo, lost: CollectiveError) -> CollectiveError:
        return CollectiveError(
            f"{self.store.root}: recovery dump at global step {step_info.global_step} stopped: {lost}. "
            "The committed checkpoint is untouched; restart the job to resume from it."
        )

    @property
    def saving_in_background(self) -> bool:
        """True while an asynchronous dump is still being written; local, non-blocking."""
        return self._writer.busy

    def wait(self) -> None:
        """Block until the dump in flight (async mode) is committed; no-op otherwise.

        Call it on every rank. Raises the background error, if the dump failed.
        """
        self._collect()

    def _collect(self) -> None:
        outcome = self._writer.wait()
        if outcome is None:
            return
        generation, fingerprints = self._pending
        self._pending = None
        self._committed(generation, fingerprints)
        self.last_metrics = {**self.last_metrics, **saving_metrics(
            self.last_metrics["time/saving"], outcome.result["bytes"], background=outcome.seconds)}
        logger.info("recovery checkpoint %s committed in the background (%s)", outcome.result["path"],
                    describe_metrics(self.last_metrics))

    def _committed(self, generation: str, fingerprints: dict[str, list[int]]) -> None:
        self._generation = generation
        self._fingerprints.update(fingerprints)

    def _prepare(
        self,
        engines: dict[str, Any],
        step_info: StepInfo,
        components: dict[str, Any],
        rank_state: dict[str, Any],
        tokenizer: Any,
    ) -> tuple[DumpJob, dict[str, torch.Tensor], dict[str, list[int]]]:
        """Create the generation, write its JSON files, capture the tensors; collective.

        Raises _AttemptFailed on every rank (after discarding the generation) when a rank failed.
        """
        rank = dist.rank()
        names = sorted(engines)
        for name in names:
            check_path_component(name, "model name")
        tags = dist.all_gather_objects([step_info.global_step, names])
        if any(tag != tags[0] for tag in tags):
            raise RankMismatchError(f"RecoverHandler.dump: ranks disagree on (global_step, models): {tags}")
        begun = self._begin(step_info.global_step, names) if rank == 0 else None
        kind, generation = dist.broadcast_object(begun, src=0)
        if kind == "refused":
            raise CheckpointError(generation)
        if kind == "failed":
            raise _AttemptFailed(f"cannot create a generation folder: {generation}")
        records: dict[str, FileRecord] = {}
        files: dict[str, bytes] = {}
        hf: dict[str, HFFiles] = {}
        tensors: dict[str, torch.Tensor] = {}
        fingerprints: dict[str, list[int]] = {}
        local_error: str | None = None
        try:
            for name in names:
                if engines[name].is_frozen:
                    fingerprints[name] = engines[name].fingerprint()
                model_tensors, model_records = self._prepare_engine(
                    engines[name], name, generation, fingerprints.get(name), tokenizer, files, hf
                )
                records.update(model_records)
                tensors.update({f"{name}{MODEL_SEPARATOR}{key}": value for key, value in model_tensors.items()})
            if rank == 0:
                for file_name, data in encode_global_info(step_info, components).items():
                    files[f"{RECOVER_INFO}/{file_name}"] = data
            file_name, data = encode_rank_state(rank, rank_state)
            files[f"{RECOVER_INFO}/{file_name}"] = data
        except (RankMismatchError, CollectiveError):
            raise
        except Exception as error:  # local failures are agreed below
            local_error = f"rank {rank}: {type(error).__name__}: {error}"
        errors = [e for e in dist.all_gather_objects(local_error) if e is not None]
        if errors:
            if rank == 0:
                self.store.discard(generation)
            raise _AttemptFailed("; ".join(errors))
        header = {
            "format": RECOVER_FORMAT,
            "format_version": RECOVER_FORMAT_VERSION,
            "areal_ckpt_version": __version__,
            "torch_version": torch.__version__,
            "world_size": dist.world_size(),
            "models": names,
            "step": step_info.model_dump(),
        }
        job = DumpJob(
            trial=self.store.trial, generation=generation, models=names,
            records={k: (r.size, r.crc32) for k, r in records.items()}, files=files, hf=hf, header=header,
            retries=self.config.retries,
        )
        return job, tensors, fingerprints

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
            if not self._tidied:  # later dumps: each commit removes what it superseded
                self.store.remove_debris(keep=committed)
                self._tidied = True
            return "created", self.store.create(global_step, names)
        except OSError as error:
            return "failed", str(error)

    def _prepare_engine(
        self, engine: Any, name: str, generation: str, fingerprint: list[int] | None, tokenizer: Any,
        files: dict[str, bytes], hf: dict[str, HFFiles],
    ) -> tuple[dict[str, torch.Tensor], dict[str, FileRecord]]:
        """This rank's tensors of one model (none when an unchanged frozen model is linked) and
        the records of the files linked for it; adds the files to write for it to ``files`` and
        ``hf`` (rank 0)."""
        previous = self._fingerprints.get(name)
        unchanged = fingerprint is not None and previous == fingerprint
        if dist.all_true(unchanged) and self._generation is not None:
            return {}, self.store.link_model(self._generation, generation, name) if dist.rank() == 0 else {}
        include_optimizer = not self.config.no_save_optim
        tensors, extra = engine.recover_state(include_optimizer)
        if dist.rank() == 0:
            extra["optimizer_saved"] = include_optimizer and not engine.is_frozen
            files[f"{name}/{ENGINE_STATE_FILE}"] = safe_json.dumps(extra)
            hf[name] = hf_files(engine, None, tokenizer)  # what `areal-ckpt export` needs besides the shards
        return tensors, {}

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
            found = find_committed(self.store)
        found = dist.broadcast_object(found, src=0)
        if found is None:
            return None
        if found.startswith("error:"):
            raise CheckpointError(found.removeprefix("error:"))
        folder = self.store.path(found)
        manifest = verify_checkpoint(folder)
        engines = dict(engine) if isinstance(engine, Mapping) else {"default": engine}
        if sorted(engines) != manifest["models"]:
            raise CheckpointError(
                f"{folder}: checkpoint holds models {manifest['models']}, load was given {sorted(engines)}"
            )
        for name in sorted(engines):
            load_engine(engines[name], folder / name, manifest, self.config.no_load_optim)
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
        self._tidied = True  # find_committed removed the debris
        if info.rng_state is not None:
            restore_rng_state(info.rng_state)
        logger.info(
            "resuming from global step %d (epoch %d, step %d of the epoch): %s",
            info.last_step_info.global_step, info.last_step_info.epoch, info.last_step_info.epoch_step, folder,
        )
        return info
