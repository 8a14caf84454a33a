"""Which committed checkpoints go once a new one has committed: one function, fed by policies.

Every consumer's retention is the same question over the same facts, so it is answered once
(:func:`doomed_by`) and each consumer only names its policy:

- :class:`KeepLast` — exports: the ``count`` newest by (step, commit order).
- :class:`KeepNewest` — a recovery trial: the newest generation, plus the generations still in
  flight (a tiered trial's upload running or queued, passed as ``protected``).
- :class:`ReplaceSameLabel` — DeepSpeed tags: a tag saved again replaces its earlier saves;
  other tags stay.

The rules every policy obeys are in :func:`doomed_by`, not in the policies: the checkpoint
just committed is never doomed, nor anything a policy protects, nor anything committed after
it (a checkpoint is never deleted unless a newer committed one exists). Pure: nothing here
touches storage; the location (:mod:`areal_ckpt.storage.location`) or the recovery store removes
what this returns.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Committed:
    """One committed checkpoint: its name where it is kept (a folder, a prefix), the step it
    was taken at (-1 when unknown), its commit order (0 where names commit once, e.g. a
    folder), its label (a DeepSpeed tag; empty when it has none), and what its commit recorded
    (``facts``: an object record's fields; empty for a folder) and when (``when``: unix time,
    None when unknown). Only name, step, order and label decide anything here."""

    name: str
    step: int
    order: int
    label: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    when: float | None = field(default=None, compare=False)

    def key(self) -> tuple[int, int, str]:
        """The order retention sorts by: step, then commit order, then name."""
        return (self.step, self.order, self.name)


class RetentionPolicy(Protocol):
    """What a consumer wants kept; asked only about checkpoints older than the newest."""

    def candidates(self, older: list[Committed], newest: Committed, newer: list[Committed]) -> list[Committed]:
        """Of ``older`` (the committed checkpoints that sort before ``newest``, oldest first),
        those this policy removes; ``newer`` (those that sort after it, kept whatever the
        policy says) counts where the policy counts. Pure."""


@dataclass(frozen=True)
class KeepLast:
    """Keep the ``count`` newest checkpoints (the one just committed among them)."""

    count: int

    def candidates(self, older: list[Committed], newest: Committed, newer: list[Committed]) -> list[Committed]:
        """All of ``older`` but the ones needed to keep ``count`` with ``newest`` and ``newer``."""
        return older[: max(len(older) - max(self.count - 1 - len(newer), 0), 0)]


@dataclass(frozen=True)
class KeepNewest:
    """Keep only the newest checkpoint (a recovery trial holds one generation)."""

    def candidates(self, older: list[Committed], newest: Committed, newer: list[Committed]) -> list[Committed]:
        """All of ``older``."""
        return list(older)


@dataclass(frozen=True)
class ReplaceSameLabel:
    """A checkpoint saved again under its label replaces the earlier ones of that label."""

    def candidates(self, older: list[Committed], newest: Committed, newer: list[Committed]) -> list[Committed]:
        """The checkpoints of ``older`` with ``newest``'s label."""
        return [entry for entry in older if entry.label == newest.label]


@dataclass(frozen=True)
class Doomed:
    """What :func:`doomed_by` decided: the checkpoints to remove, and the ones a policy would
    have removed but that were committed after the newest (kept; the caller warns)."""

    remove: list[Committed]
    kept_newer: list[Committed] = field(default_factory=list)


def doomed_by(
    policy: RetentionPolicy, committed: list[Committed], newest: str, protected: Collection[str] = ()
) -> Doomed:
    """The one retention function: of ``committed``, what ``policy`` removes now that ``newest``
    has committed (its latest commit, where a name was committed more than once). Never that
    commit, never a name in ``protected`` (in flight), never a checkpoint that sorts after it
    (reported in ``kept_newer``). Nothing when ``newest`` is not in ``committed``. Pure."""
    mine = [entry for entry in committed if entry.name == newest]
    if not mine:
        return Doomed([])
    latest = max(mine, key=lambda entry: entry.order)
    ordered = sorted(committed, key=Committed.key)
    others = [entry for entry in ordered if entry != latest and entry.name not in protected]
    older = [entry for entry in others if entry.key() < latest.key()]
    newer = [entry for entry in others if entry.key() >= latest.key()]
    return Doomed(policy.candidates(older, latest, newer), newer)
