"""Power cuts, not just kill -9: our writers run on a FUSE file system that remembers what a
power cut would keep (tests/crashfs.py); every disk state a cut could leave is then rebuilt as
an ordinary folder and loaded as after a reboot. Each must load the last checkpoint whose save
had returned, or the one being written, bit for bit: never an error, never less.

Two persistence models: ``strict`` (data and directory entries survive only once fsync'd) and
``eager_metadata`` (directory entries survive at once, data only once fsync'd: a rename of a
file whose data was never synced shows an empty file)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from areal_trials import DUMP_AFTER, LAYOUTS, write_areal_trial
from crashfs import MODELS, Mounted, mark_returned
from distributed import run_distributed
from recover_fixtures import SPEC, make_setup, recover_config, step_info, train_step
from safetensors.torch import load_file, save_file

import areal_ckpt as ac


@pytest.fixture
def crashfs(tmp_path: Path) -> Iterator[Mounted]:
    if shutil.which("fusermount3") is None or not os.path.exists("/dev/fuse"):
        pytest.fail("power-loss tests need FUSE: /dev/fuse and fuse3 (make test installs fuse3)")
    mounted = Mounted(tmp_path / "fs")
    try:
        yield mounted
    finally:
        mounted.close()


def _check_every_state(crashfs: Mounted, tmp_path: Path, check: Callable[[Path, int | None], None]) -> int:
    count = 0
    for model in MODELS:
        for index, newest, folder in crashfs.states(model, tmp_path / "states"):
            try:
                check(folder, newest)
            except AssertionError as failure:
                raise AssertionError(f"model {model}, power cut after event {index}: {failure}") from None
            count += 1
    return count


def dump_worker(rank: int, world_size: int, mount: str, mode: str, log: str, returns: str, saved: str) -> None:
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(Path(mount), mode=mode), SPEC)
    for step in range(3):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
        handler.wait()  # an asynchronous dump is durable once wait returns
        if rank == 0:
            mark_returned(Path(log), Path(returns))
            save_file({k: v.contiguous() for k, v in setup.model.state_dict().items()}, f"{saved}.{step}")
    handler.close()


@pytest.mark.parametrize(("world", "mode"), [(1, "sync"), (1, "async"), (2, "sync")])
def test_recovery_dumps_survive_a_power_cut_at_every_point(crashfs, tmp_path, world, mode):
    saved = tmp_path / "saved"
    args = (str(crashfs.mount), mode, str(crashfs.log), str(crashfs.returns_file), str(saved))
    run_distributed(dump_worker, world, *args)
    crashfs.close()

    def check(folder: Path, newest: int | None) -> None:
        fresh = make_setup(seed=1)
        config = recover_config(folder, mode="sync", on_world_size_change="drop_rank_state")  # 2 ranks' dump, read by 1
        info = ac.RecoverHandler(config, SPEC).load(fresh.engine)
        step = None if info is None else info.last_step_info.global_step
        allowed = {0, None} if newest is None else {newest, newest + 1} & {0, 1, 2}
        assert step in allowed, f"loaded step {step}, the newest saved by then was {newest}"
        if step is not None:
            expected = load_file(f"{saved}.{step}")
            assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in expected.items()), "weights differ"

    assert _check_every_state(crashfs, tmp_path, check) > 20  # every point where the durable state changed


def test_hf_exports_with_retention_survive_a_power_cut_at_every_point(crashfs, tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from areal_ckpt.tools.inspection import verify

    setup = make_setup()
    saver = ac.Saver(
        ac.SaverConfig(
            experiment_name="exp",
            trial_name="trial",
            fileroot=str(crashfs.mount),
            user="tester",
            mode="sync",
            keep_last=1,
        ),
        SPEC,
    )
    saved = []
    for step in range(3):
        train_step(setup, step)
        saver.save(setup.engine, 0, step, step, force=True, tokenizer=tokenizer)
        crashfs.returned()
        saved.append(setup.model.lm_head.weight.detach().clone())
    saver.finalize()
    crashfs.close()

    def check(folder: Path, newest: int | None) -> None:
        root = folder / "checkpoints/tester/exp/trial/default"
        exports = sorted(p for p in root.iterdir() if p.name.startswith("epoch")) if root.is_dir() else []
        steps = {int(p.name.rpartition("globalstep")[2]) for p in exports}
        if newest is not None:
            assert steps & {newest, newest + 1}, f"exports {sorted(steps)}, the newest saved by then was {newest}"
        for export in exports:  # every visible export is whole and loads
            assert verify(export) == [], f"{export.name}: {verify(export)}"
            model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
            step = int(export.name.rpartition("globalstep")[2])
            assert torch.equal(model.lm_head.weight, saved[step]), export.name

    assert _check_every_state(crashfs, tmp_path, check) > 20


def test_deepspeed_shaped_tags_and_latest_survive_a_power_cut_at_every_point(crashfs, tmp_path):
    setup = make_setup()
    saved = []
    for step in range(3):
        train_step(setup, step)
        ac.save_checkpoint(setup.engine, crashfs.mount / "ds", tag=f"step{step}", client_state={"step": step})
        crashfs.returned()
        saved.append(setup.model.lm_head.weight.detach().clone())
    crashfs.close()

    def check(folder: Path, newest: int | None) -> None:
        fresh = make_setup(seed=1)
        if not (folder / "ds/latest").exists():
            assert newest is None, f"'latest' is gone, the newest saved by then was {newest}"
            return
        path, client_state = ac.load_checkpoint(fresh.engine, folder / "ds")
        step = client_state["step"]
        allowed = {0} if newest is None else {newest, newest + 1}
        assert step in allowed, f"'latest' names step {step}, the newest saved by then was {newest}"
        assert torch.equal(fresh.model.lm_head.weight, saved[step]), json.dumps({"path": path})

    assert _check_every_state(crashfs, tmp_path, check) > 10


@pytest.mark.parametrize("layout", LAYOUTS)
def test_import_areal_survives_a_power_cut_at_every_point(tmp_path, layout):
    """An AReaL trial on disk (in place, or in its generation layout under LATEST), imported in
    place: after any cut the trial holds AReaL's own layout (refused with the import hint, which
    then succeeds) or the import, and either way the job resumes with AReaL's weights. Never a
    trial that loads nothing or other weights."""
    from areal_ckpt.tools.import_areal import import_areal_trial

    backing = tmp_path / "fs/backing"
    written = write_areal_trial(backing / "checkpoints/tester/exp/trial", layout, {"default": make_setup()})
    weights = written.dumped["default"]
    mounted = Mounted(tmp_path / "fs", backing)
    try:
        import_areal_trial(mounted.mount / "checkpoints/tester/exp/trial")
        mounted.returned()
    finally:
        mounted.close()

    def check(folder: Path, newest: int | None) -> None:
        fresh = make_setup(seed=1)
        handler = ac.RecoverHandler(recover_config(folder), SPEC)
        try:
            info = handler.load(fresh.engine)
        except ac.CheckpointError as error:
            assert newest is None, f"the import had returned, yet: {error}"
            assert "areal-ckpt import-areal" in str(error), str(error)  # the hint, followed
            import_areal_trial(folder / "checkpoints/tester/exp/trial")
            info = handler.load(fresh.engine)
        handler.close()
        assert info is not None and info.last_step_info.global_step == DUMP_AFTER
        assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in weights.items()), "weights differ"

    assert _check_every_state(mounted, tmp_path, check) > 10


def test_recover_pointer_survives_a_power_cut_at_every_point(tmp_path):
    """A trial whose commit record was lost (a copy that dropped links), re-pointed by
    `areal-ckpt recover-pointer`: after any cut it is refused with the same hint (which then
    works) or it loads the newest generation."""
    from areal_ckpt.cli.main import main as cli_main

    backing = tmp_path / "fs/backing"
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(backing), SPEC)
    for step in range(2):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
    handler.close()
    weights = {k: v.clone() for k, v in setup.model.state_dict().items()}
    trial = "checkpoints/tester/exp/trial"
    (backing / trial / ".recover/current").unlink()
    mounted = Mounted(tmp_path / "fs", backing)
    try:
        assert cli_main(["recover-pointer", str(mounted.mount / trial)]) == 0
        mounted.returned()
    finally:
        mounted.close()

    def check(folder: Path, newest: int | None) -> None:
        fresh = make_setup(seed=1)
        try:
            info = ac.RecoverHandler(recover_config(folder), SPEC).load(fresh.engine)
        except ac.CheckpointError as error:
            assert newest is None and f"areal-ckpt recover-pointer {folder / trial}" in str(error), str(error)
            assert cli_main(["recover-pointer", str(folder / trial)]) == 0  # the hint, followed
            info = ac.RecoverHandler(recover_config(folder), SPEC).load(fresh.engine)
        assert info is not None and info.last_step_info.global_step == 1
        assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in weights.items()), "weights differ"

    assert _check_every_state(mounted, tmp_path, check) >= 2


def _tiny_writer(folder: Path, durable: bool) -> None:
    """Write a file and rename it into place, with or without the fsyncs that make it durable."""
    (folder / "sub").mkdir()
    with open(folder / "sub/tmp", "wb") as handle:
        handle.write(b"payload")
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.rename(folder / "sub/tmp", folder / "sub/data")
    if durable:
        for directory in (folder / "sub", folder):
            descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(descriptor)
            os.close(descriptor)


@pytest.mark.parametrize("durable", [False, True])
def test_the_harness_loses_what_was_not_made_durable_and_keeps_what_was(crashfs, tmp_path, durable):
    _tiny_writer(crashfs.mount, durable)
    crashfs.returned()
    crashfs.close()
    after = {}
    for model in MODELS:  # the last state: the disk after the program ended and the power went
        for _, _, folder in crashfs.states(model, tmp_path / "states"):
            data = folder / "sub/data"
            after[model] = data.read_bytes() if data.is_file() else None
    if durable:
        assert after == {"strict": b"payload", "eager_metadata": b"payload"}
    else:
        assert after["strict"] is None  # neither the data nor the entries were synced
        assert after["eager_metadata"] == b""  # the rename survived, the data did not
