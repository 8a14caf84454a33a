"""ZeRO 1-3 optimizer state restored from a dump: into the dump's own partitions in place, or
into other partitions (another number of ranks, ZeRO 1 / 2 against 3) parameter by parameter.

Where a parameter's elements lie: under ZeRO 1 and 2 each parameter group is one flat buffer
(the parameters one after another, at the offsets the dump's master layout records, then
padding) that the ranks' partitions tile in rank order; under ZeRO-3 each parameter is split
into equal parts, rank r holding part r, and a rank's partition of a group is its parts of the
group's parameters one after another. A rank's fp32 masters and its optimizer's per-element
state (Adam's moments) are its partitions. A dump stores each rank's partitions whole, under
keys that name the rank, with the layout
(:meth:`~areal_ckpt.engines.deepspeed_engine.DeepSpeedEngine.recover_state`).

Into other partitions, each parameter is found by name in the saved layout and the elements of
this rank's partitions are copied from the saved partitions that hold them (:func:`plan_for`):
each rank reads only those (about its own share and two neighbours' under ZeRO 1 / 2), never the
whole optimizer, and the padding of its partitions is zero, as DeepSpeed makes it. Scalar state
(Adam's ``step``) is the same everywhere and is taken from the first saved partition read; a
ZeRO-3 dump that kept its fp32 masters as the weights gives them through the loaded weights.
Helpers of :class:`~areal_ckpt.engines.deepspeed_engine.DeepSpeedEngine`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from areal_ckpt import dist
from areal_ckpt.paths import OPTIM_PREFIX

Layout = list[list[dict[str, Any]]]


@dataclass(frozen=True)
class ZeroLayout:
    """Where the parameters lie in an engine's or a dump's partitions: the master layout and
    the ZeRO stage that reads it."""

    layout: Layout
    stage: int


@dataclass(frozen=True)
class Piece:
    """``length`` elements of this rank's partition of group ``group``, from ``start``: found at
    ``saved_start`` in saved rank ``saved_rank``'s partition of the saved group ``saved_group``."""

    group: int
    saved_group: int
    saved_rank: int
    saved_start: int
    start: int
    length: int


def other_optimizer(engine_state: dict[str, Any], optimizer: Any) -> str | None:
    """Why the ZeRO ``optimizer`` is not the one the dump's ``engine_state`` was saved from, in
    words naming both: another class (recorded since dumps name it) or another number of
    parameter groups; None when it may be (or for ZeRO 0, a torch optimizer's own state)."""
    inner = getattr(optimizer, "optimizer", None)
    if inner is None or "optimizer_param_groups" not in engine_state:
        return None
    saved, now = engine_state.get("optimizer_class"), type(inner).__name__
    if saved is not None and saved != now:
        return f"the optimizer state was saved from {saved} and cannot be loaded into {now}"
    groups = len(engine_state["optimizer_param_groups"])
    if groups != len(inner.param_groups):
        return f"the dump's optimizer has {groups} parameter groups and this {now} {len(inner.param_groups)}"
    return None


def refusal(saved: Layout | None, current: Callable[[], Layout]) -> str | None:
    """Why the optimizer partitions of a ZeRO 1-3 dump (its master layout ``saved``) cannot be
    mapped into an engine whose layout is ``current()``, in words; None when they can (the same
    parameters, by name and shape, whatever their groups)."""
    if saved is None:
        return "the dump records no master layout (expert-parallel)"
    before = {entry["name"]: list(entry["shape"]) for group in saved for entry in group}
    now = {entry["name"]: list(entry["shape"]) for group in current() for entry in group}
    differing = sorted(set(before) ^ set(now)) or sorted(name for name in now if before[name] != now[name])
    return f"the dump's parameters differ from this model's in {differing[:5]}" if differing else None


def allocate_state(
    state: dict[torch.Tensor, dict[str, Any]],
    masters: list[torch.Tensor],
    stored: dict[str, tuple[torch.dtype, tuple[int, ...]]],
) -> None:
    """The optimizer ``state`` of each of this rank's ``masters`` given every tensor the dump's
    index ``stored`` holds for them that it lacks (an optimizer that has not stepped), to be
    loaded into in place."""
    prefix = f"{OPTIM_PREFIX}rank{dist.rank()}.state."
    for name, (dtype, shape) in stored.items():
        if name.startswith(prefix):
            index, _, key = name[len(prefix) :].partition(".")
            entry = state.setdefault(masters[int(index)], {})
            if key not in entry:
                entry[key] = torch.empty(shape, dtype=dtype, device=masters[int(index)].device)


def plan_for(
    optimizer: Any,
    current: ZeroLayout,
    masters: list[torch.Tensor],
    saved: ZeroLayout,
    stored: dict[str, tuple[torch.dtype, tuple[int, ...]]],
) -> list[Piece]:
    """What fills this rank's partitions (``masters``, one per group; the engine's layout
    ``current``) of the ZeRO ``optimizer`` from the dump whose layout is ``saved`` and whose
    index is ``stored``: each parameter's elements this rank holds (under ZeRO 1 / 2 its part of
    the flat group, split as DeepSpeed splits it: equal parts in rank order, the remainder to the
    first ranks; under ZeRO-3 its own partition of each parameter), found where the dump kept
    them and split where the saved partitions meet. Local; reads nothing."""
    world, rank = dist.world_size(), dist.rank()
    if current.stage < 3:
        flats = [flat.numel() for flat in optimizer.bit16_groups_flat]
        starts = [rank * (total // world) + min(rank, total % world) for total in flats]
    bounds = [list(itertools.accumulate(_partition_sizes(stored, g), initial=0)) for g in range(len(saved.layout))]
    where = {entry["name"]: (group, entry) for group, entries in enumerate(saved.layout) for entry in entries}
    pieces = []
    for group, entries in enumerate(current.layout):
        for entry in entries:
            offset, numel = int(entry["offset"]), math.prod(entry["shape"])
            if current.stage == 3:  # this rank's partition of the parameter, at its offset in the group
                first = rank * int(entry["partition"])
                last, position = min(first + int(entry["partition"]), numel), offset
            else:  # the parameter's elements inside this rank's part of the group's flat buffer
                low, high = starts[group], starts[group] + masters[group].numel()
                first, last = max(offset, low) - offset, min(offset + numel, high) - offset
                position = offset + first - low
            saved_group, saved_entry = where[entry["name"]]
            while first < last:
                saved_rank, saved_start, run = _saved_at(saved_entry, saved.stage, bounds[saved_group], first)
                length = min(last - first, run)
                pieces.append(Piece(group, saved_group, saved_rank, saved_start, position, length))
                first, position = first + length, position + length
    return pieces


def _saved_at(entry: dict[str, Any], stage: int, bounds: list[int], element: int) -> tuple[int, int, int]:
    """Where element ``element`` of the (flattened) parameter ``entry`` of a saved layout lies:
    the saved rank, the position in its partition of the group, and how many elements follow it
    there before that partition ends."""
    if stage == 3:  # each rank holds the same-sized part of every parameter
        part = int(entry["partition"])
        return element // part, int(entry["offset"]) + element % part, part - element % part
    flat = int(entry["offset"]) + element
    rank = bisect.bisect_right(bounds, flat) - 1
    return rank, flat - bounds[rank], bounds[rank + 1] - flat


def _partition_sizes(stored: dict[str, tuple[torch.dtype, tuple[int, ...]]], group: int) -> list[int]:
    """The saved partitions' sizes of ``group``, in rank order, from the checkpoint's index
    (none where the dump kept its masters as the weights: a ZeRO-3 dump, where none is needed)."""
    sizes: list[int] = []
    while (key := f"{OPTIM_PREFIX}rank{len(sizes)}.master.{group}") in stored:
        sizes.append(math.prod(stored[key][1]))
    return sizes


def reshard_template(
    pieces: list[Piece],
    stored: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    groups: int,
) -> dict[str, torch.Tensor]:
    """Fresh tensors for the saved partitions ``pieces`` read from (masters, where the dump
    stored them, and state), plus saved rank 0's of the first group for a group of this rank's
    that no piece reads (its scalar state is still needed)."""
    sources = {(piece.saved_group, piece.saved_rank) for piece in pieces}
    if len({piece.group for piece in pieces}) < groups:
        sources.add((0, 0))
    template = {}
    for group, rank in sorted(sources):
        master, state = f"{OPTIM_PREFIX}rank{rank}.master.{group}", f"{OPTIM_PREFIX}rank{rank}.state.{group}."
        for name, (dtype, shape) in stored.items():
            if name == master or name.startswith(state):
                template[name] = torch.empty(shape, dtype=dtype)
    return template


def restore_optimizer(
    optimizer: Any,
    masters: list[torch.Tensor],
    loaded: dict[str, torch.Tensor],
    engine_state: dict[str, Any],
    pieces: list[Piece] | None,
) -> None:
    """Restore the ZeRO ``optimizer`` (its fp32 ``masters``, one per group) from a dump: the
    masters from the weights where the dump stored them once as such (ZeRO-3, fp32), and from the
    saved partitions as ``pieces`` map them into other partitions (None: ``loaded`` filled this
    rank's own in place); then the hyper-parameters, the scalar state, the loss scaler, and
    DeepSpeed's per-parameter state views linked. Local."""
    inner = optimizer.optimizer
    if engine_state.get("masters_in_model"):
        optimizer._restore_from_bit16_weights()  # the masters were stored once, as the weights
    if pieces is not None:  # a dump of other partitions: mapped into this rank's
        apply_pieces(pieces, loaded, masters, inner.state)
    for group, stored in zip(inner.param_groups, engine_state["optimizer_param_groups"], strict=True):
        group.update(stored)
    for index, master in enumerate(masters):
        scalars = engine_state["optimizer_scalars"]  # a dump of other groups: the same on each
        inner.state[master].update(scalars.get(str(index)) or scalars.get("0", {}))
    for field, value in engine_state["loss_scaler"].items():
        setattr(optimizer.loss_scaler, field, value)
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if callable(link):  # DeepSpeed links its per-parameter state views at its first step
        link()  # (safe_get_full_optimizer_state fails until then): link the loaded state now


@torch.no_grad()  # the masters are leaves that require grad
def apply_pieces(
    pieces: list[Piece],
    loaded: dict[str, torch.Tensor],
    masters: list[torch.Tensor],
    state: dict[torch.Tensor, dict[str, Any]],
) -> None:
    """Fill this rank's fp32 ``masters`` and their optimizer ``state`` (allocated here where the
    optimizer has not stepped) from the saved partitions ``loaded`` as ``pieces`` say, padding
    zero; scalar state from the first saved partition read."""
    for group, master in enumerate(masters):
        mine = [piece for piece in pieces if piece.group == group]
        saved_group, saved_rank = (mine[0].saved_group, mine[0].saved_rank) if mine else (0, 0)
        prefix = f"{OPTIM_PREFIX}rank{saved_rank}.state.{saved_group}."
        entry = state.setdefault(master, {})
        per_element = []
        for name, value in loaded.items():
            if name.startswith(prefix):
                key = name[len(prefix) :]
                held = entry.get(key)
                if value.dim() == 0:
                    entry[key] = value.clone().to(master.device)
                elif isinstance(held, torch.Tensor) and held.shape == master.shape and held.dtype == value.dtype:
                    held.zero_()  # filled in place: views DeepSpeed linked to it stay true
                    per_element.append(key)
                else:
                    entry[key] = torch.zeros_like(master, dtype=value.dtype)
                    per_element.append(key)
        masters_stored = f"{OPTIM_PREFIX}rank{saved_rank}.master.{saved_group}" in loaded
        if masters_stored:  # else they were restored from the weights they equal
            master.zero_()
        for piece in mine:
            source = f"{OPTIM_PREFIX}rank{piece.saved_rank}"
            span = slice(piece.saved_start, piece.saved_start + piece.length)
            target = slice(piece.start, piece.start + piece.length)
            if masters_stored:
                master[target].copy_(loaded[f"{source}.master.{piece.saved_group}"].reshape(-1)[span])
            for key in per_element:
                entry[key][target].copy_(loaded[f"{source}.state.{piece.saved_group}.{key}"].reshape(-1)[span])
