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


def load_plain_pickle(path: Path) -> Any:
    """The plain data pickled in ``path``; CheckpointError naming the file and what was refused."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BYTES:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes; a state pickle over {MAX_BYTES} is not read")
        return _PlainDataUnpickler(io.BytesIO(path.read_bytes())).load()
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error.strerror}") from None
    except (*REFUSED_PICKLE, RuntimeError) as error:
        if isinstance(error, RecursionError):
            raise CheckpointError(f"{path}: refused: nested too deeply") from None
        raise CheckpointError(f"{path}: refused: {error}; nothing in it was run") from None
