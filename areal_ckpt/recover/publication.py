"""When a trial's local commits reach where the trial persists: a policy, chosen once.

Every recovery dump commits into a local store first (:class:`~areal_ckpt.generations.store.RecoverStore`).
What happens next, and where a load looks, is one of three policies; the factory
(:func:`~areal_ckpt.recover.location.trial_location`) picks it from the ``recover:`` block, and
the handler, the dump's two halves and the load call it without asking which one they hold:

- :class:`KeptLocally` — a local trial (``fileroot`` a folder, no ``local_dir``): the store *is*
  the trial; nothing is published.
- :class:`PublishedInDump` — a trial on object storage without ``local_dir``: the store is a
  staging copy; data files stream to the bucket from memory and the dump publishes the
  generation before it returns; a load reads the bucket's newest.
- :class:`PublishedInBackground` — a tiered trial (``local_dir``): the store is the node-local
  tier; a dump returns once it committed there, an upload process publishes it behind
  (:mod:`areal_ckpt.tier.upload`); a load resumes from the tier that holds the newest
  (:mod:`areal_ckpt.tier.resume`).

Where the trial persists (a bucket, a shared folder) is the storage contract
:class:`~areal_ckpt.persistence.generations.PersistentGenerations`; this module only says *when*.
Implementations are plain, picklable data (a dump job carries one to the background writers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError, TransientError
from areal_ckpt.fsio import FileWriter
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.generations.tidy import delete_later
from areal_ckpt.jobs.retry import retried
from areal_ckpt.paths import RECOVER_MANIFEST
from areal_ckpt.persistence.generations import PersistentGenerations
from areal_ckpt.persistence.reading import ReadFrom, restore_newest
from areal_ckpt.publish import read_manifest
from areal_ckpt.storage.foreign import refuse_foreign_layout
from areal_ckpt.storage.mirrors import set_aside_contents
from areal_ckpt.tier.nodes import node_of
from areal_ckpt.tier.resume import TierChoice, restore_from_tiers
from areal_ckpt.tier.upload import Uploads

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class CommittedDump:
    """A dump just committed in the local store, as :meth:`Publication.publish` sees it: its
    generation and global step, its models, this rank's files in it (``mine``: size and
    CRC-32; ``streamed``: those already written where the trial persists), the job's run token
    and the retries allowed."""

    generation: str
    step: int
    models: list[str]
    mine: Mapping[str, tuple[int, int]]
    streamed: set[str]
    run: str
    retries: int


class Publication(Protocol):
    """When the local commits of a trial reach where it persists, and where a load looks."""

    def start(self, store: RecoverStore) -> None:
        """Every rank, when a handler that dumps is made: claim what the dumps will use and check
        it answers. Collective; raises CheckpointError on every rank when it cannot be used."""

    def before_dump(self, run: str, loaded: list[str], first: bool) -> None:
        """Rank 0 before a dump (``first``: the job's first): the checks where the trial
        persists (the newest commit there is this job's or one it ``loaded``) and, where due,
        the removal of earlier jobs' debris. Local; blocking; CheckpointError is a refusal."""

    def uploads(self, store: RecoverStore, run: str, retries: int) -> Uploads | None:
        """The background uploads of a handler that dumps, or None when dumps publish nothing
        later. Collective (every rank makes its own)."""

    def restore(
        self, store: RecoverStore, restore: Callable[[ReadFrom], T | None]
    ) -> tuple[T | None, TierChoice | None]:
        """Run ``restore(read_from)`` (a collective load of the committed generation, read as
        :class:`~areal_ckpt.persistence.reading.ReadFrom` says: the local store as it is, where
        the trial persists, or the assembled local tiers, :mod:`~areal_ckpt.tier.resume`);
        returns its result and the tier choice it followed (None: no choice to make).
        Collective."""

    def has_checkpoint(self, store: RecoverStore) -> bool:
        """True when a committed checkpoint exists wherever this trial keeps them. Local;
        CheckpointError when a commit record is broken or the trial holds AReaL's folders."""

    def direct_writer(self, generation: str, part: str) -> Callable[[Path], FileWriter] | None:
        """What writes a data file of ``part`` of ``generation`` straight to where the trial
        persists (uncommitted until published), or None: written into the local store. Pure."""

    def node(self, store: RecoverStore) -> str:
        """Which node's copy of the store this rank writes ("" when every rank writes one copy,
        so rank 0's node tidies alone). Local."""

    def publish(self, store: RecoverStore, dump: CommittedDump) -> str:
        """After ``dump`` committed in ``store``: what the dump still owes before it returns
        (publishing it, within the dump); returns where the dump's checkpoint now is, for its
        result. Collective; blocking; durable on return; raises on every rank."""

    def where(self, store: RecoverStore, generation: str, choice: TierChoice | None) -> str:
        """Where a load found ``generation``, for the line rank 0 logs. Pure."""


@dataclass(frozen=True)
class KeptLocally:
    """A local trial: the store is the trial, nothing persists elsewhere."""

    def start(self, store: RecoverStore) -> None:
        """Nothing to claim: the trial's lock is taken by the handler."""

    def before_dump(self, run: str, loaded: list[str], first: bool) -> None:
        """Nothing: the local store checks its own commit in ``begin``."""

    def uploads(self, store: RecoverStore, run: str, retries: int) -> Uploads | None:
        """None: nothing to upload."""
        return None

    def restore(
        self, store: RecoverStore, restore: Callable[[ReadFrom], T | None]
    ) -> tuple[T | None, TierChoice | None]:
        """``restore`` of the local store as it is: it is where the trial is."""
        return restore(ReadFrom()), None

    def has_checkpoint(self, store: RecoverStore) -> bool:
        """The store's commit record names a generation whose manifest reads."""
        refuse_foreign_layout(store.trial)
        generation = store.committed()
        if generation is None:
            return False
        read_manifest(store.path(generation), RECOVER_MANIFEST)
        return True

    def direct_writer(self, generation: str, part: str) -> Callable[[Path], FileWriter] | None:
        """None: data files go into the trial."""
        return None

    def node(self, store: RecoverStore) -> str:
        """The empty name: one copy of the trial."""
        return ""

    def publish(self, store: RecoverStore, dump: CommittedDump) -> str:
        """Nothing owed: the generation's folder."""
        return str(store.path(dump.generation))

    def where(self, store: RecoverStore, generation: str, choice: TierChoice | None) -> str:
        """The generation's folder."""
        return str(store.path(generation))


@dataclass(frozen=True)
class PublishedInDump:
    """A trial persisting ``behind`` its staging copy, published within each dump."""

    behind: PersistentGenerations

    def start(self, store: RecoverStore) -> None:
        """Rank 0 checks ``behind`` answers (CheckpointError naming it on every rank else); when
        it holds no commit, every node's cache sets aside what it still holds (:meth:`restore`)."""

        def empty() -> bool:
            self.behind.check_access()
            try:
                return self.behind.newest() is None
            except CheckpointError:  # a broken commit record: the load or the dump refuses it, naming it
                return False

        if agree.decided_by_rank0(empty, f"RecoverHandler: cannot use {self.behind.where()}"):
            self._forget(store)

    def before_dump(self, run: str, loaded: list[str], first: bool) -> None:
        """Every dump: the owner check; the first also removes earlier jobs' debris behind."""
        self.behind.check_owner(run, loaded)
        if first:
            self.behind.remove_debris()

    def uploads(self, store: RecoverStore, run: str, retries: int) -> Uploads | None:
        """None: each dump publishes before it returns."""
        return None

    def restore(
        self, store: RecoverStore, restore: Callable[[ReadFrom], T | None]
    ) -> tuple[T | None, TierChoice | None]:
        """``restore`` from ``behind``: its newest commit counts. When there is none, the
        trial starts fresh whatever the node's cache still holds: that is set aside (renamed,
        never read or deleted), so the first dump does not take it for a commit."""
        restored = restore_newest(self.behind, restore)
        if restored is None:
            self._forget(store)
        return restored, None

    def _forget(self, store: RecoverStore) -> None:
        """Every rank: its node's cache of ``behind`` sets aside the generations it holds
        (:func:`~areal_ckpt.storage.mirrors.set_aside_contents`). Collective."""
        why = f"{self.behind.where()} holds no committed recovery checkpoint: the trial starts fresh"
        agree.on_every_rank(
            lambda: set_aside_contents(store.root, why), f"{store.root}: cannot set the stale cache aside"
        )

    def has_checkpoint(self, store: RecoverStore) -> bool:
        """``behind`` holds a committed generation."""
        return self.behind.newest() is not None

    def direct_writer(self, generation: str, part: str) -> Callable[[Path], FileWriter] | None:
        """``behind``'s writer, when it takes data files from memory."""
        return self.behind.direct_writer(generation, part)

    def node(self, store: RecoverStore) -> str:
        """The empty name: each node's staging copy is tidied by its own ranks after the publication."""
        return ""

    def publish(self, store: RecoverStore, dump: CommittedDump) -> str:
        """Publish the generation behind (retried), then every rank deletes the older
        generations of its staging copy off the dump's path; returns its location behind."""
        generation = dump.generation
        retried(
            lambda: self.behind.publish(store.path(generation), dump.mine, dump.run, dump.step, dump.streamed),
            dump.retries,
            f"{self.behind.where()}: upload of the recovery dump at global step {dump.step} (committed in "
            f"{store.root} only)",
        )
        older = [name for name in store.generations() if name != generation]  # on its own node, a rank's alone
        delete_later(store.root, older, dist.rank(), dump.models, remove_folders=True)
        return self.behind.where(generation)

    def where(self, store: RecoverStore, generation: str, choice: TierChoice | None) -> str:
        """The generation's location behind."""
        return self.behind.where(generation)


@dataclass(frozen=True)
class PublishedInBackground:
    """A tiered trial: commits on the node-local tier, copied to ``copies`` other nodes' local
    tiers and published ``behind`` (every ``upload_every``-th commit) by the uploads."""

    behind: PersistentGenerations
    copies: int = 0
    upload_every: int = 1
    unanswered: list[str] = field(default_factory=list, compare=False)  # why ``behind`` did not answer :meth:`start`

    def start(self, store: RecoverStore) -> None:
        """Every rank claims its local tier for ``behind``; rank 0 checks ``behind`` answers,
        and when it does not the dumps go on committing locally (logged), and the load that
        follows does not ask it again (:meth:`restore`)."""
        identity = self.behind.identity()
        agree.require_same(str(identity), "RecoverHandler: the ranks name different persistent tiers")
        agree.on_every_rank(
            lambda: store.claim_local_tier(identity, self.behind.where()), "RecoverHandler: cannot use the local tier"
        )
        self.unanswered.clear()
        try:
            agree.decided_by_rank0(self.behind.check_access, f"RecoverHandler: cannot use {self.behind.where()}")
        except CheckpointError as error:
            logger.warning("%s; dumps commit to the local tier %s until it answers", error, store.trial)
            self.unanswered.append(str(error))

    def before_dump(self, run: str, loaded: list[str], first: bool) -> None:
        """The job's first dump only: the owner check, going on (logged) when ``behind`` does
        not answer, since each upload checks again; the debris is left to the first upload."""
        if not first:
            return
        try:
            self.behind.check_owner(run, loaded)
        except TransientError as error:
            logger.warning("%s; the dump commits to the local tier, its upload checks again", error)

    def uploads(self, store: RecoverStore, run: str, retries: int) -> Uploads | None:
        """The uploads (and peer copies) of the local commits."""
        return Uploads(store, self.behind, run, retries, self.copies, self.upload_every)

    def restore(
        self, store: RecoverStore, restore: Callable[[ReadFrom], T | None]
    ) -> tuple[T | None, TierChoice | None]:
        """The tier choice (:func:`~areal_ckpt.tier.resume.restore_from_tiers`); the first
        after a :meth:`start` that found ``behind`` silent takes that as its answer (asking
        again would wait out the storage client's retries twice before resuming locally)."""
        unanswered = self.unanswered.pop() if self.unanswered else None
        return restore_from_tiers(store, self.behind, restore, unanswered)

    def has_checkpoint(self, store: RecoverStore) -> bool:
        """This node's local tier first (a broken one is left for ``behind``), then ``behind``."""
        try:
            if store.committed() is not None:
                return True
        except CheckpointError as error:
            logger.warning("the local tier cannot be used (%s); looking at %s", error, self.behind.where())
        return self.behind.newest() is not None

    def direct_writer(self, generation: str, part: str) -> Callable[[Path], FileWriter] | None:
        """None: data files land on the local tier; the upload reads them from there."""
        return None

    def node(self, store: RecoverStore) -> str:
        """The node whose local tier this rank writes (:func:`~areal_ckpt.tier.nodes.node_of`)."""
        return node_of(store.root)

    def publish(self, store: RecoverStore, dump: CommittedDump) -> str:
        """Nothing within the dump (the upload is offered by the handler): the local folder."""
        return str(store.path(dump.generation))

    def where(self, store: RecoverStore, generation: str, choice: TierChoice | None) -> str:
        """The local tier's folder, or the location behind, as the choice was."""
        if choice is not None and choice.local:
            return f"{store.path(generation)} (the local tier)"
        return f"{self.behind.where(generation)} (the persistent tier)"
