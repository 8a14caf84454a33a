"""Hostile conditions, round four, on every object store: a commit log with names no reader
parses, a file fetched on demand that rotted in the bucket. Each test failed before its fix
(docs/reliability.md, fourth round)."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest
import torch
from helpers import read_export_tensors
from object_helpers import commit_records, keys_under, read_object, write_object
from recover_fixtures import SPEC, make_setup, step_info, train_step
from test_object_export import s3_saver
from test_object_recover import TRIAL, s3_config

import areal_ckpt as ac
from areal_ckpt.export.download import download_export
from areal_ckpt.storage import commits
from areal_ckpt.storage import object_location as series_module
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.object_location import ObjectLocation
from areal_ckpt.urls import parse_object_url

LOG = f"{TRIAL}/.recover/.commits"


def dumped(bucket: str, staging, steps: int) -> ac.RecoverHandler:
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(bucket, staging), SPEC)
    for step in range(steps):
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
    return handler


def test_a_full_commit_log_refuses_the_next_commit_and_deletes_nothing(object_bucket, tmp_path):
    handler = dumped(object_bucket, tmp_path / "a", 2)
    (newest,) = keys_under(object_bucket, f"{LOG}/")
    write_object(object_bucket, f"{LOG}/999999999999.json", read_object(object_bucket, newest))  # the last number
    before = keys_under(object_bucket)
    with pytest.raises(ac.CheckpointError, match=r"999999999999.json: the commit log is full .*nothing was committed"):
        handler.dump(make_setup().engine, step_info(2), force=True)
    handler.close()
    after = keys_under(object_bucket)
    assert set(before) <= set(after)  # nothing deleted (the failed dump's uploads are debris, cleared later)
    assert keys_under(object_bucket, f"{LOG}/") == sorted([newest, f"{LOG}/999999999999.json"])  # no new record
    fresh = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "fresh"), SPEC)
    assert fresh.load(make_setup(seed=1).engine).last_step_info.global_step == 1  # still loads
    fresh.close()
    other = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "b").model_copy(update={"trial_name": "t2"}), SPEC)
    assert other.dump(make_setup().engine, step_info(0), force=True) is not None  # the hint: a new trial_name
    other.close()


def test_an_object_in_the_commit_log_that_is_not_a_record_is_named_never_skipped(object_bucket, tmp_path):
    dumped(object_bucket, tmp_path / "a", 1).close()
    newer = f"{LOG}/1000000000000.json"  # thirteen digits: a record no reader parses
    (record,) = keys_under(object_bucket, f"{LOG}/")
    write_object(object_bucket, newer, read_object(object_bucket, record))
    for attempt in ("load", "dump"):
        handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / attempt), SPEC)
        with pytest.raises(ac.CheckpointError, match=r"1000000000000.json: not a commit record's name .*move it out"):
            if attempt == "load":
                handler.load(make_setup().engine)
            else:
                handler.dump(make_setup().engine, step_info(5), force=True)
        handler.close()
    assert newer in keys_under(object_bucket) and [r["global_step"] for r in commit_records(object_bucket, TRIAL)]
    url = parse_object_url(object_bucket, "test")
    store_of(url).delete([newer])  # the hint: moved out of the log
    loader = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "after"), SPEC)
    assert loader.load(make_setup().engine).last_step_info.global_step == 0
    loader.close()


def _flip_a_digit(data: bytes) -> bytes:
    """``data`` (JSON text) with its last digit changed: the same size, still JSON, another number."""
    at = max(i for i, byte in enumerate(data) if chr(byte).isdigit())
    return data[:at] + (b"1" if data[at : at + 1] != b"1" else b"2") + data[at + 1 :]


def test_a_file_fetched_on_demand_is_checked_before_use(object_bucket, tmp_path):
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "a"), SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    (index,) = [
        key for key in keys_under(object_bucket, f"{TRIAL}/.recover/") if key.endswith("default/dcp_index.json")
    ]
    write_object(object_bucket, index, _flip_a_digit(read_object(object_bucket, index)))
    loader = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "fresh"), SPEC)
    with pytest.raises(ac.CheckpointError, match=r"dcp_index.json: checksum mismatch"):
        loader.load(make_setup(seed=1).engine)
    loader.close()


def test_a_tag_file_fetched_on_demand_is_checked_before_use(object_bucket, tmp_path):
    setup = make_setup()
    ac.save_checkpoint(setup.engine, f"{object_bucket}/ds", tag="t1")
    (index,) = [key for key in keys_under(object_bucket, "ds/t1/") if key.endswith("dcp_index.json")]
    write_object(object_bucket, index, _flip_a_digit(read_object(object_bucket, index)))
    with pytest.raises(ac.CheckpointError, match=r"dcp_index.json: checksum mismatch"):
        ac.load_checkpoint(make_setup(seed=1).engine, f"{object_bucket}/ds", tag="t1")


@pytest.mark.parametrize("planted", ["recover_info", "generation"])
def test_a_link_in_a_staging_copy_is_never_written_through(object_bucket, tmp_path, planted):
    dumped(object_bucket, tmp_path / "disk", 1).close()
    (generation,) = (tmp_path / "disk").rglob("gen-*")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = generation / "recover_info" if planted == "recover_info" else generation
    link.rename(tmp_path / "moved")
    link.symlink_to(elsewhere)
    loader = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk"), SPEC)
    with pytest.raises(ac.CheckpointError, match=r"a link in the local copy of .*not writing through it"):
        loader.load(make_setup(seed=1).engine)
    loader.close()
    assert list(elsewhere.iterdir()) == []  # no manifest, no file written into the link's target


def test_a_link_at_a_tags_local_copy_is_never_written_through(object_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the per-node copies go
    (tmp_path / "tmp").mkdir()
    setup = make_setup()
    ac.save_checkpoint(setup.engine, f"{object_bucket}/ds", tag="t1")
    ac.load_checkpoint(make_setup(seed=1).engine, f"{object_bucket}/ds", tag="t1")
    (copy,) = (tmp_path / "tmp").rglob("t1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    copy.rename(tmp_path / "moved")
    copy.symlink_to(elsewhere)
    with pytest.raises(ac.CheckpointError, match=r"a link in the local copy of .*not writing through it"):
        ac.load_checkpoint(make_setup(seed=2).engine, f"{object_bucket}/ds", tag="t1")
    assert list(elsewhere.iterdir()) == []


def test_a_download_leaves_a_users_folder_of_its_temporary_name_alone(object_bucket, tmp_path, make_model, tokenizer):
    saver = ac.Saver(
        ac.SaverConfig(
            experiment_name="exp",
            trial_name="trial",
            fileroot=f"{object_bucket}/runs",
            user="tester",
            staging_dir=str(tmp_path / "staging"),
        ),
        SPEC,
    )
    saver.save(ac.TorchEngine(make_model()), 0, 1, 1, tokenizer=tokenizer, force=True)
    saver.finalize()
    mine = tmp_path / "download.partial"  # the user's own folder, named as the old temporary name
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (tmp_path / "linked.partial").symlink_to(tmp_path / "elsewhere")
    for destination in (tmp_path / "download", tmp_path / "linked"):
        assert download_export(f"{object_bucket}/{TRIAL}/default", destination) == destination
        assert (destination / "config.json").is_file()
    assert (mine / "notes.txt").read_text() == "keep me" and not (tmp_path / "elsewhere").exists()
    assert not list(tmp_path.glob(".download.partial-*"))  # its own temporary folder is gone


def test_the_default_staging_folder_is_private_ours_and_never_a_link(object_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    base = tmp_path / "tmp" / f"areal_ckpt-staging-{os.getuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    base.symlink_to(elsewhere)  # planted under the predictable name
    with pytest.raises(ac.CheckpointError, match=r"staging-\d+: a symbolic link .*move it away, or set staging_dir"):
        ac.RecoverHandler(s3_config(object_bucket, None), SPEC)
    assert list(elsewhere.iterdir()) == []
    base.unlink()  # the hint followed: moved away
    base.mkdir(mode=0o755)  # as an older version left it
    os.chmod(base, 0o755)
    handler = ac.RecoverHandler(s3_config(object_bucket, None), SPEC)
    handler.dump(make_setup().engine, step_info(0), force=True)
    handler.close()
    assert stat.S_IMODE(base.stat().st_mode) == 0o700 and any(base.rglob("gen-*"))  # private, used


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user owns needs root")
def test_a_default_staging_folder_another_user_owns_is_refused(object_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    base = tmp_path / "tmp" / f"areal_ckpt-staging-{os.getuid()}"
    base.mkdir()
    os.chown(base, 65534, -1)  # another user's folder under that name
    with pytest.raises(ac.CheckpointError, match=r"owned by uid 65534, not by this user .*move it away"):
        ac.RecoverHandler(s3_config(object_bucket, None), SPEC)
    base.rmdir()  # the hint followed: moved away
    ac.RecoverHandler(s3_config(object_bucket, None), SPEC).close()
    assert base.is_dir() and base.stat().st_uid == os.getuid()


def test_two_jobs_exporting_one_trial_never_share_a_folder_and_the_later_commit_is_refused(
    object_bucket, tmp_path, make_model
):
    series = [ObjectLocation(parse_object_url(f"{object_bucket}/race", "t"), writer=w) for w in ("a", "b")]
    assert [one.reserve("step1") for one in series] == ["step1", "step1.1"]  # both listed an empty prefix first
    first, second = (s3_saver(object_bucket, tmp_path / job) for job in ("a", "b"))  # two jobs, two staging_dirs
    models = {"a": make_model(seed=1), "b": make_model(seed=2)}
    url = first.save(ac.TorchEngine(models["a"]), 0, 1, 1, force=True)
    with pytest.raises(
        ac.CommitError,
        match=r"globalstep1 was committed by another job after this one started.*"
        r"make this Saver again",
    ):
        second.save(ac.TorchEngine(models["b"]), 0, 1, 1, force=True)
    second.finalize()
    assert len(keys_under(object_bucket, f"{TRIAL}/default/.commits/")) == 1  # nothing of the refused export
    assert first.save(ac.TorchEngine(models["a"]), 0, 2, 2, force=True).endswith("globalstep2")  # the first goes on
    first.finalize()
    assert_export_holds(url, models["a"], tmp_path / "first")
    again = s3_saver(object_bucket, tmp_path / "b")  # the hint: the Saver made again continues the series
    later = again.save(ac.TorchEngine(models["b"]), 0, 1, 1, force=True)
    again.finalize()
    assert later == url + ".1"
    assert_export_holds(later, models["b"], tmp_path / "second")
    assert_export_holds(url, models["a"], tmp_path / "first-again")


def test_a_saver_made_while_another_job_exports_leaves_its_uploads_alone(
    object_bucket, tmp_path, make_model, monkeypatch
):
    model = make_model(seed=3)
    saver = s3_saver(object_bucket, tmp_path / "a")
    real_upload_rest = series_module.upload_rest

    def another_saver_starts(*args, **kwargs):  # the shards are up, the commit not yet written
        s3_saver(object_bucket, tmp_path / "b").finalize()
        real_upload_rest(*args, **kwargs)

    monkeypatch.setattr(series_module, "upload_rest", another_saver_starts)
    url = saver.save(ac.TorchEngine(model), 0, 1, 1, force=True)
    assert_export_holds(url, model, tmp_path / "kept")  # the returned URL is whole
    monkeypatch.setattr(commits, "CLAIM_SECONDS", 0.0)  # as if the writer had been silent for an hour
    with pytest.raises(ac.CheckpointError, match=r"globalstep2: not committed, its objects went missing meanwhile"):
        saver.save(ac.TorchEngine(model), 0, 2, 2, force=True)  # never a URL that cannot be downloaded
    saver.finalize()
    assert len(keys_under(object_bucket, f"{TRIAL}/default/.commits/")) == 1


def assert_export_holds(url: str, model, folder) -> None:
    tensors = read_export_tensors(download_export(url, folder))
    assert tensors.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensors[name], tensor), name
