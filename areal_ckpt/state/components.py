"""Capture and restore the loop's stateful helpers: saver, evaluator, stats logger, dataloader.

Anything with ``state_dict()`` / ``load_state_dict()`` works; all of these are optional. Local.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from areal_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)

#: Recorded instead of a dataloader's state when a dump follows an epoch's last step.
EPOCH_COMPLETE = "areal_ckpt_epoch_complete"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def capture_components(saver: Stateful | None, evaluator: Stateful | None,
                       stats_logger: Stateful | None) -> dict[str, Any]:
    """The states that go to ``recover_info/{saver,evaluator,stats_logger}_info.json`` (None if absent)."""
    return {
        "saver_info": saver.state_dict() if saver is not None else None,
        "evaluator_info": evaluator.state_dict() if evaluator is not None else None,
        "stats_logger_info": stats_logger.state_dict() if stats_logger is not None else None,
    }


def dataloader_state(dataloader: Stateful | None, epoch_ended: bool) -> Any:
    """The dataloader's position, or the "epoch complete" marker after an epoch's last step.

    After its last batch a stateful loader's state still says "inside this epoch", and
    restoring it would yield an empty epoch; the resumed loop starts the next epoch instead,
    so the marker tells :func:`restore_components` to leave the loader fresh.
    """
    if dataloader is None:
        return None
    if epoch_ended:
        return {EPOCH_COMPLETE: True}
    return dataloader.state_dict()


def restore_components(source: str, states: dict[str, Any], targets: dict[str, Stateful | None]) -> None:
    """Load each target's saved state (keys as in ``targets``: saver, evaluator, stats_logger,
    dataloader); a target whose state was not saved starts fresh, with a warning naming ``source``."""
    for label, target in targets.items():
        if target is None:
            continue
        state = states.get(label)
        if state is None:
            logger.warning("%s: no %s state in the checkpoint; it starts fresh", source, label)
            continue
        if label == "dataloader" and isinstance(state, dict) and state.get(EPOCH_COMPLETE):
            continue
        try:
            target.load_state_dict(state)
        except Exception as error:  # a forged or mismatched state: name where it came from
            raise CheckpointError(
                f"{source}: the {label} could not load its saved state: {type(error).__name__}: {error}"
            ) from None
