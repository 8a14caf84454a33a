"""An AReaL trial (stock DCP + JSON + pickle, as AReaL's RecoverHandler writes them, in place or
in its generation layout under LATEST) is imported in place and resumed with the same weights,
optimizer moments, step and data position; a hostile pickle or DCP metadata is refused by name
and nothing is imported."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from areal_trials import (
    DUMP_AFTER,
    IN_PLACE,
    LAYOUTS,
    STEPS,
    AReaLTrial,
    Counter,
    flat_state,
    loader,
    run,
    snapshot,
    write_areal_trial,
    write_recover_info,
)
from recover_fixtures import SPEC, dump_once, make_setup, recover_config, step_info, trial_dir
from test_dcp_interop import _assert_bitwise

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main


@pytest.fixture(params=LAYOUTS)
def areal_trial(request, fileroot) -> AReaLTrial:
    """An AReaL trial after global step DUMP_AFTER (actor only), in each of AReaL's layouts."""
    return write_areal_trial(trial_dir(fileroot), request.param, {"default": make_setup()})


@pytest.fixture
def in_place_trial(fileroot) -> AReaLTrial:
    """The same in AReaL's in-place layout only: for what does not depend on the layout."""
    return write_areal_trial(trial_dir(fileroot), IN_PLACE, {"default": make_setup()})


def test_an_imported_areal_trial_resumes_with_the_same_state_and_data(fileroot, areal_trial, capsys):
    trial = areal_trial.path
    originals = snapshot(trial)
    setup, data, evaluator, stats = make_setup(seed=1), loader(), Counter(), Counter()
    saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester", freq_steps=2),
        SPEC,
    )
    handler = ac.RecoverHandler(recover_config(fileroot, freq_steps=2), SPEC)
    with pytest.raises(ac.CheckpointError, match="written by AReaL") as refused:  # not imported yet: refused
        handler.load(setup.engine, saver, evaluator, stats, data)
    command = str(refused.value).split("convert it in place with `areal-ckpt ", 1)[1].split("`", 1)[0].split()
    assert command == ["import-areal", str(trial)]
    assert cli_main(command) == 0  # the hint
    assert "global step 4" in capsys.readouterr().out
    info = handler.load(setup.engine, saver, evaluator, stats, data)
    assert info is not None and info.last_step_info.global_step == DUMP_AFTER and info.world_size == 1
    assert (evaluator.calls, stats.calls) == (7, 5)
    assert saver.state_dict()["schedules"]["default"]["steps_since"] == 1
    assert json.loads((trial / "recover_info/checkpoint_info.json").read_text())["steps_since"] == 2
    for _ in range(DUMP_AFTER + 1):  # AReaL stores no LR scheduler state: advance it (docs/migrating.md)
        setup.scheduler.step()
    batches = iter(data)  # the restored position: the rest of epoch 1
    run(DUMP_AFTER + 1, STEPS - 1, [setup], data, batches)
    _assert_bitwise(flat_state(setup), areal_trial.want["default"])
    assert snapshot(trial / "areal_original") == originals  # AReaL's files, every byte, moved aside
    assert sorted(p.name for p in (trial / "areal_original").iterdir()) == areal_trial.areal_entries()
    assert (trial / "recover_info").is_symlink() and (trial / "default/recover_checkpoint").is_symlink()
    handler.close()
    saver.finalize()


def test_import_with_remove_original_leaves_only_our_layout(areal_trial, capsys):
    trial = areal_trial.path
    assert cli_main(["import-areal", str(trial), "--remove-original"]) == 0
    assert not (trial / "areal_original").exists()
    assert cli_main(["verify", str(trial)]) == 0
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 0  # a re-run: nothing to import, nothing changed
    assert "nothing to import: it holds areal_ckpt's checkpoint gen-" in capsys.readouterr().out
    assert snapshot(trial) == before


def test_a_rerun_after_training_on_changes_nothing_and_removes_the_originals_only_when_asked(
    fileroot, areal_trial, capsys
):
    """A launch script may run the import before every start of the job."""
    trial = areal_trial.path
    assert cli_main(["import-areal", str(trial)]) == 0
    setup = make_setup(seed=1)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.load(setup.engine)
    assert handler.dump(setup.engine, step_info(DUMP_AFTER + 1), force=True)
    handler.close()
    committed = (trial / ".recover/current").readlink().name
    before = snapshot(trial)
    capsys.readouterr()
    assert cli_main(["import-areal", str(trial)]) == 0
    out = capsys.readouterr().out
    assert f"nothing to import: it holds areal_ckpt's checkpoint {committed} (global step 5) already" in out
    assert f"AReaL's own folders are kept in {trial / 'areal_original'}" in out
    assert snapshot(trial) == before
    assert cli_main(["import-areal", str(trial), "--remove-original"]) == 0
    assert not (trial / "areal_original").exists() and (trial / ".recover/current").readlink().name == committed
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(setup.engine).last_step_info.global_step == 5


def test_our_checkpoints_beside_areals_folders_are_refused_by_name(fileroot, capsys):
    trial = trial_dir(fileroot)
    dump_once(fileroot)
    (trial / "recover_info").unlink()
    write_recover_info(trial / "recover_info", loader(), Counter())  # AReaL's folder where our link was
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert "holds areal_ckpt's recovery checkpoints and also AReaL's folders (recover_info)" in error
    assert snapshot(trial) == before


def test_an_interrupted_import_is_refused_until_the_import_is_run_again(fileroot, areal_trial, monkeypatch):
    trial = areal_trial.path
    real_rename = Path.rename

    def failing_rename(self: Path, target: Any) -> Any:
        if "areal_original" in str(target):
            raise OSError(28, "No space left on device")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    assert cli_main(["import-areal", str(trial)]) == 2  # committed, but AReaL's folders could not move
    monkeypatch.undo()
    setup = make_setup(seed=1)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    with pytest.raises(ac.CheckpointError, match="written by AReaL") as refused:
        handler.load(setup.engine)
    assert f"`areal-ckpt import-areal {trial}`" in str(refused.value)
    assert cli_main(["import-areal", str(trial)]) == 0  # finishes the committed import
    assert handler.load(setup.engine).last_step_info.global_step == DUMP_AFTER
    handler.close()


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (str(self.marker),)


def test_a_hostile_dataloader_pickle_is_refused_by_name_and_nothing_is_imported(tmp_path, areal_trial, capsys):
    trial = areal_trial.path
    marker = tmp_path / "planted"
    (areal_trial.info / "dataloader_info.pkl").write_bytes(pickle.dumps({"_num_yielded": _Planted(marker)}))
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert "dataloader_info.pkl: refused: refused global posix.mkdir" in error and "nothing in it was run" in error
    assert not marker.exists() and snapshot(trial) == before
    assert not (trial / ".recover/current").is_symlink()


def test_a_hostile_dcp_metadata_is_refused_and_nothing_is_imported(tmp_path, areal_trial, capsys):
    trial = areal_trial.path
    marker = tmp_path / "planted"
    (areal_trial.payload() / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    assert "refused global posix.mkdir" in capsys.readouterr().err
    assert not marker.exists() and snapshot(trial) == before


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_a_damaged_record_fails_the_import_by_name_and_leaves_the_trial_as_it_was(areal_trial, capsys, damage):
    trial = areal_trial.path
    data = areal_trial.payload() / "__0_0.distcp"
    content = data.read_bytes()
    data.write_bytes(content[: len(content) // 2] if damage == "truncated" else b"XXXX" + content[4:])
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert str(areal_trial.payload()) in error and "Traceback" not in error
    assert snapshot(trial) == before and not (trial / ".recover").exists()


def test_a_trial_of_several_ranks_keeps_each_ranks_position_and_its_world_size(in_place_trial):
    trial = in_place_trial.path
    positions = [{"_num_yielded": 1, "rank": 0}, {"_num_yielded": 1, "rank": 1}]  # AReaL all-gathers them
    (trial / "recover_info/dataloader_info.pkl").write_bytes(pickle.dumps(positions))
    imported = ac.import_areal_trial(trial)
    assert imported.world_size == 2
    manifest = json.loads((imported.generation / "recover_info/areal_ckpt_manifest.json").read_text())
    assert manifest["world_size"] == 2
    for rank in (0, 1):
        state = json.loads((imported.generation / f"recover_info/rank{rank}.json").read_text())
        assert state["dataloader"] == positions[rank] and state["rng"] is None


def test_the_dataloader_unpickler_reads_tensors_but_not_gradients():
    import io

    from areal_ckpt.state.plain_pickle import _PlainDataUnpickler

    state = {"generator": torch.Generator().manual_seed(1).get_state(), "order": [3, 1], "nested": {"a": (1.5, None)}}
    assert _PlainDataUnpickler(io.BytesIO(pickle.dumps(state))).load()["generator"].equal(state["generator"])
    with pytest.raises(pickle.UnpicklingError, match="may not require gradients"):
        _PlainDataUnpickler(io.BytesIO(pickle.dumps(torch.ones(2, requires_grad=True)))).load()


@pytest.mark.parametrize("linked", ["areal_original", "areal_original/default"])
def test_the_originals_are_never_moved_through_a_link_and_nothing_is_imported(tmp_path, in_place_trial, capsys, linked):
    trial = in_place_trial.path
    outside = tmp_path / "outside"
    outside.mkdir()
    (trial / linked).parent.mkdir(parents=True, exist_ok=True)
    (trial / linked).symlink_to(outside)
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial), "--remove-original"]) == 2
    error = capsys.readouterr().err
    assert f"{trial / linked}: is a link or a file, not a folder this import made" in error
    assert "Move it away and run the import again" in error
    assert list(outside.iterdir()) == [] and snapshot(trial) == before and not (trial / ".recover").exists()
    (trial / linked).unlink()  # the hint
    assert cli_main(["import-areal", str(trial), "--remove-original"]) == 0
    assert not (trial / "areal_original").exists() and list(outside.iterdir()) == []


@pytest.mark.parametrize("planted", ["recover_info/dataloader_info.pkl", "default/recover_checkpoint/.metadata"])
def test_a_fifo_in_place_of_a_file_is_refused_at_once(tmp_path, in_place_trial, planted):
    """A FIFO with no writer would block a plain open forever; run as a user runs it, with a
    limit so a regression fails instead of hanging the suite."""
    trial = in_place_trial.path
    (trial / planted).unlink()
    os.mkfifo(trial / planted)
    done = subprocess.run(
        [sys.executable, "-m", "areal_ckpt", "import-areal", str(trial)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert f"{trial / planted}: " in done.stderr and "not a regular file (a FIFO)" in done.stderr
    assert not (trial / ".recover").exists()


@pytest.mark.parametrize("target", ["/dev/zero", "a copy elsewhere"])
def test_a_link_in_place_of_the_pickle_is_refused_and_the_file_put_there_imports(areal_trial, capsys, target):
    """Only folder links were refused: a link to a file (a device, or the user's file) was read through."""
    trial = areal_trial.path
    pickle_path = areal_trial.info / "dataloader_info.pkl"
    original = pickle_path.read_bytes()
    elsewhere = trial.parent / "elsewhere.pkl"
    elsewhere.write_bytes(original)
    pickle_path.unlink()
    pickle_path.symlink_to("/dev/zero" if target == "/dev/zero" else elsewhere)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert f"{pickle_path}: is a link; the import reads AReaL's files only where AReaL writes them" in error
    assert "put the file itself there" in error and not (trial / ".recover").exists()
    pickle_path.unlink()
    pickle_path.write_bytes(original)  # the hint followed
    assert cli_main(["import-areal", str(trial)]) == 0


def _dag(levels: int) -> list:
    node: list = []
    for _ in range(levels):
        node = [node, node]  # each level doubles the written-out size; the pickle grows by a few bytes
    return node


def _self_referencing() -> list:
    node: list = []
    node.append(node)
    return node


@pytest.mark.parametrize(
    "position, message",
    [
        (_dag(40), "it expands to more than 16777216 values"),
        (_self_referencing(), "it contains itself"),
        (torch.zeros(1).as_strided((2**40,), (0,)), "it expands to more than 16777216 values"),
    ],
    ids=["memo-dag", "self-reference", "stride-0-tensor"],
)
def test_a_pickle_that_expands_without_bound_is_refused_by_name(in_place_trial, capsys, position, message):
    trial = in_place_trial.path
    payload = pickle.dumps(position)
    assert len(payload) < 1000
    (trial / "recover_info/dataloader_info.pkl").write_bytes(payload)
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert f"dataloader_info.pkl: refused: {message}; nothing in it was run" in error and "Traceback" not in error
    assert snapshot(trial) == before


@pytest.mark.parametrize("edit", [('"steps": 5', '"steps": Infinity'), ('"last_time": 0.0', '"last_time": -1e400')])
def test_trigger_state_with_infinite_values_counts_afresh_and_the_import_goes_on(in_place_trial, caplog, edit):
    trial = in_place_trial.path
    path = trial / "recover_info/saver_info.json"
    path.write_text(path.read_text().replace(*edit))
    assert edit[1] in path.read_text()
    imported = ac.import_areal_trial(trial)
    assert imported.step_info.global_step == DUMP_AFTER
    assert f"{path}: not AReaL's trigger state; those triggers count afresh" in caplog.text


def test_an_import_killed_after_moving_the_originals_but_before_the_links_is_finished_by_running_it_again(
    fileroot, areal_trial
):
    trial = areal_trial.path
    assert cli_main(["import-areal", str(trial)]) == 0
    (trial / "recover_info").unlink()  # the state a kill right after the moves leaves
    (trial / "default/recover_checkpoint").unlink()
    assert cli_main(["import-areal", str(trial)]) == 0
    assert (trial / "recover_info").is_symlink() and (trial / "default/recover_checkpoint").is_symlink()
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    assert info.last_step_info.global_step == DUMP_AFTER


def test_an_import_killed_before_its_commit_is_refused_by_recover_pointer_and_finished_by_the_import(
    tmp_path, fileroot, areal_trial, capsys
):
    """A kill between the manifest and the pointer switch leaves a complete generation beside
    AReaL's folders, with no `current`. recover-pointer changes nothing and names the command
    that finishes it; that command does."""
    trial = areal_trial.path
    before = tmp_path / "before"
    shutil.copytree(trial, before, symlinks=True)
    assert cli_main(["import-areal", str(trial)]) == 0
    (generation,) = [p for p in (trial / ".recover").iterdir() if p.name.startswith("gen-")]
    shutil.copytree(generation, tmp_path / generation.name)
    shutil.rmtree(trial)
    shutil.copytree(before, trial, symlinks=True)
    shutil.copytree(tmp_path / generation.name, trial / ".recover" / generation.name)
    capsys.readouterr()
    assert cli_main(["recover-pointer", str(trial)]) == 2
    error = capsys.readouterr().err
    assert "holds a recovery checkpoint written by AReaL" in error and "Traceback" not in error
    assert not (trial / ".recover/current").is_symlink() and areal_trial.info.is_dir()
    assert f"areal-ckpt import-areal {trial}" in error
    assert cli_main(["import-areal", str(trial)]) == 0  # the hint
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    assert info.last_step_info.global_step == DUMP_AFTER
