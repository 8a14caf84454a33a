"""Making sharded tensors whole on the ranks that write them.

An export writes its files in rounds of one file per rank, one tensor of each file at a time.
At each such step every rank needs one full tensor, whose rows are spread over all ranks:
under FSDP2 (dim-0 shards over a 1-D mesh) each rank sends each owner its own rows while it
receives the rows of its own tensor, so the links carry data both ways at once and no rank
pads, concatenates or receives a tensor it does not write. Other layouts are all-gathered.
The next step's transfers are started before the current tensor is handed out, so they move
(on the process group's own threads) while the caller writes; a step that all-gathers first
waits for the transfers before it, so a collective never runs beside tagged sends.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor, Shard

from areal_ckpt import dist


@dataclass
class _Step:
    """One step's transfers in flight and the tensor this rank will hold when they are done."""

    name: str | None
    tensor: torch.Tensor | None
    requests: list[Any] = field(default_factory=list)

    def wait(self) -> None:
        for request in self.requests:
            request.wait()
        self.requests.clear()


def _start_step(names: Sequence[str | None], state: dict[str, torch.Tensor], tag: int, previous: _Step | None) -> _Step:
    """Start making ``state[names[i]]`` whole on global rank ``i`` (None: rank ``i`` takes
    nothing now) while ``previous`` may still be in flight. Collective when any entry is a
    DTensor: every rank passes the same names in the same order and the same ``tag``. Blocks
    only for layouts that are all-gathered (after waiting for ``previous``)."""
    me = dist.rank()
    step = _Step(name=names[me] if me < len(names) else None, tensor=None)
    exchanged: list[tuple[int, DTensor]] = []
    for owner, name in enumerate(names):
        if name is None:
            continue
        tensor = state[name]
        if not isinstance(tensor, DTensor):
            step.tensor = tensor if owner == me else step.tensor
        elif _sharded_by_rows(tensor, owner):
            exchanged.append((owner, tensor))
        else:  # collective over the mesh, made by every rank in the same order
            if previous is not None:
                previous.wait()
            full = tensor.full_tensor()
            step.tensor = full if owner == me else step.tensor
    for owner, tensor in exchanged:
        group = tensor.device_mesh.get_group()
        ranks = tensor.device_mesh.mesh.tolist()
        local = tensor.to_local().detach()
        if owner == me:
            step.tensor = local.new_empty(tensor.shape)
            for index, peer in enumerate(ranks):
                rows, offset = Shard.local_shard_size_and_offset(tensor.shape[0], len(ranks), index)
                piece = step.tensor.narrow(0, offset, rows)
                if peer == me:
                    piece.copy_(local)
                elif rows:
                    step.requests.append(torch_dist.irecv(piece, src=peer, group=group, tag=tag))
        elif me in ranks and local.shape[0]:
            step.requests.append(torch_dist.isend(local.contiguous(), dst=owner, group=group, tag=tag))
    return step


def round_of_files(
    files: Sequence[Sequence[str]], state: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for each name of ``files[rank]`` (nothing when there is
    no such entry), in order, taking ``state``'s tensors by name. Each stays on its device (a
    caller copies it once, to where it goes: a pinned arena or a file) and is valid until the
    next item is taken.

    ``files[i]`` lists the tensors rank ``i`` writes. Collective when ``state`` holds DTensors:
    every rank passes the same ``files`` and exhausts the iterator; step ``k`` makes tensor
    ``k`` of every file whole on its owner, and is started while the caller still holds the
    tensor of step ``k - 1`` (so a rank holds at most two gathered tensors). Blocking per item.
    """
    current: _Step | None = None
    for tag, names in enumerate(itertools.zip_longest(*files)):
        following = _start_step(names, state, tag, current)
        if current is not None:
            yield from _handed_out(current)
        current = following
    if current is not None:
        yield from _handed_out(current)


def _handed_out(step: _Step) -> Iterator[tuple[str, torch.Tensor]]:
    step.wait()
    if step.name is not None and step.tensor is not None:
        yield step.name, step.tensor.detach()


def _sharded_by_rows(tensor: DTensor, owner: int) -> bool:
    """True for FSDP2's layout (dim-0 shards over a 1-D mesh that holds ``owner``)."""
    mesh = tensor.device_mesh
    return (
        mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
        and owner in mesh.mesh.tolist()
        and tensor.numel() > 0
    )
