"""Names that several ranks hold must hold one value: DCP keeps one copy of them.

DCP takes a plain (not DTensor) tensor that several ranks hold under one name for a replica and
writes it from one rank. Where ranks hold different values under one name (experts of an
expert-parallel layer, a hand-written tensor-parallel shard), that would keep one rank's value
and lose the others, silently. So before a save:

- when a plan is made (a job's first save of a model, or after its tensors changed), every
  rank fingerprints every plain tensor in full (CRC-32 of dtype, shape and every byte) and rank
  0 compares them for each name several ranks hold;
- when the plan is reused (every later save), the names every rank holds are compared again
  by a sample of each (its first and last 4 KiB and 8 KiB spread evenly over the rest), with
  two reductions of one integer per name: ranks whose values drifted apart since (experts
  trained on different tokens) differ in the sample.

A difference raises RankMismatchError on every rank naming the tensors, before any shard is
written; the previous checkpoint stays the committed one.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import torch
from torch.distributed.tensor import DTensor

from areal_ckpt import dist
from areal_ckpt.errors import RankMismatchError
from areal_ckpt.fsio import crc32

_EDGE_BYTES = 4096
_SPREAD_BYTES = 8192
_SHOWN = 5


def _header(tensor: torch.Tensor) -> int:
    return crc32(f"{tensor.dtype}{tuple(tensor.shape)}".encode())


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """CRC-32 of each plain tensor's dtype, shape and bytes, by name (DTensors are left out:
    their placement says which rank holds what). Local; reads every byte, a tensor at a time
    through host memory when it lives on an accelerator."""
    return {
        name: crc32(_bytes_of(tensor).cpu().numpy().data, _header(tensor))
        for name, tensor in tensors.items()
        if not isinstance(tensor, DTensor)
    }


def _sample(tensor: torch.Tensor) -> int:
    """CRC-32 of ``tensor``'s dtype, shape and a sample of its bytes."""
    flat = _bytes_of(tensor)
    step = max(1, flat.numel() // _SPREAD_BYTES)
    sample = torch.cat([flat[:_EDGE_BYTES], flat[-_EDGE_BYTES:], flat[::step]]).cpu()
    return crc32(sample.numpy().data, _header(tensor))


def check_replicas(per_rank: list[dict[str, int]], folder: Path) -> list[str]:
    """Rank 0, given every rank's :func:`fingerprints`: the names every rank holds, sorted;
    RankMismatchError naming ``folder``, the first differing names and their ranks when a name
    that several ranks hold differs between them. Pure."""
    holders: dict[str, dict[int, list[int]]] = {}
    for rank, prints in enumerate(per_rank):
        for name, value in prints.items():
            holders.setdefault(name, {}).setdefault(value, []).append(rank)
    differing = {name: sorted(by_value.values()) for name, by_value in holders.items() if len(by_value) > 1}
    if differing:
        _refuse(
            folder,
            {
                name: f"ranks {' | '.join(_ranks(group) for group in groups)} hold different values"
                for name, groups in differing.items()
            },
        )
    everywhere = len(per_rank)
    return sorted(name for name, by_value in holders.items() if sum(map(len, by_value.values())) == everywhere)


def check_replicas_sampled(tensors: dict[str, torch.Tensor], names: list[str], folder: Path) -> None:
    """Collective: raise RankMismatchError on every rank, naming ``folder`` and the tensors,
    when one of ``names`` (held by every rank) differs between ranks in its sample. Two
    reductions of one integer per name."""
    if dist.world_size() == 1 or not names:
        return
    samples = [_sample(tensors[name]) for name in names]
    lowest = dist.all_reduce_ints(samples, "min")
    highest = dist.all_reduce_ints(samples, "max")
    differing = {name: "differs between ranks" for name, low, high in zip(names, lowest, highest) if low != high}
    if differing:
        _refuse(folder, differing)


def _ranks(group: list[int]) -> str:
    return ", ".join(map(str, group))


def _refuse(folder: Path, differing: dict[str, str]) -> NoReturn:
    shown = "; ".join(f"{name} ({how})" for name, how in list(differing.items())[:_SHOWN])
    raise RankMismatchError(
        f"{folder}: {len(differing)} tensor name(s) hold different values on different ranks, and a checkpoint keeps "
        f"one value per name: {shown}. Such tensors (experts or tensor-parallel shards) must be DTensors with a "
        "Shard placement, or carry names unique to their rank; no shard was written"
    )
