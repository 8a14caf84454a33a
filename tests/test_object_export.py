"""HF exports to object storage, on every store (SeaweedFS, fake-gcs-server, Azurite on
127.0.0.1): real uploads, commit records written create-only, retention, damaged objects; on S3,
faults injected at events (a server killed before an upload, Ctrl-C inside one)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from helpers import read_export_tensors, saver_config, wrap_model
from object_helpers import keys_under, read_object, write_object
from seaweed import SeaweedServer, kill_at_next_upload
from test_object_recover import s3_config
from transformers import AutoModelForCausalLM

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model
from areal_ckpt.export.download import download_export
from areal_ckpt.storage import commits
from areal_ckpt.urls import parse_object_url

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)
TRIAL = "runs/checkpoints/tester/exp/trial"


def s3_saver(bucket_url: str, tmp_path: Path, **fields) -> ac.Saver:
    fields.setdefault("max_shard_size", "40KB")
    return ac.Saver(saver_config(f"{bucket_url}/runs", staging_dir=str(tmp_path / "staging"), **fields), SPEC)


def test_export_to_object_storage_downloads_and_loads_with_from_pretrained(
    object_server, object_bucket, tmp_path, make_model, tokenizer
):
    model = make_model()
    saver = s3_saver(object_bucket, tmp_path)
    url = saver.save(ac.TorchEngine(model), 0, 1, 1, tokenizer=tokenizer, force=True)
    saver.finalize()
    assert url == f"{object_bucket}/{TRIAL}/default/epoch0epochstep1globalstep1"
    keys = keys_under(object_bucket, TRIAL)
    assert f"{TRIAL}/default/.commits/000000000001.json" in keys
    shards = [key for key in keys if key.endswith(".safetensors")]
    assert len(shards) >= 2 and f"{TRIAL}/default/epoch0epochstep1globalstep1/areal_ckpt_manifest.json" in keys
    assert not any((tmp_path / "staging").rglob("*.safetensors"))  # the staging copy is gone after the commit

    local = download_export(f"{object_bucket}/{TRIAL}/default", tmp_path / "download")
    loaded = AutoModelForCausalLM.from_pretrained(local, local_files_only=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    tokens = torch.arange(12).reshape(2, 6)
    assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
    assert (local / "tokenizer.json").is_file()


def s3_export_worker(rank: int, world_size: int, environment: dict, root: str, staging: str, wrap: str) -> None:
    os.environ.update(environment)
    config = ac.SaverConfig(
        experiment_name="exp",
        trial_name=wrap,
        fileroot=root,
        user="tester",
        max_shard_size="40KB",
        staging_dir=f"{staging}/node{rank}",  # no folder shared between the ranks: two nodes
    )
    saver = ac.Saver(config, SPEC)
    torch.manual_seed(0)
    model = wrap_model(build_model(48), wrap)
    assert (
        saver.save(ac.TorchEngine(model), 0, 1, 1, force=True)
        == f"{root}/checkpoints/tester/exp/{wrap}/default/epoch0epochstep1globalstep1"
    )
    saver.finalize()


@pytest.mark.dist
@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_two_ranks_on_two_staging_folders_export_to_object_storage_as_one_process_does(
    object_server, object_bucket, tmp_path, wrap
):
    run_distributed(
        s3_export_worker, 2, object_server.environment(), f"{object_bucket}/two", str(tmp_path / "staging"), wrap
    )
    torch.manual_seed(0)
    single = build_model(48)
    exported = download_export(f"{object_bucket}/two/checkpoints/tester/exp/{wrap}/default", tmp_path / "two")
    tensors = read_export_tensors(exported)
    assert tensors.keys() == single.state_dict().keys()
    for name, tensor in tensors.items():
        assert torch.equal(tensor, single.state_dict()[name]), name
    assert json.loads((exported / "areal_ckpt_manifest.json").read_text())["world_size"] == 2
    assert len(list(exported.glob("model-*.safetensors"))) >= 2  # both ranks wrote shards


def test_retention_on_object_storage_keeps_the_newest_and_deletes_record_then_data(
    object_server, object_bucket, tmp_path, make_model
):
    saver = s3_saver(object_bucket, tmp_path, keep_last=2)
    engine = ac.TorchEngine(make_model())
    for step in range(4):
        saver.save(engine, 0, step, step, force=True)
    saver.finalize()
    keys = keys_under(object_bucket, f"{TRIAL}/default/")
    folders = sorted({key.split("/")[-2] for key in keys if "/.commits/" not in key and "/.claims/" not in key})
    assert folders == ["epoch0epochstep2globalstep2", "epoch0epochstep3globalstep3"]
    assert sorted(Path(key).name for key in keys if "/.claims/" in key) == folders  # removed with their folders
    records = [key for key in keys if "/.commits/" in key]
    assert [Path(key).name for key in records] == ["000000000003.json", "000000000004.json"]


def test_the_same_step_again_goes_to_a_fresh_prefix(object_server, object_bucket, tmp_path, make_model):
    saver = s3_saver(object_bucket, tmp_path)
    first = saver.save(ac.TorchEngine(make_model(seed=0)), 0, 1, 1, force=True)
    second = saver.save(ac.TorchEngine(make_model(seed=1)), 0, 1, 1, force=True)
    saver.finalize()
    assert second == f"{first}.1"  # the first export's objects are never overwritten
    newest = download_export(f"{object_bucket}/{TRIAL}/default", tmp_path / "newest")
    older = download_export(first, tmp_path / "older")
    assert torch.equal(read_export_tensors(newest)["lm_head.weight"], make_model(seed=1).lm_head.weight)
    assert torch.equal(read_export_tensors(older)["lm_head.weight"], make_model(seed=0).lm_head.weight)


def test_async_export_to_object_storage_equals_the_sync_one(object_server, object_bucket, tmp_path, make_model):
    model = make_model()
    for mode in ("sync", "async"):
        saver = ac.Saver(
            saver_config(f"{object_bucket}/{mode}", staging_dir=str(tmp_path / mode), mode=mode, max_shard_size="40KB"),
            SPEC,
        )
        saver.save(ac.TorchEngine(model), 0, 1, 1, force=True)
        saver.finalize()
    sync = read_export_tensors(
        download_export(f"{object_bucket}/sync/checkpoints/tester/exp/trial/default", tmp_path / "s")
    )
    asyn = read_export_tensors(
        download_export(f"{object_bucket}/async/checkpoints/tester/exp/trial/default", tmp_path / "a")
    )
    assert sync.keys() == asyn.keys() and all(torch.equal(sync[k], asyn[k]) for k in sync)


def test_server_killed_before_an_upload_keeps_the_previous_export(own_object_server, tmp_path, make_model, monkeypatch):
    server = own_object_server
    server.make_bucket("killed")
    bucket = f"{server.scheme}://killed"
    saver = s3_saver(bucket, tmp_path)
    engine = ac.TorchEngine(make_model())
    first = saver.save(engine, 0, 1, 1, force=True)
    restore = kill_at_next_upload(server, monkeypatch)  # the event: the second export's first upload starts
    random.seed(7)  # the clients' retries draw their jitter from the loop's stream: the export leaves it alone
    with pytest.raises(ac.CheckpointError, match=r"export failed \(nothing was published\)"):
        saver.save(engine, 0, 2, 2, force=True)
    assert random.random() == random.Random(7).random()
    restore()
    saver.finalize()
    server.start()  # the same data folder and ports: the server came back
    keys = keys_under(bucket, f"{TRIAL}/default/")
    assert [key for key in keys if "/.commits/" in key] == [f"{TRIAL}/default/.commits/000000000001.json"]
    intact = download_export(f"{bucket}/" + TRIAL + "/default", tmp_path / "intact")
    assert json.loads((intact / "areal_ckpt_manifest.json").read_text())["step"]["global_step"] == 1
    assert first.endswith("globalstep1")
    s3_saver(bucket, tmp_path).finalize()  # so young a claim may be a live writer's: kept
    assert any(key.endswith("/.claims/epoch0epochstep2globalstep2") for key in keys_under(bucket, TRIAL))
    monkeypatch.setattr(commits, "CLAIM_SECONDS", 0.0)  # as if an hour had passed
    s3_saver(bucket, tmp_path).finalize()  # a new job removes what the failed one left
    assert all("globalstep1" in key or "/.commits/" in key for key in keys_under(bucket, f"{TRIAL}/"))


def test_ctrl_c_during_an_upload_commits_nothing_and_stays_an_interrupt(
    s3_server, s3_bucket, tmp_path, make_model, monkeypatch
):
    saver = s3_saver(s3_bucket, tmp_path)
    engine = ac.TorchEngine(make_model())
    saver.save(engine, 0, 1, 1, force=True)

    from areal_ckpt.storage.s3 import S3ObjectWriter

    def interrupted(self):  # a shard's upload, written from memory, at its end
        raise KeyboardInterrupt

    real_close = S3ObjectWriter.close
    monkeypatch.setattr(S3ObjectWriter, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        saver.save(engine, 0, 2, 2, force=True)
    monkeypatch.setattr(S3ObjectWriter, "close", real_close)
    saver.finalize()
    records = [key for key in keys_under(s3_bucket, TRIAL) if "/.commits/" in key]
    assert records == [f"{TRIAL}/default/.commits/000000000001.json"]


def test_a_damaged_object_is_refused_by_checksum_naming_its_key(object_server, object_bucket, tmp_path, make_model):
    saver = s3_saver(object_bucket, tmp_path)
    saver.save(ac.TorchEngine(make_model()), 0, 1, 1, force=True)
    saver.finalize()
    shard = next(key for key in keys_under(object_bucket, TRIAL) if key.endswith(".safetensors"))
    body = bytearray(read_object(object_bucket, shard))
    body[-1] ^= 0xFF
    write_object(object_bucket, shard, bytes(body))
    with pytest.raises(ac.CheckpointError, match=rf"{shard.rsplit('/', 1)[1]}: checksum mismatch"):
        download_export(f"{object_bucket}/{TRIAL}/default", tmp_path / "damaged")
    assert not (tmp_path / "damaged").exists() and not (tmp_path / "damaged.partial").exists()
    write_object(object_bucket, shard, bytes(body[:100]))
    with pytest.raises(ac.CheckpointError, match=r"size 100 bytes, manifest says"):
        download_export(f"{object_bucket}/{TRIAL}/default", tmp_path / "truncated")


def test_start_errors_name_the_endpoint_bucket_and_cause(s3_server, s3_bucket, tmp_path, monkeypatch):
    with pytest.raises(ac.CheckpointError, match=r"bucket 'no-such-bucket' does not exist"):
        s3_saver("s3://no-such-bucket", tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(
        ac.CheckpointError, match=r"access denied \(SignatureDoesNotMatch\); check the credentials"
    ) as denied:
        s3_saver(s3_bucket + "-denied", tmp_path)
    assert "not-the-secret" not in str(denied.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    random.seed(5)  # botocore retried the check, drawing its jitter: the loop's stream is left alone
    with pytest.raises(ac.CheckpointError, match=r"at http://127.0.0.1:9: the server refused the connection"):
        s3_saver(s3_bucket + "-down", tmp_path)
    with pytest.raises(ac.CheckpointError, match=r"at http://127.0.0.1:9: the server refused the connection"):
        ac.RecoverHandler(s3_config(s3_bucket + "-down", tmp_path / "staging"), SPEC)
    assert random.random() == random.Random(5).random()


def test_an_unsupported_scheme_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"is a hdfs:// URL; object storage is reached through s3://"):
        saver_config("hdfs://bucket/runs")
    with pytest.raises(ValueError, match=r"'x' is not a valid bucket name"):
        saver_config("s3://x/runs")
    assert parse_object_url("s3://bucket/a/b/", "t").key("c") == "a/b/c"


def test_a_new_job_aborts_the_unfinished_multipart_uploads_a_dead_one_left(s3_server, s3_bucket, tmp_path):
    client, bucket = s3_server.client(), s3_bucket.removeprefix("s3://")
    key = f"{TRIAL}/default/epoch0epochstep5globalstep5/model-00001-of-00002.safetensors"
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]  # as a killed writer leaves it
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * (5 << 20))
    client.put_object(Bucket=bucket, Key=f"{TRIAL}/default/epoch0epochstep5globalstep5/config.json", Body=b"{}")
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    s3_saver(s3_bucket, tmp_path).finalize()
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert keys_under(s3_bucket, TRIAL) == []  # the uncommitted export's objects are gone too


def test_credentials_without_write_permission_are_named_and_nothing_is_committed(tmp_path, monkeypatch, make_model):
    from seaweed import READER_KEYS
    from test_object_recover import s3_config

    server = SeaweedServer(tmp_path / "server", reader=True)  # the reader may list and read, not write
    server.start()
    try:
        server.make_bucket("guarded")
        for variable, value in {**server.environment(), **READER_KEYS}.items():
            monkeypatch.setenv(variable, value)
        engine = ac.TorchEngine(make_model())
        saver = s3_saver("s3://guarded", tmp_path)
        with pytest.raises(
            ac.CheckpointError, match=r"s3://guarded/runs/\S+ at http\S+: access denied \(AccessDenied\)"
        ):
            saver.save(engine, 0, 1, 1, force=True)
        saver.finalize()
        handler = ac.RecoverHandler(s3_config("s3://guarded", tmp_path / "disk", write_retries=3), SPEC)
        with pytest.raises(ac.CheckpointError, match=r"access denied \(AccessDenied\); check the credentials"):
            handler.dump(engine, ac.StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=4), force=True)
        handler.close()
        assert keys_under("s3://guarded", "") == []
    finally:
        server.stop()
