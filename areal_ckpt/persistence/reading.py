"""Reading a trial's recovery generations from where they persist
(:class:`~areal_ckpt.persistence.generations.PersistentGenerations`): what a load reads from
(:class:`ReadFrom`), a load started again when a running job's commit superseded what it read
(:func:`restore_newest`), and the committed generation brought into the node's local store
(:func:`fetch_committed`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.range_read import PeerFiles
from areal_ckpt.paths import RECOVER_MANIFEST
from areal_ckpt.persistence.generations import PersistentGenerations
from areal_ckpt.storage.folders import fetch_shared
from areal_ckpt.storage.location import recovery_location_of

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
