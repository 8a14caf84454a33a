"""A folder or a URL as the ``areal-ckpt`` commands see it, chosen once.

:func:`place_of` turns a command's path argument into a
:class:`~areal_ckpt.tools.place_contract.CheckpointPlace`: a
:class:`FolderPlace` (a local or shared folder, read in place) or an
:class:`~areal_ckpt.tools.object_place.ObjectPlace` (a prefix on an object store: listed and
verified where it lies, copied down for the commands that read a checkpoint whole). The commands
call it and never ask which one they have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.generations.repoint import repoint_trial
from areal_ckpt.tools.catalog import Found, Unverifiable
from areal_ckpt.tools.inspection import describe, found_in, list_trial
from areal_ckpt.tools.place_contract import CheckpointPlace, Repointed
from areal_ckpt.urls import locate


class FolderPlace:
    """A folder (local disk or a shared file system), read and written in place."""

    unit = "file"

    def __init__(self, path: Path) -> None:
        self.path = path

    def describe(self, scratch: Path) -> dict[str, Any]:
        """:func:`~areal_ckpt.tools.inspection.describe` of the folder."""
        return describe(self.path)

    def found(self) -> list[Found | Unverifiable]:
        """:func:`~areal_ckpt.tools.inspection.found_in` the folder; CheckpointError when the
        path is no folder (a wrong argument, not damage)."""
        self._check_folder()
        return found_in(self.path)

    def _check_folder(self) -> None:
        """CheckpointError ``{path}: not a folder`` unless the path is one (links followed, as
        a user's path may be one)."""
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a folder")

    def list(self) -> list[dict[str, Any]]:
        """:func:`~areal_ckpt.tools.inspection.list_trial` of the folder."""
        return list_trial(self.path)

    def readable(self, scratch: Path) -> Path:
        """The folder itself."""
        return self.path

    def readable_tag(self, tag: str | None, scratch: Path) -> tuple[Path, str | None]:
        """The folder itself and ``tag``."""
        return self.path, tag

    def output(self, scratch: Path) -> Path:
        """The folder itself."""
        return self.path

    def commit_output(self, folder: Path) -> str:
        """Nothing to do: the output was written (and committed) in place."""
        return str(folder)

    def repoint(self) -> Repointed:
        """:func:`~areal_ckpt.generations.repoint.repoint_trial` of the folder."""
        return Repointed(*repoint_trial(self.path), str(self.path))


def place_of(value: str, what: str) -> CheckpointPlace:
    """The location a command's argument ``what`` names: an object store prefix for a URL
    (ConfigError naming it when malformed), else a folder. Pure; the object side (its
    clients, torch for the downloads) is imported only for a URL, so a folder's ``list``,
    ``inspect`` and ``verify`` start quickly."""
    where = locate(value, what)
    if isinstance(where, Path):
        return FolderPlace(where)
    from areal_ckpt.tools.object_place import ObjectPlace

    return ObjectPlace(where)
