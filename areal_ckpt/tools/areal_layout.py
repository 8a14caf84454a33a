"""Where AReaL's recovery checkpoint lies in a trial, in either of AReaL's two layouts.

AReaL's SPMD trainers overwrite ``{trial}/recover_info/`` and ``{trial}/{engine}/recover_checkpoint/``
in place. Its single-controller trainers (AReaL PR #1616) write each dump into a fresh folder
``{trial}/checkpoint_generations/generation_step%08d/`` (``manifest/`` holding what
``recover_info/`` held, ``payloads/{engine}/`` what ``recover_checkpoint/`` held) and publish it
by replacing ``{trial}/LATEST``, a small JSON record (``format_version`` 1, ``generation``,
``global_step``, ``engines``). AReaL reads LATEST's generation when LATEST exists and the old
folders only when it does not; so does :func:`areal_checkpoint`. Read-only.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import read_regular_file
from areal_ckpt.paths import RECOVER_CHECKPOINT, check_model_name, recover_info_link
from areal_ckpt.storage.foreign import AREAL_GENERATION_LAYOUT

logger = logging.getLogger(__name__)

LATEST, GENERATIONS = AREAL_GENERATION_LAYOUT
MANIFEST, PAYLOADS = "manifest", "payloads"
LATEST_FORMAT = 1
#: LATEST is a few lines of JSON; anything much larger is not AReaL's record.
LATEST_LIMIT = 64 * 1024
_GENERATION = re.compile(r"generation_step(\d{8,})")


@dataclass(frozen=True)
class AReaLCheckpoint:
    """AReaL's checkpoint to import: the folder holding its ``step_info.json`` and the rest of
    its recover info, one stock DCP folder per engine, and (generation layout) the step LATEST
    records and the generations LATEST does not name that are newer than it (unpublished)."""

    info: Path
    payloads: dict[str, Path]
    published_step: int | None = None
    unpublished: list[Path] = field(default_factory=list)


def areal_checkpoint(trial: Path, found: list[Path]) -> AReaLCheckpoint:
    """The checkpoint AReaL would resume ``trial`` from, given what
    :func:`~areal_ckpt.storage.foreign.foreign_recovery_layout` ``found`` there: LATEST's
    generation when there is a LATEST, else the old in-place folders (as AReaL chooses). Read-only;
    raises CheckpointError naming the file and cause when LATEST is malformed, names a generation
    or engine folder that is missing or is a link, when only unpublished generations are there, or
    when the old layout is incomplete."""
    latest = trial / LATEST
    if latest.exists() or latest.is_symlink():
        return _published_generation(trial, latest)
    info = recover_info_link(trial)
    engines = sorted(path.parent.name for path in found if path.name == RECOVER_CHECKPOINT)
    if info not in found and trial / GENERATIONS in found:
        raise CheckpointError(
            f"{trial / GENERATIONS}: AReaL never published any of these generations ({latest} is missing), so "
            f"there is nothing to import and AReaL would not resume from them either; to start afresh, move it "
            f"away (e.g. mv {trial / GENERATIONS} {trial / GENERATIONS}.unpublished)"
        )
    if info not in found:
        raise CheckpointError(f"{info}: missing; {trial} holds no recovery checkpoint written by AReaL")
    if not engines:
        raise CheckpointError(f"{trial}: holds AReaL's recover_info/ but no {{name}}/{RECOVER_CHECKPOINT}/")
    return AReaLCheckpoint(info, {name: trial / name / RECOVER_CHECKPOINT for name in engines})


def _published_generation(trial: Path, latest: Path) -> AReaLCheckpoint:
    record = _read_latest(latest)
    generation = trial / GENERATIONS / record["generation"]
    for folder in (trial / GENERATIONS, generation, generation / MANIFEST, generation / PAYLOADS):
        _check_folder(folder, latest)
    payloads = {name: generation / PAYLOADS / name for name in record["engines"]}
    for folder in payloads.values():
        _check_folder(folder, latest)
    step = record["global_step"]
    return AReaLCheckpoint(generation / MANIFEST, payloads, step, _newer_generations(trial / GENERATIONS, step))


def _read_latest(latest: Path) -> dict[str, Any]:
    """LATEST's record, checked as AReaL checks it (plus engine names we can keep a model under)."""
    if latest.is_symlink():
        raise CheckpointError(f"{latest}: is a link; AReaL publishes LATEST as a file, and the import reads no link")
    try:
        record = json.loads(read_regular_file(latest, LATEST_LIMIT))
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{latest}: AReaL's checkpoint pointer is unreadable: {error}") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{latest}: AReaL's checkpoint pointer is not a JSON object")
    missing = [key for key in ("format_version", "generation", "global_step", "engines") if key not in record]
    if missing:
        raise CheckpointError(f"{latest}: AReaL's checkpoint pointer lacks {', '.join(missing)}")
    version, step, generation, engines = (record[k] for k in ("format_version", "global_step", "generation", "engines"))
    if type(version) is not int or version != LATEST_FORMAT:
        raise CheckpointError(f"{latest}: format_version {version!r}; this import reads format {LATEST_FORMAT}")
    if type(step) is not int or not 0 <= step < 1 << 63:
        shown = repr(step) if len(repr(step)) <= 40 else f"{repr(step)[:40]}... ({len(repr(step))} characters)"
        raise CheckpointError(
            f"{latest}: global_step {shown} is not a step (an integer from 0 to 2**63 - 1); nothing was imported: "
            "restore the LATEST AReaL wrote"
        )
    if generation != f"generation_step{step:08d}":
        raise CheckpointError(f"{latest}: generation {generation!r} does not match global_step {step}")
    if not isinstance(engines, list) or not engines or not all(isinstance(name, str) for name in engines):
        raise CheckpointError(f"{latest}: engines {str(engines)[:100]} is not a non-empty list of names")
    if len(set(engines)) != len(engines):
        raise CheckpointError(f"{latest}: engines {engines} names one engine twice")
    for name in engines:
        try:
            check_model_name(name)
        except ValueError as error:
            raise CheckpointError(f"{latest}: engine {name!r}: {error}") from None
    return record


def _check_folder(folder: Path, latest: Path) -> None:
    try:
        if folder.is_symlink():
            raise CheckpointError(f"{folder}: is a link; the import reads AReaL's folders only where AReaL writes them")
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: missing (named by {latest}); nothing was imported")
    except OSError as error:  # a name the file system cannot hold (too long), a folder it cannot read
        raise CheckpointError(
            f"{latest}: names {folder.name[:60]!r}, which cannot be looked up ({error.strerror}); nothing was imported"
        ) from None


def _newer_generations(root: Path, published: int) -> list[Path]:
    """The generation folders in ``root`` newer than the published step: dumps AReaL started
    and never published (cut short), which AReaL does not resume from either; logged."""
    newer = []
    for entry in sorted(root.iterdir()):
        match = _GENERATION.fullmatch(entry.name)
        if match is not None and int(match.group(1)) > published:
            newer.append(entry)
    for entry in newer:
        logger.warning(
            "%s: newer than the generation LATEST names (step %d) but never published (a dump cut short); "
            "not imported, left as it is",
            entry,
            published,
        )
    return newer
