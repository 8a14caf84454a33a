"""Agreement across ranks, typed: every rank reaches the same outcome, or raises the same error.

Four shapes cover every decision the package takes across ranks:

- :func:`decided_by_rank0`: one rank decides (reads ``latest``, creates a folder), every rank
  gets its value;
- :func:`on_every_rank`: every rank does its share (verifies its files, writes its shards),
  every rank learns whether all went well;
- :func:`gathered_then_decided`: every rank contributes a small value (its file records), rank 0
  decides from all of them (commits), every rank gets the result; :func:`gathered_then_dealt`
  the same with one result per rank (a scatter);
- :func:`require_same`: a value every rank must hold the same (a step, a tag).

In each, an exception on any rank becomes the same exception on every rank: a failure of this
package (:class:`~areal_ckpt.errors.CheckpointError` and its subclasses) keeps its class and
message; any other exception becomes a CheckpointError naming what was being done, the rank
and the exception; several failed ranks are named in rank order. KeyboardInterrupt and
SystemExit stay what they are: the interrupted rank re-raises its own, the others raise the same
type naming that rank, and nothing retries them. An error that a collective inside the action
already agreed on (a :class:`~areal_ckpt.errors.CollectiveError`: a peer is gone; or an error
these helpers raised) passes through untouched, so nested agreements do not wait on each other.

Every function here is collective over the default process group (a world of one without it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Generic, NoReturn, TypeVar

from areal_ckpt import dist
from areal_ckpt.errors import (
    CheckpointError,
    CollectiveError,
    CommitError,
    ConfigError,
    RankMismatchError,
    TransientError,
)

T = TypeVar("T")
C = TypeVar("C")

#: Exceptions that keep their class when they cross to another rank.
_OWN_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (CheckpointError, CommitError, ConfigError, RankMismatchError, CollectiveError, TransientError)
}
_INTERRUPTS: dict[str, type[BaseException]] = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}
_AGREED = "_areal_ckpt_agreed"


@dist.exchanged
@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What one rank's peers learn of its failure: the rank, the exception's class and message."""

    rank: int
    kind: str
    message: str

    def __str__(self) -> str:
        if self.kind in _OWN_ERRORS:
            return f"rank {self.rank}: {self.message}"
        return f"rank {self.rank}: {self.kind}: {self.message}"


@dist.exchanged
@dataclasses.dataclass(frozen=True)
class _Done(Generic[T]):
    """A step that succeeded, with its value."""

    value: T


@dist.exchanged
@dataclasses.dataclass(frozen=True)
class _Failed:
    """A step that failed on the ranks named; ``decided`` when the deciding rank's own decision
    failed (its error then crosses unchanged, without a rank prefix)."""

    failures: list[RankFailure]
    decided: bool = False


def _failure(error: BaseException) -> RankFailure:
    return RankFailure(dist.rank(), type(error).__name__, str(error))


def _passes_through(error: BaseException) -> bool:
    """True for errors every rank already raises together (agreed inside the action)."""
    return isinstance(error, CollectiveError) or getattr(error, _AGREED, False)


def _agreed(error: BaseException) -> BaseException:
    setattr(error, _AGREED, True)
    return error


def _raise(failed: _Failed, own: BaseException | None, what: str) -> NoReturn:
    """Raise on this rank what every rank raises for ``failed`` (see the module docstring)."""
    failures = failed.failures
    interrupted = [failure for failure in failures if failure.kind in _INTERRUPTS]
    if interrupted:
        if isinstance(own, (KeyboardInterrupt, SystemExit)):
            raise _agreed(own)
        first = interrupted[0]
        raise _agreed(_INTERRUPTS[first.kind](f"{what}: rank {first.rank} was interrupted"))
    kinds = {failure.kind for failure in failures}
    cls = _OWN_ERRORS.get(kinds.pop(), CheckpointError) if len(kinds) == 1 else CheckpointError
    if failed.decided and failures[0].kind in _OWN_ERRORS:
        raise _agreed(cls(failures[0].message)) from own
    raise _agreed(cls(f"{what}: " + "; ".join(map(str, failures)))) from own


def decided_by_rank0(decide: Callable[[], T], what: str) -> T:
    """Collective: rank 0 runs ``decide`` (local: it must not call collectives) and every rank
    returns its value (small, plain data), or every rank raises the same error."""
    outcome: _Done[T] | _Failed | None = None
    own: BaseException | None = None
    if dist.rank() == 0:
        try:
            outcome = _Done(decide())
        except BaseException as error:  # every rank raises it, below
            own, outcome = error, _Failed([_failure(error)], decided=True)
    outcome = dist.broadcast_object(outcome, src=0)
    if isinstance(outcome, _Done):
        return outcome.value
    _raise(outcome, own, what)


def on_every_rank(action: Callable[[], T], what: str) -> T:
    """Collective: every rank runs ``action`` (which may call collectives, in the same order on
    every rank) and returns its own result once every rank succeeded; else every rank raises
    the same error, naming each failed rank. One 4-byte reduction when all succeeded."""
    own: BaseException | None = None
    result: T | None = None
    try:
        result = action()
    except BaseException as error:
        if _passes_through(error):
            raise
        own = error
    if dist.all_true(own is None):
        return result  # type: ignore[return-value]  # set: this rank's action returned
    failures = [failure for failure in dist.all_gather_objects(None if own is None else _failure(own)) if failure]
    _raise(_Failed(failures), own, what)


def gathered_then_decided(contribute: Callable[[], C], decide: Callable[[list[C]], T], what: str) -> T:
    """Collective: every rank runs ``contribute`` (which may call collectives) and sends its
    small result to rank 0, which runs ``decide`` on all of them, in rank order (local); every
    rank returns its value, or every rank raises the same error (a contribution's, or
    ``decide``'s). A non-zero rank sends its contribution and receives the outcome, at any
    world size."""
    outcome, own = _gather_and_decide(contribute, decide)
    outcome = dist.broadcast_object(outcome, src=0)
    if isinstance(outcome, _Done):
        return outcome.value
    _raise(outcome, own, what)


def gathered_then_dealt(contribute: Callable[[], C], decide: Callable[[list[C]], list[T]], what: str) -> T:
    """As :func:`gathered_then_decided`, but ``decide`` returns one value per rank and each rank
    returns its own (a scatter: a non-zero rank receives only its value)."""
    outcome, own = _gather_and_decide(contribute, decide)
    dealt: list[_Done[T] | _Failed] | None = None
    if isinstance(outcome, _Done):
        dealt = [_Done(value) for value in outcome.value]
        if len(dealt) != dist.world_size():
            own, outcome = None, _Failed([RankFailure(0, "CheckpointError", f"decided {len(dealt)} values")], True)
    if isinstance(outcome, _Failed):
        dealt = [outcome] * dist.world_size()
    mine: _Done[T] | _Failed = dist.scatter_objects(dealt, src=0)
    if isinstance(mine, _Done):
        return mine.value
    _raise(mine, own, what)


def _gather_and_decide(
    contribute: Callable[[], C], decide: Callable[[list[C]], T]
) -> tuple[_Done[T] | _Failed | None, BaseException | None]:
    """Rank 0: the decision (or every failure); other ranks: None. And this rank's own error."""
    own: BaseException | None = None
    mine: _Done[C] | RankFailure
    try:
        mine = _Done(contribute())
    except BaseException as error:
        if _passes_through(error):
            raise
        own, mine = error, _failure(error)
    gathered = dist.gather_objects(mine, dst=0)
    if gathered is None:
        return None, own
    failures = [item for item in gathered if isinstance(item, RankFailure)]
    if failures:
        return _Failed(failures), own
    try:
        return _Done(decide([item.value for item in gathered if isinstance(item, _Done)])), own
    except BaseException as error:  # every rank raises it
        return _Failed([_failure(error)], decided=True), error


def require_same(value: object, what: str) -> None:
    """Collective: return when ``value`` (small, comparable with ``==``) is the same on every
    rank, else raise RankMismatchError ``"{what}: [every rank's value]"`` on every rank. Costs
    a broadcast of rank 0's value and one 4-byte reduction when they agree."""
    reference = dist.broadcast_object(value, src=0)
    if dist.all_true(value == reference):
        return
    raise _agreed(RankMismatchError(f"{what}: {dist.all_gather_objects(value)}"))
