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
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_slices import read_when_needed
from areal_ckpt.fsio import FileWriter
from areal_ckpt.paths import MANIFEST_NAME, TAG_CLIENT_STATE, TAG_MODEL, staging_trial_root
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.commits import (
    CommitLog,
    CommitRecord,
    upload_folder_files,
)
from areal_ckpt.storage.folders import ObjectFiles, OnDemandFiles, fetch_shared
from areal_ckpt.storage.series import ObjectSeries
from areal_ckpt.urls import ObjectURL, parse_object_url, url_scheme

logger = logging.getLogger(__name__)

#: The offline converter every save_dir holds, under the name DeepSpeed gives its own.
OFFLINE_CONVERTER = "zero_to_fp32.py"


def offline_converter_script() -> bytes:
    """``zero_to_fp32.py``'s text: torch + safetensors only (:mod:`areal_ckpt.tools.offline_zero_to_fp32`)."""
    return (Path(__file__).parent.parent / "tools" / "offline_zero_to_fp32.py").read_bytes()


def object_root(value: str | os.PathLike[str], what: str) -> ObjectURL | None:
    """``value`` as an object storage URL, None for a local path; CheckpointError naming
    ``what`` for a URL of an unsupported scheme or a malformed one. Pure."""
    try:
        if url_scheme(str(value)) is None:
            return None
        return parse_object_url(str(value), what)
    except ValueError as error:
        raise CheckpointError(f"{what}: {error}" if what not in str(error) else str(error)) from None


def rank_staging(root: ObjectURL, tag: str) -> Path:
    """This rank's own local staging folder for a save of ``tag`` to ``root``."""
    return staging_trial_root(None, root) / f".{tag}.rank{dist.rank()}.staging"


def prepare_rank_staging(staging: Path) -> None:
    """Every rank: an empty staging folder of its own. Raises CheckpointError naming it."""
    try:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / TAG_MODEL).mkdir(parents=True)
        (staging / TAG_CLIENT_STATE).mkdir()
    except OSError as error:
        raise CheckpointError(f"{staging}: cannot prepare the checkpoint's staging folder: {error}") from error


def choose_folder(root: ObjectURL, tag: str) -> str:
    """Rank 0: the never-used prefix a save of ``tag`` goes to (``tag`` or ``tag.{n}``);
    CheckpointError naming the endpoint and bucket when the bucket does not answer."""
    store_of(root).check_access()
    return ObjectSeries(root).reserve(tag)


def data_writer(root: ObjectURL, folder: str) -> Callable[[Path], FileWriter]:
    """What writes this rank's DCP data file of the tag straight to the bucket, from memory."""
    target = root.child(folder, TAG_MODEL)
    return lambda path: store_of(target).open_writer(target.key(path.name))


def upload_own(root: ObjectURL, folder: str, staging: Path, names: list[str]) -> None:
    """Every rank: upload the files it wrote (``names``, relative to its ``staging``). Blocking."""
    target = root.child(folder)
    upload_folder_files(store_of(target), staging, names, target)


def commit_tag(root: ObjectURL, folder: str, staging: Path, uploaded: set[str], tag: str, save_latest: bool) -> None:
    """Rank 0, once every rank uploaded its own files and the manifest is written into
    ``staging``: upload the rest and the manifest, write the commit record, then delete the
    older saves of ``tag`` and place the offline converter. Blocking."""
    series = ObjectSeries(root)
    newest = series.commit(staging, folder, staging, uploaded, {"tag": tag, "latest": save_latest})
    series.supersede(newest, lambda body: body.get("tag") == tag)  # a tag saved again replaces it
    store = store_of(root)
    script = offline_converter_script()
    try:
        if store.get_bytes(root.key(OFFLINE_CONVERTER)) != script:
            store.put_bytes(root.key(OFFLINE_CONVERTER), script)
    except CheckpointError as error:  # the checkpoint is committed; the script is a convenience
        logger.warning("%s: could not place %s: %s", root, OFFLINE_CONVERTER, error)


def remove_uncommitted(root: ObjectURL, folder: str) -> None:
    """Rank 0 after a failed save: delete what was uploaded of it (best effort)."""
    ObjectSeries(root).discard(folder)


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


def fetch_tag(root: ObjectURL, folder: str, token: str) -> Path:
    """Every rank: the local copy of the committed tag ``folder``: its manifest and small files
    completed and checked (see :func:`areal_ckpt.storage.folders.fetch_shared`), its data files
    (and DCP metadata) left for :func:`data_fetcher` to bring down as they are read. Blocking."""
    source = root.child(folder)
    copies = staging_trial_root(None, root)
    return fetch_shared(ObjectFiles(source), copies, MANIFEST_NAME, token, deferred=read_when_needed)


def data_fetcher(root: ObjectURL, folder: str, copy: Path, files: dict[str, dict[str, int]]) -> Callable[[Path], None]:
    """What brings a DCP file of the tag's local ``copy`` (data, chunks, metadata) down before a
    rank reads it."""
    return OnDemandFiles(ObjectFiles(root.child(folder)), copy, files).ensure
