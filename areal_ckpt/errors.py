"""Exceptions raised by areal_ckpt. Every message names the file or key involved and the cause."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class for checkpoint failures that the caller should see, never swallow."""


class ConfigError(ValueError):
    """A configuration file, block or value is invalid; the message names the file and key path."""


class CommitError(CheckpointError):
    """Publishing a staged checkpoint failed; the previously committed checkpoint is intact."""


class RankMismatchError(CheckpointError):
    """Ranks disagree about what to save (name, step); raised on every rank before any write."""


class CollectiveError(CheckpointError):
    """A collective between ranks failed: usually another rank died or the network broke."""


class TransientError(CheckpointError):
    """A failure that trying again may cure (an OS error while writing a new recovery dump);
    the recovery dump retries it (:mod:`areal_ckpt.jobs.retry`) before giving up."""
