"""Deleting what a recovery commit superseded, off the dump's path.

A commit hides each generation it supersedes (one rename to ``.trash-gen-...``); then every rank
deletes its own files there (its data file per model, its ``rank{r}.json``), so no rank deletes
O(world size) files, and rank 0 sweeps up the rest (a few global files). Both run on one helper
thread per process, after the dump returned: unlinking a large file is not free (~0.3 s for a
fresh 450 MB file here). At most one rank-file deletion runs per process: the next one waits for
it. Nothing is deleted through a link. All functions are local.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from areal_ckpt.paths import RECOVER_INFO, RECOVER_TRASH_PREFIX, data_file_of, rank_state_file
from areal_ckpt.publish import TrashCollector
from areal_ckpt.storage.folder_location import FolderLocation
from areal_ckpt.storage.retention import Committed

logger = logging.getLogger(__name__)

#: This process's deletions of superseded recovery files, in the order queued.
_DELETIONS = TrashCollector()


def wait_for_deletions() -> None:
    """Block until this process's queued deletions of superseded files have finished."""
    _DELETIONS.wait()


def delete_later(
    root: Path, generations: list[str], rank: int, models: list[str], remove_folders: bool = False
) -> None:
    """Queue :func:`delete_rank_files` of ``generations`` in the store ``root`` (then, with
    ``remove_folders``, :func:`remove_empty_folders` of each) on this process's deletion thread;
    what it deletes was superseded by a commit already. Waits first for this process's previous
    deletions, so at most one runs."""
    _DELETIONS.wait()

    def delete() -> None:
        delete_rank_files(root, generations, rank, models)
        for name in generations if remove_folders else []:
            remove_empty_folders(root / name)

    _DELETIONS.run(delete)


def drop_later(root: Path, generations: list[str]) -> None:
    """Hide ``generations`` of the store ``root`` (one rename each) and delete what is hidden
    there on this process's deletion thread: for a local tier that no commit of its own tidies
    (another node's, in a tiered trial), by one rank of that node. Never through a link; a
    generation that cannot be hidden is logged and left for a later call."""
    FolderLocation(root, trash_prefix=RECOVER_TRASH_PREFIX).remove([Committed(name, -1, 0) for name in generations])
    sweep_trash_later(root)


def delete_rank_files(root: Path, hidden: list[str], rank: int, models: list[str]) -> None:
    """Delete ``rank``'s own files (its data file of each model, its rank state) from the
    generations ``hidden`` of the store ``root``; missing ones are skipped, and nothing is
    deleted under a link. Errors are logged (the folder was already superseded and
    :func:`remove_trash` takes the rest)."""
    for name in hidden:
        folder = root / name
        for sub, file_name in [(model, data_file_of(rank)) for model in models] + [
            (RECOVER_INFO, rank_state_file(rank))
        ]:
            if folder.is_symlink() or (folder / sub).is_symlink():
                continue
            try:
                (folder / sub / file_name).unlink(missing_ok=True)
            except OSError as error:
                logger.warning("could not delete %s: %s (it is removed later)", folder / sub / file_name, error)


def remove_empty_folders(folder: Path) -> None:
    """Remove the generation ``folder`` and the folders in it, where empty (what is left on a
    node whose ranks deleted their own files); never through a link. Errors ignored (a folder
    still holding another rank's files stays)."""
    if folder.is_symlink() or not folder.is_dir():
        return
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink():
            try:
                path.rmdir()
            except OSError:
                pass
    try:
        folder.rmdir()
    except OSError:
        pass


def remove_trash(root: Path) -> None:
    """Rank 0: delete the hidden generations of the store ``root`` left by earlier commits (what
    the ranks' own deletions left), once this process's own deletions finished. Errors are
    logged, never raised."""
    _DELETIONS.wait()
    _sweep_trash(root)


def sweep_trash_later(root: Path) -> None:
    """Rank 0: queue :func:`remove_trash`'s sweep after this process's own deletions."""
    _DELETIONS.run(lambda: _sweep_trash(root))


def _sweep_trash(root: Path) -> None:
    if not root.is_dir() or root.is_symlink():
        return
    for entry in root.iterdir():
        if not entry.name.startswith(RECOVER_TRASH_PREFIX):
            continue
        if entry.is_symlink():
            entry.unlink()
        else:  # another rank may still be deleting its own files in it
            shutil.rmtree(entry, ignore_errors=True)
            if entry.exists():
                logger.warning("could not delete %s entirely (it is removed later)", entry)
