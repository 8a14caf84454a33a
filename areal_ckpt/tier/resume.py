"""Which tier a tiered trial resumes from: the nodes' local tiers or where the trial persists.

A tiered trial (``recover.local_dir``) commits each dump locally first and publishes it later
(:mod:`areal_ckpt.tier.upload`) to where it persists (object storage or a shared folder:
"the persistent tier" below), so at a restart either tier may hold the newest commit. The
lowest rank of each node reports what its node's local tier holds; rank 0 also asks the
persistent tier; all ranks then follow one decision (:func:`choose_tier`):

- the newest generation the local tiers hold whole between them (every file on some node: a
  node's own files, or the copies other nodes keep of them, :mod:`areal_ckpt.tier.peer_copies`),
  when the persistent tier holds that one, an older one or none: resume locally, once each
  node received what it lacks and rank 0's node committed it (as fast as a local trial);
- the persistent tier holds a newer one, or no local generation is whole (nodes that lost
  their disks with no copies elsewhere, a job moved to other nodes): resume from the persistent
  tier, with a warning naming the newer local generation and what it lacks where;
- the persistent tier cannot be reached: resume locally, saying so, when a generation is
  whole; else a CheckpointError (never a silent fresh start).

On several nodes rank 0's commit stands for every node: another node's local tier holds the
folder of each generation with its own ranks' files and any copies (:mod:`areal_ckpt.tier.nodes`).

A local generation that turns out damaged while it is assembled or loads (a copy failing its
check included) is given up for the persistent tier's newest, named in a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import generation_step
from areal_ckpt.persistence.generations import PersistentGenerations
from areal_ckpt.persistence.reading import ReadFrom, restore_newest
from areal_ckpt.storage.foreign import refuse_foreign_layout
from areal_ckpt.storage.peer_reads import PeerReads
from areal_ckpt.tier.peer_copies import (
    Assembly,
    Holding,
    assemble,
    assemblies,
    holdings_of,
    node_leaders,
    set_aside_damaged,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dist.exchanged
@dataclass(frozen=True)
class TierChoice:
    """Where a tiered trial resumes from: ``local`` (``generation``, assembled from the nodes'
    local tiers, its manifest from rank ``manifest_from``'s node; ``partial`` once loaded when
    a node lacks data files of it: those no rank of it read, and those that went straight into
    its ranks' loads) or the persistent tier; ``remote_newest`` is the persistent tier's newest
    generation (None: none, or it could not be reached, ``reachable`` False)."""

    local: bool
    remote_newest: str | None
    reachable: bool
    generation: str | None = None
    manifest_from: int = 0
    partial: bool = False  # set once loaded: some node lacks data files of it


def choose_tier(store: RecoverStore, behind: PersistentGenerations, unanswered: str | None = None) -> TierChoice:
    """Decide where the tiered trial ``store`` (persisting ``behind``) resumes from (see the
    module docstring). Collective: the lowest rank of each node reads its node's local tier,
    rank 0 also the persistent tier (unless ``unanswered`` says why it did not answer a moment
    ago: then it is not asked again, which would wait out the storage client's retries a second
    time), and decides. Raises CheckpointError on every rank when
    neither tier can serve every rank although a checkpoint exists, or the trial holds AReaL's
    folders. Nothing is deleted here (the load removes debris once the choice is made); a local
    tier whose commit record is broken counts as empty, with a warning naming the cause."""
    leaders = node_leaders(store)

    def own_local() -> dict[str, Holding] | None:
        if dist.rank() not in leaders:
            return None
        if dist.rank() == 0:
            try:  # its debris stays until the load: an older generation may be the one to assemble
                refuse_foreign_layout(store.trial)
                store.check_root()
            except CheckpointError as error:  # the bucket may still hold everything: not a reason to stop
                logger.warning("the local tier cannot be used (%s); looking at %s", error, behind.where())
                return {}
        return holdings_of(store)

    return agree.gathered_then_decided(
        own_local,
        lambda held: _decide(
            store, behind, {rank: holdings for rank, holdings in enumerate(held) if holdings is not None}, unanswered
        ),
        f"{store.root}: cannot choose a tier to resume from",
    )


def restore_from_tiers(
    store: RecoverStore,
    behind: PersistentGenerations,
    restore: Callable[[ReadFrom], T | None],
    unanswered: str | None = None,
) -> tuple[T | None, TierChoice]:
    """Resume the tiered trial ``store`` (persisting ``behind``): :func:`choose_tier` (told
    ``unanswered``), then ``restore(read_from)`` (a collective load from the local tiers,
    once the chosen generation was assembled on them, or from the persistent tier, returning
    None when there is nothing to load). Each node first receives only what its ranks read, a
    data file only one of its ranks reads straight into that rank's load (``peers``; the
    transfers the load did not reach run once it ends); when assembling or loading fails on a
    rank, every node receives every file it lacks and the load runs again; when that fails too
    (a file damaged, a copy that fails its check) and the persistent tier holds a generation,
    every rank loads that one instead, with a warning naming the failure. Collective; returns
    what ``restore`` returned and the choice it followed."""
    choice = choose_tier(store, behind, unanswered)
    if not choice.local or choice.generation is None:
        return restore_newest(behind, restore), choice
    generation = choice.generation
    failure: CheckpointError | None = None
    restored: T | None = None
    partial = False
    for every_file in (False, True):  # a load sharded otherwise than the dump reads beyond its slice
        failure = None
        peers: PeerReads | None = None
        try:
            partial, peers = assemble(store, generation, choice.manifest_from, every_file, not every_file)
            restored = restore(ReadFrom(assembled=True, peers=peers))
        except CheckpointError as error:
            failure = error
        try:
            if peers is not None:
                peers.settle()  # the transfers of a model not loaded, or of a load that failed first
        except CheckpointError as error:
            failure = failure or error
        if dist.all_true(failure is None):
            return restored, dataclasses.replace(choice, partial=partial)
        if every_file:
            break
        try:
            damaged = set_aside_damaged(store, generation)
        except CheckpointError as error:  # no manifest to check against: the persistent tier is next
            logger.warning("%s: the local tiers' files were not checked: %s", store.path(generation), error)
            damaged = 0
        if not partial and not damaged:
            break
        logger.warning(
            "the local tiers' %s did not load with the files each node's ranks read (%s)%s: every node receives "
            "every file it lacks, and it is loaded again",
            choice.generation,
            failure or "on another rank",
            f"; {damaged} file(s) that failed their check set aside" if damaged else "",
        )
    if choice.remote_newest is None:
        raise failure or CheckpointError(f"{store.root}: another rank could not load the local tier")
    logger.warning(
        "the local tier's recovery checkpoint cannot be loaded (%s): loading %s from the persistent tier",
        failure or "on another rank",
        choice.remote_newest,
    )
    return restore_newest(behind, restore), dataclasses.replace(choice, local=False)


def _decide(
    store: RecoverStore, behind: PersistentGenerations, held: dict[int, dict[str, Holding]], unanswered: str | None
) -> TierChoice:
    """Rank 0: the decision, from what each node's local tier holds (``held``, by the node's
    lowest rank) and the persistent tier's newest (not asked when ``unanswered``)."""
    found = assemblies(held)
    whole = next((entry for entry in found if entry.whole), None)
    newest, error = None, unanswered
    if error is None:
        try:
            newest = behind.newest()
        except CheckpointError as failure:
            error = str(failure)
    if error is not None:
        if whole is not None:
            logger.warning(
                "cannot reach %s (%s): resuming from the local tier's %s; it is uploaded once it answers",
                behind.where(),
                error,
                store.path(whole.generation),
            )
            return TierChoice(True, None, False, whole.generation, whole.manifest_from)
        what = "holds no committed recovery checkpoint" if not found else _lacking(store, found[0], held)
        raise CheckpointError(
            f"cannot reach {behind.where()} ({error}), and the local tier {what}; not starting fresh: restart when "
            "it answers"
        ) from None
    if whole is not None and (newest is None or generation_step(whole.generation) >= generation_step(newest)):
        _warn_of_skipped(store, found, whole, held)
        return TierChoice(True, newest, True, whole.generation, whole.manifest_from)
    orphans = sorted({name for holdings in held.values() for name in holdings} - set(held.get(0, {})))
    if newest is None and not found and orphans:  # rank 0's node lost its tier, and every manifest with it
        raise CheckpointError(
            f"{store.root}: other nodes' local tiers hold files of {', '.join(orphans)}, rank 0's node holds none "
            f"of them and no node holds a manifest of any (rank 0's local tier lost before their copies were "
            f"made), and {behind.where()} holds none: whether one was committed cannot be told; not starting "
            "fresh, nothing was deleted: restart with rank 0's local tier back, or remove those generation "
            "folders to start afresh"
        )
    newer = next(
        (entry for entry in found if newest is None or generation_step(entry.generation) > generation_step(newest)),
        None,
    )
    if newer is not None:
        if newest is None:
            raise CheckpointError(
                f"{store.path(newer.generation)}: the newest recovery checkpoint is committed on local tiers only, "
                f"{behind.where()} holds none, and {_lacking(store, newer, held)} (their node lost its disk, or the "
                "job moved to other nodes); not starting fresh, nothing was deleted: restart on the nodes whose "
                "local_dir holds it"
            )
        logger.warning(
            "%s is newer than %s, but %s (a node lost its disk, or the job moved): resuming from there",
            store.path(newer.generation),
            behind.where(newest),
            _lacking(store, newer, held),
        )
    return TierChoice(False, newest, True)


def _warn_of_skipped(
    store: RecoverStore, found: list[Assembly], chosen: Assembly, held: dict[int, dict[str, Holding]]
) -> None:
    """Rank 0: a warning naming each newer committed generation than ``chosen`` that the local
    tiers cannot resume (a file lost, or replaced by something that is no file), and what it
    lacks: a resume never skips a commit without a word."""
    for entry in found:
        if generation_step(entry.generation) > generation_step(chosen.generation) and not entry.whole:
            logger.warning(
                "%s is newer than %s, but %s: resuming from the older one",
                store.path(entry.generation),
                chosen.generation,
                _lacking(store, entry, held),
            )


def _lacking(store: RecoverStore, entry: Assembly, held: dict[int, dict[str, Holding]]) -> str:
    """What keeps ``entry`` from being assembled: the nodes without it, the files no node holds."""
    ranks = [rank for rank, holdings in sorted(held.items()) if entry.generation not in holdings]
    shown = ", ".join(entry.missing[:3]) + (f" and {len(entry.missing) - 3} more" if len(entry.missing) > 3 else "")
    return (f"ranks {ranks} have no local copy of it and " if ranks else "") + f"no node holds {shown}"
