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
from areal_ckpt.fsio import FileRecord, fsync_dir, make_dirs, write_file_durably
from areal_ckpt.generations.foreign import refuse_foreign_layout
from areal_ckpt.generations.tidy import sweep_trash_later, wait_for_deletions
from areal_ckpt.paths import (
    RECOVER_CURRENT,
    RECOVER_INFO,
    RECOVER_MANIFEST,
    RECOVER_STORE,
    generation_name,
    generation_step,
    is_generation_name,
    recover_checkpoint_link,
    recover_info_link,
    recover_pointer,
    recover_store,
)
from areal_ckpt.publish import check_files, read_manifest, write_manifest
from areal_ckpt.storage.location import recovery_location_of
from areal_ckpt.storage.mirrors import Identity, claim_tier
from areal_ckpt.storage.pointers import PointerLink
from areal_ckpt.storage.retention import Committed, KeepNewest, doomed_by

logger = logging.getLogger(__name__)

#: In the store, beside a trial's first generation while it commits: ``.pending-{generation}``,
#: made durable before its manifest and removed after the switch (see :meth:`RecoverStore.commit`).
PENDING_PREFIX = ".pending-"

#: In a tiered trial's local tier, the persistent tier it belonged to as an older version recorded
#: it (read once by :meth:`RecoverStore.claim_local_tier`, which records the full identity now).
PERSISTS_AT = ".persists-at"

#: Model folders found to be links, already named in a warning by this process.
_LINKED_FOLDERS_NAMED: set[Path] = set()


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
        regular file, a link), when a commit record exists but does not name a generation
        folder of this store (dangling, tampered, pointing elsewhere), and when the record is
        missing although complete generations are there (e.g. a copy that dropped symlinks).
        Read-only.
        """
        self.check_root()
        target = self.current.read(self.root)
        if target is None:
            complete = [name for name in self.complete_generations() if not self.is_pending(name)]
            if complete:
                raise CheckpointError(
                    f"{self.pointer}: the commit record is missing, but {self.root} holds complete recovery "
                    f"generations {complete}; nothing was deleted. Run `areal-ckpt recover-pointer {self.trial}` to "
                    "point it at the newest one whose files all verify"
                )
            return None
        if not is_generation_name(target):
            raise CheckpointError(f"{self.pointer}: points to {target!r}, which is not a generation of this store")
        if not (self.root / target).is_dir() or (self.root / target).is_symlink():
            raise CheckpointError(
                f"{self.pointer}: committed generation {target} is missing; run `areal-ckpt recover-pointer "
                f"{self.trial}` to point it at the newest generation whose files all verify"
            )
        return target

    def check_root(self) -> None:
        """Raise CheckpointError unless the store is absent or a real folder."""
        if self.root.is_symlink():
            where = os.readlink(self.root)
            state = "" if self.root.exists() else ", which does not exist (an unmounted volume?)"
            raise CheckpointError(
                f"{self.root}: is a symbolic link to {where}{state}; areal_ckpt keeps recovery generations only "
                "in a real folder and never writes through a link it did not create: move the link away "
                "(mv it) and put the folder itself there"
            )
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(
                f"{self.root}: expected the folder of recovery generations, found a file; nothing was deleted: "
                "move it away (mv it) to start this trial fresh"
            )

    def generations(self) -> list[str]:
        """Generation folders in the store, oldest step first (committed or not); read-only."""
        if not self.root.is_dir() or self.root.is_symlink():
            return []
        names = [
            e.name for e in self.root.iterdir() if is_generation_name(e.name) and e.is_dir() and not e.is_symlink()
        ]
        return sorted(names, key=lambda name: (generation_step(name), name))

    def is_complete(self, generation: str) -> bool:
        """True when ``generation`` holds a readable manifest (its files are not checked); read-only."""
        try:
            read_manifest(self.path(generation), RECOVER_MANIFEST)
        except CheckpointError:
            return False
        return True

    def is_pending(self, generation: str) -> bool:
        """True when ``generation`` is a trial's first commit that a power cut stopped between its
        manifest and the switch (its pending marker is still there): never committed. Read-only."""
        return (self.root / f"{PENDING_PREFIX}{generation}").is_file()

    def complete_generations(self) -> list[str]:
        """Generations holding a readable manifest, oldest step first; read-only."""
        return [name for name in self.generations() if self.is_complete(name)]

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
        """Write the manifest, switch ``current`` to ``generation``, then hide the generations it
        supersedes (one rename each); returns their hidden names. Durable on return; until the
        switch the previous generation stays committed. A trial's first commit is bracketed by a
        pending marker, so that a power cut between its manifest and the switch leaves a
        generation known never to have been committed (a fresh start), not one that looks like
        a lost commit record (which is refused, see :meth:`committed`). The hidden folders are deleted by every
        rank in parallel (:mod:`areal_ckpt.generations.tidy`: each its own files, then rank 0 the rest).
        The generations ``protected`` names (a tiered trial's uploads in flight or queued) are kept."""
        first = not self.pointer.is_symlink()
        marker = self.root / f"{PENDING_PREFIX}{generation}"
        if first:  # until the switch, a complete generation without a commit record is this one, not a lost record
            write_file_durably(marker, b"")
            fsync_dir(self.root)
        write_manifest(self.path(generation), RECOVER_MANIFEST, records, header)
        fsync_dir(self.root)  # the generation's own entry, before anything points to it
        self.location.recommit(generation, {})
        if first:
            marker.unlink(missing_ok=True)
            fsync_dir(self.root)
        # housekeeping: the commit above already holds whatever happens from here on
        try:
            self.ensure_links(models)
        except (OSError, CheckpointError) as error:
            logger.warning("%s: committed %s, but its fixed links were not placed: %s", self.root, generation, error)
        try:
            superseded = self._superseded(keep=generation, protected=protected)
        except OSError as error:
            logger.warning("%s: committed %s, but tidying up failed: %s", self.root, generation, error)
            return []
        return [trash.name for trash in self.location.remove([Committed(name, -1, 0) for name in superseded])]

    def ensure_links(self, models: list[str]) -> None:
        """Point ``recover_info`` and each model's ``recover_checkpoint`` at the committed
        generation, replacing an older link atomically. Never through a link: a model folder
        that is a link (the user's, e.g. exports on another disk) gets no ``recover_checkpoint``
        link, with a warning (once per process) naming where the checkpoint is; never over anything but a link
        (CheckpointError, from :class:`~areal_ckpt.storage.pointers.PointerLink`). Local; durable on return."""
        wanted = {recover_info_link(self.trial): f"{RECOVER_STORE}/{RECOVER_CURRENT}/{RECOVER_INFO}"}
        for model in models:
            wanted[recover_checkpoint_link(self.trial, model)] = f"../{RECOVER_STORE}/{RECOVER_CURRENT}/{model}"
        for link, target in wanted.items():
            if link.is_symlink() and os.readlink(link) == target:
                continue
            if link.parent.is_symlink():
                if link.parent in _LINKED_FOLDERS_NAMED:
                    continue
                _LINKED_FOLDERS_NAMED.add(link.parent)
                logger.warning(
                    "%s is a link (to %s) areal_ckpt did not create: no %s link is placed through it; "
                    "the model's recovery checkpoint is %s",
                    link.parent,
                    os.readlink(link.parent),
                    link.name,
                    self.root / RECOVER_CURRENT / link.parent.name,
                )
                continue
            make_dirs(link.parent)
            PointerLink(link.name).point(link.parent, target)

    def _superseded(self, keep: str | None, protected: tuple[str, ...] = ()) -> list[str]:
        """Generations other than ``keep`` and ``protected`` that are incomplete, or that the
        :class:`~areal_ckpt.storage.retention.KeepNewest` policy removes beside ``keep``. A
        complete generation at or after ``keep``'s step (a dump interrupted between its manifest
        and the switch, so possibly committed after ``keep`` as far as the store can tell) is
        not among them, with a warning: a checkpoint is never deleted unless a newer committed
        one exists. Read-only."""
        names = [name for name in self.generations() if name != keep and name not in protected]
        complete = [name for name in names if self.is_complete(name) and not self.is_pending(name)]
        # the committed one first in commit order: an uncommitted complete one of its step sorts after it
        entries = [Committed(name, generation_step(name), 1) for name in complete]
        if keep is not None:
            entries.append(Committed(keep, generation_step(keep), 0))
        doomed = {entry.name for entry in doomed_by(KeepNewest(), entries, keep or "").remove}
        for name in complete:
            if name not in doomed:
                logger.warning(
                    "%s: keeping %s: it is complete and not older than the committed %s", self.root, name, keep
                )
        return [name for name in names if name not in complete or name in doomed]

    def remove_debris(self, keep: str | None, wait: bool = True) -> list[str]:
        """Remove the generations ``keep`` supersedes (see :meth:`_superseded`) and stray
        pointer links; returns the generations removed. Each is hidden at once (one durable
        rename); it and the hidden ones earlier commits left are deleted on this process's
        deletion thread, before this returns with ``wait``, else while the caller goes on
        (a load reads meanwhile; :func:`~areal_ckpt.generations.tidy.wait_for_deletions` waits for
        it; a crash leaves them hidden for the next call). Rank 0 only, while no rank writes
        (this process's own deletions are waited for first)."""
        wait_for_deletions()
        if not self.root.is_dir() or self.root.is_symlink():
            return []
        removed = self._superseded(keep)
        self.location.remove([Committed(name, -1, 0) for name in removed])
        for entry in self.root.iterdir():
            if entry.name.startswith(f".{RECOVER_CURRENT}.") and entry.is_symlink():
                entry.unlink()
            elif entry.name.startswith(PENDING_PREFIX) and not entry.is_symlink():
                pending = entry.name[len(PENDING_PREFIX) :]
                if pending == keep or not (self.root / pending).is_dir():  # committed after all, or removed
                    entry.unlink()
        fsync_dir(self.root)
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
