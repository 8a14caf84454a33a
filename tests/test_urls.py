"""Object storage URLs: ``fileroot: s3://...`` is taken by both blocks (tests/test_s3_*.py);
wherever else a path goes a URL is refused loudly, never taken for a local folder named ``s3:``."""

from __future__ import annotations

import os

import pytest
from recover_fixtures import SPEC

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main

URL = "s3://ckpt/runs"
REFUSAL = r"is a s3:// URL: object storage is not supported here yet \(a fileroot is: docs/storage.md\)"


@pytest.fixture
def in_tmp(tmp_path):
    before = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(before)
    assert not (tmp_path / "s3:").exists()  # nothing became a local folder


def test_the_recover_checkpoint_link_helper_refuses_a_url(in_tmp):
    # object storage holds no links: AReaL's recover_checkpoint path has no meaning there
    with pytest.raises(ac.ConfigError, match=rf"fileroot '{URL}' {REFUSAL}"):
        ac.Saver.get_recover_checkpoint_path("e", "t", URL)
    with pytest.raises(ac.ConfigError, match=REFUSAL):
        ac.RecoverHandler.recover_info_path("e", "t", URL)


def test_areal_path_helpers_give_urls_for_a_url_fileroot():
    user = ac.Saver.get_save_root("e", "t", "/x").split("/")[-3]
    assert ac.Saver.get_save_root("e", "t", URL) == f"{URL}/checkpoints/{user}/e/t"
    assert ac.Saver.get_model_save_path("e", "t", URL, 1, 2, 3, "actor") == (
        f"{URL}/checkpoints/{user}/e/t/actor/epoch1epochstep2globalstep3"
    )


def test_save_and_load_checkpoint_refuse_an_unsupported_scheme(in_tmp, make_model):
    engine = ac.TorchEngine(make_model())
    with pytest.raises(
        ac.CheckpointError, match=r"save_checkpoint: save_dir 'hdfs://ckpt/ds' is a hdfs:// URL; object"
    ):
        ac.save_checkpoint(engine, "hdfs://ckpt/ds", tag="t")
    with pytest.raises(
        ac.CheckpointError, match=r"load_checkpoint: load_dir 'hdfs://ckpt/ds' is a hdfs:// URL; object"
    ):
        ac.load_checkpoint(engine, "hdfs://ckpt/ds", tag="t")
    assert not (in_tmp / "hdfs:").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["import-areal", URL],
        ["export", "x", "out", "--config-from", URL],
        ["convert-deepspeed", "x", "out", "--config", URL],
    ],
)
def test_the_cli_refuses_a_url_where_it_reads_only_local_folders(in_tmp, capsys, argv):
    assert cli_main(argv) == 2
    assert "is a s3:// URL: object storage is not supported here yet" in capsys.readouterr().err


def test_a_scheme_is_named_whatever_it_is(in_tmp):
    with pytest.raises(ValueError, match=r"is a hdfs:// URL; object storage is reached through s3://"):
        ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot="hdfs://bucket", mode="on")
    assert (
        ac.RecoverHandler(
            ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot=str(in_tmp / "local:colon"), mode="on"), SPEC
        ).load(ac.TorchEngine(__import__("torch").nn.Linear(1, 1)))
        is None
    )  # a colon alone is a path


@pytest.mark.parametrize(
    ("value", "cause"),
    [
        ("s3:/bkt/x", r"'s3:/bkt/x' is not a valid s3:// URL; write s3://bucket/prefix"),
        ("s3:bkt/x", r"'s3:bkt/x' is not a valid s3:// URL; write s3://bucket/prefix"),
        ("GS:/bkt/x", r"'GS:/bkt/x' is not a valid gs:// URL; write gs://bucket/prefix"),
        (" s3://bkt/x", r"' s3://bkt/x' is a URL with spaces around it"),
        ("gs://", r"'gs://': the bucket name is missing"),
        ("gs:///x", r"'gs:///x': the bucket name is missing"),
        ("az://Upper/x", r"'az://Upper/x': 'Upper' is not a valid bucket name \(3-63 of a-z, 0-9, '-', no '--'\)"),
        ("az://a--b/x", r"'az://a--b/x': 'a--b' is not a valid bucket name"),
        ("ftp://host/x", r"'ftp://host/x' is a ftp:// URL; object storage is reached through s3://"),
    ],
)
def test_a_malformed_or_unknown_url_is_a_config_error_naming_it_never_a_local_folder(in_tmp, capsys, value, cause):
    block = f"  experiment_name: e\n  trial_name: t\n  fileroot: {value!r}\n"
    (in_tmp / "job.yaml").write_text(f"saver:\n{block}recover:\n{block}")
    with pytest.raises(ac.ConfigError, match=rf"job.yaml: invalid configuration: saver.fileroot: .*{cause}"):
        ac.load_config(in_tmp / "job.yaml")
    (in_tmp / "job.yaml").unlink()
    with pytest.raises(ValueError, match=cause):
        ac.SaverConfig(experiment_name="e", trial_name="t", fileroot=value)
    assert cli_main(["list", value]) == 2
    assert "error:" in capsys.readouterr().err
    assert not list(in_tmp.iterdir())  # no folder named s3: (or anything else) appeared


def test_save_checkpoint_names_a_url_missing_its_slashes(in_tmp, make_model):
    engine = ac.TorchEngine(make_model())
    with pytest.raises(ac.CheckpointError, match=r"save_dir: 's3:/ckpt/ds' is not a valid s3:// URL"):
        ac.save_checkpoint(engine, "s3:/ckpt/ds", tag="t")
    assert not (in_tmp / "s3:").exists()
