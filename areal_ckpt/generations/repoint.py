"""`areal-ckpt recover-pointer`: point a trial's lost commit record at the newest generation whose
every file verifies. An operator's repair, run by one process holding the trial's lock; it never
deletes anything."""

from __future__ import annotations

import logging
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.generations.foreign import refuse_foreign_layout
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import METADATA_JSON, RECOVER_INFO, RECOVER_MANIFEST, STEP_FILE, check_model_name, generation_step
from areal_ckpt.publish import check_files, read_manifest

logger = logging.getLogger(__name__)


def repoint_newest_verified(store: RecoverStore) -> tuple[str, dict[str, list[str]]]:
    """Point ``store``'s ``current`` at the newest generation whose manifest names what a load
    needs (:func:`missing_parts`) and whose every file matches it (sizes and CRC-32, all read);
    returns it and the problems of the newer ones skipped. Warns when another generation holds
    the same step. Durable on return. Raises CheckpointError, changing nothing, when the store
    is not a real folder, the trial holds AReaL's folders (an interrupted import: running
    import-areal again finishes it), or no generation verifies."""
    store.check_root()
    refuse_foreign_layout(store.trial)
    skipped: dict[str, list[str]] = {}
    generations = store.generations()
    for name in reversed(generations):
        try:
            manifest = read_manifest(store.path(name), RECOVER_MANIFEST)
        except CheckpointError as error:
            skipped[name] = [str(error)]
            continue
        problems = missing_parts(manifest) or check_files(store.path(name), manifest["files"], manifest["files"])
        if problems:
            skipped[name] = problems
            continue
        twins = [other for other in generations if other != name and generation_step(other) == generation_step(name)]
        if twins:
            logger.warning(
                "%s: %s and %s hold the same global step %d; pointing at %s",
                store.root,
                name,
                twins,
                generation_step(name),
                name,
            )
        store.location.point(name)
        store.ensure_links(manifest["models"])
        return name, skipped
    raise CheckpointError(f"{store.root}: no recovery generation verifies: {skipped or 'there is none'}")


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
