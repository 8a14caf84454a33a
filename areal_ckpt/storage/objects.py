"""The object-store contract.

An object store keeps immutable objects under keys; writing one key is atomic (a reader sees
the old object, the new one, or none), there is no rename, and the only conditional write we
rely on is create-only (``If-None-Match: *``: exactly one of several writers of a new key
wins). Compare-and-swap is not used: it had two winners in 8-11% of contended rounds on one
real server (see docs/storage.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

from areal_ckpt.errors import ConfigError, TransientError
from areal_ckpt.fsio import FileWriter
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)

_READ_PATIENCE_SECONDS = 30.0  # a server that answers "failing" (5xx) right after a restart recovers within seconds
T = TypeVar("T")
#: The variable that bounds how long one request waits for a store's answer (seconds).
TIMEOUT_VARIABLE = "AREAL_CKPT_STORAGE_TIMEOUT"
_DEFAULT_TIMEOUT = 30.0  # a stalled server costs a blocking dump about two minutes, not eight
_MOST_TIMEOUT = 86400.0


def request_timeout() -> float:
    """How long one request may wait for the server's answer, in seconds: ``$AREAL_CKPT_STORAGE_TIMEOUT``
    (default 30), read when a store is made; every store's client applies it to each read and
    retries a bounded number of times, so a server that stops answering becomes an error after
    a few times this, each retry logged. ConfigError naming the variable for a value that is
    not a positive number of at most a day (inf, NaN and 1e10 included). Pure."""
    value = os.environ.get(TIMEOUT_VARIABLE)
    if value is None or value == "":
        return _DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= _MOST_TIMEOUT:  # also refuses inf and NaN, which the clients' clocks cannot add
        raise ConfigError(
            f"{TIMEOUT_VARIABLE}={value!r}: give the seconds a request may wait, a positive number of at most "
            f"{_MOST_TIMEOUT:.0f} (a day)"
        )
    return seconds


class ServerFailingError(TransientError):
    """The server answered, but with a failure of its own (5xx, throttling): reads wait for it."""


def patiently(read: Callable[[], T]) -> T:
    """``read()`` (idempotent), tried again with back-off while the server answers with a
    failure of its own (:class:`ServerFailingError`), for up to 30 s, each wait logged; the
    client's own attempts come first. Blocking."""
    deadline, delay = time.monotonic() + _READ_PATIENCE_SECONDS, 0.5
    while True:
        try:
            return read()
        except ServerFailingError as failure:
            if time.monotonic() + delay > deadline:
                raise
            logger.warning("%s; trying again in %.1f s", failure, delay)
            time.sleep(delay)
            delay = min(2 * delay, 8.0)


def no_answer(error: BaseException, silent: str = "did not answer") -> str:
    """How a request that got no answer failed, for a message: the server "refused the
    connection" when nothing listens at the endpoint (a wrong endpoint, a server that is down;
    any error in ``error``'s chain says so), else ``silent``. Pure."""
    seen: BaseException | None = error
    for _ in range(16):  # a chain of causes is short; a loop in one ends here
        if seen is None:
            break
        if isinstance(seen, ConnectionRefusedError) or "Connection refused" in str(seen):
            return "refused the connection (nothing listens there: a wrong endpoint, or the server is down)"
        seen = seen.__cause__ or seen.__context__
    return silent


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key (from the bucket's root), its size in bytes and when it was
    written (Unix seconds)."""

    key: str
    size: int
    modified: float = 0.0


@runtime_checkable
class ObjectStore(Protocol):
    """What the object commit protocol needs of a store. Every method is blocking and local
    to the calling process (no collective); errors are CheckpointError naming the URL and the
    cause, TransientError where trying again may cure it (the server unreachable, a 5xx).
    KeyboardInterrupt and SystemExit pass through untouched."""

    url: ObjectURL
    #: Where the store is reached (a URL; the account's for Azure): part of the identity a
    #: local copy of one of its prefixes records (:mod:`areal_ckpt.storage.mirrors`).
    endpoint: str

    def check_access(self) -> None:
        """Raise CheckpointError naming the endpoint and bucket when the bucket cannot be
        listed (missing, no permission, wrong credentials, server unreachable)."""

    def put_file(self, key: str, path: Path) -> None:
        """Upload the local file ``path`` as ``key`` (parallel multipart when large); the key
        appears whole or not at all."""

    def put_bytes(self, key: str, data: bytes, create_only: bool = False) -> bool:
        """Store ``data`` as ``key``; with ``create_only``, only if no object has that key
        (False, nothing written, when one has)."""

    def open_writer(self, key: str) -> FileWriter:
        """A :class:`~areal_ckpt.fsio.FileWriter` of the object ``key``: the bytes go up from
        memory in parts as they are written (no local file), and the key appears whole when
        the writer is closed, or not at all."""

    def get_bytes(self, key: str) -> bytes | None:
        """The whole object ``key``, or None when there is none."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from offset ``start`` (fewer only at the object's end);
        CheckpointError naming the key when it is missing."""

    def get_file(self, key: str, path: Path) -> None:
        """Download ``key`` into the local file ``path`` (parallel ranged reads when large);
        CheckpointError naming the key when it is missing."""

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (read-after-write consistent)."""

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (missing ones are no error)."""

    def abort_uploads(self, prefix: str, spared: frozenset[str] = frozenset()) -> int:
        """Abort the unfinished multipart uploads under ``prefix`` (a dead writer's parts),
        except those under any prefix in ``spared`` (a live writer's); returns how many."""
