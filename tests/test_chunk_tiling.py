"""Chunks that do not tile their tensor (a gap, or an overlap hiding a gap) are refused by every
reader, naming the file and the tensor, before anything is written or loaded: our recovery
format, a stock DCP folder's export, and an AReaL trial's import."""

from __future__ import annotations

import pickle

import pytest
import torch
from areal_trials import snapshot
from recover_fixtures import committed_generation, dump_once, make_setup
from test_forged import edit_json, forget_index, load_into_fresh
from test_import_areal import areal_trial  # noqa: F401  (a fixture)
from test_stock_dcp import LAYOUTS, _stock_save
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

from areal_ckpt.cli.main import main as cli_main
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_metadata import check_tiling
from areal_ckpt.formats.stock_dcp import read_stock_metadata

ROWS, COLUMNS = 48, 64  # lm_head.weight of the tiny model
GAP = [([0, 0], [24, COLUMNS])]  # rows 24-47 in no chunk
OVERLAP = [([0, 0], [24, COLUMNS]), ([12, 0], [24, COLUMNS])]  # as many elements as the tensor; rows 36-47 in none
#: forgery -> (chunks, the refusal when the whole metadata is read, when the index is read; the index's
#: chunk of a whole tensor is also checked against the bytes stored for it, which a gap fails first)
FORGERIES = {
    "gap": (GAP, "chunks hold 1536 elements, the tensor 3072", "12288 stored bytes for a [24, 64] chunk"),
    "overlap": (OVERLAP, "overlap", "overlap"),
}


def _entry(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in chunks],
    )


def test_row_column_and_grid_shardings_tile_and_forgeries_do_not():
    check_tiling("rows", _entry([8, 4], [([0, 0], [3, 4]), ([3, 0], [5, 4])]))
    check_tiling("columns", _entry([8, 4], [([0, 2], [8, 2]), ([0, 0], [8, 2])]))
    check_tiling("grid", _entry([4, 4], [([r, c], [2, 2]) for r in (0, 2) for c in (0, 2)]))
    check_tiling("bricks", _entry([2, 4], [([0, 0], [1, 3]), ([0, 3], [1, 1]), ([1, 0], [1, 1]), ([1, 1], [1, 3])]))
    check_tiling("scalar", _entry([], [([], [])]))
    check_tiling("empty chunk", _entry([2], [([0], [2]), ([2], [0])]))
    with pytest.raises(ValueError, match=r"w: chunks at \[0, 0\] of \[2, 2\] and at \[1, 1\] of \[2, 2\] overlap"):
        check_tiling("w", _entry([3, 3], [([0, 0], [2, 2]), ([1, 1], [2, 2]), ([0, 2], [1, 1])]))
    with pytest.raises(ValueError, match=r"w: chunks hold 2 elements, the tensor 4"):
        check_tiling("w", _entry([2, 2], [([0, 0], [1, 2])]))
    with pytest.raises(ValueError, match=r"w: chunk at \[1, 0\] of \[2, 2\] exceeds \[2, 2\]"):
        check_tiling("w", _entry([2, 2], [([0, 0], [1, 2]), ([1, 0], [2, 2])]))


def _as_json_chunks(chunks):
    return [{"offsets": offsets, "sizes": sizes} for offsets, sizes in chunks]


@pytest.mark.parametrize("forged", ["dcp_index.json", "dcp_metadata.json"])
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_our_format_refuses_chunks_that_do_not_tile_before_loading_anything(fileroot, forgery, forged):
    """The index is what a load at the same world size reads; the whole metadata what a load
    reads when the folder has no index (written before it existed) or the slice falls short."""
    chunks, whole_message, index_message = FORGERIES[forgery]
    dump_once(fileroot)
    generation = committed_generation(fileroot)
    if forged == "dcp_metadata.json":
        forget_index(generation)
    name = "dcp.model.lm_head.weight"
    edit_json(generation, f"default/{forged}", lambda d: d["tensors"][name].update(chunks=_as_json_chunks(chunks)))
    with pytest.raises(CheckpointError) as caught:
        assert load_into_fresh(fileroot)
    error = str(caught.value)
    assert f"default/{forged}: malformed DCP metadata" in error and "model.lm_head.weight: " in error
    assert (index_message if forged == "dcp_index.json" else whole_message) in error


def _forge_stock(folder, key: str, chunks) -> None:
    metadata = read_stock_metadata(folder)
    entry = metadata.state_dict_metadata[key]
    entry.chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in chunks]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))  # only allowed classes: the unpickler builds it


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_stock_dcp_export_refuses_chunks_that_do_not_tile(tmp_path, capsys, forgery):
    chunks, message, _ = FORGERIES[forgery]
    folder, base, out = tmp_path / "dcp", tmp_path / "base", tmp_path / "hf"
    _stock_save(folder, LAYOUTS["plain"])
    make_setup().model.config.save_pretrained(base)
    _forge_stock(folder, "model.lm_head.weight", chunks)
    assert cli_main(["export", str(folder), str(out), "--config-from", str(base)]) == 2
    error = capsys.readouterr().err
    assert f"{folder / '.metadata'}: model.lm_head.weight: " in error and message in error, error
    assert not out.exists()


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_an_areal_import_refuses_chunks_that_do_not_tile_and_changes_nothing(areal_trial, capsys, forgery):  # noqa: F811
    chunks, message, _ = FORGERIES[forgery]
    trial = areal_trial.path
    folder = areal_trial.payload()
    _forge_stock(folder, "dcp.model.lm_head.weight", chunks)
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert f"{folder / '.metadata'}: dcp.model.lm_head.weight: " in error and message in error, error
    assert snapshot(trial) == before and not (trial / ".recover").exists()
