"""On-disk store of recovery generations with a single atomic switch.

Layout (see :mod:`areal_ckpt.paths`)::

    {trial}/.recover/gen-<step>-<token>/{name}/...          one folder per model (DCP shards)
    {trial}/.recover/gen-<step>-<token>/recover_info/...    step counters, states, manifest
    {trial}/.recover/current -> gen-<step>-<token>          the commit record
    {trial}/recover_info -> .recover/current/recover_info    fixed convenience links
    {trial}/{name}/recover_checkpoint -> ../.recover/current/{name}

A dump writes a new generation beside the committed one, fsyncs it, writes its manifest, then
renames a new ``current`` symlink over the old one: the only step that changes what a reader
sees, and it is atomic. Only then are older generations deleted. A crash at any instant leaves
``current`` on a complete generation; anything else in the store is debris that the next start
removes. Every method here is local; in a job, rank 0 alone calls the ones that change the store.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError, TransientError
from areal_ckpt.fsio import FileRecord, make_dirs
from areal_ckpt.generations.tidy import sweep_trash_later, wait_for_deletions
from areal_ckpt.paths import (
    RECOVER_CURRENT,
    RECOVER_INFO,
    RECOVER_MANIFEST,
    RECOVER_STORE,
    generation_name,
    is_generation_name,
    recover_pointer,
    recover_store,
)
from areal_ckpt.publish import check_files, read_manifest, write_manifest
from areal_ckpt.storage.foreign import refuse_foreign_layout
from areal_ckpt.storage.in_place import (
    after_commit,
    check_store_folder,
    clear_strays,
    commit_in_place,
    committed_in_place,
    generation_folders,
    is_complete,
    place_fixed_links,
    superseded_in_place,
)
from areal_ckpt.storage.location import recovery_location_of
from areal_ckpt.storage.mirrors import Identity, claim_tier
from areal_ckpt.storage.pointers import PointerLink
from areal_ckpt.storage.retention import Committed

logger = logging.getLogger(__name__)

#: In a tiered trial's local tier, the persistent tier it belonged to as an older version recorded
#: it (read once by :meth:`RecoverStore.claim_local_tier`, which records the full identity now).
PERSISTS_AT = ".persists-at"


class RecoverStore:
    """The recovery generations of one trial."""

    def __init__(self, trial: Path, links_previous_data: bool = True) -> None:
        self.trial = trial
        self.root = recover_store(trial)
        self.pointer = recover_pointer(trial)
        #: The commit record: the link ``current``, switched by each commit.
        self.current = PointerLink(RECOVER_CURRENT)
        #: The store as a folder location: generations written in place, committed by switching
        #: ``current``, superseded ones hidden as ``.trash-{name}`` while deleted.
        self.location = recovery_location_of(trial)
        #: True when this store holds every data file of its previous generation on every node,
        #: so an unchanged part can be hard-linked from it: a plain local trial. A staging copy
        #: holds none (they go to the bucket from memory), a node's local tier only its own
        #: ranks'. Set by :func:`~areal_ckpt.recover.location.trial_location`.
        self.links_previous_data = links_previous_data

    def claim_local_tier(self, persists_at: Identity, legacy: str) -> None:
        """A tiered trial's local tier, every rank: CheckpointError naming both locations when it
        mirrors another location than ``persists_at`` (the same ``local_dir`` and trial names
        under another fileroot or endpoint), else record ``persists_at`` in it
        (:func:`~areal_ckpt.storage.mirrors.claim_tier`; ``legacy``: the text an older version
        recorded in ``.recover/.persists-at``, accepted once), and make its store folder. Local;
        durable on return."""
        self.check_root()
        claim_tier(self.trial, persists_at, (self.root / PERSISTS_AT, legacy))
        try:
            make_dirs(self.root)  # the store, where the ranks of a node learn they share it
        except OSError as error:
            raise CheckpointError(f"{self.root}: cannot create the local tier's store: {error}") from None

    def committed(self) -> str | None:
        """Name of the committed generation, None when the trial has none.

        Raises CheckpointError (never a silent None) when the store is not a real folder (a
        regular file, a link), or its commit record is broken or missing beside complete
        generations (:func:`~areal_ckpt.storage.in_place.committed_in_place`). Read-only.
        """
        return committed_in_place(self.root, self.current, RECOVER_MANIFEST)

    def check_root(self) -> None:
        """Raise CheckpointError unless the store is absent or a real folder
        (:func:`~areal_ckpt.storage.in_place.check_store_folder`)."""
        check_store_folder(self.root)

    def generations(self) -> list[str]:
        """Generation folders in the store, oldest step first (committed or not); read-only."""
        return generation_folders(self.root)

    def complete_generations(self) -> list[str]:
        """Generations holding a readable manifest, oldest step first; read-only."""
        return [name for name in self.generations() if is_complete(self.root, name, RECOVER_MANIFEST)]

    def path(self, generation: str) -> Path:
        """Folder of ``generation`` (no side effects)."""
        return self.root / generation

    def create(self, global_step: int, model_names: list[str]) -> str:
        """Create an empty generation folder with one sub-folder per model; returns its name.

        Not durable by itself: :meth:`commit` makes the folder durable before pointing to it.
        """
        name = generation_name(global_step, secrets.token_hex(4))
        folder = self.path(name)
        make_dirs(self.root)  # the store itself, durably; the generation is made durable by the commit
        for sub in [RECOVER_INFO, *model_names]:
            (folder / sub).mkdir(parents=True)
        return name

    def begin(self, global_step: int, names: list[str], loaded: str | None, first: bool) -> str:
        """Rank 0 at the start of a dump: the new generation's name. Local. Raises
        CheckpointError (a refusal) when a committed generation exists that this job did not
        load or write (``loaded``), or the store is broken, or (``first`` dump of the job) the
        trial holds AReaL's own folders; TransientError (retried by the dump) on an OS error.
        On a first dump the debris of earlier jobs is removed before the new generation is
        created."""
        if first:
            refuse_foreign_layout(self.trial)
        committed = self.committed()
        if committed is not None and committed != loaded:
            raise CheckpointError(
                f"{self.path(committed)} is a recovery checkpoint this job has not loaded; "
                "call RecoverHandler.load() first (or use another trial_name) so it is not overwritten"
            )
        try:
            if first:  # later dumps: each commit hides what it superseded, the ranks delete it
                self.remove_debris(keep=committed)
            else:
                sweep_trash_later(self.root)  # after this process's own deletions, off the dump's path
            return self.create(global_step, names)
        except OSError as error:
            raise TransientError(f"{self.root}: cannot create a generation folder: {error}") from error

    def check_model(self, source: str, model: str, share: int, shares: int) -> list[str]:
        """Before ``model``'s files in generation ``source`` are linked into a new one: the
        problems (missing, a link, size, CRC-32, all read) of the ``share``-th of ``shares``
        slices of them (each rank checks its own slice), one line each naming the file; empty
        when intact. Local, read-only, blocking."""
        files = read_manifest(self.path(source), RECOVER_MANIFEST)["files"]
        names = sorted(name for name in files if name.startswith(f"{model}/"))[share::shares]
        return check_files(self.path(source), files, names)

    def link_model(self, source: str, target: str, model: str) -> dict[str, FileRecord]:
        """Hard-link ``model``'s files from generation ``source`` into ``target`` (unchanged model).

        Returns their manifest records, taken from ``source``'s manifest (no data is read).
        """
        files = read_manifest(self.path(source), RECOVER_MANIFEST)["files"]
        records = {}
        prefix = f"{model}/"
        for relative, entry in files.items():
            if relative.startswith(prefix):
                (self.path(target) / relative).parent.mkdir(parents=True, exist_ok=True)
                os.link(self.path(source) / relative, self.path(target) / relative)
                records[relative] = FileRecord(entry["size"], entry["crc32"])
        if not records:
            raise CheckpointError(f"{self.path(source)}: holds no files for model {model!r}")
        return records

    def commit(
        self,
        generation: str,
        records: dict[str, FileRecord],
        header: dict[str, Any],
        models: list[str],
        protected: tuple[str, ...] = (),
    ) -> list[str]:
        """Write the manifest and switch ``current`` to ``generation``
        (:func:`~areal_ckpt.storage.in_place.commit_in_place`), then place the trial's links and
        hide the generations it supersedes (one rename each); returns their hidden names. Durable
        on return; until the switch the previous generation stays committed. The hidden folders
        are deleted by every rank in parallel (:mod:`areal_ckpt.generations.tidy`: each its own
        files, then rank 0 the rest). The generations ``protected`` names (a tiered trial's
        uploads in flight or queued) are kept."""
        commit_in_place(
            self.root,
            self.current,
            generation,
            lambda: write_manifest(self.path(generation), RECOVER_MANIFEST, records, header),
        )
        hidden = after_commit(self.root, generation, RECOVER_MANIFEST, models, self._hide, protected)
        return [trash.name for trash in hidden]

    def ensure_links(self, models: list[str]) -> None:
        """:func:`~areal_ckpt.storage.in_place.place_fixed_links` of this trial. Local; durable."""
        place_fixed_links(self.trial, models)

    def _hide(self, names: list[str]) -> list[Path]:
        """Each generation ``names`` hidden under its trash name; returns the trash folders."""
        return self.location.remove([Committed(name, -1, 0) for name in names])

    def remove_debris(self, keep: str | None, wait: bool = True) -> list[str]:
        """Remove the generations ``keep`` supersedes
        (:func:`~areal_ckpt.storage.in_place.superseded_in_place`) and stray
        pointer links; returns the generations removed. Each is hidden at once (one durable
        rename); it and the hidden ones earlier commits left are deleted on this process's
        deletion thread, before this returns with ``wait``, else while the caller goes on
        (a load reads meanwhile; :func:`~areal_ckpt.generations.tidy.wait_for_deletions` waits for
        it; a crash leaves them hidden for the next call). Rank 0 only, while no rank writes
        (this process's own deletions are waited for first)."""
        wait_for_deletions()
        if not self.root.is_dir() or self.root.is_symlink():
            return []
        removed = superseded_in_place(self.root, keep, RECOVER_MANIFEST)
        self._hide(removed)
        clear_strays(self.root, self.current, keep)
        sweep_trash_later(self.root)
        if wait:
            wait_for_deletions()
        return removed

    def discard(self, generation: str) -> None:
        """Delete an uncommitted generation after a failed dump (best effort)."""
        shutil.rmtree(self.path(generation), ignore_errors=True)


def find_committed(store: RecoverStore) -> str | None:
    """Rank 0 at start: the committed generation (None if none) once the debris of interrupted
    dumps is hidden; it is deleted while the load reads (:meth:`RecoverStore.remove_debris`,
    which the load waits for before it returns). Local. Raises CheckpointError, deleting
    nothing, when the commit record is broken or the trial holds AReaL's own recovery folders."""
    refuse_foreign_layout(store.trial)
    committed = store.committed()
    removed = store.remove_debris(keep=committed, wait=False)
    if removed and committed is None:
        logger.warning("removed recovery generations never committed (the trial has no commit): %s", removed)
    elif removed:
        logger.warning(
            "removed recovery generations older than the committed %s or never committed: %s", committed, removed
        )
    return committed


def resolve_recovery(path: Path) -> tuple[Path, str | None]:
    """The generation folder behind ``path`` and the model folder it names, if any.

    ``path`` may be a trial folder, its ``.recover`` store, a generation, ``recover_info`` or a
    ``{name}/recover_checkpoint`` link. Raises CheckpointError when it is none of these.
    """
    path = Path(path)
    for candidate in (path, path / RECOVER_STORE):
        pointer = candidate / RECOVER_CURRENT if candidate.name == RECOVER_STORE else recover_pointer(candidate)
        if pointer.is_symlink():
            return (pointer.parent / pointer.readlink()).resolve(), None
    resolved = path.resolve()
    if is_generation_name(resolved.name):
        return resolved, None
    if is_generation_name(resolved.parent.name):
        return resolved.parent, None if resolved.name == RECOVER_INFO else resolved.name
    raise CheckpointError(f"{path}: not a recovery checkpoint (no .recover/current, generation or recover_info)")
