"""The command line on object storage (:class:`ObjectPlace`): what a URL holds, listed and
verified where it lies, copied down for the commands that read a checkpoint whole (``inspect``,
``export``), and a local output committed up (``export``, ``convert-deepspeed``).

Only committed checkpoints count (a commit record names them, see
:mod:`areal_ckpt.storage.commits`); objects no record names are a dead writer's debris and
are neither listed nor verified.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.generations.repoint import repoint_trial
from areal_ckpt.paths import (
    MANIFEST_NAME,
    RECOVER_MANIFEST,
    RECOVER_STORE,
)
from areal_ckpt.publish import read_manifest
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.folders import fetch_folder
from areal_ckpt.storage.location import recovery_location_of
from areal_ckpt.storage.object_location import ObjectLocation, locations_in
from areal_ckpt.tags.save_dir import SaveDir
from areal_ckpt.tools.catalog import Found, Unverifiable, list_found
from areal_ckpt.tools.inspection import describe
from areal_ckpt.tools.place_contract import Repointed
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)


def committed_under(url: ObjectURL) -> list[Found]:
    """The committed checkpoints ``url`` names: a trial's (every model's exports and
    the recovery checkpoint), a model's exports (its prefix), or the one committed folder it
    is. One listing plus one read per commit record. CheckpointError when there is none."""
    listing = store_of(url).list_prefix(url.key() + "/" if url.key() else "")
    found = [checkpoint for root in locations_in(url, listing) for checkpoint in _committed_in(root)]
    if not found and url.key():  # the URL may be one committed folder
        parent, folder = url.parent()
        found = [c for c in _committed_in(parent) if c.entry.name == folder]
    if not found:
        raise CheckpointError(f"{url}: no committed checkpoint there (no commit record under it or naming it)")
    return found


def _committed_in(root: ObjectURL) -> list[Found]:
    """The checkpoints committed in the location ``root``."""
    last = root.key().rsplit("/", 1)[-1]
    kind = "recover" if last == RECOVER_STORE else "export"
    manifest = RECOVER_MANIFEST if kind == "recover" else MANIFEST_NAME
    location = ObjectLocation(root, manifest)
    return [
        Found("deepspeed", entry.label, location, entry, manifest)
        if kind == "export" and entry.label
        else Found(kind, "" if kind == "recover" else last, location, entry, manifest)
        for entry in location.committed()
    ]


def fetch_checkpoint(url: ObjectURL, scratch: Path) -> tuple[Path, str]:
    """Download the one checkpoint ``url`` names into the empty local folder
    ``scratch``: a trial's recovery checkpoint (as a local trial: ``scratch`` itself), or an
    export (the model's newest, or the committed folder named). Returns the local path to
    read and the checkpoint's URL. Blocking; each file is checked against the manifest when
    it is read. A ``save_checkpoint`` folder gives its ``latest`` tag (else its newest)."""
    found = committed_under(url)
    recoveries = [c for c in found if c.kind == "recover"]
    if recoveries:
        checkpoint = max(recoveries, key=lambda c: c.entry.order)
        store = recovery_location_of(scratch)
        fetch_folder(
            checkpoint.location.files_of(checkpoint.entry.name),
            Path(store.where(checkpoint.entry.name)),
            RECOVER_MANIFEST,
        )
        store.recommit(checkpoint.entry.name, {})  # a local trial holding that one generation
        return scratch, checkpoint.where
    tags = [c for c in found if c.kind == "deepspeed"]
    if tags:
        found = [c for c in tags if c.entry.facts.get("latest")] or tags
    names = {c.name for c in found if c.kind == "export"}
    if len(names) > 1:
        raise CheckpointError(f"{url}: holds exports of models {sorted(names)}; name one: {url}/NAME")
    checkpoint = max(found, key=lambda c: c.entry.order)
    folder = scratch / checkpoint.entry.name
    fetch_folder(checkpoint.location.files_of(checkpoint.entry.name), folder, MANIFEST_NAME)
    return folder, checkpoint.where


def fetch_tag_into(root: ObjectURL, tag: str | None, scratch: Path) -> Path:
    """Download the ``save_checkpoint`` tag ``tag`` (None: ``latest``) of the save_dir
    ``root`` into ``scratch/{its folder}`` and return that folder. Blocking."""
    location = ObjectLocation(root)
    location.check_access()
    folder = SaveDir(location).newest(tag)
    if folder is None:
        raise CheckpointError(f"{root}: no tag saved with save_latest; name one with --tag")
    fetch_folder(location.files_of(folder), scratch / folder, MANIFEST_NAME)
    return scratch / folder


def commit_output(folder: Path, url: ObjectURL) -> str:
    """Upload the local export ``folder`` to ``url``, which must hold nothing yet,
    and commit it in its parent's log (as the Saver commits an export: ``download_export``
    and ``from_pretrained`` after it read it). Returns the committed URL. Blocking."""
    parent, name = url.parent()
    if not name:
        raise CheckpointError(f"{url}: name a prefix inside the bucket to write to (s3://bucket/prefix/name)")
    store = store_of(url)
    if store.list_prefix(url.key() + "/"):
        raise CheckpointError(f"{url}: already holds objects; choose a new output prefix")
    local = folder.rename(folder.with_name(name)) if folder.name != name else folder
    header = read_manifest(local, MANIFEST_NAME)
    location = ObjectLocation(parent)
    reserved = location.reserve(local.name)
    try:
        location.commit(local, reserved, set(), {"name": header.get("name"), "step": header.get("step")})
    except BaseException:
        location.discard(reserved)
        raise
    return location.where(reserved)


class ObjectPlace:
    """A prefix on an object store, for the ``areal-ckpt`` commands
    (:class:`~areal_ckpt.tools.places.CheckpointPlace`): committed checkpoints listed and
    verified where they lie, one copied down whole for the commands that read it."""

    unit = "object"

    def __init__(self, url: ObjectURL) -> None:
        self.url = url

    def describe(self, scratch: Path) -> dict[str, Any]:
        """The facts of a downloaded copy, with the checkpoint's URL as its path."""
        local, url = fetch_checkpoint(self.url, scratch)
        return {**describe(local), "path": url}

    def found(self) -> list[Found | Unverifiable]:
        """:func:`committed_under` the URL."""
        return list(committed_under(self.url))

    def list(self) -> list[dict[str, Any]]:
        """:func:`~areal_ckpt.tools.catalog.list_found` of what is committed, newest first."""
        return sorted(
            list_found(self.found()), key=lambda e: (e["global_step"] or 0, e["created_unix"] or 0), reverse=True
        )

    def readable(self, scratch: Path) -> Path:
        """A checked copy in ``scratch`` (:func:`fetch_checkpoint`)."""
        return fetch_checkpoint(self.url, scratch)[0]

    def readable_tag(self, tag: str | None, scratch: Path) -> tuple[Path, str | None]:
        """A checked copy of the tag in ``scratch`` (:func:`fetch_tag_into`), and its folder's name."""
        fetched = fetch_tag_into(self.url, tag, scratch)
        return fetched.parent, fetched.name

    def output(self, scratch: Path) -> Path:
        """A folder in ``scratch``, committed here by :meth:`commit_output`."""
        return scratch / "out"

    def commit_output(self, folder: Path) -> str:
        """:func:`commit_output` to this URL."""
        return commit_output(folder, self.url)

    def repoint(self) -> Repointed:
        """:func:`~areal_ckpt.generations.repoint.repoint_trial` of the prefix."""
        return Repointed(*repoint_trial(self.url), str(self.url))
