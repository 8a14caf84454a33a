"""A trial that holds AReaL's own recovery folders is never taken for a fresh one.

AReaL keeps its recovery checkpoint in real folders where ours are links (``recover_info/``,
``{name}/recover_checkpoint/``), or, in its newer layout, under a ``LATEST`` pointer; a job of
ours that saw such a trial as empty would start afresh beside the user's checkpoint. These
read-only checks find them, for a load or a first dump to refuse with the way out
(``areal-ckpt import-areal`` converts either layout).
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_ckpt.errors import CheckpointError
from areal_ckpt.paths import RECOVER_CHECKPOINT, recover_info_link

#: The entries of AReaL's newer crash-safe layout (a ``LATEST`` pointer over generation folders).
AREAL_GENERATION_LAYOUT = ("LATEST", "checkpoint_generations")


def foreign_recovery_layout(trial: Path) -> list[Path]:
    """AReaL's own recovery folders in ``trial``: a real ``recover_info/`` folder or a real
    ``{name}/recover_checkpoint/`` folder where ours are links, or the entries of AReaL's
    newer layout (:data:`AREAL_GENERATION_LAYOUT`). Read-only; [] when none."""
    found = [trial / name for name in AREAL_GENERATION_LAYOUT if os.path.lexists(trial / name)]
    info = recover_info_link(trial)
    if info.exists() and not info.is_symlink():
        found.append(info)
    if trial.is_dir():
        for model in sorted(trial.iterdir()):
            if model.name.startswith(".") or not model.is_dir() or model.is_symlink():
                continue
            checkpoint = model / RECOVER_CHECKPOINT
            if checkpoint.exists() and not checkpoint.is_symlink():
                found.append(checkpoint)
    return found


def refuse_foreign_layout(trial: Path) -> None:
    """Raise CheckpointError, saying how to proceed, when :func:`foreign_recovery_layout` finds
    anything in ``trial``; read-only."""
    found = foreign_recovery_layout(trial)
    if not found:
        return
    names = ", ".join(str(path.relative_to(trial)) for path in found)
    layout = " in AReaL's generation layout" if any(path.name in AREAL_GENERATION_LAYOUT for path in found) else ""
    checkpoints = [path for path in found if path.name == RECOVER_CHECKPOINT]
    salvage = (  # in the generation layout the checkpoint is the one LATEST names: the import reads it
        f"; its weights export to an HF folder with `areal-ckpt export {checkpoints[0]} OUT --config-from BASE_MODEL`"
        if checkpoints and not layout
        else ""
    )
    raise CheckpointError(
        f"{trial}: holds a recovery checkpoint written by AReaL{layout} ({names}); areal_ckpt does "
        f"not resume from it as it is and leaves it untouched. To resume from AReaL's step, convert it "
        f"in place with `areal-ckpt import-areal {trial}`, then start the job again; to start "
        f"afresh, move that trial folder away (e.g. mv {trial} {trial}.areal) or use another "
        f"trial_name{salvage}"
    )
