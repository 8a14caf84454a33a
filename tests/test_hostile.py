"""Hostile conditions, second round: what an attacker or an unlucky operator does to a trial."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from helpers import saver_config
from recover_fixtures import SPEC, committed_generation, make_setup, recover_config, step_info, train_step, trial_dir

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main
from areal_ckpt.lock import LOCK_NAME

HERE = Path(__file__).parent


# -- the trial lock ------------------------------------------------------------------------------


def test_a_planted_lock_link_is_refused_and_its_target_untouched(fileroot, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    trial = trial_dir(fileroot)
    trial.mkdir(parents=True)
    (trial / LOCK_NAME).symlink_to(victim)
    with pytest.raises(ac.CheckpointError, match=r"\.areal_ckpt\.lock: the trial lock is a symbolic link") as caught:
        ac.Saver(saver_config(fileroot), SPEC)
    assert victim.read_text() == "precious"
    assert "remove the link" in str(caught.value)
    (trial / LOCK_NAME).unlink()  # the hint
    ac.Saver(saver_config(fileroot), SPEC).finalize()
    assert (trial / LOCK_NAME).is_file() and not (trial / LOCK_NAME).is_symlink()


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_lock_that_is_not_a_regular_file_is_refused(fileroot, kind):
    trial_dir(fileroot).mkdir(parents=True)
    lock_path = trial_dir(fileroot) / LOCK_NAME
    lock_path.mkdir() if kind == "folder" else os.mkfifo(lock_path)
    with pytest.raises(ac.CheckpointError, match="the trial lock is not a regular file"):
        ac.RecoverHandler(recover_config(fileroot), SPEC)


def test_two_spellings_of_one_trial_share_the_lock_in_one_process(fileroot, tmp_path):
    alias = tmp_path / "alias"
    alias.symlink_to(fileroot)
    saver = ac.Saver(saver_config(fileroot), SPEC)
    handler = ac.RecoverHandler(recover_config(alias), SPEC)  # same trial through a linked fileroot
    handler.close()
    saver.finalize()


_LOCK_UNDER_LIMIT = """
import resource, signal, sys
from pathlib import Path
from areal_ckpt.errors import CheckpointError
from areal_ckpt.lock import acquire_trial_lock, release_trial_lock
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
trial = Path(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
try:
    acquire_trial_lock(trial)
except CheckpointError as error:
    print("first:", error)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
acquire_trial_lock(trial)
print("second: taken")
release_trial_lock(trial)
"""


def test_a_failed_lock_record_is_named_and_a_retry_in_the_same_process_succeeds(tmp_path):
    trial = tmp_path / "trial"
    done = subprocess.run(
        [sys.executable, "-c", _LOCK_UNDER_LIMIT, str(trial)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first.startswith(f"first: {trial / LOCK_NAME}: cannot record the trial lock's holder: File too large")
    assert second == "second: taken"


def test_a_trial_folder_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "root").write_text("a file where the fileroot should be")
    with pytest.raises(
        ac.CheckpointError, match=r"root/checkpoints/tester/exp/trial/\.areal_ckpt\.lock: cannot create"
    ):
        ac.Saver(saver_config(tmp_path / "root"), SPEC)


# -- a lost or broken commit record ------------------------------------------------------------


def _two_dumps(fileroot: Path):
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    for step in range(2):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
    handler.close()
    return setup


def test_a_lost_commit_record_is_refused_nothing_is_deleted_and_recover_pointer_restores_it(fileroot, capsys):
    setup = _two_dumps(fileroot)
    generation = committed_generation(fileroot)
    (trial_dir(fileroot) / ".recover/current").unlink()  # e.g. copied with a tool that drops symlinks
    config = recover_config(fileroot)
    with pytest.raises(ac.CheckpointError, match="commit record is missing") as caught:
        ac.check_if_recover(config)
    assert generation.name in str(caught.value) and "nothing was deleted" in str(caught.value)
    handler = ac.RecoverHandler(config, SPEC)
    with pytest.raises(ac.CheckpointError, match="commit record is missing"):
        handler.load(make_setup(seed=3).engine)
    with pytest.raises(ac.CheckpointError, match="commit record is missing"):
        handler.dump(setup.engine, step_info(2), force=True)
    handler.close()
    assert generation.is_dir()

    command = str(caught.value).split("Run `", 1)[1].split("`", 1)[0]  # the hint, followed
    assert command == f"areal-ckpt recover-pointer {trial_dir(fileroot)}"
    assert cli_main(command.split()[1:]) == 0
    assert f"-> {generation.name}" in capsys.readouterr().out
    fresh = make_setup(seed=3)
    info = ac.RecoverHandler(config, SPEC).load(fresh.engine)
    assert info.last_step_info.global_step == 1
    assert all(fresh.model.state_dict()[k].equal(v) for k, v in setup.model.state_dict().items())


def test_recover_pointer_skips_a_damaged_newer_generation(fileroot, capsys):
    _two_dumps(fileroot)
    good = committed_generation(fileroot)
    newer = good.parent / "gen-00000009-0badf00d"
    shutil.copytree(good, newer)
    shard = newer / "default/__0_0.distcp"
    shard.write_bytes(bytes([shard.read_bytes()[0] ^ 1]) + shard.read_bytes()[1:])
    (good.parent / "current").unlink()
    assert cli_main(["recover-pointer", str(trial_dir(fileroot))]) == 0
    out = capsys.readouterr().out
    assert f"SKIP {newer.name}: " in out and "checksum mismatch" in out
    assert committed_generation(fileroot) == good


def test_recover_pointer_moves_current_off_a_damaged_generation_to_the_newest_intact_one(fileroot, capsys):
    """As on object storage: ``current`` naming a generation whose file rotted is repaired to
    the newest intact one; nothing is deleted."""
    _two_dumps(fileroot)
    good = committed_generation(fileroot)
    newer = good.parent / "gen-00000009-0badf00d"
    shutil.copytree(good, newer)
    (good.parent / "current").unlink()
    (good.parent / "current").symlink_to(newer.name)
    shard = newer / "default/__0_0.distcp"
    shard.write_bytes(bytes([shard.read_bytes()[0] ^ 1]) + shard.read_bytes()[1:])
    trial = str(trial_dir(fileroot))
    assert cli_main(["recover-pointer", trial]) == 0
    out = capsys.readouterr().out
    assert f"SKIP {newer.name}: " in out and "checksum mismatch" in out and f"-> {good.name}:" in out
    assert committed_generation(fileroot) == good and newer.is_dir()
    assert cli_main(["recover-pointer", trial]) == 0
    assert f"already names {good.name}, which is intact; nothing changed" in capsys.readouterr().out


def test_a_complete_generation_newer_than_the_committed_one_is_kept_until_a_newer_commit(fileroot):
    setup = _two_dumps(fileroot)
    good = committed_generation(fileroot)
    interrupted = good.parent / "gen-00000005-0badf00d"  # a dump killed between manifest and switch
    shutil.copytree(good, interrupted)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    assert handler.load(make_setup(seed=3).engine).last_step_info.global_step == 1
    assert interrupted.is_dir()
    handler.dump(setup.engine, step_info(6), force=True)  # a newer commit: now it may go
    handler.close()
    assert not interrupted.exists()


@pytest.mark.parametrize("kind", ["file", "dangling link"])
def test_a_store_that_is_not_a_folder_is_refused_and_the_hint_works(fileroot, tmp_path, kind):
    store = trial_dir(fileroot) / ".recover"
    store.parent.mkdir(parents=True)
    if kind == "file":
        store.write_text("not a folder")
    else:
        store.symlink_to(tmp_path / "unmounted-volume")
    config = recover_config(fileroot)
    with pytest.raises(ac.CheckpointError, match=r"\.recover: ") as caught:
        ac.check_if_recover(config)
    assert "move it" in str(caught.value) or "move the link away" in str(caught.value)
    with pytest.raises(ac.CheckpointError):
        ac.RecoverHandler(config, SPEC).load(make_setup().engine)
    assert not (tmp_path / "unmounted-volume").exists()
    store.rename(store.with_name("moved-away"))  # the hint
    assert not ac.check_if_recover(config)


# -- Ctrl-C during a synchronous dump ------------------------------------------------------------


def _interrupted_dump(rank: int, world: int, root: str, result: str) -> None:
    """Dump once, then dump again with a real SIGINT delivered while the shard is written (the
    hook sends it from inside the first write; the handler raises it at the next bytecode)."""
    from areal_ckpt.formats import dcp_storage

    messages: list[str] = []
    logging.getLogger("areal_ckpt").addHandler(
        type("Collect", (logging.Handler,), {"emit": lambda self, r: messages.append(r.getMessage())})()
    )
    fileroot = Path(root)
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot, write_retries=3), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    good = committed_generation(fileroot)
    original = dcp_storage.ChecksummedWriter.write

    def write_then_interrupt(self, data):
        original(self, data)
        os.kill(os.getpid(), signal.SIGINT)

    if rank == world - 1:  # on 2 ranks only rank 1 is interrupted: rank 0 must stop the same way
        dcp_storage.ChecksummedWriter.write = write_then_interrupt
    train_step(setup, 1)
    try:
        handler.dump(setup.engine, step_info(1), force=True)
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except BaseException as error:  # what must not happen: converted
        outcome = f"{type(error).__name__}: {error}"
    dcp_storage.ChecksummedWriter.write = original
    Path(f"{result}.{rank}").write_text(
        json.dumps(
            {
                "outcome": outcome,
                "retries": sum("retrying" in m for m in messages),
                "committed": committed_generation(fileroot).name,
                "good": good.name,
                "generations": sorted(p.name for p in good.parent.glob("gen-*")),
            }
        )
    )


@pytest.mark.parametrize("world", [1, 2])
def test_ctrl_c_during_a_synchronous_dump_reaches_the_caller_at_once(fileroot, tmp_path, world):
    result = tmp_path / "result.json"
    run_distributed(_interrupted_dump, world, str(fileroot), str(result))
    reports = [json.loads(Path(f"{result}.{rank}").read_text()) for rank in range(world)]
    assert all(r["outcome"] == "KeyboardInterrupt" and r["retries"] == 0 for r in reports), reports
    report = reports[0]
    assert report["committed"] == report["good"] and len(report["generations"]) == 2  # debris of the interrupted one
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    drop = world > 1  # loaded here by one process: the saved ranks' RNG streams cannot be re-assigned
    assert handler.load(make_setup().engine, drop_rank_state=drop).last_step_info.global_step == 0
    assert [p.name for p in committed_generation(fileroot).parent.glob("gen-*")] == [report["good"]]  # cleaned
    handler.close()


# -- configuration -----------------------------------------------------------------------------


BASE = "experiment_name: e\ntrial_name: t\nfileroot: /r\n"
ALIAS_BOMB = (
    BASE
    + "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(
        f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]\n" for previous, name in zip("abcdefgh", "bcdefghi")
    )
    + "saver:\n  freq_steps: 1\n  extra: *i\n"
)


@pytest.mark.parametrize(
    "label, text, fragments",
    [
        ("alias bomb", ALIAS_BOMB, ["saver.extra", "expands to more than 100000 values"]),
        (
            "alias bomb through interpolation",
            ALIAS_BOMB.replace("  extra: *i\n", "  user: ${i}\n"),
            ["expands to more than 100000 values"],
        ),
        ("recursive alias", BASE + "saver:\n  extra: &loop [1, *loop]\n", ["saver.extra", "refers to itself"]),
        ("deep nesting", BASE + "saver:\n  extra: " + "[" * 200 + "]" * 200 + "\n", ["nested more than 64 levels"]),
        ("deep nesting in the parser", BASE + "x: " + "[" * 5000 + "]" * 5000 + "\n", ["nested too deeply"]),
        (
            "misspelled recover block",
            BASE + "recovr:\n  mode: on\n",
            ["recovr: unknown top-level block; did you mean recover?"],
        ),
        ("misspelled saver block", BASE + "savers:\n  freq_steps: 3\n", ["did you mean saver?"]),
        (
            "duplicate key",
            BASE + "recover:\n  mode: on\n  mode: off\n",
            ["duplicate key 'mode' (first at line 5)", "line 6"],
        ),
        (
            "absurd retries",
            BASE + "recover:\n  retries: 1000000000\n",
            ["recover.retries", "less than or equal to 1000"],
        ),
        ("name with a newline", BASE.replace("trial_name: t", 'trial_name: "run1\\n"'), ["trial_name", "folder name"]),
        ("name too long", BASE.replace("trial_name: t", "trial_name: " + "x" * 300), ["300 bytes long"]),
        ("NUL in fileroot", BASE.replace("fileroot: /r", 'fileroot: "/r\\0x"'), ["NUL"]),
    ],
)
def test_hostile_configs_fail_with_one_clear_error(tmp_path, label, text, fragments):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ac.ConfigError) as caught:
        ac.load_config(path)
    for fragment in fragments:
        assert fragment in str(caught.value), f"{label}: {fragment!r} not in {caught.value}"


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "config.yaml"
    prefix = (BASE + "saver:\n  user: ").encode()
    path.write_bytes(prefix + b"\xff\xfe\n")
    with pytest.raises(ac.ConfigError, match=rf"config.yaml: not UTF-8 text \(byte {len(prefix)}: "):
        ac.load_config(path)


@pytest.mark.parametrize("login", ["/abs/path", "../../x", "a/b"])
def test_a_login_name_that_is_a_path_is_refused_and_the_hint_works(fileroot, monkeypatch, login):
    monkeypatch.setenv("USER", login)
    config = ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot))
    with pytest.raises(ac.ConfigError, match=r"user \(from \$USER\).*set `user:` in the config"):
        ac.Saver(config, SPEC)
    # nothing was created, outside fileroot or in it
    assert list(fileroot.iterdir()) == [] and sorted(p.name for p in fileroot.parent.iterdir()) == ["fileroot"]
    assert not Path("/abs").exists()
    saver = ac.Saver(config.model_copy(update={"user": "alice"}), SPEC)
    assert saver.trial_root == fileroot / "checkpoints/alice/exp/trial"
    saver.finalize()


def test_a_message_between_ranks_cannot_run_code(tmp_path):
    """What ranks send each other is unpickled with an allow-list: DCP's plan classes pass, a
    payload that would run code is refused by name and runs nothing."""
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from areal_ckpt import dist

    plan = SavePlan([WriteItem(MetadataIndex("dcp.model.w"), WriteItemType.BYTE_IO)], planner_data={"w": ("w",)})
    encoded = dist._encode(plan)
    assert dist._decode(dist._as_tensor(encoded, len(encoded))) == plan
    marker = tmp_path / "ran"
    payload = pickle.dumps(_ExecutesOnLoad(str(marker)))
    hostile = len(payload).to_bytes(8, "little") + payload
    with pytest.raises(pickle.UnpicklingError, match="refused global"):
        dist._decode(dist._as_tensor(hostile, len(hostile)))
    assert not marker.exists()


def _naming(module: str, name: str) -> torch.Tensor:
    """A peer message (as dist encodes one) whose only content is the global ``module.name``."""
    from areal_ckpt import dist

    payload = b"c" + module.encode() + b"\n" + name.encode() + b"\n."  # pickle's GLOBAL opcode, then STOP
    framed = len(payload).to_bytes(8, "little") + payload
    return dist._as_tensor(framed, len(framed))


@pytest.mark.parametrize(
    "module, name",
    [
        ("areal_ckpt.__main__", "main"),  # importing it runs the command line
        ("areal_ckpt.side_effect_probe", "Probe"),  # a module of ours that does not exist
        ("torch.distributed.checkpoint.planner", "torch.utils._pytree.TreeSpec"),  # a dataclass by attribute walk
        ("areal_ckpt.agree", "dist.signal.Signals"),  # an enum by attribute walk
        ("torch", "onnx"),  # one of torch's lazily imported submodules
        ("areal_ckpt.dist", "Traffic"),  # one of our dataclasses that never travels
    ],
)
def test_a_peer_message_naming_anything_not_exchanged_imports_nothing(module, name):
    """The peer unpickler's allow-list is exact (module, qualified name) pairs, checked before any
    import or attribute walk: a name outside it is refused and no module is imported."""
    import pickle

    from areal_ckpt import dist

    modules_before = set(sys.modules)
    with pytest.raises(pickle.UnpicklingError, match=f"refused global {module}.{name}: ranks exchange only plain data"):
        dist._decode(_naming(module, name))
    assert set(sys.modules) == modules_before


def test_exchanged_classes_resolve_by_exact_name_and_only_dataclasses_or_enums_register():
    from torch.distributed.checkpoint.planner import WriteItemType

    from areal_ckpt import agree, dist
    from areal_ckpt.formats.dcp_storage import Placement

    assert dist._decode(_naming("torch.distributed.checkpoint.planner", "WriteItemType")) is WriteItemType
    assert dist._decode(_naming("areal_ckpt.formats.dcp_storage", "Placement")) is Placement
    assert dist._decode(_naming("areal_ckpt.agree", "RankFailure")) is agree.RankFailure
    assert dist._decode(_naming("torch", "bfloat16")) is torch.bfloat16
    with pytest.raises(TypeError, match="only dataclasses and enums travel between ranks"):
        dist.exchanged(dict)


class _ExecutesOnLoad:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_dump_never_writes_or_deletes_through_a_model_folder_link(fileroot, tmp_path, caplog):
    """``{trial}/default`` as a user-made link to another disk holding files named like ours: a
    dump commits, places no link through it, says where the checkpoint is, and leaves every file
    there as it was; the checkpoint loads."""
    elsewhere = tmp_path / "other-disk"
    elsewhere.mkdir()
    (elsewhere / "recover_checkpoint").write_text("user's file")
    (elsewhere / ".recover_checkpoint.new").write_text("user's other file")
    trial = trial_dir(fileroot)
    trial.mkdir(parents=True)
    (trial / "default").symlink_to(elsewhere)
    setup = make_setup()
    train_step(setup, 0)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    assert handler.dump(setup.engine, step_info(0), force=True)
    train_step(setup, 1)
    assert handler.dump(setup.engine, step_info(1), force=True)
    handler.close()
    assert caplog.text.count("areal_ckpt did not create") == 1  # once, not at every dump
    assert (elsewhere / "recover_checkpoint").read_text() == "user's file"
    assert (elsewhere / ".recover_checkpoint.new").read_text() == "user's other file"
    assert sorted(p.name for p in elsewhere.iterdir()) == [".recover_checkpoint.new", "recover_checkpoint"]
    assert f"{trial / 'default'} is a link (to {elsewhere}) areal_ckpt did not create" in caplog.text
    assert f"the model's recovery checkpoint is {trial / '.recover/current/default'}" in caplog.text
    fresh = make_setup(seed=1)
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(fresh.engine) is not None
    assert all(torch.equal(a, b) for a, b in zip(setup.model.state_dict().values(), fresh.model.state_dict().values()))


def test_a_pointer_switch_never_replaces_what_is_not_a_link(tmp_path):
    from areal_ckpt.publish import switch_symlink

    (tmp_path / "pointer").write_text("a file of someone else's")
    with pytest.raises(ac.CheckpointError, match=r"pointer: exists and is not a link areal_ckpt made"):
        switch_symlink(tmp_path / "pointer", "target")
    (tmp_path / "link").symlink_to("old")
    (tmp_path / ".link.new").write_text("another file")
    with pytest.raises(ac.CheckpointError, match=r"\.link\.new: exists and is not a link areal_ckpt made"):
        switch_symlink(tmp_path / "link", "new")
    assert (tmp_path / "pointer").read_text() == "a file of someone else's"
    assert (tmp_path / ".link.new").read_text() == "another file" and os.readlink(tmp_path / "link") == "old"
    (tmp_path / ".link.new").unlink()
    (tmp_path / ".link.new").symlink_to("left by an interrupted switch")
    switch_symlink(tmp_path / "link", "new")
    assert os.readlink(tmp_path / "link") == "new" and not (tmp_path / ".link.new").is_symlink()


def _resigned(generation: Path, change) -> None:
    from areal_ckpt.publish import render_manifest

    path = generation / "recover_info/areal_ckpt_manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_bytes(render_manifest(manifest))


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda m: m.update(files={}), "recover_info/step_info.json: not in the manifest"),
        (lambda m: m.update(models=["../elsewhere"]), "model name '../elsewhere' cannot be used as a folder name"),
    ],
    ids=["no files", "a model outside the trial"],
)
def test_recover_pointer_skips_a_resigned_manifest_before_switching_anything(fileroot, capsys, change, problem):
    _two_dumps(fileroot)
    good = committed_generation(fileroot)
    newer = good.parent / "gen-00000009-0badf00d"
    shutil.copytree(good, newer)
    _resigned(newer, change)
    (good.parent / "current").unlink()
    assert cli_main(["recover-pointer", str(trial_dir(fileroot))]) == 0
    out = capsys.readouterr().out
    assert f"SKIP {newer.name}: " in out and problem in out, out
    assert committed_generation(fileroot) == good
    assert not (trial_dir(fileroot).parent / "elsewhere").exists()


def test_recover_pointer_names_two_generations_of_the_same_step(fileroot, caplog):
    _two_dumps(fileroot)
    good = committed_generation(fileroot)
    twin = good.parent / f"{good.name.rsplit('-', 1)[0]}-0badf00d"
    shutil.copytree(good, twin)
    (good.parent / "current").unlink()
    assert cli_main(["recover-pointer", str(trial_dir(fileroot))]) == 0
    chosen = committed_generation(fileroot).name
    other = ({good.name, twin.name} - {chosen}).pop()
    assert f"{chosen} and ['{other}'] hold the same step 1; pointing at {chosen}" in caplog.text


def test_a_model_named_recover_info_is_refused_before_anything_is_written(fileroot):
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    with pytest.raises(ValueError, match="model name 'recover_info' is taken"):
        handler.dump({"recover_info": setup.engine}, step_info(0), force=True)
    handler.close()
    store = trial_dir(fileroot) / ".recover"
    assert not store.exists() or list(store.iterdir()) == []
