"""The commit of a folder location whose checkpoints are written in place: a trial's recovery
store (``{trial}/.recover``), where each dump is a generation folder beside the committed one and
the link ``current`` is the commit (:class:`~areal_ckpt.storage.folder_location.FolderLocation`
with ``pointer_commits``, whether the generation was written here or copied in from a node's
local tier).

The sequence: the generation's files are durable, then its manifest, then ``current`` is switched
to it (atomic, durable); a trial's first commit is bracketed by a pending marker, so a power cut
between its manifest and the switch leaves a generation known never to have been committed.
After the switch the trial's fixed links (``recover_info``, each model's ``recover_checkpoint``)
name ``current``, and what the commit superseded is hidden for deletion. Every function is local
and blocking; nothing here writes or deletes through a link it did not make.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import fsync_dir, make_dirs, write_file_durably
from areal_ckpt.paths import (
    RECOVER_CURRENT,
    RECOVER_INFO,
    RECOVER_STORE,
    generation_step,
    is_generation_name,
    recover_checkpoint_link,
    recover_info_link,
)
from areal_ckpt.publish import read_manifest
from areal_ckpt.storage.pointers import Pointer, PointerLink
from areal_ckpt.storage.retention import Committed, KeepNewest, doomed_by

logger = logging.getLogger(__name__)

#: Beside a trial's first generation while it commits: ``.pending-{generation}``, made durable
#: before its manifest and removed after the switch (see :func:`commit_in_place`).
PENDING_PREFIX = ".pending-"

#: Model folders found to be links, already named in a warning by this process.
_LINKED_FOLDERS_NAMED: set[Path] = set()


def generation_folders(root: Path) -> list[str]:
    """The generation folders in ``root`` (real folders, committed or not), oldest step first;
    [] when ``root`` is missing or a link. Read-only."""
    if not root.is_dir() or root.is_symlink():
        return []
    names = [e.name for e in root.iterdir() if is_generation_name(e.name) and e.is_dir() and not e.is_symlink()]
    return sorted(names, key=lambda name: (generation_step(name), name))


def is_complete(root: Path, name: str, manifest: str) -> bool:
    """True when generation ``name`` holds a readable manifest (its files are not checked)."""
    try:
        read_manifest(root / name, manifest)
    except CheckpointError:
        return False
    return True


def is_pending(root: Path, name: str) -> bool:
    """True when ``name`` is a trial's first commit that a power cut stopped between its manifest
    and the switch (its pending marker is still there): never committed. Read-only."""
    return (root / f"{PENDING_PREFIX}{name}").is_file()


def check_store_folder(root: Path) -> None:
    """CheckpointError naming ``root`` and the way out unless it is absent or a real folder (a
    link there is someone else's: never written through). Read-only."""
    if root.is_symlink():
        where = os.readlink(root)
        state = "" if root.exists() else ", which does not exist (an unmounted volume?)"
        raise CheckpointError(
            f"{root}: is a symbolic link to {where}{state}; areal_ckpt keeps recovery generations only "
            "in a real folder and never writes through a link it did not create: move the link away "
            "(mv it) and put the folder itself there"
        )
    if root.exists() and not root.is_dir():
        raise CheckpointError(
            f"{root}: expected the folder of recovery generations, found a file; nothing was deleted: "
            "move it away (mv it) to start this trial fresh"
        )


def committed_in_place(root: Path, pointer: Pointer, manifest: str) -> str | None:
    """The generation ``pointer`` commits in ``root``, None when the trial has none.
    CheckpointError (never a silent None) when ``root`` is no real folder
    (:func:`check_store_folder`), when the record exists but names no generation folder here
    (dangling, tampered, pointing elsewhere), and when it is missing although complete,
    never-pending generations are there (a copy that dropped links): each with the repair to
    run. Read-only."""
    check_store_folder(root)
    trial = root.parent
    target = pointer.read(root)
    if target is None:
        complete = [n for n in generation_folders(root) if is_complete(root, n, manifest) and not is_pending(root, n)]
        if complete:
            raise CheckpointError(
                f"{root / pointer.name}: the commit record is missing, but {root} holds complete recovery "
                f"generations {complete}; nothing was deleted. Run `areal-ckpt recover-pointer {trial}` to "
                "point it at the newest one whose files all verify"
            )
        return None
    if not is_generation_name(target):
        raise CheckpointError(f"{root / pointer.name}: points to {target!r}, which is not a generation of this store")
    if not (root / target).is_dir() or (root / target).is_symlink():
        raise CheckpointError(
            f"{root / pointer.name}: committed generation {target} is missing; run `areal-ckpt recover-pointer "
            f"{trial}` to point it at the newest generation whose files all verify"
        )
    return target


def commit_in_place(root: Path, pointer: Pointer, name: str, write_manifest: Callable[[], None]) -> None:
    """Commit the generation ``name`` whose files are durable in ``root``: ``write_manifest``
    (durable), the folder's entry fsync'd, then ``pointer`` switched to it; a first commit (no
    pointer yet) is bracketed by its pending marker. Durable on return; until the switch the
    previous generation stays committed. OSError when a step fails."""
    first = pointer.read(root) is None
    marker = root / f"{PENDING_PREFIX}{name}"
    if first:  # until the switch, a complete generation without a commit record is this one, not a lost record
        write_file_durably(marker, b"")
        fsync_dir(root)
    write_manifest()
    fsync_dir(root)  # the generation's own entry, before anything points to it
    pointer.point(root, name)
    if first:
        marker.unlink(missing_ok=True)
        fsync_dir(root)


def superseded_in_place(root: Path, keep: str | None, manifest: str, protected: tuple[str, ...] = ()) -> list[str]:
    """Generations other than ``keep`` and ``protected`` that are incomplete or pending, or that
    the :class:`~areal_ckpt.storage.retention.KeepNewest` policy removes beside ``keep``. A
    complete one at or after ``keep``'s step (a dump interrupted between its manifest and the
    switch, so possibly committed after ``keep`` as far as the store can tell) is not among them,
    with a warning: a checkpoint is never deleted unless a newer committed one exists. Read-only."""
    names = [name for name in generation_folders(root) if name != keep and name not in protected]
    complete = [name for name in names if is_complete(root, name, manifest) and not is_pending(root, name)]
    # the committed one first in commit order: an uncommitted complete one of its step sorts after it
    entries = [Committed(name, generation_step(name), 1) for name in complete]
    if keep is not None:
        entries.append(Committed(keep, generation_step(keep), 0))
    doomed = {entry.name for entry in doomed_by(KeepNewest(), entries, keep or "").remove}
    for name in complete:
        if name not in doomed:
            logger.warning("%s: keeping %s: it is complete and not older than the committed %s", root, name, keep)
    return [name for name in names if name not in complete or name in doomed]


def clear_strays(root: Path, pointer: Pointer, keep: str | None) -> None:
    """Remove what interrupted commits left in ``root`` besides generations: temporary pointer
    links and the pending markers of generations committed (``keep``) or gone. Durable."""
    if not root.is_dir() or root.is_symlink():
        return
    for entry in root.iterdir():
        if entry.name.startswith(f".{pointer.name}.") and entry.is_symlink():
            entry.unlink()
        elif entry.name.startswith(PENDING_PREFIX) and not entry.is_symlink():
            pending = entry.name[len(PENDING_PREFIX) :]
            if pending == keep or not (root / pending).is_dir():  # committed after all, or removed
                entry.unlink()
    fsync_dir(root)


def place_fixed_links(trial: Path, models: list[str]) -> None:
    """Point ``{trial}/recover_info`` and each model's ``recover_checkpoint`` at the committed
    generation, replacing an older link atomically. Never through a link: a model folder that is
    a link (the user's, e.g. exports on another disk) gets no ``recover_checkpoint`` link, with a
    warning (once per process) naming where the checkpoint is; never over anything but a link
    (CheckpointError, from :class:`~areal_ckpt.storage.pointers.PointerLink`). Durable on return."""
    wanted = {recover_info_link(trial): f"{RECOVER_STORE}/{RECOVER_CURRENT}/{RECOVER_INFO}"}
    for model in models:
        wanted[recover_checkpoint_link(trial, model)] = f"../{RECOVER_STORE}/{RECOVER_CURRENT}/{model}"
    for link, target in wanted.items():
        if link.is_symlink() and os.readlink(link) == target:
            continue
        if link.parent.is_symlink():
            if link.parent not in _LINKED_FOLDERS_NAMED:
                _LINKED_FOLDERS_NAMED.add(link.parent)
                logger.warning(
                    "%s is a link (to %s) areal_ckpt did not create: no %s link is placed through it; "
                    "the model's recovery checkpoint is %s",
                    link.parent,
                    os.readlink(link.parent),
                    link.name,
                    trial / RECOVER_STORE / RECOVER_CURRENT / link.parent.name,
                )
            continue
        make_dirs(link.parent)
        PointerLink(link.name).point(link.parent, target)


def after_commit(
    root: Path,
    name: str,
    manifest: str,
    models: list[str],
    hide: Callable[[list[str]], list[Path]] | None = None,
    protected: tuple[str, ...] = (),
) -> list[Path]:
    """The housekeeping after ``name`` was committed in the recovery store ``root`` (the commit
    already holds whatever happens here, so failures are logged, not raised): the trial's fixed
    links placed for ``models``, then, with ``hide``, the generations the commit superseded (but
    ``protected``, see :func:`superseded_in_place`) handed to it; it returns their trash
    folders, returned for the caller to delete ([] without ``hide``)."""
    try:
        place_fixed_links(root.parent, models)
    except (OSError, CheckpointError) as error:
        logger.warning("%s: committed %s, but its fixed links were not placed: %s", root, name, error)
    if hide is None:
        return []
    try:
        return hide(superseded_in_place(root, name, manifest, protected))
    except OSError as error:
        logger.warning("%s: committed %s, but tidying up failed: %s", root, name, error)
        return []
