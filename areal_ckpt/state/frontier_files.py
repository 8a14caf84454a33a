"""A rollout frontier's snapshot as files of a recovery generation, and back.

Each rank that dumps a frontier writes two files into ``recover_info/rollout/``:
``rank{r}.json`` (its prompts and states, the data source's facts and position, the counters:
pickle-free JSON, :mod:`areal_ckpt.state.safe_json`) and ``rank{r}.safetensors`` (the
finished trajectories' tensors, packed one entry per name and dtype). Both are listed in the
generation's manifest like every file, so they commit with the weights or not at all, and a
load checks each one's size and CRC-32 against the manifest before it decodes a byte.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import crc32, read_regular_file
from areal_ckpt.paths import RECOVER_INFO
from areal_ckpt.state import safe_json
from areal_ckpt.state.frontier import STATES, FrontierSnapshot, Prompt, RolloutFrontier

logger = logging.getLogger(__name__)

#: The folder of ``recover_info/`` a frontier's files go to, and their format's version.
FRONTIER_FOLDER = "rollout"
FRONTIER_VERSION = 1


def frontier_files(rank: int) -> tuple[str, str]:
    """The paths (in a generation) of rank ``rank``'s frontier record and tensors. Pure."""
    base = f"{RECOVER_INFO}/{FRONTIER_FOLDER}/rank{rank}"
    return f"{base}.json", f"{base}.safetensors"


def _packed_name(name: str, dtype: torch.dtype) -> str:
    """The safetensors entry holding every trajectory's ``name`` tensors of ``dtype``. Pure."""
    return f"{name}/{str(dtype).removeprefix('torch.')}"


def encode_frontier(snapshot: FrontierSnapshot, rank: int) -> dict[str, bytes]:
    """The two files of ``snapshot`` for rank ``rank``, by path in the generation: the
    trajectories' tensors packed one entry per (name, dtype) in the prompts' order, each
    trajectory recording its tensors' entries and shapes (a few large entries instead of one
    per tensor). The record is JSON; what came from the user (prompts, plain trajectory values,
    the data source's state) is encoded with :mod:`areal_ckpt.state.safe_json`. Pure;
    StateEncodingError (a TypeError) naming a prompt or value JSON cannot hold."""
    parts: dict[str, list[torch.Tensor]] = {}
    prompts = []
    for prompt in snapshot.prompts:
        values, shapes = {}, {}
        for name, value in (prompt.trajectory or {}).items():
            if not isinstance(value, torch.Tensor):
                values[name] = value
                continue
            packed = _packed_name(name, value.dtype)
            shapes[name] = [packed, list(value.shape)]
            parts.setdefault(packed, []).append(value.reshape(-1))
        prompts.append(
            {
                "key": prompt.key,
                "prompt": safe_json.encode(prompt.prompt, f"prompt {prompt.key}"),
                "epoch": prompt.epoch,
                "order": prompt.order,
                "seed": prompt.seed,
                "state": prompt.state,
                "version": prompt.version,
                "finished_order": prompt.finished_order,
                "values": safe_json.encode(values, f"trajectory {prompt.key}"),
                "tensors": shapes,
            }
        )
    record = {
        "format_version": FRONTIER_VERSION,
        "source": safe_json.encode(snapshot.source, "source"),
        "epoch": snapshot.epoch,
        "drawn_in_epoch": snapshot.drawn_in_epoch,
        "draws": snapshot.draws,
        "finishes": snapshot.finishes,
        "consumed": snapshot.consumed,
        "version": snapshot.version,
        "exhausted": snapshot.exhausted,
        "loader": safe_json.encode(snapshot.loader, "loader"),
        "prompts": prompts,
    }
    tensors = {packed: torch.cat(pieces) for packed, pieces in parts.items()}
    json_name, tensor_name = frontier_files(rank)
    return {json_name: json.dumps(record, allow_nan=False).encode(), tensor_name: safetensors.torch.save(tensors)}


def _read_checked(folder: Path, name: str, files: dict[str, dict[str, int]]) -> bytes:
    """The bytes of ``name`` in the generation ``folder`` once their size and CRC-32 match the
    manifest's ``files``; CheckpointError naming the file otherwise. Local."""
    path = folder / name
    entry = files.get(name)
    if entry is None:
        raise CheckpointError(f"{path}: not in the manifest")
    try:
        data = read_regular_file(path, limit=entry["size"])
    except OSError as error:
        raise CheckpointError(f"{path}: unreadable: {error}") from None
    if len(data) != entry["size"] or crc32(data) != entry["crc32"]:
        raise CheckpointError(f"{path}: size or checksum differs from the manifest (the file is damaged)")
    return data


def holds_frontier(files: dict[str, dict[str, int]], rank: int) -> bool:
    """True when a generation's manifest ``files`` list rank ``rank``'s frontier. Pure."""
    return frontier_files(rank)[0] in files


def read_frontier(folder: Path, files: dict[str, dict[str, int]], rank: int) -> FrontierSnapshot:
    """Rank ``rank``'s frontier in the generation ``folder`` (manifest file list ``files``),
    each file checked against the manifest first. CheckpointError naming the file for a
    damaged, missing or malformed record (nothing executable is ever decoded). Local."""
    json_name, tensor_name = frontier_files(rank)
    where = str(folder / json_name)
    record_bytes = _read_checked(folder, json_name, files)
    tensor_bytes = _read_checked(folder, tensor_name, files)
    try:
        record = safe_json.loads(record_bytes, where)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{where}: malformed: {error}") from None
    try:
        tensors = safetensors.torch.load(tensor_bytes)
    except safetensors.SafetensorError as error:
        raise CheckpointError(f"{folder / tensor_name}: malformed: {error}") from None
    try:
        return _snapshot_of(record, tensors)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: malformed: {type(error).__name__}: {error}") from None


def frontier_to_restore(
    folder: Path, manifest: dict[str, Any], frontier: RolloutFrontier | None, policy: str
) -> FrontierSnapshot | None:
    """What ``frontier`` restores from the generation ``folder`` (its verified ``manifest``),
    read and checked before any weight is loaded, so a frontier that cannot be restored leaves
    the engines untouched. Without a ``frontier`` nothing is read (a warning on rank 0 when
    the generation holds one). On another number of ranks than the dump's, the per-rank
    frontiers cannot be dealt out again: CheckpointError saying what to do, or with ``policy``
    ``drop_rank_state`` (``recover.on_world_size_change``) None, logged. Collective: every
    rank reads its own files; every rank raises the same CheckpointError when one cannot."""
    files, saved = manifest["files"], manifest["world_size"]
    if frontier is None:
        if holds_frontier(files, 0) and dist.rank() == 0:
            logger.warning(
                "%s holds a rollout frontier; this load was given none (rollout=), so its prompts in flight "
                "are not restored",
                folder,
            )
        return None

    def read() -> FrontierSnapshot | None:
        if not holds_frontier(files, 0):
            raise CheckpointError(
                f"{folder}: holds no rollout frontier (it was dumped without rollout=); load it with the data "
                "source as dataloader= and without rollout=: the frontier then draws on from the data source's "
                "restored position, and later dumps record it"
            )
        if saved != dist.world_size():
            if policy == "drop_rank_state":
                logger.log(
                    dist.job_info(),
                    "%s: dumped by %d ranks, loaded on %d: the rollout frontier is not restored (drop_rank_state); "
                    "its data source starts afresh",
                    folder,
                    saved,
                    dist.world_size(),
                )
                return None
            raise CheckpointError(
                f"{folder}: dumped by {saved} ranks, loading on {dist.world_size()}: each rank's rollout frontier "
                f"(its prompts in flight and its data source's position) cannot be dealt out again. Resume with "
                f"{saved} ranks, or set recover.on_world_size_change: drop_rank_state to start the data afresh"
            )
        snapshot = read_frontier(folder, files, dist.rank())
        frontier.check(snapshot, str(folder / frontier_files(dist.rank())[0]))
        return snapshot

    return agree.on_every_rank(read, f"{folder}: the rollout frontier cannot be restored")


def _unpacked(packed: torch.Tensor, shape: Any, start: int) -> torch.Tensor:
    """One trajectory's tensor out of its packed entry (a copy); ValueError when its recorded
    shape does not lie inside the entry."""
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"shape {str(shape)[:100]} is not a list of sizes")
    count = math.prod(shape)
    if start + count > packed.numel():
        raise ValueError(f"offset {start} and shape {shape} lie outside their entry of {packed.numel()} elements")
    return packed[start : start + count].reshape(shape).clone()


def _integer(value: Any, name: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _snapshot_of(record: Any, tensors: dict[str, Any]) -> FrontierSnapshot:
    """The snapshot ``record`` (decoded JSON) and ``tensors`` describe; ValueError / KeyError /
    TypeError naming what is malformed."""
    if not isinstance(record, dict) or record.get("format_version") != FRONTIER_VERSION:
        raise ValueError(f"not a rollout frontier of version {FRONTIER_VERSION}")
    prompts = []
    offsets: dict[str, int] = {}  # where the next trajectory's part of each packed entry starts
    for entry in sorted(record["prompts"], key=lambda entry: _integer(entry["order"], "order")):
        if entry["state"] not in STATES or not isinstance(entry["key"], str):
            raise ValueError(f"prompt {str(entry.get('key'))[:100]!r}: state {str(entry.get('state'))[:20]!r}")
        order = _integer(entry["order"], "order")
        trajectory = None
        if entry["state"] == "finished":
            if not isinstance(entry["values"], dict):
                raise TypeError(f"prompt {entry['key']!r}: values must be an object")
            trajectory = dict(entry["values"])
            for name, (packed, shape) in entry["tensors"].items():
                trajectory[name] = _unpacked(tensors[packed], shape, offsets.get(packed, 0))
                offsets[packed] = offsets.get(packed, 0) + math.prod(shape)
        prompts.append(
            Prompt(
                key=entry["key"],
                prompt=entry["prompt"],
                epoch=_integer(entry["epoch"], "epoch"),
                order=order,
                seed=_integer(entry["seed"], "seed"),
                state=entry["state"],
                version=_integer(entry["version"], "version", optional=True),
                finished_order=_integer(entry["finished_order"], "finished_order", optional=True),
                trajectory=trajectory,
            )
        )
    if len({p.key for p in prompts}) != len(prompts):
        raise ValueError("a prompt key is listed twice")
    if not isinstance(record["source"], dict) or not isinstance(record["exhausted"], bool):
        raise TypeError("source must be an object and exhausted a boolean")
    return FrontierSnapshot(
        source=record["source"],
        epoch=_integer(record["epoch"], "epoch"),
        drawn_in_epoch=_integer(record["drawn_in_epoch"], "drawn_in_epoch"),
        draws=_integer(record["draws"], "draws"),
        finishes=_integer(record["finishes"], "finishes"),
        consumed=_integer(record["consumed"], "consumed"),
        version=_integer(record["version"], "version"),
        exhausted=record["exhausted"],
        loader=record["loader"],
        prompts=sorted(prompts, key=lambda p: p.order),
    )
