"""A trial's recovery generations on object storage, committed through a create-only log: the
object-store implementation of :class:`~areal_ckpt.persistence.contract.PersistentGenerations`.

With ``fileroot: s3://bucket/prefix`` (or ``gs://``, ``az://``) a dump is first written and
committed, exactly as on a local filesystem, into the local staging copy of the trial
(``staging_dir``: each node its own), its data files streamed straight to the bucket; then every
rank uploads the other files it wrote, and rank 0 the rest, the manifest, and last the commit
record ``{trial}/.recover/.commits/{n}.json`` naming the generation
(:mod:`areal_ckpt.storage.commits`). What object storage holds is what a restart loads
(:func:`~areal_ckpt.persistence.contract.fetch_committed`). Each commit record carries the writing
job's run token, so a job refuses to commit over a generation neither it wrote nor it loaded (a
second job on the trial) before uploading anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import FileWriter
from areal_ckpt.paths import RECOVER_MANIFEST, RECOVER_STORE, is_generation_name
from areal_ckpt.publish import read_manifest
from areal_ckpt.storage.folders import FileSource, check_local_copy
from areal_ckpt.storage.location import recovery_location_of, retain
from areal_ckpt.storage.mirrors import Identity, identity_of
from areal_ckpt.storage.retention import Committed, KeepNewest
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)


class ObjectGenerations:
    """A trial's recovery generations on object storage (``trial``: the trial's prefix), a thin
    consumer of the :class:`~areal_ckpt.storage.object_location.ObjectLocation` at
    ``{trial}/.recover``. Local to the calling process but :meth:`publish`; blocking; picklable
    (the store is made per process)."""

    def __init__(self, trial: ObjectURL) -> None:
        self.trial = trial
        self.root = trial.child(RECOVER_STORE)
        self.location = recovery_location_of(trial)

    def where(self, generation: str | None = None) -> str:
        """The URL of the trial's generations, or of ``generation``."""
        return self.location.where(generation)

    def identity(self) -> Identity:
        """The trial prefix's scheme, endpoint, bucket and prefix."""
        return identity_of(self.trial)

    def check_access(self) -> None:
        """CheckpointError naming the endpoint, bucket and cause unless the bucket answers."""
        self.location.check_access()

    def newest_entry(self) -> Committed | None:
        """The newest commit, checked to name a generation; None when there is none."""
        entry = self.location.newest()
        if entry is not None and not is_generation_name(entry.name):
            raise CheckpointError(f"{self.root}: commit {entry.order} names {entry.name!r}, not a recovery generation")
        return entry

    def newest(self) -> str | None:
        """The generation the newest commit names; None when there is none."""
        entry = self.newest_entry()
        return None if entry is None else entry.name

    def check_owner(self, run: str, loaded: Iterable[str]) -> None:
        """CheckpointError unless the newest commit is none, one this job (``run``) wrote, or
        one of the generations it ``loaded``; nothing is written otherwise."""
        entry = self.newest_entry()
        if entry is None or entry.facts.get("run") == run or entry.name in set(loaded):
            return
        raise CheckpointError(
            f"{self.root.child(entry.name)} is a recovery checkpoint this job has not loaded (committed by "
            "another job); call RecoverHandler.load() first (or use another trial_name) so it is not overwritten"
        )

    def remove_debris(self) -> None:
        """Delete the objects of generations no commit names and unfinished uploads."""
        removed = self.location.tidy()
        if removed:
            logger.warning("removed uncommitted recovery generations from %s: %s", self.root, removed)

    def publish(
        self, folder: Path, mine: Mapping[str, tuple[int, int]], run: str, step: int, written: Iterable[str] = ()
    ) -> None:
        """Upload the committed local generation ``folder`` (see
        :meth:`PersistentGenerations.publish`): each file checked against its record (size,
        CRC-32, no link) before it goes up, then rank 0 commits with a create-only record and
        deletes every older generation (record first). Collective; blocking."""
        generation, done = folder.name, set(written)
        own = {name: {"size": size, "crc32": crc} for name, (size, crc) in mine.items() if name not in done}

        def upload_mine() -> list[str]:
            check_local_copy(folder, own, sorted(own))
            self.location.put_own(folder, generation, sorted(own))
            return sorted(mine)

        def commit(every: list[list[str]]) -> None:
            uploaded = {name for names in every for name in names}
            files = read_manifest(folder, RECOVER_MANIFEST)["files"]
            check_local_copy(folder, files, sorted(set(files) - uploaded))
            self.location.commit(folder, generation, uploaded, {"run": run, "global_step": step})
            retain(self.location, KeepNewest(), generation)

        agree.gathered_then_decided(
            upload_mine, commit, f"{self.where(generation)}: upload failed (not committed there)"
        )
        logger.log(dist.job_info(), "committed %s", self.where(generation))

    def files_of(self, generation: str) -> FileSource:
        """The objects of ``generation``."""
        return self.location.files_of(generation)

    def direct_writer(self, generation: str, part: str) -> Callable[[Path], FileWriter]:
        """Writes a data file of ``part`` from memory straight to the generation's prefix."""
        write = self.location.writer_of(generation)
        assert write is not None  # an object location writes every file from memory
        return lambda path: write(f"{part}/{path.name}")
