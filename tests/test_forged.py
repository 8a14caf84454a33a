"""Forged and corrupted files: every reader answers with a CheckpointError naming the file and
the cause, never a bare TypeError / RecursionError, and never allocates what the files do not hold.

"Forged" means the manifest is re-signed after the edit (its CRC-32s detect accidents, not
intent; see docs/layout.md), so only the readers' own checks stand between.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from helpers import saver_config
from recover_fixtures import SPEC, committed_generation, dump_once, make_setup, recover_config, trial_dir

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main
from areal_ckpt.publish import render_manifest

DEEP = "[" * 100_000 + "]" * 100_000


def forge(generation: Path, relative: str, content: bytes) -> None:
    """Replace one file of a recovery generation and re-sign the manifest to match."""
    manifest_path = generation / "recover_info/areal_ckpt_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    (generation / relative).write_bytes(content)
    if relative != "recover_info/areal_ckpt_manifest.json":
        manifest["files"][relative] = {"size": len(content), "crc32": zlib.crc32(content)}
        manifest_path.write_bytes(render_manifest(manifest))


def forget_index(generation: Path, model: str = "default") -> None:
    """Make a generation's model folder one written before ``dcp_index.json`` existed: no index,
    no chunk files, the manifest re-signed without them."""
    manifest_path = generation / "recover_info/areal_ckpt_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for path in [generation / model / "dcp_index.json", *(generation / model).glob("*.chunks.json")]:
        path.unlink()
        del manifest["files"][path.relative_to(generation).as_posix()]
    manifest_path.write_bytes(render_manifest(manifest))


def edit_json(generation: Path, relative: str, change) -> None:
    data = json.loads((generation / relative).read_text())
    change(data)
    forge(generation, relative, json.dumps(data).encode())


def load_into_fresh(fileroot: Path):
    setup = make_setup(seed=5)
    before = {k: v.clone() for k, v in setup.model.state_dict().items()}
    try:
        ac.RecoverHandler(recover_config(fileroot), SPEC).load(setup.engine)
    finally:
        untouched = all(torch.equal(before[k], v) for k, v in setup.model.state_dict().items())
    return untouched


def _set(path: list, value):
    def change(data):
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


FORGERIES = [
    (
        "tensors is a list",
        "default/dcp_index.json",
        _set(["tensors"], []),
        "dcp_index.json: malformed DCP metadata",
    ),
    (
        "huge chunk",
        "default/dcp_index.json",
        lambda d: d["tensors"]["dcp.model.lm_head.weight"]["chunks"][0].update(sizes=[28, 2**33]),
        "dcp_index.json: malformed DCP metadata",
    ),
    (
        "chunk length forged too",
        "default/dcp_index.json",
        lambda d: [
            d["tensors"]["dcp.model.lm_head.weight"].update(size=[48, 2**33]),
            d["tensors"]["dcp.model.lm_head.weight"]["chunks"][0].update(sizes=[48, 2**33]),
            [s.update(length=48 * 2**33 * 4) for s in d["storage"] if s["fqn"] == "dcp.model.lm_head.weight"],
        ],
        "checkpoint has torch.float32 [48, 8589934592], model has torch.float32 [48, 64]",
    ),
    (
        "overflowing shape",
        "default/dcp_index.json",
        lambda d: d["tensors"]["dcp.model.lm_head.weight"].update(size=[2**70, 64]),
        "up to 2**48",
    ),
    (
        "param groups of the wrong type",
        "default/engine_state.json",
        _set(["optimizer_param_groups"], "lr=1"),
        "engine_state.json: cannot restore",
    ),
    (
        "schedule state of the wrong type",
        "recover_info/checkpoint_info.json",
        _set(["steps_since"], "many"),
        "checkpoint_info.json: malformed",
    ),
    (
        "rng state malformed",
        "recover_info/rank0.json",
        _set(["rng", "torch_cpu"], [1, 2, 3]),
        "rank0.json: RNG state is malformed",
    ),
]


@pytest.mark.parametrize("label, relative, change, message", FORGERIES, ids=[f[0] for f in FORGERIES])
def test_forged_state_raises_a_checkpoint_error_naming_the_file(fileroot, label, relative, change, message):
    dump_once(fileroot)
    generation = committed_generation(fileroot)
    edit_json(generation, relative, change)
    with pytest.raises(ac.CheckpointError) as caught:
        load_into_fresh(fileroot)
    assert message in str(caught.value), str(caught.value)


def test_rank_state_that_is_not_an_object_is_named(fileroot):
    dump_once(fileroot)
    forge(committed_generation(fileroot), "recover_info/rank0.json", b"[1, 2]")
    with pytest.raises(ac.CheckpointError, match=r"rank0.json: expected an object"):
        load_into_fresh(fileroot)


def test_malformed_rng_or_schedule_state_is_refused_before_any_weight_is_loaded(fileroot):
    dump_once(fileroot)
    edit_json(committed_generation(fileroot), "recover_info/rank0.json", _set(["rng", "python"], "not a state"))
    setup = make_setup(seed=5)
    before = {k: v.clone() for k, v in setup.model.state_dict().items()}
    with pytest.raises(ac.CheckpointError, match="RNG state is malformed"):
        ac.RecoverHandler(recover_config(fileroot), SPEC).load(setup.engine)
    assert all(torch.equal(before[k], v) for k, v in setup.model.state_dict().items())


@pytest.mark.parametrize(
    "relative",
    [
        "default/dcp_index.json",
        "default/dcp_metadata.json",
        "recover_info/rank0.json",
        "recover_info/areal_ckpt_manifest.json",
    ],
)
@pytest.mark.parametrize("signed", [True, False], ids=["forged", "corrupted"])
def test_deeply_nested_json_is_named_by_every_reader(fileroot, tmp_path, capsys, relative, signed):
    dump_once(fileroot)
    generation = committed_generation(fileroot)
    if relative == "default/dcp_metadata.json":  # what a load reads when the folder has no index
        forget_index(generation)
    if signed:
        forge(generation, relative, DEEP.encode())
    else:
        (generation / relative).write_text(DEEP)
    with pytest.raises(
        ac.CheckpointError, match=Path(relative).name if signed else "recover_info|dcp_metadata|dcp_index|rank0"
    ):
        load_into_fresh(fileroot)
    for command in (
        ["verify", str(trial_dir(fileroot))],
        ["inspect", str(trial_dir(fileroot))],
        ["list", str(trial_dir(fileroot))],
        ["export", str(trial_dir(fileroot)), str(tmp_path / "out")],
    ):
        code = cli_main(command)
        out = capsys.readouterr()
        assert "Traceback" not in out.err and "RecursionError" not in out.err + out.out, command
        if command[0] == "verify":  # a forged file matches its re-signed manifest; a corrupted one does not
            assert code == (0 if signed and "manifest" not in relative else 1), command
        elif code != 0:
            assert code == 2 and Path(relative).name in out.err, (command, out.err)


def test_a_manifest_with_a_world_size_of_the_wrong_type_is_named(fileroot):
    dump_once(fileroot)
    generation = committed_generation(fileroot)
    path = generation / "recover_info/areal_ckpt_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["world_size"] = "two"
    path.write_bytes(render_manifest(manifest))
    with pytest.raises(ac.CheckpointError, match="world_size must be a positive integer"):
        load_into_fresh(fileroot)


def test_export_of_a_forged_shape_allocates_nothing_and_names_the_file(fileroot, tmp_path, capsys):
    dump_once(fileroot)
    edit_json(
        committed_generation(fileroot),
        "default/dcp_metadata.json",
        lambda d: d["tensors"]["dcp.model.lm_head.weight"].update(size=[2**20, 2**20]),
    )
    assert cli_main(["export", str(trial_dir(fileroot)), str(tmp_path / "out")]) == 2
    assert "dcp_metadata.json: malformed DCP metadata" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_inspect_names_a_safetensors_header_with_a_bad_shape(fileroot, make_model, capsys):
    saver = ac.Saver(saver_config(fileroot), SPEC)
    export = Path(saver.save(ac.TorchEngine(make_model()), 0, 0, 0, force=True))
    saver.finalize()
    shard = export / "model.safetensors"
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = "abc"
    encoded = json.dumps(header).encode().ljust(length)
    shard.write_bytes(data[:8] + encoded[:length] + data[8 + length :]) if len(
        encoded
    ) == length else shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])
    assert cli_main(["inspect", str(export)]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: malformed safetensors header entry" in err and "Traceback" not in err


def test_list_reports_a_damaged_recovery_checkpoint_and_still_lists_the_healthy_exports(fileroot, make_model, capsys):
    saver = ac.Saver(saver_config(fileroot), SPEC)
    saver.save(ac.TorchEngine(make_model()), 0, 0, 0, force=True)
    saver.finalize()
    dump_once(fileroot)
    metadata = committed_generation(fileroot) / "default/dcp_metadata.json"
    metadata.write_bytes(metadata.read_bytes()[:100])
    assert cli_main(["list", str(trial_dir(fileroot))]) == 0
    out = capsys.readouterr().out
    assert "recover (DAMAGED)" in out and "export" in out
    assert cli_main(["list", str(trial_dir(fileroot)), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    damaged = next(e for e in entries if e["kind"] == "recover")
    assert "dcp_metadata.json" in damaged["problem"]
    assert [e["kind"] for e in entries].count("export") == 1


def test_export_of_a_consistent_forgery_claiming_more_than_the_files_hold_allocates_nothing(fileroot, tmp_path, capsys):
    dump_once(fileroot)

    def claim_1_5_tb(d):
        entry = d["tensors"]["dcp.model.lm_head.weight"]
        entry.update(size=[48, 2**33])
        entry["chunks"][0].update(sizes=[48, 2**33])
        for stored in d["storage"]:
            if stored["fqn"] == "dcp.model.lm_head.weight":
                stored.update(length=48 * 2**33 * 4)

    edit_json(committed_generation(fileroot), "default/dcp_metadata.json", claim_1_5_tb)
    assert cli_main(["export", str(trial_dir(fileroot)), str(tmp_path / "out")]) == 2
    assert "places model.lm_head.weight at bytes" in capsys.readouterr().err


@pytest.mark.parametrize("record", ["folder name", "manifest", "step_info.json"])
def test_a_step_recorded_differently_in_one_of_its_three_places_is_refused_by_name(fileroot, record):
    dump_once(fileroot)  # after global step 1
    generation = committed_generation(fileroot)
    if record == "folder name":  # a generation renamed by hand, `current` moved along
        renamed = generation.with_name(generation.name.replace("gen-00000001-", "gen-00000007-"))
        generation.rename(renamed)
        (generation.parent / "current").unlink()
        (generation.parent / "current").symlink_to(renamed.name)
    elif record == "manifest":
        path = generation / "recover_info/areal_ckpt_manifest.json"
        manifest = json.loads(path.read_text())
        manifest["step"]["global_step"] = 7
        path.write_bytes(render_manifest(manifest))
    else:
        edit_json(generation, "recover_info/step_info.json", _set(["global_step"], 7))
    with pytest.raises(ac.CheckpointError, match="global step is recorded differently") as caught:
        load_into_fresh(fileroot)
    assert "7" in str(caught.value) and "1" in str(caught.value)
    assert ".recover" in str(caught.value)
