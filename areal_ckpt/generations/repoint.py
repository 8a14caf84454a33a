"""`areal-ckpt recover-pointer`: point a trial's lost commit record at the newest generation whose
every file verifies. An operator's repair, run by one process holding the trial's lock; it never
deletes anything."""

from __future__ import annotations

import logging
from typing import Any

from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import (
    METADATA_JSON,
    RECOVER_INFO,
    RECOVER_MANIFEST,
    STEP_FILE,
    check_model_name,
    generation_step,
    is_generation_name,
)
from areal_ckpt.publish import read_manifest
from areal_ckpt.storage.foreign import refuse_foreign_layout
from areal_ckpt.storage.location import Location, recommit_newest_intact

logger = logging.getLogger(__name__)


def repoint_newest_verified(store: RecoverStore) -> tuple[str, dict[str, list[str]], bool]:
    """Make ``store``'s ``current`` name its newest generation whose manifest names what a load
    needs (:func:`missing_parts`) and whose every file matches it (sizes and CRC-32, all read),
    unless it names such a one already
    (:func:`~areal_ckpt.storage.location.recommit_newest_intact`, as on object storage), then
    place the trial's fixed links. Returns the generation, the problems of those skipped, and
    whether ``current`` changed. Durable on return. Raises CheckpointError, changing nothing,
    when the store is not a real folder, the trial holds AReaL's folders (an interrupted import:
    running import-areal again finishes it), or no generation verifies."""
    store.check_root()
    refuse_foreign_layout(store.trial)
    name, skipped, changed = recommit_newest_generation(store.location)
    if changed:
        store.ensure_links(read_manifest(store.path(name), RECOVER_MANIFEST)["models"])
    return name, skipped, changed


def recommit_newest_generation(generations: Location) -> tuple[str, dict[str, list[str]], bool]:
    """:func:`~areal_ckpt.storage.location.recommit_newest_intact` over a trial's recovery
    generations (:func:`~areal_ckpt.storage.location.recovery_location_of`, a folder or a
    prefix): each must be a generation whose manifest names what a load needs
    (:func:`missing_parts`), newest step first; a new commit records this repair. Blocking."""
    return recommit_newest_intact(
        generations,
        RECOVER_MANIFEST,
        is_generation_name,
        generation_step,
        lambda name: {"run": "recover-pointer", "global_step": generation_step(name)},
        missing_parts,
        "recovery generation",
    )


def missing_parts(manifest: dict[str, Any]) -> list[str]:
    """What a recovery generation's manifest lacks to be loadable, in words (empty when
    nothing): model names that can name folders of a trial, and among its files each model's
    DCP metadata and the step record. Pure: a manifest re-signed to list no files is caught
    here, before its checksums (which would then check nothing) are trusted."""
    models = manifest.get("models")
    if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
        return [f"models {str(models)[:100]} is not a list of model names"]
    problems = []
    for model in models:
        try:
            check_model_name(model)
        except ValueError as error:
            problems.append(str(error))
    required = [f"{RECOVER_INFO}/{STEP_FILE}", *(f"{model}/{METADATA_JSON}" for model in models)]
    return problems + [f"{name}: not in the manifest" for name in required if name not in manifest["files"]]
