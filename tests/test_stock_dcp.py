"""Checkpoints written by stock torch.distributed.checkpoint: exported and inspected without
running anything from them."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from recover_fixtures import make_setup, train_step
from test_recover_failures import _RunsCode
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import AutoModelForCausalLM

from areal_ckpt.cli.main import main as cli_main


def _stock_save(folder: Path, nest) -> dict[str, torch.Tensor]:
    """Train a step, save with dcp.save's own writer, return the model's weights."""
    setup = make_setup()
    train_step(setup, 0)
    model_state, optim_state = get_state_dict(setup.model, setup.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(nest(model_state, optim_state), checkpoint_id=str(folder))
    return {name: tensor.clone() for name, tensor in setup.model.state_dict().items()}


LAYOUTS = {
    "plain": lambda model, optim: {"model": model, "optim": optim},
    "areal": lambda model, optim: {"dcp": {"model": model, "optim": optim}},
    "flat": lambda model, optim: dict(model),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_stock_dcp_checkpoint_exports_to_an_hf_folder_with_identical_weights(tmp_path, layout, capsys):
    folder, base = tmp_path / "dcp", tmp_path / "base"
    weights = _stock_save(folder, LAYOUTS[layout])
    make_setup().model.config.save_pretrained(base)
    out = tmp_path / "hf"
    assert cli_main(["export", str(folder), str(out)]) == 2  # no config: the error says how
    hint = capsys.readouterr().err
    assert "pass --config-from with the model's HF folder" in hint and not out.exists()
    assert cli_main(["export", str(folder), str(out), "--config-from", str(base)]) == 0  # the hint
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in weights.items())


def test_inspect_describes_a_stock_dcp_folder(tmp_path, capsys):
    folder = tmp_path / "dcp"
    _stock_save(folder, LAYOUTS["plain"])
    assert cli_main(["inspect", str(folder), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["kind"] == "dcp" and set(facts["groups"]) == {"model", "optim"}
    assert facts["groups"]["model"]["dtypes"] == ["float32"] and facts["groups"]["model"]["tensors"] > 10


@pytest.mark.parametrize("command", ["export", "inspect"])
def test_a_hostile_metadata_pickle_is_refused_and_runs_nothing(tmp_path, capsys, command):
    folder, base = tmp_path / "dcp", tmp_path / "base"
    _stock_save(folder, LAYOUTS["plain"])
    make_setup().model.config.save_pretrained(base)
    marker = tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    args = (
        ["export", str(folder), str(tmp_path / "hf"), "--config-from", str(base)]
        if command == "export"
        else ["inspect", str(folder)]
    )
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert f"{folder / '.metadata'}: refused: refused global" in err and "nothing in it was run" in err
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_forged_shape_in_stock_metadata_allocates_nothing(tmp_path, capsys):
    from areal_ckpt.formats.stock_dcp import read_stock_metadata

    folder, base = tmp_path / "dcp", tmp_path / "base"
    _stock_save(folder, LAYOUTS["plain"])
    make_setup().model.config.save_pretrained(base)
    metadata = read_stock_metadata(folder)
    entry = metadata.state_dict_metadata["model.lm_head.weight"]
    entry.size = entry.chunks[0].sizes = torch.Size([2**20, 2**20])  # its one chunk still tiles it
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    assert cli_main(["export", str(folder), str(tmp_path / "hf"), "--config-from", str(base)]) == 2
    assert "model.lm_head.weight claims 4398046511104 bytes" in capsys.readouterr().err


def _forged(metadata, change):
    change(metadata)
    return metadata


FORGED_STRUCTURE = {
    "size as a list": (
        lambda m: setattr(m.state_dict_metadata["model.lm_head.weight"], "size", [48, 64]),
        "entry 'model.lm_head.weight': size [48, 64] is not a torch.Size",
    ),
    "properties None": (
        lambda m: setattr(m.state_dict_metadata["model.lm_head.weight"], "properties", None),
        "entry 'model.lm_head.weight': properties None name no dtype",
    ),
    "an int key": (
        lambda m: m.state_dict_metadata.update({7: m.state_dict_metadata["model.lm_head.weight"]}),
        "entry 7: its name is not a string",
    ),
    "a storage key that is not a MetadataIndex": (
        lambda m: m.storage_data.update({"model.lm_head.weight": next(iter(m.storage_data.values()))}),
        "storage key model.lm_head.weight is not a MetadataIndex",
    ),
}


@pytest.mark.parametrize("forgery", sorted(FORGED_STRUCTURE))
@pytest.mark.parametrize("command", ["export", "inspect"])
def test_stock_metadata_of_the_wrong_shape_is_named_not_a_traceback(tmp_path, capsys, forgery, command):
    from areal_ckpt.formats.stock_dcp import read_stock_metadata

    folder, base = tmp_path / "dcp", tmp_path / "base"
    _stock_save(folder, LAYOUTS["plain"])
    make_setup().model.config.save_pretrained(base)
    change, message = FORGED_STRUCTURE[forgery]
    (folder / ".metadata").write_bytes(pickle.dumps(_forged(read_stock_metadata(folder), change)))
    args = (
        ["export", str(folder), str(tmp_path / "hf"), "--config-from", str(base)]
        if command == "export"
        else ["inspect", str(folder)]
    )
    assert cli_main(args) == 2
    error = capsys.readouterr().err
    assert f"{folder / '.metadata'}: {message}" in error and "Traceback" not in error, error


def test_many_records_claiming_the_same_bytes_are_refused_before_anything_is_allocated(tmp_path, capsys):
    """13,000 storage entries over one small file, each inside it: together they claim far more
    than the file holds, so a shape backed by them is refused."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from areal_ckpt.formats.stock_dcp import read_stock_metadata

    folder, base = tmp_path / "dcp", tmp_path / "base"
    _stock_save(folder, LAYOUTS["plain"])
    make_setup().model.config.save_pretrained(base)
    metadata = read_stock_metadata(folder)
    entry = metadata.state_dict_metadata["model.lm_head.weight"]
    record = metadata.storage_data[MetadataIndex("model.lm_head.weight", torch.Size([0, 0]))]
    rows = 13_000
    entry.size = torch.Size([rows * 48, 64])
    entry.chunks = [ChunkStorageMetadata(torch.Size([48 * r, 0]), torch.Size([48, 64])) for r in range(rows)]
    for r in range(1, rows):
        metadata.storage_data[MetadataIndex("model.lm_head.weight", torch.Size([48 * r, 0]))] = record
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    assert cli_main(["export", str(folder), str(tmp_path / "hf"), "--config-from", str(base)]) == 2
    error = capsys.readouterr().err
    assert "the records of model.lm_head.weight and model.lm_head.weight share bytes of" in error, error
