"""Where ``save_checkpoint`` / ``load_checkpoint`` keep tags: the contract each ``save_dir``
implements, a folder (:class:`~areal_ckpt.tags.folder.FolderTags`) or a prefix on an object
store (:class:`~areal_ckpt.tags.objects.ObjectTags`), chosen once by
:func:`~areal_ckpt.tags.location.tag_location`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from areal_ckpt.fsio import FileWriter
from areal_ckpt.storage.folders import FileSource

#: The offline converter every save_dir holds, under the name DeepSpeed gives its own.
OFFLINE_CONVERTER = "zero_to_fp32.py"


def offline_converter_script() -> bytes:
    """``zero_to_fp32.py``'s text: torch + safetensors only (:mod:`areal_ckpt.tools.offline_zero_to_fp32`)."""
    return (Path(__file__).parent.parent / "tools" / "offline_zero_to_fp32.py").read_bytes()


@dataclass(frozen=True)
class TagSave:
    """One save of a tag in progress: this rank's ``staging`` folder, the ``folder`` the save
    goes to in the save_dir (the tag, or a never-used prefix for it), ``where`` it will be (a
    path or URL, for messages) and the key of DCP's save plan cache for the save_dir."""

    staging: Path
    folder: str
    where: str
    plan_key: str


@dataclass(frozen=True)
class OpenedTag:
    """A committed tag ready to load: the local ``folder`` to read, the path or URL ``shown`` to
    the caller, and where the DCP files ``folder`` lacks come from as they are read
    (``source``; None when every file is there)."""

    folder: Path
    shown: str
    source: FileSource | None


class TagLocation(Protocol):
    """A save_dir. Methods say whether they are collective; all block; errors are
    CheckpointError naming the path or URL."""

    def check_node_local_storage(self, enabled: bool) -> None:
        """CheckpointError, nothing written, when DeepSpeed's ``use_node_local_storage`` is set
        and this location cannot give every rank one checkpoint from per-node writes. Local."""

    def begin(self, tag: str) -> TagSave:
        """Collective: the save's staging folders made empty (rank 0's, or every rank's own) and
        its folder chosen."""

    def data_writer(self, save: TagSave) -> Callable[[Path], FileWriter] | None:
        """What writes this rank's DCP data files straight to the location, or None: into the
        staging folder."""

    def put_own(self, save: TagSave, names: list[str]) -> None:
        """Every rank, after its files are written (``names``, relative to the staging folder,
        the data files among them): put in place those that are not yet. Blocking."""

    def commit(self, save: TagSave, tag: str, written: set[str], save_latest: bool) -> None:
        """Rank 0, once every rank's files are in place and the manifest is in its staging
        folder (``written``: every rank's files): the tag committed whole, then ``latest``
        (``save_latest``), an older save of the tag replaced, the offline converter placed."""

    def close(self, save: TagSave, failed: bool) -> None:
        """Every rank, at the end of a save: its staging removed, and after a ``failed`` save
        what it left in the location (rank 0). Best effort; never raises."""

    def open(self, tag: str | None) -> OpenedTag | None:
        """Collective: the committed ``tag`` (None: the one ``latest`` names; None returned when
        there is no ``latest``) ready to read on every rank; CheckpointError naming a missing
        tag."""
