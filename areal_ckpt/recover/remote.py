"""A trial's recovery generations on object storage, committed through a create-only log.

With ``fileroot: s3://bucket/prefix`` a dump is first written and committed, exactly as on a
local filesystem, into the local staging copy of the trial (``staging_dir``: each node its
own); then every rank uploads the files it wrote, and rank 0 the rest, the manifest, and last
the commit record ``{trial}/.recover/.commits/{n}.json`` naming the generation
(:mod:`areal_ckpt.storage.commits`). What object storage holds is what a restart loads: every
rank fetches into its staging copy the files of the newest committed generation that the copy
lacks (ranks sharing one copy take turns under a file lock), points the copy's ``current`` at
it and loads as from a local trial. Each commit record carries the writing job's run token, so
a job refuses to commit over a generation neither it wrote nor it loaded (a second job on the
trial) before uploading anything.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

from areal_ckpt import agree
from areal_ckpt.errors import CheckpointError, TransientError
from areal_ckpt.paths import RECOVER_CURRENT, RECOVER_MANIFEST, RECOVER_STORE, is_generation_name
from areal_ckpt.publish import switch_symlink
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.commits import CommitLog, CommitRecord, remove_debris, upload_folder_files
from areal_ckpt.storage.folders import fetch_shared
from areal_ckpt.storage.series import ObjectSeries
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)


def new_run_token() -> str:
    """A token naming one job (one RecoverHandler) in the commit records it writes."""
    return secrets.token_hex(8)


class RemoteGenerations:
    """The commit log of a trial's recovery generations on object storage (``trial``: the
    trial's prefix). Local to the calling process; blocking; picklable (the store is made
    per process)."""

    def __init__(self, trial: ObjectURL) -> None:
        self.trial = trial
        self.root = trial.child(RECOVER_STORE)

    def check_access(self) -> None:
        """CheckpointError naming the endpoint, bucket and cause unless the bucket answers."""
        store_of(self.root).check_access()

    @property
    def log(self) -> CommitLog:
        """The commit log under ``{trial}/.recover/``."""
        return CommitLog(store_of(self.root), self.root)

    def newest(self) -> CommitRecord | None:
        """The newest commit record, checked to name a generation; None when there is none."""
        record = self.log.newest()
        if record is not None and not is_generation_name(record.folder):
            raise CheckpointError(
                f"{self.root.url_of(self.root.key())}: commit {record.sequence} names {record.folder!r}, "
                "not a recovery generation"
            )
        return record

    def check_owner(self, run: str, loaded: Iterable[str]) -> None:
        """Rank 0 before a dump or an upload: CheckpointError unless the newest commit is none,
        one this job (``run``) wrote, or one of the generations it loaded (``loaded``: of a
        tiered trial, the one it resumed from and the one object storage held then); nothing
        is written otherwise."""
        record = self.newest()
        if record is None or record.body.get("run") == run or record.folder in set(loaded):
            return
        raise CheckpointError(
            f"{self.root.child(record.folder)} is a recovery checkpoint this job has not loaded (committed by "
            "another job); call RecoverHandler.load() first (or use another trial_name) so it is not overwritten"
        )

    def before_dump(self, run: str, loaded: list[str], first: bool, tiered: bool) -> None:
        """Rank 0 before a dump: :meth:`check_owner`, then at the job's ``first`` dump
        :meth:`remove_debris`. A ``tiered`` trial is checked at its first dump only, goes on
        (logged) when the bucket does not answer, since each of its uploads checks again, and
        leaves the debris to its first upload. Local; blocking."""
        if not tiered:
            self.check_owner(run, loaded)
            if first:
                self.remove_debris()
            return
        try:
            self.check_owner(run, loaded)
        except TransientError as error:
            logger.warning("%s; the dump commits to the local tier, its upload checks again", error)

    def remove_debris(self) -> None:
        """Rank 0 at a job's first dump (after :meth:`check_owner`): delete the objects of
        generations no commit record names and unfinished uploads, what killed dumps left."""
        log = self.log
        removed = remove_debris(log.store, self.root, log.committed_folders())
        if removed:
            logger.warning("removed uncommitted recovery generations from %s: %s", self.root, removed)

    def publish(self, folder: Path, mine: Iterable[str], run: str, step: int, uploaded: Iterable[str] = ()) -> None:
        """Upload the committed local generation ``folder``: every rank its own files
        (``mine``, but those ``uploaded`` already: written straight to the bucket), then rank 0 the
        other files it lists, its manifest and the commit record, then deletes older
        generations (record first). Collective; blocking; every rank raises the same error when
        any upload failed, and nothing is committed then."""
        target = self.root.child(folder.name)
        mine, done = sorted(mine), set(uploaded)

        def upload_mine() -> list[str]:
            upload_folder_files(store_of(target), folder, [name for name in mine if name not in done], target)
            return mine

        def commit(every: list[list[str]]) -> None:
            series = ObjectSeries(self.root, RECOVER_MANIFEST)
            uploaded = {name for names in every for name in names}
            newest = series.commit(folder, folder.name, folder, uploaded, {"run": run, "global_step": step})
            series.supersede(newest, lambda body: True)  # one generation: the newest

        agree.gathered_then_decided(upload_mine, commit, f"{target}: upload failed (not committed there)")
        logger.info("committed %s", target)

    def fetch_newest(self, store_root: Path, deferred: Callable[[str], bool] = lambda name: False) -> str | None:
        """Every rank: bring the newest committed generation into the local store ``store_root``
        and point its ``current`` at it; returns its name, None when object storage holds none.
        A file the copy already holds is kept when its size and CRC-32 match the manifest, else
        downloaded again (with a warning naming it: a local copy torn by a crash never makes a
        load fail while the bucket holds the file intact). Ranks sharing ``store_root`` take
        turns (a file lock) and the first one leaves a marker for the others of this load (a
        token rank 0 draws per load), so each copy is checked and completed once per load.
        The files ``deferred`` names are left for the reader to bring down
        (:class:`~areal_ckpt.storage.folders.OnDemandFiles`). Collective (the ranks agree on
        the generation and on success)."""

        decided = agree.decided_by_rank0(
            lambda: None if (record := self.newest()) is None else (record.folder, secrets.token_hex(4)),
            f"{self.root}: cannot read the commit log",
        )
        if decided is None:
            return None
        generation, token = decided

        def point_current(folder: Path) -> None:
            pointer = store_root / RECOVER_CURRENT
            if not pointer.is_symlink() or os.readlink(pointer) != generation:
                switch_symlink(pointer, generation)

        def fetch() -> None:
            source = self.root.child(generation)
            fetch_shared(
                store_of(source), source, store_root, RECOVER_MANIFEST, token, then=point_current, deferred=deferred
            )

        agree.on_every_rank(fetch, f"{self.root}: cannot fetch the committed recovery checkpoint")
        return generation
