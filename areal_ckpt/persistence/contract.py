"""Where a trial's recovery generations persist behind the node's own copy of the trial.

A recovery dump is always written and committed into a local store first
(:class:`~areal_ckpt.generations.store.RecoverStore`: a plain trial, the staging copy of a trial on
object storage, or the local tier of a tiered trial). When the trial persists elsewhere, the
committed generation is then *published* there and a restart *fetches* the newest one from
there. :class:`PersistentGenerations` is that contract; its implementations are
:class:`~areal_ckpt.persistence.remote.ObjectGenerations` (a prefix on any object store: a
create-only commit record) and :class:`~areal_ckpt.persistence.shared_folder.FolderGenerations` (a
trial folder on a shared file system: fsync, then the ``current`` link switch). The factory is
:func:`~areal_ckpt.recover.location.trial_location`; nothing else asks which one it has.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.range_read import PeerFiles
from areal_ckpt.fsio import FileWriter
from areal_ckpt.paths import RECOVER_MANIFEST
from areal_ckpt.storage.folders import FileSource, fetch_shared
from areal_ckpt.storage.location import recovery_location_of
from areal_ckpt.storage.mirrors import Identity

logger = logging.getLogger(__name__)

T = TypeVar("T")


def new_run_token() -> str:
    """A token naming one job (one RecoverHandler) in the commits it makes where a trial persists."""
    return secrets.token_hex(8)


class PersistentGenerations(Protocol):
    """A trial's committed recovery generations where they persist. Every method but
    :meth:`publish` is local to the calling process; all block; instances are picklable (a
    background uploader receives one). Errors are CheckpointError naming the location,
    TransientError where trying again may cure them."""

    def where(self, generation: str | None = None) -> str:
        """The trial's location, or that of its ``generation``, for messages (a URL or a path)."""

    def identity(self) -> Identity:
        """The full identity of the trial's location (what a local tier of it records). Pure
        but for making the store's client."""

    def check_access(self) -> None:
        """CheckpointError naming the location and the cause unless it can be used."""

    def newest(self) -> str | None:
        """The newest committed generation's name, None when there is none; CheckpointError when
        the commit record is broken."""

    def check_owner(self, run: str, loaded: Iterable[str]) -> None:
        """Rank 0 before a dump or an upload: CheckpointError, nothing written, unless the newest
        commit is none, one this job (``run``) made, or one of the generations it ``loaded``."""

    def remove_debris(self) -> None:
        """Rank 0 at a job's first commit here (after :meth:`check_owner`): delete what killed
        writers left (uncommitted generations, unfinished uploads); committed ones are kept."""

    def publish(
        self, folder: Path, mine: Mapping[str, tuple[int, int]], run: str, step: int, written: Iterable[str] = ()
    ) -> None:
        """Make the committed local generation ``folder`` the newest committed one here: every
        rank puts its own files (``mine``: name -> size and CRC-32, but those ``written`` here
        already by :meth:`direct_writer`), then rank 0 the other files the manifest lists, the
        manifest, and commits (naming ``run`` and ``step``); older generations are deleted
        after. Every byte put is checked first against its record (a local file that rotted or
        became a link is never committed here, nor a reason to delete what is). Collective;
        durable on return; every rank raises the same error when any part failed, and nothing
        is committed then."""

    def files_of(self, generation: str) -> FileSource:
        """The files of ``generation``, to fetch."""

    def direct_writer(self, generation: str, part: str) -> Callable[[Path], FileWriter] | None:
        """What writes a data file of ``part`` straight here, bypassing the local copy (the
        file is uncommitted until :meth:`publish`), or None when data files are written locally
        and put here by :meth:`publish`."""


@dataclass(frozen=True)
class ReadFrom:
    """Where a load reads the committed generation from, as the trial's
    :class:`~areal_ckpt.recover.publication.Publication` decided: with a ``source`` (where the
    trial persists) its newest commit is the one, brought into the local store, which is then
    a cache of it; without, the local store as it is. ``assembled``: the local tiers of a
    tiered trial once the generation was assembled on them (the data files other nodes hold,
    or send, are not looked for locally); ``peers``: the data files other ranks send straight
    into this rank's load; ``newest``: with a source, its newest commit as read (and agreed) for
    this load, None when it holds none: the load reads that one, not the newest again. Plain data."""

    source: PersistentGenerations | None = None
    newest: str | None = None
    assembled: bool = False
    peers: PeerFiles | None = None


#: How many times a load from where a trial persists starts again when another job's commit
#: superseded (and deleted) the generation it was reading.
SUPERSEDED_ATTEMPTS = 3


def restore_newest(behind: PersistentGenerations, restore: Callable[[ReadFrom], T | None]) -> T | None:
    """``restore(ReadFrom(behind))``; when it fails and ``behind``'s newest commit changed
    meanwhile (a running job on the trial committed, and its retention deleted the generation
    being read), again from the newer one, logged, up to :data:`SUPERSEDED_ATTEMPTS` times, then
    a CheckpointError saying so; any other failure is raised as it is. Collective (rank 0 reads
    the newest commit, agreed)."""
    attempt = 1
    while True:
        read = agree.decided_by_rank0(behind.newest, f"{behind.where()}: cannot read the newest commit")
        try:
            return restore(ReadFrom(behind, newest=read))
        except CheckpointError as error:
            now = agree.decided_by_rank0(behind.newest, f"{behind.where()}: cannot read the newest commit")
            if read is None or now == read:
                raise
            if attempt == SUPERSEDED_ATTEMPTS:
                raise CheckpointError(
                    f"{behind.where(read)} was superseded by {now} while it was loaded, {attempt} times in a row "
                    "(another job commits to this trial faster than it loads: stop it, or use another trial_name)"
                ) from error
            if dist.rank() == 0:
                logger.warning("%s was superseded by %s while it was loaded (%s); loading %s", read, now, error, now)
            attempt += 1


def fetch_committed(
    behind: PersistentGenerations,
    generation: str,
    store_root: Path,
    deferred: Callable[[str], bool] = lambda name: False,
) -> None:
    """Every rank: bring ``generation``, committed ``behind`` (its newest, as the ranks agreed),
    into the local store ``store_root`` and point its ``current`` at it.
    A file the copy already holds is kept when its size and CRC-32 match the manifest, else
    fetched again (with a warning naming it: a local copy torn by a crash never makes a load
    fail while the trial's location holds the file intact). Ranks sharing ``store_root`` take
    turns (a file lock) and the first one leaves a marker for the others of this load (a token
    rank 0 draws per load), so each copy is checked and completed once per load. The files
    ``deferred`` names are left for the reader to bring down
    (:class:`~areal_ckpt.storage.folders.OnDemandFiles`). Collective (the ranks agree on the
    load's token and on success)."""
    token = agree.decided_by_rank0(lambda: secrets.token_hex(4), f"{behind.where()}: cannot start the fetch")

    def point_current(folder: Path) -> None:
        recovery_location_of(store_root.parent).recommit(generation, {})

    def fetch() -> None:
        fetch_shared(
            behind.files_of(generation), store_root, RECOVER_MANIFEST, token, then=point_current, deferred=deferred
        )

    agree.on_every_rank(fetch, f"{behind.where()}: cannot fetch the committed recovery checkpoint")
