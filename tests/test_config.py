"""load_config: AReaL-style blocks, interpolation, overrides, and one clear error per bad input."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
from recover_fixtures import SPEC

import areal_ckpt as ac

AREAL_STYLE = """
experiment_name: grpo-gsm8k
trial_name: run1
cluster:
  fileroot: /tmp/areal/experiments
  n_nodes: 1
actor:
  path: ${experiment_name}/actor   # unrelated keys are left alone
saver:
  experiment_name: ${experiment_name}
  trial_name: ${trial_name}
  fileroot: ${cluster.fileroot}
  freq_epochs: 1
  freq_steps: null
  freq_secs: 600
recover:
  mode: auto
  freq_steps: 20
  retries: 2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_areal_style_blocks_with_interpolation_and_inheritance(tmp_path):
    cfg = ac.load_config(write(tmp_path, AREAL_STYLE))
    assert cfg.saver.experiment_name == "grpo-gsm8k"
    assert cfg.saver.fileroot == "/tmp/areal/experiments"
    assert (cfg.saver.freq_epochs, cfg.saver.freq_steps, cfg.saver.freq_secs) == (1, None, 600)
    # recover: names inherited from the top level (fileroot from cluster.fileroot)
    assert cfg.recover.trial_name == "run1"
    assert cfg.recover.fileroot == "/tmp/areal/experiments"
    assert (cfg.recover.mode, cfg.recover.freq_steps, cfg.recover.retries) == ("auto", 20, 2)
    assert cfg.saver.mode == "auto" and cfg.saver.max_shard_size == 5 * 10**9


def test_defaults_when_blocks_are_omitted(tmp_path):
    cfg = ac.load_config(write(tmp_path, "experiment_name: e\ntrial_name: t\nfileroot: /r\n"))
    assert cfg.recover.mode == "disabled" and cfg.recover.retries == 3
    assert cfg.saver.keep_last is None and cfg.saver.export_dtype is None
    assert (cfg.saver.freq_epochs, cfg.saver.freq_steps, cfg.saver.freq_secs) == (None, None, None)


def test_dotted_overrides_are_typed_and_feed_interpolation(tmp_path):
    path = write(tmp_path, AREAL_STYLE)
    cfg = ac.load_config(
        path,
        [
            "saver.freq_steps=10",
            "cluster.fileroot=/data/ckpt",
            "saver.max_shard_size=2MB",
            "recover.no_save_optim=true",
        ],
    )
    assert cfg.saver.freq_steps == 10
    assert cfg.saver.fileroot == "/data/ckpt" and cfg.recover.fileroot == "/data/ckpt"
    assert cfg.saver.max_shard_size == 2 * 10**6
    assert cfg.recover.no_save_optim is True


def test_string_interpolation_inside_a_value(tmp_path):
    text = "experiment_name: e\ntrial_name: t\nfileroot: /r\nsaver:\n  trial_name: ${trial_name}-export\n"
    assert ac.load_config(write(tmp_path, text)).saver.trial_name == "t-export"


@pytest.mark.parametrize("size, expected", [("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), (1000, 1000), ("1.5KB", 1500)])
def test_max_shard_size_units(tmp_path, size, expected):
    cfg = ac.SaverConfig(experiment_name="e", trial_name="t", fileroot="/r", max_shard_size=size)
    assert cfg.max_shard_size == expected


BASE = "experiment_name: e\ntrial_name: t\nfileroot: /r\n"

BAD_CONFIGS = [
    ("unknown key", BASE + "saver:\n  freq_step: 3\n", ["saver.freq_step", "unknown key"]),
    ("negative frequency", BASE + "saver:\n  freq_steps: -1\n", ["saver.freq_steps", "greater than 0"]),
    ("zero frequency", BASE + "recover:\n  freq_secs: 0\n", ["recover.freq_secs", "greater than 0"]),
    ("wrong type", BASE + "saver:\n  freq_epochs: often\n", ["saver.freq_epochs", "integer"]),
    ("bool as int", BASE + "saver:\n  keep_last: true\n", ["saver.keep_last"]),
    ("float frequency", BASE + "saver:\n  freq_steps: 2.5\n", ["saver.freq_steps"]),
    ("bad mode", BASE + "recover:\n  mode: sometimes\n", ["recover.mode"]),
    ("bad dtype", BASE + "saver:\n  export_dtype: int8\n", ["saver.export_dtype"]),
    ("bad shard size", BASE + "saver:\n  max_shard_size: 5 gigs\n", ["saver.max_shard_size", "5 gigs"]),
    ("negative retries", BASE + "recover:\n  retries: -2\n", ["recover.retries"]),
    ("missing names", "saver:\n  freq_steps: 2\n", ["saver.experiment_name", "saver.trial_name", "saver.fileroot"]),
    ("path in a name", "experiment_name: ../escape\ntrial_name: t\nfileroot: /r\n", ["experiment_name", "folder name"]),
    ("block not a mapping", BASE + "saver: 5\n", ["saver", "mapping"]),
    (
        "unresolvable interpolation",
        BASE + "saver:\n  fileroot: ${cluster.fileroot}\n",
        ["saver.fileroot", "cluster.fileroot"],
    ),
    (
        "circular interpolation",
        "experiment_name: ${trial_name}\ntrial_name: ${experiment_name}\nfileroot: /r\n",
        ["circular"],
    ),
    ("resolver syntax", BASE + "saver:\n  user: ${oc.env:USER}\n", ["saver.user", "unsupported"]),
    ("bad yaml", "saver:\n  freq_steps: [1, 2\n", ["invalid YAML", "line"]),
    ("top level not a mapping", "- a\n- b\n", ["top level"]),
    (
        "a typo of a key",
        BASE + "recover:\n  freq_step: 5\n",
        ["recover.freq_step: unknown key; did you mean freq_steps?"],
    ),
    (
        "a typo of another key",
        BASE + "saver:\n  kep_last: 2\n",
        ["saver.kep_last: unknown key; did you mean keep_last?"],
    ),
]


@pytest.mark.parametrize("label, text, fragments", BAD_CONFIGS, ids=[case[0] for case in BAD_CONFIGS])
def test_bad_config_names_file_key_and_problem(tmp_path, label, text, fragments):
    path = write(tmp_path, text)
    with pytest.raises(ac.ConfigError) as caught:
        ac.load_config(path)
    message = str(caught.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, f"{label}: {fragment!r} not in {message!r}"


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ac.ConfigError, match="nope.yaml: config file not found"):
        ac.load_config(missing)


@pytest.mark.parametrize("override", ["saver.freq_steps", "saver..x=1", "=3"])
def test_malformed_override_is_rejected(tmp_path, override):
    with pytest.raises(ac.ConfigError, match="override"):
        ac.load_config(write(tmp_path, BASE), [override])


def test_bad_override_value_is_validated_like_the_file(tmp_path):
    with pytest.raises(ac.ConfigError, match="saver.freq_steps"):
        ac.load_config(write(tmp_path, BASE), ["saver.freq_steps=-5"])


@pytest.mark.parametrize("written, mode", [("on", "on"), ("off", "off"), ("'on'", "on"), ("auto", "auto")])
def test_unquoted_on_and_off_mean_the_modes(tmp_path, written, mode):
    cfg = ac.load_config(write(tmp_path, BASE + f"recover:\n  mode: {written}\n"))
    assert cfg.recover.mode == mode


@pytest.mark.parametrize("mode", ["fault", "resume", "bogus"])
def test_an_invalid_recover_mode_raises_areals_value_error_text(mode):
    """AReaL's own tests match on these words: `Invalid recover mode '<mode>'`, and the note
    that the fault and resume modes were removed."""
    with pytest.raises(ValueError) as refused:
        ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot="/r", mode=mode)
    message = str(refused.value)
    assert f"Invalid recover mode '{mode}'" in message and "fault" in message and "resume" in message


def test_an_invalid_saver_mode_raises_areals_value_error_text():
    with pytest.raises(ValueError, match="Invalid mode 'fast'. Valid options: auto, sync, async"):
        ac.SaverConfig(experiment_name="e", trial_name="t", fileroot="/r", mode="fast")


def test_check_if_recover_takes_areals_parameter_name(fileroot):
    config = ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot=str(fileroot), user="u", mode="on")
    assert ac.check_if_recover(config, _run_id=0) is False


def test_defaults_equal_areals():
    # AReaL's RecoverConfig: mode "disabled", retries 3, no_save_optim / no_load_optim False,
    # no frequency; its SaverConfig: mode "auto".
    recover = ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot="/r")
    assert (recover.mode, recover.retries, recover.no_save_optim, recover.no_load_optim) == (
        "disabled",
        3,
        False,
        False,
    )
    assert (recover.freq_epochs, recover.freq_steps, recover.freq_secs) == (None, None, None)
    assert ac.SaverConfig(experiment_name="e", trial_name="t", fileroot="/r").mode == "auto"


def test_hydra_append_and_force_overrides(tmp_path):
    path = write(tmp_path, BASE + "saver:\n  freq_steps: 3\n")
    cfg = ac.load_config(path, ["+saver.keep_last=2", "++saver.freq_steps=7", "++recover.retries=5"])
    assert (cfg.saver.keep_last, cfg.saver.freq_steps, cfg.recover.retries) == (2, 7, 5)


def test_hydra_append_of_a_set_key_is_refused_and_its_hint_works(tmp_path):
    path = write(tmp_path, BASE + "saver:\n  freq_steps: 3\n")
    with pytest.raises(ac.ConfigError, match=r"saver.freq_steps is already set; use \+\+saver.freq_steps=9") as caught:
        ac.load_config(path, ["+saver.freq_steps=9"])
    hint = str(caught.value).split("use ", 1)[1].split(" ", 1)[0]
    assert ac.load_config(path, [hint]).saver.freq_steps == 9


# AReaL's own config dataclasses, as areal/api/cli_args.py declares their fields and defaults
# (the field lists, not AReaL's code): what an AReaL trainer passes as config.saver / config.recover.
@dataclasses.dataclass
class ArealTimer:
    experiment_name: str = ""
    trial_name: str = ""
    fileroot: str = ""
    freq_epochs: int | None = None
    freq_steps: int | None = None
    freq_secs: int | None = None


@dataclasses.dataclass
class ArealSaverConfig(ArealTimer):
    mode: str = "auto"


@dataclasses.dataclass
class ArealRecoverConfig(ArealTimer):
    mode: str = "disabled"
    retries: int = 3
    no_save_optim: bool = False
    no_load_optim: bool = False


def test_areals_own_config_objects_drive_saver_recover_handler_and_check_if_recover(fileroot, tokenizer):
    from recover_fixtures import SPEC, make_setup, step_info

    names = {"experiment_name": "exp", "trial_name": "trial", "fileroot": str(fileroot)}
    setup = make_setup()
    saver = ac.Saver(ArealSaverConfig(**names, freq_steps=1, mode="sync"), SPEC)
    assert saver.config.keep_last is None and saver.config.mode == "sync"  # ours: our defaults
    assert saver.save(setup.engine, 0, 0, 0, tokenizer=tokenizer)
    saver.finalize()
    recover = ArealRecoverConfig(**names, freq_steps=1, mode="on", no_load_optim=True)
    assert ac.check_if_recover(recover, 0) is False
    handler = ac.RecoverHandler(recover, SPEC)
    assert handler.config.no_load_optim and handler.config.write_retries == 3
    handler.dump(setup.engine, step_info(0))
    handler.close()
    assert ac.check_if_recover(recover, 0) and ac.check_if_auto_recover(recover)
    namespace = types.SimpleNamespace(**names, mode="on", freq_epochs=None, freq_steps=None, freq_secs=None)
    info = ac.RecoverHandler(namespace, SPEC).load(make_setup(seed=1).engine)
    assert info is not None and info.last_step_info.global_step == 0


def test_an_areal_config_object_is_validated_as_strictly_as_yaml(fileroot):
    names = {"experiment_name": "exp", "trial_name": "trial", "fileroot": str(fileroot)}
    with pytest.raises(ValueError, match="Invalid recover mode 'fault'"):
        ac.RecoverHandler(ArealRecoverConfig(**names, mode="fault"), ac.FinetuneSpec(1, 4, 2))
    with pytest.raises(ac.ConfigError, match=r"SaverConfig from a ArealSaverConfig: .*freq_steps"):
        ac.Saver(ArealSaverConfig(**names, freq_steps=0), ac.FinetuneSpec(1, 4, 2))
    with pytest.raises(ac.ConfigError, match="trial_name"):
        ac.Saver(
            ArealSaverConfig(experiment_name="exp", trial_name="../up", fileroot=str(fileroot)),
            ac.FinetuneSpec(1, 4, 2),
        )


def test_a_block_that_never_saves_is_named_in_a_warning_at_construction(fileroot, caplog):
    names = {"experiment_name": "e", "trial_name": "t", "fileroot": str(fileroot)}
    ac.RecoverHandler(ac.RecoverConfig(mode="on", **names), SPEC).close()
    ac.Saver(ac.SaverConfig(**names), SPEC).finalize()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith("recover: none of freq_epochs, freq_steps, freq_secs is set") for m in warned)
    assert any(m.startswith("saver: none of freq_epochs, freq_steps, freq_secs is set") for m in warned)
    caplog.clear()
    ac.RecoverHandler(ac.RecoverConfig(mode="on", freq_steps=2, **names), SPEC).close()  # the hint: set one
    ac.RecoverHandler(ac.RecoverConfig(**names), SPEC).close()  # recovery off: nothing to warn about
    assert not [r for r in caplog.records if "none of freq_epochs" in r.getMessage()]


def test_the_key_a_typo_is_told_about_loads(tmp_path):
    with pytest.raises(ac.ConfigError, match=r"recover.freq_step: unknown key; did you mean freq_steps\?"):
        ac.load_config(write(tmp_path, BASE + "recover:\n  freq_step: 5\n"))
    assert ac.load_config(write(tmp_path, BASE + "recover:\n  freq_steps: 5\n")).recover.freq_steps == 5
