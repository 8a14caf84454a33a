"""`areal-ckpt` on object storage, on every store (SeaweedFS, fake-gcs-server, Azurite on 127.0.0.1): list, verify (objects read
where they lie), inspect, export from and to a bucket, convert-deepspeed to a bucket and
recover-pointer, on checkpoints the Saver and RecoverHandler committed there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import saver_config
from object_helpers import keys_under, read_object, write_object
from recover_fixtures import SPEC, make_setup, step_info, train_step
from test_object_recover import s3_config
from transformers import AutoModelForCausalLM

import areal_ckpt as ac
from areal_ckpt.cli.main import main
from areal_ckpt.export.download import download_export

TRIAL = "runs/checkpoints/tester/exp/trial"
EXPORT = f"{TRIAL}/default/epoch0epochstep1globalstep1"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def object_trial(object_server, object_bucket, tmp_path, tokenizer):
    """A trial on the bucket: two exports (steps 0 and 1) and a recovery checkpoint (step 1)."""
    setup = make_setup(tie_word_embeddings=True)
    saver = ac.Saver(
        saver_config(f"{object_bucket}/runs", staging_dir=str(tmp_path / "stage-saver"), freq_steps=1), SPEC
    )
    handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "stage-recover"), SPEC)
    for step in range(2):
        train_step(setup, step)
        saver.save(setup.engine, 0, step, step, tokenizer=tokenizer)
    handler.dump(setup.engine, step_info(1), tokenizer=tokenizer, force=True)
    saver.finalize()
    handler.close()
    return f"{object_bucket}/{TRIAL}", setup


def objects(bucket_url: str, prefix: str) -> dict[str, bytes]:
    return {key: read_object(bucket_url, key) for key in keys_under(bucket_url, prefix)}


def test_list_inspect_and_verify_read_a_trial_on_the_bucket(object_trial, object_bucket, capsys):
    trial, setup = object_trial
    code, stdout, _ = run(capsys, "list", trial, "--json")
    entries = json.loads(stdout)
    assert code == 0 and [(e["kind"], e["global_step"]) for e in entries] == [
        ("recover", 1),
        ("export", 1),
        ("export", 0),
    ]
    assert entries[1]["path"] == f"{object_bucket}/{EXPORT}" and entries[1]["name"] == "default"
    assert entries[0]["name"] == "default" and entries[0]["bytes"] > entries[1]["bytes"] > 0  # with optimizer state
    assert run(capsys, "list", trial)[0] == 0

    code, stdout, _ = run(capsys, "verify", trial)
    assert code == 0 and stdout.count("OK ") == 3 and f"OK   {object_bucket}/{EXPORT}:" in stdout

    code, stdout, _ = run(capsys, "inspect", trial, "--json")
    facts = json.loads(stdout)
    assert code == 0 and facts["kind"] == "recover" and facts["complete"] and facts["step"]["global_step"] == 1
    assert facts["path"].startswith(f"{trial}/.recover/gen-") and facts["models"]["default"]["optimizer"] is True
    assert facts["models"]["default"]["parameters"] == sum(t.numel() for t in setup.model.state_dict().values())
    facts = json.loads(run(capsys, "inspect", f"{object_bucket}/{EXPORT}", "--json")[1])
    assert facts["kind"] == "export" and facts["complete"] and facts["path"] == f"{object_bucket}/{EXPORT}"
    assert facts["parameters"] == sum(p.numel() for p in setup.model.parameters())


def test_verify_names_each_damaged_object_by_url(object_server, object_trial, object_bucket, capsys):
    trial, _ = object_trial
    stored = objects(object_bucket, f"{EXPORT}/")
    shards = sorted(key for key in stored if key.endswith(".safetensors"))
    flipped = bytearray(stored[shards[0]])
    flipped[-1] ^= 0xFF
    write_object(object_bucket, shards[0], bytes(flipped))  # same size, other bytes
    write_object(object_bucket, f"{EXPORT}/extra.bin", b"added later")
    code, stdout, err = run(capsys, "verify", trial)
    assert code == 1 and "1 of 3 checkpoint(s) damaged" in err
    assert f"{object_bucket}/{shards[0]}: checksum mismatch" in stdout
    assert f"{object_bucket}/{EXPORT}/extra.bin: not listed in the manifest" in stdout

    write_object(object_bucket, shards[0], stored[shards[0]][:-5])
    code, stdout, _ = run(capsys, "verify", f"{object_bucket}/{EXPORT}")
    assert code == 1 and f"{object_bucket}/{shards[0]}: size" in stdout and "truncated or replaced" in stdout

    code, _, err = run(capsys, "verify", f"{object_bucket}/nothing/here")
    assert code == 2 and f"{object_bucket}/nothing/here: no committed checkpoint there" in err
    assert "hint: `areal-ckpt verify PATH`" in err


def test_export_from_the_bucket_to_the_bucket_loads_with_from_pretrained(object_trial, object_bucket, tmp_path, capsys):
    trial, setup = object_trial
    out = f"{object_bucket}/exports/default"
    code, stdout, _ = run(capsys, "export", trial, out, "--max-shard-size", "60KB")
    assert code == 0 and stdout.rstrip().endswith(f"to {out}")
    local = download_export(out, tmp_path / "download")
    loaded = AutoModelForCausalLM.from_pretrained(local, local_files_only=True)
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert run(capsys, "verify", out)[0] == 0

    code, _, err = run(capsys, "export", trial, out)
    assert code == 2 and f"{out}: already holds objects; choose a new output prefix" in err
    assert "hint:" not in err  # the error names its own way out
    assert run(capsys, "export", trial, f"{object_bucket}/exports/second")[0] == 0  # the hint followed

    code, _, _ = run(capsys, "export", trial, str(tmp_path / "local-out"))  # to a local folder too
    assert code == 0 and (tmp_path / "local-out" / "config.json").is_file()


def test_convert_deepspeed_writes_to_the_bucket(object_bucket, tmp_path, capsys):
    setup = make_setup()
    train_step(setup, 0)
    ac.save_checkpoint(setup.engine, tmp_path / "ds", tag="step1")
    out = f"{object_bucket}/converted/model"
    code, _, _ = run(capsys, "convert-deepspeed", str(tmp_path / "ds"), out)
    assert code == 0
    loaded = AutoModelForCausalLM.from_pretrained(download_export(out, tmp_path / "download"), local_files_only=True)
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def _two_dumps(object_bucket: str, tmp_path: Path) -> dict[str, bytes]:
    """Two dumps of a trial on the bucket; the objects of the first, which the second's
    retention deleted."""
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk"), SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    first = objects(object_bucket, f"{TRIAL}/.recover/gen-")
    train_step(setup, 1)
    handler.dump(setup.engine, step_info(1), force=True)  # deletes the first generation after its commit
    handler.close()
    return first


def test_recover_pointer_commits_the_newest_intact_generation(object_server, object_bucket, tmp_path, capsys):
    trial = f"{object_bucket}/{TRIAL}"
    first = _two_dumps(object_bucket, tmp_path)
    code, stdout, _ = run(capsys, "recover-pointer", trial)
    assert code == 0 and "which is intact; nothing changed" in stdout

    for key, data in first.items():  # the first generation is back, uncommitted; the second is damaged
        write_object(object_bucket, key, data)
    second = sorted(k for k in objects(object_bucket, f"{TRIAL}/.recover/gen-") if k not in first)
    damaged = next(k for k in second if k.endswith(".distcp"))
    write_object(object_bucket, damaged, b"torn")
    assert run(capsys, "verify", trial)[0] == 1
    code, stdout, _ = run(capsys, "recover-pointer", trial)
    generation = next(iter(first)).removeprefix(f"{TRIAL}/.recover/").split("/")[0]
    assert (
        code == 0
        and f"OK   {trial} -> {generation}: every file matches" in stdout
        and f"{object_bucket}/{damaged}" in stdout
    )

    resumed = make_setup(seed=3)
    info = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "other-disk"), SPEC).load(resumed.engine)
    assert info is not None and info.last_step_info.global_step == 0


def test_recover_pointer_without_an_intact_generation_changes_nothing(object_server, object_bucket, tmp_path, capsys):
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk"), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    records = objects(object_bucket, f"{TRIAL}/.recover/.commits/")
    data = next(k for k in objects(object_bucket, f"{TRIAL}/.recover/gen-") if k.endswith(".distcp"))
    write_object(object_bucket, data, b"torn")
    code, _, err = run(capsys, "recover-pointer", f"{object_bucket}/{TRIAL}")
    assert code == 2 and "no intact recovery generation to point at" in err and f"{object_bucket}/{data}" in err
    assert objects(object_bucket, f"{TRIAL}/.recover/.commits/") == records


def test_a_url_where_only_a_local_path_is_read_is_refused(s3_bucket, tmp_path, capsys):
    code, _, err = run(capsys, "import-areal", f"{s3_bucket}/{TRIAL}")
    assert code == 2 and "is a s3:// URL: object storage is not supported here yet" in err
    code, _, err = run(capsys, "list", "hdfs://bucket/trial")
    assert code == 2 and "is a hdfs:// URL; object storage is reached through s3://" in err
    assert not Path("hdfs:").exists()


def test_recover_pointer_repairs_a_garbage_newest_record_keeping_it_aside(object_bucket, tmp_path, capsys, caplog):
    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "disk"), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    (record,) = objects(object_bucket, f"{TRIAL}/.recover/.commits/")
    write_object(object_bucket, record, b"{not a record")
    with pytest.raises(ac.CheckpointError, match="not a commit record"):
        ac.RecoverHandler(s3_config(object_bucket, tmp_path / "fresh"), SPEC).load(make_setup(seed=1).engine)
    code, stdout, _ = run(capsys, "recover-pointer", f"{object_bucket}/{TRIAL}")
    aside = f"{TRIAL}/.recover/.commits-set-aside/000000000001.json"
    assert code == 0 and f"moved out of the log to {object_bucket}/{aside}" in stdout and "OK " in stdout
    assert read_object(object_bucket, aside) == b"{not a record"  # kept, not deleted
    resumed = make_setup(seed=2)
    loader = ac.RecoverHandler(s3_config(object_bucket, tmp_path / "after"), SPEC)
    assert loader.load(resumed.engine).last_step_info.global_step == 0
    loader.dump(resumed.engine, step_info(1), force=True)  # later dumps commit and tidy without a word
    loader.close()
    assert "not deleted yet" not in caplog.text and read_object(object_bucket, aside) == b"{not a record"


def test_export_reads_again_when_the_job_supersedes_the_generation_it_reads(persistent_root, tmp_path, capsys):
    import areal_ckpt.tools.convert as convert
    import areal_ckpt.tools.object_place as object_place

    setup = make_setup()
    handler = ac.RecoverHandler(s3_config(persistent_root.root, tmp_path / "stage"), SPEC)
    train_step(setup, 0)
    handler.dump(setup.engine, step_info(0), force=True)
    trial = f"{persistent_root.root}/{TRIAL}"
    steps = iter(range(1, 100))

    def the_job_dumps_meanwhile(real):  # the job's next dump lands while `export` reads
        def reading(*args, **kwargs):
            step = next(steps)
            train_step(setup, step)
            handler.dump(setup.engine, step_info(step), force=True)
            return real(*args, **kwargs)

        return reading

    hooked = (convert, "check_files") if persistent_root.kind == "posix" else (object_place, "fetch_folder")
    real = getattr(*hooked)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(*hooked, the_job_dumps_meanwhile(real))
        code, _, err = run(capsys, "export", trial, str(tmp_path / "busy"))
    assert code == 2 and "was superseded by" in err and "3 times in a row" in err and "run again" in err
    assert not (tmp_path / "busy").exists()
    with pytest.MonkeyPatch.context() as patch:
        once = iter([the_job_dumps_meanwhile(real)])
        patch.setattr(*hooked, lambda *a, **k: next(once, real)(*a, **k))  # one dump during the first read
        code, _, err = run(capsys, "export", trial, str(tmp_path / "once"))
    assert code == 0, err
    code, _, err = run(capsys, "export", trial, str(tmp_path / "again"))  # the hint: run again
    handler.close()
    assert code == 0, err
    for folder in ("once", "again"):
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / folder, local_files_only=True)
        for name, tensor in setup.model.state_dict().items():
            assert torch.equal(exported.state_dict()[name], tensor), (folder, name)


def test_recover_pointer_on_a_bucket_skips_a_resigned_manifest_as_the_folder_repair_does(
    object_server, object_bucket, tmp_path, capsys
):
    """A manifest re-signed to name a model outside the trial verifies object by object; the
    repair also checks what a load needs it to list (as a folder's does) and skips it."""
    from areal_ckpt.publish import render_manifest

    first = _two_dumps(object_bucket, tmp_path)
    for key, data in first.items():  # the first generation is back, uncommitted
        write_object(object_bucket, key, data)
    (manifest_key,) = [
        k for k in objects(object_bucket, f"{TRIAL}/.recover/gen-") if k not in first and k.endswith("manifest.json")
    ]
    manifest = json.loads(read_object(object_bucket, manifest_key))
    manifest["models"] = ["../elsewhere"]
    write_object(object_bucket, manifest_key, render_manifest(manifest))
    code, stdout, _ = run(capsys, "recover-pointer", f"{object_bucket}/{TRIAL}")
    generation = next(iter(first)).removeprefix(f"{TRIAL}/.recover/").split("/")[0]
    assert code == 0 and "model name '../elsewhere' cannot be used as a folder name" in stdout, stdout
    assert f"-> {generation}: every file matches" in stdout
