"""A series of committed checkpoints (one model's exports) wherever it lives: the storage
contract the export path calls, chosen once per trial by :func:`areal_ckpt.storage.trials.export_trial`.

A checkpoint joins a series in four steps, the same on every location: rank 0 *reserves* its
name, the ranks write their large files (into the local staging folder, or straight to the
store through :meth:`CheckpointSeries.writer_of`), rank 0 *commits* the staging folder (which
holds the manifest), and on failure *discards* what was uploaded. Retention lists the
committed checkpoints and removes the surplus, never the newest. Two implementations:

- :class:`FolderSeries`: a folder on a POSIX file system (local disk, NFS, Lustre); the commit
  is one rename of the fsync'd staging folder (:func:`areal_ckpt.publish.publish`).
- :class:`ObjectSeries`: a prefix on an object store (any scheme of
  :mod:`areal_ckpt.storage.backends`); the commit uploads the rest and the manifest under a
  never-reused prefix, then writes a create-only commit record.

Every method is blocking and local to the calling process (no collective); the callers say
which rank calls it.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from areal_ckpt.errors import CheckpointError, CommitError
from areal_ckpt.fsio import FileWriter
from areal_ckpt.paths import MANIFEST_NAME, export_trash
from areal_ckpt.publish import hide_folder, publish
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.commits import CLAIMS, CommitLog, CommitRecord, claim_fresh_folder, delete_prefix, remove_debris
from areal_ckpt.storage.folders import check_uploaded, upload_rest
from areal_ckpt.storage.retention import Committed, RetentionPolicy, doomed_by
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)


@runtime_checkable
class CheckpointSeries(Protocol):
    """Where the committed checkpoints of one series live, and how a new one joins them.
    Implementations are plain, picklable data (a background writer receives them)."""

    def reserve(self, name: str) -> str:
        """Rank 0, before anything is written: the name the new checkpoint will be committed
        under (``name`` itself in a folder, where the commit replaces it whole; ``name`` or
        ``name.{n}`` on a store, a prefix never used before)."""

    def writer_of(self, reserved: str) -> Callable[[str], FileWriter] | None:
        """Where each rank's large files go as they are made: a function opening the store's
        writer of one file of the reserved checkpoint, or None to write them into the local
        staging folder."""

    def join_staging(self, staging: Path) -> None:
        """Every rank, before writing its files: the staging folder rank 0 prepared, as this
        rank sees it. On a store each node stages only its own small files, in a folder made
        here; a folder series' staging folder is rank 0's on the shared file system and is
        never made here, so a rank without that file system fails loudly instead of writing
        files rank 0 would commit without having them."""

    def commit(self, staging: Path, reserved: str, final: Path, uploaded: set[str], body: dict[str, Any]) -> int:
        """Rank 0: make the checkpoint in ``staging`` (manifest written, durable) the committed
        ``reserved`` one, whole or not at all; returns its commit order (0 for a folder). ``final`` is its folder when the series is a
        folder; ``uploaded`` the files the ranks wrote themselves (through :meth:`writer_of`:
        already in the store, or in ``staging``); ``body`` what the commit records (its name
        and step)."""

    def discard(self, reserved: str) -> None:
        """Rank 0, after a failed save: remove what was uploaded of ``reserved`` (best effort;
        the next start removes what is left)."""

    def location(self, reserved: str, final: Path) -> str:
        """Where the committed ``reserved`` checkpoint is: its folder or its URL."""

    def committed(self, step_of: Callable[[str], int | None]) -> list[Committed]:
        """The committed checkpoints, in no particular order; ``step_of`` reads the step from a
        checkpoint's name (a name it does not parse is not part of the series)."""

    def remove(self, doomed: list[Committed]) -> list[Path]:
        """Remove ``doomed`` so that no reader finds any of them any more (a folder is renamed
        to a trash name; on a store each commit record goes first, then its objects). Returns
        the local trash folders for the caller to delete off the hot path. Failures are
        logged, not raised."""

    def tidy(self) -> None:
        """Rank 0 when a job starts on the series: remove what earlier writers left
        uncommitted (objects no record names, unfinished uploads); nothing in a folder (its
        staging folders are removed with the trial's)."""


@dataclass(frozen=True)
class FolderSeries:
    """A series of checkpoint folders under ``root`` on a POSIX file system."""

    root: Path

    def reserve(self, name: str) -> str:
        """``name``: a folder's commit replaces a same-named one whole."""
        return name

    def writer_of(self, reserved: str) -> Callable[[str], FileWriter] | None:
        """None: files go into the staging folder, renamed into place at the commit."""
        return None

    def join_staging(self, staging: Path) -> None:
        """Nothing: rank 0 made it on the shared file system."""

    def commit(self, staging: Path, reserved: str, final: Path, uploaded: set[str], body: dict[str, Any]) -> int:
        """One rename of ``staging`` to ``final`` (fsync'd; an older folder of that name goes
        to the trash)."""
        publish(staging, final, export_trash(final))
        return 0

    def discard(self, reserved: str) -> None:
        """Nothing was written outside the staging folder."""

    def location(self, reserved: str, final: Path) -> str:
        """The folder."""
        return str(final)

    def committed(self, step_of: Callable[[str], int | None]) -> list[Committed]:
        """Every real folder (not a link) whose name parses; none when ``root`` is a link
        (nothing is deleted through a link) or missing."""
        if self.root.is_symlink():
            logger.warning("retention: %s is a symbolic link; not deleting old exports through it", self.root)
            return []
        if not self.root.is_dir():
            return []
        return [
            Committed(path.name, step, 0)
            for path in self.root.iterdir()
            if path.is_dir() and not path.is_symlink() and (step := step_of(path.name)) is not None
        ]

    def remove(self, doomed: list[Committed]) -> list[Path]:
        """Each folder renamed to its trash name (vanishes at once); returns the trash folders."""
        hidden = []
        for entry in doomed:
            path = self.root / entry.name
            try:
                hide_folder(path, export_trash(path))
                hidden.append(export_trash(path))
            except OSError as error:
                logger.warning("retention: could not remove %s: %s", path, error)
        return hidden

    def tidy(self) -> None:
        """Nothing: staging and trash folders are removed with the trial's."""


@dataclass(frozen=True)
class ObjectSeries:
    """A series of checkpoints under the prefix ``root`` of an object store, each committed by
    a create-only record in ``{root}/.commits/``; ``manifest`` names each checkpoint's
    manifest file. The one object commit sequence: exports, recovery generations, DeepSpeed
    tags and the command line's outputs all commit through :meth:`commit`.

    ``writer`` identifies the writer (a job's Saver) in its claims and records. With ``since``
    (the newest record's number when the writer started on the series) the series has one
    writer: a commit that would follow a record another writer made after ``since`` is refused
    (:class:`~areal_ckpt.errors.CommitError`, nothing committed), since object storage has no
    lock that dies with its holder to refuse the second job when it starts."""

    root: ObjectURL
    manifest: str = MANIFEST_NAME
    writer: str = ""
    since: int | None = None

    def reserve(self, name: str) -> str:
        """``name``, or the first free ``name.{n}``, claimed for this writer alone
        (:func:`~areal_ckpt.storage.commits.claim_fresh_folder`)."""
        return claim_fresh_folder(store_of(self.root), self.root, name, self.writer)

    def writer_of(self, reserved: str) -> Callable[[str], FileWriter] | None:
        """The store's writer of each file: uploaded from memory as it is written."""
        target = self.root.child(reserved)
        store = store_of(target)
        return lambda name: store.open_writer(target.key(name))

    def join_staging(self, staging: Path) -> None:
        """This node's own staging folder, made (rank 0's node already has it)."""
        staging.mkdir(parents=True, exist_ok=True)

    def commit(self, staging: Path, reserved: str, final: Path, uploaded: set[str], body: dict[str, Any]) -> int:
        """Upload what the manifest lists beyond ``uploaded``, then the manifest, then the
        create-only record naming ``reserved`` and this writer; returns the record's sequence
        number. CommitError, the record withdrawn, when another writer took its number or
        (with ``since``) committed after this one started, and CheckpointError naming each
        object when a file of ``reserved`` is not in the store once the record is written:
        the caller then discards ``reserved``."""
        target = self.root.child(reserved)
        store = store_of(target)
        upload_rest(store, staging, target, self.manifest, uploaded=uploaded)
        log = CommitLog(store, self.root)
        self._refuse_another_writer(log, None)
        record = log.append({**body, "folder": reserved, **({"writer": self.writer} if self.writer else {})})
        try:
            self._refuse_another_writer(log, record)
            missing = check_uploaded(store, staging, target, self.manifest)
            if missing:
                raise CheckpointError(
                    f"{target}: not committed, its objects went missing meanwhile: " + "; ".join(missing)
                )
        except BaseException:
            try:
                log.withdraw(record)
            except CheckpointError as error:
                logger.warning("%s: the refused commit record stays until it is removed: %s", self.root, error)
            raise
        return record.sequence

    def _refuse_another_writer(self, log: CommitLog, mine: CommitRecord | None) -> None:
        """With ``since``: CommitError naming it when the newest record before ``mine`` (before
        any, when ``mine`` is None) is newer than ``since`` and another writer's."""
        if self.since is None:
            return
        before = [sequence for sequence in log.sequences() if mine is None or sequence < mine.sequence]
        other = log.read(before[-1]) if before and before[-1] > self.since else None
        if other is not None and other.body.get("writer") != self.writer:
            raise CommitError(
                f"{self.root.child(other.folder)} was committed by another job after this one started on "
                f"{self.root}; two jobs must not write one trial (nothing of this checkpoint was committed): stop "
                "the other job and make this Saver again (it continues after the other's commits), or use another "
                "trial_name"
            )

    def discard(self, reserved: str) -> None:
        """Delete the objects uploaded under ``reserved``; a failure is logged (the next
        start removes them)."""
        target = self.root.child(reserved)
        try:
            delete_prefix(store_of(target), target.key() + "/")
            store_of(target).delete([self.root.key(CLAIMS, reserved)])
        except Exception as error:  # the server may be what failed
            logger.warning("could not remove the uncommitted %s (the next start does): %s", target, error)

    def location(self, reserved: str, final: Path) -> str:
        """The committed prefix's URL."""
        return str(self.root.child(reserved))

    def committed(self, step_of: Callable[[str], int | None]) -> list[Committed]:
        """What the commit records name: the step from the record's ``step`` (else from its
        ``name``), the order its sequence number, the label its ``tag``."""
        found = []
        for record in CommitLog(store_of(self.root), self.root).records():
            step = record.body.get("step")
            value = step.get("global_step") if isinstance(step, dict) else step_of(str(record.body.get("name", "")))
            label = record.body.get("tag")
            found.append(
                Committed(
                    record.folder,
                    value if isinstance(value, int) else -1,
                    record.sequence,
                    label if isinstance(label, str) else "",
                )
            )
        return found

    def remove(self, doomed: list[Committed]) -> list[Path]:
        """Each doomed record deleted, then its objects unless a remaining record names them."""
        log = CommitLog(store_of(self.root), self.root)
        try:
            records = log.records()
            orders = {entry.order for entry in doomed}
            kept = {record.folder for record in records if record.sequence not in orders}
            for record in records:
                if record.sequence in orders:
                    log.remove(record, kept)
        except CheckpointError as error:
            logger.warning("retention: could not remove old checkpoints of %s: %s", self.root, error)
        return []

    def tidy(self) -> None:
        """Objects no record names and unfinished uploads under the prefix removed."""
        store = store_of(self.root)
        remove_debris(store, self.root, CommitLog(store, self.root).committed_folders())


def retain(
    series: CheckpointSeries,
    policy: RetentionPolicy,
    newest: str,
    step_of: Callable[[str], int | None] = lambda name: None,
) -> tuple[list[Committed], list[Path]]:
    """Rank 0, after ``newest`` (a reserved name) was committed to ``series``: remove what
    ``policy`` dooms (:func:`~areal_ckpt.storage.retention.doomed_by`), so that no reader finds
    it any more. Returns what was removed and the local trash folders for the caller to delete
    off the training loop's path. Blocking; failures are logged, not raised: the commit it
    follows stands."""
    try:
        doomed = doomed_by(policy, series.committed(step_of), newest).remove
        return doomed, series.remove(doomed)
    except CheckpointError as error:
        logger.warning("retention: could not remove checkpoints older than %s: %s", newest, error)
        return [], []


def remove_trash(folders: list[Path]) -> None:
    """Delete trash folders :meth:`CheckpointSeries.remove` returned (blocking; errors
    ignored: a trash folder left behind is removed at the next start)."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
