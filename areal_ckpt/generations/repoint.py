"""`areal-ckpt recover-pointer`: commit again a trial's newest generation whose every file
verifies, when its commit record is lost or names a damaged one, in a folder or on a store alike.
An operator's repair, run by one process (holding a folder trial's lock); it never deletes
anything."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from areal_ckpt.paths import (
    METADATA_JSON,
    RECOVER_INFO,
    RECOVER_MANIFEST,
    STEP_FILE,
    check_model_name,
    generation_step,
    is_generation_name,
)
from areal_ckpt.storage.location import Location, recommit_newest_intact, recovery_location_of
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)


def repoint_trial(trial: Path | ObjectURL) -> tuple[str, dict[str, list[str]], bool]:
    """``recover-pointer`` on the trial folder or prefix ``trial``: when its newest commit names a
    generation that is missing or damaged (or none), commit again the newest generation whose
    manifest names what a load needs (:func:`missing_parts`) and whose every file matches it
    (:func:`~areal_ckpt.storage.location.recommit_newest_intact` over
    :func:`~areal_ckpt.storage.location.recovery_location_of`, under a folder trial's lock; a
    folder's fixed links placed again; a store's new record create-only). Returns the generation,
    those skipped with their problems, and whether a commit was made. Never deletes anything.
    CheckpointError, changing nothing, when a folder trial is no folder or holds AReaL's own
    folders (an interrupted import: running ``import-areal`` again finishes it), or when no
    generation verifies. Blocking; one process."""
    return recommit_newest_generation(recovery_location_of(trial))


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
