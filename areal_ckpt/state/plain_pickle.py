"""Reading a pickle that should hold plain data only (AReaL's ``dataloader_info.pkl``).

The unpickler builds containers, numbers, strings and bytes (the pickle protocol's own opcodes)
and, as the only globals, ``collections.OrderedDict`` and CPU tensors: a tensor's storage goes
through ``torch.load(weights_only=True)`` and is rebuilt without gradients or hooks. Any other
global (a class, a function, ``os.system``) is refused by name before anything is built, so
nothing in the file can run code. Local, read-only.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path
from typing import Any

import torch

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import read_regular_file

#: What an allow-listed unpickler raises on a malformed or refused stream (besides RecursionError).
REFUSED_PICKLE = (
    pickle.UnpicklingError,
    AttributeError,
    EOFError,
    ImportError,
    IndexError,
    KeyError,
    TypeError,
    ValueError,
)
MAX_BYTES = 256 << 20  # a dataloader's state is small; a larger file is refused unread
#: Most values a state may hold written out as a tree: shared parts counted where they appear, a
#: tensor as its elements. A few hundred bytes of pickle can describe 2**40 of them.
MAX_VALUES = 1 << 24


def _storage_from_bytes(data: bytes) -> Any:
    if not isinstance(data, bytes):
        raise pickle.UnpicklingError("a tensor storage must be given as bytes")
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _tensor(storage: Any, offset: int, size: Any, stride: Any, requires_grad: Any, hooks: Any, *rest: Any) -> Any:
    if requires_grad or hooks or rest:
        raise pickle.UnpicklingError("a stored tensor may not require gradients or carry hooks")
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, collections.OrderedDict())


_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _tensor,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
}


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refused global {module}.{name}: only plain data and tensors are read")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"refused persistent id {str(pid)[:80]}")


def expanded_size(value: Any, limit: int = MAX_VALUES) -> int:
    """How many values ``value`` holds written out as a tree (JSON), counting a shared list,
    tuple or dict at every place it appears and a tensor as its elements, up to ``limit``;
    ValueError past it or when ``value`` contains itself. Iterative and memoised, so a deep or
    heavily shared structure costs its distinct containers, not its expansion. Pure."""
    sizes: dict[int, int] = {}
    started: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, torch.Tensor):
            sizes[id(node)] = node.numel()
        elif isinstance(node, list | tuple | dict):
            children = list(node.values()) if isinstance(node, dict) else list(node)
            if children_done:
                sizes[id(node)] = 1 + len(node) * isinstance(node, dict) + sum(sizes.get(id(c), 1) for c in children)
                started.discard(id(node))
            elif id(node) in started:
                raise ValueError("it contains itself")
            elif id(node) not in sizes:
                started.add(id(node))
                stack.append((node, True))
                stack.extend((child, False) for child in children if id(child) not in sizes)
        if sizes.get(id(node), 0) > limit:
            raise ValueError(f"it expands to more than {limit} values")
    return sizes.get(id(value), 1)


def load_plain_pickle(path: Path) -> Any:
    """The plain data pickled in ``path``; CheckpointError naming the file and what was refused
    (a global, a file that is not regular or over :data:`MAX_BYTES`, a value that contains
    itself or expands past :data:`MAX_VALUES`)."""
    path = Path(path)
    try:
        value = _PlainDataUnpickler(io.BytesIO(read_regular_file(path, MAX_BYTES))).load()
        expanded_size(value)
        return value
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error.strerror}") from None
    except (*REFUSED_PICKLE, RuntimeError) as error:
        if isinstance(error, RecursionError):
            raise CheckpointError(f"{path}: refused: nested too deeply") from None
        raise CheckpointError(f"{path}: refused: {error}; nothing in it was run") from None
