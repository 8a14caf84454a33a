"""Tiered recovery checkpoints (recover.local_dir in front of object storage, real servers on
127.0.0.1, or of a shared folder): a dump commits to the local tier, goes to the persistent tier
in the background, and a restart resumes from whichever tier holds the newest commit. The
cycles run on every store and on a folder; the tests that kill and restart the server run on
S3 (SeaweedFS)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from object_helpers import commit_records, keys_under, read_object
from recover_fixtures import SPEC, make_setup, step_info, train_step
from recovery_runs import assert_same_run, losses, run_job
from test_object_recover import s3_config

import areal_ckpt as ac
from areal_ckpt.errors import CheckpointError, ConfigError
from areal_ckpt.paths import generation_step


def tiered_config(bucket_url: str, local_dir: Path, **fields) -> ac.RecoverConfig:
    return s3_config(bucket_url, None, local_dir=str(local_dir), **fields)


def local_step(local_dir: Path, trial: str = "trial") -> int | None:
    """The global step of the generation the local tier has committed (None: none)."""
    pointer = local_dir / f"checkpoints/tester/exp/{trial}/.recover/current"
    return generation_step(pointer.readlink().name) if pointer.is_symlink() else None


def persisted_steps(root: str, trial: str = "trial") -> list[int]:
    """The global steps of the commits the persistent tier under ``root`` holds: a bucket's
    commit records, or the shared folder's committed generation."""
    if "://" in root:
        return [record["global_step"] for record in commit_records(root, f"runs/checkpoints/tester/exp/{trial}")]
    step = local_step(Path(root) / "runs", trial)
    return [] if step is None else [step]


def assert_same_weights(expected: torch.nn.Module, actual: torch.nn.Module) -> None:
    for name, tensor in expected.state_dict().items():
        assert torch.equal(actual.state_dict()[name], tensor), name


def test_local_dir_is_another_folder_than_fileroot_and_replaces_staging_dir(tmp_path):
    with pytest.raises(ConfigError, match="is fileroot itself; the local tier must be another folder"):
        ac.RecoverConfig.of(
            {"experiment_name": "e", "trial_name": "t", "fileroot": str(tmp_path), "local_dir": f"{tmp_path}/./"}
        )
    assert ac.RecoverConfig.of(  # a shared folder behind a node-local one: the HPC layout
        {"experiment_name": "e", "trial_name": "t", "fileroot": str(tmp_path), "local_dir": str(tmp_path / "l")}
    ).local_dir == str(tmp_path / "l")
    with pytest.raises(ConfigError, match="drop staging_dir"):
        ac.RecoverConfig.of(
            {
                "experiment_name": "e",
                "trial_name": "t",
                "fileroot": "s3://bucket/runs",
                "local_dir": str(tmp_path / "l"),
                "staging_dir": str(tmp_path / "s"),
            }
        )
    with pytest.raises(ConfigError, match="local_dir"):
        ac.RecoverConfig.of(
            {"experiment_name": "e", "trial_name": "t", "fileroot": "s3://bucket/runs", "local_dir": "s3://b/x"}
        )


def test_a_dump_commits_locally_uploads_in_the_background_and_reports_both(persistent_root, tmp_path, caplog):
    setup = make_setup()
    handler = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "local"), SPEC)
    for step in range(3):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
        assert local_step(tmp_path / "local") == step  # committed locally on return
    handler.wait()  # the newest is on object storage too
    metrics = handler.last_metrics
    handler.close()
    assert persisted_steps(persistent_root.root) == [2]
    assert metrics["upload/bytes"] > 0 and metrics["upload/gbps"] > 0 and metrics["bytes"] > 0
    assert metrics["upload/lag_steps"] == 0 and metrics["upload/failures"] == 0
    assert f"uploaded recovery checkpoint {persistent_root.root}/" in caplog.text
    # a restart on the same node loads the local tier (nothing fetched), on a fresh node the bucket
    for local, fetched in ((tmp_path / "local", False), (tmp_path / "fresh-node", True)):
        caplog.clear()
        fresh = make_setup(seed=1)
        loader = ac.RecoverHandler(tiered_config(persistent_root.root, local), SPEC)
        assert loader.load(fresh.engine).last_step_info.global_step == 2
        loader.close()
        assert ("fetched" in caplog.text) == fetched
        tier = (
            f"{persistent_root.root}/runs/checkpoints/tester/exp/trial/.recover/gen-00000002-"
            if fetched
            else f"{local}/"
        )
        resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming trial")]
        assert len(resumed) == 1 and resumed[0].startswith("resuming trial trial after global step 2 (epoch 0, step 2")
        assert tier in resumed[0] and resumed[0].endswith("(the persistent tier)" if fetched else "(the local tier)")
        assert_same_weights(setup.model, fresh.model)


def test_uploads_wait_out_a_stopped_server_and_a_restart_without_it_resumes_locally(
    own_object_server, tmp_path, caplog
):
    server = own_object_server
    server.make_bucket("tiered-outage")
    bucket = f"{server.scheme}://tiered-outage"
    config = tiered_config(bucket, tmp_path / "local", write_retries=1)
    setup = make_setup()
    handler = ac.RecoverHandler(config, SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.wait()
    server.kill()  # object storage gone for a while: training and local commits go on
    for step in (1, 2):
        train_step(setup, step)
        assert handler.dump(setup.engine, step_info(step), force=True) is not None
        assert local_step(tmp_path / "local") == step
    with pytest.raises(CheckpointError, match="committed on this node's local tier only"):
        handler.wait()
    assert handler.last_metrics["upload/lag_steps"] == 2 and handler.last_metrics["upload/failures"] >= 1
    server.start()  # back: the next dump's upload catches up with the newest
    train_step(setup, 3)
    handler.dump(setup.engine, step_info(3), force=True)
    handler.wait()
    assert persisted_steps(bucket) == [3] and handler.last_metrics["upload/lag_steps"] == 0
    handler.close()
    server.kill()  # down at the restart: resume from the local tier, saying so
    assert ac.check_if_recover(config)  # a launcher sees the local tier's checkpoint
    caplog.clear()
    fresh = make_setup(seed=1)
    with caplog.at_level(logging.WARNING):
        loader = ac.RecoverHandler(config, SPEC)
        waits = len(storage_warnings(caplog))  # the start's access check waited out the client's retries
        assert waits >= 1
        assert loader.load(fresh.engine).last_step_info.global_step == 3
    assert len(storage_warnings(caplog)) == waits  # the load took the start's answer: no second wait
    assert f"cannot reach {bucket}/" in caplog.text and "resuming from the local tier" in caplog.text
    assert_same_weights(setup.model, fresh.model)
    server.start()
    loader.close()


def storage_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The waits on a store logged so far (each client logs every failed attempt)."""
    return [record for record in caplog.records if record.name.startswith("areal_ckpt.storage")]


def test_a_dump_whose_requests_are_retried_leaves_the_loops_python_random_stream_alone(own_object_server, tmp_path):
    # botocore and google-api-core draw their retry jitter from Python's global random, which the
    # loop seeds and a checkpoint records: a resumed run must not depend on how often the bucket answered
    server = own_object_server
    server.make_bucket("tiered-jitter")
    bucket = f"{server.scheme}://tiered-jitter"
    setup = make_setup()
    handler = ac.RecoverHandler(tiered_config(bucket, tmp_path / "local", write_retries=0), SPEC)
    train_step(setup, 0)
    server.kill()  # the first dump's check of the bucket is retried by the client, then given up
    random.seed(1234)
    handler.dump(setup.engine, step_info(0), force=True)
    assert local_step(tmp_path / "local") == 0
    assert random.random() == random.Random(1234).random()
    server.start()
    handler.close()


def test_a_restart_after_a_cut_upload_resumes_from_the_local_tier_and_uploads_it(own_object_server, tmp_path):
    server = own_object_server
    server.make_bucket("tiered-cut")
    bucket = f"{server.scheme}://tiered-cut"
    config = tiered_config(bucket, tmp_path / "local", write_retries=0)
    setup = make_setup()
    handler = ac.RecoverHandler(config, SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.wait()
    server.kill()
    train_step(setup, 1)
    handler.dump(setup.engine, step_info(1), force=True)  # committed locally; its upload cannot go through
    with pytest.raises(CheckpointError, match="local tier only"):
        handler.close()
    server.start()
    assert persisted_steps(bucket) == [0]
    fresh = make_setup(seed=1)
    loader = ac.RecoverHandler(config, SPEC)
    assert loader.load(fresh.engine).last_step_info.global_step == 1  # the local tier's, newer
    assert_same_weights(setup.model, fresh.model)
    loader.wait()
    loader.close()
    assert persisted_steps(bucket) == [1]  # caught up by the resumed job


def test_a_damaged_local_file_is_ignored_for_the_intact_upload_with_a_warning(persistent_root, tmp_path, caplog):
    setup = make_setup()
    handler = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "local"), SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    (data,) = (tmp_path / "local").rglob("gen-*/default/__0_0.distcp")
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(bytes(damaged))
    fresh = make_setup(seed=1)
    loader = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "local"), SPEC)
    assert loader.load(fresh.engine).last_step_info.global_step == 0
    loader.close()
    assert "the local tier's recovery checkpoint cannot be loaded" in caplog.text
    assert "__0_0.distcp" in caplog.text
    assert_same_weights(setup.model, fresh.model)


@pytest.mark.dist
def test_two_nodes_with_their_own_local_dirs_resume_bit_exact_after_one_loses_its_disk(
    reference_run_fsdp2, persistent_root, tmp_path
):
    root, out, local = f"{persistent_root.root}/root", tmp_path / "out", tmp_path / "local"
    tiered = ["--local-dir", str(local), "--environment", json.dumps(persistent_root.environment)]
    killed = [*tiered, "--kill-at", "7", "--wait-before-kill"]  # its last dump is on both tiers
    assert run_job(root, out, world_size=2, wrap="fsdp2", extra=killed) == [-9, -9]
    shutil.rmtree(local / "node1")  # the second node's disk is lost with it
    run_job(root, out, world_size=2, wrap="fsdp2", extra=tiered)
    assert_same_run(reference_run_fsdp2, out, world_size=2)


@pytest.mark.dist
def test_two_nodes_whose_uploads_never_went_through_resume_bit_exact_from_their_local_tiers(
    reference_run_fsdp2, own_object_server, tmp_path
):
    # rank 0's commit stands for both nodes, the other holding its own rank's files of each dump;
    # the restart copies over what each node lacks (an FSDP2 load also reads the other rank's file)
    server, out, local = own_object_server, tmp_path / "out", tmp_path / "local"
    root = f"{server.scheme}://tiered-nodes/root"
    server.make_bucket("tiered-nodes")
    # the jobs' processes come from a fork server older than this test's environment: the server's
    # variables and the short request timeout the fixture sets here go with them
    environment = {**server.environment(), "AREAL_CKPT_STORAGE_TIMEOUT": os.environ["AREAL_CKPT_STORAGE_TIMEOUT"]}
    tiered = ["--local-dir", str(local), "--environment", json.dumps(environment)]
    held = tmp_path / "held"
    held.mkdir()

    def stop_server_once_loaded() -> None:  # every upload of the first run fails: its dumps stay on the nodes
        while not all((held / f"held-rank{rank}").exists() for rank in range(2)):
            time.sleep(0.01)
        server.kill()
        (held / "go").touch()

    stopper = threading.Thread(target=stop_server_once_loaded, daemon=True)
    stopper.start()
    first = [*tiered, "--kill-at", "7", "--hold", str(held)]
    assert run_job(root, out, world_size=2, wrap="fsdp2", extra=first) == [-9, -9]
    stopper.join()
    assert local_step(local / "node0", "bitexact") == 7 and local_step(local / "node1", "bitexact") is None
    committed = (local / "node0/checkpoints/tester/exp/bitexact/.recover/current").resolve().name
    node1_copy = local / "node1/checkpoints/tester/exp/bitexact/.recover" / committed
    assert [path.name for path in node1_copy.glob("*/__*_0.distcp")] == ["__1_0.distcp"]  # its own rank's only
    server.start()
    shutil.move(local / "node1", tmp_path / "node1-elsewhere")  # the job restarts without that node's disk
    with pytest.raises(AssertionError, match=r"ranks \[1\] have no local copy of it .* restart on the nodes whose"):
        run_job(root, out, world_size=2, wrap="fsdp2", extra=tiered)
    assert local_step(local / "node0", "bitexact") == 7  # nothing deleted
    shutil.rmtree(local / "node1", ignore_errors=True)
    shutil.move(tmp_path / "node1-elsewhere", local / "node1")  # the hint: on the nodes that hold it
    run_job(root, out, world_size=2, wrap="fsdp2", extra=tiered)
    assert_same_run(reference_run_fsdp2, out, world_size=2)
    for rank in range(2):  # resumed after step 7 (the bucket never held it): no step up to it ran twice
        assert all(len(values) == 1 for step, values in losses(out, rank).items() if step <= 7)


def test_async_tiered_dumps_upload_after_their_background_commit(persistent_root, tmp_path):
    setup = make_setup()
    handler = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "local", mode="async"), SPEC)
    for step in range(3):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
    handler.wait()
    handler.close()
    assert local_step(tmp_path / "local") == 2 and persisted_steps(persistent_root.root) == [2]
    fresh = make_setup(seed=1)
    loader = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "fresh-node"), SPEC)
    assert loader.load(fresh.engine).last_step_info.global_step == 2
    loader.close()
    assert_same_weights(setup.model, fresh.model)


def test_a_second_job_that_did_not_load_is_refused_at_its_first_dump(persistent_root, tmp_path):
    setup = make_setup()
    first = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "node-a"), SPEC)
    first.dump(setup.engine, step_info(0), force=True)
    first.close()
    second = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "node-b"), SPEC)
    with pytest.raises(CheckpointError, match="this job has not loaded"):
        second.dump(setup.engine, step_info(5), force=True)
    second.close()
    assert local_step(tmp_path / "node-b") is None and persisted_steps(persistent_root.root) == [0]


def test_a_broken_local_commit_record_is_warned_about_and_the_persistent_tier_used(persistent_root, tmp_path, caplog):
    setup = make_setup()
    handler = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "local"), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    pointer = tmp_path / "local/checkpoints/tester/exp/trial/.recover/current"
    pointer.unlink()
    pointer.symlink_to("gen-00000009-deadbeef")  # dangling: a generation this copy does not hold
    assert ac.check_if_recover(
        tiered_config(persistent_root.root, tmp_path / "local")
    )  # the bucket's, as the load finds
    fresh = make_setup(seed=1)
    loader = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "local"), SPEC)
    assert loader.load(fresh.engine).last_step_info.global_step == 0
    loader.close()
    assert "the local tier cannot be used" in caplog.text and "gen-00000009-deadbeef is missing" in caplog.text
    assert_same_weights(setup.model, fresh.model)


def test_a_restart_on_a_fresh_node_while_the_bucket_is_down_refuses_then_resumes_once_it_answers(
    own_object_server, tmp_path
):
    server = own_object_server
    bucket = f"{server.scheme}://tiered-fresh"
    server.make_bucket("tiered-fresh")
    setup = make_setup()
    handler = ac.RecoverHandler(tiered_config(bucket, tmp_path / "node-a"), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    server.kill()
    fresh = make_setup(seed=1)
    loader = ac.RecoverHandler(tiered_config(bucket, tmp_path / "node-b"), SPEC)
    with pytest.raises(CheckpointError, match=f"cannot reach {bucket}/.* not starting fresh: restart when it answers"):
        loader.load(fresh.engine)
    loader.close()
    server.start()  # the hint followed
    loader = ac.RecoverHandler(tiered_config(bucket, tmp_path / "node-b"), SPEC)
    assert loader.load(fresh.engine).last_step_info.global_step == 0
    loader.close()
    assert_same_weights(setup.model, fresh.model)


def test_a_local_tier_under_another_fileroot_is_refused_naming_both(persistent_root, tmp_path):
    setup = make_setup()
    first = ac.RecoverHandler(tiered_config(f"{persistent_root.root}/projA", tmp_path / "local"), SPEC)
    first.dump(setup.engine, step_info(3), force=True)
    first.close()
    other = tiered_config(f"{persistent_root.root}/projB", tmp_path / "local")  # same local_dir and trial names
    with pytest.raises(
        CheckpointError, match=r"belongs to \S*projA\S*( at \S+)?, not to \S*projB.* move that trial folder"
    ):
        ac.RecoverHandler(other, SPEC)
    assert local_step(tmp_path / "local") == 3  # nothing read or deleted
    shutil.move(tmp_path / "local/checkpoints", tmp_path / "projA-local-tier")  # the hint followed
    handler = ac.RecoverHandler(other, SPEC)
    assert handler.load(make_setup(seed=1).engine) is None  # projB holds nothing: a fresh start, said by None
    handler.close()


def test_a_local_generation_damaged_while_its_upload_waits_is_never_committed_to_the_bucket(
    own_object_server, tmp_path, caplog
):
    server = own_object_server
    bucket = f"{server.scheme}://tiered-rot"
    server.make_bucket("tiered-rot")
    setup = make_setup()
    handler = ac.RecoverHandler(tiered_config(bucket, tmp_path / "local", write_retries=0), SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.wait()
    server.kill()  # the next upload is held back
    train_step(setup, 1)
    handler.dump(setup.engine, step_info(1), force=True)
    with pytest.raises(CheckpointError, match="local tier only"):
        handler.wait()
    (generation,) = [p for p in (tmp_path / "local").rglob("gen-00000001-*") if p.is_dir()]
    (data,) = generation.glob("default/__0_0.distcp")
    rotted = bytearray(data.read_bytes())
    rotted[len(rotted) // 2] ^= 0xFF
    data.write_bytes(bytes(rotted))
    private = tmp_path / "private.json"
    private.write_text('{"secret": 1}')
    (generation / "recover_info/rank0.json").unlink()
    (generation / "recover_info/rank0.json").symlink_to(private)
    server.start()
    with pytest.raises(CheckpointError, match=r"local tier only"):
        handler.close()  # the upload of the damaged generation is refused
    assert "differs from its records" in caplog.text and "__0_0.distcp: checksum mismatch" in caplog.text
    assert persisted_steps(bucket) == [0]  # the good one stays committed, nothing of step 1 committed
    assert not any(
        key.endswith("private.json") or b"secret" in read_object(bucket, key)
        for key in keys_under(bucket, "runs/")
        if key.endswith(".json")
    )
    fresh = make_setup(seed=1)
    loader = ac.RecoverHandler(tiered_config(bucket, tmp_path / "fresh-node"), SPEC)
    assert loader.load(fresh.engine).last_step_info.global_step == 0
    loader.close()


@pytest.mark.parametrize("races", [1, 3])
def test_a_load_whose_generation_another_jobs_upload_supersedes_mid_fetch_loads_the_newer_one(
    persistent_root, tmp_path, monkeypatch, caplog, races
):
    """Two jobs on one trial: the first job's next upload deletes the generation the second one
    is fetching (it failed 2 of 3 times on "dcp_index.json: missing", with no retry). Three
    times in a row: said so, and the hint (stop the other job) followed."""
    from areal_ckpt.storage import folders

    running = make_setup()
    first = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "node-a"), SPEC)
    train_step(running, 0)
    first.dump(running.engine, step_info(0), force=True)
    first.wait()
    real_ensure = folders.OnDemandFiles.ensure
    raced: list[int] = []

    def ensure_after_the_first_jobs_next_commit(self, path):  # type: ignore[no-untyped-def]
        if path.name == "dcp_index.json" and len(raced) < races:  # the load's first file of a generation
            raced.append(len(raced) + 1)
            train_step(running, len(raced))
            first.dump(running.engine, step_info(len(raced)), force=True)
            first.wait()  # uploaded; the persistent tier keeps only the newest: the one being read is gone
        return real_ensure(self, path)

    monkeypatch.setattr(folders.OnDemandFiles, "ensure", ensure_after_the_first_jobs_next_commit)
    fresh = make_setup(seed=1)
    second = ac.RecoverHandler(tiered_config(persistent_root.root, tmp_path / "node-b"), SPEC)  # a fresh disk
    if races == 3:
        with pytest.raises(
            CheckpointError, match=r"superseded by gen-00000003-\w+ while it was loaded, 3 times .*stop it"
        ):
            second.load(fresh.engine)
        first.close()  # the hint followed: the other job stopped
    assert second.load(fresh.engine).last_step_info.global_step == races
    second.close()
    first.close()
    assert raced == list(range(1, races + 1)) and "was superseded by gen-00000001-" in caplog.text
    assert_same_weights(running.model, fresh.model)
