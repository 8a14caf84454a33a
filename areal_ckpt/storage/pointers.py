"""What names the committed checkpoint of a folder location: its *pointer*, one entry beside the
checkpoints replaced atomically. Two styles, one interface (:class:`Pointer`):

- :class:`PointerFile`: a file holding the checkpoint's name and a newline, replaced by renaming
  a complete new file over it (DeepSpeed's ``latest``);
- :class:`PointerLink`: a relative symbolic link to the checkpoint's folder, switched by renaming
  a new link over it (the recovery store's ``current``).

Either way a reader sees the old name or the new one, never neither, and the switch is durable
when it returns. Nothing here follows or replaces an entry it did not make: a pointer that is
another kind of entry is refused by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import fsync_dir, write_file_durably
from areal_ckpt.publish import switch_symlink


def replace_file(root: Path, name: str, data: bytes) -> None:
    """Make ``{root}/{name}`` hold ``data`` by renaming a complete new file over it (a link
    there is replaced, never written through); durable on return."""
    temporary = root / f".{name}.{os.getpid()}"
    write_file_durably(temporary, data)
    os.replace(temporary, root / name)
    fsync_dir(root)


class Pointer(Protocol):
    """The pointer of a folder location: ``name`` is its entry in the location's folder."""

    @property
    def name(self) -> str:
        """The pointer's entry in the location's folder."""

    def read(self, root: Path) -> str | None:
        """What the pointer in ``root`` names (unchecked), None when there is none;
        CheckpointError naming it when it is another kind of entry. Read-only."""

    def point(self, root: Path, checkpoint: str) -> None:
        """Make the pointer in ``root`` name ``checkpoint`` (nothing when it does already);
        atomic and durable on return."""


@dataclass(frozen=True)
class PointerFile:
    """A file naming the checkpoint (DeepSpeed's ``latest``)."""

    name: str

    def read(self, root: Path) -> str | None:
        """The file's first line (read through a link, never written through one); None
        without a file."""
        path = root / self.name
        if not path.is_file():
            return None
        return path.read_text(errors="replace").strip()

    def point(self, root: Path, checkpoint: str) -> None:
        """A complete new file renamed over it."""
        if self.read(root) != checkpoint:
            replace_file(root, self.name, f"{checkpoint}\n".encode())


@dataclass(frozen=True)
class PointerLink:
    """A relative link to the checkpoint's folder (the recovery store's ``current``)."""

    name: str

    def read(self, root: Path) -> str | None:
        """The link's target; None without one. CheckpointError when the entry is no link."""
        path = root / self.name
        if path.is_symlink():
            return os.readlink(path)
        if path.exists():
            raise CheckpointError(f"{path}: expected a symlink to a generation, found a regular entry")
        return None

    def point(self, root: Path, checkpoint: str) -> None:
        """A new link renamed over it (:func:`~areal_ckpt.publish.switch_symlink`)."""
        path = root / self.name
        if not (path.is_symlink() and os.readlink(path) == checkpoint):
            switch_symlink(path, checkpoint)
