"""save_checkpoint / load_checkpoint with save_dir on object storage, on every store (SeaweedFS,
fake-gcs-server, Azurite on 127.0.0.1): tags, `latest`, a tag saved again, a server killed mid-save, two ranks staging on
separate local disks, and the CLI reading the tags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from object_helpers import keys_under
from recover_fixtures import make_setup, train_step
from seaweed import kill_at_next_upload
from test_deepspeed import deepspeed_engine
from test_tagged import VOCAB, _ds_step

import areal_ckpt as ac
from areal_ckpt.cli.main import main


def assert_same_training_state(saved, loaded) -> None:
    for name, tensor in saved.model.state_dict().items():
        assert torch.equal(tensor, loaded.model.state_dict()[name]), name
    assert loaded.optimizer.state_dict()["state"][0]["exp_avg"].equal(
        saved.optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert loaded.scheduler.state_dict() == saved.scheduler.state_dict()


def test_tags_and_latest_on_the_bucket_load_bit_exact(object_server, object_bucket, tmp_path, monkeypatch):
    (tmp_path / "node").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # staging and local copies go under this TMPDIR
    root = f"{object_bucket}/ds"
    setup = make_setup()
    assert ac.load_checkpoint(setup.engine, root) == (None, None)  # nothing saved yet
    train_step(setup, 0)
    assert ac.save_checkpoint(setup.engine, root, tag="step1", client_state={"kl": 0.5})
    first = {name: tensor.clone() for name, tensor in setup.model.state_dict().items()}
    train_step(setup, 1)
    ac.save_checkpoint(setup.engine, root, tag="step2", client_state={"kl": 0.25})
    ac.save_checkpoint(setup.engine, root, tag="side", save_latest=False)
    keys = keys_under(object_bucket, "ds/")
    assert [k for k in keys if "/.commits/" in k] == [f"ds/.commits/00000000000{n}.json" for n in (1, 2, 3)]
    assert "ds/zero_to_fp32.py" in keys and "ds/step2/areal_ckpt_manifest.json" in keys
    assert list((tmp_path / "node").iterdir()) and not list((tmp_path / "node").rglob("*.distcp"))  # staged there

    fresh = make_setup(seed=3)
    path, client_state = ac.load_checkpoint(fresh.engine, root)  # latest: step2, not "side"
    assert path == f"{root}/step2" and client_state == {"kl": 0.25}
    assert_same_training_state(setup, fresh)
    older = make_setup(seed=4)
    path, client_state = ac.load_checkpoint(older.engine, root, tag="step1", load_module_only=True)
    assert path == f"{root}/step1" and client_state == {"kl": 0.5} and not older.optimizer.state
    for name, tensor in first.items():
        assert torch.equal(older.model.state_dict()[name], tensor), name
    with pytest.raises(ac.CheckpointError, match=rf"{root}/nope: no such checkpoint tag \(no commit in {root}"):
        ac.load_checkpoint(older.engine, root, tag="nope")

    train_step(setup, 2)  # a tag saved again replaces it: a new prefix, the old one deleted after the commit
    ac.save_checkpoint(setup.engine, root, tag="step1", client_state={"kl": 0.125})
    keys = keys_under(object_bucket, "ds/")
    assert not any(k.startswith("ds/step1/") for k in keys) and "ds/step1.1/areal_ckpt_manifest.json" in keys
    again = make_setup(seed=5)
    assert ac.load_checkpoint(again.engine, root) == (f"{root}/step1.1", {"kl": 0.125})
    assert_same_training_state(setup, again)


def test_a_server_killed_mid_save_leaves_the_previous_tag_and_latest(own_object_server, tmp_path, monkeypatch):
    (tmp_path / "node").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    server = own_object_server
    server.make_bucket("killed")
    bucket = f"{server.scheme}://killed"
    setup = make_setup()
    train_step(setup, 0)
    ac.save_checkpoint(setup.engine, f"{bucket}/ds", tag="good")
    saved = {name: tensor.clone() for name, tensor in setup.model.state_dict().items()}
    train_step(setup, 1)
    restore = kill_at_next_upload(server, monkeypatch)  # the event: the next save's first upload starts
    with pytest.raises(ac.CheckpointError, match=rf"{bucket}/ds/bad: checkpoint not saved .*cannot upload {bucket}"):
        ac.save_checkpoint(setup.engine, f"{bucket}/ds", tag="bad")
    restore()
    server.start()
    assert list(keys_under(bucket, "ds/.commits/")) == ["ds/.commits/000000000001.json"]
    fresh = make_setup(seed=2)
    assert ac.load_checkpoint(fresh.engine, f"{bucket}/ds")[0] == f"{bucket}/ds/good"
    for name, tensor in saved.items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name


def two_node_worker(rank: int, world_size: int, environment: dict, root: str, nodes: str, report: str) -> None:
    os.environ.update(environment)
    tempfile.tempdir = f"{nodes}/node{rank}"  # no local folder shared between the ranks: two nodes
    os.makedirs(tempfile.tempdir)
    from areal_ckpt.demo.tiny import build_model

    torch.manual_seed(0)
    trained = deepspeed_engine(build_model(VOCAB), stage=2, node_local=True)  # DeepSpeed's node-local setting
    for step in range(2):
        _ds_step(trained, step)
    ac.save_checkpoint(trained, root, client_state={"rank": rank})
    torch.manual_seed(1)
    fresh = deepspeed_engine(build_model(VOCAB), stage=2, node_local=True)
    tempfile.tempdir = f"{nodes}/node{rank}-restarted"  # the copy comes from the bucket, not the staging
    os.makedirs(tempfile.tempdir)
    path, client_state = ac.load_checkpoint(fresh, root)
    _ds_step(trained, 2)
    _ds_step(fresh, 2)  # resumed training continues exactly
    same = all(torch.equal(a, b) for a, b in zip(trained.module.parameters(), fresh.module.parameters(), strict=True))
    Path(f"{report}.{rank}").write_text(json.dumps({"path": path, "client_state": client_state, "same": same}))


@pytest.mark.dist
def test_two_node_local_ranks_on_separate_disks_save_to_the_bucket_and_resume_exactly(
    object_server, object_bucket, tmp_path
):
    root, report = f"{object_bucket}/ds", tmp_path / "report"
    run_distributed(two_node_worker, 2, object_server.environment(), root, str(tmp_path), str(report))
    for rank in range(2):
        entry = json.loads(Path(f"{report}.{rank}").read_text())
        assert entry == {"path": f"{root}/global_step2", "client_state": {"rank": rank}, "same": True}
    keys = keys_under(object_bucket, "ds/global_step2/")
    assert {"ds/global_step2/client_state/rank0.json", "ds/global_step2/client_state/rank1.json"} <= set(keys)


def test_the_cli_lists_verifies_and_converts_tags_on_the_bucket(object_bucket, tmp_path, monkeypatch, capsys):
    (tmp_path / "node").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    root = f"{object_bucket}/ds"
    setup = make_setup()
    train_step(setup, 0)
    ac.save_checkpoint(setup.engine, root, tag="step1")
    assert main(["list", root, "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["kind"] == "deepspeed" and entry["name"] == "step1" and entry["path"] == f"{root}/step1"
    assert main(["verify", root]) == 0 and f"OK   {root}/step1:" in capsys.readouterr().out
    assert main(["inspect", root, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["kind"] == "deepspeed" and facts["complete"] and facts["models"]["model"]["optimizer"]
    assert main(["convert-deepspeed", root, str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_save_dir_copied_from_the_bucket_converts_offline_by_latest_and_by_tag(object_bucket, tmp_path, monkeypatch):
    from object_helpers import read_object
    from safetensors.torch import load_file

    from areal_ckpt.tools.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    (tmp_path / "node").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    root, setup, states = f"{object_bucket}/ds", make_setup(), []
    for step, (tag, latest) in enumerate([("step1", True), ("step1", True), ("side", False)]):
        train_step(setup, step)
        ac.save_checkpoint(setup.engine, root, tag=tag, save_latest=latest)  # step1 again: stored as step1.1
        states.append({name: tensor.clone() for name, tensor in setup.model.state_dict().items()})
    copy = tmp_path / "copy"
    for key in keys_under(object_bucket, "ds/"):  # as `aws s3 sync` or `gcloud storage cp -r` copies it
        (copy / key.removeprefix("ds/")).parent.mkdir(parents=True, exist_ok=True)
        (copy / key.removeprefix("ds/")).write_bytes(read_object(object_bucket, key))
    assert not (copy / "latest").exists() and (copy / "step1.1").is_dir() and not (copy / "step1").exists()
    for number, (arguments, expected) in enumerate(
        [([], states[1]), (["-t", "step1"], states[1]), (["-t", "side"], states[2])]
    ):
        out = tmp_path / f"out{number}"
        command = [sys.executable, str(copy / "zero_to_fp32.py"), str(copy), str(out), "--safe_serialization"]
        done = subprocess.run(
            [*command, *arguments], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""}
        )
        assert done.returncode == 0, done.stderr
        converted = load_file(out / "model.safetensors")
        inside = get_fp32_state_dict_from_zero_checkpoint(copy, arguments[-1] if arguments else None)
        for name, tensor in expected.items():
            assert torch.equal(converted[name], tensor.float()) and torch.equal(inside[name], tensor.float()), name
