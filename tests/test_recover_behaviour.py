"""RecoverHandler behaviour: modes, what a dump holds, frozen models, options, retries, agreement."""

from __future__ import annotations

import json
import logging
import resource
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from recover_fixtures import (
    SPEC,
    committed_generation,
    dump_once,
    make_setup,
    recover_config,
    step_info,
    train_step,
    trial_dir,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torture import second_job

import areal_ckpt as ac


class Counter:
    """A stand-in evaluator / stats logger: anything with state_dict() / load_state_dict() works."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value, "history": [1.5, float("inf")]}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


@pytest.mark.parametrize("mode", ["off", "disabled"])
def test_off_modes_do_nothing(fileroot, mode):
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot, mode=mode, freq_steps=1), SPEC)
    assert handler.dump(setup.engine, step_info(0), force=True) is None
    assert handler.load(setup.engine) is None
    assert not ac.check_if_recover(recover_config(fileroot, mode=mode))
    assert not fileroot.joinpath("checkpoints").exists()


def test_no_checkpoint_means_none_and_a_fresh_start(fileroot):
    assert not ac.check_if_recover(recover_config(fileroot))
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup().engine) is None


def test_dump_follows_the_schedule(fileroot):
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot, freq_steps=3), SPEC)
    dumped = [handler.dump(setup.engine, step_info(g)) is not None for g in range(7)]
    assert dumped == [False, False, True, False, False, True, False]


def test_round_trip_of_everything_a_dump_holds(fileroot):
    setup = make_setup()
    loader = StatefulDataLoader(list(range(8)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    next(batches)
    saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), freq_steps=2), SPEC
    )
    saver.save(setup.engine, 0, 0, 0)  # one step counted towards the next export
    evaluator, stats_logger = Counter(7), Counter(9)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    train_step(setup, 0)
    path = handler.dump(
        setup.engine,
        step_info(0),
        saver=saver,
        dataloader=loader,
        evaluator=evaluator,
        stats_logger=stats_logger,
        client_state={"kl_coef": 0.05, "ppo_iter": 3},
        force=True,
    )
    assert Path(path) == committed_generation(fileroot)
    expected_rest = [batch.tolist() for batch in batches]
    after_dump = torch.rand(3)

    trial = trial_dir(fileroot)
    assert sorted(p.name for p in (trial / "recover_info").iterdir()) == [
        "areal_ckpt_manifest.json",
        "checkpoint_info.json",
        "evaluator_info.json",
        "rank0.json",
        "saver_info.json",
        "stats_logger_info.json",
        "step_info.json",
    ]
    assert (trial / "default/recover_checkpoint/dcp_metadata.json").is_file()
    assert json.loads((trial / "recover_info/step_info.json").read_text())["global_step"] == 0
    manifest = json.loads((trial / "recover_info/areal_ckpt_manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["models"] == ["default"] and manifest["format_version"] == 3

    fresh = make_setup(seed=3)
    new_loader = StatefulDataLoader(
        list(range(8)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    new_saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), freq_steps=2), SPEC
    )
    new_evaluator, new_logger = Counter(), Counter()
    torch.manual_seed(1234)  # disturb the RNG: load must restore it
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(
        fresh.engine, saver=new_saver, dataloader=new_loader, evaluator=new_evaluator, stats_logger=new_logger
    )
    assert info.last_step_info == step_info(0) and info.last_step_info.next() == step_info(1)
    assert info.client_state == {"kl_coef": 0.05, "ppo_iter": 3}
    assert (new_evaluator.value, new_logger.value) == (7, 9)
    assert torch.equal(torch.rand(3), after_dump)
    assert [batch.tolist() for batch in new_loader] == expected_rest
    assert new_saver.save(fresh.engine, 0, 1, 1) is not None  # the saver's cadence continued
    for name, tensor in fresh.model.state_dict().items():
        assert torch.equal(tensor, setup.model.state_dict()[name]), name
    assert fresh.scheduler.state_dict() == setup.scheduler.state_dict()
    assert fresh.optimizer.param_groups[0]["lr"] == setup.optimizer.param_groups[0]["lr"]
    for (_, a), (_, b) in zip(
        sorted(fresh.optimizer.state_dict()["state"].items()), sorted(setup.optimizer.state_dict()["state"].items())
    ):
        assert all(torch.equal(a[key], b[key]) for key in ("step", "exp_avg", "exp_avg_sq"))


def test_a_model_without_an_optimizer_loads_the_weights_of_a_dump_that_has_optimizer_state(fileroot):
    trained = dump_once(fileroot)
    fresh = make_setup(seed=1).model  # evaluation: the model alone, no optimizer, no scheduler
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(fresh)) is not None
    assert all(torch.equal(a, b) for a, b in zip(trained.model.state_dict().values(), fresh.state_dict().values()))


def test_frozen_reference_model_is_not_rewritten_until_it_changes(fileroot):
    actor = make_setup(seed=0)
    torch.manual_seed(5)
    ref_model = make_setup(seed=5).model
    engines = {"actor": actor.engine, "ref": ac.TorchEngine(ref_model)}
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)

    def inode(name: str) -> int:
        return (committed_generation(fileroot) / name / "__0_0.distcp").stat().st_ino

    handler.dump(engines, step_info(0), force=True)
    first = {name: inode(name) for name in engines}
    train_step(actor, 1)
    handler.dump(engines, step_info(1), force=True)
    assert inode("ref") == first["ref"]  # hard-linked, not rewritten
    assert inode("actor") != first["actor"]
    with torch.no_grad():
        ref_model.lm_head.weight.add_(1.0)  # e.g. the reference policy is refreshed from the actor
    handler.dump(engines, step_info(2), force=True)
    assert inode("ref") != first["ref"]
    loaded_ref = make_setup(seed=9).model
    ac.RecoverHandler(recover_config(fileroot), SPEC).load(
        {"actor": make_setup(seed=9).engine, "ref": ac.TorchEngine(loaded_ref)}
    )
    assert torch.equal(loaded_ref.lm_head.weight, ref_model.lm_head.weight)


def test_no_save_optim_and_no_load_optim(fileroot, caplog, tmp_path):
    trained = dump_once(fileroot, no_save_optim=True)
    assert not any(
        k.startswith("optim.")
        for k in json.loads((committed_generation(fileroot) / "default/dcp_metadata.json").read_text())["tensors"]
    )
    fresh = make_setup(seed=2)
    ac.RecoverHandler(recover_config(fileroot), SPEC).load(fresh.engine)
    assert torch.equal(fresh.model.lm_head.weight, trained.model.lm_head.weight)
    assert not fresh.optimizer.state or all(not torch.any(s["exp_avg"]) for s in fresh.optimizer.state.values())
    assert "optimizer state not restored (it was not saved)" in caplog.text

    other = tmp_path / "other"
    dump_once(other)
    untouched = make_setup(seed=2)
    ac.RecoverHandler(recover_config(other, no_load_optim=True), SPEC).load(untouched.engine)
    assert "not requested: no_load_optim" in caplog.text


def _dump_under_file_size_limit(rank: int, world: int, root: str, lift_at_retry: bool, result: str) -> None:
    """Dump with RLIMIT_FSIZE so small that checkpoint writes fail with EFBIG (a real kernel
    error). With ``lift_at_retry`` the limit is lifted when the first failed attempt announces
    its retry (an event of the code under test, not a timer), so the retry must succeed."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    messages: list[str] = []

    def collect(record: logging.LogRecord) -> None:
        messages.append(record.getMessage())
        if lift_at_retry and "retrying" in record.getMessage():
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)

    handler_log = logging.getLogger("areal_ckpt")
    handler_log.addHandler(type("Collect", (logging.Handler,), {"emit": lambda self, r: collect(r)})())
    fileroot = Path(root)
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot, write_retries=2), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    good = committed_generation(fileroot)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    train_step(setup, 1)
    try:
        handler.dump(setup.engine, step_info(1), force=True)
        outcome = "committed"
    except ac.CheckpointError as error:
        outcome = f"raised: {error}"
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    handler.close()  # removes what the ranks' own deletions left of the superseded generation
    leftovers = sorted(p.name for p in (trial_dir(fileroot) / ".recover").iterdir())
    Path(result).write_text(
        json.dumps(
            {
                "outcome": outcome,
                "retries": sum("retrying" in m for m in messages),
                "previous_intact": good.is_dir(),
                "committed": committed_generation(fileroot).name,
                "good": good.name,
                "leftovers": leftovers,
            }
        )
    )


def test_failed_writes_are_retried_then_raised_and_the_previous_checkpoint_survives(fileroot, tmp_path):
    result = tmp_path / "result.json"
    run_distributed(_dump_under_file_size_limit, 1, str(fileroot), False, str(result))
    report = json.loads(result.read_text())
    assert report["outcome"].startswith("raised:") and "after 3 attempts" in report["outcome"]
    assert "File too large" in report["outcome"]  # the kernel's cause, not a generic failure
    assert report["retries"] == 2
    assert report["committed"] == report["good"] and report["previous_intact"]
    assert report["leftovers"] == ["current", report["good"]]  # failed attempts left nothing behind


def test_a_transient_write_failure_is_retried_to_success(fileroot, tmp_path):
    result = tmp_path / "result.json"
    run_distributed(_dump_under_file_size_limit, 1, str(fileroot), True, str(result))
    report = json.loads(result.read_text())
    assert report["outcome"] == "committed" and report["retries"] == 1
    assert report["committed"] != report["good"] and report["leftovers"] == ["current", report["committed"]]


def _dump_with_rank_dependent_step(rank: int, world: int, root: str) -> None:
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(Path(root)), SPEC)
    with pytest.raises(ac.RankMismatchError, match="ranks disagree"):
        handler.dump(setup.engine, step_info(rank), force=True)


@pytest.mark.dist
def test_ranks_disagreeing_on_the_step_are_stopped_before_any_write(fileroot):
    run_distributed(_dump_with_rank_dependent_step, 2, str(fileroot))
    assert not (trial_dir(fileroot) / ".recover").exists()


def test_trial_lock_is_held_until_close_and_finalize(fileroot, tmp_path):
    report = tmp_path / "report.txt"
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester"), SPEC
    )
    run_distributed(second_job, 1, str(fileroot), str(report))
    assert report.read_text().startswith("refused") and "another job is using this trial" in report.read_text()
    handler.close()
    run_distributed(second_job, 1, str(fileroot), str(report))
    assert report.read_text().startswith("refused")  # the Saver still holds it
    saver.finalize()
    saver.finalize()  # idempotent
    run_distributed(second_job, 1, str(fileroot), str(report))
    assert report.read_text() == "accepted"


def test_stateless_optimizer_keeps_its_param_groups_without_a_hidden_copy(fileroot):
    setup = make_setup()
    sgd = torch.optim.SGD(setup.model.parameters(), lr=0.125)
    engine = ac.TorchEngine(setup.model, optimizer=sgd)
    tensors, extra = engine.recover_state(include_optimizer=True)
    assert all(parameter.grad is None for parameter in setup.model.parameters())  # no zero grads made
    assert not any(name.startswith("optim.") for name in tensors) and extra["optimizer_has_state"] is False
    ac.RecoverHandler(recover_config(fileroot), SPEC).dump(engine, step_info(0), force=True)
    fresh = make_setup(seed=4)
    fresh_sgd = torch.optim.SGD(fresh.model.parameters(), lr=1.0)
    ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(fresh.model, optimizer=fresh_sgd))
    assert fresh_sgd.param_groups[0]["lr"] == 0.125
    assert all(parameter.grad is None for parameter in fresh.model.parameters())  # nor when loading
    assert torch.equal(fresh.model.lm_head.weight, setup.model.lm_head.weight)


def test_the_superseded_dump_is_deleted_off_the_callers_thread_after_the_commit(fileroot, monkeypatch):
    from areal_ckpt.generations import tidy
    from areal_ckpt.generations.store import RecoverStore

    deleted: list[tuple[list[str], str, str | None]] = []  # (generations, thread, committed when deleting)
    real_delete = tidy.delete_rank_files

    def recording_delete(root, hidden, rank, models):
        deleted.append((list(hidden), threading.current_thread().name, RecoverStore(trial_dir(fileroot)).committed()))
        return real_delete(root, hidden, rank, models)

    monkeypatch.setattr(tidy, "delete_rank_files", recording_delete)
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    for step in range(2):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
    newest = committed_generation(fileroot)
    handler.close()  # waits for the deletion
    (hidden, thread, committed_then) = deleted[-1]
    assert len(hidden) == 1 and hidden[0].startswith(".trash-gen-00000000-")
    assert thread.startswith("areal_ckpt-trash") and thread != threading.current_thread().name
    assert committed_then == newest.name  # the newer dump was committed before anything was deleted
    store = trial_dir(fileroot) / ".recover"
    assert sorted(p.name for p in store.iterdir() if p.name.startswith((".trash", "gen-"))) == [newest.name]


def test_the_debris_a_load_finds_is_deleted_on_the_deletion_thread_while_it_loads_and_gone_when_it_returns(
    fileroot, monkeypatch
):
    from areal_ckpt.generations import tidy

    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    train_step(setup, 1)
    handler.dump(setup.engine, step_info(1), force=True)
    handler.close()
    newest = committed_generation(fileroot)
    older = newest.parent / "gen-00000000-0123abcd"  # what a crash between a commit and its tidy leaves
    shutil.copytree(newest, older)
    swept: list[tuple[list[str], str]] = []  # (hidden generations seen, thread)
    real_sweep = tidy._sweep_trash

    def recording_sweep(root: Path) -> None:
        swept.append((sorted(p.name for p in root.iterdir()), threading.current_thread().name))
        real_sweep(root)

    monkeypatch.setattr(tidy, "_sweep_trash", recording_sweep)
    fresh = make_setup(seed=1)
    loader = ac.RecoverHandler(recover_config(fileroot), SPEC)
    assert loader.load(fresh.engine).last_step_info.global_step == 1
    assert any(f".trash-{older.name}" in names and thread.startswith("areal_ckpt-trash") for names, thread in swept), (
        swept
    )
    store = newest.parent  # gone once the load returned, without close
    assert sorted(p.name for p in store.iterdir() if p.name.startswith((".trash", "gen-"))) == [newest.name]
    assert torch.equal(fresh.model.lm_head.weight, setup.model.lm_head.weight)
    loader.close()
