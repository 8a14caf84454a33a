"""Import a trial written by AReaL's own RecoverHandler into our layout, in place.

AReaL leaves ``{trial}/recover_info/`` (JSON files and a pickled ``dataloader_info.pkl``) and
one stock DCP folder ``{trial}/{name}/recover_checkpoint/`` per model (an FSDP engine's
``dcp.save({"dcp": DCPState(model, optimizer)})``), or the same files in the generation that
its ``LATEST`` names (:mod:`areal_ckpt.tools.areal_layout`). The import reads all of it first, without
running anything from it (DCP metadata and the pickle through allow-listed unpicklers, tensor
records through ``torch.load(weights_only=True)``), writes one recovery generation of ours
beside it, and commits that generation with the usual atomic pointer switch. Only then are
AReaL's folders (``LATEST`` and ``checkpoint_generations/`` too) moved under
``{trial}/areal_original/`` (or removed on request) and our links
put in their place. A failure before the commit leaves the trial as it was; an interruption
after it is finished by running the import again (a load refuses the trial until then).

AReaL's recovery checkpoint holds no LR scheduler state and no RNG streams: after the import a
load restores neither (it logs that the scheduler starts afresh); everything else (weights,
optimizer moments and param groups, step, dataloader position, saver / evaluator / stats
logger state) carries over. One process runs the import, before the job starts; it holds one
model's whole state in memory at a time.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_save import save_tensors
from areal_ckpt.formats.hf_export import copy_base_model_assets
from areal_ckpt.fsio import fsync_dir, write_file_durably
from areal_ckpt.generations.repoint import missing_parts
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.lock import acquire_trial_lock, release_trial_lock
from areal_ckpt.paths import (
    ENGINE_STATE_FILE,
    HF_FILES,
    RECOVER_INFO,
    RECOVER_MANIFEST,
    STEP_FILE,
    recover_checkpoint_link,
    recover_info_link,
)
from areal_ckpt.publish import check_files, read_manifest, write_manifest
from areal_ckpt.recover.write import dump_header
from areal_ckpt.state import safe_json
from areal_ckpt.step import StepInfo
from areal_ckpt.storage.foreign import foreign_recovery_layout
from areal_ckpt.tools.areal_layout import areal_checkpoint
from areal_ckpt.tools.areal_read import read_model, read_recover_info, stored_tensors

logger = logging.getLogger(__name__)

#: Where AReaL's own folders are kept after an import commits.
ORIGINALS = "areal_original"
IMPORTED_FROM = "areal"


@dataclass(frozen=True)
class ImportedTrial:
    """What :func:`import_areal_trial` made: the committed generation, the step it resumes
    after, its models, the number of ranks AReaL ran with, where the originals went, and the
    names of AReaL's generations newer than its LATEST that were never published (not imported;
    kept with the originals unless those were removed); ``imported_now`` is False when the
    trial was ours already (a re-run) and ``generation`` is its committed one."""

    generation: Path
    step_info: StepInfo
    models: list[str]
    world_size: int
    originals: Path | None
    unpublished: list[str] = field(default_factory=list)
    imported_now: bool = True


def import_areal_trial(trial: Path, config_from: Path | None = None, remove_original: bool = False) -> ImportedTrial:
    """Convert the AReaL trial ``trial`` into our layout in place; durable and atomic.

    ``config_from`` (an HF folder, e.g. the base model) supplies each model's ``hf/`` files, so
    that ``areal-ckpt export`` needs no ``--config-from`` later. Local: one process, holding the
    trial's lock. Raises CheckpointError naming the file and cause when the trial is not an
    AReaL trial, already ours, or holds anything refused; the trial is then left as it was.
    Run again on a trial whose import was committed but interrupted (its originals or links
    not all in place yet) it finishes that import; on one it finished, or that has trained on
    since, it changes nothing (but removes the kept originals with ``remove_original``) and
    returns the committed generation with ``imported_now`` False: a launch script may run it
    before every start.
    """
    trial = Path(trial)
    if not trial.is_dir():
        raise CheckpointError(f"{trial}: not a folder")
    acquire_trial_lock(trial)
    try:
        store = RecoverStore(trial)
        found = foreign_recovery_layout(store.trial)
        try:
            committed = store.committed()
        except CheckpointError as lost:  # no commit record beside complete generations: maybe our own
            committed = _commit_interrupted_import(store, lost)
        if committed is not None:
            header = read_manifest(store.path(committed), RECOVER_MANIFEST)
            if header.get("imported_from") == IMPORTED_FROM and _unfinished(store, header, found):
                logger.info("%s: finishing the import committed as %s", trial, committed)
                return _finish(store, committed, header, remove_original)
            if found:
                raise CheckpointError(
                    f"{store.path(committed)}: the trial holds areal_ckpt's recovery checkpoints and also AReaL's "
                    f"folders ({', '.join(str(path.relative_to(trial)) for path in found)}); nothing was imported. "
                    "Move AReaL's folders out of the trial to keep training from areal_ckpt's checkpoint"
                )
            return _already_ours(store, committed, header, remove_original)
        source = areal_checkpoint(store.trial, found)
        _moves(store, found)  # where AReaL's folders go is checked before anything is written
        step_info, files, world_size = read_recover_info(source.info, sorted(source.payloads))
        if source.published_step is not None and source.published_step != step_info.global_step:
            raise CheckpointError(
                f"{source.info / STEP_FILE}: global step {step_info.global_step}, but AReaL's LATEST names step "
                f"{source.published_step}; nothing was imported"
            )
        sources = source.payloads
        for folder in sources.values():  # every check that needs no tensor, before anything is written
            stored_tensors(folder)
        store.remove_debris(keep=None)
        generation = store.create(step_info.global_step, sorted(sources))
        try:
            header = _write(store.path(generation), step_info, files, sources, config_from, world_size)
            write_manifest(store.path(generation), RECOVER_MANIFEST, {}, header)  # checksums every file
            fsync_dir(store.root)
            store.current.point(store.root, generation)  # the commit (the links follow the moves)
        except BaseException:
            store.discard(generation)
            with contextlib.suppress(OSError):
                store.root.rmdir()  # only when the import created it: it is empty then
            raise
        return _finish(store, generation, header, remove_original, source.unpublished)
    finally:
        release_trial_lock(trial)


def _commit_interrupted_import(store: RecoverStore, lost: CheckpointError) -> str:
    """An import killed between its manifest and its commit: commit the newest complete
    generation that an import wrote, once every file of it verifies, and return it. Raises
    ``lost`` (the store's error: its commit record is missing) when there is none."""
    for name in reversed(store.complete_generations()):
        manifest = read_manifest(store.path(name), RECOVER_MANIFEST)
        if manifest.get("imported_from") != IMPORTED_FROM:
            break  # a generation of a job that trained: recover-pointer's case, not ours
        problems = missing_parts(manifest) or check_files(store.path(name), manifest["files"], manifest["files"])
        if problems:
            raise CheckpointError(f"{store.path(name)}: an interrupted import's generation is damaged: {problems}")
        store.current.point(store.root, name)
        logger.info("%s: committed %s, which an interrupted import had written", store.trial, name)
        return name
    raise lost


def _unfinished(store: RecoverStore, header: dict[str, Any], found: list[Path]) -> bool:
    """True when a committed import still has AReaL's folders in place or misses a link."""
    links = [recover_info_link(store.trial), *(recover_checkpoint_link(store.trial, m) for m in header["models"])]
    return bool(found) or not all(link.is_symlink() for link in links)


def _write(
    generation: Path,
    step_info: StepInfo,
    files: dict[str, bytes],
    sources: dict[str, Path],
    config_from: Path | None,
    world_size: int,
) -> dict[str, Any]:
    """Write the generation's files, one model in memory at a time; returns its manifest header."""
    for name, source in sources.items():
        state = read_model(source)
        save_tensors(state.tensors, generation / name, state.param_groups or None)
        has_optimizer = any(key.startswith("optim.") for key in state.tensors) or bool(state.param_groups)
        extra = {
            "optimizer_has_state": has_optimizer,
            "optimizer_param_groups": state.param_groups,
            "optimizer_scalars": state.scalars,
            "optimizer_saved": has_optimizer,
            "imported_from": IMPORTED_FROM,
        }
        write_file_durably(generation / name / ENGINE_STATE_FILE, safe_json.dumps(extra))
        if config_from is not None:
            (generation / name / HF_FILES).mkdir()
            copy_base_model_assets(Path(config_from), generation / name / HF_FILES)
    for file_name, data in files.items():
        write_file_durably(generation / RECOVER_INFO / file_name, data)
    header = dump_header(step_info.to_dict(), sorted(sources))
    return {**header, "world_size": world_size, "imported_from": IMPORTED_FROM}


def _moves(store: RecoverStore, found: list[Path]) -> dict[Path, Path]:
    """Where each of AReaL's folders ``found`` goes under ``{trial}/areal_original/``; read-only.
    CheckpointError naming the path when a folder on the way is a link (nothing is moved
    through a link this import did not create) or not a folder, or the place is taken."""
    originals = store.trial / ORIGINALS
    moves = {}
    for path in found:
        relative = path.relative_to(store.trial)  # recover_info, or {name}/recover_checkpoint
        target = originals / relative
        for folder in [originals, *(originals / parent for parent in reversed(relative.parents[:-1]))]:
            if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
                raise CheckpointError(
                    f"{folder}: is a link or a file, not a folder this import made; AReaL's folders are not "
                    "moved through it. Move it away and run the import again"
                )
        if target.exists() or target.is_symlink():
            raise CheckpointError(f"{target}: already exists; move it away and run the import again")
        moves[path] = target
    return moves


def _already_ours(store: RecoverStore, generation: str, header: dict[str, Any], remove_original: bool) -> ImportedTrial:
    """A re-run on a trial that holds nothing of AReaL's but its kept originals: nothing to
    import; the originals removed when asked (never through a link)."""
    originals = store.trial / ORIGINALS
    kept = originals.is_dir() and not originals.is_symlink()
    if remove_original and kept:
        shutil.rmtree(originals)
        fsync_dir(store.trial)
        kept = False
    logger.info("%s: nothing to import: it holds areal_ckpt's checkpoint %s already", store.trial, generation)
    return ImportedTrial(
        generation=store.path(generation),
        step_info=StepInfo.from_dict(header["step"]),
        models=list(header["models"]),
        world_size=int(header["world_size"]),
        originals=originals if kept else None,
        imported_now=False,
    )


def _finish(
    store: RecoverStore,
    generation: str,
    header: dict[str, Any],
    remove_original: bool,
    unpublished: list[Path] | None = None,
) -> ImportedTrial:
    """After the commit: move AReaL's folders away (or remove them), then put our links."""
    originals = store.trial / ORIGINALS
    for path, target in _moves(store, foreign_recovery_layout(store.trial)).items():
        target.parent.mkdir(parents=True, exist_ok=True)
        path.rename(target)
        fsync_dir(path.parent)
        fsync_dir(target.parent)
    models = list(header["models"])
    store.ensure_links(models)
    if remove_original and originals.exists():
        shutil.rmtree(originals)
        fsync_dir(store.trial)
    logger.info(
        "%s: imported AReaL's checkpoint after global step %d as %s",
        store.trial,
        header["step"]["global_step"],
        generation,
    )
    return ImportedTrial(
        generation=store.path(generation),
        step_info=StepInfo.from_dict(header["step"]),
        models=models,
        world_size=int(header["world_size"]),
        originals=None if remove_original or not originals.exists() else originals,
        unpublished=[path.name for path in unpublished or []],
    )
