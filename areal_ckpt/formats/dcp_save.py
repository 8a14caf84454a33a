"""Save flat tensor dicts as DCP checkpoints: DCP's planner, our protocol between ranks.

DCP's default planner decides who writes what (a replicated tensor by one rank, each rank its
chunks of a sharded one) and builds the global metadata; :mod:`areal_ckpt.formats.dcp_storage`
decides how the bytes land. The exchange between ranks is ours rather than ``dcp.save``'s, for
scale: ``dcp.save`` sends every rank's plan to rank 0 and back on every save, then broadcasts
the whole global metadata (every chunk of every rank) to every rank, so each rank receives
O(world size) bytes per save. Here:

- the global plan is made once per ``plan_key`` and reused while every rank's local plan is
  unchanged (same names, shapes, dtypes and shardings: every save of a training run after the
  first); checking that costs one 4-byte reduction;
- the write results go to rank 0 only (a gather), which alone builds and writes the metadata;
- rank 0 tells every rank the outcome (a few bytes).

A non-zero rank's traffic per save is therefore O(its own tensors), independent of the world
size (docs/scale.md measures it). A failure on any rank raises the same CheckpointError on
every rank; a KeyboardInterrupt / SystemExit on any rank stops every rank the same way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_storage import RawStorageWriter
from areal_ckpt.fsio import FileRecord


@dataclasses.dataclass(frozen=True)
class _Failure:
    """One rank's failure in a save step, as sent to the other ranks."""

    rank: int
    text: str
    interrupt: str | None  # "KeyboardInterrupt" / "SystemExit", never converted or retried


@dataclasses.dataclass
class _CachedPlan:
    """A global plan made by an earlier save, valid while the local plans stay the same."""

    placement: tuple[int, int]  # (rank, world size) it was made for
    local_items: list[WriteItem]
    central: SavePlan  # this rank's part of the global plan
    metadata: Metadata | None  # rank 0: the global metadata (storage positions are refilled)


_PLANS: dict[str, _CachedPlan] = {}


def save_tensors(
    tensors: dict[str, torch.Tensor],
    folder: Path,
    param_groups: list[dict[str, Any]] | None = None,
    plan_key: str | None = None,
) -> dict[str, FileRecord]:
    """Collective: every rank saves its part of ``tensors`` (flat name -> Tensor / DTensor) into ``folder``.

    ``model.<fqn>`` and ``optim.<fqn>.<key>`` are stored as an AReaL engine stores them, any
    other name ``n`` as ``dcp.n`` (:data:`~areal_ckpt.formats.dcp_metadata.STORED_PREFIXES`).
    ``param_groups`` (the optimizer's, as ``get_optimizer_state_dict`` gives them; the same on
    every rank) are stored for stock readers only. Each rank writes and fsyncs its own
    ``__{rank}_0.distcp`` and returns its record (file name -> size and CRC-32, computed while
    writing); rank 0 also writes ``dcp_metadata.json`` and ``.metadata``. Saves with the same
    ``plan_key`` (e.g. one model's dumps) reuse the global plan while nothing changed. Blocking;
    the folder's entries are made durable by the caller's commit. Raises CheckpointError on
    every rank when any rank failed, naming each rank and its cause.
    """
    non_tensors = [name for name, value in tensors.items() if not isinstance(value, torch.Tensor)]
    if non_tensors:
        raise CheckpointError(f"only tensors go through DCP; not tensors: {non_tensors[:5]}")
    writer = RawStorageWriter(folder)
    planner = DefaultSavePlanner()
    central, metadata = _plan(_stored_layout(tensors, param_groups), writer, planner, plan_key, folder)
    results: Any = None
    own: BaseException | None = None
    try:
        results = writer.write_data(planner.finish_plan(central), planner).value()
    except BaseException as error:  # reported to rank 0 below, so every rank ends the same way
        own, results = error, _failure_of(error)
    gathered = dist.gather_objects(results, dst=0)
    outcome: list[_Failure] | None = None
    if gathered is not None:
        outcome = [item for item in gathered if isinstance(item, _Failure)] or None
        if outcome is None:
            try:
                writer.finish(metadata, gathered)
            except Exception as error:
                outcome = [_failure_of(error)]
    outcome = dist.broadcast_object(outcome, src=0)
    if outcome:
        _raise_agreed(outcome, own, folder)
    return {writer.file_name: writer.record}


def _plan(
    state: dict[str, Any], writer: RawStorageWriter, planner: DefaultSavePlanner, plan_key: str | None, folder: Path
) -> tuple[SavePlan, Metadata | None]:
    """This rank's part of the global plan (and, on rank 0, the global metadata): the cached one
    when every rank's local plan is unchanged, else made by rank 0 from all local plans.
    Collective."""
    placement = (dist.rank(), dist.world_size())
    cached = _PLANS.get(plan_key) if plan_key is not None else None
    local: Any = None
    own: BaseException | None = None
    try:
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=placement[0] == 0)
        writer.set_up_storage_writer(placement[0] == 0)
        local = writer.prepare_local_plan(planner.create_local_plan())
        unchanged = cached is not None and cached.placement == placement and cached.local_items == local.items
    except BaseException as error:  # reported below, so every rank ends the same way
        own, local, unchanged = error, _failure_of(error), False
    if dist.all_true(unchanged) and cached is not None:
        return cached.central, cached.metadata
    plans = dist.gather_objects(local, dst=0)
    answers: list[Any] | None = None
    metadata: Metadata | None = None
    if plans is not None:
        failures = [plan for plan in plans if isinstance(plan, _Failure)]
        if not failures:
            try:
                global_plans, metadata = planner.create_global_plan(plans)
                answers = writer.prepare_global_plan(global_plans)
            except Exception as error:
                failures = [_failure_of(error)]
        if failures:
            answers = [failures] * len(plans)
    answer = dist.scatter_objects(answers, src=0)
    if isinstance(answer, list):
        _raise_agreed(answer, own, folder)
    if plan_key is not None:
        _PLANS[plan_key] = _CachedPlan(placement, list(local.items), answer, metadata)
    return answer, metadata


def _failure_of(error: BaseException) -> _Failure:
    interrupt = type(error).__name__ if isinstance(error, (KeyboardInterrupt, SystemExit)) else None
    text = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    return _Failure(dist.rank(), f"rank {dist.rank()}: {text}", interrupt)


def _raise_agreed(failures: list[_Failure], own: BaseException | None, folder: Path) -> None:
    """Raise what every rank raises for ``failures``: this rank's own interruption, or one of the
    same type naming the rank it hit, or CheckpointError naming each failed rank."""
    interrupted = [failure for failure in failures if failure.interrupt is not None]
    if interrupted:
        if isinstance(own, (KeyboardInterrupt, SystemExit)):
            raise own
        first = interrupted[0]
        kind = KeyboardInterrupt if first.interrupt == "KeyboardInterrupt" else SystemExit
        raise kind(f"rank {first.rank} was interrupted while writing DCP shards")
    raise CheckpointError(f"{folder}: writing DCP shards failed: {'; '.join(f.text for f in failures)}")


def _stored_layout(tensors: dict[str, torch.Tensor], param_groups: list[dict[str, Any]] | None) -> dict[str, Any]:
    """``tensors`` nested as ``{"dcp": {"model": {fqn: t}, "optim": {"state": {fqn: {key: t}},
    "param_groups": [...]}}}``, which DCP flattens to the names of ``STORED_PREFIXES``."""
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    others: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            model[name.removeprefix("model.")] = tensor
        elif name.startswith("optim."):
            fqn, _, key = name.removeprefix("optim.").rpartition(".")
            state.setdefault(fqn, {})[key] = tensor
        elif name in ("model", "optim"):
            raise CheckpointError(f"{name!r}: a stored tensor cannot be named like a group of tensors")
        else:
            others[name] = tensor
    stored: dict[str, Any] = {"model": model, **others}
    if state or param_groups:
        stored["optim"] = {"state": state, **({"param_groups": param_groups} if param_groups else {})}
    return {"dcp": stored}
