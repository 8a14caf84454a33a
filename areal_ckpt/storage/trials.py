"""A trial's exports wherever they live: the series of each of its models and the local folder
they are staged in (:class:`ExportTrial`), a POSIX folder or a prefix of an object store, chosen
once from the fileroot by :func:`export_trial`."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from areal_ckpt.fsio import make_dirs
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.commits import CommitLog
from areal_ckpt.storage.folder_location import FolderLocation
from areal_ckpt.storage.folders import staging_root
from areal_ckpt.storage.location import Location
from areal_ckpt.storage.object_location import ObjectLocation
from areal_ckpt.urls import ObjectURL, locate


class ExportTrial(Protocol):
    """A trial's exports: the series of each model and the local folder they are staged in."""

    @property
    def staging(self) -> Path:
        """The local folder the trial's exports are staged in (the trial itself when local)."""

    def series(self, name: str) -> Location:
        """The location of model folder ``name`` (``default``, ``actor``...). Pure."""

    def where(self, *parts: str) -> str:
        """The path or URL of ``parts`` below the trial. Pure."""

    def make_staging(self) -> None:
        """Every rank when a Saver starts: the local staging folder exists (a folder trial is
        made by the trial's lock, which names what stands in its way). Durable; blocking."""

    def open(self) -> None:
        """Rank 0 when a Saver starts: the store answers, and each model's series is tidied
        (:meth:`~areal_ckpt.storage.location.Location.tidy`). Blocking."""


@dataclass(frozen=True)
class FolderTrial:
    """A trial in a folder of a POSIX file system: staged in place."""

    staging: Path

    def series(self, name: str) -> Location:
        return FolderLocation(self.staging / name)

    def where(self, *parts: str) -> str:
        return str(self.staging.joinpath(*parts))

    def make_staging(self) -> None:
        """Nothing: the trial's lock makes the folder."""

    def open(self) -> None:
        """Nothing to check: the trial's lock and stale staging folders are the Saver's."""


@dataclass(frozen=True)
class ObjectTrial:
    """A trial under a prefix of an object store, staged in a local folder. Its series have one
    writer, this trial (``writer``), from :meth:`open` on: see :class:`~areal_ckpt.storage.object_location.ObjectLocation`."""

    root: ObjectURL
    staging: Path
    writer: str = field(default_factory=lambda: secrets.token_hex(8))
    _since: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def series(self, name: str) -> Location:
        return ObjectLocation(self.root.child(name), writer=self.writer, since=self._since.get(name, 0))

    def where(self, *parts: str) -> str:
        return str(self.root.child(*parts))

    def make_staging(self) -> None:
        make_dirs(self.staging)

    def open(self) -> None:
        store = store_of(self.root)
        store.check_access()
        base = self.root.key() + "/"
        names = {
            item.key[len(base) :].split("/", 1)[0] for item in store.list_prefix(base) if "/" in item.key[len(base) :]
        }
        for name in sorted(name for name in names if not name.startswith(".")):  # .recover is the RecoverHandler's
            self.series(name).tidy()
            sequences = CommitLog(store, self.root.child(name)).sequences()
            self._since[name] = sequences[-1] if sequences else 0


def export_trial(fileroot: str, levels: tuple[str, ...], staging_dir: str | None) -> ExportTrial:
    """The trial ``{fileroot}/{levels...}`` (``checkpoints/{user}/{experiment}/{trial}``): a
    folder, or a prefix of an object store (any registered scheme) staged under
    ``staging_dir``. The one place an export trial's kind is decided; ConfigError naming
    ``fileroot`` when it is a malformed URL. Pure."""
    where = locate(fileroot, "fileroot")
    if isinstance(where, Path):
        return FolderTrial(where.joinpath(*levels))
    root = where.child(*levels)
    return ObjectTrial(root, staging_root(staging_dir, root))
