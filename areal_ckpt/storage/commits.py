"""Committing a folder of files to object storage without rename or compare-and-swap.

A checkpoint on object storage is a *generation*: a key prefix that is never reused, holding
immutable objects (the data files, then the manifest with every file's size and CRC-32). It
becomes visible only through a *commit record*, a small JSON object written last, create-only
(``If-None-Match: *``), in a commit log: ``{log}/{sequence:012d}.json``. Sequence numbers only
grow, so the newest generation is the record with the highest number, found by one listing;
two writers that race for the same number cannot both win (create-only had exactly one
winner in every contended round measured), so a commit is never silently overwritten. A
reader looks only at generations a record names; objects under any other prefix are debris
of a writer that died, removed by the next writer. Retention deletes a record first, then the
data it named.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError, CommitError
from areal_ckpt.storage.objects import ObjectStore
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)

COMMIT_LOG = ".commits"
#: Beside a commit log: the records ``recover-pointer`` moved out of it (kept, never debris).
SET_ASIDE = ".commits-set-aside"
#: Beside a commit log: one create-only claim per reserved folder (``{name}``: who reserved it).
CLAIMS = ".claims"
#: How long a claimed folder that no record names is presumed to belong to a live writer,
#: counted from its claim or its newest object, whichever is younger (seconds).
CLAIM_SECONDS = 3600.0
_RECORD = re.compile(r"^(\d{12})\.json$")
_RECORD_LIMIT = 1 << 20
_SEQUENCE_LIMIT = 10**12  # twelve digits: a record past them would not be read as one
_UPLOADERS = 4


@dataclass(frozen=True)
class CommitRecord:
    """One commit: its sequence number and what it says (``folder``: the generation's prefix
    relative to the log's parent, plus the writer's own fields)."""

    sequence: int
    body: dict[str, Any]
    #: When the record was written (unix time, from the listing that found it; None otherwise).
    modified: float | None = None

    @property
    def folder(self) -> str:
        """The committed generation's prefix, relative to the commit log's parent."""
        return str(self.body["folder"])


class CommitLog:
    """The commit records of one prefix (a model's exports, a trial's recovery dumps):
    ``{parent}/.commits/{sequence:012d}.json``. Local to the calling process; blocking."""

    def __init__(self, store: ObjectStore, parent: ObjectURL) -> None:
        self.store = store
        self.parent = parent
        self._prefix = parent.key(COMMIT_LOG) + "/"

    def sequences(self) -> list[int]:
        """The sequence numbers of the records present, ascending (one listing). CheckpointError
        naming it for an object in the log whose name is not a record's (``{n:012d}.json``): no
        reader would see it, so a commit or a retention decided without it could lose or hide a
        checkpoint; nothing is written or deleted then."""
        return sorted(self._listed())

    def _listed(self) -> dict[int, float]:
        """The records present: sequence number -> when written (one listing); CheckpointError
        as in :meth:`sequences`."""
        found = {}
        for item in self.store.list_prefix(self._prefix):
            match = _RECORD.match(item.key[len(self._prefix) :])
            if match is None:
                raise CheckpointError(
                    f"{self.parent.url_of(item.key)}: not a commit record's name (records are "
                    f"{COMMIT_LOG}/NNNNNNNNNNNN.json, twelve digits); nothing was written or deleted: move it out "
                    f"of {self.parent.url_of(self._prefix)}"
                )
            found[int(match.group(1))] = item.modified
        return found

    def read(self, sequence: int) -> CommitRecord | None:
        """The record ``sequence`` (None when it was deleted meanwhile); CheckpointError naming
        its URL when it is not a commit record (not JSON, no ``folder``, an unsafe folder)."""
        key = self._key(sequence)
        raw = self.store.get_bytes(key)
        if raw is None:
            return None
        try:
            if len(raw) > _RECORD_LIMIT:
                raise ValueError(f"{len(raw)} bytes")
            body = json.loads(raw)
            folder = body["folder"]
            if not isinstance(folder, str) or not folder or any(p in ("", ".", "..") for p in folder.split("/")):
                raise ValueError(f"folder {folder!r}")
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{self.parent.url_of(key)}: not a commit record ({error})") from None
        return CommitRecord(sequence, body)

    def records(self) -> list[CommitRecord]:
        """Every record present, oldest first, each with when it was written (one listing)."""
        listed = self._listed()
        return [
            CommitRecord(record.sequence, record.body, listed[sequence])
            for sequence in sorted(listed)
            if (record := self.read(sequence)) is not None
        ]

    def newest(self) -> CommitRecord | None:
        """The record with the highest sequence number, or None when there is none."""
        for sequence in reversed(self.sequences()):
            record = self.read(sequence)
            if record is not None:
                return record
        return None

    def append(self, body: dict[str, Any]) -> CommitRecord:
        """Write the next record, create-only: the commit. CommitError, nothing written, when
        another writer took that number first (a second job on the same prefix). Idempotent: when
        the newest record holds exactly ``body`` (an earlier attempt landed although its answer
        was lost), that record is the commit and nothing is written."""
        sequences = self.sequences()
        data = json.dumps(body, indent=1, sort_keys=True).encode()
        if sequences and self.store.get_bytes(self._key(sequences[-1])) == data:
            return CommitRecord(sequences[-1], body)
        sequence = (sequences[-1] if sequences else 0) + 1
        if sequence >= _SEQUENCE_LIMIT:
            raise CheckpointError(
                f"{self.parent.url_of(self._key(sequences[-1]))}: the commit log is full (its last number is "
                "taken); nothing was committed or deleted: a new trial_name (or prefix) starts a new log"
            )
        if not self.store.put_bytes(self._key(sequence), data, create_only=True):
            if self.store.get_bytes(self._key(sequence)) == data:  # an earlier attempt of this very PUT landed
                return CommitRecord(sequence, body)
            raise CommitError(
                f"{self.parent.url_of(self._key(sequence))}: another job committed to {self.parent} at the same time; "
                "two jobs must not write one trial (nothing of this checkpoint was committed)"
            )
        return CommitRecord(sequence, body)

    def remove(self, record: CommitRecord, kept: set[str]) -> None:
        """Delete ``record`` and then every object of the generation it named and its claim
        (retention), unless a record that stays (its folder in ``kept``) names that generation
        too."""
        self.store.delete([self._key(record.sequence)])
        if record.folder not in kept:
            delete_prefix(self.store, self.parent.key(record.folder) + "/")
            self.store.delete([self.parent.key(CLAIMS, record.folder)])

    def withdraw(self, record: CommitRecord) -> None:
        """Delete ``record`` alone, right after this writer appended it (its commit is refused);
        the generation's objects are the caller's to discard."""
        self.store.delete([self._key(record.sequence)])

    def set_aside(self, sequence: int) -> str:
        """An operator's repair: move the record ``sequence`` (one no reader can use) out of the
        log, to ``{parent}/.commits-set-aside/`` (kept byte for byte, never removed as debris);
        returns its new URL."""
        data = self.store.get_bytes(self._key(sequence))
        aside = self.parent.key(SET_ASIDE, f"{sequence:012d}.json")
        if data is not None:
            self.store.put_bytes(aside, data)
            self.store.delete([self._key(sequence)])
        return self.parent.url_of(aside)

    def committed_folders(self) -> set[str]:
        """The folders every present record names."""
        return {record.folder for record in self.records()}

    def _key(self, sequence: int) -> str:
        return f"{self._prefix}{sequence:012d}.json"


def claim_fresh_folder(store: ObjectStore, parent: ObjectURL, name: str, writer: str) -> str:
    """Reserve for ``writer`` alone the first of ``name``, ``{name}.1``, ``{name}.2``... under
    which no object was ever kept and no other writer holds a claim, by writing its claim
    ``{parent}/.claims/{folder}`` create-only: of several writers reserving at once each gets
    its own folder, and a reader of an older commit never sees a newer writer's objects.
    Returns the folder. Blocking."""
    base, claims = parent.key() + "/", parent.key(CLAIMS) + "/"
    taken = {item.key[len(base) :].split("/", 1)[0] for item in store.list_prefix(parent.key(name))}
    taken |= {item.key[len(claims) :] for item in store.list_prefix(claims + name)}
    claim = json.dumps({"writer": writer, "host": socket.gethostname(), "pid": os.getpid()}).encode()
    number = 0
    while True:
        folder = f"{name}.{number}" if number else name
        number += 1
        if folder not in taken and store.put_bytes(claims + folder, claim, create_only=True):
            return folder


class FolderUploader:
    """Uploads files of the local ``folder`` to ``{target}/{name}`` on helper threads, a few
    files at a time (each large one in parallel parts), while the caller goes on (writing the
    next file). Local to the calling process."""

    def __init__(self, store: ObjectStore, folder: Path, target: ObjectURL) -> None:
        self.store, self.folder, self.target = store, folder, target
        self._pool = ThreadPoolExecutor(_UPLOADERS, thread_name_prefix="areal_ckpt-upload")
        self._pending: list[Future[None]] = []

    def submit(self, name: str) -> None:
        """Start uploading ``name`` (complete on disk, unchanged from now on); returns at once."""
        self._pending.append(self._pool.submit(self.store.put_file, self.target.key(name), self.folder / name))

    def wait(self) -> None:
        """Block until every submitted file is uploaded; raises the first error (an interruption
        included) once the uploads in flight ended, the queued ones cancelled."""
        try:
            for done in self._pending:
                done.result()
        finally:
            self._pool.shutdown(cancel_futures=True)


def upload_folder_files(store: ObjectStore, folder: Path, names: Iterable[str], target: ObjectURL) -> None:
    """Upload each of ``names`` (relative to the local ``folder``) to ``{target}/{name}``
    (:class:`FolderUploader`). Blocking; raises the first error."""
    uploader = FolderUploader(store, folder, target)
    for name in names:
        uploader.submit(name)
    uploader.wait()


def delete_prefix(store: ObjectStore, prefix: str) -> int:
    """Delete every object under the key ``prefix``; how many."""
    keys = [item.key for item in store.list_prefix(prefix)]
    store.delete(keys)
    return len(keys)


def remove_debris(store: ObjectStore, parent: ObjectURL, keep: set[str]) -> list[str]:
    """Delete what writers that died left under ``parent``: the objects whose first path part
    is neither a committed folder in ``keep`` nor the commit log's, their claims, and the
    unfinished multipart uploads there. A folder claimed (:func:`claim_fresh_folder`) less
    than :data:`CLAIM_SECONDS` ago, counted from its claim or its newest object, may belong to
    a writer still at work (another job's Saver, a slow upload) and is left alone, logged.
    Returns the folders removed. Blocking."""
    base, claims = parent.key() + "/", parent.key(CLAIMS) + "/"
    debris: dict[str, list[str]] = {}
    touched: dict[str, float] = {}
    for item in store.list_prefix(base):
        relative = item.key[len(base) :]
        top = relative.split("/", 1)[0]
        if item.key.startswith(claims):
            top = relative[len(CLAIMS) + 1 :]
        elif top in (COMMIT_LOG, SET_ASIDE, CLAIMS) or "/" not in relative:
            continue
        if top not in keep:
            debris.setdefault(top, []).append(item.key)
            touched[top] = max(touched.get(top, 0.0), item.modified)
    now = time.time()
    live = {folder for folder in debris if claims + folder in debris[folder] and now - touched[folder] < CLAIM_SECONDS}
    for folder in sorted(live):
        logger.info(
            "kept %s: not committed, but claimed by a writer that may still be at work", parent.url_of(base + folder)
        )
    for folder, keys in sorted(debris.items()):
        if folder not in live:
            store.delete(keys)
            logger.info("removed %s: objects of a checkpoint that was never committed", parent.url_of(base + folder))
    aborted = store.abort_uploads(base, spared=frozenset(base + folder + "/" for folder in live))
    if aborted:
        logger.info("aborted %d unfinished upload(s) under %s", aborted, parent)
    return sorted(set(debris) - live)
