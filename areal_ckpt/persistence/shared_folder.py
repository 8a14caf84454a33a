"""A trial's recovery generations on a shared file system (Lustre, NFS, GPFS) behind a node-local
tier: the POSIX implementation of :class:`~areal_ckpt.persistence.contract.PersistentGenerations`.

With ``fileroot`` a shared folder and ``recover.local_dir`` on each node's own disk (NVMe), a
dump commits to the local tier, then its files are copied into the shared trial, which is an
ordinary local trial (:class:`~areal_ckpt.generations.store.RecoverStore`, the same layout and
commit: manifest, fsync, then the ``current`` link switch). So the shared trial can be read as
it is: by a job without ``local_dir``, by ``areal-ckpt`` commands, by a node whose local disk
was lost. The job's run token goes into the shared manifest, as into a commit record on object
storage, for the owner check.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError, TransientError
from areal_ckpt.fsio import FileRecord, FileWriter, copy_durably, link_on_path, make_dirs
from areal_ckpt.generations.foreign import refuse_foreign_layout
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import RECOVER_MANIFEST
from areal_ckpt.publish import read_manifest
from areal_ckpt.storage.folders import FileSource, FolderSource
from areal_ckpt.storage.mirrors import Identity, identity_of

logger = logging.getLogger(__name__)

#: The manifest field naming the job that published a generation into a shared trial.
RUN_FIELD = "published_by_run"


class FolderGenerations:
    """The recovery generations of the trial folder ``trial`` on a shared file system. Local to
    the calling process but :meth:`publish`; blocking; picklable."""

    def __init__(self, trial: Path) -> None:
        self.trial = trial
        self.store = RecoverStore(trial)

    def where(self, generation: str | None = None) -> str:
        """The path of the trial's generations, or of ``generation``."""
        return str(self.store.root if generation is None else self.store.path(generation))

    def identity(self) -> Identity:
        """The shared trial folder's absolute path."""
        return identity_of(self.trial)

    def check_access(self) -> None:
        """CheckpointError naming the folder unless the trial's store is absent or a real
        folder, and the folder above the trial can be written."""
        self.store.check_root()
        try:
            make_dirs(self.trial)
        except OSError as error:
            raise CheckpointError(f"{self.trial}: cannot create the shared trial folder: {error}") from None

    def newest(self) -> str | None:
        """The committed generation of the shared trial (see :meth:`RecoverStore.committed`)."""
        return self.store.committed()

    def check_owner(self, run: str, loaded: Iterable[str]) -> None:
        """CheckpointError unless the shared trial's committed generation is none, one of
        ``loaded``, or one this job (``run``) published."""
        committed = self.store.committed()
        if committed is None or committed in set(loaded):
            return
        try:
            published_by = read_manifest(self.store.path(committed), RECOVER_MANIFEST).get(RUN_FIELD)
        except CheckpointError:
            published_by = None
        if published_by == run:
            return
        raise CheckpointError(
            f"{self.store.path(committed)} is a recovery checkpoint this job has not loaded (committed by another "
            "job); call RecoverHandler.load() first (or use another trial_name) so it is not overwritten"
        )

    def remove_debris(self) -> None:
        """Delete the shared trial's uncommitted generations (never a complete one newer than
        the committed one, see :meth:`RecoverStore.remove_debris`)."""
        refuse_foreign_layout(self.trial)
        removed = self.store.remove_debris(keep=self.store.committed())
        if removed:
            logger.warning("removed uncommitted recovery generations from %s: %s", self.store.root, removed)

    def publish(
        self, folder: Path, mine: Mapping[str, tuple[int, int]], run: str, step: int, written: Iterable[str] = ()
    ) -> None:
        """Copy the committed local generation ``folder`` into the shared trial and commit it
        there (see :meth:`PersistentGenerations.publish`): each file fsync'd, its bytes as read
        checked against the local manifest (size and CRC-32) before the commit, then rank 0's
        manifest (with the job's ``run``) and the ``current`` switch; the generations it
        supersedes are deleted after. Collective; durable on return."""
        target = self.store.path(folder.name)
        done = set(written)

        def copy_mine() -> dict[str, tuple[int, int]]:  # plain data: it crosses to rank 0
            return _copy(folder, target, sorted(name for name in mine if name not in done))

        def commit(every: list[dict[str, tuple[int, int]]]) -> None:
            manifest = read_manifest(folder, RECOVER_MANIFEST)
            files = manifest["files"]
            copied = {name: record for records in every for name, record in records.items()}
            copied.update(_copy(folder, target, sorted(set(files) - set(copied) - done)))
            listed = {name: (entry["size"], entry["crc32"]) for name, entry in files.items()}
            differing = [name for name, record in copied.items() if listed.get(name) != record]
            if differing:
                raise CheckpointError(
                    f"{folder}: {differing[:5]} differ from the local manifest (damaged on the local tier); "
                    f"not committed in {self.store.root}"
                )
            header = {key: value for key, value in manifest.items() if key != "files"}
            records = {name: FileRecord(*record) for name, record in listed.items()}
            try:
                hidden = self.store.commit(folder.name, records, {**header, RUN_FIELD: run}, list(manifest["models"]))
            except OSError as error:
                raise TransientError(f"{target}: cannot commit: {error}") from error
            for name in hidden:
                shutil.rmtree(self.store.root / name, ignore_errors=True)

        agree.gathered_then_decided(copy_mine, commit, f"{target}: copy failed (not committed there)")
        logger.log(dist.job_info(), "committed %s", target)

    def files_of(self, generation: str) -> FileSource:
        """The files of ``generation`` in the shared trial."""
        return FolderSource(self.store.path(generation))

    def direct_writer(self, generation: str, part: str) -> Callable[[Path], FileWriter] | None:
        """None: data files are written to the local tier and copied by :meth:`publish`."""
        return None


def _copy(folder: Path, target: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    """Copy ``names`` from ``folder`` into ``target`` (each fsync'd; never through a link on
    either side); returns the size and CRC-32 of the bytes copied, by name. TransientError
    naming the file when a copy fails."""
    copied = {}
    for name in names:
        source, path = folder / name, target / name
        link = link_on_path(path, target.parent) or link_on_path(source, folder)
        if link is not None:
            raise CheckpointError(f"{link}: a link; not copying through it")
        try:
            make_dirs(path.parent)
            record = copy_durably(source, path)
        except OSError as error:
            raise TransientError(f"cannot copy {source} to {path}: {error}") from error
        copied[name] = (record.size, record.crc32)
    return copied
