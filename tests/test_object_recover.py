"""Recovery dumps on object storage, on every store (real servers on 127.0.0.1: SeaweedFS,
fake-gcs-server, Azurite): resume bit-exact on a node that lost its local disk, SIGKILL while
uploading, a second job, a torn staging file; on S3, a server killed mid-dump and multipart parts."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import recover_job
import torch
from distributed import run_distributed, start_processes
from helpers import wrap_model
from object_helpers import commit_records, keys_under
from recover_fixtures import SPEC, make_setup, step_info, train_step
from recovery_runs import assert_same_run, run_job
from seaweed import kill_at_next_upload

import areal_ckpt as ac
from areal_ckpt.formats.dcp_slices import read_when_needed
from areal_ckpt.storage.backends import store_of
from areal_ckpt.urls import parse_object_url

TRIAL = "runs/checkpoints/tester/exp/trial"


def job_args(server, staging, *extra: str) -> list[str]:
    return ["--staging-dir", str(staging), "--environment", json.dumps(server.environment()), *extra]


def s3_config(bucket_url: str, staging, **fields) -> ac.RecoverConfig:
    """The trial ``exp/trial`` under ``{bucket_url}/runs``, staged in ``staging`` (None: not set)."""
    fields.setdefault("mode", "sync")
    return ac.RecoverConfig(
        experiment_name="exp",
        trial_name="trial",
        fileroot=f"{bucket_url}/runs",
        user="tester",
        staging_dir=None if staging is None else str(staging),
        **fields,
    )


def test_resume_from_object_storage_on_a_node_that_lost_its_disk_is_bit_exact(
    reference_run, object_server, object_bucket, tmp_path
):
    # every attempt starts with an empty staging folder: what it resumes from came from the bucket
    root, out = f"{object_bucket}/root", tmp_path / "out"
    for attempt, kill_at in enumerate((5, 6)):
        args = job_args(object_server, tmp_path / f"disk{attempt}", "--kill-at", str(kill_at))
        assert run_job(root, out, extra=args) == [-9]
    run_job(root, out, extra=job_args(object_server, tmp_path / "disk-last"))
    assert_same_run(reference_run, out, world_size=1)
    records = commit_records(object_bucket, "root/checkpoints/tester/exp/bitexact")
    assert len(records) == 1 and records[0]["global_step"] == 15  # older generations deleted after each commit


def uncommitted_generations(server, bucket_url: str, trial: str) -> set[str]:
    """Recovery generations with objects that no commit record names: an upload in flight, or debris."""
    store = f"{trial}/.recover/"
    named = {record["folder"] for record in commit_records(bucket_url, trial)}
    return {key[len(store) :].split("/")[0] for key in keys_under(bucket_url, f"{store}gen-")} - named


def test_sigkill_while_uploading_then_resume_is_bit_exact_and_clears_the_debris(
    reference_run, object_server, object_bucket, tmp_path
):
    root, out, trial = f"{object_bucket}/root", tmp_path / "out", "root/checkpoints/tester/exp/bitexact"
    for attempt in range(2):
        args = ["--fileroot", root, "--out", str(out), "--wrap", "none"]
        args += job_args(object_server, tmp_path / f"disk{attempt}")
        before = uncommitted_generations(object_server, object_bucket, trial)
        (process,) = start_processes(recover_job.run, 1, args)
        try:
            deadline = time.monotonic() + 300
            while True:  # the event: an upload began; the job is frozen, and killed if it is still uncommitted
                assert process.is_alive() and time.monotonic() < deadline, "no upload was seen in flight"
                if uncommitted_generations(object_server, object_bucket, trial) - before:
                    os.kill(process.pid, signal.SIGSTOP)
                    if uncommitted_generations(object_server, object_bucket, trial) - before:
                        break
                    os.kill(process.pid, signal.SIGCONT)  # it committed meanwhile: wait for its next upload
                time.sleep(0.01)
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.join(30)
    assert uncommitted_generations(object_server, object_bucket, trial)  # what the killed uploads left
    run_job(root, out, extra=job_args(object_server, tmp_path / "disk-last"))
    assert_same_run(reference_run, out, world_size=1)
    assert not uncommitted_generations(object_server, object_bucket, trial)  # removed by the first dump


@pytest.mark.dist
def test_two_ranks_on_two_disks_dump_to_object_storage_and_resume_bit_exact(
    reference_run_fsdp2, object_server, object_bucket, tmp_path
):
    root, out = f"{object_bucket}/root", tmp_path / "out"
    args = job_args(object_server, tmp_path / "first", "--kill-at", "6")
    assert run_job(root, out, world_size=2, wrap="fsdp2", extra=args) == [-9, -9]
    run_job(root, out, world_size=2, wrap="fsdp2", extra=job_args(object_server, tmp_path / "second"))
    assert_same_run(reference_run_fsdp2, out, world_size=2)


@pytest.mark.parametrize("event", ["data file streamed while written", "upload after the local commit"])
def test_a_server_killed_during_a_dump_leaves_the_previous_one_committed(
    own_object_server, tmp_path, monkeypatch, event
):
    server = own_object_server
    server.make_bucket("killed-dump")
    bucket = f"{server.scheme}://killed-dump"
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(bucket, tmp_path / "disk", write_retries=1), SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    streamed = event == "data file streamed while written"
    restore = kill_at_next_upload(server, monkeypatch, streamed)  # the event: that upload of the second dump starts
    train_step(setup, 1)
    started = time.monotonic()
    if streamed:  # the dump fails while writing: not even the staging copy commits it
        failed = rf"recovery dump at global step 1 failed after 2 attempts: .*cannot upload {bucket}/\S+/__0_0"
    else:  # the staging copy committed it; the bucket did not
        failed = r"upload of the recovery dump at global step 1 \(committed in \S+ only\) failed after 2 attempts: "
    with pytest.raises(
        ac.CheckpointError,
        match=failed + r".*the server (did not answer|refused the connection).*the previous checkpoint is",
    ):
        handler.dump(setup.engine, step_info(1), force=True)
    assert time.monotonic() - started < 120  # bounded: no endless retries against a dead server
    restore()
    handler.close()
    server.start()
    assert [record["global_step"] for record in commit_records(bucket, TRIAL)] == [0]
    fresh = make_setup(seed=1)
    resumed = ac.RecoverHandler(s3_config(bucket, tmp_path / "other-disk"), SPEC)
    info = resumed.load(fresh.engine)
    assert info is not None and info.last_step_info.global_step == 0
    resumed.close()


def test_a_second_job_is_refused_before_it_overwrites_the_bucket(object_server, object_bucket, tmp_path):
    first_setup = make_setup()
    first = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "a"), SPEC)
    train_step(first_setup, 0)
    first.dump(first_setup.engine, step_info(0), force=True)
    assert ac.check_if_recover(s3_config(object_bucket, tmp_path / "elsewhere"))

    second = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "b"), SPEC)  # did not load
    with pytest.raises(ac.CheckpointError, match=r"is a recovery checkpoint this job has not loaded"):
        second.dump(make_setup(seed=1).engine, step_info(0), force=True)
    assert second.load(make_setup(seed=1).engine) is not None  # the hint: load first, then dump
    second.dump(make_setup(seed=1).engine, step_info(1), force=True)
    second.close()
    with pytest.raises(ac.CheckpointError, match=r"committed by another job"):  # the first job lost the trial
        first.dump(first_setup.engine, step_info(2), force=True)
    first.close()
    assert [record["global_step"] for record in commit_records(object_bucket, TRIAL)] == [1]


def test_check_if_recover_reads_the_bucket(object_server, object_bucket, tmp_path):
    assert not ac.check_if_recover(s3_config(object_bucket, tmp_path / "disk"))
    kind = "container" if object_server.scheme == "az" else "bucket"
    with pytest.raises(ac.CheckpointError, match=rf"{kind} 'no-such-bucket' does not exist"):
        ac.RecoverHandler(s3_config(f"{object_server.scheme}://no-such-bucket", tmp_path / "disk"), SPEC)


def test_ctrl_c_during_a_dump_upload_is_not_retried_and_commits_nothing(
    object_server, object_bucket, tmp_path, monkeypatch
):
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk", write_retries=3), SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    calls = []

    def interrupted(self, key, path):
        calls.append(key)
        raise KeyboardInterrupt

    store_class = type(store_of(parse_object_url(object_bucket, "test")))
    real_put_file = store_class.put_file
    monkeypatch.setattr(store_class, "put_file", interrupted)
    train_step(setup, 1)
    with pytest.raises(KeyboardInterrupt):
        handler.dump(setup.engine, step_info(1), force=True)
    assert calls and len(calls) == len(set(calls))  # no file tried twice: an interruption is never retried
    monkeypatch.setattr(store_class, "put_file", real_put_file)
    handler.close()
    assert [record["global_step"] for record in commit_records(object_bucket, TRIAL)] == [0]


def test_async_dumps_upload_from_the_background_writer_and_resume(object_server, object_bucket, tmp_path):
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk", mode="async"), SPEC)
    for step in range(3):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
    handler.close()  # waits for the last upload
    assert [record["global_step"] for record in commit_records(object_bucket, TRIAL)] == [2]
    fresh = make_setup(seed=1)
    loader = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "new-disk"), SPEC)
    assert loader.load(fresh.engine).last_step_info.global_step == 2
    loader.close()
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name
    assert fresh.optimizer.state_dict()["state"][0]["step"] == setup.optimizer.state_dict()["state"][0]["step"]


def test_a_torn_file_in_the_staging_copy_is_downloaded_again(object_server, object_bucket, tmp_path, caplog):
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk"), SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    first = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk"), SPEC)  # a load brings the data file down
    assert first.load(make_setup(seed=2).engine) is not None
    first.close()
    (data,) = (tmp_path / "disk").rglob("gen-*/default/__0_0.distcp")
    torn = bytearray(data.read_bytes())
    torn[len(torn) // 2] ^= 0xFF  # as a crash of this node could leave it: right size, wrong bytes
    data.write_bytes(bytes(torn))
    fresh = make_setup(seed=1)
    resumed = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk"), SPEC)
    assert resumed.load(fresh.engine).last_step_info.global_step == 0
    resumed.close()
    assert "__0_0.distcp: checksum mismatch (file corrupted); downloading it again" in caplog.text
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name


@pytest.mark.dist
def test_lora_on_two_nodes_dumps_twice_and_resumes_from_fresh_disks_bit_exact(object_server, object_bucket, tmp_path):
    # the frozen base is written once per dump on each node: no node's staging copy holds the
    # other node's files, so an unchanged part cannot be linked from the previous generation
    lora = ["--lora"]
    run_job(tmp_path / "ref/root", tmp_path / "ref/out", world_size=2, wrap="ddp", extra=lora)
    root, out = f"{object_bucket}/root", tmp_path / "out"
    args = [*lora, *job_args(object_server, tmp_path / "first"), "--kill-at", "6"]
    assert run_job(root, out, world_size=2, wrap="ddp", extra=args) == [-9, -9]
    run_job(root, out, world_size=2, wrap="ddp", extra=[*lora, *job_args(object_server, tmp_path / "second")])
    assert_same_run(tmp_path / "ref/out", out, world_size=2)


def data_files_read_worker(rank: int, world_size: int, environment: dict, bucket: str, tmp: str) -> None:
    os.environ.update(environment)
    from areal_ckpt.demo.tiny import build_model

    torch.manual_seed(0)
    model = wrap_model(build_model(48), "fsdp2")
    handler = ac.RecoverHandler(s3_config(bucket, f"{tmp}/first/node{rank}"), SPEC)
    handler.dump(ac.TorchEngine(model), step_info(0), force=True)
    handler.close()
    torch.manual_seed(1)
    fresh = wrap_model(build_model(48), "fsdp2")
    loader = ac.RecoverHandler(s3_config(bucket, f"{tmp}/second/node{rank}"), SPEC)  # a node that never saw the job
    assert loader.load(ac.TorchEngine(fresh)) is not None
    loader.close()
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    Path(f"{tmp}/report.{rank}").write_text(json.dumps({"same": same, "files": dcp_files(f"{tmp}/second/node{rank}")}))


def dcp_files(copy: Path | str) -> list[str]:
    """The names of the DCP files (data, chunk files, metadata) a node's copy holds."""
    return sorted(p.name for p in Path(copy).rglob("*") if read_when_needed(p.name))


@pytest.mark.dist
def test_each_node_downloads_only_the_data_files_and_metadata_its_ranks_read(object_server, object_bucket, tmp_path):
    run_distributed(data_files_read_worker, 2, object_server.environment(), object_bucket, str(tmp_path))
    for rank in range(2):  # the same world size: each rank reads its own shard file, index and chunk file
        report = json.loads((tmp_path / f"report.{rank}").read_text())
        own = [f"__{rank}_0.chunks.json", f"__{rank}_0.distcp", "dcp_index.json"]
        assert report == {"same": True, "files": own}, report

    from areal_ckpt.demo.tiny import build_model

    torch.manual_seed(0)
    saved = build_model(48)
    torch.manual_seed(1)
    fresh = build_model(48)  # one rank now: it reads both shard files
    loader = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "third"), SPEC)
    assert loader.load(ac.TorchEngine(fresh), drop_rank_state=True) is not None
    loader.close()
    # its own slice does not hold rank 1's shards: it read the whole metadata, never the stock pickle
    whole = ["__0_0.chunks.json", "__0_0.distcp", "__1_0.distcp", "dcp_index.json", "dcp_metadata.json"]
    assert dcp_files(tmp_path / "third") == whole
    for name, tensor in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_a_data_file_larger_than_a_part_goes_up_from_memory_and_loads_bit_exact(
    s3_server, s3_bucket, tmp_path, monkeypatch
):
    from areal_ckpt.storage.s3 import S3ObjectWriter

    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4608)  # 75.5 MB of fp32 weights: two 64 MiB parts
    handler = ac.RecoverHandler(s3_config(s3_bucket, tmp_path / "disk"), SPEC)
    parts = []
    real_upload_part = S3ObjectWriter._upload_part

    def counted(self, number, views):
        parts.append((number, sum(len(view) for view in views)))
        return real_upload_part(self, number, views)

    monkeypatch.setattr(S3ObjectWriter, "_upload_part", counted)
    handler.dump(ac.TorchEngine(model), step_info(0), force=True)
    handler.close()
    assert sorted(parts)[0] == (1, 64 << 20) and [number for number, _ in sorted(parts)] == [1, 2]
    assert not list((tmp_path / "disk").rglob("*.distcp"))  # no local copy of the data was written
    torch.manual_seed(1)
    fresh = torch.nn.Linear(4096, 4608)
    loader = ac.RecoverHandler(s3_config(s3_bucket, tmp_path / "new-disk"), SPEC)
    assert loader.load(ac.TorchEngine(fresh)).last_step_info.global_step == 0
    loader.close()
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_ctrl_c_while_a_part_goes_up_aborts_the_upload_and_commits_nothing(s3_server, s3_bucket, tmp_path, monkeypatch):
    from areal_ckpt.storage.s3 import S3ObjectWriter

    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4608)
    handler = ac.RecoverHandler(s3_config(s3_bucket, tmp_path / "disk", write_retries=3), SPEC)
    handler.dump(ac.TorchEngine(model), step_info(0), force=True)
    committed = model.weight.detach().clone()
    real_upload_part = S3ObjectWriter._upload_part
    calls = []

    def interrupted(self, number, data):
        calls.append(number)
        if number == 2:
            raise KeyboardInterrupt
        return real_upload_part(self, number, data)

    monkeypatch.setattr(S3ObjectWriter, "_upload_part", interrupted)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        handler.dump(ac.TorchEngine(model), step_info(1), force=True)
    assert 2 in calls
    monkeypatch.setattr(S3ObjectWriter, "_upload_part", real_upload_part)
    handler.close()
    bucket = s3_bucket.removeprefix("s3://")
    assert s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert [record["global_step"] for record in commit_records(s3_bucket, TRIAL)] == [0]
    fresh = torch.nn.Linear(4096, 4608)
    loader = ac.RecoverHandler(s3_config(s3_bucket, tmp_path / "new-disk"), SPEC)
    assert loader.load(ac.TorchEngine(fresh)).last_step_info.global_step == 0
    loader.close()
    assert torch.equal(fresh.weight, committed)


def test_a_link_planted_in_the_staging_copy_is_never_written_through(object_server, object_bucket, tmp_path):
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk"), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    (generation,) = (tmp_path / "disk").rglob("gen-*")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (generation / "default").rename(tmp_path / "moved")  # the model's folder becomes a link to elsewhere
    (generation / "default").symlink_to(elsewhere)
    loader = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk"), SPEC)
    with pytest.raises(
        ac.CheckpointError, match=r"/default: a link in the local copy of (s3|gs|az)://\S+; not writing"
    ):
        loader.load(make_setup(seed=1).engine)
    loader.close()
    assert list(elsewhere.iterdir()) == []
