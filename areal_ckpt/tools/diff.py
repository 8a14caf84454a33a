"""``areal-ckpt diff A B``: two checkpoints compared tensor by tensor, streaming.

The sections of each side (:mod:`areal_ckpt.tools.tensor_sets`) are paired (one each: those
two, whatever their names; else by name), then the tensors both sections name are read in
batches of at most ``batch_bytes`` per side and compared: same dtype and shape, equal bit for
bit, else the largest absolute and relative difference and whether they are within
``atol + rtol * |b|`` (``torch.allclose``'s rule; NaN equals NaN only where both are NaN).
Names in one side only, and dtype or shape changes, are listed; optimizer state
(``optim.*``) is compared where both sides hold some (an export holds none: then it is left
out, and said). Local, read-only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from areal_ckpt.paths import OPTIM_PREFIX
from areal_ckpt.tools.inspection import kind_of
from areal_ckpt.tools.tensor_sets import CONCURRENT_KINDS, TensorSet, tensor_sets

T = TypeVar("T")
U = TypeVar("U")

#: Elements compared at once within one tensor (bounds the float64 working copies).
_CHUNK = 1 << 22


@dataclass
class TensorDifference:
    """One tensor both sides hold with the same dtype and shape, and how they differ."""

    name: str
    equal: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    within: bool = True


@dataclass
class SectionDiff:
    """The comparison of one pair of sections."""

    a: str
    b: str
    compared: int = 0
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)  # dtype or shape
    differing: list[TensorDifference] = field(default_factory=list)
    optimizer_only_in: str | None = None  # "a" / "b": one side holds no optimizer state, not compared


@dataclass
class Diff:
    """The whole comparison: each side's kind, paired sections, sections in one side only."""

    kinds: tuple[str, str]
    sections: list[SectionDiff] = field(default_factory=list)
    unpaired_a: list[str] = field(default_factory=list)
    unpaired_b: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """True when nothing is in one side only, nothing changed dtype or shape, and every
        compared tensor is within the tolerance."""
        return not (self.unpaired_a or self.unpaired_b) and all(
            not (s.only_a or s.only_b or s.changed) and all(d.within for d in s.differing) for s in self.sections
        )

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "equal": self.equal,
            "kinds": list(self.kinds),
            "unpaired_sections": {"a": self.unpaired_a, "b": self.unpaired_b},
            "sections": [
                {
                    "a": s.a,
                    "b": s.b,
                    "compared": s.compared,
                    "only_in_a": s.only_a,
                    "only_in_b": s.only_b,
                    "changed": s.changed,
                    "differing": [vars(d) for d in s.differing],
                    "optimizer_only_in": s.optimizer_only_in,
                }
                for s in self.sections
            ],
        }


def _float_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.float64) if tensor.dtype != torch.bool else tensor.to(torch.int64).to(torch.float64)


def compare_tensors(name: str, a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> TensorDifference:
    """How ``a`` and ``b`` (same dtype and shape) differ, a chunk of elements at a time. Pure."""
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    if _bitwise(flat_a, flat_b):
        return TensorDifference(name, True)
    result = TensorDifference(name, False)
    for start in range(0, flat_a.numel(), _CHUNK):
        x, y = _float_of(flat_a[start : start + _CHUNK]), _float_of(flat_b[start : start + _CHUNK])
        both_nan = torch.isnan(x) & torch.isnan(y)
        gap = torch.where(both_nan, torch.zeros_like(x), (x - y).abs())
        gap = torch.nan_to_num(gap, nan=float("inf"))
        scale = torch.maximum(x.abs(), y.abs())
        relative = torch.where(gap == 0, torch.zeros_like(gap), gap / scale.clamp_min(torch.finfo(torch.float64).tiny))
        result.max_abs = max(result.max_abs, float(gap.max()))
        result.max_rel = max(result.max_rel, float(torch.nan_to_num(relative, nan=float("inf")).max()))
        close = both_nan | (gap <= atol + rtol * torch.nan_to_num(y.abs(), nan=0.0))
        result.within = result.within and bool(close.all())
    return result


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the bytes are the same (NaNs included, which ``torch.equal`` calls unequal),
    compared as the widest integers the byte count allows (eight bytes at a time is about five
    times faster than one here)."""
    if a.numel() != b.numel():
        return False
    left, right = _as_bytes(a), _as_bytes(b)
    for wide in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=wide).element_size()
        if left.numel() % size == 0 and left.data_ptr() % size == 0 and right.data_ptr() % size == 0:
            return torch.equal(left.view(wide), right.view(wide))
    return torch.equal(left, right)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a bool tensor's as its bytes too)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _batches(
    names: list[str], index: dict[str, tuple[torch.dtype, tuple[int, ...]]], limit: int
) -> Iterator[list[str]]:
    """``names`` in consecutive groups of at most ``limit`` bytes (a larger tensor alone)."""
    batch: list[str] = []
    size = 0
    for name in names:
        dtype, shape = index[name]
        nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel())
        if batch and size + nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += nbytes
    if batch:
        yield batch


def _optimizer_names(names: set[str]) -> set[str]:
    return {name for name in names if name.startswith(OPTIM_PREFIX)}


def _compare_sections(
    a_name: str, a: TensorSet, b_name: str, b: TensorSet, atol: float, rtol: float, batch_bytes: int
) -> SectionDiff:
    names_a, names_b = set(a.index), set(b.index)
    only_in = None
    if _optimizer_names(names_a) and not _optimizer_names(names_b):
        only_in, names_a = "a", names_a - _optimizer_names(names_a)
    elif _optimizer_names(names_b) and not _optimizer_names(names_a):
        only_in, names_b = "b", names_b - _optimizer_names(names_b)
    result = SectionDiff(a_name, b_name, only_a=sorted(names_a - names_b), only_b=sorted(names_b - names_a))
    result.optimizer_only_in = only_in
    common = sorted(names_a & names_b)
    for name in common:
        if a.index[name] != b.index[name]:
            (dtype_a, shape_a), (dtype_b, shape_b) = a.index[name], b.index[name]
            result.changed.append(
                {"name": name, "a": [str(dtype_a), list(shape_a)], "b": [str(dtype_b), list(shape_b)]}
            )
    same = [name for name in common if a.index[name] == b.index[name]]
    together = a.concurrent and b.concurrent
    for batch in _batches(same, a.index, batch_bytes):
        left, right = _both(partial(_read_all, a, batch), partial(_read_all, b, batch), together)
        for name in batch:
            difference = compare_tensors(name, left.pop(name), right.pop(name), atol, rtol)
            result.compared += 1
            if not difference.equal:
                result.differing.append(difference)
    return result


def diff_checkpoints(a: Path, b: Path, atol: float = 0.0, rtol: float = 0.0, batch_bytes: int = 1 << 28) -> Diff:
    """Compare the checkpoints in the local folders ``a`` and ``b`` (see the module docstring);
    at most ``batch_bytes`` of tensors per side are held at once. The two sides are checked and
    read at once, on a helper thread and this one, where both are made of plain file reads
    (:data:`~areal_ckpt.tools.tensor_sets.CONCURRENT_KINDS`). CheckpointError naming a folder
    that holds no checkpoint we read, or a damaged file. Local, read-only."""
    together = a.is_dir() and b.is_dir() and kind_of(a) in CONCURRENT_KINDS and kind_of(b) in CONCURRENT_KINDS
    (kind_a, sections_a), (kind_b, sections_b) = _both(lambda: tensor_sets(a), lambda: tensor_sets(b), together)
    result = Diff((kind_a, kind_b))
    if len(sections_a) == 1 and len(sections_b) == 1:
        pairs = [(next(iter(sections_a)), next(iter(sections_b)))]
    else:
        pairs = [(name, name) for name in sorted(set(sections_a) & set(sections_b))]
        result.unpaired_a = sorted(set(sections_a) - set(sections_b))
        result.unpaired_b = sorted(set(sections_b) - set(sections_a))
    for name_a, name_b in pairs:
        result.sections.append(
            _compare_sections(name_a, sections_a[name_a], name_b, sections_b[name_b], atol, rtol, batch_bytes)
        )
    return result


def _read_all(tensors: TensorSet, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of ``tensors``, read, by name."""
    return dict(tensors.read(names))


def _both(first: Callable[[], T], second: Callable[[], U], together: bool) -> tuple[T, U]:
    """``first()`` and ``second()``: with ``together`` the first on a helper thread while the
    second runs on this one (each side's reads and checksums overlap the other's), else one
    after the other. Either one's exception is raised once both have ended."""
    if not together:
        return first(), second()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="diff-side") as pool:
        future = pool.submit(first)
        try:
            other = second()
        except BaseException:
            future.cancel()
            wait([future])
            raise
        return future.result(), other
