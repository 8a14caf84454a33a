"""Tensor descriptions shared by engines and formats (no I/O, no collectives)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from areal_ckpt.fsio import crc32

#: torch dtype -> safetensors dtype tag.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

#: The plain dtypes a state file may name (``"float32"``, ``"int64"``, ...): JSON state and
#: our DCP metadata record a tensor's dtype by these names.
DTYPES_BY_NAME: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

#: torch's dtypes and memory formats by attribute name (``float32``, ``channels_last``): inert
#: values an allow-listed unpickler may return for a global ``torch.<name>``. Read from the
#: module's namespace, so a name outside it never reaches torch's lazy imports.
TORCH_INERT_VALUES: dict[str, torch.dtype | torch.memory_format] = {
    name: value for name, value in vars(torch).items() if isinstance(value, (torch.dtype, torch.memory_format))
}

#: Names accepted for ``export_dtype``.
EXPORT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class TensorSpec:
    """Name, full (unsharded) shape and dtype of one tensor as it will be exported."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size of the full tensor in bytes."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def export_dtype_for(source: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``source`` dtype is exported as: floats follow ``target``, others keep theirs."""
    if target is None or not source.is_floating_point:
        return source
    return target


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor in row-major order, as a view (copied only when the tensor
    is not contiguous). Writable when the tensor is contiguous: reading into it fills the tensor."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return flat.view(torch.uint8).numpy().data


def local_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of this rank's bytes of ``tensor`` (a DTensor's local shard); one read, copied
    only when the tensor is off the CPU or not contiguous. Local."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return crc32(tensor_bytes(local.detach().cpu()))
