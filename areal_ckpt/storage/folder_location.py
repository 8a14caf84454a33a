"""A :class:`~areal_ckpt.storage.location.Location` in a folder of a POSIX file system (local
disk, NFS, Lustre). Two commit styles behind one interface: a checkpoint staged beside the others
is committed by one rename of its fsync'd staging folder, and a pointing commit then switches
the location's pointer (:mod:`areal_ckpt.storage.pointers`: a file renamed over, DeepSpeed's
``latest``); or, where the pointer commits (the recovery store's link ``current``), each
checkpoint is a folder written or copied in place and committed by the pointer's switch
(:mod:`areal_ckpt.storage.in_place`)."""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from areal_ckpt.errors import CheckpointError, TransientError
from areal_ckpt.fsio import FileRecord, FileWriter, copy_durably, link_on_path, make_dirs
from areal_ckpt.lock import acquire_trial_lock, release_trial_lock
from areal_ckpt.paths import EXPORT_STAGING_PREFIX, EXPORT_TRASH_PREFIX, MANIFEST_NAME, generation_step
from areal_ckpt.publish import hide_folder, publish, read_manifest, write_manifest
from areal_ckpt.storage.folders import FileSource, FolderSource, Opened
from areal_ckpt.storage.foreign import refuse_foreign_layout
from areal_ckpt.storage.in_place import (
    after_commit,
    check_store_folder,
    clear_strays,
    commit_in_place,
    committed_in_place,
    generation_folders,
    is_complete,
    is_pending,
    place_fixed_links,
    superseded_in_place,
)
from areal_ckpt.storage.pointers import Pointer, replace_file
from areal_ckpt.storage.retention import Committed

logger = logging.getLogger(__name__)


def _checked_name(name: str, where: str) -> str:
    """``name`` when it is one safe path part; CheckpointError naming ``where`` otherwise."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or name.startswith("."):
        raise CheckpointError(f"{where}: names {name!r}, not a checkpoint of this location")
    return name


@dataclass(frozen=True)
class FolderLocation:
    """Checkpoint folders under ``root`` on a POSIX file system. ``pointer``: what a pointing
    commit switches (None when this location has none); ``trash_prefix``: what a removed
    folder's name is prefixed with while it is deleted; ``pointer_commits``: the checkpoints
    are written in place, so the one the pointer names is the only committed one (the
    recovery store's ``current``, :mod:`~areal_ckpt.storage.in_place`), not one commit among
    many (DeepSpeed's ``latest``); ``manifest``: each checkpoint's manifest file."""

    root: Path
    pointer: Pointer | None = None
    trash_prefix: str = EXPORT_TRASH_PREFIX
    pointer_commits: bool = False
    manifest: str = MANIFEST_NAME
    shared_staging: ClassVar[bool] = True

    def where(self, name: str | None = None) -> str:
        """The folder, or the checkpoint's."""
        return str(self.root if name is None else self.root / name)

    def check_access(self) -> None:
        """Nothing to contact: the commit names what stands in its way; where the pointer
        commits, CheckpointError naming the folder unless it is absent or a real folder
        (:func:`~areal_ckpt.storage.in_place.check_store_folder`) and the one above it can be
        made."""
        if not self.pointer_commits:
            return
        check_store_folder(self.root)
        try:
            make_dirs(self.root.parent)
        except OSError as error:
            raise CheckpointError(f"{self.root.parent}: cannot create the trial folder: {error}") from None

    def reserve(self, name: str) -> str:
        """``name``: a folder's commit replaces a same-named one whole."""
        return name

    def stage(self, name: str, rank: int) -> Path:
        """``{root}/.export-staging.{name}``, made empty by rank 0 (the root made durable: the
        commit renames into it)."""
        staging = self.root / f"{EXPORT_STAGING_PREFIX}{name}"
        if rank == 0:
            try:
                if staging.exists():
                    shutil.rmtree(staging)
                make_dirs(self.root)
                staging.mkdir()
            except OSError as error:
                raise CheckpointError(f"{staging}: cannot prepare the staging folder: {error}") from error
        return staging

    def unstage(self, staging: Path, rank: int) -> None:
        """Rank 0 removes the shared staging folder (what a failed save wrote is all in it)."""
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)

    def join_staging(self, staging: Path) -> None:
        """Nothing: rank 0 made it on the shared file system."""

    def writer_of(self, reserved: str) -> Callable[[str], FileWriter] | None:
        """None: files go into the staging folder, renamed into place at the commit."""
        return None

    def put_own(
        self, staging: Path, reserved: str, names: list[str], expected: Mapping[str, tuple[int, int]] | None = None
    ) -> None:
        """Nothing when every file was written in place; where the pointer commits and
        ``staging`` is another folder (a node's local tier), each file copied into
        ``{root}/{reserved}`` and fsync'd, checked against ``expected`` as copied (one read)."""
        if self.pointer_commits and staging != self.root / reserved:
            self._copy_in(staging, reserved, names, expected)

    def _copy_in(
        self, staging: Path, reserved: str, names: list[str], expected: Mapping[str, tuple[int, int]] | None
    ) -> None:
        """Copy ``names`` from ``staging`` into ``{root}/{reserved}`` (never through a link on
        either side; TransientError naming the file when a copy fails); CheckpointError naming
        every copy whose size and CRC-32 are not its ``expected`` record."""
        target = self.root / reserved
        differing = []
        for name in names:
            source, path = staging / name, target / name
            link = link_on_path(path, self.root.parent) or link_on_path(source, staging)
            if link is not None:
                raise CheckpointError(f"{link}: a link; not copying through it")
            try:
                make_dirs(path.parent)
                record = copy_durably(source, path)
            except OSError as error:
                raise TransientError(f"cannot copy {source} to {path}: {error}") from error
            if expected is not None and expected.get(name) != (record.size, record.crc32):
                differing.append(name)
        if differing:
            raise CheckpointError(
                f"{staging}: {differing[:5]} differ from their records (damaged where they were copied from); "
                f"not committed in {self.root}"
            )

    def commit(
        self, staging: Path, reserved: str, uploaded: set[str], body: dict[str, Any], point: bool = False
    ) -> int:
        """One rename of ``staging`` to ``{root}/{reserved}`` (fsync'd; an older folder of that
        name goes to the trash), then (``point``) the pointer file renamed over. Where the
        pointer commits: the files ``staging``'s manifest lists beyond ``uploaded`` copied in,
        then :func:`~areal_ckpt.storage.in_place.commit_in_place` with that manifest
        and ``body`` in its header, then the trial's links placed (what it superseded stays
        for :func:`~areal_ckpt.storage.location.retain`).
        As on a store, the files the commit copies are not checked: a publisher puts them first
        with :meth:`put_own`'s check."""
        if self.pointer_commits:
            self._commit_in_place(staging, reserved, uploaded, body)
            return 0
        final = self.root / reserved
        publish(staging, final, self.root / f"{self.trash_prefix}{reserved}")
        if point:
            self.point(reserved)
        return 0

    def _commit_in_place(self, staging: Path, reserved: str, uploaded: set[str], body: dict[str, Any]) -> None:
        """:meth:`commit` where the pointer commits."""
        assert self.pointer is not None  # a location whose pointer commits has one
        manifest = read_manifest(staging, self.manifest)
        listed = {name: (entry["size"], entry["crc32"]) for name, entry in manifest["files"].items()}
        self._copy_in(staging, reserved, sorted(set(listed) - uploaded), None)
        header = {key: value for key, value in manifest.items() if key != "files"}
        records = {name: FileRecord(*record) for name, record in listed.items()}
        pointer, root = self.pointer, self.root
        try:
            make_dirs((root / reserved / self.manifest).parent)
            commit_in_place(
                root,
                pointer,
                reserved,
                lambda: write_manifest(root / reserved, self.manifest, records, {**header, **body}),
            )
        except OSError as error:
            raise TransientError(f"{root / reserved}: cannot commit: {error}") from error
        after_commit(root, reserved, self.manifest, list(header.get("models", [])))

    def point(self, name: str) -> None:
        """Make the pointer name the checkpoint ``name`` (already whole and durable here: a
        commit's, a repair's, a copy assembled from committed files); atomic and durable.
        CheckpointError when this location has no pointer."""
        if self.pointer is None:
            raise CheckpointError(f"{self.root}: has no pointer to switch")
        self.pointer.point(self.root, name)

    def discard(self, reserved: str) -> None:
        """Nothing was written outside the staging folder."""

    def committed(self, step_of: Callable[[str], int | None] = lambda name: None) -> list[Committed]:
        """Every real folder (not a link) whose name parses; none when ``root`` is missing. Where
        the pointer commits, the one it names (:func:`~areal_ckpt.storage.in_place.committed_in_place`:
        CheckpointError when it names none, or is missing beside complete generations; its
        facts its manifest's header, none when that does not read), last and of order 1, after the complete generations of
        lower steps (earlier commits it superseded, order 0)."""
        if self.pointer_commits:
            return self._committed_in_place(step_of)
        if not self.root.is_dir():
            return []
        return [
            Committed(path.name, step, 0, when=path.stat().st_mtime)
            for path in self.root.iterdir()
            if path.is_dir() and not path.is_symlink() and (step := step_of(path.name)) is not None
        ]

    def _committed_in_place(self, step_of: Callable[[str], int | None]) -> list[Committed]:
        """:meth:`committed` where the pointer commits."""
        assert self.pointer is not None  # a location whose pointer commits has one
        name = committed_in_place(self.root, self.pointer, self.manifest)
        if name is None:
            return []
        try:  # a reader of the checkpoint finds a broken manifest; the commit's name stands without it
            facts = {
                key: value for key, value in read_manifest(self.root / name, self.manifest).items() if key != "files"
            }
        except CheckpointError:
            facts = {}
        earlier = [
            Committed(other, _step(step_of, other), 0, when=self._mtime(other))
            for other in generation_folders(self.root)
            if generation_step(other) < generation_step(name)
            and is_complete(self.root, other, self.manifest)
            and not is_pending(self.root, other)
        ]
        return [*earlier, Committed(name, _step(step_of, name), 1, "", facts, self._mtime(name))]

    def _mtime(self, name: str) -> float | None:
        """The checkpoint folder's modification time; None when it cannot be read."""
        try:
            return (self.root / name).stat().st_mtime
        except OSError:
            return None

    def newest(self, step_of: Callable[[str], int | None] = lambda name: None) -> Committed | None:
        """The committed folder of the highest step, then name (a folder's names commit once);
        where the pointer commits, the one it names."""
        if self.pointer_commits:
            return next(reversed(self._committed_in_place(step_of)), None)
        return max(self.committed(step_of), key=lambda entry: (entry.step, entry.name), default=None)

    def present(self) -> list[str]:
        """Every real sub-folder not named with a leading dot, committed or not."""
        if not self.root.is_dir() or self.root.is_symlink():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.is_symlink() and p.name[0] != ".")

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Where the pointer commits, the trial's lock (the folder above ``root``) held while the
        block runs: CheckpointError naming the trial when it is no folder, or the job that holds
        it. Elsewhere nothing is held."""
        if not self.pointer_commits:
            yield
            return
        trial = self.root.parent
        if not trial.is_dir():
            raise CheckpointError(f"{trial}: not a folder")
        acquire_trial_lock(trial)
        try:
            yield
        finally:
            release_trial_lock(trial)

    def mend(self) -> dict[str, list[str]]:
        """Nothing to set aside: a pointer that names no folder here is refused by
        :meth:`pointed`. Where the pointer commits, CheckpointError, changing nothing, unless the
        folder is absent or a real folder and the trial holds none of AReaL's own recovery folders
        (:func:`~areal_ckpt.storage.foreign.refuse_foreign_layout`: an interrupted import, which
        ``import-areal`` finishes)."""
        if self.pointer_commits:
            check_store_folder(self.root)
            refuse_foreign_layout(self.root.parent)
        return {}

    def recommit(self, name: str, body: dict[str, Any]) -> None:
        """:meth:`point` at ``name`` (``body`` is what a store's record would hold; a folder's
        pointer records only the name); where the pointer commits, the trial's fixed links then
        placed for the models its manifest names
        (:func:`~areal_ckpt.storage.in_place.place_fixed_links`). Durable on return."""
        self.point(_checked_name(name, self.where(name)))
        if self.pointer_commits:
            models = read_manifest(self.root / name, self.manifest).get("models")
            place_fixed_links(self.root.parent, models if isinstance(models, list) else [])

    def named(self, label: str) -> str | None:
        """``label`` itself when it is a folder here (a save under it replaced the older one)."""
        folder = self.root / _checked_name(label, str(self.root / label))
        return label if folder.is_dir() else None

    def pointed(self) -> str | None:
        """The name the pointer holds; None without one. CheckpointError naming it when that
        is no folder here."""
        if self.pointer is None:
            return None
        found = self.pointer.read(self.root)
        if found is None:
            return None
        path = self.root / self.pointer.name
        name = _checked_name(found, str(path))
        if not (self.root / name).is_dir():
            raise CheckpointError(f"{path}: names {name!r}, but {self.root / name} does not exist")
        return name

    def files_of(self, name: str) -> FileSource:
        """The folder's files, read through no link."""
        return FolderSource(self.root / name)

    def open(self, name: str, token: str, deferred: Callable[[str], bool] = lambda file: False) -> Opened:
        """The folder itself, read in place."""
        return Opened(self.root / name, None)

    def place(self, name: str, data: bytes) -> None:
        """A complete new file renamed over ``{root}/{name}``; durable."""
        target = self.root / name
        if not (target.is_file() and not target.is_symlink() and target.read_bytes() == data):
            replace_file(self.root, name, data)

    def _hide(self, names: list[str]) -> list[Path]:
        """:meth:`remove` of the folders ``names``."""
        return self.remove([Committed(name, -1, 0) for name in names])

    def remove(self, doomed: list[Committed]) -> list[Path]:
        """Each folder renamed to its trash name (vanishes at once); returns the trash folders.
        Nothing when ``root`` is a link (nothing is deleted through a link), with a warning."""
        if doomed and self.root.is_symlink():
            logger.warning("retention: %s is a symbolic link; not deleting old checkpoints through it", self.root)
            return []
        hidden = []
        for entry in doomed:
            path, trash = self.root / entry.name, self.root / f"{self.trash_prefix}{entry.name}"
            try:
                hide_folder(path, trash)
                hidden.append(trash)
            except OSError as error:
                logger.warning("retention: could not remove %s: %s", path, error)
        return hidden

    def tidy(self) -> list[str]:
        """Nothing: staging and trash folders are removed with the trial's. Where the pointer
        commits: CheckpointError when the trial holds AReaL's own recovery folders
        (:func:`~areal_ckpt.storage.foreign.refuse_foreign_layout`), else what interrupted
        commits left (:func:`~areal_ckpt.storage.in_place.superseded_in_place` of the committed
        one, stray links and markers) deleted; returns the generations removed."""
        if not self.pointer_commits:
            return []
        assert self.pointer is not None  # a location whose pointer commits has one
        refuse_foreign_layout(self.root.parent)
        if not self.root.is_dir() or self.root.is_symlink():
            return []
        keep = committed_in_place(self.root, self.pointer, self.manifest)
        removed = superseded_in_place(self.root, keep, self.manifest)
        trash = self._hide(removed)
        clear_strays(self.root, self.pointer, keep)
        for folder in trash:
            shutil.rmtree(folder, ignore_errors=True)
        return removed


def _step(step_of: Callable[[str], int | None], name: str) -> int:
    """``step_of(name)``, -1 when it gives none."""
    step = step_of(name)
    return -1 if step is None else step
