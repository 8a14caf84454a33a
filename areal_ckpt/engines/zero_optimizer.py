"""ZeRO 1-3 optimizer state restored from a dump: on the dump's number of ranks, in place; ZeRO
1 / 2 on another, mapped parameter by parameter (:func:`plan_pieces`).

Under ZeRO 1 and 2 each parameter group is one flat buffer (the parameters one after another,
each at the offset the dump's master layout records, then padding) that the ranks' partitions
tile in rank order; a rank's fp32 masters and its optimizer's per-element state (Adam's moments)
are its partition of that buffer. A dump stores each rank's partitions whole, under keys that
name the rank (:meth:`~areal_ckpt.engines.deepspeed_engine.DeepSpeedEngine.recover_state`).

A load on another number of ranks maps each parameter, by name, from where it lay in the saved
buffer to where it lies in this engine's, and copies the elements of this rank's new partition
from the saved partitions that hold them (:func:`plan_pieces`): each rank reads only the saved
partitions that overlap its own (about its own share plus two neighbours', never the whole
optimizer), and the padding of its partition is zero, as DeepSpeed makes it. Scalar state
(Adam's ``step``) is the same on every rank and is taken from the first partition read.
Helpers of :class:`~areal_ckpt.engines.deepspeed_engine.DeepSpeedEngine`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from areal_ckpt import dist
from areal_ckpt.engines.zero3 import master_layout
from areal_ckpt.paths import OPTIM_PREFIX

Layout = list[list[dict[str, Any]]]


@dataclass(frozen=True)
class Piece:
    """``length`` elements of group ``group``'s buffer: at ``saved_start`` in saved rank
    ``saved_rank``'s partition, at ``start`` in this rank's."""

    group: int
    saved_rank: int
    saved_start: int
    start: int
    length: int


def refusal(stage: int, saved: Layout | None, current: Callable[[], Layout]) -> str | None:
    """Why the optimizer partitions of a ZeRO ``stage`` dump (its master layout ``saved``)
    cannot be loaded on another number of ranks into an engine whose layout is ``current()``, in
    words; None when they can (ZeRO 1 / 2, the same parameter groups of the same parameters)."""
    if stage == 3:
        return "ZeRO-3 partitions load on as many ranks only"
    if saved is None:
        return "the dump records no master layout (expert-parallel)"
    return _layout_mismatch(saved, current())


def _layout_mismatch(saved: Layout, current: Layout) -> str | None:
    """Why the parameters of the saved master layout cannot be mapped onto the current one (the
    groups, or a group's parameter names and shapes, differ), in words; None when they can."""
    if len(saved) != len(current):
        return f"the dump has {len(saved)} parameter groups, this optimizer {len(current)}"
    for index, (before, now) in enumerate(zip(saved, current, strict=True)):
        shapes_before = {entry["name"]: list(entry["shape"]) for entry in before}
        shapes_now = {entry["name"]: list(entry["shape"]) for entry in now}
        if shapes_before != shapes_now:
            names = sorted(set(shapes_before) ^ set(shapes_now)) or sorted(
                name for name in shapes_now if shapes_before[name] != shapes_now[name]
            )
            return f"parameter group {index} differs in {names[:5]}"
    return None


def partition_sizes(stored: dict[str, tuple[torch.dtype, tuple[int, ...]]], group: int) -> list[int]:
    """The saved partitions' sizes of ``group``, in rank order, from the checkpoint's index."""
    sizes: list[int] = []
    while (key := f"{OPTIM_PREFIX}rank{len(sizes)}.master.{group}") in stored:
        sizes.append(math.prod(stored[key][1]))
    return sizes


def plan_for(
    optimizer: Any, module: torch.nn.Module, saved: Layout, stored: dict[str, tuple[torch.dtype, tuple[int, ...]]]
) -> list[Piece]:
    """:func:`plan_pieces` for this rank of the ZeRO 1 / 2 ``optimizer`` (its flat groups split
    as DeepSpeed splits them: equal parts in rank order, the remainder to the first ranks) from
    a dump whose layout is ``saved`` and whose index is ``stored``. Local."""
    flats = [flat.numel() for flat in optimizer.bit16_groups_flat]
    world, rank = dist.world_size(), dist.rank()
    starts = [rank * (total // world) + min(rank, total % world) for total in flats]
    sizes = [master.numel() for master in optimizer.single_partition_of_fp32_groups]
    saved_sizes = [partition_sizes(stored, group) for group in range(len(flats))]
    return plan_pieces(saved, master_layout(optimizer, 2, module), saved_sizes, starts, sizes)


def plan_pieces(
    saved: Layout,
    current: Layout,
    saved_sizes: list[list[int]],
    starts: list[int],
    sizes: list[int],
) -> list[Piece]:
    """What fills this rank's partitions: for each group, each parameter's elements inside this
    rank's partition (``starts`` / ``sizes``: where it lies in each group's buffer), found at
    the parameter's saved offset and split where the saved partitions (``saved_sizes``, in rank
    order) meet. Pure."""
    pieces = []
    for group, entries in enumerate(current):
        saved_offsets = {entry["name"]: int(entry["offset"]) for entry in saved[group]}
        bounds = [0]
        for size in saved_sizes[group]:
            bounds.append(bounds[-1] + size)
        low, high = starts[group], starts[group] + sizes[group]
        for entry in entries:
            offset, numel = int(entry["offset"]), math.prod(entry["shape"])
            first, last = max(offset, low), min(offset + numel, high)
            position = saved_offsets[entry["name"]] + (first - offset)
            while first < last:
                rank = next(r for r in range(len(bounds) - 1) if bounds[r] <= position < bounds[r + 1])
                length = min(last - first, bounds[rank + 1] - position)
                pieces.append(Piece(group, rank, position - bounds[rank], first - low, length))
                first, position = first + length, position + length
    return pieces


def reshard_template(
    pieces: list[Piece],
    stored: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    groups: int,
) -> dict[str, torch.Tensor]:
    """Fresh tensors for the saved partitions ``pieces`` read from (masters and state), plus
    the state of saved rank 0 for a group no piece reads (its scalar state is still needed)."""
    ranks = {(piece.group, piece.saved_rank) for piece in pieces}
    ranks |= {(group, 0) for group in range(groups) if not any(g == group for g, _ in ranks)}
    template = {}
    for group, rank in sorted(ranks):
        for prefix in (f"{OPTIM_PREFIX}rank{rank}.master.{group}", f"{OPTIM_PREFIX}rank{rank}.state.{group}."):
            for name, (dtype, shape) in stored.items():
                if name == prefix or (prefix.endswith(".") and name.startswith(prefix)):
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
    masters from the weights where the dump stored them once as such (ZeRO-3, fp32), or from the
    saved partitions of another world size (``pieces``; on the dump's world size ``loaded``
    filled them in place); then the hyper-parameters, the scalar state, the loss scaler, and
    DeepSpeed's per-parameter state views linked. Local."""
    inner = optimizer.optimizer
    if engine_state.get("masters_in_model"):
        optimizer._restore_from_bit16_weights()  # the masters were stored once, as the weights
    if pieces is not None:  # a dump of another world size: mapped into this rank's partitions
        apply_pieces(pieces, loaded, masters, inner.state)
    for group, stored in zip(inner.param_groups, engine_state["optimizer_param_groups"], strict=True):
        group.update(stored)
    for index, master in enumerate(masters):
        inner.state[master].update(engine_state["optimizer_scalars"][str(index)])
    for field, value in engine_state["loss_scaler"].items():
        setattr(optimizer.loss_scaler, field, value)
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if callable(link):  # DeepSpeed links its per-parameter state views at its first step
        link()  # (safe_get_full_optimizer_state fails until then): link the loaded state now


def apply_pieces(
    pieces: list[Piece],
    loaded: dict[str, torch.Tensor],
    masters: list[torch.Tensor],
    state: dict[torch.Tensor, dict[str, Any]],
) -> None:
    """Fill this rank's fp32 ``masters`` and their optimizer ``state`` (allocated here where the
    optimizer has not stepped) from the saved partitions ``loaded`` as ``pieces`` say, padding
    zero; scalar state from the first saved partition read."""
    with torch.no_grad():  # the masters are leaves that require grad
        _apply(pieces, loaded, masters, state)


def _apply(
    pieces: list[Piece],
    loaded: dict[str, torch.Tensor],
    masters: list[torch.Tensor],
    state: dict[torch.Tensor, dict[str, Any]],
) -> None:
    """:func:`apply_pieces`, gradients off."""
    for group, master in enumerate(masters):
        read = sorted({p.saved_rank for p in pieces if p.group == group}) or [0]
        prefix = f"{OPTIM_PREFIX}rank{read[0]}.state.{group}."
        entry = state.setdefault(master, {})
        per_element = []
        for name, value in loaded.items():
            if name.startswith(prefix):
                key = name[len(prefix) :]
                if value.dim() == 0:
                    entry[key] = value.clone().to(master.device)
                else:
                    entry[key] = torch.zeros_like(master, dtype=value.dtype)
                    per_element.append(key)
        master.zero_()
        for piece in (p for p in pieces if p.group == group):
            source = f"{OPTIM_PREFIX}rank{piece.saved_rank}"
            span = slice(piece.saved_start, piece.saved_start + piece.length)
            target = slice(piece.start, piece.start + piece.length)
            master[target].copy_(loaded[f"{source}.master.{group}"].reshape(-1)[span])
            for key in per_element:
                entry[key][target].copy_(loaded[f"{source}.state.{group}.{key}"].reshape(-1)[span])
