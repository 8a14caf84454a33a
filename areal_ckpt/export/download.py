"""Bring a committed export down from object storage as a local folder ``from_pretrained`` loads."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from areal_ckpt.errors import CheckpointError
from areal_ckpt.paths import MANIFEST_NAME
from areal_ckpt.storage.folders import fetch_folder
from areal_ckpt.storage.object_location import ObjectLocation
from areal_ckpt.urls import ObjectURL, parse_object_url

logger = logging.getLogger(__name__)


def committed_export(url: str) -> ObjectURL:
    """The prefix of the export ``url`` names: a model's prefix (``.../{trial}/{name}``: its
    newest committed export) or one export's (``.../{name}/epoch..globalstep..``, which must be
    committed). CheckpointError naming the URL when no commit record names it. Reads only."""
    where = parse_object_url(url, "export URL")
    newest = ObjectLocation(where).newest()
    if newest is not None:
        return where.child(newest.name)
    parent, folder = where.parent()
    if folder and any(export.name == folder for export in ObjectLocation(parent).committed()):
        return where
    raise CheckpointError(f"{url}: no committed export there (no commit record of {parent} names it)")


def download_export(url: str, destination: Path) -> Path:
    """Download the export ``url`` names (see :func:`committed_export`) into the new local
    folder ``destination``, check every file's size and CRC-32 against the export's manifest,
    and return ``destination``. Blocking; local to the caller (no collective). On any error
    (a missing, truncated or altered object, named by its URL) nothing is left at
    ``destination``."""
    if destination.exists() or destination.is_symlink():
        raise CheckpointError(f"{destination}: exists; download into a new folder")
    export = committed_export(url)
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{destination.name}.partial-", dir=destination.parent))  # ours alone
    try:
        _fetch(export, partial)
        if destination.exists() or destination.is_symlink():  # made meanwhile: never replaced
            raise CheckpointError(f"{destination}: appeared during the download; download into a new folder")
        partial.rename(destination)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    logger.info("downloaded %s to %s", export, destination)
    return destination


def _fetch(export: ObjectURL, folder: Path) -> None:
    """Manifest first, then every file it lists, each checked against it (size and CRC-32)."""
    parent, name = export.parent()
    fetch_folder(ObjectLocation(parent).files_of(name), folder, MANIFEST_NAME)
