"""A node-local tier in front of a shared file system (fileroot a folder, local_dir another):
what is particular to a folder as the persistent tier. The cycles every persistent tier runs
(background upload, own-node and fresh-node resume, a damaged local file, async, a second job)
are in test_tiered.py, parametrised over it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from recover_fixtures import SPEC, make_setup, step_info, train_step

import areal_ckpt as ac
from areal_ckpt.errors import CheckpointError
from areal_ckpt.storage.folders import FolderSource

TRIAL = "checkpoints/tester/exp/trial"


def config(shared: Path, local: Path | None) -> ac.RecoverConfig:
    return ac.RecoverConfig(
        experiment_name="exp",
        trial_name="trial",
        fileroot=str(shared),
        user="tester",
        mode="sync",
        local_dir=None if local is None else str(local),
    )


def test_the_shared_trial_is_an_ordinary_trial_that_a_job_without_local_dir_resumes_from(tmp_path):
    setup = make_setup()
    handler = ac.RecoverHandler(config(tmp_path / "shared", tmp_path / "nvme"), SPEC)
    for step in range(2):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
    handler.close()  # the newest is in the shared trial too
    shared = tmp_path / "shared" / TRIAL
    generations = sorted(path.name for path in (shared / ".recover").glob("gen-*"))
    assert generations == [os.readlink(shared / ".recover/current")]  # one committed generation, the newest
    assert (shared / "recover_info/step_info.json").is_file()  # the fixed links of a local trial
    fresh = make_setup(seed=1)
    plain = ac.RecoverHandler(config(tmp_path / "shared", None), SPEC)  # local_dir dropped
    assert plain.load(fresh.engine).last_step_info.global_step == 1
    plain.close()
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name


def test_a_link_in_the_shared_trial_is_never_written_through(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shared = tmp_path / "shared" / TRIAL
    shared.mkdir(parents=True)
    (shared / ".recover").symlink_to(elsewhere)  # not ours: a link where the generations go
    setup = make_setup()
    with caplog.at_level(logging.WARNING):
        handler = ac.RecoverHandler(config(tmp_path / "shared", tmp_path / "nvme"), SPEC)
    assert "is a symbolic link" in caplog.text
    with pytest.raises(CheckpointError, match=r"\.recover: is a symbolic link to .*move the link away"):
        handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    os.replace(shared / ".recover", tmp_path / "moved-away")  # the hint followed
    handler = ac.RecoverHandler(config(tmp_path / "shared", tmp_path / "nvme"), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    assert (shared / ".recover/current").is_symlink() and list(elsewhere.iterdir()) == []


def test_a_file_read_from_a_shared_folder_through_a_link_is_refused(tmp_path):
    folder, outside = tmp_path / "gen", tmp_path / "outside"
    folder.mkdir()
    outside.write_bytes(b"not the checkpoint's")
    (folder / "model.safetensors").symlink_to(outside)
    (tmp_path / "copy").mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors is a link; not reading through it"):
        FolderSource(folder).get_file("model.safetensors", tmp_path / "copy/model.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        FolderSource(folder).get_file("absent", tmp_path / "copy/absent")
    assert list((tmp_path / "copy").iterdir()) == []  # no partial copy left
