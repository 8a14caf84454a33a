"""Which tier a tiered trial resumes from: the node's local tier or where the trial persists.

A tiered trial (``recover.local_dir``) commits each dump locally first and publishes it later
(:mod:`areal_ckpt.recover.upload`) to where it persists (object storage or a shared folder:
"the persistent tier" below), so at a restart either tier may hold the newest commit. Every
rank looks at its own local tier; rank 0 also asks the persistent tier; all ranks then follow
one decision (:func:`choose_tier`):

- rank 0's local tier has committed a generation, every rank's local tier holds its folder,
  and the persistent tier holds that one, an older one or none: resume locally (as fast as a
  local trial);
- the persistent tier holds a newer one, or some rank has no local copy of the local one (a
  node that lost its disk, a job moved to other nodes): resume from the persistent tier, with
  a warning when that skips a newer local generation;
- the persistent tier cannot be reached: resume locally, saying so, when every rank can; else
  a CheckpointError (never a silent fresh start).

On several nodes rank 0's commit stands for every node: another node's local tier holds only
the folder of each generation, with its own ranks' files (:mod:`areal_ckpt.recover.nodes`).
Before a local load the nodes exchange the files each lacks.

A local generation that turns out damaged while it loads is given up for the persistent tier's
newest by the caller (:meth:`~areal_ckpt.recover.handler.RecoverHandler.load`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.paths import generation_step
from areal_ckpt.recover.persistent import PersistentGenerations
from areal_ckpt.recover.store import RecoverStore, find_committed

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dist.exchanged
@dataclass(frozen=True)
class TierChoice:
    """Where a tiered trial resumes from: ``local`` (the local tier's committed generation) or
    the persistent tier; ``remote_newest`` is the persistent tier's newest generation (None:
    none, or it could not be reached, ``reachable`` False)."""

    local: bool
    remote_newest: str | None
    reachable: bool


def choose_tier(store: RecoverStore, behind: PersistentGenerations) -> TierChoice:
    """Decide where the tiered trial ``store`` (persisting ``behind``) resumes from (see the
    module docstring).
    Collective: every rank reads its own local tier, rank 0 the persistent tier and decides. Raises
    CheckpointError on every rank when neither tier can serve every rank although a checkpoint
    exists. Rank 0 removes its local tier's debris (as a local load does); a local tier whose
    commit record is broken counts as empty, with a warning naming the cause."""

    def own_local() -> tuple[str | None, list[str]]:
        if dist.rank() != 0:
            return None, store.generations()
        try:
            return find_committed(store), store.generations()
        except CheckpointError as error:  # the bucket may still hold everything: not a reason to stop
            logger.warning("the local tier cannot be used (%s); looking at %s", error, behind.where())
            return None, []

    return agree.gathered_then_decided(
        own_local, lambda held: _decide(store, behind, held), f"{store.root}: cannot choose a tier to resume from"
    )


def restore_from_tiers(
    store: RecoverStore, behind: PersistentGenerations, restore: Callable[[bool], T | None]
) -> tuple[T | None, TierChoice]:
    """Resume the tiered trial ``store`` (persisting ``behind``): :func:`choose_tier`, then ``restore(local)`` (a
    collective load from the local tier, or from the persistent tier, returning None when there
    is nothing to load). When a rank's load from the local tier fails (a file damaged or
    missing) and the persistent tier holds a generation, every rank loads that one instead, with a warning
    naming the failure. Collective; returns what ``restore`` returned and the choice it
    followed."""
    choice = choose_tier(store, behind)
    if not choice.local:
        return restore(False), choice
    failure: CheckpointError | None = None
    restored: T | None = None
    try:
        restored = restore(True)
    except CheckpointError as error:
        failure = error
    if dist.all_true(failure is None):
        return restored, choice
    if choice.remote_newest is None:
        raise failure or CheckpointError(f"{store.root}: another rank could not load the local tier")
    logger.warning(
        "the local tier's recovery checkpoint cannot be loaded (%s): loading %s from the persistent tier",
        failure or "on another rank",
        choice.remote_newest,
    )
    return restore(False), dataclasses.replace(choice, local=False)


def _decide(store: RecoverStore, behind: PersistentGenerations, held: list[tuple[str | None, list[str]]]) -> TierChoice:
    """Rank 0: the decision, from rank 0's local committed generation and the generation
    folders each rank's local tier holds (``held``, by rank)."""
    local = held[0][0]
    missing = [rank for rank, (_, folders) in enumerate(held) if local not in folders]
    everywhere = local is not None and not missing
    try:
        newest = behind.newest()
    except CheckpointError as error:
        if everywhere:
            logger.warning(
                "cannot reach %s (%s): resuming from the local tier's %s; it is uploaded once it answers",
                behind.where(),
                error,
                store.path(local),  # type: ignore[arg-type]
            )
            return TierChoice(local=True, remote_newest=None, reachable=False)
        what = "holds no committed recovery checkpoint" if local is None else f"of ranks {missing} lacks {local}"
        raise CheckpointError(
            f"cannot reach {behind.where()} ({error}), and the local tier {what}; not starting fresh: restart when "
            "it answers"
        ) from None
    if everywhere and (newest is None or newest == local or generation_step(local) > generation_step(newest)):  # type: ignore[arg-type]
        return TierChoice(local=True, remote_newest=newest, reachable=True)
    if local is not None and (newest is None or generation_step(local) > generation_step(newest)):
        if newest is None:
            raise CheckpointError(
                f"{store.path(local)}: the newest recovery checkpoint is committed on local tiers only, "
                f"{behind.where()} holds none, and ranks {missing} have no local copy of it (their node lost its "
                "disk, or the job moved to other nodes); not starting fresh, nothing was deleted: restart on the "
                "nodes whose local_dir holds it"
            )
        logger.warning(
            "%s is newer than %s, but ranks %s have no local copy of it (a node lost its disk, or the job "
            "moved): resuming from there",
            store.path(local),
            behind.where(newest),
            missing,
        )
    return TierChoice(local=False, remote_newest=newest, reachable=True)
