"""Pickle-free encoding of ``state_dict()`` values as JSON.

Covers what optimizers' param groups, LR schedulers, dataloaders and RNGs put in their states:
None, bool, int, float (including inf / nan), str, lists, tuples, sets and frozensets, dicts
(any hashable scalar keys), small torch tensors and numpy arrays / scalars (each kept with its
numpy dtype: an ``np.float64`` comes back as one, not as a ``float``). Tensors and arrays are stored inline as
base64 with dtype and shape, so this is meant for small state; model and optimizer tensors go
through DCP. Decoding builds only those types: nothing in a file can name a class or run code.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import torch

from areal_ckpt.tensors import DTYPES_BY_NAME

_NUMPY_KINDS = set("biuf")
_MARK = "__areal_ckpt__"


class StateEncodingError(TypeError):
    """A state value cannot be stored without pickle; the message names its key path."""


def encode(value: Any, path: str = "state") -> Any:
    """Turn ``value`` into JSON-compatible data; raises StateEncodingError naming the bad key path."""
    if isinstance(value, np.generic):  # first: np.float64 is also a float
        return {**_encode_array(np.asarray(value), path), _MARK: "npscalar"}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_MARK: "float", "value": repr(value)}
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, path)
    if isinstance(value, np.ndarray):
        return _encode_array(value, path)
    if isinstance(value, set | frozenset):
        kind = "set" if isinstance(value, set) else "frozenset"
        items = [encode(item, f"{path}{{{i}}}") for i, item in enumerate(value)]
        return {_MARK: kind, "items": sorted(items, key=lambda item: json.dumps(item, sort_keys=True))}  # one order
    if isinstance(value, tuple):
        return {_MARK: "tuple", "items": [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and _MARK not in value:
            return {key: encode(item, f"{path}.{key}") for key, item in value.items()}
        return {
            _MARK: "dict",
            "items": [[encode(key, f"{path}<key>"), encode(item, f"{path}[{key!r}]")] for key, item in value.items()],
        }
    raise StateEncodingError(
        f"{path}: cannot store a {type(value).__module__}.{type(value).__qualname__} without pickle; "
        "state values must be numbers, strings, lists, tuples, sets, dicts, tensors or numpy arrays and scalars"
    )


def _encode_tensor(tensor: torch.Tensor, path: str) -> dict[str, Any]:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES_BY_NAME:
        raise StateEncodingError(f"{path}: tensor dtype {tensor.dtype} is not supported in JSON state")
    data = tensor.detach().cpu().contiguous().reshape(-1)
    raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return {_MARK: "tensor", "dtype": name, "shape": list(tensor.shape), "data": base64.b64encode(raw).decode()}


def _encode_array(array: np.ndarray, path: str) -> dict[str, Any]:
    if array.dtype.kind not in _NUMPY_KINDS:
        raise StateEncodingError(f"{path}: numpy dtype {array.dtype} is not supported in JSON state")
    raw = np.ascontiguousarray(array).tobytes()
    return {
        _MARK: "ndarray",
        "dtype": array.dtype.str,
        "shape": list(array.shape),
        "data": base64.b64encode(raw).decode(),
    }


def decode(value: Any, path: str = "state") -> Any:
    """Inverse of :func:`encode`; raises ValueError naming the key path on malformed input."""
    if isinstance(value, list):
        return [decode(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if not isinstance(value, dict):
        return value
    kind = value.get(_MARK)
    if kind is None:
        return {key: decode(item, f"{path}.{key}") for key, item in value.items()}
    try:
        if kind == "tuple":
            return tuple(decode(item, f"{path}[{i}]") for i, item in enumerate(value["items"]))
        if kind == "dict":
            return {decode(key, path): decode(item, f"{path}[{key!r}]") for key, item in value["items"]}
        if kind == "float":
            return float(value["value"])
        if kind == "tensor":
            dtype = DTYPES_BY_NAME[value["dtype"]]
            raw = bytearray(base64.b64decode(value["data"], validate=True))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(value["shape"]).clone()
        if kind in ("ndarray", "npscalar"):
            array_dtype = np.dtype(value["dtype"])
            if array_dtype.kind not in _NUMPY_KINDS:
                raise ValueError(f"unsupported numpy dtype {array_dtype}")
            data = base64.b64decode(value["data"], validate=True)
            array = np.frombuffer(data, dtype=array_dtype).reshape(value["shape"]).copy()
            return array[()] if kind == "npscalar" else array
        if kind in ("set", "frozenset"):
            items = [decode(item, f"{path}{{{i}}}") for i, item in enumerate(value["items"])]
            return set(items) if kind == "set" else frozenset(items)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{path}: malformed {kind} entry: {error}") from None
    raise ValueError(f"{path}: unknown entry kind {kind!r}")


def dumps(value: Any) -> bytes:
    """JSON bytes of :func:`encode` (value)."""
    return json.dumps(encode(value), allow_nan=False).encode()


def loads(data: bytes | str, source: str = "state") -> Any:
    """Decode JSON produced by :func:`dumps`; errors name ``source`` and the key path."""
    try:
        parsed = json.loads(data)
    except json.JSONDecodeError as error:
        raise ValueError(f"{source}: not valid JSON: {error}") from None
    except RecursionError:
        raise ValueError(f"{source}: JSON nested too deeply") from None
    try:
        return decode(parsed, source)
    except RecursionError:
        raise ValueError(f"{source}: JSON nested too deeply") from None
