"""A ``save_dir`` / ``load_dir`` as ``save_checkpoint`` / ``load_checkpoint`` use it: DeepSpeed's
tags over one :class:`~areal_ckpt.storage.location.Location` (a folder or a prefix of an object
store, whichever the path or URL names; nothing here asks which).

A tag is a checkpoint whose label is the tag; ``latest`` is the location's pointer (in a folder
the file ``latest``, renamed over; on a store the newest commit record that pointed). A tag saved
again replaces its earlier saves (:class:`~areal_ckpt.storage.retention.ReplaceSameLabel`: in a
folder the rename replaces it whole, on a store the older saves are removed after the commit).
Every save_dir also holds the offline converter under the name DeepSpeed gives its own.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from areal_ckpt import agree, dist
from areal_ckpt.config import check_path_component
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_slices import read_when_needed
from areal_ckpt.fsio import FileWriter
from areal_ckpt.paths import DATA_SUFFIX, LATEST, TAG_CLIENT_STATE, TAG_MODEL
from areal_ckpt.storage.folders import FileSource
from areal_ckpt.storage.location import Location, location_of, retain
from areal_ckpt.storage.retention import ReplaceSameLabel

logger = logging.getLogger(__name__)

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


class SaveDir:
    """A save_dir over its location. Methods say whether they are collective; all block; errors
    are CheckpointError naming the path or URL. Picklable."""

    def __init__(self, location: Location) -> None:
        self.location = location

    def check_node_local_storage(self, enabled: bool) -> None:
        """CheckpointError, nothing written, when DeepSpeed's ``use_node_local_storage`` is set
        and the location needs one staging folder every node shares (a folder). Local."""
        if enabled and self.location.shared_staging:
            raise CheckpointError(
                "save_checkpoint: checkpoint.use_node_local_storage is set, so each node would keep only its own "
                "ranks' shards; areal_ckpt commits one checkpoint that every rank can read, so it needs one "
                "save_dir on storage every node shares. Give an object store save_dir (s3://, gs:// or az://: "
                "each node then writes only its own ranks' files to its local disk, and the bucket is what the "
                "nodes share), or set use_node_local_storage to false (nothing was written)"
            )

    def begin(self, tag: str) -> TagSave:
        """Collective: rank 0 reserves the save's folder (``tag``, or on a store a never-used
        ``tag.{n}``; CheckpointError naming the endpoint and bucket when it does not answer),
        then the staging folders are made empty (rank 0's shared one, or each rank's own)."""
        location, rank = self.location, dist.rank()

        def reserve() -> str:
            location.check_access()
            return location.reserve(tag)

        folder = agree.decided_by_rank0(reserve, "save_checkpoint")
        staging = agree.on_every_rank(lambda: location.stage(tag, rank), "save_checkpoint")
        for part in (TAG_MODEL, TAG_CLIENT_STATE):
            (staging / part).mkdir(parents=True, exist_ok=True)
        return TagSave(staging, folder, location.where(folder), f"{location.where()}/{TAG_MODEL}")

    def data_writer(self, save: TagSave) -> Callable[[Path], FileWriter] | None:
        """What writes this rank's DCP data files straight to the location, or None: into the
        staging folder."""
        write = self.location.writer_of(save.folder)
        if write is None:
            return None
        return lambda path: write(f"{TAG_MODEL}/{path.name}")

    def put_own(self, save: TagSave, names: list[str]) -> None:
        """Every rank, after its files are written (``names``, relative to the staging folder,
        the data files among them): put in place those that are not yet."""
        written_there = self.location.writer_of(save.folder) is not None
        staged = [name for name in names if not (written_there and name.endswith(DATA_SUFFIX))]
        self.location.put_own(save.staging, save.folder, staged)

    def commit(self, save: TagSave, tag: str, written: set[str], save_latest: bool) -> None:
        """Rank 0, once every rank's files are in place and the manifest is in its staging
        folder (``written``: every rank's files): the tag committed whole, then ``latest``
        (``save_latest``), older saves of the tag removed, the offline converter placed."""
        self.location.commit(save.staging, save.folder, written, {"tag": tag}, point=save_latest)
        retain(self.location, ReplaceSameLabel(), save.folder)
        try:
            self.location.place(OFFLINE_CONVERTER, offline_converter_script())
        except (OSError, CheckpointError) as error:  # the checkpoint is committed; the script is a convenience
            logger.warning("%s: could not place %s: %s", self.location.where(), OFFLINE_CONVERTER, error)

    def close(self, save: TagSave, failed: bool) -> None:
        """Every rank, at the end of a save: its staging removed, and after a ``failed`` save
        what rank 0's save left in the location. Best effort; never raises."""
        if failed and dist.rank() == 0:
            self.location.discard(save.folder)
        self.location.unstage(save.staging, dist.rank())

    def newest(self, tag: str | None) -> str | None:
        """Local: the folder of the newest committed save of ``tag``, or of ``latest`` when
        ``tag`` is None (None when no save pointed). CheckpointError naming a missing tag."""
        if tag is None:
            return self.location.pointed()
        check_path_component(tag, "tag")
        found = self.location.named(tag)
        if found is None:
            raise CheckpointError(
                f"{self.location.where(tag)}: no such checkpoint tag (no commit in {self.location.where()} names it)"
            )
        return found

    def open(self, tag: str | None) -> OpenedTag | None:
        """Collective: rank 0 finds the newest committed save of ``tag`` (or of ``latest``; None
        returned when there is none), every rank gets it ready to read (in place, or its node's
        checked local copy of its manifest and small files; the DCP files come down as read)."""

        def find() -> tuple[str, str] | None:
            self.location.check_access()
            folder = self.newest(tag)
            return None if folder is None else (folder, secrets.token_hex(4))

        found = agree.decided_by_rank0(find, "load_checkpoint")
        if found is None:
            return None
        folder, token = found
        opened = agree.on_every_rank(
            lambda: self.location.open(folder, token, deferred=read_when_needed),
            f"{self.location.where(folder)}: cannot fetch the checkpoint",
        )
        return OpenedTag(opened.folder, self.location.where(folder), opened.source)


def save_dir_of(value: str | os.PathLike[str], what: str) -> SaveDir:
    """``value`` as a save_dir (:func:`~areal_ckpt.storage.location.location_of`, its pointer
    ``latest``). CheckpointError naming ``what`` for a malformed URL or one of an unsupported
    scheme. Pure."""
    try:
        return SaveDir(location_of(value, what, pointer=LATEST))
    except ValueError as error:
        raise CheckpointError(f"{what}: {error}" if what not in str(error) else str(error)) from None
