"""Object storage URLs are refused loudly wherever a path goes (until object storage lands),
never taken for a local folder named ``s3:``."""

from __future__ import annotations

import os

import pytest
from recover_fixtures import SPEC

import areal_ckpt as ac
from areal_ckpt.tools.cli import main as cli_main

URL = "s3://ckpt/runs"
REFUSAL = r"is a s3:// URL: checkpoints on object storage are not supported yet"


@pytest.fixture
def in_tmp(tmp_path):
    before = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(before)
    assert not (tmp_path / "s3:").exists()  # nothing became a local folder


def test_a_url_fileroot_is_a_config_error_naming_it(in_tmp):
    for block in (ac.SaverConfig, ac.RecoverConfig):  # pydantic's ValidationError (a ValueError) names the field
        with pytest.raises(ValueError, match=r"fileroot\n.*fileroot 's3://ckpt/runs' is a s3:// URL"):
            block(experiment_name="e", trial_name="t", fileroot=URL)
    (in_tmp / "job.yaml").write_text(f"experiment_name: e\ntrial_name: t\nfileroot: {URL}\nsaver:\n  freq_steps: 1\n")
    with pytest.raises(ac.ConfigError, match=r"job.yaml.*fileroot"):
        ac.load_config(in_tmp / "job.yaml")
    with pytest.raises(ValueError, match=REFUSAL):
        ac.Saver.get_save_root("e", "t", URL)


def test_save_and_load_checkpoint_refuse_a_url(in_tmp, make_model):
    engine = ac.TorchEngine(make_model())
    with pytest.raises(ac.CheckpointError, match=rf"save_checkpoint: save_dir '{URL}' {REFUSAL}"):
        ac.save_checkpoint(engine, URL, tag="t")
    with pytest.raises(ac.CheckpointError, match=rf"load_checkpoint: load_dir '{URL}' {REFUSAL}"):
        ac.load_checkpoint(engine, URL, tag="t")


@pytest.mark.parametrize(
    "argv",
    [["list", URL], ["verify", URL], ["inspect", URL], ["export", URL, "out"], ["export", "x", URL]],
)
def test_the_cli_refuses_a_url_argument(in_tmp, capsys, argv):
    assert cli_main(argv) == 2
    assert "is a s3:// URL: checkpoints on object storage are not supported yet" in capsys.readouterr().err


def test_a_scheme_is_named_whatever_it_is(in_tmp):
    with pytest.raises(ValueError, match=r"is a gs:// URL"):
        ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot="gs://bucket", mode="on")
    assert (
        ac.RecoverHandler(
            ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot=str(in_tmp / "local:colon"), mode="on"), SPEC
        ).load(ac.TorchEngine(__import__("torch").nn.Linear(1, 1)))
        is None
    )  # a colon alone is a path
