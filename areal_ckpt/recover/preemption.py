"""Preemption: a signal means "dump at the end of this step, then exit".

Spot instances, SLURM (``--signal=B:USR1@120``, or SIGTERM before its kill) and Kubernetes
(SIGTERM, then SIGKILL after ``terminationGracePeriodSeconds``) warn a job before they end it.
With ``recover.preemption_signals`` set, the RecoverHandler installs a handler for each of those
signals that only records its arrival (so nothing runs inside a signal handler, and a second
signal, during the dump or not, changes nothing). At every ``dump()`` call, the step boundary,
the ranks agree (one small all-reduce) whether any rank received one; if so every rank dumps
that step, forced and written in the calling process (it is waited for anyway; a dump still in
the background writer is finished first), and then:

- when the loop has asked (read :attr:`RecoverHandler.preempted` before), ``dump`` returns and
  ``preempted`` is True: the loop stops cleanly and exits as it likes;
- otherwise the handler closes itself and raises ``SystemExit(128 + N)`` for signal N: the
  status a shell reports for a process that signal ended, which torchrun's elastic agent, SLURM
  and Kubernetes treat as a failure to restart from.

A signal that arrives while a dump is being written is seen when that dump ends: the step just
dumped is the preemption dump. The handlers are installed from the main thread only (Python's
rule); from another thread a warning says preemption is off.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from areal_ckpt import dist

logger = logging.getLogger(__name__)


class PreemptionSignals:
    """The signals that ask this process to dump and exit, and whether one arrived. Local
    (installing and reading); :meth:`agreed` is the collective."""

    def __init__(self, names: Sequence[str]) -> None:
        self.numbers = [int(signal.Signals[name]) for name in names]  # names checked by RecoverConfig
        self._received: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}
        if threading.current_thread() is not threading.main_thread():
            logger.warning("preemption_signals: RecoverHandler made outside the main thread; signals are not watched")
            return
        for number in self.numbers:
            self._previous[number] = signal.signal(number, self._record)

    #: Set once a preemption dump was made; read by the loop through RecoverHandler.preempted.
    preempted = False
    #: Whether the loop has read RecoverHandler.preempted: then a preemption dump returns.
    asked = False

    def _record(self, number: int, frame: FrameType | None) -> None:
        if self._received is None:
            self._received = number

    def agreed(self) -> int | None:
        """Collective (every rank, at the same call): the signal any rank received, or None.
        Blocking for one small all-reduce."""
        received = dist.all_reduce_ints([self._received or 0], "max")[0]
        return received or None

    def restore(self) -> None:
        """Put back the handlers that were there before (idempotent); local."""
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def after_dump(
        self, path: str, global_step: int, signalled: int | None, wait: Callable[[], None], close: Callable[[], None]
    ) -> str:
        """Collective, after every dump (``signalled``: what :meth:`agreed` said before it): when
        a signal came, before the dump or while it was written, ``wait`` until the dump is
        durable, log it on rank 0, then return ``path`` to a loop that asks, or ``close`` the
        handler and raise ``SystemExit(128 + signal)``. Otherwise returns ``path`` at once."""
        signalled = signalled or self.agreed()
        if signalled is None:
            return path
        wait()
        self.preempted = True
        name = signal.Signals(signalled).name
        if dist.rank() == 0:
            logger.warning(
                "%s received: recovery checkpoint of global step %d saved (%s); %s",
                name, global_step, path, "the loop stops" if self.asked else f"exiting with {128 + signalled}",
            )  # fmt: skip
        if self.asked:
            return path
        close()
        raise SystemExit(128 + signalled)
