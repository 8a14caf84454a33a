"""A :class:`~areal_ckpt.storage.location.Location` under a prefix of an object store (any scheme
of :mod:`areal_ckpt.storage.backends`): a checkpoint is committed by a create-only record written
after its objects (:mod:`areal_ckpt.storage.commits`)."""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from areal_ckpt.errors import CheckpointError, CommitError
from areal_ckpt.fsio import FileWriter
from areal_ckpt.paths import EXPORT_STAGING_PREFIX, MANIFEST_NAME
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.commits import (
    CLAIMS,
    COMMIT_LOG,
    CommitLog,
    CommitRecord,
    claim_fresh_folder,
    delete_prefix,
    remove_debris,
    upload_folder_files,
)
from areal_ckpt.storage.folders import (
    FileSource,
    ObjectSource,
    Opened,
    check_local_copy,
    check_uploaded,
    fetch_shared,
    staging_root,
    upload_rest,
)
from areal_ckpt.storage.objects import ObjectInfo
from areal_ckpt.storage.retention import Committed
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectLocation:
    """Checkpoints under the prefix ``root`` of an object store, each committed by a create-only
    record in ``{root}/.commits/``; ``manifest`` names each checkpoint's manifest file. The one
    object commit sequence: exports, recovery generations, DeepSpeed tags and the command line's
    outputs all commit through :meth:`commit`. Its pointer is the newest record of a commit that
    pointed (``"latest": true``); its labels the records' ``tag``.

    ``writer`` identifies the writer (a job's Saver) in its claims and records. With ``since``
    (the newest record's number when the writer started on the location) the location has one
    writer: a commit that would follow a record another writer made after ``since`` is refused
    (:class:`~areal_ckpt.errors.CommitError`, nothing committed), since object storage has no
    lock that dies with its holder to refuse the second job when it starts."""

    root: ObjectURL
    manifest: str = MANIFEST_NAME
    writer: str = ""
    since: int | None = None
    shared_staging: ClassVar[bool] = False

    def where(self, name: str | None = None) -> str:
        """The prefix's URL, or the checkpoint's."""
        return str(self.root if name is None else self.root.child(name))

    def check_access(self) -> None:
        """CheckpointError naming the endpoint, bucket and cause unless the bucket answers."""
        store_of(self.root).check_access()

    def reserve(self, name: str) -> str:
        """``name``, or the first free ``name.{n}``, claimed for this writer alone
        (:func:`~areal_ckpt.storage.commits.claim_fresh_folder`)."""
        return claim_fresh_folder(store_of(self.root), self.root, name, self.writer)

    def stage(self, name: str, rank: int) -> Path:
        """This rank's own ``.export-staging.{name}.rank{rank}`` in the node's cache of the
        prefix (:func:`~areal_ckpt.storage.folders.staging_root`), made empty."""
        staging = staging_root(None, self.root) / f"{EXPORT_STAGING_PREFIX}{name}.rank{rank}"
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        except OSError as error:
            raise CheckpointError(f"{staging}: cannot prepare the staging folder: {error}") from error
        return staging

    def unstage(self, staging: Path, rank: int) -> None:
        """Every rank removes its own."""
        shutil.rmtree(staging, ignore_errors=True)

    def join_staging(self, staging: Path) -> None:
        """This node's own staging folder, made (rank 0's node already has it)."""
        staging.mkdir(parents=True, exist_ok=True)

    def writer_of(self, reserved: str) -> Callable[[str], FileWriter] | None:
        """The store's writer of each file: uploaded from memory as it is written."""
        target = self.root.child(reserved)
        store = store_of(target)
        return lambda name: store.open_writer(target.key(name))

    def put_own(
        self, staging: Path, reserved: str, names: list[str], expected: Mapping[str, tuple[int, int]] | None = None
    ) -> None:
        """Upload ``names`` from ``staging`` to the reserved prefix, each first checked against
        its ``expected`` record when given (:func:`~areal_ckpt.storage.folders.check_local_copy`)."""
        if expected is not None:
            records = {name: {"size": size, "crc32": crc} for name, (size, crc) in expected.items()}
            check_local_copy(staging, records, sorted(names))
        target = self.root.child(reserved)
        upload_folder_files(store_of(target), staging, sorted(names), target)

    def commit(
        self, staging: Path, reserved: str, uploaded: set[str], body: dict[str, Any], point: bool = False
    ) -> int:
        """Upload what the manifest lists beyond ``uploaded``, then the manifest, then the
        create-only record naming ``reserved``, this writer and (``point``) ``"latest": true``;
        returns the record's sequence number. CommitError, the record withdrawn, when another
        writer took its number or (with ``since``) committed after this one started, and
        CheckpointError naming each object when a file of ``reserved`` is not in the store once
        the record is written: the caller then discards ``reserved``."""
        target = self.root.child(reserved)
        store = store_of(target)
        upload_rest(store, staging, target, self.manifest, uploaded=uploaded)
        log = CommitLog(store, self.root)
        self._refuse_another_writer(log, None)
        fields = {**body, "folder": reserved, **({"writer": self.writer} if self.writer else {})}
        record = log.append({**fields, "latest": True} if point else fields)
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

    def committed(self, step_of: Callable[[str], int | None] = lambda name: None) -> list[Committed]:
        """What the commit records name: the step from the record's ``step`` (else from its
        ``name``), the order its sequence number, the label its ``tag``, the facts its fields,
        the time its record's."""
        return [_committed_of(record, step_of) for record in CommitLog(store_of(self.root), self.root).records()]

    def newest(self, step_of: Callable[[str], int | None] = lambda name: None) -> Committed | None:
        """The newest record's entry (its time unknown); one listing and one read."""
        record = CommitLog(store_of(self.root), self.root).newest()
        return None if record is None else _committed_of(record, step_of)

    def named(self, label: str) -> str | None:
        """The folder of the newest record whose ``tag`` is ``label``."""
        return self._newest(lambda record: record.body.get("tag") == label)

    def pointed(self) -> str | None:
        """The folder of the newest record of a commit that pointed."""
        return self._newest(lambda record: record.body.get("latest") is True)

    def _newest(self, chosen: Callable[[CommitRecord], bool]) -> str | None:
        """The folder of the newest record ``chosen`` accepts that names one prefix right under
        the root (a forged record naming a deeper one is not followed)."""
        for record in reversed(CommitLog(store_of(self.root), self.root).records()):
            if chosen(record) and "/" not in record.folder:
                return record.folder
        return None

    def files_of(self, name: str) -> FileSource:
        """The objects under the checkpoint's prefix."""
        return ObjectSource(self.root.child(name))

    def open(self, name: str, token: str, deferred: Callable[[str], bool] = lambda file: False) -> Opened:
        """The node's checked copy in its cache of the prefix, completed once per ``token``
        (:func:`~areal_ckpt.storage.folders.fetch_shared`); ``deferred`` files come down as read."""
        source = self.files_of(name)
        copy = fetch_shared(source, staging_root(None, self.root), self.manifest, token, deferred=deferred)
        return Opened(copy, source)

    def place(self, name: str, data: bytes) -> None:
        """The object ``{root}/{name}`` put unless it holds ``data`` already."""
        store = store_of(self.root)
        if store.get_bytes(self.root.key(name)) != data:
            store.put_bytes(self.root.key(name), data)

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

    def tidy(self) -> list[str]:
        """Objects no record names and unfinished uploads under the prefix removed; returns the
        folders removed."""
        store = store_of(self.root)
        return remove_debris(store, self.root, CommitLog(store, self.root).committed_folders())

    def present(self) -> list[str]:
        """The first parts of the keys under the prefix, but those with a leading dot (the
        records, claims and side files): every checkpoint prefix, committed or not."""
        base = self.root.key() + "/"
        found = {item.key[len(base) :].split("/", 1)[0] for item in store_of(self.root).list_prefix(base)}
        return sorted(name for name in found if not name.startswith("."))

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Nothing held: a store has no lock (an operator's repair runs while no job writes the
        prefix)."""
        return contextlib.nullcontext()

    def mend(self) -> dict[str, list[str]]:
        """Every commit record no reader can use moved out of the log (kept, see
        :meth:`~areal_ckpt.storage.commits.CommitLog.set_aside`): it would stop every later load
        and tidy. Returns each with its problem and where it went."""
        log = CommitLog(store_of(self.root), self.root)
        moved: dict[str, list[str]] = {}
        for sequence in log.sequences():
            try:
                log.read(sequence)
            except CheckpointError as error:
                moved[f"commit {sequence}"] = [str(error), f"moved out of the log to {log.set_aside(sequence)}"]
        return moved

    def recommit(self, name: str, body: dict[str, Any]) -> None:
        """A new create-only commit record naming the present checkpoint ``name``."""
        CommitLog(store_of(self.root), self.root).append({**body, "folder": name})


def locations_in(url: ObjectURL, listing: list[ObjectInfo]) -> list[ObjectURL]:
    """The locations at ``url`` or one level below it (a model's exports, a trial's recovery
    generations, a save_dir) that hold commit records, found in ``listing`` (every object under
    ``url``), sorted. Pure."""
    base = url.key() + "/" if url.key() else ""
    found: set[str] = set()
    for item in listing:
        parts = item.key[len(base) :].split("/")
        if len(parts) in (2, 3) and parts[-2] == COMMIT_LOG:
            found.add("/".join(parts[:-2]))
    return [url.child(name) if name else url for name in sorted(found)]


def _committed_of(record: CommitRecord, step_of: Callable[[str], int | None]) -> Committed:
    """The entry of one commit record (see :meth:`ObjectLocation.committed`)."""
    step = record.body.get("step")
    value = step.get("global_step") if isinstance(step, dict) else step_of(str(record.body.get("name", "")))
    label = record.body.get("tag")
    return Committed(
        record.folder,
        value if isinstance(value, int) else -1,
        record.sequence,
        label if isinstance(label, str) else "",
        record.body,
        record.modified,
    )
