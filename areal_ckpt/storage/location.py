"""Where committed checkpoints live: the one location contract (:class:`Location`) every
consumer writes and reads through — exports, DeepSpeed tags, the command line's outputs — and
its two implementations, chosen once by :func:`location_of` from a path or a URL.

A checkpoint joins a location in four steps, the same everywhere: rank 0 *reserves* its name,
the ranks *stage* their small files and write their large ones (into the staging folder, or
straight to the store through :meth:`Location.writer_of`), each rank *puts* up what it staged
(:meth:`Location.put_own`), and rank 0 *commits* (the staging folder holds the manifest); on
failure rank 0 *discards* what was uploaded. Readers ask what is *committed* (a checkpoint an
interrupted writer left is never among it), the checkpoint a *label* or the *pointer* names, and
*open* one; retention *removes*; a writer starting on a location *tidies* its debris.

- :class:`FolderLocation`: a folder on a POSIX file system (local disk, NFS, Lustre). The commit
  is one rename of the fsync'd staging folder over the checkpoint's folder
  (:func:`areal_ckpt.publish.publish`), then, when the commit points, its pointer switched
  (:mod:`areal_ckpt.storage.pointers`: the file ``latest`` renamed over, or the recovery store's
  link ``current``).
- :class:`ObjectLocation`: a prefix on an object store (any scheme of
  :mod:`areal_ckpt.storage.backends`). The commit uploads the rest and the manifest under a
  never-reused prefix, then writes a create-only commit record (:mod:`areal_ckpt.storage.commits`);
  the pointer is the newest record that says so.

Adding a backend means one class implementing :class:`Location` here (or one
:class:`~areal_ckpt.storage.objects.ObjectStore` under :class:`ObjectLocation`) and one line in
:func:`location_of`; no consumer changes (docs/storage.md, "Adding a backend"). Every method is
blocking and local to the calling process (no collective); the callers say which rank calls it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import FileWriter
from areal_ckpt.paths import RECOVER_CURRENT, RECOVER_MANIFEST, RECOVER_STORE, RECOVER_TRASH_PREFIX
from areal_ckpt.storage.folder_location import FolderLocation
from areal_ckpt.storage.folders import FileSource, Opened, check_checkpoint
from areal_ckpt.storage.object_location import ObjectLocation
from areal_ckpt.storage.pointers import PointerFile, PointerLink
from areal_ckpt.storage.retention import Committed, RetentionPolicy, doomed_by
from areal_ckpt.urls import ObjectURL, locate

logger = logging.getLogger(__name__)


@runtime_checkable
class Location(Protocol):
    """Where the committed checkpoints of one series live (one model's exports, a save_dir's
    tags), and how a new one joins them. Implementations are plain, picklable data (a
    background writer receives them). Errors are CheckpointError naming the path or URL."""

    @property
    def shared_staging(self) -> bool:
        """True when every rank stages into the one folder rank 0 made on the location's own
        file system (which every node must then share); False when each rank stages its own
        files in a local folder and puts them up itself (:meth:`put_own`). Pure."""

    def where(self, name: str | None = None) -> str:
        """The location's path or URL, or that of its checkpoint ``name``, for messages. Pure."""

    def check_access(self) -> None:
        """CheckpointError naming the location and the cause unless it can be used now."""

    def reserve(self, name: str) -> str:
        """Rank 0, before anything is written: the name the new checkpoint will be committed
        under (``name`` itself in a folder, where the commit replaces it whole; ``name`` or
        ``name.{n}`` on a store, a prefix never used before)."""

    def stage(self, name: str, rank: int) -> Path:
        """Every rank, before a save of ``name`` writes: the staging folder rank ``rank`` writes
        into, made empty (a folder location's one shared folder is made by rank 0 alone; the
        others get its path once rank 0 has made it, which the caller agrees first)."""

    def unstage(self, staging: Path, rank: int) -> None:
        """Every rank, at the end of a save: its staging folder removed (a shared one by rank
        0). Best effort; never raises."""

    def join_staging(self, staging: Path) -> None:
        """Every rank, before writing its files: the staging folder rank 0 prepared, as this
        rank sees it. On a store each node stages only its own small files, in a folder made
        here; a folder location's staging folder is rank 0's on the shared file system and is
        never made here, so a rank without that file system fails loudly instead of writing
        files rank 0 would commit without having them."""

    def writer_of(self, reserved: str) -> Callable[[str], FileWriter] | None:
        """Where each rank's large files go as they are made: a function opening the store's
        writer of one file (a path relative to the checkpoint) of the reserved checkpoint, or
        None to write them into the staging folder."""

    def put_own(
        self, staging: Path, reserved: str, names: list[str], expected: Mapping[str, tuple[int, int]] | None = None
    ) -> None:
        """Every rank, once its files are written: put ``names`` (relative to ``staging``; not
        the ones :meth:`writer_of` wrote) where rank 0's commit finds them; with ``expected``
        (name -> size and CRC-32) each file put is checked against its record first or as it is
        put, CheckpointError naming those that differ (a local file that rotted or became a link
        is never committed); a folder whose files were written in place puts, and so checks,
        nothing. Blocking."""

    def commit(
        self, staging: Path, reserved: str, uploaded: set[str], body: dict[str, Any], point: bool = False
    ) -> int:
        """Rank 0: make the checkpoint in ``staging`` (manifest written, durable) the committed
        ``reserved`` one, whole or not at all, then (``point``) the one the pointer names;
        returns its commit order (0 for a folder). ``uploaded``: the files the ranks put
        themselves; ``body``: what the commit records (its name, step, label as ``tag``)."""

    def discard(self, reserved: str) -> None:
        """Rank 0, after a failed save: remove what was uploaded of ``reserved`` (best effort;
        the next start removes what is left)."""

    def committed(self, step_of: Callable[[str], int | None] = lambda name: None) -> list[Committed]:
        """The committed checkpoints, in no particular order; ``step_of`` reads the step from a
        checkpoint's name (in a folder a name it does not parse is not part of the series)."""

    def newest(self, step_of: Callable[[str], int | None] = lambda name: None) -> Committed | None:
        """The checkpoint committed last (on a store the highest commit order; in a folder, where
        a name commits once, the highest step then name), or None when nothing is committed."""

    def named(self, label: str) -> str | None:
        """The newest committed checkpoint saved under ``label`` (a DeepSpeed tag), or None. A
        save under a label reserves the label as its name and records it (``{"tag": label}``):
        a folder's label is its name, a store's the records' ``tag``."""

    def pointed(self) -> str | None:
        """The committed checkpoint the pointer names (DeepSpeed's ``latest``), or None when no
        commit pointed; CheckpointError naming the pointer when it names no checkpoint here."""

    def files_of(self, name: str) -> FileSource:
        """The files of the committed checkpoint ``name``, where they lie (to fetch or verify)."""

    def open(self, name: str, token: str, deferred: Callable[[str], bool] = lambda file: False) -> Opened:
        """Every rank: the committed checkpoint ``name`` ready to read here: in place, or its
        manifest and files (but those ``deferred`` names, brought down as read) in the node's
        checked local copy, completed once per ``token`` (one per load, the same on every rank)."""

    def place(self, name: str, data: bytes) -> None:
        """Rank 0: the small file ``name`` beside the checkpoints (not a checkpoint: DeepSpeed's
        ``zero_to_fp32.py``) holds ``data``, replaced whole; nothing when it does already."""

    def remove(self, doomed: list[Committed]) -> list[Path]:
        """Remove ``doomed`` so that no reader finds any of them any more (a folder is renamed
        to a trash name; on a store each commit record goes first, then its objects). Returns
        the local trash folders for the caller to delete off the hot path. Failures are
        logged, not raised."""

    def tidy(self) -> list[str]:
        """Rank 0 when a job starts on the location: remove what earlier writers left
        uncommitted (objects no record names, unfinished uploads; where a folder's pointer
        commits, generations it does not name and older than it); nothing in another folder
        (its staging folders are removed with the trial's). Returns the names removed."""

    def present(self) -> list[str]:
        """Every checkpoint held here, committed or not (an operator's repair looks among
        them: :func:`recommit_newest_intact`). Read-only."""

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """An operator's repair: the location held against its writers while the block runs (a
        folder trial's lock: CheckpointError naming the job that holds it, or the trial when it
        is no folder); nothing on a store, where the repair runs while no job writes."""

    def mend(self) -> dict[str, list[str]]:
        """An operator's repair, first step (inside :meth:`exclusive`): set aside (never delete)
        whatever records a commit that no reader can use; returns each with its problem and
        where it went. CheckpointError, changing nothing, where the location holds what it cannot
        repair (a folder trial holding AReaL's own recovery folders)."""

    def recommit(self, name: str, body: dict[str, Any]) -> None:
        """An operator's repair, last step: make the present, whole checkpoint ``name`` the
        committed one (``body``: what the commit records). Durable on return."""


def location_of(value: str | os.PathLike[str], what: str, pointer: str | None = None) -> Location:
    """``value`` as a location: a prefix on the object store its URL names, or a folder
    (``pointer``: the name of its pointer file, DeepSpeed's ``latest``; an object prefix's
    pointer is its records').
    The one place a location's kind is decided; ConfigError naming ``what`` for a malformed
    URL or an unsupported scheme. Pure: contacts nothing."""
    where = locate(value, what)
    if isinstance(where, Path):
        return FolderLocation(where, None if pointer is None else PointerFile(pointer))
    return ObjectLocation(where)


def recovery_location_of(trial: Path | ObjectURL) -> Location:
    """The recovery generations of the trial folder or prefix ``trial`` as a location: its
    ``.recover`` folder, each generation written in place and committed by switching the link
    ``current`` (superseded ones hidden as ``.trash-{name}`` while deleted), or its ``.recover``
    prefix on a store, committed by create-only records. The one place that layout is decided.
    Pure: contacts nothing."""
    if isinstance(trial, Path):
        return FolderLocation(
            trial / RECOVER_STORE, PointerLink(RECOVER_CURRENT), RECOVER_TRASH_PREFIX, True, RECOVER_MANIFEST
        )
    return ObjectLocation(trial.child(RECOVER_STORE), RECOVER_MANIFEST)


def retain(
    series: Location,
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


def recommit_newest_intact(
    location: Location,
    manifest: str,
    candidate: Callable[[str], bool],
    order: Callable[[str], int],
    body: Callable[[str], dict[str, Any]],
    content: Callable[[dict[str, Any]], list[str]] = lambda manifest: [],
    noun: str = "checkpoint",
) -> tuple[str, dict[str, list[str]], bool]:
    """An operator's repair (``recover-pointer``) on a location whose newest commit is the one
    read (an object prefix; a folder whose pointer commits), held against its writers
    (:meth:`Location.exclusive`): what no reader can use is set aside (:meth:`Location.mend`);
    when the committed checkpoint is then missing, named by a broken pointer or fails its check
    (every file by size and CRC-32 where it lies, and ``content``'s check of what its manifest
    must list), the newest ``candidate`` present (highest ``order``, then name) that passes is
    committed again (:meth:`Location.recommit` with ``body``), with a warning when another holds
    the same order.
    Returns that checkpoint, those skipped with their problems, and whether anything was
    committed; CheckpointError naming them all (each a ``noun``) when none passes. Blocking;
    never deletes a checkpoint."""
    with location.exclusive():
        skipped = location.mend()
        try:
            newest = location.newest(lambda name: order(name) if candidate(name) else None)
        except CheckpointError as error:
            newest, skipped["commit record"] = None, [str(error)]
        if newest is not None and not candidate(newest.name):
            skipped[newest.name] = [f"the commit names {newest.name!r}, not a {noun}"]
            newest = None
        if newest is not None:
            problems = check_checkpoint(location.files_of(newest.name), manifest, content=content)
            if not problems:
                return newest.name, skipped, False
            skipped[newest.name] = problems
        present = [name for name in location.present() if candidate(name)]
        for name in sorted((n for n in present if n not in skipped), key=lambda n: (order(n), n), reverse=True):
            problems = check_checkpoint(location.files_of(name), manifest, content=content)
            if problems:
                skipped[name] = problems
                continue
            twins = [other for other in present if other != name and order(other) == order(name)]
            if twins:
                logger.warning(
                    "%s: %s and %s hold the same step %d; pointing at %s",
                    location.where(),
                    name,
                    twins,
                    order(name),
                    name,
                )
            location.recommit(name, body(name))
            return name, skipped, True
        raise CheckpointError(
            f"{location.where()}: no intact {noun} to point at"
            + "".join(f"; {name}: {'; '.join(problems)}" for name, problems in skipped.items())
            + ("" if skipped else " (there is none)")
        )


def remove_trash(folders: list[Path]) -> None:
    """Delete trash folders :meth:`Location.remove` returned (blocking; errors
    ignored: a trash folder left behind is removed at the next start)."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
