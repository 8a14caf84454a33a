"""``save_checkpoint`` / ``load_checkpoint`` with ``save_dir`` on a local (or shared POSIX)
filesystem: the tag folder staged and renamed into place whole, ``latest`` renamed over, the
offline converter placed (see :mod:`areal_ckpt.tags.api` for the layout)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from areal_ckpt import agree, dist
from areal_ckpt.config import check_path_component
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import FileWriter, fsync_dir, make_dirs, write_file_durably
from areal_ckpt.paths import LATEST, TAG_CLIENT_STATE, TAG_MODEL
from areal_ckpt.publish import publish
from areal_ckpt.tags.contract import OFFLINE_CONVERTER, OpenedTag, TagSave, offline_converter_script

logger = logging.getLogger(__name__)


class FolderTags:
    """A save_dir that is a folder every rank shares (local disk, NFS, Lustre): rank 0 stages
    the tag, every rank writes its files into that staging folder, rank 0 renames it into place
    and ``latest`` over. Picklable."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def check_node_local_storage(self, enabled: bool) -> None:
        """Refused: one folder every node shares is what a commit here needs."""
        if enabled:
            raise CheckpointError(
                "save_checkpoint: checkpoint.use_node_local_storage is set, so each node would keep only its own "
                "ranks' shards; areal_ckpt commits one checkpoint that every rank can read, so it needs one "
                "save_dir on storage every node shares. Give an s3:// save_dir (each node then writes only its own "
                "ranks' files to its local disk, and the bucket is what the nodes share), or set "
                "use_node_local_storage to false (nothing was written)"
            )

    def begin(self, tag: str) -> TagSave:
        """Collective: rank 0 makes the staging folder ``.{tag}.staging`` empty."""
        staging = self.root / f".{tag}.staging"
        agree.decided_by_rank0(lambda: prepare_staging(staging), "save_checkpoint")
        return TagSave(staging, tag, str(self.root / tag), f"{self.root}/{TAG_MODEL}")

    def data_writer(self, save: TagSave) -> Callable[[Path], FileWriter] | None:
        """None: data files are written into the shared staging folder."""
        return None

    def put_own(self, save: TagSave, names: list[str]) -> None:
        """Nothing: every file was written in place."""

    def commit(self, save: TagSave, tag: str, written: set[str], save_latest: bool) -> None:
        """Rank 0: :func:`publish_tag`."""
        publish_tag(self.root, tag, save.staging, self.root / tag, save_latest)

    def close(self, save: TagSave, failed: bool) -> None:
        """Rank 0 removes the staging folder (what a failed save wrote is all in it)."""
        if dist.rank() == 0:
            shutil.rmtree(save.staging, ignore_errors=True)

    def open(self, tag: str | None) -> OpenedTag | None:
        """Collective: ``tag``, or the one ``latest`` names (rank 0 reads it); read in place."""
        if tag is None:
            tag = agree.decided_by_rank0(lambda: read_latest(self.root), "load_checkpoint")
            if tag is None:
                return None
        check_path_component(tag, "tag")
        folder = self.root / tag
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: no such checkpoint tag")
        return OpenedTag(folder, str(folder), None)


def prepare_staging(staging: Path) -> None:
    """Rank 0: an empty staging folder for a tag. Raises CheckpointError naming it."""
    try:
        if staging.exists():
            shutil.rmtree(staging)
        make_dirs(staging.parent)  # the save_dir, durably: the publish renames into it
        (staging / TAG_MODEL).mkdir(parents=True)
        (staging / TAG_CLIENT_STATE).mkdir()
    except OSError as error:
        raise CheckpointError(f"{staging}: cannot prepare the checkpoint folder: {error}") from error


def publish_tag(root: Path, tag: str, staging: Path, final: Path, save_latest: bool) -> None:
    """Rank 0: publish the staged tag folder, then ``latest``."""
    publish(staging, final, root / f".{tag}.trash")
    if save_latest:
        write_latest(root, tag)
    try:
        place_offline_converter(root)
    except OSError as error:  # the checkpoint is committed; the script is a convenience
        logger.warning("%s: could not place %s: %s", root, OFFLINE_CONVERTER, error)


def place_offline_converter(root: Path) -> None:
    """Rank 0: put ``zero_to_fp32.py`` (torch + safetensors only, see
    :mod:`areal_ckpt.tools.offline_zero_to_fp32`) into ``root``, as DeepSpeed puts its own, by
    renaming a complete new file over it; nothing when the same script is there already."""
    script = offline_converter_script()
    target = root / OFFLINE_CONVERTER
    if target.is_file() and not target.is_symlink() and target.read_bytes() == script:
        return
    temporary = root / f".{OFFLINE_CONVERTER}.{os.getpid()}"
    write_file_durably(temporary, script)
    os.replace(temporary, target)
    fsync_dir(root)


def write_latest(root: Path, tag: str) -> None:
    """Point ``latest`` at ``tag`` by renaming a complete new file over it; durable."""
    temporary = root / f".{LATEST}.{os.getpid()}"
    write_file_durably(temporary, f"{tag}\n".encode())
    os.replace(temporary, root / LATEST)
    fsync_dir(root)


def read_latest(root: Path) -> str | None:
    """The tag ``latest`` names, None when there is no ``latest``; local.

    Raises CheckpointError when it names something that is not a tag folder of ``root``.
    """
    path = root / LATEST
    if not path.is_file():
        return None
    tag = path.read_text(errors="replace").strip()
    try:
        check_path_component(tag, "tag")
    except ValueError as error:
        raise CheckpointError(f"{path}: {error}") from None
    if not (root / tag).is_dir():
        raise CheckpointError(f"{path}: names {tag!r}, but {root / tag} does not exist")
    return tag
