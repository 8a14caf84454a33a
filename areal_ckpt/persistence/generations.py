"""Where a trial's recovery generations persist behind the node's own copy of the trial.

A recovery dump is always written and committed into a local store first
(:class:`~areal_ckpt.generations.store.RecoverStore`: the staging copy of a trial on object
storage, or the local tier of a tiered trial). The committed generation is then *published*
where the trial persists, and a restart *fetches* the newest one from there
(:mod:`~areal_ckpt.persistence.reading`). :class:`PersistentGenerations` is that side, one class
over the trial's recovery :class:`~areal_ckpt.storage.location.Location`
(:func:`~areal_ckpt.storage.location.recovery_location_of`): a prefix on any object store
(committed by a create-only record) or a trial folder on a shared file system (Lustre, NFS, GPFS:
each file copied in and fsync'd, then the ``current`` link switched, the same layout a job
without ``local_dir`` writes, so the shared trial reads as it is). Every commit carries the
publishing job's run token (in the record, or the manifest's header), for the owner check.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import FileWriter
from areal_ckpt.paths import RECOVER_MANIFEST, is_generation_name
from areal_ckpt.publish import read_manifest
from areal_ckpt.storage.folders import FileSource
from areal_ckpt.storage.location import recovery_location_of, remove_trash, retain
from areal_ckpt.storage.mirrors import Identity, identity_of
from areal_ckpt.storage.retention import Committed, KeepNewest
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)


def new_run_token() -> str:
    """A token naming one job (one RecoverHandler) in the commits it makes where a trial persists."""
    return secrets.token_hex(8)


class PersistentGenerations:
    """The committed recovery generations of the trial ``trial`` (a folder on a shared file
    system or an object prefix) where it persists. Every method but :meth:`publish` is local
    to the calling process; all block; picklable (a background uploader receives one). Errors
    are CheckpointError naming the location, TransientError where trying again may cure them."""

    def __init__(self, trial: Path | ObjectURL) -> None:
        self.trial = trial
        self.location = recovery_location_of(trial)

    def where(self, generation: str | None = None) -> str:
        """The trial's generations (a path or a URL), or those of ``generation``, for messages."""
        return self.location.where(generation)

    def identity(self) -> Identity:
        """The full identity of the trial's location (what a local tier of it records)."""
        return identity_of(self.trial)

    def check_access(self) -> None:
        """CheckpointError naming the location and the cause unless it can be used."""
        self.location.check_access()

    def newest_entry(self) -> Committed | None:
        """The newest commit, checked to name a generation; None when there is none;
        CheckpointError when the commit record is broken."""
        entry = self.location.newest()
        if entry is not None and not is_generation_name(entry.name):
            raise CheckpointError(f"{self.where()}: the commit names {entry.name!r}, not a recovery generation")
        return entry

    def newest(self) -> str | None:
        """The generation the newest commit names; None when there is none."""
        entry = self.newest_entry()
        return None if entry is None else entry.name

    def check_owner(self, run: str, loaded: Iterable[str]) -> None:
        """Rank 0 before a dump or an upload: CheckpointError, nothing written, unless the newest
        commit is none, one this job (``run``) made, or one of the generations it ``loaded``."""
        entry = self.newest_entry()
        if entry is None or entry.facts.get("run") == run or entry.name in set(loaded):
            return
        raise CheckpointError(
            f"{self.where(entry.name)} is a recovery checkpoint this job has not loaded (committed by another "
            "job); call RecoverHandler.load() first (or use another trial_name) so it is not overwritten"
        )

    def remove_debris(self) -> None:
        """Rank 0 at a job's first commit here (after :meth:`check_owner`): delete what killed
        writers left (:meth:`~areal_ckpt.storage.location.Location.tidy`); committed
        generations are kept."""
        removed = self.location.tidy()
        if removed:
            logger.warning("removed uncommitted recovery generations from %s: %s", self.where(), removed)

    def publish(
        self, folder: Path, mine: Mapping[str, tuple[int, int]], run: str, step: int, written: Iterable[str] = ()
    ) -> None:
        """Make the committed local generation ``folder`` the newest committed one here: every
        rank puts its own files (``mine``: name -> size and CRC-32, but those ``written`` here
        already by :meth:`direct_writer`), then rank 0 the other files the manifest lists, the
        manifest, and commits (naming ``run`` and ``step``); the generations it supersedes are
        deleted after. Every byte put is checked against its record (a local file that rotted
        or became a link is never committed here, nor a reason to delete what is). Collective;
        durable on return; every rank raises the same error when any part failed, and nothing is
        committed then."""
        generation, done = folder.name, set(written)
        own = {name: record for name, record in mine.items() if name not in done}

        def put_mine() -> list[str]:  # plain data: it crosses to rank 0
            self.location.put_own(folder, generation, sorted(own), own)
            return sorted(mine)

        def commit(every: list[list[str]]) -> None:
            uploaded = {name for names in every for name in names}
            files = read_manifest(folder, RECOVER_MANIFEST)["files"]
            rest = {name: (entry["size"], entry["crc32"]) for name, entry in files.items() if name not in uploaded}
            self.location.put_own(folder, generation, sorted(rest), rest)
            self.location.commit(folder, generation, uploaded | set(rest), {"run": run, "global_step": step})
            remove_trash(retain(self.location, KeepNewest(), generation)[1])

        agree.gathered_then_decided(put_mine, commit, f"{self.where(generation)}: copy failed (not committed there)")
        logger.log(dist.job_info(), "committed %s", self.where(generation))

    def files_of(self, generation: str) -> FileSource:
        """The files of ``generation``, to fetch."""
        return self.location.files_of(generation)

    def direct_writer(self, generation: str, part: str) -> Callable[[Path], FileWriter] | None:
        """What writes a data file of ``part`` straight here, bypassing the local copy (the
        file is uncommitted until :meth:`publish`): an object store's writer, from memory; None
        for a folder, where data files are written to the local tier and copied by
        :meth:`publish`."""
        write = self.location.writer_of(generation)
        return None if write is None else lambda path: write(f"{part}/{path.name}")
