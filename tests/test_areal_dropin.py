"""AReaL drop-in: AReaL's calls, in AReaL's order, with AReaL's meaning, and our guarantees on top."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from recover_fixtures import SPEC, make_setup, recover_config, step_info, train_step, trial_dir
from safetensors.torch import load_file
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoModelForCausalLM, AutoProcessor, CLIPImageProcessorPil, GenerationConfig, LlavaProcessor

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main

HERE = Path(__file__).parent
ROOT = HERE.parent
AREAL_YAML = HERE / "data/areal_grpo.yaml"


class Holder:
    """An AReaL-shaped engine: a torch model as .model, optionally .optimizer / .lr_scheduler."""

    def __init__(self, model, optimizer=None, lr_scheduler=None) -> None:
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler


class Counter:
    def __init__(self, value=0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def make_base_model(folder: Path, tokenizer) -> Path:
    """A local base model folder: tokenizer, generation config, a chat template, and a weights
    file that must never be copied into an export."""
    tokenizer.save_pretrained(folder)
    GenerationConfig(max_new_tokens=7).save_pretrained(folder)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "model.safetensors").write_bytes(b"not the trained weights")
    return folder


# -- the whole trainer, killed and relaunched ----------------------------------------------------


def _torchrun(out: Path, base: Path, root: Path, trial: str, kill_at: int) -> list[str]:
    overrides = [f"cluster.fileroot={root}", f"trial_name={trial}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "areal_trainer.py"),
        "--config",
        str(AREAL_YAML),
        "--out",
        str(out),
        "--base-model",
        str(base),
        "--kill-at",
        str(kill_at),
        *overrides,
    ]


def _steps(out: Path, rank: int) -> dict[int, list[dict]]:
    seen: dict[int, list[dict]] = {}
    for line in (out / f"steps-rank{rank}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        seen.setdefault(entry["step"], []).append(entry)
    return seen


@pytest.mark.dist
def test_an_areal_trainer_killed_and_relaunched_ends_bitwise_equal(tmp_path, tokenizer):
    base = make_base_model(tmp_path / "base", tokenizer)
    root = tmp_path / "fileroot"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    done = subprocess.run(
        _torchrun(reference, base, root, "reference", -1), env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # as a user runs it: the launcher in front of torchrun, the job's overrides given to both
    launcher = [
        sys.executable,
        "-m",
        "areal_ckpt.cli.main",
        "launch",
        "--config",
        str(AREAL_YAML),
        f"cluster.fileroot={root}",
        "trial_name=killed",
        "--",
        *_torchrun(killed, base, root, "killed", 9),
    ]
    done = subprocess.run(launcher, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "areal-ckpt launch: attempt 1 failed" in done.stderr and "relaunch 1 of recover.retries=2" in done.stderr
    assert "attempt 3" not in done.stderr

    for rank in range(2):
        want, got = (
            load_file(reference / f"final-rank{rank}.safetensors"),
            load_file(killed / f"final-rank{rank}.safetensors"),
        )
        assert want.keys() == got.keys() and any(key.startswith("optim.") for key in want)
        assert [key for key in want if not torch.equal(want[key], got[key])] == []
        expected, seen = _steps(reference, rank), _steps(killed, rank)
        assert sorted(seen) == list(range(12))
        replayed = {step for step, entries in seen.items() if len(entries) > 1}
        assert replayed == {8, 9}  # dumps after steps 3, 5, 7: the kill after step 9 resumes at 8
        for step, entries in seen.items():  # the same batches, generations and losses, every time
            for entry in entries:
                assert (entry["ids"], entry["generated"], entry["loss"]) == (
                    expected[step][0]["ids"],
                    expected[step][0]["generated"],
                    expected[step][0]["loss"],
                ), step
        resumed = json.loads((killed / f"resume-rank{rank}.json").read_text())
        assert resumed["attempt"] == 1 and resumed["check_if_recover"] is True and resumed["start_step"] == 8
        # the rollout server got the recovered weights and the version AReaL gives it
        assert resumed["rollout_has_recovered_weights"] and resumed["rollout_version"] == resumed["actor_version"] == 8
        # evaluator and stats logger: restored as they were when step 7 was dumped
        assert {"evaluator": resumed["evaluator"], "stats_logger": resumed["stats_logger"]} == expected[7][0][
            "components_at_dump"
        ]
    assert not (reference / "resume-rank0.json").exists()

    trial = next(root.glob("checkpoints/*/gsm8k-grpo/killed"))
    exports = sorted(p.name for p in (trial / "default").glob("epoch*"))
    assert exports == sorted(
        p.name for p in next(root.glob("checkpoints/*/gsm8k-grpo/reference")).glob("default/epoch*")
    )
    newest = trial / "default/epoch1epochstep5globalstep11"
    assert newest.name in exports
    # the processor went in with save_pretrained; the base model's assets (from actor.config.path) too
    assert isinstance(AutoProcessor.from_pretrained(newest), LlavaProcessor)
    assert (newest / "chat_template.jinja").read_text() == "{{ messages }}"
    assert GenerationConfig.from_pretrained(newest).max_new_tokens == 7
    assert AutoModelForCausalLM.from_pretrained(newest).num_parameters() > 0


# -- an AReaL trial on disk -------------------------------------------------------------------


def _write_areal_trial(trial: Path, setup) -> None:
    """A trial as AReaL writes it: stock DCP in {name}/recover_checkpoint, JSON + pickle in recover_info."""
    dcp.save({"model": setup.model.state_dict()}, checkpoint_id=str(trial / "default/recover_checkpoint"))
    info = trial / "recover_info"
    info.mkdir(parents=True)
    (info / "step_info.json").write_text(
        json.dumps({"epoch": 0, "epoch_step": 1, "global_step": 1, "steps_per_epoch": 4})
    )
    for name in ("saver_info", "evaluator_info", "stats_logger_info", "checkpoint_info"):
        (info / f"{name}.json").write_text(json.dumps({}))
    (info / "dataloader_info.pkl").write_bytes(pickle.dumps([{"_num_yielded": 2}]))


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def test_an_areal_trial_is_refused_untouched_and_the_hint_works(fileroot):
    setup = make_setup()
    trial = trial_dir(fileroot)
    _write_areal_trial(trial, setup)
    before = _snapshot(trial)
    config = recover_config(fileroot)
    with pytest.raises(ac.CheckpointError, match="written by AReaL") as caught:
        ac.check_if_recover(config, 0)
    assert str(trial) in str(caught.value) and "recover_info" in str(caught.value)
    handler = ac.RecoverHandler(config, SPEC)
    with pytest.raises(ac.CheckpointError, match="written by AReaL"):
        handler.load(setup.engine)
    with pytest.raises(ac.CheckpointError, match="written by AReaL"):
        handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    after = _snapshot(trial)
    after.pop(".areal_ckpt.lock")  # ours: the one-job-per-trial lock
    assert after == before

    # the second hint: AReaL's weights export to an HF folder
    export = ("export" + str(caught.value).split("`areal-ckpt export", 1)[1].split("`", 1)[0]).split()
    base = trial.parent / "base"
    setup.model.config.save_pretrained(base)
    out = trial.parent / "salvaged"
    assert cli_main([arg.replace("OUT", str(out)).replace("BASE_MODEL", str(base)) for arg in export]) == 0
    salvaged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert all(torch.equal(salvaged.state_dict()[k], v) for k, v in setup.model.state_dict().items())
    assert _snapshot(trial) == {**before, ".areal_ckpt.lock": _snapshot(trial)[".areal_ckpt.lock"]}
    # the first hint: move that trial folder away; the job then starts fresh and AReaL's files survive
    hint = str(caught.value).split("(e.g. ", 1)[1].split(")", 1)[0]
    assert hint == f"mv {trial} {trial}.areal"
    subprocess.run(hint.split(), check=True)
    assert not ac.check_if_recover(config, 0)
    handler = ac.RecoverHandler(config, SPEC)
    assert handler.load(setup.engine) is None
    assert handler.dump(setup.engine, step_info(0), force=True) is not None
    handler.close()
    moved = _snapshot(Path(f"{trial}.areal"))
    moved.pop(".areal_ckpt.lock")
    assert moved == before


# -- calls and engines, in one process ---------------------------------------------------------


def test_positional_dump_and_load_put_every_component_in_its_slot(fileroot):
    setup = make_setup()
    saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester", freq_steps=3),
        SPEC,
    )
    saver.save(setup.engine, 0, 0, 0)
    loader = StatefulDataLoader(list(range(8)), batch_size=2)
    batches = iter(loader)
    next(batches)
    rest = [batch.tolist() for batch in StatefulDataLoader(list(range(8)), batch_size=2)][1:]
    handler = ac.RecoverHandler(recover_config(fileroot, freq_steps=1), SPEC)
    # AReaL's order: engine, step_info, saver, evaluator, stats_logger, dataloader
    assert handler.dump(setup.engine, step_info(0), saver, Counter(7), Counter(9), loader) is not None
    handler.close()
    saver.finalize()

    evaluator, stats_logger, new_loader = Counter(), Counter(), StatefulDataLoader(list(range(8)), batch_size=2)
    new_saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester", freq_steps=3),
        SPEC,
    )
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(
        make_setup(1).engine, new_saver, evaluator, stats_logger, new_loader
    )
    assert info.last_step_info == step_info(0)
    assert (evaluator.value, stats_logger.value) == (7, 9)
    assert [batch.tolist() for batch in new_loader] == rest
    assert new_saver.save(setup.engine, 0, 1, 1) is None and new_saver.save(setup.engine, 0, 2, 2) is not None


def test_keyword_only_options_cannot_be_reached_by_position(fileroot):
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    with pytest.raises(TypeError):
        handler.dump(setup.engine, step_info(0), None, None, None, None, None, None, None, {"kl": 1})
    with pytest.raises(TypeError):
        handler.load(setup.engine, None, None, None, None, None, None, "default", False, True)


def test_an_areal_shaped_engine_round_trips_alone_and_in_a_dict(fileroot):
    setup = make_setup()
    train_step(setup, 0)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    holder = Holder(setup.model, setup.optimizer, setup.scheduler)
    handler.dump({"actor": holder, "ref": Holder(make_setup(4).model)}, step_info(0), force=True)
    fresh, ref = make_setup(2), make_setup(4)
    ac.RecoverHandler(recover_config(fileroot), SPEC).load(
        {"actor": Holder(fresh.model, fresh.optimizer, fresh.scheduler), "ref": Holder(ref.model)}
    )
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name
    assert fresh.scheduler.state_dict() == setup.scheduler.state_dict()
    assert fresh.optimizer.state_dict()["state"][0]["exp_avg"].equal(
        setup.optimizer.state_dict()["state"][0]["exp_avg"]
    )


def test_what_is_not_an_engine_is_told_what_an_engine_provides(fileroot):
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester"), SPEC
    )
    for call in (
        lambda: handler.dump(object(), step_info(0), force=True),
        lambda: saver.save({"weights": 1}, 0, 0, 0, force=True),
        lambda: handler.dump({"actor": Holder(model=3)}, step_info(0), force=True),
        lambda: saver.save(torch.nn.Linear(2, 2), 0, 0, 0),  # no trigger set, so never due: refused at once
        lambda: handler.dump(torch.nn.Linear(2, 2), step_info(0)),
    ):
        with pytest.raises(ac.CheckpointError, match=r"is not an engine: pass areal_ckpt.TorchEngine.*as \.model"):
            call()


def test_a_dump_needs_a_completed_step(fileroot):
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    with pytest.raises(ac.CheckpointError, match="StepInfo.epoch must be >= 0"):
        handler.dump(make_setup().engine, ac.StepInfo(-1, -1, -1, 4), force=True)


class Rollout:
    """A rollout engine with its own copy of the model that records what happens to it."""

    def __init__(self, model, colocated=False) -> None:
        self.model, self.events, self.version = model, [], 0
        if colocated:
            self.pause_generation_sync = lambda: self.events.append("pause_generation_sync")
            self.offload = lambda tags: self.events.append(f"offload {tags[0]}")

    def pause(self):
        self.events.append("pause")

    def resume(self):
        self.events.append("resume")

    def set_version(self, version):
        self.version = version


class Actor(Holder):
    def __init__(self, setup, log) -> None:
        super().__init__(setup.model, setup.optimizer, setup.scheduler)
        self.log, self.version = log, 0

    def connect_engine(self, engine, meta):
        self.rollout = engine
        self.log.append(f"connect v{meta.version}")

    def update_weights(self, meta):
        self.log.append(f"update v{meta.version}")
        self.rollout.model.load_state_dict(self.model.state_dict())

    def set_version(self, version):
        self.version = version


class Meta:
    def __init__(self, kind="disk", version=None) -> None:
        self.type, self.version = kind, version

    def with_version(self, version):
        return Meta(self.type, version)


@pytest.mark.parametrize("colocated", [False, True])
def test_load_pushes_the_recovered_weights_to_the_rollout_engine(fileroot, colocated):
    setup = make_setup()
    for step in range(3):
        train_step(setup, step)
    ac.RecoverHandler(recover_config(fileroot), SPEC).dump(setup.engine, step_info(2), force=True)

    fresh = make_setup(seed=7)
    initial = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    rollout = Rollout(make_setup(seed=8).model, colocated=colocated)
    log = rollout.events
    actor = Actor(fresh, log)
    if colocated:  # the weights may be loaded only after the rollout engine released its memory
        rollout.offload = lambda tags: log.append(
            f"offload {tags[0]} (actor {'fresh' if torch.equal(fresh.model.lm_head.weight, initial['lm_head.weight']) else 'loaded'})"
        )
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(
        actor,
        None,
        None,
        None,
        None,
        inference_engine=rollout,
        weight_update_meta=Meta("awex" if colocated else "disk"),
        colocated_rollout=colocated,
    )
    assert info.last_step_info.global_step == 2
    if colocated:
        assert log == [
            "connect v3",
            "pause",
            "pause_generation_sync",
            "offload kv_cache (actor fresh)",
            "offload weights (actor fresh)",
            "update v3",
            "resume",
        ]
    else:
        assert log == ["connect v3", "pause", "update v3", "resume"]
    assert rollout.version == actor.version == 3
    prompt = torch.tensor([[5, 6, 7]])
    expected = setup.model.eval().generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    got = rollout.model.eval().generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


def test_weight_sync_arguments_are_checked_before_anything_is_loaded(fileroot):
    setup = make_setup()
    ac.RecoverHandler(recover_config(fileroot), SPEC).dump(setup.engine, step_info(0), force=True)
    fresh = make_setup(seed=3)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    with pytest.raises(ValueError, match="weight_update_meta is required"):
        handler.load(Actor(fresh, []), inference_engine=Rollout(fresh.model))
    with pytest.raises(ac.CheckpointError, match="engine 'default': Holder must provide connect_engine"):
        handler.load(Holder(fresh.model), inference_engine=Rollout(fresh.model), weight_update_meta=Meta())
    with pytest.raises(NotImplementedError, match="lacks pause_generation_sync\\(\\), offload\\(tags=...\\)"):
        handler.load(  # AReaL's exception type and check
            Actor(fresh, []),
            inference_engine=Rollout(fresh.model),
            weight_update_meta=Meta("awex"),
            colocated_rollout=True,
        )
    untagged = Rollout(fresh.model, colocated=True)
    untagged.offload = lambda: untagged.events.append("offload")  # no tags: would fail after pause()
    with pytest.raises(
        NotImplementedError, match=r"Rollout lacks offload\(tags=...\), which .* nothing was paused or loaded"
    ):
        handler.load(
            Actor(fresh, []), inference_engine=untagged, weight_update_meta=Meta("awex"), colocated_rollout=True
        )
    assert untagged.events == []
    with pytest.raises(ac.CheckpointError, match="inference_engine_update_from='critic' is not one of"):
        handler.load(
            Actor(fresh, []),
            inference_engine=Rollout(fresh.model),
            weight_update_meta=Meta(),
            inference_engine_update_from="critic",
        )
    assert all(torch.equal(before[k], v) for k, v in fresh.model.state_dict().items())


# -- the Saver's AReaL surface --------------------------------------------------------------------


def test_static_path_helpers_name_our_layout_and_create_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("USER", "alice")
    root = tmp_path / "root"
    trial = root / "checkpoints/alice/exp/t1"
    assert ac.Saver.get_save_root("exp", "t1", str(root)) == str(trial)
    assert ac.Saver.get_model_save_root("exp", "t1", str(root), "actor") == str(trial / "actor")
    assert ac.Saver.get_model_save_path("exp", "t1", str(root), 1, 2, 9, "actor") == str(
        trial / "actor/epoch1epochstep2globalstep9"
    )
    assert ac.Saver.get_recover_checkpoint_path("exp", "t1", str(root)) == str(trial / "default/recover_checkpoint")
    assert ac.RecoverHandler.recover_info_path("exp", "t1", str(root)) == str(trial / "recover_info")
    assert not root.exists()


def test_saver_exports_processor_and_base_model_assets_with_areal_arguments(fileroot, tmp_path, tokenizer, make_model):
    base = make_base_model(tmp_path / "base", tokenizer)
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tokenizer)
    saver = ac.Saver(
        ac.SaverConfig(
            experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester", freq_steps=1, mode="sync"
        ),
        SPEC,
    )
    assert not saver.is_async
    saver.maybe_wait_for_staging()
    model = make_model()
    # AReaL's positional call: engine, epoch, step, global_step, name, tokenizer, processor, base_model_path
    path = Path(saver.save(Holder(model), 0, 1, 1, "actor", None, processor, str(base)))
    assert path == trial_dir(fileroot) / "actor/epoch0epochstep1globalstep1"
    assert sorted(p.name for p in path.iterdir()) == [
        "areal_ckpt_manifest.json",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert isinstance(AutoProcessor.from_pretrained(path), LlavaProcessor)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ac.CheckpointError, match="could not prepare the export.*missing-base"):
        saver.save(Holder(model), 0, 2, 2, "actor", base_model_path=str(tmp_path / "missing-base"))
    saver.finalize()
    assert ac.SaverConfig(experiment_name="e", trial_name="t", fileroot="/r", mode="async").mode == "async"


def test_export_of_a_dump_carries_its_processor_and_base_assets(fileroot, tmp_path, tokenizer):
    base = make_base_model(tmp_path / "base", tokenizer)
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tokenizer)
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(setup.engine, step_info(0), None, None, None, None, tokenizer, processor, str(base), force=True)
    handler.close()
    out = tmp_path / "export"
    assert cli_main(["export", str(trial_dir(fileroot)), str(out)]) == 0
    assert isinstance(AutoProcessor.from_pretrained(out), LlavaProcessor)
    assert (out / "chat_template.jinja").is_file() and GenerationConfig.from_pretrained(out).max_new_tokens == 7
    assert (out / "model.safetensors").read_bytes() != b"not the trained weights"


# -- the launcher ------------------------------------------------------------------------------


def _job_yaml(tmp_path: Path, fileroot: Path, **recover) -> Path:
    lines = ["experiment_name: exp", "trial_name: trial", f"fileroot: {fileroot}", "user: tester", "recover:"]
    lines += [f"  {key}: {value}" for key, value in {"mode": "on", **recover}.items()]
    path = tmp_path / "job.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _launch(config: Path, script: str, *overrides: str, **popen) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "areal_ckpt.cli.main",
        "launch",
        "--config",
        str(config),
        *overrides,
        "--",
        sys.executable,
        "-c",
        script,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, **popen)


def test_launch_stops_a_job_that_fails_twice_the_same_way_before_its_first_dump(tmp_path, fileroot):
    config = _job_yaml(tmp_path, fileroot, retries=5)
    done = _launch(
        config,
        "import os; print('attempt', os.environ['AREAL_CKPT_LAUNCH_ATTEMPT']); "
        "raise FileNotFoundError('no such dataset')",
    )
    assert done.returncode == 1
    assert done.stdout.split() == ["attempt", "0", "attempt", "1"]
    assert "failed the same way twice in a row before its first recovery dump" in done.stderr


def test_launch_relaunches_a_job_that_progresses_up_to_retries_times_and_passes_its_status(tmp_path, fileroot):
    config = _job_yaml(tmp_path, fileroot, retries=2)
    # each attempt commits a new recovery checkpoint, then fails the same way
    script = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import areal_ckpt as ac, os\n"
        "from recover_fixtures import SPEC, make_setup, recover_config, step_info\n"
        "attempt = int(os.environ['AREAL_CKPT_LAUNCH_ATTEMPT'])\n"
        f"handler = ac.RecoverHandler(recover_config(__import__('pathlib').Path({str(fileroot)!r})), SPEC)\n"
        "setup = make_setup(); handler.load(setup.engine)\n"
        "handler.dump(setup.engine, step_info(attempt), force=True); handler.close()\n"
        "sys.exit(3)\n"
    )
    done = _launch(config, script)
    assert done.returncode == 3
    assert done.stderr.count("areal-ckpt launch: attempt ") == 6  # 3 starts, 3 failures
    assert "recover.retries=2 relaunches used, giving up" in done.stderr


def test_launch_runs_once_when_recovery_is_off_and_obeys_overrides(tmp_path, fileroot):
    config = _job_yaml(tmp_path, fileroot, retries=5)
    done = _launch(config, "import sys; sys.exit(4)", "recover.mode=off")
    assert done.returncode == 4 and "recovery is disabled (recover.mode=off)" in done.stderr
    assert _launch(config, "pass").returncode == 0


def test_launch_passes_a_death_by_signal_through_as_a_shell_does(tmp_path, fileroot):
    config = _job_yaml(tmp_path, fileroot, retries=0)
    done = _launch(config, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert done.returncode == 128 + 9


def test_launch_stops_on_ctrl_c_without_relaunching(tmp_path, fileroot):
    config = _job_yaml(tmp_path, fileroot, retries=5)
    started = tmp_path / "started"
    script = f"import pathlib, time; pathlib.Path({str(started)!r}).touch()\nwhile True: time.sleep(0.05)\n"
    command = [
        sys.executable,
        "-m",
        "areal_ckpt.cli.main",
        "launch",
        "--config",
        str(config),
        "--",
        sys.executable,
        "-c",
        script,
    ]
    launcher = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        while not started.exists():  # an event the job produces, not a delay
            assert launcher.poll() is None, launcher.stderr.read()
            time.sleep(0.01)
        launcher.send_signal(2)  # SIGINT, as Ctrl-C sends it
        stderr = launcher.communicate(timeout=120)[1]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130
    assert "KeyboardInterrupt" in stderr and "interrupted, not relaunching" in stderr
    assert stderr.count("areal-ckpt launch: attempt ") == 2


def test_launch_without_a_command_says_how_and_that_form_runs(tmp_path, fileroot, capsys):
    config = _job_yaml(tmp_path, fileroot)
    assert cli_main(["launch", "--config", str(config)]) == 2
    message = capsys.readouterr().err
    assert "put the job's command after '--', e.g. areal-ckpt launch --config job.yaml -- torchrun" in message
    assert cli_main(["launch", "--config", str(config), "--", sys.executable, "-c", "pass"]) == 0


def test_a_saver_given_no_base_model_path_takes_the_engines_configured_folder_and_skips_a_hub_name(
    fileroot, tmp_path, tokenizer, make_model, caplog
):
    """As AReaL's engine configuration names the model (``engine.config.path``): a local folder's
    files are copied into the export; a hub name is skipped with a warning naming it."""
    base = make_base_model(tmp_path / "base", tokenizer)
    saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester", mode="sync"),
        SPEC,
    )
    engine = Holder(make_model())
    engine.config = types.SimpleNamespace(path=str(base))
    path = Path(saver.save(engine, 0, 1, 1, "actor", force=True))
    assert (path / "chat_template.jinja").is_file() and (path / "generation_config.json").is_file()
    engine.config = types.SimpleNamespace(path="Qwen/Qwen2.5-0.5B-Instruct")
    path = Path(saver.save(engine, 0, 2, 2, "actor", force=True))
    assert not (path / "chat_template.jinja").exists()
    assert (
        "not copying base model files into the export: Qwen/Qwen2.5-0.5B-Instruct is not a local folder" in caplog.text
    )
    saver.finalize()
