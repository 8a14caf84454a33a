"""`areal-ckpt`: inspect, verify, list, export, errors and --help, on real checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import read_export_tensors, saver_config
from recover_fixtures import SPEC, make_setup, recover_config, step_info, train_step, trial_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

import areal_ckpt as ac
from areal_ckpt.cli.main import main


@pytest.fixture
def trial(fileroot, tokenizer):
    """A trial with two exports and a recovery checkpoint of a model with tied embeddings."""
    setup = make_setup(tie_word_embeddings=True)
    saver = ac.Saver(saver_config(fileroot, freq_steps=1), SPEC)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    for step in range(2):
        train_step(setup, step)
        saver.save(setup.engine, 0, step, step, tokenizer=tokenizer)
    handler.dump(setup.engine, step_info(1), tokenizer=tokenizer, force=True)
    return trial_dir(fileroot), setup


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("target", ["trial", "recover_info", "default/recover_checkpoint"])
def test_export_turns_a_recovery_checkpoint_into_a_loadable_hf_folder(trial, tmp_path, capsys, tokenizer, target):
    root, setup = trial
    path = root if target == "trial" else root / target
    out = tmp_path / "exported"
    code, stdout, _ = run(capsys, "export", str(path), str(out), "--dtype", "bfloat16", "--max-shard-size", "60KB")
    assert code == 0 and "exported" in stdout
    assert (out / "model.safetensors.index.json").is_file()
    stored = read_export_tensors(out)
    assert "lm_head.weight" not in stored  # tied, as save_pretrained writes it
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert loaded.dtype == torch.bfloat16
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).encode("12+7") == tokenizer.encode("12+7")
    code, _, err = run(capsys, "export", str(path), str(out))
    assert code == 2 and "already exists" in err and "hint:" not in err  # its own way out, no generic hint


def test_inspect_reports_kind_step_sizes_and_dtypes(trial, capsys):
    root, setup = trial
    code, stdout, _ = run(capsys, "inspect", str(root), "--json")
    facts = json.loads(stdout)
    assert code == 0 and facts["kind"] == "recover" and facts["complete"]
    assert facts["step"]["global_step"] == 1 and facts["world_size"] == 1
    assert facts["models"]["default"]["parameters"] == sum(t.numel() for t in setup.model.state_dict().values())
    assert facts["models"]["default"]["optimizer"] is True

    export = root / "default/epoch0epochstep1globalstep1"
    code, stdout, _ = run(capsys, "inspect", str(export))
    assert code == 0 and "kind        export" in stdout and "complete    yes" in stdout
    facts = json.loads(run(capsys, "inspect", str(export), "--json")[1])
    assert facts["parameters"] == sum(p.numel() for p in setup.model.parameters())
    assert facts["dtypes"] == {"F32": facts["parameters"]}


def test_verify_names_every_bad_file_and_sets_the_exit_code(trial, capsys):
    root, _ = trial
    export = root / "default/epoch0epochstep1globalstep1"
    assert run(capsys, "verify", str(export))[0] == 0
    assert run(capsys, "verify", str(root))[0] == 0
    shard = export / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    (export / "pytorch_model.bin").write_bytes(b"added later")
    code, stdout, err = run(capsys, "verify", str(export))
    assert code == 1
    assert f"{shard}: checksum mismatch" in stdout
    assert "pytorch_model.bin: not listed in the manifest" in stdout
    assert "1 of 1 checkpoint(s) damaged" in err
    # the whole trial: every export and the recovery checkpoint, one line each
    code, stdout, err = run(capsys, "verify", str(root))
    lines = stdout.splitlines()
    assert code == 1 and len(lines) == 3 and "1 of 3 checkpoint(s) damaged" in err
    assert lines[0] == f"OK   {root / 'default/epoch0epochstep0globalstep0'}: every file matches its manifest"
    assert lines[1].startswith(f"BAD  {export}: ") and "checksum mismatch" in lines[1]
    generation = (root / ".recover/current").readlink()  # the generation its commit record names, as on a bucket
    assert lines[2] == f"OK   {root / '.recover' / generation}: every file matches its manifest"
    rank_file = root / "recover_info/rank0.json"
    rank_file.write_text(rank_file.read_text()[:-5])
    code, stdout, _ = run(capsys, "verify", str(root / "recover_info"))
    assert code == 1 and "rank0.json: size" in stdout


def test_list_shows_exports_and_the_recovery_checkpoint_newest_first(trial, capsys):
    root, _ = trial
    entries = json.loads(run(capsys, "list", str(root), "--json")[1])
    assert [(e["kind"], e["global_step"]) for e in entries] == [("recover", 1), ("export", 1), ("export", 0)]
    code, stdout, _ = run(capsys, "list", str(root))
    assert code == 0 and stdout.splitlines()[0].split()[:3] == ["kind", "model", "global"]


def test_errors_are_one_line_with_a_hint(tmp_path, capsys):
    code, stdout, err = run(capsys, "inspect", str(tmp_path / "missing"))
    assert code == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert lines[0] == f"areal-ckpt inspect: error: {tmp_path / 'missing'}: not a folder"
    assert lines[1].startswith("hint:")
    code, _, err = run(capsys, "export", str(tmp_path), str(tmp_path / "out"))
    assert code == 2 and "not a recovery checkpoint" in err


@pytest.mark.parametrize("command", [[], ["inspect"], ["verify"], ["list"], ["export"]])
def test_help_on_every_command(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    shown = capsys.readouterr().out
    assert exited.value.code == 0 and "usage: areal-ckpt" in shown
    assert ":mod:" not in shown and "areal_ckpt.cli" not in shown  # for users, not the module's developers
    if command in ([], ["inspect"], ["verify"], ["list"]):  # every store is named, not S3's alone
        assert "gs://" in " ".join(shown.split()) and "az://" in " ".join(shown.split())


def test_console_script_and_module_entry_points(trial):
    root, _ = trial
    script = Path(sys.executable).with_name("areal-ckpt")
    for command in ([str(script)], [sys.executable, "-m", "areal_ckpt"]):
        done = subprocess.run([*command, "verify", str(root)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.startswith("OK"), done.stderr


@pytest.mark.parametrize(
    "command", ["verify", "list", "inspect", "import-areal", "recover-pointer", "export", "convert-deepspeed"]
)
@pytest.mark.parametrize("given", ["missing", "a plain file"])
def test_a_path_that_is_no_folder_is_a_wrong_argument_exit_2_with_a_hint_that_is_not_the_command_again(
    trial, tmp_path, capsys, command, given
):
    # verify used to say "1 of 1 checkpoint(s) damaged" (exit 1); import-areal and recover-pointer
    # "cannot create the trial lock: File exists"; the hint sent the user back to the same command
    path = tmp_path / "elsewhere"
    if given == "a plain file":
        path.write_text("not a trial")
    outputs = [str(tmp_path / "out")] if command in ("export", "convert-deepspeed") else []
    code, stdout, err = run(capsys, command, str(path), *outputs)
    assert code == 2 and stdout == ""
    assert err.splitlines()[0] == f"areal-ckpt {command}: error: {path}: not a folder"
    assert (
        err.splitlines()[1].startswith("hint: give an existing folder (a trial,") and command not in err.splitlines()[1]
    )
    root, _ = trial
    if command in ("verify", "list", "inspect"):  # the hint followed: the trial's folder
        assert run(capsys, command, str(root))[0] == 0


@pytest.mark.parametrize("command", ["verify", "export", "convert-deepspeed"])
def test_a_wrong_path_is_refused_before_torch_is_imported(tmp_path, command):
    # bad arguments used to take 3-8 s to be refused: torch and the engines were imported first
    outputs = [str(tmp_path / "out")] if command != "verify" else []
    probe = (
        "import sys; from areal_ckpt.cli.main import main; "
        f"code = main({[command, str(tmp_path / 'missing'), *outputs]!r}); "
        "print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "not a folder" in done.stderr


@pytest.mark.parametrize("command", ["list", "inspect", "verify"])
def test_list_inspect_and_verify_of_a_local_trial_import_neither_torch_nor_transformers(trial, command):
    # they took 2.3-2.6 s, almost all of it torch's import; now a fraction of a second
    root, _ = trial
    probe = (
        "import sys; from areal_ckpt.cli.main import main; "
        f"code = main({[command, str(root)]!r}); "
        "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split()[-3:] == ["0", "False", "False"], done.stderr
    assert str(root) in done.stdout  # it did read the trial


def test_list_of_a_trial_areal_wrote_names_the_import(fileroot, capsys):
    from areal_trials import IN_PLACE, write_areal_trial

    areal = write_areal_trial(trial_dir(fileroot), IN_PLACE, {"default": make_setup()})
    code, stdout, _ = run(capsys, "list", str(areal.path))
    assert code == 0 and "but AReaL's own recovery checkpoint (" in stdout
    assert f"`areal-ckpt import-areal {areal.path}` makes it one a job resumes from" in stdout
    assert run(capsys, "import-areal", str(areal.path))[0] == 0  # the hint followed
    assert json.loads(run(capsys, "list", str(areal.path), "--json")[1])[0]["kind"] == "recover"
