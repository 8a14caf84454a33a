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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_storage import RawStorageWriter
from areal_ckpt.formats.replicas import check_replicas, check_replicas_sampled, fingerprints
from areal_ckpt.fsio import FileRecord, FileWriter


@dataclasses.dataclass
class _CachedPlan:
    """A global plan made by an earlier save, valid while the local plans stay the same."""

    placement: tuple[int, int]  # (rank, world size) it was made for
    local_items: list[WriteItem]
    central: SavePlan  # this rank's part of the global plan
    metadata: Metadata | None  # rank 0: the global metadata (storage positions are refilled)
    replicated: list[str]  # names every rank holds as plain tensors, checked again at each save


_PLANS: dict[str, _CachedPlan] = {}


def save_tensors(
    tensors: dict[str, torch.Tensor],
    folder: Path,
    param_groups: list[dict[str, Any]] | None = None,
    plan_key: str | None = None,
    open_writer: Callable[[Path], FileWriter] | None = None,
) -> dict[str, FileRecord]:
    """Collective: every rank saves its part of ``tensors`` (flat name -> Tensor / DTensor) into ``folder``.

    ``model.<fqn>`` and ``optim.<fqn>.<key>`` are stored as an AReaL engine stores them, any
    other name ``n`` as ``dcp.n`` (:data:`~areal_ckpt.formats.dcp_names.STORED_PREFIXES`).
    ``param_groups`` (the optimizer's, as ``get_optimizer_state_dict`` gives them; the same on
    every rank) are stored for stock readers only. Each rank writes and fsyncs its own
    ``__{rank}_0.distcp`` (and its chunk file, :mod:`areal_ckpt.formats.dcp_slices`) and returns
    their records (file name -> size and CRC-32, computed while writing); rank 0 also writes
    ``dcp_metadata.json``, ``dcp_index.json`` and ``.metadata``. Saves with the same
    ``plan_key`` (e.g. one model's dumps) reuse the global plan while nothing changed. Blocking;
    the folder's entries are made durable by the caller's commit. Raises CheckpointError on
    every rank when any rank failed, naming each rank and its cause. ``open_writer`` makes the
    writer of this rank's data file (see :class:`~areal_ckpt.formats.dcp_storage.RawStorageWriter`).
    """
    non_tensors = [name for name, value in tensors.items() if not isinstance(value, torch.Tensor)]
    if non_tensors:
        raise CheckpointError(f"only tensors go through DCP; not tensors: {non_tensors[:5]}")
    writer = RawStorageWriter(folder, open_writer)
    planner = DefaultSavePlanner()
    central, metadata = _plan(tensors, _stored_layout(tensors, param_groups), writer, planner, plan_key, folder)
    agree.gathered_then_decided(  # the write results go to rank 0, which writes the metadata
        lambda: writer.write_data(planner.finish_plan(central), planner).value(),
        lambda results: writer.finish(_global(metadata, folder), results),
        f"{folder}: writing DCP shards failed",
    )
    if not writer.records:
        raise CheckpointError(f"{folder}: DCP planned no data file for rank {dist.rank()}")
    return writer.records


def _global(metadata: Metadata | None, folder: Path) -> Metadata:
    """Rank 0's global metadata (only rank 0 makes it, and only rank 0 writes it)."""
    if metadata is None:
        raise CheckpointError(f"{folder}: rank {dist.rank()} has no global DCP metadata to write")
    return metadata


def _plan(
    tensors: dict[str, torch.Tensor],
    state: dict[str, Any],
    writer: RawStorageWriter,
    planner: DefaultSavePlanner,
    plan_key: str | None,
    folder: Path,
) -> tuple[SavePlan, Metadata | None]:
    """This rank's part of the global plan (and, on rank 0, the global metadata): the cached one
    when every rank's local plan is unchanged, else made by rank 0 from all local plans. Either
    way only once the names several ranks hold have the same value on each (exactly when a plan
    is made, by samples when it is reused: :mod:`areal_ckpt.formats.replicas`). Collective."""
    placement = (dist.rank(), dist.world_size())
    cached = _PLANS.get(plan_key) if plan_key is not None else None
    local: SavePlan | None = None
    failure: BaseException | None = None
    try:
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=placement[0] == 0)
        writer.set_up_storage_writer(placement[0] == 0)
        local = writer.prepare_local_plan(planner.create_local_plan())
    except BaseException as error:  # sent to rank 0 below, so every rank ends the same way
        failure = error
    unchanged = (
        local is not None and cached is not None and cached.placement == placement and cached.local_items == local.items
    )
    if dist.all_true(unchanged) and cached is not None:
        check_replicas_sampled(tensors, cached.replicated, folder)
        return cached.central, cached.metadata
    metadata: list[Metadata] = []  # rank 0's global metadata, set by `decide`
    replicated: list[str] = []  # rank 0's names every rank holds, set by `decide`

    def contribute() -> tuple[SavePlan, dict[str, int]]:
        if failure is not None or local is None:
            raise failure or CheckpointError(f"{folder}: no local plan")
        return local, fingerprints(tensors) if dist.world_size() > 1 else {}

    def decide(contributions: list[tuple[SavePlan, dict[str, int]]]) -> list[tuple[SavePlan, list[str]]]:
        replicated.extend(check_replicas([prints for _, prints in contributions], folder))
        global_plans, global_metadata = planner.create_global_plan([plan for plan, _ in contributions])
        metadata.append(global_metadata)
        return [(plan, replicated) for plan in writer.prepare_global_plan(global_plans)]

    central, shared = agree.gathered_then_dealt(contribute, decide, f"{folder}: planning DCP shards failed")
    if plan_key is not None and local is not None:
        _PLANS[plan_key] = _CachedPlan(placement, list(local.items), central, metadata[0] if metadata else None, shared)
    return central, metadata[0] if metadata else None


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
