"""ResumableDistributedSampler: DistributedSampler's order, with a position any world size can resume.

The order of an epoch is a function of (seed, epoch) over the whole dataset, exactly as
``torch.utils.data.DistributedSampler`` makes it; rank r of R takes every R-th index of it. After
every rank consumed m samples, the samples consumed are exactly the first m * R of the epoch's
order, whatever R is: that prefix length is the position, and it carries over to any number of
ranks. A job resumed on R' ranks hands the rest of the epoch's order out every R'-th index, padded
(or, with ``drop_last``, truncated) so every rank gets as many samples, as DistributedSampler
does. Over the epoch every sample is then seen exactly once, plus the padding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.utils.data import Sampler

_VERSION = 1


class ResumableDistributedSampler(Sampler[int]):
    """A drop-in for ``torch.utils.data.DistributedSampler`` (same arguments, ``set_epoch``,
    padding and ``drop_last``) whose position survives a change of world size.

    Pass it to a ``StatefulDataLoader`` (or a DataLoader) as its ``sampler`` and call
    ``set_epoch`` as usual; ``RecoverHandler.dump`` records its position with the dataloader's
    state, and ``RecoverHandler.load`` restores it on any number of ranks. Local: nothing here
    communicates (``num_replicas`` / ``rank`` default to the process group's, as
    DistributedSampler's do).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            num_replicas = torch_dist.get_world_size() if torch_dist.is_initialized() else 1
        if rank is None:
            rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, samples of its order already consumed)
        self._iteration_start = 0  # where the current iteration began in its epoch's order
        self._yielded = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration yields (as DistributedSampler)."""
        self.epoch = epoch

    def _order(self) -> list[int]:
        """The epoch's order over the whole dataset, as DistributedSampler computes it."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=generator).tolist()
        return list(range(len(self.dataset)))

    def _start(self) -> int:
        if self._resume is not None and self._resume[0] == self.epoch:
            return self._resume[1]
        return 0

    def _count(self, remaining: int) -> int:
        """Samples per rank for ``remaining`` samples left in the epoch (DistributedSampler's rule)."""
        if self.drop_last and remaining % self.num_replicas:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        start = self._start()
        self._resume = None  # a resumed position applies to the first iteration after it only
        self._iteration_start = start
        remaining = self._order()[start:]
        total = self._count(len(remaining)) * self.num_replicas
        if total > len(remaining) and remaining:  # pad by repeating from the start, as DistributedSampler
            padding = total - len(remaining)
            remaining += (remaining * math.ceil(padding / len(remaining)))[:padding]
        mine = remaining[:total][self.rank : total : self.num_replicas]
        self._yielded = 0
        for index in mine:
            self._yielded += 1
            yield index

    def __len__(self) -> int:
        return self._count(len(self.dataset) - self._start())

    # -- the position ---------------------------------------------------------------------

    def position(self, consumed: int | None = None) -> dict[str, Any]:
        """This rank's position, JSON-able: the epoch, where its current iteration began in the
        epoch's order, and how many samples this rank consumed since (``consumed``, e.g. batches
        yielded times the batch size, at most what the iteration holds; default: what this
        sampler yielded)."""
        start = self._iteration_start
        return {
            "version": _VERSION,
            "epoch": self.epoch,
            "start": start,
            "consumed": self._yielded if consumed is None else min(consumed, self._count(len(self.dataset) - start)),
            "num_replicas": self.num_replicas,
            "dataset_len": len(self.dataset),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def resume_at(self, epoch: int, start: int) -> None:
        """Make the next iteration of ``epoch`` begin after the first ``start`` samples of its order."""
        self.epoch = epoch
        self._resume = (epoch, start)
        self._iteration_start = start


#: What a saved position and the live sampler must agree on: with any of them changed, the
#: epoch's order (or how it is split) is another one, and resuming would skip or repeat samples.
ORDER_KEYS = ("dataset_len", "seed", "shuffle", "drop_last")
_KEYS = ("version", "epoch", "start", "consumed", "num_replicas", *ORDER_KEYS)


def _is_int(value: Any, low: int, high: int | None = None) -> bool:
    return type(value) is int and value >= low and (high is None or value <= high)


def check_position(position: Any, source: str) -> dict[str, Any]:
    """``position`` (a :meth:`ResumableDistributedSampler.position` read from a file) when every
    field has its type and range: the epoch, seed and counts are integers, ``start`` lies in the
    dataset, ``consumed`` in what one rank takes of the rest of the epoch. ValueError naming
    ``source`` and the field otherwise. Pure."""
    if not isinstance(position, dict) or any(key not in position for key in _KEYS):
        raise ValueError(f"{source}: not a ResumableDistributedSampler position")
    length, replicas = position["dataset_len"], position["num_replicas"]
    if position["version"] != _VERSION or not _is_int(length, 0) or not _is_int(replicas, 1):
        raise ValueError(
            f"{source}: sampler position has version {position['version']!r}, dataset_len {length!r}, "
            f"num_replicas {replicas!r} (expected version {_VERSION} and counts)"
        )
    start = position["start"]
    checks = {
        "epoch": _is_int(position["epoch"], 0),
        "seed": type(position["seed"]) is int,
        "shuffle": type(position["shuffle"]) is bool,
        "drop_last": type(position["drop_last"]) is bool,
        "start": _is_int(start, 0, length),
    }
    if checks["start"]:
        checks["consumed"] = _is_int(position["consumed"], 0, math.ceil((length - start) / replicas))
    for key, valid in checks.items():
        if not valid:
            raise ValueError(f"{source}: sampler position field {key} = {position[key]!r} is out of type or range")
    return position


def check_same_order(saved: dict[str, Any], sampler: ResumableDistributedSampler, source: str) -> None:
    """Raise ValueError naming ``source``, each differing field and both values, unless
    ``sampler`` orders its data as the one that saved ``saved`` did (:data:`ORDER_KEYS`). Pure."""
    live = {"dataset_len": len(sampler.dataset), "seed": sampler.seed, "shuffle": sampler.shuffle}
    live["drop_last"] = sampler.drop_last
    differing = [
        f"{key} saved {saved[key]!r}, this sampler {live[key]!r}" for key in ORDER_KEYS if saved[key] != live[key]
    ]
    if differing:
        raise ValueError(
            f"{source}: the data order was saved by another sampler ({'; '.join(differing)}): resuming would skip "
            "or repeat samples. Build the ResumableDistributedSampler with the saved values."
        )


def global_position(positions: list[dict[str, Any]], source: str) -> tuple[int, int]:
    """(epoch, samples of its order consumed by all saved ranks together) from every saved rank's
    :meth:`ResumableDistributedSampler.position`; ValueError naming ``source`` when one is
    malformed (:func:`check_position`) or they do not describe one synchronous position (ranks
    at different epochs, starts or counts)."""
    first = check_position(positions[0], f"{source}: rank 0")
    for index, position in enumerate(positions):
        check_position(position, f"{source}: rank {index}")
        differing = [key for key in _KEYS if position[key] != first[key]]
        if differing:
            raise ValueError(
                f"{source}: ranks 0 and {index} were at different data positions ({differing}); "
                "the position cannot be carried to another number of ranks"
            )
    if first["num_replicas"] != len(positions):
        raise ValueError(
            f"{source}: written by {len(positions)} ranks, but the sampler had num_replicas={first['num_replicas']}"
        )
    consumed = min(first["start"] + first["consumed"] * first["num_replicas"], first["dataset_len"])
    return int(first["epoch"]), int(consumed)
