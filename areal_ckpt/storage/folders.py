"""Whole checkpoint folders and where they are kept: upload a local folder's files (the
manifest last), bring a committed one down from any location (a :class:`FileSource`: a prefix on
object storage, or a folder on a shared file system), check one where it lies. Each checkpoint
folder carries a manifest (every file's size and CRC-32, :mod:`areal_ckpt.publish`); these
functions go by it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from areal_ckpt import fsio
from areal_ckpt.errors import CheckpointError
from areal_ckpt.paths import DATA_SUFFIX, default_staging_base
from areal_ckpt.publish import check_files, read_manifest
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.commits import (
    upload_folder_files,
)
from areal_ckpt.storage.mirrors import bind_cache, cache_folder, identity_of
from areal_ckpt.storage.objects import ObjectStore
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)

_FETCH_LOCK = ".fetch.lock"
_FETCHED_PREFIX = ".fetched-"  # + a load's token: this copy was completed and checked for that load
_RANGE = 32 << 20
_READERS = 4


class FileSource(Protocol):
    """The files of one committed checkpoint where it is kept, read whole by name (a path
    relative to the checkpoint). Local to the calling process; blocking; picklable."""

    @property
    def name(self) -> str:
        """The checkpoint's folder name."""

    def where(self, file: str | None = None) -> str:
        """The checkpoint's location, or that of its ``file``, for messages (a URL or a path)."""

    def get_file(self, file: str, path: Path) -> None:
        """Write the bytes of ``file`` into the local ``path`` (replacing it whole); CheckpointError
        naming ``file``'s location when it is missing or cannot be read."""

    def listing(self) -> dict[str, int | None]:
        """Every entry under the checkpoint by its relative path: a file's size, None for
        what is no regular file (a link, a FIFO: never read). One listing; read-only."""

    def crc32(self, file: str, size: int) -> int:
        """The CRC-32 of ``file`` (``size`` bytes, as listed), read where it lies without a
        local copy; CheckpointError naming it when it cannot be read. Read-only."""


@dataclass(frozen=True)
class Opened:
    """A committed checkpoint ready to read on this rank: the local ``folder`` holding its
    manifest and small files, and where the large files ``folder`` lacks come from as they are
    read (``source``; None when every file is in ``folder``, read in place)."""

    folder: Path
    source: FileSource | None


@dataclass(frozen=True)
class ObjectSource:
    """A committed checkpoint's files on object storage, under the prefix ``url``."""

    url: ObjectURL

    @property
    def name(self) -> str:
        """The prefix's last part."""
        return self.url.key().rsplit("/", 1)[-1]

    def where(self, file: str | None = None) -> str:
        """The prefix's URL, or the object's."""
        return str(self.url) if file is None else self.url.url_of(self.url.key(file))

    def get_file(self, file: str, path: Path) -> None:
        """Download the object (the store's parallel ranged reads)."""
        store_of(self.url).get_file(self.url.key(file), path)

    def listing(self) -> dict[str, int | None]:
        """The objects under the prefix with their sizes (one listing)."""
        base = self.url.key() + "/"
        return {item.key[len(base) :]: item.size for item in store_of(self.url).list_prefix(base)}

    def crc32(self, file: str, size: int) -> int:
        """:func:`object_crc32` (ranged reads)."""
        return object_crc32(store_of(self.url), self.url.key(file), size)


@dataclass(frozen=True)
class FolderSource:
    """A committed checkpoint's files in a folder (a shared file system: Lustre, NFS, GPFS).
    A file is read only when it is a regular file reached through no link inside ``folder``."""

    folder: Path

    @property
    def name(self) -> str:
        """The folder's name."""
        return self.folder.name

    def where(self, file: str | None = None) -> str:
        """The folder's path, or the file's."""
        return str(self.folder if file is None else self.folder / file)

    def get_file(self, file: str, path: Path) -> None:
        """Copy the file (:func:`~areal_ckpt.fsio.copy_durably`), refusing one behind a link."""
        source = self.folder / file
        try:
            fsio.copy_durably(self._reached(file), path)
        except FileNotFoundError:
            raise CheckpointError(f"{source}: missing") from None
        except OSError as error:
            raise CheckpointError(f"{source}: cannot copy: {error}") from None

    def listing(self) -> dict[str, int | None]:
        """Every entry under the folder, walked through no link (a link is listed, never
        followed); empty when the folder is missing."""
        listing: dict[str, int | None] = {}
        for top, folders, names in os.walk(self.folder):
            for name in [*names, *folders]:
                path = Path(top) / name
                if path.is_symlink() or not path.is_dir():
                    regular = path.is_file() and not path.is_symlink()
                    listing[path.relative_to(self.folder).as_posix()] = path.stat().st_size if regular else None
        return listing

    def crc32(self, file: str, size: int) -> int:
        """The file read once (:func:`~areal_ckpt.fsio.record_of`), never through a link."""
        try:
            return fsio.record_of(self._reached(file)).crc32
        except OSError as error:
            raise CheckpointError(f"{self.folder / file}: cannot read: {error}") from None

    def _reached(self, file: str) -> Path:
        """The path of ``file``; OSError when a link stands on it inside the folder."""
        path = self.folder / file
        link = fsio.link_on_path(path, self.folder)
        if link is not None:
            raise OSError(f"{link} is a link; not reading through it")
        return path


def listing_of(folder: Path) -> dict[str, int]:
    """The size of every regular file in ``folder`` by its path there (links not followed; see
    :meth:`FolderSource.listing`); local."""
    return {name: size for name, size in FolderSource(folder).listing().items() if size is not None}


def staging_root(staging_dir: str | None, url: ObjectURL) -> Path:
    """The local cache of the object trial ``url`` (:func:`~areal_ckpt.storage.mirrors.cache_folder`),
    bound to it (:func:`~areal_ckpt.storage.mirrors.bind_cache`: one that mirrors anything else
    is set aside), the default base first made private (:func:`~areal_ckpt.fsio.private_folder`:
    0700, ours, no link; CheckpointError naming it otherwise). Local; creates the cache's
    folders and its record."""
    if not staging_dir:
        fsio.private_folder(default_staging_base())
    folder = cache_folder(staging_dir, url)
    bind_cache(folder, identity_of(url))
    return folder


def upload_rest(store: ObjectStore, folder: Path, target: ObjectURL, manifest_name: str, uploaded: set[str]) -> None:
    """Upload to ``target`` the files the manifest of the local ``folder`` lists that are not
    in ``uploaded`` (other ranks' own files, already there), then the manifest itself, last:
    what it lists is in place before it. Blocking; the caller writes the commit record next."""
    listed = read_manifest(folder, manifest_name)["files"]
    upload_folder_files(store, folder, sorted(set(listed) - uploaded), target)
    upload_folder_files(store, folder, [manifest_name], target)


def check_uploaded(store: ObjectStore, folder: Path, target: ObjectURL, manifest_name: str) -> list[str]:
    """After :func:`upload_rest`: every file the manifest of the local ``folder`` lists, and the
    manifest, is an object under ``target`` of its size (one listing; nothing else removed
    them meanwhile). Returns one problem per object, naming its URL; empty when all are
    there. Blocking; read-only."""
    base = target.key() + "/"
    present = {item.key[len(base) :]: item.size for item in store.list_prefix(base)}
    expected = {name: int(record["size"]) for name, record in read_manifest(folder, manifest_name)["files"].items()}
    expected[manifest_name] = (folder / manifest_name).stat().st_size
    return [
        f"{target.url_of(target.key(name))}: "
        + ("missing" if name not in present else f"{present[name]} bytes, not {size}")
        for name, size in sorted(expected.items())
        if present.get(name) != size
    ]


def check_local_copy(folder: Path, files: dict[str, dict[str, int]], names: list[str]) -> None:
    """Before ``names`` of the local ``folder`` go up: CheckpointError naming each one that is not
    its record in ``files`` (size and CRC-32, all read), is not a regular file, or lies behind a
    link. Local, read-only."""
    problems = check_files(folder, files, names)
    if problems:
        raise CheckpointError(
            f"{folder}: not uploaded, the local copy differs from its records: " + "; ".join(problems)
        )


def fetch_shared(
    source: FileSource,
    copies: Path,
    manifest_name: str,
    token: str,
    then: Callable[[Path], None] = lambda folder: None,
    deferred: Callable[[str], bool] = lambda name: False,
) -> Path:
    """Complete the local copy ``copies/{name}`` of the committed checkpoint ``source``
    (:func:`fetch_folder`; the files ``deferred`` names are left for :class:`OnDemandFiles`),
    once per load: processes sharing ``copies`` (the ranks of one node) take turns under a
    file lock, and the first leaves a marker named by ``token`` (one per load, the same on
    every rank) so the others skip the check. ``then(copy)`` runs under the lock too. Returns
    the copy. Blocking; local to the caller."""
    name = source.name
    copies.mkdir(parents=True, exist_ok=True)
    with fsio.ExclusiveLock(copies / _FETCH_LOCK):
        folder, marker = copies / name, copies / f"{_FETCHED_PREFIX}{token}"
        if not marker.is_file():
            fetched = fetch_folder(source, folder, manifest_name, deferred)
            if fetched:
                logger.info("fetched %d file(s) of %s", fetched, source.where())
            for stale in copies.glob(f"{_FETCHED_PREFIX}*"):  # earlier loads'
                stale.unlink(missing_ok=True)
            marker.touch()
        then(folder)
    return folder


class OnDemandFiles:
    """The files of a local copy (``folder``) of the committed checkpoint ``source`` that come
    down only when a reader asks for them (:meth:`ensure`): a rank downloads the data files its
    load reads, not every rank's. ``files`` is the checkpoint's manifest file list. Local to
    the calling process; blocking."""

    def __init__(self, source: FileSource, folder: Path, files: dict[str, dict[str, int]]) -> None:
        self.source, self.folder, self.files = source, folder, files
        self._ready: set[str] = set()

    def ensure(self, path: Path) -> None:
        """Make ``path`` (a file of the copy) hold the manifest's bytes: a copy already there is
        checked once by size and CRC-32 (torn by a crash: downloaded again, with a warning
        naming it), a missing one is downloaded. Processes sharing the copy take turns (a file
        lock). A path the manifest does not list is left to the reader to refuse."""
        name = path.relative_to(self.folder).as_posix()
        if name in self._ready or name not in self.files:
            return
        with fsio.ExclusiveLock(self.folder.parent / _FETCH_LOCK):
            problems = check_files(self.folder, self.files, [name])
            if problems:
                if path.exists():
                    logger.warning("%s; downloading it again from %s", problems[0], self.source.where())
                _download(self.source, self.folder, name)
                _check_downloaded(self.source, self.folder, self.files, [name])
        self._ready.add(name)


def fetch_folder(
    source: FileSource,
    folder: Path,
    manifest_name: str,
    deferred: Callable[[str], bool] = lambda name: False,
) -> int:
    """Download into the local ``folder`` the manifest of the committed checkpoint ``source``
    and every file it lists, but those ``deferred`` names, that ``folder`` lacks or holds
    damaged (size or CRC-32 differ: a copy torn by a crash is fetched again, with a warning
    naming it); returns how many files were downloaded. Blocking; local to the caller."""
    _download(source, folder, manifest_name)
    try:
        files = read_manifest(folder, manifest_name)["files"]
    except CheckpointError as error:
        raise CheckpointError(f"{source.where(manifest_name)}: {error}") from None
    fetched = []
    for name in [name for name in files if not deferred(name)]:
        problems = check_files(folder, files, [name])
        if not problems:
            continue
        if (folder / name).exists():
            logger.warning("%s; downloading it again from %s", problems[0], source.where())
        _download(source, folder, name)
        fetched.append(name)
    _check_downloaded(source, folder, files, fetched)
    return len(fetched)


def _check_downloaded(source: FileSource, folder: Path, files: dict[str, dict[str, int]], names: list[str]) -> None:
    """CheckpointError naming each of ``names`` whose copy in ``folder`` is not the manifest's:
    size and CRC-32, but a DCP data file's CRC-32, which its reader checks as it reads it (one
    pass over the largest files, not two). Local, read-only."""
    data = [name for name in names if name.endswith(DATA_SUFFIX)]
    problems = check_files(folder, files, [name for name in names if not name.endswith(DATA_SUFFIX)])
    problems += check_files(folder, files, data, checksum=False)
    if problems:
        named = [problem.replace(str(folder), source.where(), 1) for problem in problems]
        raise CheckpointError(f"{source.where()}: the downloaded copy is damaged: " + "; ".join(named))


def _download(source: FileSource, folder: Path, name: str) -> None:
    """Download ``name`` of ``source`` into ``folder``; CheckpointError, nothing written, when a
    link stands on its path inside ``folder`` (never written through: the copy is ours)."""
    path = folder / name
    link = fsio.link_on_path(path, folder)
    if link is not None:
        raise CheckpointError(f"{link}: a link in the local copy of {source.where()}; not writing through it")
    path.parent.mkdir(parents=True, exist_ok=True)
    source.get_file(name, path)


def check_checkpoint(
    source: FileSource,
    manifest_name: str,
    progress: Callable[[Iterable[str]], Iterable[str]] = iter,
    content: Callable[[dict[str, Any]], list[str]] = lambda manifest: [],
) -> list[str]:
    """Every problem of the committed checkpoint ``source`` where it lies, whatever the
    location: its manifest missing or damaged, or lacking what ``content`` says a readable one
    holds; a listed file missing, not a regular file, of another size or failing its CRC-32
    (all read, no local copy); an entry the manifest does not list. One line each naming the
    file's path or URL; empty means intact. Blocking; read-only."""
    listing = source.listing()
    if manifest_name not in listing:
        return [f"{source.where(manifest_name)}: missing: the checkpoint is incomplete"]
    try:
        manifest = manifest_of(source, manifest_name)
    except CheckpointError as error:
        return [str(error)]
    lacking = content(manifest)
    if lacking:  # a manifest re-signed to list less than a checkpoint holds: its checksums prove nothing
        return [f"{source.where(manifest_name)}: {problem}" for problem in lacking]
    files = manifest["files"]
    problems = []
    for name in progress(sorted(files)):
        where, expected, size = source.where(name), files[name], listing.get(name, -1)
        if size == -1:
            problems.append(f"{where}: missing")
        elif size is None:
            problems.append(f"{where}: not a regular file")
        elif size != expected["size"]:
            problems.append(f"{where}: size {size} bytes, manifest says {expected['size']} (truncated or replaced)")
        elif source.crc32(name, size) != expected["crc32"]:
            problems.append(f"{where}: checksum mismatch (corrupted)")
    for extra in sorted(set(listing) - set(files) - {manifest_name}):
        problems.append(f"{source.where(extra)}: not listed in the manifest (added after the checkpoint was written)")
    return problems


def manifest_of(source: FileSource, manifest_name: str) -> dict[str, Any]:
    """The checked manifest of the checkpoint ``source`` (:func:`~areal_ckpt.publish.read_manifest`,
    read through a private temporary copy); CheckpointError naming its path or URL. Read-only."""
    with tempfile.TemporaryDirectory(prefix="areal_ckpt-manifest-") as scratch:
        local = Path(scratch)
        (local / manifest_name).parent.mkdir(parents=True, exist_ok=True)
        source.get_file(manifest_name, local / manifest_name)
        try:
            return read_manifest(local, manifest_name)
        except CheckpointError as error:
            raise CheckpointError(str(error).replace(str(local / manifest_name), source.where(manifest_name))) from None


def object_crc32(store: ObjectStore, key: str, size: int) -> int:
    """The CRC-32 of the object ``key`` of ``size`` bytes, read as ranged GETs a few at a time
    (in order; at most a few ranges in memory). Blocking."""
    crc = 0
    starts = list(range(0, size, _RANGE))
    with ThreadPoolExecutor(_READERS, thread_name_prefix="areal_ckpt-verify") as pool:
        for window in range(0, len(starts), _READERS):
            pieces = pool.map(
                lambda start: store.get_range(key, start, min(_RANGE, size - start)), starts[window : window + _READERS]
            )
            for piece in pieces:
                crc = fsio.crc32(piece, crc)
    return crc
