"""Loud failures: a checkpoint that exists but cannot be loaded raises, names the file, and is kept."""

from __future__ import annotations

import io
import json
import pickle
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from recover_fixtures import SPEC, committed_generation, dump_once, make_setup, recover_config, trial_dir

import areal_ckpt as ac
from areal_ckpt.formats.stock_dcp import read_stock_metadata
from areal_ckpt.publish import render_manifest


def load_fresh(fileroot: Path, **model_overrides):
    setup = make_setup(seed=1, **model_overrides)
    return ac.RecoverHandler(recover_config(fileroot), SPEC).load(setup.engine), setup


def shard(fileroot: Path) -> Path:
    return committed_generation(fileroot) / "default/__0_0.distcp"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.unlink(), "__0_0.distcp: missing"),
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "__0_0.distcp: size"),
        (
            lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]),
            "__0_0.distcp: checksum mismatch",
        ),
    ],
    ids=["missing", "truncated", "bit-flip"],
)
def test_damaged_shard_is_named_and_never_replaced_by_a_fresh_start(fileroot, damage, message):
    dump_once(fileroot)
    generation = committed_generation(fileroot)
    damage(shard(fileroot))
    assert ac.check_if_recover(recover_config(fileroot))  # a checkpoint exists: never "fresh trial"
    with pytest.raises(ac.CheckpointError, match=message):
        load_fresh(fileroot)
    # a job that skips load() cannot overwrite the checkpoint it could not read
    setup = make_setup()
    with pytest.raises(ac.CheckpointError, match="call RecoverHandler.load"):
        ac.RecoverHandler(recover_config(fileroot), SPEC).dump(
            setup.engine,
            ac.StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=SPEC.steps_per_epoch),
            force=True,
        )
    assert committed_generation(fileroot) == generation and generation.is_dir()


def test_different_model_names_missing_and_unexpected_keys(fileroot):
    dump_once(fileroot)
    with pytest.raises(ac.CheckpointError) as caught:
        load_fresh(fileroot, num_hidden_layers=3)
    assert "missing keys ['model.model.layers.2." in str(caught.value)
    with pytest.raises(
        ac.CheckpointError,
        match=r"model.model.embed_tokens.weight: checkpoint has torch.float32 \[48, 64\].*nothing was loaded.*"
        r"train the changed model under a new trial_name",
    ):
        load_fresh(fileroot, hidden_size=32, intermediate_size=64)
    changed = make_setup(seed=1, hidden_size=32, intermediate_size=64)  # the hint: a new trial_name
    config = recover_config(fileroot).model_copy(update={"trial_name": "changed"})
    handler = ac.RecoverHandler(config, SPEC)
    assert handler.load(changed.engine) is None
    handler.dump(changed.engine, ac.StepInfo(0, 0, 0, SPEC.steps_per_epoch), force=True)
    handler.close()
    assert ac.RecoverHandler(config, SPEC).load(make_setup(seed=2, hidden_size=32, intermediate_size=64).engine)


def test_edited_manifest_is_named(fileroot):
    dump_once(fileroot)
    manifest_path = committed_generation(fileroot) / "recover_info/areal_ckpt_manifest.json"
    manifest_path.write_text(manifest_path.read_text().replace('"world_size": 1', '"world_size": 2'))
    with pytest.raises(ac.CheckpointError, match="areal_ckpt_manifest.json: checksum mismatch"):
        load_fresh(fileroot)


def test_incompatible_format_version_is_refused(fileroot):
    dump_once(fileroot)
    manifest_path = committed_generation(fileroot) / "recover_info/areal_ckpt_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = 99
    manifest_path.write_bytes(render_manifest(manifest))
    with pytest.raises(ac.CheckpointError, match="version 99 cannot be read"):
        load_fresh(fileroot)


def test_missing_manifest_is_an_incomplete_checkpoint(fileroot):
    dump_once(fileroot)
    (committed_generation(fileroot) / "recover_info/areal_ckpt_manifest.json").unlink()
    with pytest.raises(ac.CheckpointError, match="manifest missing"):
        ac.check_if_recover(recover_config(fileroot))
    with pytest.raises(ac.CheckpointError, match="manifest missing"):
        load_fresh(fileroot)


def test_commit_record_pointing_elsewhere_or_nowhere_is_refused(fileroot, tmp_path):
    dump_once(fileroot)
    pointer = trial_dir(fileroot) / ".recover/current"
    generation = committed_generation(fileroot)
    pointer.unlink()
    pointer.symlink_to(tmp_path)  # outside the store
    with pytest.raises(ac.CheckpointError, match="not a generation of this store"):
        load_fresh(fileroot)
    pointer.unlink()
    pointer.symlink_to("gen-00000009-0badc0de")  # dangling
    with pytest.raises(ac.CheckpointError, match="committed generation gen-00000009-0badc0de is missing"):
        ac.check_if_recover(recover_config(fileroot))
    assert generation.is_dir()


class _RunsCode:
    """Unpickling this would create a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_tampered_pickles_never_run(fileroot, tmp_path):
    dump_once(fileroot)
    generation = committed_generation(fileroot)
    marker = tmp_path / "code-ran"
    manifest_path = generation / "recover_info/areal_ckpt_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    # plant a code-running pickle where DCP's default writer keeps its pickled metadata, replace
    # a JSON state file with another, and forge the manifest so their checksums match: only the
    # loader's own rules stand between
    for relative in ("default/.metadata", "recover_info/checkpoint_info.json"):
        payload = pickle.dumps(_RunsCode(str(marker)))
        (generation / relative).write_bytes(payload)
        manifest["files"][relative] = {"size": len(payload), "crc32": zlib.crc32(payload)}
    manifest_path.write_bytes(render_manifest(manifest))
    with pytest.raises(ac.CheckpointError, match="checkpoint_info.json: state file unreadable"):
        load_fresh(fileroot)
    assert not marker.exists()
    # with only a .metadata pickle planted the checkpoint still loads: no such file is ever read
    dump_fileroot = tmp_path / "second"
    trained = dump_once(dump_fileroot)
    generation = committed_generation(dump_fileroot)
    payload = pickle.dumps(_RunsCode(str(marker)))
    (generation / "default/.metadata").write_bytes(payload)
    manifest_path = generation / "recover_info/areal_ckpt_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["default/.metadata"] = {"size": len(payload), "crc32": zlib.crc32(payload)}
    manifest_path.write_bytes(render_manifest(manifest))
    info, setup = load_fresh(dump_fileroot)
    assert info is not None and not marker.exists()
    assert torch.equal(setup.model.lm_head.weight, trained.model.lm_head.weight)


def test_data_files_hold_raw_tensor_bytes_that_our_loader_reads_without_unpickling(fileroot):
    trained = dump_once(fileroot)
    generation = committed_generation(fileroot)
    folder = generation / "default"
    index = json.loads((folder / "dcp_metadata.json").read_text())
    entry = next(e for e in index["storage"] if e["fqn"] == "dcp.model.lm_head.weight")
    data = bytearray((folder / entry["file"]).read_bytes())
    assert (
        data[entry["byte_offset"] : entry["byte_offset"] + entry["length"]]
        == trained.model.lm_head.weight.detach().contiguous().numpy().tobytes()
    )
    # garble every pickle in the folder (each record's data.pkl, DCP's .metadata) and forge the
    # manifest to match: stock torch can no longer read a record, our loader never needed them
    records = read_stock_metadata(folder).storage_data
    for info in records.values():
        record = zipfile.ZipFile(io.BytesIO(bytes(data[info.offset : info.offset + info.length])))
        member = record.getinfo("archive/data.pkl")
        start = info.offset + member.header_offset + 30 + len(member.filename)
        data[start : start + member.file_size] = b"X" * member.file_size
    first = next(iter(records.values()))
    with pytest.raises((pickle.UnpicklingError, RuntimeError, EOFError)):
        torch.load(io.BytesIO(bytes(data[first.offset : first.offset + first.length])), weights_only=True)
    manifest_path = generation / "recover_info/areal_ckpt_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for relative, payload in ((f"default/{entry['file']}", bytes(data)), ("default/.metadata", b"X" * 64)):
        (generation / relative).write_bytes(payload)
        manifest["files"][relative] = {"size": len(payload), "crc32": zlib.crc32(payload)}
    manifest_path.write_bytes(render_manifest(manifest))
    info, setup = load_fresh(fileroot)
    assert info is not None
    assert torch.equal(setup.model.lm_head.weight, trained.model.lm_head.weight)


def test_a_model_given_to_load_that_the_checkpoint_lacks_is_refused(fileroot):
    dump_once(fileroot)
    setup = make_setup()
    with pytest.raises(
        ac.CheckpointError, match=r"holds models \['default'\], load was given \['actor', 'ref'\]; it has no actor, ref"
    ):
        ac.RecoverHandler(recover_config(fileroot), SPEC).load({"actor": setup.engine, "ref": setup.engine})
