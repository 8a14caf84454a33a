"""The life of a Saver or RecoverHandler between construction and close, shared by both.

One job (an export or a recovery dump) at a time: saved in the caller's process
(synchronous) or handed to a background writer (asynchronous) and collected before the next
one, by :meth:`SaveLifecycle.wait` or at :meth:`SaveLifecycle.close`. The policy pieces live
here too: whether a save runs in the background (:func:`resolve_async`) and the metrics of a
save (:func:`saving_metrics`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.jobs.background import BackgroundJob, BackgroundWriter, JobOutcome
from areal_ckpt.jobs.shm_arena import StagingArena
from areal_ckpt.lock import acquire_trial_lock, release_trial_lock

logger = logging.getLogger(__name__)


class SaveLifecycle:
    """The trial's lock, the background writer, the job in flight and the last save's metrics.

    Created by every rank; ``lock`` (rank 0, when saving is enabled) takes the trial's lock at
    once: a second job on the same trial is refused.
    """

    def __init__(self, label: str, trial: Path, lock: bool) -> None:
        self.writer = BackgroundWriter(label, trial)
        self.trial = trial
        self.last_metrics: dict[str, float] = {}
        self._on_collected: Callable[[JobOutcome], str] | None = None
        self._committed_anyway: Callable[[], str | None] | None = None
        self._locked = lock
        if lock:
            acquire_trial_lock(trial)

    @property
    def arena(self) -> StagingArena:
        """The shared-memory arena a job's tensors are staged in before :meth:`submit`."""
        return self.writer.arena

    @property
    def busy(self) -> bool:
        """True while the job in flight is still being written; local, non-blocking."""
        return self.writer.busy

    def finished(self, blocking_seconds: float, nbytes: int, what: str) -> None:
        """Record a synchronous save of ``nbytes`` that blocked the caller ``blocking_seconds``
        and log ``what`` was saved; local."""
        self.last_metrics = saving_metrics(blocking_seconds, nbytes, background=0.0)
        logger.log(dist.job_info(), "%s (%s)", what, describe_metrics(self.last_metrics))

    def submit(
        self,
        job: BackgroundJob,
        blocking_seconds: float,
        nbytes: int,
        on_collected: Callable[[JobOutcome], str],
        committed_anyway: Callable[[], str | None] | None = None,
    ) -> None:
        """Hand ``job`` (its tensors staged) to the background writer; ``on_collected`` runs
        when it is collected and returns what to log. ``committed_anyway`` (collective, every
        rank) is asked when a writer failed or died: it returns what to log when the job's
        commit took effect all the same (a writer killed after committing), else None. Local,
        non-blocking."""
        self.writer.submit(job)
        self._on_collected = on_collected
        self._committed_anyway = committed_anyway
        self.last_metrics = saving_metrics(blocking_seconds, nbytes)

    def wait(self) -> None:
        """Block until the job in flight is committed, then run its ``on_collected``; no-op
        without one. Collective in effect: every rank's writer commits together. Raises the
        background error when the job failed; with ``committed_anyway`` given at submit, the
        ranks first agree whether any writer failed, and if one did, every writer is stopped
        (the next submit starts new ones) and the job counts as done when its commit took
        effect regardless."""
        in_flight = self._on_collected is not None
        committed_anyway, self._committed_anyway = self._committed_anyway, None
        try:
            outcome = self.writer.wait()
        except CheckpointError as error:
            if committed_anyway is None:
                raise
            self._settle(committed_anyway, error)
            return
        if in_flight and committed_anyway is not None and self._settle(committed_anyway, None):
            return  # a peer's writer failed after the commit: settled and logged
        if outcome is None:
            return
        on_collected, self._on_collected = self._on_collected, None
        blocked = self.last_metrics["time/saving"]
        self.last_metrics = {
            **self.last_metrics,
            **saving_metrics(blocked, int(outcome.result.get("bytes", self.last_metrics["bytes"])), outcome.seconds),
        }
        what = on_collected(outcome) if on_collected is not None else str(outcome.result.get("path"))
        logger.log(dist.job_info(), "%s in the background (%s)", what, describe_metrics(self.last_metrics))

    def _settle(self, committed_anyway: Callable[[], str | None], failure: CheckpointError | None) -> bool:
        """Collective: agree whether any rank's writer failed; False when none did. If one did,
        stop every writer and either log that the job committed all the same (True) or raise
        (``failure`` where this rank's writer failed, a CheckpointError naming the peers'
        failure elsewhere)."""
        if dist.all_reduce_ints([int(failure is not None)], "max")[0] == 0:
            return False
        self._on_collected = None
        self.writer.stop()
        what = committed_anyway()
        if what is None:
            raise failure or CheckpointError(
                f"{self.writer.label}: another rank's background writer failed; the save did not commit"
            )
        logger.warning("%s, although a background writer failed after its commit (%s)", what, failure or "on a peer")
        return True

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Wait for the job in flight, stop the writer, free its shared memory, run ``then``
        and release the trial's lock. Call it on every rank; idempotent. Raises the background
        error of the last job, after releasing everything."""
        try:
            self.wait()
        finally:
            self.writer.close()
            try:
                if then is not None:
                    then()
            finally:
                if self._locked:
                    release_trial_lock(self.trial)
                    self._locked = False


def resolve_async(mode: str, on_accelerator: bool) -> bool:
    """Whether a save in ``mode`` runs in the background.

    ``async``: always. ``auto`` / ``on``: only when the state lives on an accelerator, where
    staging is the device-to-host copy a save needs anyway and the host's cores are idle
    during compute; a CPU-trained model saves synchronously, because a background writer would
    compete with the training loop for the same cores. Anything else: synchronously.
    """
    if mode == "async":
        return True
    return mode in ("auto", "on") and on_accelerator


def saving_metrics(blocking: float, nbytes: int, background: float | None = None) -> dict[str, float]:
    """The metrics dict of one save: ``time/saving`` (seconds the caller was blocked),
    ``time/background`` (seconds written in the background; 0 when synchronous; absent until
    known), ``bytes`` and ``gbps`` (bytes over the time spent writing)."""
    metrics = {"time/saving": blocking, "bytes": float(nbytes)}
    if background is not None:
        writing = background if background > 0 else blocking
        metrics["time/background"] = background
        metrics["gbps"] = nbytes / writing / 1e9 if writing > 0 else 0.0
    return metrics


def describe_metrics(metrics: dict[str, float]) -> str:
    """One log-line rendering of :func:`saving_metrics`."""
    text = f"{metrics['bytes'] / 1e9:.3f} GB, blocked {metrics['time/saving']:.2f} s"
    if "time/background" in metrics:
        text += f", background {metrics['time/background']:.2f} s, {metrics['gbps']:.2f} GB/s"
    return text
