"""Thin helpers over torch.distributed that also work when it is not initialized.

Functions that are collective say so: every rank of the default process group must call them,
in the same order. Without an initialized process group they act as a world of one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as torch_dist

from areal_ckpt.errors import CollectiveError

_F = TypeVar("_F", bound=Callable[..., Any])


def _collective(function: _F) -> _F:
    """Turn a backend failure (a peer died: gloo reports "Connection closed by peer" at once;
    otherwise the process group's timeout bounds the wait) into a CollectiveError."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except RuntimeError as error:
            raise CollectiveError(
                f"rank {rank()}: {function.__name__} across {world_size()} ranks failed "
                f"(another rank died or the network broke): {error}"
            ) from error

    return wrapper  # type: ignore[return-value]


def is_distributed() -> bool:
    """True when a default process group is initialized."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (0 without distributed)."""
    return torch_dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks in the default group (1 without distributed)."""
    return torch_dist.get_world_size() if is_distributed() else 1


@_collective
def barrier() -> None:
    """Collective: wait for every rank."""
    if is_distributed():
        torch_dist.barrier()


def _flag_device() -> torch.device:
    if torch_dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@_collective
def broadcast_flag(flag: bool, src: int = 0) -> bool:
    """Collective: every rank returns rank ``src``'s ``flag``."""
    if not is_distributed():
        return flag
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device())
    torch_dist.broadcast(tensor, src=src)
    return bool(tensor.item())


@_collective
def all_true(flag: bool) -> bool:
    """Collective: True only when ``flag`` is True on every rank."""
    if not is_distributed():
        return flag
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device())
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MIN)
    return bool(tensor.item())


@_collective
def all_gather_objects(obj: Any) -> list[Any]:
    """Collective: every rank's JSON-like ``obj``, indexed by rank.

    Only for small, trusted, in-process values (it pickles over the process group); never used
    on anything read from a checkpoint.
    """
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * world_size()
    torch_dist.all_gather_object(gathered, obj)
    return gathered


@_collective
def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Collective: every rank returns rank ``src``'s small in-process ``obj``."""
    if not is_distributed():
        return obj
    holder = [obj]
    torch_dist.broadcast_object_list(holder, src=src)
    return holder[0]
