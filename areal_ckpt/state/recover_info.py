"""The ``recover_info/`` folder: step counters, component states and per-rank state, as JSON.

Global files are written by rank 0: step_info.json, saver_info.json, evaluator_info.json,
stats_logger_info.json, checkpoint_info.json. Each rank writes its own ``rank{r}.json``
(RNG streams, dataloader position, client state). All values go through
:mod:`areal_ckpt.state.safe_json`: nothing here can run code when read.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import read_json_file
from areal_ckpt.paths import GLOBAL_FILES, STEP_FILE, rank_state_file
from areal_ckpt.state import safe_json
from areal_ckpt.state.components import (
    EPOCH_COMPLETE,
    RESUMABLE_POSITION,
    resharded_dataloader_state,
)
from areal_ckpt.state.rng import fresh_rng_state
from areal_ckpt.state.sampler import global_position
from areal_ckpt.step import StepInfo

logger = logging.getLogger(__name__)

RANK_COMPONENTS = ("dataloader", "rng", "client_state")


@dataclass
class RecoverInfo:
    """What a resumed loop needs besides the restored objects: where to continue, and its state.

    ``last_step_info`` is the step the dump was taken after: continue at ``.next()``.
    ``dataloader_info`` and ``client_state`` are this rank's. The first six fields are AReaL's,
    in AReaL's order.
    """

    last_step_info: StepInfo
    saver_info: dict[str, Any] | None = None
    evaluator_info: dict[str, Any] | None = None
    stats_logger_info: dict[str, Any] | None = None
    dataloader_info: Any = None
    checkpoint_info: dict[str, Any] | None = None
    client_state: dict[str, Any] = field(default_factory=dict)
    rng_state: Any = None
    world_size: int = 1
    path: str = ""


def encode_global_info(step_info: StepInfo, states: dict[str, Any]) -> dict[str, bytes]:
    """Rank 0's files: step_info.json and the ``*_info.json`` files (null for absent
    components), name -> content; pure. Raises ValueError for a value JSON cannot hold."""
    files = {STEP_FILE: json.dumps(step_info.to_dict(), indent=1).encode()}
    files.update({file_name: safe_json.dumps(states.get(key)) for key, file_name in GLOBAL_FILES.items()})
    return files


def encode_rank_state(rank: int, components: dict[str, Any]) -> tuple[str, bytes]:
    """Every rank's own ``rank{r}.json``: (file name, content); pure. Raises ValueError for an
    unknown component or a value JSON cannot hold."""
    unknown = set(components) - set(RANK_COMPONENTS)
    if unknown:
        raise ValueError(f"unknown per-rank components {sorted(unknown)}")
    return rank_state_file(rank), safe_json.dumps(components)


def _read_json(path: Path) -> Any:
    return read_json_file(path, "state file")[1]


def _decode(value: Any, source: str) -> Any:
    """:func:`safe_json.decode`, its errors (deep nesting included) as CheckpointError."""
    try:
        return safe_json.decode(value, source)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    except RecursionError:
        raise CheckpointError(f"{source}: nested too deeply") from None


def _rank_object(state: Any, path: Path) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected an object with {list(RANK_COMPONENTS)}, got {type(state).__name__}")
    return state


def read_recover_info(
    folder: Path, rank: int, world_size: int, saved_world_size: int, policy: str = "refuse"
) -> RecoverInfo:
    """Read ``recover_info/`` for ``rank`` of a job of ``world_size`` ranks; read-only. Local
    when the world size is the saved one, else collective (:func:`_resharded_components`).

    When the world size changed, the dataloader position carries over only as a
    ResumableDistributedSampler's global position (see :func:`_resharded_dataloader`); each other
    per-rank component is re-assigned only if every saved rank had the same value. Otherwise
    CheckpointError explains how to proceed, unless ``policy`` (``recover.on_world_size_change``)
    says otherwise: ``fresh_rng`` gives each rank a fresh RNG stream derived from the checkpoint
    and its rank (other differing components are still refused); ``drop_rank_state`` leaves every
    differing component out (None), with a warning naming it.
    """
    try:
        step_info = StepInfo.from_dict(_read_json(folder / STEP_FILE))
        step_info.check_completed()
    except ValueError as error:
        raise CheckpointError(f"{folder / STEP_FILE}: invalid step info: {error}") from None
    info = RecoverInfo(last_step_info=step_info, world_size=saved_world_size, path=str(folder.parent))
    for key, file_name in GLOBAL_FILES.items():
        setattr(info, key, _decode(_read_json(folder / file_name), str(folder / file_name)))
    if info.checkpoint_info is not None and not isinstance(info.checkpoint_info, dict):
        raise CheckpointError(f"{folder / GLOBAL_FILES['checkpoint_info']}: expected an object")
    components = _rank_components(folder, rank, world_size, saved_world_size, policy)
    info.dataloader_info = components.get("dataloader")
    info.rng_state = components.get("rng")
    info.client_state = components.get("client_state") or {}
    return info


def _summary(component: str, value: Any) -> Any:
    """What must be the same on every saved rank for ``component`` to carry to another world
    size: the value itself; for a dataloader's position over a ResumableDistributedSampler, that
    position; for any other dataloader position, only its kind (it is refused or dropped)."""
    if component != "dataloader" or value is None:
        return value
    if isinstance(value, dict) and value.get(EPOCH_COMPLETE):
        return value
    if isinstance(value, dict) and RESUMABLE_POSITION in value:
        return {"resumable": value[RESUMABLE_POSITION]}
    return "per-rank position"


def _digest(summary: Any) -> int:
    data = json.dumps(summary, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


def _saved_share(rank: int, world_size: int, saved_world_size: int) -> list[int]:
    """The saved ranks whose files ``rank`` reads after a world-size change: every
    ``world_size``-th one, or (more ranks than before) one, so each reads O(saved / now) files."""
    return [saved for saved in range(saved_world_size) if saved % world_size == rank] or [rank % saved_world_size]


def _resharded_components(
    folder: Path, rank: int, world_size: int, saved_world_size: int, policy: str
) -> dict[str, Any]:
    """The per-rank components ``rank`` restores after the world size changed. Collective: each
    rank reads its share of the saved ``rank{r}.json`` files, and the ranks agree whether each
    component is the same on every saved rank by reducing digests (min and max), so no rank
    reads or receives O(saved ranks) data. A component that is the same everywhere carries over
    (a ResumableDistributedSampler's position as a global position, see
    :func:`_resharded_dataloader`); one that differs raises CheckpointError saying what to do,
    or is handled as ``policy`` says (see :func:`read_recover_info`)."""

    def read_share() -> dict[int, dict[str, Any]]:
        shares = {}
        for index in _saved_share(rank, world_size, saved_world_size):
            path = folder / rank_state_file(index)
            shares[index] = _rank_object(_read_json(path), path)
        return shares

    saved = agree.on_every_rank(read_share, f"{folder}: per-rank state cannot be read")
    digests = [[_digest(_summary(c, state.get(c))) for c in RANK_COMPONENTS] for state in saved.values()]
    lowest = dist.all_reduce_ints([min(column) for column in zip(*digests)], "min")
    highest = dist.all_reduce_ints([max(column) for column in zip(*digests)], "max")
    mine = next(iter(saved.values()))
    components: dict[str, Any] = {}
    for component, low, high in zip(RANK_COMPONENTS, lowest, highest):
        value = mine.get(component)
        if component == "dataloader":
            components[component] = _resharded_dataloader(
                folder, value if low == high else None, low == high, saved_world_size, world_size, policy
            )
        elif low == high:
            components[component] = _decode(value, f"{folder}/rank*.json:{component}")
        elif component == "rng" and policy == "fresh_rng":
            components[component] = fresh_rng_state(_digest([low, high, rank, world_size]))
            if rank == 0:
                logger.warning(
                    "world size changed (%d -> %d): per-rank RNG streams cannot carry over; each rank starts a fresh "
                    "stream derived from the checkpoint and its rank (recover.on_world_size_change: fresh_rng)",
                    saved_world_size,
                    world_size,
                )
        elif policy == "drop_rank_state":
            logger.warning(
                "world size changed (%d -> %d): per-rank %s state differs between saved ranks; "
                "not restored (drop_rank_state)",
                saved_world_size,
                world_size,
                component,
            )
        else:
            fresh = " (for RNG streams alone, recover.on_world_size_change: fresh_rng)" if component == "rng" else ""
            raise CheckpointError(
                f"{folder}: saved by {saved_world_size} ranks, loading on {world_size}: the per-rank "
                f"{component} state differs between the saved ranks, so it cannot be re-assigned. "
                f"Resume with {saved_world_size} ranks, or set recover.on_world_size_change: drop_rank_state (or "
                "pass drop_rank_state=True to RecoverHandler.load) to restore weights, optimizer and counters "
                f"without the per-rank state{fresh}."
            )
    return components


def _resharded_dataloader(
    folder: Path, value: Any, same: bool, saved_world_size: int, world_size: int, policy: str
) -> Any:
    """The dataloader state a rank restores after the world size changed, given one saved rank's
    ``value`` and whether every saved rank's summary is the same. A ResumableDistributedSampler's
    position carries over exactly (as a global position); "epoch complete" markers carry over as
    they are; any other per-rank position cannot (its sampler's order depends on the number of
    ranks): CheckpointError saying what to do, or, with policy ``drop_rank_state``, nothing (the loop
    restarts the saved epoch's data), logged."""
    if same and value is None:
        return None
    summary = _summary("dataloader", value) if same else None
    if isinstance(summary, dict) and summary.get(EPOCH_COMPLETE):
        return _decode(value, f"{folder}/rank*.json:dataloader")
    if isinstance(summary, dict):
        try:
            epoch, start = global_position([value[RESUMABLE_POSITION]] * saved_world_size, f"{folder}/rank*.json")
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        logger.log(
            dist.job_info(),
            "world size changed (%d -> %d): the data resumes at sample %d of epoch %d's order",
            saved_world_size,
            world_size,
            start,
            epoch,
        )
        return resharded_dataloader_state(epoch, start, value[RESUMABLE_POSITION])
    if policy == "drop_rank_state":
        logger.warning(
            "world size changed (%d -> %d): the dataloader position was not restored (drop_rank_state): "
            "the saved epoch's data restarts from its first batch",
            saved_world_size,
            world_size,
        )
        return None
    why = (
        "the saved ranks were at different data positions"
        if not same
        else "the dataloader position is per rank and its sampler's order depends on the number of ranks"
    )
    raise CheckpointError(
        f"{folder}: saved by {saved_world_size} ranks, loading on {world_size}: {why}, so it cannot carry over "
        "without skipping or repeating samples. Use areal_ckpt.ResumableDistributedSampler (its position carries "
        "to any number of ranks), or set recover.on_world_size_change: drop_rank_state (or pass drop_rank_state=True "
        "to RecoverHandler.load) to restart the saved "
        "epoch's data from its first batch."
    )


def _rank_components(folder: Path, rank: int, world_size: int, saved_world_size: int, policy: str) -> dict[str, Any]:
    if saved_world_size == world_size:
        path = folder / rank_state_file(rank)
        return _rank_object(_decode(_read_json(path), str(path)), path)
    return _resharded_components(folder, rank, world_size, saved_world_size, policy)
