"""Making sharded tensors whole on the ranks that write them.

An export writes its files in rounds of one file per rank, one tensor of each file at a time.
At each such step every rank needs one full tensor, whose rows are spread over all ranks:
under FSDP2 (dim-0 shards over a 1-D mesh) each rank sends each owner its own rows while it
receives the rows of its own tensor, so the links carry data both ways at once and no rank
pads, concatenates or receives a tensor it does not write. Other layouts are all-gathered.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor, Shard

from areal_ckpt import dist


def whole_for_owners(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The full tensor of this rank's entry of ``tensors`` (None when it has none).

    ``tensors[i]`` is what global rank ``i`` writes now (None: nothing); entries past the list
    are None. Collective over every rank when any entry is a DTensor: all ranks pass the same
    names (their own DTensors of them) in the same order. Blocking; plain tensors are returned
    as they are, without a copy.
    """
    me = dist.rank()
    mine: torch.Tensor | None = None
    exchanged: list[tuple[int, DTensor]] = []
    for owner, tensor in enumerate(tensors):
        if tensor is None:
            continue
        if not isinstance(tensor, DTensor):
            mine = tensor if owner == me else mine
        elif _sharded_by_rows(tensor, owner):
            exchanged.append((owner, tensor))
        else:  # collective over the mesh, made by every rank in the same order
            full = tensor.full_tensor()
            mine = full if owner == me else mine
    requests = []
    for owner, tensor in exchanged:
        group = tensor.device_mesh.get_group()
        ranks = tensor.device_mesh.mesh.tolist()
        local = tensor.to_local().detach()
        if owner == me:
            mine = local.new_empty(tensor.shape)
            for index, peer in enumerate(ranks):
                rows, offset = Shard.local_shard_size_and_offset(tensor.shape[0], len(ranks), index)
                piece = mine.narrow(0, offset, rows)
                if peer == me:
                    piece.copy_(local)
                elif rows:
                    requests.append(torch_dist.irecv(piece, src=peer, group=group))
        elif me in ranks and local.shape[0]:
            requests.append(torch_dist.isend(local.contiguous(), dst=owner, group=group))
    for request in requests:
        request.wait()
    return mine


def round_of_files(
    files: Sequence[Sequence[str]], state: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full CPU tensor)`` for each name of ``files[rank]`` (nothing when there is
    no such entry), in order, taking ``state``'s tensors by name.

    ``files[i]`` lists the tensors rank ``i`` writes. Collective when ``state`` holds DTensors:
    every rank passes the same ``files`` and exhausts the iterator; step ``k`` makes tensor
    ``k`` of every file whole on its owner (:func:`whole_for_owners`). Blocking per item.
    """
    me = dist.rank()
    for names in itertools.zip_longest(*files):
        full = whole_for_owners([state[name] if name is not None else None for name in names])
        if me < len(names) and names[me] is not None:
            yield names[me], full.detach().cpu()
        del full  # freed now, not when the caller asks for the next


def _sharded_by_rows(tensor: DTensor, owner: int) -> bool:
    """True for FSDP2's layout (dim-0 shards over a 1-D mesh that holds ``owner``)."""
    mesh = tensor.device_mesh
    return (
        mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
        and owner in mesh.mesh.tolist()
        and tensor.numel() > 0
    )
