"""An AReaL trial (stock DCP + JSON + pickle, as AReaL's RecoverHandler writes them) is
imported in place and resumed with the same weights, optimizer moments, step and data position;
a hostile pickle or DCP metadata is refused by name and nothing is imported."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from recover_fixtures import SPEC, VOCAB, make_setup, recover_config, step_info, trial_dir
from test_dcp_interop import _AReaLShapedState, _assert_bitwise, _flat
from torch.distributed.checkpoint.state_dict import get_state_dict
from torchdata.stateful_dataloader import StatefulDataLoader

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main

STEPS = 8  # SPEC: 4 steps per epoch; the import resumes in epoch 1, after its first batch
DUMP_AFTER = 4  # global step 4: the first step of epoch 1


class _Counter:
    """An evaluator / stats logger: state that must come back as it was."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = state["calls"]


def _loader() -> StatefulDataLoader:
    return StatefulDataLoader(list(range(8)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))


def _train(setup, batch: torch.Tensor) -> None:
    tokens = (batch.reshape(-1, 1) * 3 + torch.arange(8)) % VOCAB
    setup.model(input_ids=tokens, labels=tokens).loss.backward()
    setup.optimizer.step()
    setup.scheduler.step()
    setup.optimizer.zero_grad()


def _run(first: int, last: int, setup, loader, batches=None) -> Any:
    """Train global steps first..last over ``loader``, a new epoch every SPEC.steps_per_epoch
    steps (``batches``: the epoch in progress, if any); returns the live iterator."""
    for global_step in range(first, last + 1):
        if batches is None or global_step % SPEC.steps_per_epoch == 0 and global_step != first:
            batches = iter(loader)
        _train(setup, next(batches))
    return batches


def _areal_freq_ctl(steps: int, last_steps: int) -> dict[str, Any]:
    """The state of AReaL's EpochStepTimeFreqCtl, as its Saver / RecoverHandler dump it."""

    def control(count: int, last: int) -> dict[str, Any]:
        return {
            "frequence_seconds": None,
            "frequency_steps": 2,
            "start_time": 0.0,
            "steps": count,
            "last_time": 0.0,
            "last_steps": last,
            "interval_steps": 1,
            "interval_seconds": 0.1,
            "initial_value": False,
        }

    return {"epoch": control(1, 1), "step": control(steps, last_steps), "time": control(steps, 0)}


def _write_areal_trial(trial: Path, setup, loader, stats: _Counter) -> None:
    """What AReaL's RecoverHandler.dump leaves after global step DUMP_AFTER, written the way it
    writes it (an FSDP engine's dcp.save of {"dcp": DCPState}, json.dump, pickle.dump)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"dcp": _AReaLShapedState(setup.model, setup.optimizer)},
            checkpoint_id=str(trial / "default/recover_checkpoint"),
        )
    info = trial / "recover_info"
    info.mkdir(parents=True)
    epoch, epoch_step = divmod(DUMP_AFTER, SPEC.steps_per_epoch)
    (info / "step_info.json").write_text(
        json.dumps(
            {
                "epoch": epoch,
                "epoch_step": epoch_step,
                "global_step": DUMP_AFTER,
                "steps_per_epoch": SPEC.steps_per_epoch,
            }
        )
    )
    (info / "saver_info.json").write_text(json.dumps(_areal_freq_ctl(DUMP_AFTER + 1, DUMP_AFTER)))
    (info / "evaluator_info.json").write_text(json.dumps({"calls": 7}))
    (info / "stats_logger_info.json").write_text(json.dumps(stats.state_dict()))
    (info / "checkpoint_info.json").write_text(json.dumps(_areal_freq_ctl(DUMP_AFTER + 1, DUMP_AFTER - 1)))
    with open(info / "dataloader_info.pkl", "wb") as f:
        pickle.dump(loader.state_dict(), f)


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
        if p.name != ".areal_ckpt.lock"
    }


@pytest.fixture
def areal_trial(fileroot):
    """An AReaL trial after global step DUMP_AFTER, and the uninterrupted run's final state."""
    reference = make_setup()
    loader = _loader()
    batches = _run(0, DUMP_AFTER, reference, loader)
    stats = _Counter()
    stats.calls = 5
    _write_areal_trial(trial_dir(fileroot), reference, loader, stats)
    _run(DUMP_AFTER + 1, STEPS - 1, reference, loader, batches)
    return trial_dir(fileroot), _flat(*get_state_dict(reference.model, reference.optimizer))


def test_an_imported_areal_trial_resumes_with_the_same_state_and_data(fileroot, areal_trial, capsys):
    trial, want = areal_trial
    originals = _snapshot(trial)
    setup, loader, evaluator, stats = make_setup(seed=1), _loader(), _Counter(), _Counter()
    saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester", freq_steps=2),
        SPEC,
    )
    handler = ac.RecoverHandler(recover_config(fileroot, freq_steps=2), SPEC)
    with pytest.raises(ac.CheckpointError, match="written by AReaL") as refused:  # not imported yet: refused
        handler.load(setup.engine, saver, evaluator, stats, loader)
    command = str(refused.value).split("convert it in place with `areal-ckpt ", 1)[1].split("`", 1)[0].split()
    assert command == ["import-areal", str(trial)]
    assert cli_main(command) == 0  # the hint
    assert "global step 4" in capsys.readouterr().out
    info = handler.load(setup.engine, saver, evaluator, stats, loader)
    assert info is not None and info.last_step_info.global_step == DUMP_AFTER and info.world_size == 1
    assert (evaluator.calls, stats.calls) == (7, 5)
    assert saver.state_dict()["schedules"]["default"]["steps_since"] == 1
    assert json.loads((trial / "recover_info/checkpoint_info.json").read_text())["steps_since"] == 2
    for _ in range(DUMP_AFTER + 1):  # AReaL stores no LR scheduler state: advance it (docs/migrating.md)
        setup.scheduler.step()
    batches = iter(loader)  # the restored position: the rest of epoch 1
    _run(DUMP_AFTER + 1, STEPS - 1, setup, loader, batches)
    _assert_bitwise(_flat(*get_state_dict(setup.model, setup.optimizer)), want)
    kept = _snapshot(trial / "areal_original")
    assert kept.pop("default") == "dir"
    assert kept == {k: v for k, v in originals.items() if k.startswith(("recover_info", "default/recover_checkpoint"))}
    assert (trial / "recover_info").is_symlink() and (trial / "default/recover_checkpoint").is_symlink()
    handler.close()
    saver.finalize()


def test_import_with_remove_original_leaves_only_our_layout(areal_trial):
    trial, _ = areal_trial
    assert cli_main(["import-areal", str(trial), "--remove-original"]) == 0
    assert not (trial / "areal_original").exists()
    assert cli_main(["verify", str(trial)]) == 0
    assert cli_main(["import-areal", str(trial)]) == 2  # nothing left to import


def test_an_interrupted_import_is_refused_until_the_import_is_run_again(fileroot, areal_trial, monkeypatch):
    trial, _ = areal_trial
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
    trial, _ = areal_trial
    marker = tmp_path / "planted"
    (trial / "recover_info/dataloader_info.pkl").write_bytes(pickle.dumps({"_num_yielded": _Planted(marker)}))
    before = _snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert "dataloader_info.pkl: refused: refused global posix.mkdir" in error and "nothing in it was run" in error
    assert not marker.exists() and _snapshot(trial) == before
    assert not (trial / ".recover/current").is_symlink()


def test_a_hostile_dcp_metadata_is_refused_and_nothing_is_imported(tmp_path, areal_trial, capsys):
    trial, _ = areal_trial
    marker = tmp_path / "planted"
    (trial / "default/recover_checkpoint/.metadata").write_bytes(pickle.dumps(_Planted(marker)))
    before = _snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    assert "refused global posix.mkdir" in capsys.readouterr().err
    assert not marker.exists() and _snapshot(trial) == before


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_a_damaged_record_fails_the_import_by_name_and_leaves_the_trial_as_it_was(areal_trial, capsys, damage):
    trial, _ = areal_trial
    data = trial / "default/recover_checkpoint/__0_0.distcp"
    content = data.read_bytes()
    data.write_bytes(content[: len(content) // 2] if damage == "truncated" else b"XXXX" + content[4:])
    before = _snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert "recover_checkpoint" in error and "Traceback" not in error
    assert _snapshot(trial) == before and not (trial / ".recover").exists()


def test_a_trial_of_several_ranks_keeps_each_ranks_position_and_its_world_size(areal_trial):
    trial, _ = areal_trial
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
def test_the_originals_are_never_moved_through_a_link_and_nothing_is_imported(tmp_path, areal_trial, capsys, linked):
    trial, _ = areal_trial
    outside = tmp_path / "outside"
    outside.mkdir()
    (trial / linked).parent.mkdir(parents=True, exist_ok=True)
    (trial / linked).symlink_to(outside)
    before = _snapshot(trial)
    assert cli_main(["import-areal", str(trial), "--remove-original"]) == 2
    error = capsys.readouterr().err
    assert f"{trial / linked}: is a link or a file, not a folder this import made" in error
    assert "Move it away and run the import again" in error
    assert list(outside.iterdir()) == [] and _snapshot(trial) == before and not (trial / ".recover").exists()
    (trial / linked).unlink()  # the hint
    assert cli_main(["import-areal", str(trial), "--remove-original"]) == 0
    assert not (trial / "areal_original").exists() and list(outside.iterdir()) == []


@pytest.mark.parametrize("planted", ["recover_info/dataloader_info.pkl", "default/recover_checkpoint/.metadata"])
def test_a_fifo_in_place_of_a_file_is_refused_at_once(tmp_path, areal_trial, planted):
    """A FIFO with no writer would block a plain open forever; run as a user runs it, with a
    limit so a regression fails instead of hanging the suite."""
    trial, _ = areal_trial
    (trial / planted).unlink()
    os.mkfifo(trial / planted)
    done = subprocess.run(
        [sys.executable, "-m", "areal_ckpt", "import-areal", str(trial)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert f"{trial / planted}: " in done.stderr and "not a regular file (a FIFO)" in done.stderr
    assert not (trial / ".recover").exists()


def test_a_device_linked_in_place_of_the_pickle_is_refused(areal_trial, capsys):
    trial, _ = areal_trial
    pickle_path = trial / "recover_info/dataloader_info.pkl"
    pickle_path.unlink()
    pickle_path.symlink_to("/dev/zero")
    assert cli_main(["import-areal", str(trial)]) == 2
    assert f"{pickle_path}: cannot read: not a regular file (a device)" in capsys.readouterr().err


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
def test_a_pickle_that_expands_without_bound_is_refused_by_name(areal_trial, capsys, position, message):
    trial, _ = areal_trial
    payload = pickle.dumps(position)
    assert len(payload) < 1000
    (trial / "recover_info/dataloader_info.pkl").write_bytes(payload)
    before = _snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert f"dataloader_info.pkl: refused: {message}; nothing in it was run" in error and "Traceback" not in error
    assert _snapshot(trial) == before


@pytest.mark.parametrize("edit", [('"steps": 5', '"steps": Infinity'), ('"last_time": 0.0', '"last_time": -1e400')])
def test_trigger_state_with_infinite_values_counts_afresh_and_the_import_goes_on(areal_trial, caplog, edit):
    trial, _ = areal_trial
    path = trial / "recover_info/saver_info.json"
    path.write_text(path.read_text().replace(*edit))
    assert edit[1] in path.read_text()
    imported = ac.import_areal_trial(trial)
    assert imported.step_info.global_step == DUMP_AFTER
    assert f"{path}: not AReaL's trigger state; those triggers count afresh" in caplog.text


def test_an_import_killed_after_moving_the_originals_but_before_the_links_is_finished_by_running_it_again(
    fileroot, areal_trial
):
    trial, _ = areal_trial
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
    trial, _ = areal_trial
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
    assert not (trial / ".recover/current").is_symlink() and (trial / "recover_info").is_dir()
    assert f"areal-ckpt import-areal {trial}" in error
    assert cli_main(["import-areal", str(trial)]) == 0  # the hint
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    assert info.last_step_info.global_step == DUMP_AFTER


def _generation_layout_trial(trial: Path) -> None:
    """AReaL's newer crash-safe layout (its PR #1616, as described there): a LATEST pointer
    over checkpoint_generations/generation_step%08d/{manifest/, payloads/<engine>/}."""
    generation = trial / "checkpoint_generations/generation_step00000004"
    (generation / "manifest").mkdir(parents=True)
    (generation / "payloads/default").mkdir(parents=True)
    (generation / "manifest/manifest.json").write_text(json.dumps({"global_step": 4, "engines": ["default"]}))
    (generation / "payloads/default/weights.bin").write_bytes(b"\0" * 64)
    latest = {"format_version": 1, "generation": generation.name, "global_step": 4, "engines": ["default"]}
    (trial / "LATEST").write_text(json.dumps(latest))


def test_areals_generation_layout_is_never_taken_for_a_fresh_trial(fileroot, tmp_path, capsys):
    trial = trial_dir(fileroot)
    _generation_layout_trial(trial)
    before = _snapshot(trial)
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    for attempt in (lambda: ac.check_if_recover(recover_config(fileroot)), lambda: handler.load(setup.engine)):
        with pytest.raises(
            ac.CheckpointError, match="holds a recovery checkpoint in AReaL's generation layout"
        ) as refused:
            attempt()
        assert "LATEST" in str(refused.value) and "checkpoint_generations" in str(refused.value)
    with pytest.raises(ac.CheckpointError, match="AReaL's generation layout"):
        handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    assert cli_main(["import-areal", str(trial)]) == 2
    assert "cannot be imported yet; nothing was changed" in capsys.readouterr().err
    assert _snapshot(trial) == before
    trial.rename(trial.with_name("trial.areal"))  # the hint: move it away, then start afresh
    fresh = ac.RecoverHandler(recover_config(fileroot), SPEC)
    assert fresh.load(setup.engine) is None
    assert fresh.dump(setup.engine, step_info(0), force=True)
    fresh.close()
