"""What a local copy of a location mirrors, recorded in the copy itself, and the two roles a
node-local copy plays (docs/architecture.md, "Where checkpoints live"):

- a **cache** (an object trial's staging copy, ``staging_dir``): never a source of truth. Its
  folder is named by the full identity of what it mirrors (scheme, endpoint, bucket, prefix),
  and it carries that identity in :data:`MIRROR_RECORD`; one whose record is missing, garbled,
  a link or another location's is set aside (renamed, never deleted, never read) and rebuilt.
  The location's newest commit decides what a load reads; a cached file is used only when it
  is that commit's and its size and CRC-32 match its manifest.
- a **tier** (``recover.local_dir``): may hold commits newer than where the trial persists, so
  it is never set aside: one that records another location is refused, naming both. The peer
  copies a tier keeps of other nodes' files live inside it and share its record.

Every function here is local to the calling process and blocking; the ranks sharing one copy
(one node) take turns under a file lock.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import ExclusiveLock, fsync_dir, make_dirs, read_regular_file, write_file_durably
from areal_ckpt.paths import staging_trial_root
from areal_ckpt.storage.backends import store_of
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)

#: In the top folder of a local copy: the identity of the location it mirrors (JSON).
MIRROR_RECORD = ".mirror.json"

#: Beside a copy set aside: ``.set-aside.{name}.{UTC time}.{token}``.
SET_ASIDE_PREFIX = ".set-aside."

_LOCK = ".mirror.lock"
_FIELDS = ("scheme", "endpoint", "bucket", "prefix")


@dataclass(frozen=True)
class Identity:
    """The full identity of a location: ``scheme`` (``s3``, ``gs``, ``az``, ``file`` for a
    folder), the store's ``endpoint`` (empty for a folder), ``bucket`` (container; empty for a
    folder) and ``prefix`` (the key prefix, or the folder's absolute path)."""

    scheme: str
    endpoint: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        if self.scheme == "file":
            return self.prefix
        return f"{self.scheme}://{self.bucket}/{self.prefix} at {self.endpoint}"

    def encoded(self) -> bytes:
        """The record's bytes (canonical JSON)."""
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()


def identity_of(where: Path | ObjectURL) -> Identity:
    """The identity of a folder or an object store's prefix; the endpoint is the one this
    process's store of that bucket reaches (made, not contacted)."""
    if isinstance(where, Path):
        return Identity("file", "", "", os.path.abspath(where))
    return Identity(where.scheme, store_of(where).endpoint, where.bucket, where.prefix)


def cache_folder(staging_dir: str | None, where: ObjectURL) -> Path:
    """The local folder of the cache of ``where`` under ``staging_dir`` (None: the default
    base), named by its scheme, endpoint, bucket and prefix. Pure but for making the store."""
    return staging_trial_root(staging_dir, where, store_of(where).endpoint)


def _read_record(folder: Path) -> Identity | str:
    """The identity ``folder`` records, or why none can be read (missing, a link, garbled)."""
    record = folder / MIRROR_RECORD
    if record.is_symlink():
        return f"{record} is a link"
    try:
        value = json.loads(read_regular_file(record, limit=65536))
    except FileNotFoundError:
        return f"{record} is missing"
    except (OSError, ValueError) as error:
        return f"{record} is unreadable ({error})"
    if (
        not isinstance(value, dict)
        or sorted(value) != sorted(_FIELDS)
        or not all(isinstance(value[name], str) for name in _FIELDS)
    ):
        return f"{record} is not an identity record"
    return Identity(**{name: value[name] for name in _FIELDS})


def _write_record(folder: Path, identity: Identity) -> None:
    """Create ``folder``'s record create-only (a rank of the same node that wrote it first
    wins; the caller reads it back). Durable on return."""
    make_dirs(folder)
    staged = folder / f".{MIRROR_RECORD}.{secrets.token_hex(4)}"
    write_file_durably(staged, identity.encoded())
    try:
        os.link(staged, folder / MIRROR_RECORD)
    except FileExistsError:
        pass
    finally:
        staged.unlink()
    fsync_dir(folder)


def _holds_anything(folder: Path) -> bool:
    return folder.is_dir() and not folder.is_symlink() and any(True for _ in folder.iterdir())


def set_aside(folder: Path, why: str) -> Path:
    """Rename ``folder`` out of the way (beside it: :data:`SET_ASIDE_PREFIX`), logged with
    ``why``; nothing is deleted. Returns the new name. Durable on return."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = folder.parent / f"{SET_ASIDE_PREFIX}{folder.name.lstrip('.')}.{stamp}.{secrets.token_hex(3)}"
    os.rename(folder, aside)
    fsync_dir(folder.parent)
    logger.warning("%s: set aside as %s (%s); nothing in it is read", folder, aside, why)
    return aside


def set_aside_contents(folder: Path, why: str) -> Path | None:
    """Set ``folder`` (a part of a cache: its recovery generations) aside when it holds
    anything (:func:`set_aside`, ``why`` logged); returns the new name, None when there was
    nothing. Ranks sharing it take turns. Local; durable on return."""
    try:
        with ExclusiveLock(folder.parent / _LOCK):
            return set_aside(folder, why) if _holds_anything(folder) else None
    except FileNotFoundError:
        return None


def bind_cache(folder: Path, identity: Identity) -> Path | None:
    """Make ``folder`` a cache of ``identity``: when it holds anything but a record of exactly
    that identity (missing, garbled, a link, another location's), it is set aside
    (:func:`set_aside`) and started empty; then the record is written if absent. Returns the
    name it was set aside as, None when it was kept. Ranks sharing it take turns. Local;
    durable on return; CheckpointError naming it when it cannot be made."""
    try:
        make_dirs(folder.parent)
        with ExclusiveLock(folder.parent / _LOCK):
            held = _read_record(folder)
            if folder.is_symlink():
                raise CheckpointError(
                    f"{folder}: a link where the local cache of {identity} belongs; nothing was written through "
                    "it: move it away, or set staging_dir"
                )
            aside = None
            if held != identity and _holds_anything(folder):
                why = held if isinstance(held, str) else f"it mirrors {held}, not {identity}"
                aside = set_aside(folder, why)
            if held != identity or aside is not None:
                _write_record(folder, identity)
            return aside
    except OSError as error:
        raise CheckpointError(f"{folder}: cannot prepare the local cache of {identity}: {error}") from None


def claim_tier(folder: Path, identity: Identity, legacy: tuple[Path, str] | None = None) -> None:
    """Make ``folder`` a tier of ``identity``: an empty one is given the record; one that
    records exactly ``identity`` is kept; any other (a record of another location, garbled, a
    link, missing beside generations) is refused, CheckpointError naming both and the way out,
    nothing read or deleted. ``legacy``: an older version's record (its path, the text it must
    hold), accepted once and replaced by the identity record. Ranks sharing it take turns.
    Local; durable on return."""
    try:
        make_dirs(folder.parent)
        with ExclusiveLock(folder.parent / _LOCK):
            held = _read_record(folder)
            if held == identity:
                return
            upgraded = isinstance(held, str) and legacy is not None and _legacy_matches(*legacy)
            if isinstance(held, Identity) or folder.is_symlink() or (_holds_anything(folder) and not upgraded):
                owner = held if isinstance(held, Identity) else f"no known location ({held})"
                raise CheckpointError(
                    f"{folder}: this local tier belongs to {owner}, not to {identity} (the same local_dir and trial "
                    "names for another fileroot or endpoint); nothing was read or deleted: give this job another "
                    "local_dir, or move that trial folder away"
                )
            if upgraded and legacy is not None:
                logger.warning(
                    "%s: a tier of %s, as an older version recorded it; recording %s", folder, legacy[1], identity
                )
            _write_record(folder, identity)
    except OSError as error:
        raise CheckpointError(f"{folder}: cannot record the local tier's location: {error}") from None


def _legacy_matches(path: Path, text: str) -> bool:
    """True when the older version's record at ``path`` is a regular file holding ``text``."""
    if path.is_symlink():
        return False
    try:
        return read_regular_file(path, limit=4096) == f"{text}\n".encode()
    except OSError:
        return False
