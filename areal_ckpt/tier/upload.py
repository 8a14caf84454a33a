"""The persistent tier of a tiered trial: committed local generations go up to where the trial
persists (object storage, a shared folder) in the background, the newest first.

With ``recover.local_dir`` a dump ends with its local commit (:mod:`areal_ckpt.recover.write`);
:class:`Uploads` then hands the generation to one upload process per rank (a background writer,
:mod:`areal_ckpt.jobs.background`, whose own gloo group runs the commit of
:meth:`~areal_ckpt.persistence.generations.PersistentGenerations.publish`), and the loop goes on.

When uploads fall behind dumps: one upload runs at a time; a generation committed meanwhile
waits as the *pending* one, and a newer commit replaces it, so the generations in between are
never uploaded (the persistent tier moves from one committed generation to a newer one, never to a
mix). With ``recover.upload_every`` N only every N-th commit is due (and the newest at close);
with ``recover.local_replicas`` K every commit is first copied to K other nodes' local tiers
(:mod:`areal_ckpt.tier.peer_copies`) by the same background job. The commit's tidying keeps
the generation in flight, the pending one and the newest whose copies are complete, so a local
tier holds at most four and no upload or copy is ever cut by its own job. A failed upload
(after ``write_retries`` tries) is logged with how far object storage lags, and the newest
committed generation is tried again at the next local commit (or ``wait`` / ``close``), not at
every step; training goes on. ``close`` uploads the newest and raises if it cannot.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.jobs.background import BackgroundWriter, JobOutcome
from areal_ckpt.jobs.retry import retried
from areal_ckpt.jobs.shm_arena import ArenaLayout
from areal_ckpt.paths import RECOVER_MANIFEST, generation_step
from areal_ckpt.persistence.generations import PersistentGenerations
from areal_ckpt.publish import read_manifest
from areal_ckpt.tier.peer_copies import replicate, shares_held

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadJob:
    """The upload of one committed generation of the local tier ``trial`` to ``behind``; plain,
    picklable data (a :class:`~areal_ckpt.jobs.background.BackgroundJob` without tensors).

    ``files`` are this rank's own files in it, with their size and CRC-32 (rank 0 uploads the rest); ``loaded`` the
    generations the job resumed from (the newest commit where the trial persists must be one of them,
    or the job's own, ``run_token``); ``tidy`` removes what killed uploads left first (a job's
    first upload)."""

    trial: Path
    behind: PersistentGenerations
    generation: str
    files: dict[str, tuple[int, int]]
    run_token: str
    loaded: tuple[str, ...]
    retries: int
    tidy: bool = False
    layout: ArenaLayout | None = None
    copies: int = 0
    publish: bool = True

    def run(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Copy the generation to ``copies`` other nodes' local tiers
        (:func:`~areal_ckpt.tier.peer_copies.replicate`), then, when ``publish``, publish and
        commit it where the trial persists, retried ``retries`` times. Collective over the
        uploaders' group; blocking; returns where it is, the bytes published and the bytes this
        rank received as copies. Raises CheckpointError on every rank when it failed (nothing
        committed there then)."""
        store = RecoverStore(self.trial)
        folder = store.path(self.generation)
        behind = self.behind
        copied = replicate(store, self.generation, self.copies) if self.copies else 0
        if not self.publish:
            return {"path": str(folder), "bytes": 0, "copied": copied, "generation": self.generation}
        step = generation_step(self.generation)
        what = f"{behind.where()}: upload of the recovery dump at global step {step} (committed in {folder} only)"

        def attempt() -> None:
            def check() -> None:
                behind.check_owner(self.run_token, self.loaded)
                if self.tidy:
                    behind.remove_debris()

            agree.decided_by_rank0(check, what)
            behind.publish(folder, self.files, self.run_token, step)

        retried(attempt, self.retries, what)
        size = agree.decided_by_rank0(
            lambda: sum(entry["size"] for entry in read_manifest(folder, RECOVER_MANIFEST)["files"].values()), what
        )
        return {"path": behind.where(self.generation), "bytes": size, "copied": copied, "generation": self.generation}


@dataclass(frozen=True)
class _Offer:
    """A committed local generation waiting for its upload, and this rank's files in it (size
    and CRC-32 by name)."""

    generation: str
    files: dict[str, tuple[int, int]]
    publish: bool = True


class Uploads:
    """The uploads of one RecoverHandler's tiered trial (the policy in the module docstring).

    Owned by the training process of every rank; every method is collective and must be called
    by every rank at the same points (the handler's ``dump``, ``load`` and ``close``)."""

    def __init__(
        self,
        store: RecoverStore,
        behind: PersistentGenerations,
        run_token: str,
        retries: int,
        copies: int = 0,
        upload_every: int = 1,
    ) -> None:
        self.store = store
        self.behind = behind
        self.copies = copies
        self.upload_every = upload_every
        self.run_token = run_token
        self.retries = retries
        self.loaded: tuple[str, ...] = ()  # set by the handler's load
        self.metrics: dict[str, float] = {}
        self._writer = BackgroundWriter("recover-upload", store.trial)
        self._in_flight: _Offer | None = None
        self._pending: _Offer | None = None
        self._uploaded: str | None = None  # the newest generation the persistent tier is known to hold
        self._committed: str | None = None  # the newest generation committed locally
        self._failures = 0  # failed uploads since the last one that went through
        self._parked = False  # the pending one failed: tried again at the next commit, wait or close
        self._tidied = False
        self._offers = 0  # local commits offered by this job
        self._newest: _Offer | None = None  # the newest one offered
        self._copied: str | None = None  # the newest generation whose peer copies are complete

    @property
    def protected(self) -> tuple[str, ...]:
        """The generations the local tiers must keep: the uploads in flight and pending, and the
        newest generation whose peer copies are complete (until a newer one's are)."""
        offers = [offer.generation for offer in (self._in_flight, self._pending) if offer is not None]
        return tuple(dict.fromkeys([*offers, *([self._copied] if self._copied else [])]))

    def resumed(self, generation: str, remote_newest: str | None, local: bool, partial: bool = False) -> None:
        """After the job resumed from ``generation`` (assembled from the local tiers when
        ``local``; ``remote_newest``: the persistent tier's newest then; ``partial``: a node
        lacks data files of it, those its ranks did not read or read as they arrived): both
        count as loaded for the owner check; a
        local generation is kept as the one whose copies are complete, and one the persistent
        tier lacks is offered for upload at once when every commit is uploaded (``upload_every``
        1), its copies made first, each file sent by a node that holds it; a partial one is
        copied again in the background otherwise, so every file is back on K+1 nodes.
        Collective; non-blocking."""
        self.loaded = tuple(sorted({generation, *([remote_newest] if remote_newest else [])}))
        self._committed = generation
        self._uploaded = remote_newest if local else generation
        self._copied = generation if local and self.copies else None
        if local and generation != remote_newest and self.upload_every == 1:  # the persistent tier lags
            self.offer(generation, shares_held(self.store, generation) if partial else {})
        elif partial and self.copies:
            self._pending = _Offer(generation, {}, publish=False)
            self.poll()

    def offer(self, generation: str, files: dict[str, tuple[int, int]]) -> None:
        """After ``generation`` committed locally: copy it to other nodes (``copies``) and, when
        it is due (every ``upload_every``-th commit, or it replaces a due one still pending),
        upload it, now if nothing is in flight on any rank, else as the pending one (replacing
        an older pending one). Collective; non-blocking."""
        self._committed = generation
        self._offers += 1
        due = self._offers % self.upload_every == 0 or (self._pending is not None and self._pending.publish)
        self._newest = _Offer(generation, dict(files), due)
        if not due and not self.copies:
            return  # nothing to do for it in the background: the local tier holds it
        self._pending, self._parked = self._newest, False
        self.poll()

    def poll(self) -> None:
        """Collect a finished upload and start the pending one (unless it failed last: then at
        the next commit, :meth:`drain` or close, so a server that is away costs no attempt per
        step); no-op while nothing is in flight or pending, one small reduction while an upload
        runs. Collective; non-blocking."""
        if self._in_flight is None and self._pending is None:
            return
        if self._in_flight is not None:
            if not dist.all_true(not self._writer.busy):
                return
            self._collect()
        if self._pending is not None and not self._parked:
            self._start(self._pending)

    def drain(self, newest: bool = False) -> None:
        """Wait for the upload in flight, then upload the pending generation and wait for it;
        with ``newest`` (at close) the newest local commit is published whatever
        ``upload_every`` says. Collective; blocking. Raises CheckpointError naming both tiers
        when the generation due (with ``newest``: the newest) is not in the persistent tier in
        the end."""
        if newest and (offer := self._newest_unpublished()) is not None:
            self._pending = offer
        if self._in_flight is not None:
            self._collect(blocking=True)
        if self._pending is not None:
            self._start(self._pending)
            self._collect(blocking=True)
        if self._pending is not None and not self._pending.publish:
            raise CheckpointError(
                f"{self.store.path(self._pending.generation)}: copying the newest recovery checkpoint to other "
                f"nodes' local tiers failed; {self._lag_text()}"
            )
        if self._pending is not None:
            raise CheckpointError(
                f"{self.store.path(self._pending.generation)}: the newest recovery checkpoint is committed on "
                f"this node's local tier only; its upload to {self.behind.where()} failed ({self._lag_text()}). A restart "
                "on this node resumes from it and uploads it"
            )

    def finish(self, within: float | None = None) -> None:
        """:meth:`drain` (newest), then stop the upload processes, even when it raised. With
        ``within`` (a preempted job, which must exit in time) the newest local commit's upload
        is given that many seconds: one not done by then is abandoned and one that failed is
        not tried again, both left to the next run with a warning, and nothing raises.
        Collective; blocking."""
        try:
            if within is None:
                self.drain(newest=True)
            else:
                self._drain_within(within)
        finally:
            self._writer.close()

    def _drain_within(self, seconds: float) -> None:
        """:meth:`finish` with a deadline ``seconds`` from now. Collective; blocking."""
        deadline = time.monotonic() + seconds
        if (offer := self._newest_unpublished()) is not None:
            self._pending, self._parked = offer, False
        for _ in range(2):  # the upload in flight, then the newest if it was not that one
            if self._in_flight is None:
                if self._pending is None or self._parked:
                    break
                self._start(self._pending)
            if not dist.all_true(self._writer.finished_within(max(0.0, deadline - time.monotonic()))):
                self._writer.abandon()
                self._pending, self._in_flight = self._pending or self._in_flight, None
                break
            self._collect(blocking=True)
        if self._pending is not None:
            logger.warning(
                "preempted: %s is not uploaded within recover.preemption_upload_seconds=%g; the local tier keeps it "
                "committed and the next run uploads it; %s",
                self.store.path(self._pending.generation),
                seconds,
                self._lag_text(),
            )

    def _newest_unpublished(self) -> _Offer | None:
        """The newest local commit as an offer to publish, None when there is none, it is
        uploaded, or its publishing upload is in flight. Local."""
        target = self._newest
        if target is None or self._uploaded == target.generation:
            return None
        offer = dataclasses.replace(target, publish=True)
        return None if self._in_flight == offer else offer

    def _start(self, offer: _Offer) -> None:
        job = UploadJob(
            trial=self.store.trial,
            behind=self.behind,
            generation=offer.generation,
            files=offer.files,
            run_token=self.run_token,
            loaded=self.loaded,
            retries=self.retries,
            tidy=not self._tidied and offer.publish,
            copies=self.copies,
            publish=offer.publish,
        )
        self._writer.submit(job)
        self._in_flight, self._pending = offer, None

    def _collect(self, blocking: bool = False) -> None:
        """Collect the upload in flight (every rank's has finished, or ``blocking``): record its
        metrics, or on any rank's failure stop the uploaders, log it and make its generation
        pending again unless a newer one is."""
        offer, self._in_flight = self._in_flight, None
        assert offer is not None
        outcome: JobOutcome | None = None
        failure: CheckpointError | None = None
        try:
            outcome = self._writer.wait()
        except CheckpointError as error:
            failure = error
        if dist.all_reduce_ints([int(failure is not None)], "max")[0]:
            self._writer.stop()
            self._failures += 1
            if self._pending is None:
                self._pending, self._parked = offer, True
            logger.warning(
                "%s: upload failed (%s); the local tier keeps it committed, and the newest is uploaded after the "
                "next local commit; %s",
                self.behind.where(offer.generation),
                failure or "on another rank",
                self._lag_text(),
            )
            self._record(None)
            return
        assert outcome is not None
        if self.copies:
            self._copied = offer.generation
        self._failures = 0
        if not offer.publish:
            self._record(outcome, published=False)
            logger.log(
                dist.job_info(), "copied recovery checkpoint %s to other nodes' local tiers", outcome.result["path"]
            )
            return
        self._tidied = True
        self._uploaded = offer.generation
        self._record(outcome)
        logger.log(
            dist.job_info(),
            "uploaded recovery checkpoint %s (%.3f GB in %.2f s, %.2f GB/s); %s",
            outcome.result["path"],
            self.metrics["upload/bytes"] / 1e9,
            self.metrics["upload/seconds"],
            self.metrics["upload/gbps"],
            self._lag_text(),
        )

    def _lag(self) -> int:
        """Steps by which the persistent tier lags the local tier (the whole newest step when it
        holds nothing of this trial)."""
        newest = 0 if self._committed is None else generation_step(self._committed)
        return newest - (-1 if self._uploaded is None else generation_step(self._uploaded))

    def _lag_text(self) -> str:
        held = "none of this trial's" if self._uploaded is None else self._uploaded
        return (
            f"{self.behind.where()} holds {held}, {self._lag()} step(s) behind the local tier's {self._committed} "
            f"({self._failures} failed upload(s) in a row)"
        )

    def _record(self, outcome: JobOutcome | None, published: bool = True) -> None:
        if outcome is not None and self.copies:
            self.metrics["copies/bytes_received"] = float(outcome.result["copied"])
            self.metrics["copies/seconds"] = outcome.seconds
        if outcome is not None and published:
            self.metrics = {
                **self.metrics,
                "upload/bytes": float(outcome.result["bytes"]),
                "upload/seconds": outcome.seconds,
                "upload/gbps": outcome.result["bytes"] / outcome.seconds / 1e9 if outcome.seconds > 0 else 0.0,
            }
        self.metrics = {
            **self.metrics,
            "upload/lag_steps": float(self._lag()),
            "upload/failures": float(self._failures),
        }
