"""The one retry policy of a recovery dump: what is retried, how often, how long between tries."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from areal_ckpt.errors import CheckpointError, TransientError

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FIRST_DELAY_SECONDS = 0.5
_MAX_DELAY_SECONDS = 10.0


def retried(attempt: Callable[[], T], retries: int, what: str, give_up: Callable[[], None] | None = None) -> T:
    """``attempt()``, tried again up to ``retries`` times while it raises TransientError, with
    back-off (0.5 s, doubling, at most 10 s between tries).

    Collective when ``attempt`` is: a TransientError comes out of an agreement (every rank
    raises it together, see :mod:`areal_ckpt.agree`), so every rank retries together. Anything
    else (KeyboardInterrupt, SystemExit, a lost peer, a refusal) is raised at once, never
    retried. After the last failed try, runs ``give_up`` and raises CheckpointError:
    ``"{what} failed after N attempts: <last failure>; the previous checkpoint is intact"``.
    """
    for tried in range(1, retries + 2):
        try:
            return attempt()
        except TransientError as failure:
            if tried > retries:
                if give_up is not None:
                    give_up()
                raise CheckpointError(
                    f"{what} failed after {tried} attempts: {failure}; the previous checkpoint is intact"
                ) from failure
            delay = min(_FIRST_DELAY_SECONDS * 2 ** (tried - 1), _MAX_DELAY_SECONDS)
            logger.warning("%s: attempt %d failed (%s); retrying in %.1f s", what, tried, failure, delay)
            time.sleep(delay)
    raise AssertionError("unreachable: the last try returns or raises")
