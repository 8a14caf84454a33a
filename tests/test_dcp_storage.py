"""The raw DCP reader: tensors stored back to back are read in runs, one read per run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats import dcp_storage
from areal_ckpt.formats.dcp_io import load_tensors, save_tensors


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(64, 33, generator=generator),  # 8448 bytes: a run of its own below
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
        "half": torch.randn(5, 7, generator=generator).to(torch.bfloat16),
        "ints": torch.arange(11, dtype=torch.int64),
        "square": torch.randn(6, 6, generator=generator),
        "row": torch.randn(1, 5, generator=generator),
    }


def _empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    template = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    template["square"] = torch.zeros(6, 6).t()  # not contiguous: read through a buffer, then copied
    return template


@pytest.mark.parametrize("run_bytes, run_items", [(64 << 20, 512), (200, 2), (1, 1)])
def test_runs_of_any_size_fill_every_tensor_exactly(tmp_path: Path, monkeypatch, run_bytes: int, run_items: int):
    monkeypatch.setattr(dcp_storage, "_RUN_BYTES", run_bytes)
    monkeypatch.setattr(dcp_storage, "_RUN_ITEMS", run_items)
    state = _state()
    records = save_tensors(state, tmp_path)
    template = _empty_like(state)
    load_tensors(template, tmp_path, expected=records)
    for name, tensor in state.items():
        assert torch.equal(template[name], tensor), name


def test_a_truncated_file_read_without_a_manifest_is_named(tmp_path: Path):
    state = _state()
    (file_name,) = save_tensors(state, tmp_path)
    data = tmp_path / file_name
    data.write_bytes(data.read_bytes()[: data.stat().st_size - 10])
    with pytest.raises(CheckpointError, match=f"{file_name}: ends early \\(truncated\\)"):
        load_tensors(_empty_like(state), tmp_path)
