"""RecoverHandler: full-state recovery checkpoints, resumed automatically and bit-exactly.

RecoverHandler = schedule (when) + engines (model / optimizer / scheduler state through DCP) +
state (RNG, dataloader, component states as JSON) + generations.store (atomic generations).
Job-safe for one job per trial; process-safe within it: every rank calls ``dump`` / ``load``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from areal_ckpt import agree, dist
from areal_ckpt.config import RecoverConfig
from areal_ckpt.engines.accept import HFAssets, check_engines, engines_by_name, named_engines
from areal_ckpt.engines.contract import EnginesLike, RolloutEngine, WeightUpdateMeta
from areal_ckpt.errors import CheckpointError, CollectiveError
from areal_ckpt.generations.tidy import remove_trash, wait_for_deletions
from areal_ckpt.jobs.lifecycle import SaveLifecycle, resolve_async
from areal_ckpt.jobs.retry import retried
from areal_ckpt.paths import default_user, recover_info_link, trial_root
from areal_ckpt.persistence.generations import new_run_token
from areal_ckpt.persistence.reading import ReadFrom
from areal_ckpt.recover.dump_runs import DumpRuns, stopped
from areal_ckpt.recover.frozen import frozen_part, part_fingerprint
from areal_ckpt.recover.location import trial_location
from areal_ckpt.recover.preemption import PreemptionSignals
from areal_ckpt.recover.prepare import PreviousDump, prepare_dump
from areal_ckpt.recover.read import OpenedGeneration, load_engine, open_committed
from areal_ckpt.recover.rollout_sync import RolloutSync
from areal_ckpt.schedule import TriggerSchedule, warn_if_never_due
from areal_ckpt.state.components import Stateful, capture_components, dataloader_state, restore_components
from areal_ckpt.state.frontier import RolloutFrontier
from areal_ckpt.state.frontier_files import encode_frontier
from areal_ckpt.state.recover_info import RecoverInfo
from areal_ckpt.state.rng import capture_rng_state, python_random_kept, restore_rng_state
from areal_ckpt.step import FinetuneSpec, StepInfo

logger = logging.getLogger(__name__)


class RecoverHandler:
    """Dumps and restores everything a training job needs to continue as if never stopped.

    One committed copy per trial, replaced on each dump by an atomic switch (see
    :mod:`areal_ckpt.generations.store` and docs/recovery.md for why a kill at any instant leaves
    the previous or the new checkpoint, whole). Creating one (recovery enabled) takes the
    trial's lock on rank 0: a second job on the same trial is refused. Dumps are written in the
    calling process or, asynchronously, by a background writer (see ``dump``).
    """

    @python_random_kept()  # its check of object storage may be retried (botocore's jitter)
    def __init__(self, config: RecoverConfig | Any, ft_spec: FinetuneSpec) -> None:
        self.config = config = RecoverConfig.of(config)
        self.ft_spec = ft_spec
        self.enabled = config.enabled
        self.store, self.publication = trial_location(config)
        self._schedule = TriggerSchedule(config.freq_epochs, config.freq_steps, config.freq_secs)
        if self.enabled:
            warn_if_never_due("recover", config.freq_epochs, config.freq_steps, config.freq_secs)
        # As AReaL's: the step the last dump (or the loaded checkpoint) was taken after.
        self.last_step_info = StepInfo(-1, -1, -1, max(ft_spec.steps_per_epoch, 0))
        self._generation: str | None = None  # committed generation this process loaded or wrote
        self._tidied = False  # rank 0 removed the debris of earlier jobs (at load or first dump)
        self._dumped = False  # rank 0 began a dump in this job (its first dump checks where the trial persists)
        self._fingerprints: dict[str, list[int]] = {}
        self._run = new_run_token()  # names this job in the commits where the trial persists
        if self.enabled:
            self.publication.start(self.store)
        self._jobs = SaveLifecycle("recover", self.store.trial, lock=self.enabled and dist.rank() == 0)
        watched = config.preemption_signals if self.enabled else ()
        self._preemption = PreemptionSignals(watched) if watched else None
        #: A tiered trial's uploads to where it persists (recover.local_dir), None otherwise.
        self._uploads = self.publication.uploads(self.store, self._run, config.write_retries) if self.enabled else None

    @property
    def last_metrics(self) -> dict[str, float]:
        """The last dump's ``time/saving``, ``time/background``, ``bytes`` and ``gbps``; for a
        tiered trial also the last upload's ``upload/seconds``, ``upload/bytes``,
        ``upload/gbps``, and ``upload/lag_steps`` / ``upload/failures`` (how far object storage
        lags the local tier, failed uploads in a row); with ``local_replicas``, the last copy
        job's ``copies/seconds`` and the bytes this rank received in it, ``copies/bytes_received``."""
        return {**self._jobs.last_metrics, **(self._uploads.metrics if self._uploads is not None else {})}

    def close(self) -> None:
        """Wait for the dump in flight and this rank's deletion of superseded files, stop the
        background writer, free its shared memory and release the trial's lock (held from
        construction on rank 0). A tiered trial first uploads its newest local commit (blocking).
        Call it on every rank; idempotent. Raises the background error of the last dump, or the
        failed final upload, after releasing everything."""
        self._jobs.close(then=self._finish)

    @property
    def preempted(self) -> bool:
        """True once a preemption signal (``recover.preemption_signals``) made the last dump:
        the loop should stop. A loop that reads it is taken to stop by itself, so that dump
        returns instead of exiting the process (docs/launching.md). Local."""
        if self._preemption is None:
            return False
        self._preemption.asked = True
        return self._preemption.preempted

    def _finish(self) -> None:
        uploads, self._uploads = self._uploads, None
        if self._preemption is not None:
            self._preemption.restore()
        try:
            if uploads is not None:  # a preempted job exits in time: its upload bounded, the rest left to the next run
                preempted = self._preemption is not None and self._preemption.preempted
                uploads.finish(within=self.config.preemption_upload_seconds if preempted else None)
        finally:
            if dist.rank() == 0:
                remove_trash(self.store.root)
            else:
                wait_for_deletions()

    # -- dump -------------------------------------------------------------------------------

    @staticmethod
    def recover_info_path(experiment_name: str, trial_name: str, fileroot: str) -> str:
        """``{trial}/recover_info``: the link to the committed generation's ``recover_info/``
        folder, for the login user (as AReaL's helper; see docs/layout.md). Pure: creates nothing."""
        return str(recover_info_link(trial_root(fileroot, default_user(), experiment_name, trial_name)))

    @python_random_kept()  # a retried request to object storage draws from it (botocore's jitter)
    def dump(
        self,
        engine: EnginesLike,
        step_info: StepInfo,
        saver: Stateful | None = None,
        evaluator: Stateful | None = None,
        stats_logger: Stateful | None = None,
        dataloader: Stateful | None = None,
        tokenizer: Any | None = None,
        processor: Any | None = None,
        base_model_path: str | None = None,
        *,
        client_state: Mapping[str, Any] | None = None,
        rollout: RolloutFrontier | None = None,
        force: bool = False,
    ) -> str | None:
        """Write a recovery checkpoint after ``step_info`` when the schedule says so (or ``force``).

        AReaL's call, in AReaL's order; the four components are optional here. ``engine`` is
        one engine or ``{model name: engine}`` (see :mod:`areal_ckpt.engines.contract`).
        Collective: every rank calls it after every step, with its own dataloader and
        ``client_state`` (the loop's own JSON-able state, e.g. a KL coefficient), and its
        ``rollout`` frontier if it has one (:class:`~areal_ckpt.state.frontier.RolloutFrontier`:
        the prompts in flight and the data source's position, snapshotted at one instant and
        committed with the weights, taken as the dump captures the tensors; ConfigError on every
        rank when one exceeds its bound). The model's HF
        config, ``tokenizer``, ``processor`` and the base model's other files are recorded so
        ``areal-ckpt export`` can make a complete HF folder. Returns None when no dump was due
        (or mode is off), else the generation's path.

        Synchronous: blocks until that generation is committed and durable. Asynchronous (mode
        ``async``; ``auto`` / ``on`` when the model is on an accelerator): first waits for the
        dump in flight, encodes the small JSON files, copies the tensors to shared memory and
        returns; the background writer commits it later (:meth:`wait`, :meth:`close`). A failed
        write is retried ``write_retries`` times with back-off, then raised on every rank: by this
        call (sync), or by the next due dump, ``wait`` or ``close`` (async). The previous
        checkpoint survives every failure.
        """
        if not self.enabled:
            return None
        if self._uploads is not None:
            self._uploads.poll()
        try:
            step_info.check_completed()
        except ValueError as error:
            raise CheckpointError(f"RecoverHandler.dump: {error}: pass the step just completed") from None
        check_engines(engine, "RecoverHandler.dump")  # a wrong argument fails at once, due or not
        signalled = self._preemption.agreed() if self._preemption is not None else None  # collective
        due = self._schedule.should_fire(self.ft_spec.is_epoch_last_step(step_info.epoch_step))
        if not (due or force or signalled):
            return None
        engines = engines_by_name(engine, "RecoverHandler.dump")
        # a preemption dump is waited for anyway: written here, with no background writer to start
        background = not signalled and resolve_async(self.config.mode, any(e.on_accelerator for e in engines.values()))
        assets = {
            name: HFAssets.of(original, tokenizer, processor, base_model_path)
            for name, original in named_engines(engine).items()
        }
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
        self._jobs.wait()
        what = f"{self.store.root}: recovery dump at global step {step_info.global_step}"
        try:
            job, tensors, fingerprints = retried(
                lambda: prepare_dump(
                    self.store,
                    self.publication,
                    self.config,
                    PreviousDump(self._generation, dict(self._fingerprints)),
                    self._begin,
                    engines,
                    step_info,
                    components,
                    rank_state,
                    assets,
                    self._run,
                    None if rollout is None else lambda: encode_frontier(rollout.snapshot(), dist.rank()),
                ),
                self.config.write_retries,
                what,
            )
        except CollectiveError as lost:  # retrying without the other ranks cannot succeed
            raise stopped(self.store, step_info, lost) from lost
        if self._uploads is not None:
            job = dataclasses.replace(job, protected=self._uploads.protected)
        runs = DumpRuns(self._jobs, self.store, self._committed)
        if background:
            path = runs.hand_off(job, tensors, fingerprints, start)
        else:
            path = runs.write(job, tensors, fingerprints, step_info, start)
            self.last_step_info = step_info
        if self._preemption is None:
            return path
        return self._preemption.after_dump(path, step_info.global_step, signalled, self._jobs.wait, self.close)

    @property
    def saving_in_background(self) -> bool:
        """True while an asynchronous dump is still being written; local, non-blocking."""
        return self._jobs.busy

    def wait(self) -> None:
        """Block until the dump in flight (async mode) is committed and, for a tiered trial,
        until the newest local commit is on object storage too; no-op otherwise.

        Call it on every rank. Raises the background error, if the dump or upload failed.
        """
        self._jobs.wait()
        if self._uploads is not None:
            self._uploads.drain()

    def _committed(
        self, generation: str, fingerprints: dict[str, list[int]], files: Mapping[str, tuple[int, int]] | None = None
    ) -> None:
        """Record that ``generation`` committed (collective for a tiered trial: its upload is
        offered; ``files``: this rank's files in it, with their size and CRC-32)."""
        self._generation = generation
        self._fingerprints.update(fingerprints)
        if self._uploads is not None:
            self._uploads.offer(generation, dict(files or {}))

    def _begin(self, global_step: int, names: list[str]) -> str:
        """Rank 0: create the generation folder (see RecoverStore.begin), after checking that
        the newest commit where the trial persists (if it persists behind the local store) is
        this job's (:meth:`~areal_ckpt.recover.publication.Publication.before_dump`); local."""
        loaded = [name for name in (self._generation, *(self._uploads.loaded if self._uploads else ())) if name]
        self.publication.before_dump(self._run, loaded, first=not self._dumped)
        self._dumped = True
        generation = self.store.begin(global_step, names, loaded=self._generation, first=not self._tidied)
        self._tidied = True
        return generation

    # -- load -------------------------------------------------------------------------------

    def load(
        self,
        engine: EnginesLike,
        saver: Stateful | None = None,
        evaluator: Stateful | None = None,
        stats_logger: Stateful | None = None,
        dataloader: Stateful | None = None,
        inference_engine: RolloutEngine | None = None,
        weight_update_meta: WeightUpdateMeta | None = None,
        inference_engine_update_from: str = "default",
        colocated_rollout: bool = False,
        *,
        rollout: RolloutFrontier | None = None,
        drop_rank_state: bool = False,
    ) -> RecoverInfo | None:
        """Restore the committed checkpoint into ``engine`` and the given objects, if there is one.

        AReaL's call, in AReaL's order; the four components are optional here. Collective:
        every rank calls it before training. Returns None when mode is off or the trial has no
        checkpoint. A checkpoint that exists but cannot be loaded raises CheckpointError naming
        the file and cause; nothing is deleted or overwritten then. A trial holding AReaL's own
        recovery folders is refused, untouched. ``engine`` may name fewer models than the
        checkpoint holds (AReaL's RL trainer loads the actor of an actor + critic dump): those
        are loaded, the others named in a warning; a model the checkpoint lacks is refused.

        With ``inference_engine`` (an RL trainer's rollout server) the recovered weights are
        pushed to it as AReaL does, through the objects' own methods: the engine named
        ``inference_engine_update_from`` connects to it, it is paused, the weights are updated
        (``weight_update_meta`` at version ``global_step + 1``) and it is resumed even if that
        failed; both then get that version. ``colocated_rollout`` with an ``awex`` meta first
        has the rollout engine release its memory, and loads the checkpoint only then.
        With ``rollout`` (the frontier the dumps recorded) its finished trajectories return to
        its buffer and its queued and generating prompts are handed out again first; it is read
        and checked against its data source before any weight is loaded.
        RNG streams are restored last, so nothing after ``load`` returns perturbs them.
        On another number of ranks than the dump's, per-rank state is handled as
        ``recover.on_world_size_change`` says; ``drop_rank_state=True`` overrides it with
        ``drop_rank_state`` (docs/recovery.md section 4).
        """
        if not self.enabled:
            return None
        originals = named_engines(engine)
        sync = RolloutSync.checked(
            originals, inference_engine, weight_update_meta, inference_engine_update_from, colocated_rollout
        )
        engines = engines_by_name(engine, "RecoverHandler.load")
        policy = "drop_rank_state" if drop_rank_state else self.config.on_world_size_change

        def restore(read_from: ReadFrom) -> OpenedGeneration | None:
            opened = open_committed(self.store, read_from, sorted(engines), policy, dataloader, rollout)
            if opened is None:
                return None

            def load_engines() -> None:
                for name in sorted(engines):
                    load_engine(
                        engines[name],
                        opened.folder / name,
                        opened.manifest,
                        self.config.no_load_optim,
                        fetch=opened.fetch,
                        peers=opened.peers,
                    )

            if sync is None:
                load_engines()
            else:
                sync.run(opened.info.last_step_info.global_step + 1, load_engines)
            return opened

        with python_random_kept():  # a request retried meanwhile draws from it; restored below when loaded
            try:
                restored, choice = self.publication.restore(self.store, restore)
            finally:
                wait_for_deletions()  # the debris rank 0 hid before loading, deleted while the engines loaded
        if restored is None:
            return None
        found, manifest, info = restored.name, restored.manifest, restored.info
        if self._uploads is not None and choice is not None:
            self._uploads.resumed(found, choice.remote_newest, choice.local, choice.partial)
        restore_components(
            info.path,
            {
                "saver": info.saver_info,
                "evaluator": info.evaluator_info,
                "stats_logger": info.stats_logger_info,
                "dataloader": info.dataloader_info,
            },
            {"saver": saver, "evaluator": evaluator, "stats_logger": stats_logger, "dataloader": dataloader},
        )
        frontier = restored.frontier
        if rollout is not None and frontier is not None:
            agree.on_every_rank(
                lambda: rollout.restore(frontier), f"{info.path}: the rollout frontier was not restored"
            )
        if info.checkpoint_info is not None:
            self._schedule.load_state_dict(info.checkpoint_info)
        self._generation = found
        for name in sorted(engines):
            if not engines[name].has_optimizer:
                self._fingerprints[name] = engines[name].fingerprint()
            if any(file.startswith(f"{frozen_part(name)}/") for file in manifest["files"]):
                self._fingerprints[frozen_part(name)] = part_fingerprint(engines[name])  # as loaded: linked next
        self._tidied = True  # find_committed removed the debris (waited for above)
        self.last_step_info = info.last_step_info
        if info.rng_state is not None:
            restore_rng_state(info.rng_state)
        if dist.rank() == 0:
            step = info.last_step_info
            logger.info(
                "resuming trial %s after global step %d (epoch %d, step %d of the epoch) from %s",
                self.config.trial_name, step.global_step, step.epoch, step.epoch_step,
                self.publication.where(self.store, found, choice),
            )  # fmt: skip
        return info
