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
        yielded times the batch size; default: what this sampler yielded)."""
        return {
            "version": _VERSION,
            "epoch": self.epoch,
            "start": self._iteration_start,
            "consumed": self._yielded if consumed is None else consumed,
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


def global_position(positions: list[dict[str, Any]], source: str) -> tuple[int, int]:
    """(epoch, samples of its order consumed by all saved ranks together) from every saved rank's
    :meth:`ResumableDistributedSampler.position`; ValueError naming ``source`` when they do not
    describe one synchronous position (ranks at different epochs, starts or counts)."""
    first = positions[0]
    keys = ("version", "epoch", "start", "consumed", "num_replicas", "dataset_len", "seed", "shuffle", "drop_last")
    for index, position in enumerate(positions):
        if not isinstance(position, dict) or any(key not in position for key in keys):
            raise ValueError(f"{source}: rank {index}: not a ResumableDistributedSampler position")
        differing = [key for key in keys if position[key] != first[key]]
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
