"""AReaL's generation layout (PR #1616: LATEST over checkpoint_generations/): the import reads only
the generation LATEST names, refuses a LATEST that does not name a whole generation with nothing
changed, leaves unpublished generations alone and says so; a trial of actor and critic resumes
both bit-exact, or the actor alone (AReaL's RL trainer's call) with a warning naming the critic."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from areal_trials import (
    DUMP_AFTER,
    GENERATIONS,
    IN_PLACE,
    STEPS,
    AReaLTrial,
    Counter,
    flat_state,
    generation_name,
    loader,
    run,
    snapshot,
    write_areal_trial,
    write_payload,
    write_recover_info,
)
from recover_fixtures import SPEC, make_setup, recover_config, step_info, trial_dir
from test_dcp_interop import _assert_bitwise, _stock_load

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main


@pytest.fixture
def generation_trial(fileroot) -> AReaLTrial:
    return write_areal_trial(trial_dir(fileroot), GENERATIONS, {"default": make_setup()})


def _refusals(fileroot: Path) -> list[Callable[[], Any]]:
    """Every way a job meets a trial: check_if_recover, load and a first dump."""
    setup = make_setup(seed=1)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    return [
        lambda: ac.check_if_recover(recover_config(fileroot)),
        lambda: handler.load(setup.engine),
        lambda: handler.dump(setup.engine, step_info(0), force=True),
    ]


def test_an_unimported_generation_trial_is_refused_untouched_and_the_import_hint_resumes_it(
    fileroot, generation_trial, capsys
):
    trial = generation_trial.path
    before = snapshot(trial)
    for attempt in _refusals(fileroot):
        with pytest.raises(ac.CheckpointError, match="written by AReaL in AReaL's generation layout") as refused:
            attempt()
        assert "LATEST, checkpoint_generations" in str(refused.value)
    assert snapshot(trial) == before
    command = str(refused.value).split("convert it in place with `areal-ckpt ", 1)[1].split("`", 1)[0].split()
    assert cli_main(command) == 0  # the hint
    assert "after global step 4" in capsys.readouterr().out
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    assert info.last_step_info.global_step == DUMP_AFTER
    assert snapshot(trial / "areal_original") == before


def test_an_unimported_generation_trial_moved_away_as_the_error_says_starts_afresh(fileroot, generation_trial):
    trial = generation_trial.path
    with pytest.raises(ac.CheckpointError, match="move that trial folder away") as refused:
        ac.check_if_recover(recover_config(fileroot))
    source, target = str(refused.value).split("(e.g. mv ", 1)[1].split(")", 1)[0].split()
    assert (source, target) == (str(trial), f"{trial}.areal")
    Path(source).rename(target)  # the hint
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    setup = make_setup()
    assert handler.load(setup.engine) is None
    assert handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    assert (Path(target) / "LATEST").is_file()


def _latest(trial: Path) -> dict[str, Any]:
    return json.loads((trial / "LATEST").read_text())


def _edit(**fields: Any) -> Callable[[Path], None]:
    def edit(trial: Path) -> None:
        (trial / "LATEST").write_text(json.dumps({**_latest(trial), **fields}, indent=2, sort_keys=True))

    return edit


def _write(text: str) -> Callable[[Path], None]:
    return lambda trial: (trial / "LATEST").write_text(text)


def _link_latest(trial: Path) -> None:
    (trial / "LATEST.real").write_bytes((trial / "LATEST").read_bytes())
    (trial / "LATEST").unlink()
    (trial / "LATEST").symlink_to("LATEST.real")


@pytest.mark.parametrize(
    "damage, message",
    [
        (_write('{"format_version": 1, '), "AReaL's checkpoint pointer is unreadable"),
        (_write("[1, 2]"), "AReaL's checkpoint pointer is not a JSON object"),
        (_write('{"format_version": 1}'), "AReaL's checkpoint pointer lacks generation, global_step, engines"),
        (_write(" " * 70000), "more than 65536 bytes"),
        (_edit(format_version=2), "format_version 2; this import reads format 1"),
        (_edit(global_step=True), "global_step True is not a step"),
        (_edit(global_step=10**300, generation=f"generation_step{10**300:08d}"), "... (301 characters) is not a step"),
        (_edit(global_step=10**19, generation=f"generation_step{10**19:08d}"), "to 2**63 - 1); nothing was imported"),
        (_edit(generation="generation_step00000003"), "generation 'generation_step00000003' does not match"),
        (_edit(engines=[]), "engines [] is not a non-empty list of names"),
        (_edit(engines=["default", "default"]), "names one engine twice"),
        (_edit(engines=["../default"]), "engine '../default'"),
        (_edit(engines=["recover_info"]), "engine 'recover_info': model name 'recover_info' is taken"),
        (_edit(global_step=6, generation=generation_name(6)), f"{generation_name(6)}: missing (named by"),
        (_edit(engines=["critic", "default"]), "payloads/critic: missing (named by"),
        (_link_latest, "LATEST: is a link"),
    ],
    ids=[
        "cut-short",
        "not-an-object",
        "lacking-keys",
        "oversized",
        "format-2",
        "boolean-step",
        "step-too-long-for-a-name",
        "step-past-int64",
        "generation-mismatch",
        "no-engines",
        "engine-twice",
        "engine-path",
        "engine-taken-name",
        "missing-generation",
        "missing-engine",
        "linked",
    ],
)
def test_a_latest_that_names_no_whole_generation_is_named_and_nothing_changes(
    fileroot, generation_trial, capsys, damage, message
):
    trial = generation_trial.path
    damage(trial)
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert str(trial) in error
    assert snapshot(trial) == before and not (trial / ".recover").exists()
    with pytest.raises(ac.CheckpointError, match="areal-ckpt import-areal"):  # still refused, with the hint
        ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)


def test_a_generation_whose_step_differs_from_latests_is_refused(generation_trial, capsys):
    trial = generation_trial.path
    path = generation_trial.info / "step_info.json"
    path.write_text(path.read_text().replace('"global_step": 4', '"global_step": 3'))
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    assert f"{path}: global step 3, but AReaL's LATEST names step 4" in capsys.readouterr().err
    assert snapshot(trial) == before


def test_a_newer_unpublished_generation_is_left_alone_and_said_so(fileroot, generation_trial, capsys, caplog):
    trial = generation_trial.path
    cut_short = trial / "checkpoint_generations" / generation_name(6)
    (cut_short / "payloads/default").mkdir(parents=True)
    (cut_short / "manifest").mkdir()
    (cut_short / "payloads/default/__0_0.distcp").write_bytes(b"half a dump")
    assert cli_main(["import-areal", str(trial)]) == 0
    out = capsys.readouterr().out
    assert "after global step 4" in out
    assert f"note: {cut_short.name}: newer than the generation AReaL's LATEST names, but never published" in out
    assert "not imported, kept with AReaL's folders" in out
    assert f"{cut_short}: newer than the generation LATEST names (step 4) but never published" in caplog.text
    kept = trial / "areal_original/checkpoint_generations" / cut_short.name / "payloads/default/__0_0.distcp"
    assert kept.read_bytes() == b"half a dump"
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    assert info.last_step_info.global_step == DUMP_AFTER


def test_generations_without_latest_are_not_imported_and_moving_them_away_starts_afresh(
    fileroot, generation_trial, capsys
):
    """AReaL resumes from nothing here (it reads no generation LATEST does not name): neither
    do we, and the error says how to start afresh; that way out is followed."""
    trial = generation_trial.path
    (trial / "LATEST").unlink()
    before = snapshot(trial)
    assert cli_main(["import-areal", str(trial)]) == 2
    error = capsys.readouterr().err
    assert f"{trial / 'checkpoint_generations'}: AReaL never published any of these generations" in error
    assert snapshot(trial) == before
    command = error.split("(e.g. ", 1)[1].split(")", 1)[0].split()
    assert command[0] == "mv"
    Path(command[1]).rename(command[2])  # the hint
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    setup = make_setup()
    assert handler.load(setup.engine) is None
    assert handler.dump(setup.engine, step_info(0), force=True)
    handler.close()


def test_latest_wins_over_older_in_place_folders_and_both_are_kept(fileroot, generation_trial):
    """A trial that ran SPMD (in place) before single-controller: AReaL reads LATEST then, so do we."""
    trial = generation_trial.path
    old = make_setup(seed=9)
    write_recover_info(trial / "recover_info", loader(), Counter(), global_step=2)
    write_payload(trial / "default/recover_checkpoint", old)
    before = snapshot(trial)
    imported = ac.import_areal_trial(trial)
    assert imported.step_info.global_step == DUMP_AFTER
    assert snapshot(trial / "areal_original") == before
    setup = make_setup(seed=1)
    ac.RecoverHandler(recover_config(fileroot), SPEC).load(setup.engine)
    published = trial / "areal_original/checkpoint_generations" / generation_name(DUMP_AFTER) / "payloads/default"
    _, want = _stock_load(published)  # what AReaL's own dcp.load reads from the generation LATEST names
    _assert_bitwise(flat_state(setup), want)


def test_an_import_killed_between_its_two_moves_is_finished_by_running_it_again(
    fileroot, generation_trial, monkeypatch
):
    trial = generation_trial.path
    real_rename = Path.rename

    def rename_latest_only(self: Path, target: Any) -> Any:
        if self.name == "checkpoint_generations":
            raise KeyboardInterrupt  # what a kill between the two moves leaves
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename_latest_only)
    with pytest.raises(KeyboardInterrupt):
        ac.import_areal_trial(trial)
    monkeypatch.undo()
    assert (trial / "areal_original/LATEST").is_file() and (trial / "checkpoint_generations").is_dir()
    with pytest.raises(ac.CheckpointError, match="areal-ckpt import-areal"):
        ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    assert cli_main(["import-areal", str(trial)]) == 0
    assert sorted(p.name for p in (trial / "areal_original").iterdir()) == generation_trial.areal_entries()
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    assert info.last_step_info.global_step == DUMP_AFTER


@pytest.fixture(params=[IN_PLACE, GENERATIONS])
def actor_critic_trial(request, fileroot) -> AReaLTrial:
    """AReaL's RL trainer dumps {"default": actor, "critic": critic}."""
    return write_areal_trial(
        trial_dir(fileroot), request.param, {"default": make_setup(), "critic": make_setup(seed=5)}
    )


def _resume(fileroot: Path, engines: dict[str, Any]) -> tuple[Any, list[Any]]:
    """Import, load ``engines`` (name -> setup) with AReaL's components, train to the end."""
    ac.import_areal_trial(trial_dir(fileroot))
    data = loader()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    given = {name: setup.engine for name, setup in engines.items()}
    info = handler.load(given if len(given) > 1 else given["default"], dataloader=data)
    handler.close()
    setups = [engines[name] for name in sorted(engines)]
    for setup in setups:
        for _ in range(DUMP_AFTER + 1):  # AReaL stores no LR scheduler state (docs/migrating.md)
            setup.scheduler.step()
    run(DUMP_AFTER + 1, STEPS - 1, setups, data, iter(data))
    return info, setups


def test_an_actor_and_critic_trial_resumes_both_bit_exact(fileroot, actor_critic_trial):
    engines = {"default": make_setup(seed=1), "critic": make_setup(seed=2)}
    info, _ = _resume(fileroot, engines)
    assert info.last_step_info.global_step == DUMP_AFTER
    for name, setup in engines.items():
        _assert_bitwise(flat_state(setup), actor_critic_trial.want[name])


def test_an_actor_and_critic_trial_loaded_with_the_actor_only_resumes_it_and_names_the_critic(
    fileroot, actor_critic_trial, caplog
):
    """AReaL's RL trainer loads ``self.actor`` alone: the actor resumes bit-exact, the critic
    keeps what it has (as with AReaL's own load of its old layout), and a warning says so."""
    actor = make_setup(seed=1)
    with caplog.at_level(logging.WARNING, logger="areal_ckpt"):
        info, _ = _resume(fileroot, {"default": actor})
    assert info.last_step_info.global_step == DUMP_AFTER
    _assert_bitwise(flat_state(actor), actor_critic_trial.want["default"])
    assert "holds models ['critic', 'default']; this load was given ['default'] only, so critic keep(s)" in caplog.text
