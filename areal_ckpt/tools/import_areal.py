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
import io
import logging
import math
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from areal_ckpt.errors import CheckpointError
from areal_ckpt.export.saver import saver_state
from areal_ckpt.formats.dcp_io import failures_text, interruption_in
from areal_ckpt.formats.dcp_metadata import tensor_entry
from areal_ckpt.formats.dcp_save import save_tensors
from areal_ckpt.formats.hf_export import copy_base_model_assets
from areal_ckpt.formats.stock_dcp import SafeFileSystemReader, check_sizes, read_stock_metadata
from areal_ckpt.fsio import fsync_dir, open_regular_file, read_json_file, write_file_durably
from areal_ckpt.lock import acquire_trial_lock, release_trial_lock
from areal_ckpt.paths import (
    ENGINE_STATE_FILE,
    GLOBAL_FILES,
    HF_FILES,
    RECOVER_INFO,
    RECOVER_MANIFEST,
    STEP_FILE,
    rank_state_file,
    recover_checkpoint_link,
    recover_info_link,
)
from areal_ckpt.publish import check_files, read_manifest, switch_symlink, write_manifest
from areal_ckpt.recover.foreign import foreign_recovery_layout
from areal_ckpt.recover.repoint import missing_parts
from areal_ckpt.recover.store import RecoverStore
from areal_ckpt.recover.write import dump_header
from areal_ckpt.schedule import schedule_state
from areal_ckpt.state import safe_json
from areal_ckpt.state.plain_pickle import load_plain_pickle
from areal_ckpt.step import StepInfo
from areal_ckpt.tools.areal_layout import areal_checkpoint

logger = logging.getLogger(__name__)

#: Where AReaL's own folders are kept after an import commits.
ORIGINALS = "areal_original"
DATALOADER_PICKLE = "dataloader_info.pkl"
IMPORTED_FROM = "areal"
_MODEL, _STATE, _GROUPS = "dcp.model.", "dcp.optim.state.", "dcp.optim.param_groups."


@dataclass(frozen=True)
class ImportedTrial:
    """What :func:`import_areal_trial` made: the committed generation, the step it resumes
    after, its models, the number of ranks AReaL ran with, where the originals went, and the
    names of AReaL's generations newer than its LATEST that were never published (not imported;
    kept with the originals unless those were removed)."""

    generation: Path
    step_info: StepInfo
    models: list[str]
    world_size: int
    originals: Path | None
    unpublished: list[str] = field(default_factory=list)


def import_areal_trial(trial: Path, config_from: Path | None = None, remove_original: bool = False) -> ImportedTrial:
    """Convert the AReaL trial ``trial`` into our layout in place; durable and atomic.

    ``config_from`` (an HF folder, e.g. the base model) supplies each model's ``hf/`` files, so
    that ``areal-ckpt export`` needs no ``--config-from`` later. Local: one process, holding the
    trial's lock. Raises CheckpointError naming the file and cause when the trial is not an
    AReaL trial, already ours, or holds anything refused; the trial is then left as it was.
    Run again on a trial whose import was committed but interrupted (its originals or links
    not all in place yet) it finishes that import; on one that has trained on since, it
    refuses (nothing to import).
    """
    trial = Path(trial)
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
            raise CheckpointError(
                f"{store.path(committed)}: the trial already holds areal_ckpt's recovery "
                "checkpoints; there is nothing to import"
            )
        source = areal_checkpoint(store.trial, found)
        _moves(store, found)  # where AReaL's folders go is checked before anything is written
        step_info, files, world_size = _read_recover_info(source.info, sorted(source.payloads))
        if source.published_step is not None and source.published_step != step_info.global_step:
            raise CheckpointError(
                f"{source.info / STEP_FILE}: global step {step_info.global_step}, but AReaL's LATEST names step "
                f"{source.published_step}; nothing was imported"
            )
        sources = source.payloads
        for folder in sources.values():  # every check that needs no tensor, before anything is written
            _stored_tensors(folder)
        store.remove_debris(keep=None)
        generation = store.create(step_info.global_step, sorted(sources))
        try:
            header = _write(store.path(generation), step_info, files, sources, config_from, world_size)
            write_manifest(store.path(generation), RECOVER_MANIFEST, {}, header)  # checksums every file
            fsync_dir(store.root)
            switch_symlink(store.pointer, generation)  # the commit
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
        switch_symlink(store.pointer, name)
        logger.info("%s: committed %s, which an interrupted import had written", store.trial, name)
        return name
    raise lost


def _unfinished(store: RecoverStore, header: dict[str, Any], found: list[Path]) -> bool:
    """True when a committed import still has AReaL's folders in place or misses a link."""
    links = [recover_info_link(store.trial), *(recover_checkpoint_link(store.trial, m) for m in header["models"])]
    return bool(found) or not all(link.is_symlink() for link in links)


def _schedule(areal: Any, path: Path) -> dict[str, Any] | None:
    """Our trigger state from the state of AReaL's ``EpochStepTimeFreqCtl`` (epochs and steps
    since each trigger fired; the time since the time trigger did, counted up to now); None,
    logged, when it has another shape or a count or time that is not finite (the triggers then
    count afresh)."""
    try:
        last_time = float(areal["time"]["last_time"])
        if not math.isfinite(last_time):
            raise ValueError(f"last_time {last_time}")
        return schedule_state(
            int(areal["epoch"]["steps"] - areal["epoch"]["last_steps"]),
            int(areal["step"]["steps"] - areal["step"]["last_steps"]),
            max(0.0, time.time() - last_time),
        )
    except (KeyError, TypeError, ValueError, OverflowError):  # int() of an infinite count overflows
        logger.warning("%s: not AReaL's trigger state; those triggers count afresh", path)
        return None


def _read_recover_info(folder: Path, models: list[str]) -> tuple[StepInfo, dict[str, bytes], int]:
    """AReaL's recover_info: its step, our recover_info files (name -> content) and the number
    of ranks whose dataloader positions it holds."""
    _, raw_step = read_json_file(folder / STEP_FILE, "AReaL step info")
    try:
        step_info = StepInfo.from_dict(raw_step)
        step_info.check_completed()
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{folder / STEP_FILE}: invalid step info: {error}") from None
    files = {STEP_FILE: safe_json.dumps(step_info.to_dict())}
    for key, name in GLOBAL_FILES.items():
        path = folder / name
        value = read_json_file(path, f"AReaL {key}")[1] if path.is_file() else None
        if key == "checkpoint_info" and value is not None:
            value = _schedule(value, path)
        elif key == "saver_info" and value is not None:
            schedule = _schedule(value, path)
            value = None if schedule is None else saver_state(dict.fromkeys(models, schedule))
        files[name] = safe_json.dumps(value)
    positions = load_plain_pickle(folder / DATALOADER_PICKLE)
    per_rank = positions if isinstance(positions, list) else [positions]
    if not per_rank:
        raise CheckpointError(f"{folder / DATALOADER_PICKLE}: an empty list of dataloader positions")
    for rank, position in enumerate(per_rank):
        try:
            files[rank_state_file(rank)] = safe_json.dumps({"dataloader": position, "rng": None, "client_state": {}})
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{folder / DATALOADER_PICKLE}: rank {rank}'s position: {error}") from None
    return step_info, files, len(per_rank)


@dataclass
class _ModelState:
    tensors: dict[str, torch.Tensor]
    param_groups: list[dict[str, Any]]
    scalars: dict[str, dict[str, Any]]


def _stored_tensors(folder: Path) -> tuple[Metadata, dict[str, str]]:
    """``folder``'s metadata and its tensors' stored keys -> our names, once the metadata is
    read safely, the layout is an AReaL engine's and every record lies inside its file."""
    metadata = read_stock_metadata(folder)
    keys = [key for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)]
    names = {key: _our_name(key, folder) for key in keys}
    if not any(name.startswith("model.") for name in names.values()):
        raise CheckpointError(f"{folder}: holds no model tensors under {_MODEL!r} (an AReaL FSDP engine's layout)")
    check_sizes(metadata, folder, keys)  # before anything is allocated from the metadata
    return metadata, names


def _read_model(folder: Path) -> _ModelState:
    """One model's whole state from AReaL's stock DCP folder, under our flat names."""
    metadata, names = _stored_tensors(folder)
    entries = metadata.state_dict_metadata
    template = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in ((key, tensor_entry(metadata, key, folder)) for key in names)
    }
    extras = {
        key: _read_value(metadata, key, folder)
        for key, entry in entries.items()
        if isinstance(entry, BytesStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP's notice that it runs in one process, as intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.load(template, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
        except CheckpointException as error:  # a BaseException in DCP: make it an ordinary error
            interruption = interruption_in(error)
            if interruption is not None:
                raise interruption from None
            raise CheckpointError(f"{folder}: reading AReaL's tensors failed: {failures_text(error)}") from None
    tensors = {names[key]: tensor for key, tensor in template.items()}
    groups: dict[int, dict[str, Any]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for key, value in extras.items():
        if key.startswith(_GROUPS):
            index, _, field = key[len(_GROUPS) :].partition(".")
            if not index.isdigit() or not field:
                raise CheckpointError(f"{folder}: unexpected param group entry {key!r}")
            groups.setdefault(int(index), {})[field] = value
        elif key.startswith(_STATE):
            fqn, _, field = key[len(_STATE) :].rpartition(".")
            scalars.setdefault(fqn, {})[field] = value
        else:
            raise CheckpointError(f"{folder}: unexpected non-tensor entry {key!r}")
    for fqn in {name[len("optim.") :].rpartition(".")[0] for name in tensors if name.startswith("optim.")}:
        scalars.setdefault(fqn, {})
    return _ModelState(tensors, [groups[index] for index in sorted(groups)], scalars)


def _our_name(key: str, folder: Path) -> str:
    if key.startswith(_MODEL):
        return "model." + key[len(_MODEL) :]
    if key.startswith(_STATE):
        return "optim." + key[len(_STATE) :]
    raise CheckpointError(f"{folder}: tensor {key!r} is neither under {_MODEL!r} nor {_STATE!r}")


def _read_value(metadata: Metadata, key: str, folder: Path) -> Any:
    """A non-tensor entry (a param group field), read through ``torch.load(weights_only=True)``."""
    info = metadata.storage_data.get(MetadataIndex(key))
    if info is None or not isinstance(getattr(info, "relative_path", None), str):
        raise CheckpointError(f"{folder}: no storage record for {key!r}")
    path = folder / info.relative_path
    if path.resolve().parent != folder.resolve() or info.length > (1 << 20):
        raise CheckpointError(f"{folder}: refused the record of {key!r} ({info.relative_path}, {info.length} bytes)")
    try:
        with open_regular_file(path) as stream:
            stream.seek(info.offset)
            data = stream.read(info.length)
        return torch.load(io.BytesIO(data), weights_only=True)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read {key!r}: {error.strerror}") from None
    except Exception as error:  # torch's weights-only unpickler refuses with several types
        raise CheckpointError(f"{path}: refused {key!r}: {error}; nothing in it was run") from None


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
        state = _read_model(source)
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
