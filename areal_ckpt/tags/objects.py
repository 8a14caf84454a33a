"""``save_checkpoint`` / ``load_checkpoint`` with ``save_dir`` on object storage (``s3://``,
``gs://``, ``az://``).

Layout::

    {save_dir}/{tag}/...                 the tag's objects, as in a local tag folder (a tag saved
                                         again goes to {tag}.1, {tag}.2...: a prefix is never reused)
    {save_dir}/.commits/{n:012d}.json    one commit record per save: the folder, the tag, and
                                         whether the save moved ``latest``
    {save_dir}/zero_to_fp32.py           the offline converter, as DeepSpeed places its own

There is no ``latest`` object to overwrite: ``latest`` is the newest record of a save with
``save_latest``, found by listing the log. Each rank stages its own files in a local folder
(under the system's temporary folder: ``TMPDIR``) and uploads them itself; rank 0 uploads the
rest and the manifest, then writes the record create-only, last (see
:mod:`areal_ckpt.storage.commits`). Once a save of a tag is committed, the older saves of that
tag are deleted, record first: saving a tag again replaces it, as DeepSpeed's own save does.
A load brings the tag into a local copy (ranks of a node share it) and loads from there.
"""

from __future__ import annotations

import logging
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from areal_ckpt import agree, dist
from areal_ckpt.config import check_path_component
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_slices import read_when_needed
from areal_ckpt.fsio import FileWriter
from areal_ckpt.paths import DATA_SUFFIX, MANIFEST_NAME, TAG_CLIENT_STATE, TAG_MODEL
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.commits import CommitLog, CommitRecord, upload_folder_files
from areal_ckpt.storage.folders import ObjectSource, fetch_shared, staging_root
from areal_ckpt.storage.retention import ReplaceSameLabel
from areal_ckpt.storage.series import ObjectSeries, retain
from areal_ckpt.tags.contract import OFFLINE_CONVERTER, OpenedTag, TagSave, offline_converter_script
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)


class ObjectTags:
    """A save_dir on object storage (the prefix ``root``): each rank stages and uploads its own
    files, rank 0 commits the save with a create-only record (see the module docstring).
    Picklable."""

    def __init__(self, root: ObjectURL) -> None:
        self.root = root

    def check_node_local_storage(self, enabled: bool) -> None:
        """Accepted: each node writes only its own ranks' files anyway; the bucket is shared."""

    def begin(self, tag: str) -> TagSave:
        """Collective: rank 0 reserves a never-used prefix for the save (``tag`` or ``tag.{n}``;
        CheckpointError naming the endpoint and bucket when it does not answer), every rank
        makes its own staging folder (under ``TMPDIR``) empty."""
        staging = staging_root(None, self.root) / f".{tag}.rank{dist.rank()}.staging"

        def reserve() -> str:
            store_of(self.root).check_access()
            return ObjectSeries(self.root).reserve(tag)

        folder = agree.decided_by_rank0(reserve, "save_checkpoint")
        agree.on_every_rank(lambda: _prepare_rank_staging(staging), "save_checkpoint")
        return TagSave(staging, folder, str(self.root.child(folder)), f"{self.root}/{TAG_MODEL}")

    def data_writer(self, save: TagSave) -> Callable[[Path], FileWriter]:
        """Writes this rank's DCP data file of the tag straight to the bucket, from memory."""
        target = self.root.child(save.folder, TAG_MODEL)
        return lambda path: store_of(target).open_writer(target.key(path.name))

    def put_own(self, save: TagSave, names: list[str]) -> None:
        """Every rank: upload the files it staged (its data files went up as they were made)."""
        target = self.root.child(save.folder)
        staged = sorted(name for name in names if not name.endswith(DATA_SUFFIX))
        upload_folder_files(store_of(target), save.staging, staged, target)

    def commit(self, save: TagSave, tag: str, written: set[str], save_latest: bool) -> None:
        """Rank 0: upload the rest and the manifest, write the commit record, then delete the
        older saves of ``tag`` and place the offline converter. Blocking."""
        series = ObjectSeries(self.root)
        series.commit(save.staging, save.folder, save.staging, written, {"tag": tag, "latest": save_latest})
        retain(series, ReplaceSameLabel(), save.folder)
        store = store_of(self.root)
        script = offline_converter_script()
        try:
            if store.get_bytes(self.root.key(OFFLINE_CONVERTER)) != script:
                store.put_bytes(self.root.key(OFFLINE_CONVERTER), script)
        except CheckpointError as error:  # the checkpoint is committed; the script is a convenience
            logger.warning("%s: could not place %s: %s", self.root, OFFLINE_CONVERTER, error)

    def close(self, save: TagSave, failed: bool) -> None:
        """Every rank removes its staging folder; after a ``failed`` save rank 0 deletes what was
        uploaded of it (best effort)."""
        if failed and dist.rank() == 0:
            ObjectSeries(self.root).discard(save.folder)
        shutil.rmtree(save.staging, ignore_errors=True)

    def open(self, tag: str | None) -> OpenedTag | None:
        """Collective: rank 0 finds the newest committed save of ``tag`` (or of ``latest``), every
        rank completes its node's local copy of its manifest and small files (checked); the DCP
        files come down as they are read."""
        if tag is not None:
            check_path_component(tag, "tag")
        found = agree.decided_by_rank0(lambda: find_tag(self.root, tag), "load_checkpoint")
        if found is None:
            return None
        folder, _, token = found
        source = ObjectSource(self.root.child(folder))
        copies = staging_root(None, self.root)
        copy = agree.on_every_rank(
            lambda: fetch_shared(source, copies, MANIFEST_NAME, token, deferred=read_when_needed),
            f"{source.where()}: cannot fetch the checkpoint",
        )
        return OpenedTag(copy, source.where(), source)


def _prepare_rank_staging(staging: Path) -> None:
    """Every rank: an empty staging folder of its own. Raises CheckpointError naming it."""
    try:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / TAG_MODEL).mkdir(parents=True)
        (staging / TAG_CLIENT_STATE).mkdir()
    except OSError as error:
        raise CheckpointError(f"{staging}: cannot prepare the checkpoint's staging folder: {error}") from error


def find_tag(root: ObjectURL, tag: str | None) -> tuple[str, str, str] | None:
    """Rank 0: (folder, tag, load token) of the newest committed save of ``tag``, or of
    ``latest`` when ``tag`` is None (None when nothing was saved with ``save_latest``).
    CheckpointError when a named tag has no commit."""
    store = store_of(root)
    store.check_access()
    for record in reversed(CommitLog(store, root).records()):
        if (record.body.get("latest") if tag is None else record.body.get("tag") == tag) and _is_tag(record):
            return record.folder, str(record.body["tag"]), secrets.token_hex(4)
    if tag is None:
        return None
    raise CheckpointError(f"{root.child(tag)}: no such checkpoint tag (no commit record in {root} names it)")


def _is_tag(record: CommitRecord) -> bool:
    """A record of a tag save (the log may hold nothing else, but a forged one is not followed)."""
    return isinstance(record.body.get("tag"), str) and "/" not in record.folder
