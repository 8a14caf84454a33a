"""When to checkpoint: epoch / step / seconds triggers, agreed by every rank.

Policy only: nothing here touches files. The schedule's state is JSON-serializable so that a
resumed run keeps its cadence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from areal_ckpt import dist

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


def warn_if_never_due(block: str, freq_epochs: int | None, freq_steps: int | None, freq_secs: float | None) -> None:
    """A warning on rank 0 naming ``block`` when none of its triggers is set: its checkpoints
    are then taken only when forced (AReaL's configs may say so on purpose, so it is no error).
    Local, non-blocking."""
    if freq_epochs is None and freq_steps is None and freq_secs is None and dist.rank() == 0:
        logger.warning(
            "%s: none of freq_epochs, freq_steps, freq_secs is set: nothing is saved unless a call passes "
            "force=True; set one of them in the %s: block",
            block,
            block,
        )


class TriggerSchedule:
    """Epoch, step and time triggers combined with OR; a trigger set to None never fires.

    The three triggers are independent, as in AReaL: with ``freq_steps=5`` the 5th, 10th, ...
    call fires whatever else fired in between, and the time trigger fires once ``freq_secs``
    seconds (monotonic clock) have passed since the time trigger last fired; a checkpoint taken
    for another cause, or forced, does not restart its clock. Count triggers are deterministic,
    so every rank computes them alone; the time trigger uses rank 0's clock, broadcast on every
    call (one small collective), so clocks that drift cannot split the ranks.
    """

    def __init__(
        self,
        freq_epochs: int | None,
        freq_steps: int | None,
        freq_secs: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.freq_epochs = freq_epochs
        self.freq_steps = freq_steps
        self.freq_secs = freq_secs
        self._clock = clock
        self._epochs_since = 0
        self._steps_since = 0
        self._last_time_fire = clock()

    def should_fire(self, epoch_ended: bool) -> bool:
        """Count one step (and an epoch if ``epoch_ended``); True when a checkpoint is due.

        Collective when ``freq_secs`` is set: all ranks must call it on the same steps.
        Otherwise local.
        """
        self._steps_since += 1
        if epoch_ended:
            self._epochs_since += 1
        fired = False
        if self.freq_steps is not None and self._steps_since >= self.freq_steps:
            self._steps_since = 0
            fired = True
        if self.freq_epochs is not None and epoch_ended and self._epochs_since >= self.freq_epochs:
            self._epochs_since = 0
            fired = True
        if self.freq_secs is not None:
            now = self._clock()
            if dist.broadcast_flag(now - self._last_time_fire >= self.freq_secs, src=0):
                self._last_time_fire = now
                fired = True
        return fired

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable counters and the seconds elapsed since the time trigger last fired."""
        return schedule_state(self._epochs_since, self._steps_since, self._clock() - self._last_time_fire)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters and the time trigger's elapsed seconds from :meth:`state_dict`."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"schedule state: unsupported version {state.get('version')!r}")
        self._epochs_since = int(state["epochs_since"])
        self._steps_since = int(state["steps_since"])
        self._last_time_fire = self._clock() - float(state["secs_since_last"])


def schedule_state(epochs_since: int, steps_since: int, secs_since_last: float) -> dict[str, Any]:
    """The state a :class:`TriggerSchedule` loads: epochs and steps since each trigger last
    fired and the seconds since the time trigger did; pure."""
    return {
        "version": _STATE_VERSION,
        "epochs_since": epochs_since,
        "steps_since": steps_since,
        "secs_since_last": secs_since_last,
    }


class NamedSchedules:
    """One independent :class:`TriggerSchedule` per model name (``actor``, ``critic``, ...)."""

    def __init__(self, factory: Callable[[], TriggerSchedule]) -> None:
        self._factory = factory
        self._schedules: dict[str, TriggerSchedule] = {}

    def __getitem__(self, name: str) -> TriggerSchedule:
        if name not in self._schedules:
            self._schedules[name] = self._factory()
        return self._schedules[name]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state of every schedule, by name."""
        return {name: schedule.state_dict() for name, schedule in sorted(self._schedules.items())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every named schedule from :meth:`state_dict`."""
        for name, schedule_state in state.items():
            self[name].load_state_dict(schedule_state)
