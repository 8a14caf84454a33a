"""Adding a backend (docs/storage.md): one class implementing ObjectStore, registered for its own
scheme (tests/folder_backend.py), and recovery works on it with no other change: a job dumps,
is SIGKILLed, and a fresh node resumes from what the new store holds, bit-exact."""

from __future__ import annotations

import os
import signal

import folder_backend
import torch
from distributed import run_distributed
from recover_fixtures import SPEC, make_setup, step_info, train_step

import areal_ckpt as ac

URL = "folder://bkt/runs"


def config(staging) -> ac.RecoverConfig:
    return ac.RecoverConfig(
        experiment_name="exp", trial_name="trial", fileroot=URL, user="tester", staging_dir=str(staging), mode="sync"
    )


def dump_then_die(rank: int, world_size: int, root: str, staging: str) -> None:
    os.environ[folder_backend.ROOT_VARIABLE] = root  # this process imported folder_backend: folder:// is served
    setup = make_setup()
    handler = ac.RecoverHandler(config(staging), SPEC)
    for step in range(3):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_backend_registered_for_its_scheme_runs_a_dump_kill_resume_cycle(tmp_path, monkeypatch):
    root = tmp_path / "objects"
    (root / "bkt").mkdir(parents=True)
    monkeypatch.setenv(folder_backend.ROOT_VARIABLE, str(root))
    assert run_distributed(dump_then_die, 1, str(root), str(tmp_path / "disk")) == [-9]
    records = sorted((root / "bkt/runs/checkpoints/tester/exp/trial/.recover/.commits").iterdir())
    assert [record.name for record in records] == ["000000000003.json"]  # committed through the new store
    expected = make_setup()
    for step in range(3):
        train_step(expected, step)
    fresh = make_setup(seed=1)
    handler = ac.RecoverHandler(config(tmp_path / "fresh-disk"), SPEC)
    info = handler.load(fresh.engine)
    handler.close()
    assert info is not None and info.last_step_info.global_step == 2
    for name, tensor in expected.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name
    for name, value in expected.optimizer.state_dict()["state"][0].items():
        assert torch.equal(fresh.optimizer.state_dict()["state"][0][name], value), name
