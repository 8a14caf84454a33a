"""Capture and restore the loop's stateful helpers: saver, evaluator, stats logger, dataloader.

Anything with ``state_dict()`` / ``load_state_dict()`` works; all of these are optional. Local.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.state.sampler import ORDER_KEYS, ResumableDistributedSampler, check_position, check_same_order

logger = logging.getLogger(__name__)

#: Recorded instead of a dataloader's state when a dump follows an epoch's last step.
EPOCH_COMPLETE = "areal_ckpt_epoch_complete"
#: Keys of a dataloader state over a ResumableDistributedSampler: its position and the loader's state.
RESUMABLE_POSITION = "areal_ckpt_resumable_position"
LOADER_STATE = "loader"
#: A global position handed to a rank of a job on another number of ranks.
RESHARDED = "areal_ckpt_resharded_position"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def capture_components(
    saver: Stateful | None, evaluator: Stateful | None, stats_logger: Stateful | None
) -> dict[str, Any]:
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
    so the marker tells :func:`restore_components` to leave the loader fresh. A loader over a
    :class:`ResumableDistributedSampler` also records the sampler's position (samples consumed:
    batches yielded times the batch size), which any number of ranks can resume.
    """
    if dataloader is None:
        return None
    if epoch_ended:
        return {EPOCH_COMPLETE: True}
    state = dataloader.state_dict()
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(sampler, ResumableDistributedSampler):
        yielded = state.get("_num_yielded") if isinstance(state, dict) else None
        batch_size = getattr(dataloader, "batch_size", None)
        consumed = yielded * batch_size if isinstance(yielded, int) and isinstance(batch_size, int) else None
        return {RESUMABLE_POSITION: sampler.position(consumed), LOADER_STATE: state}
    return state


def resharded_dataloader_state(epoch: int, start: int, order: dict[str, Any]) -> dict[str, Any]:
    """The dataloader state a rank of a job on another number of ranks restores: the global
    position, and what ordered the data (:data:`ORDER_KEYS` of the saved position), to be
    compared with the live sampler (see :func:`check_dataloader_state`)."""
    return {RESHARDED: {"epoch": epoch, "start": start, **{key: order[key] for key in ORDER_KEYS}}}


def check_dataloader_state(source: str, state: Any, dataloader: Stateful | None) -> None:
    """Raise CheckpointError naming ``source`` unless ``dataloader`` can take ``state`` as a
    ResumableDistributedSampler's position: a well-formed position (:func:`check_position`)
    saved by a sampler that orders the data as this loader's does (:func:`check_same_order`).
    Other states pass (their loader checks them). Pure: nothing is restored."""
    if dataloader is None or not isinstance(state, dict) or not (RESHARDED in state or RESUMABLE_POSITION in state):
        return
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(sampler, ResumableDistributedSampler):
        raise CheckpointError(
            f"{source}: the dataloader was saved over a ResumableDistributedSampler; give it one "
            f"again (this one has {type(sampler).__name__})"
        )
    try:
        saved = state[RESHARDED] if RESHARDED in state else check_position(state[RESUMABLE_POSITION], source)
        check_same_order(saved, sampler, source)
    except ValueError as error:
        raise CheckpointError(str(error)) from None


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
        if label == "dataloader" and isinstance(state, dict) and (RESHARDED in state or RESUMABLE_POSITION in state):
            _restore_resumable(source, target, state)
            continue
        try:
            target.load_state_dict(state)
        except Exception as error:  # a forged or mismatched state: name where it came from
            raise CheckpointError(
                f"{source}: the {label} could not load its saved state: {type(error).__name__}: {error}"
            ) from None


def _restore_resumable(source: str, dataloader: Any, state: dict[str, Any]) -> None:
    """Same world size: the sampler's position, then the loader's own state (they agree). Another
    world size: the sampler resumes the epoch at the global position; the loader starts fresh."""
    check_dataloader_state(source, state, dataloader)
    sampler = dataloader.sampler
    if RESHARDED in state:
        position = state[RESHARDED]
        sampler.resume_at(int(position["epoch"]), int(position["start"]))
        logger.log(
            dist.job_info(),
            "%s: data resumes at sample %d of epoch %d's order, across %d ranks",
            source,
            position["start"],
            position["epoch"],
            sampler.num_replicas,
        )
        return
    position = state[RESUMABLE_POSITION]
    sampler.resume_at(int(position["epoch"]), int(position["start"]))
    try:
        dataloader.load_state_dict(state[LOADER_STATE])
    except Exception as error:
        raise CheckpointError(
            f"{source}: the dataloader could not load its saved state: {type(error).__name__}: {error}"
        ) from None
