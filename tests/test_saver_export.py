"""Saver: HF folders that from_pretrained loads, sharding, dtype, retention, metrics, state."""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path

import pytest
import torch
from helpers import export_names, manifest, read_export_tensors, saver_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import areal_ckpt as ac

SPEC = ac.FinetuneSpec(total_train_epochs=2, dataset_size=40, train_batch_size=4)


def prompt(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.encode("12+7=19 the answer is")])


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_with_from_pretrained_with_equal_weights_and_logits(fileroot, make_model, tokenizer, tied):
    model = make_model(tie_word_embeddings=tied).eval()
    saver = ac.Saver(saver_config(fileroot), SPEC)
    path = Path(saver.save(ac.TorchEngine(model), 0, 3, 3, tokenizer=tokenizer, force=True))
    assert path == fileroot / "checkpoints/tester/exp/trial/default/epoch0epochstep3globalstep3"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    assert not (path / "model.safetensors.index.json").exists()

    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    reference = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    with torch.no_grad():
        assert torch.equal(loaded(prompt(tokenizer)).logits, model(prompt(tokenizer)).logits)
    stored = read_export_tensors(path)
    assert ("lm_head.weight" in stored) is not tied
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    reloaded_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert reloaded_tokenizer.encode("12+7=19") == tokenizer.encode("12+7=19")


def test_sharded_export_writes_index_and_bounded_files(fileroot, make_model):
    model = make_model()
    saver = ac.Saver(saver_config(fileroot, max_shard_size="40KB"), SPEC)
    path = Path(saver.save(ac.TorchEngine(model), 0, 0, 0, force=True))
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert set(index["weight_map"].values()) == {shard.name for shard in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for shard in shards:
        tensors = load_file(shard)
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 40_000, shard.name
        assert all(index["weight_map"][name] == shard.name for name in tensors)
    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


@pytest.mark.parametrize("dtype_name, dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_export_dtype_converts_weights_and_config(fileroot, make_model, dtype_name, dtype):
    model = make_model()
    saver = ac.Saver(saver_config(fileroot, export_dtype=dtype_name), SPEC)
    path = Path(saver.save(ac.TorchEngine(model), 0, 0, 0, force=True))
    stored = read_export_tensors(path)
    assert {t.dtype for t in stored.values()} == {dtype}
    assert json.loads((path / "config.json").read_text())["dtype"] == dtype_name
    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert loaded.dtype == dtype
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name].to(dtype)), name
    assert model.dtype == torch.float32  # the training model is untouched


def test_manifest_lists_every_file_with_its_size_and_checksum(fileroot, make_model, tokenizer):
    saver = ac.Saver(saver_config(fileroot, max_shard_size="60KB"), SPEC)
    path = Path(saver.save(ac.TorchEngine(make_model()), 1, 2, 12, tokenizer=tokenizer, force=True))
    recorded = manifest(path)
    on_disk = {p.name for p in path.iterdir()} - {"areal_ckpt_manifest.json"}
    assert set(recorded["files"]) == on_disk
    for name, entry in recorded["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "crc32": zlib.crc32(data)}, name
    assert recorded["step"] == {"epoch": 1, "epoch_step": 2, "global_step": 12}
    assert recorded["format"] == "areal_ckpt.hf_export" and recorded["world_size"] == 1


def test_schedule_decides_which_steps_export_with_exact_folder_names(fileroot, make_model):
    saver = ac.Saver(saver_config(fileroot, freq_epochs=1, freq_steps=4), SPEC)
    engine = ac.TorchEngine(make_model())
    returned = []
    for global_step in range(SPEC.total_train_steps):
        epoch, epoch_step = divmod(global_step, SPEC.steps_per_epoch)
        returned.append(saver.save(engine, epoch, epoch_step, global_step))
    expected = [
        "epoch0epochstep3globalstep3",
        "epoch0epochstep7globalstep7",
        "epoch0epochstep9globalstep9",
        "epoch1epochstep1globalstep11",
        "epoch1epochstep5globalstep15",
        "epoch1epochstep9globalstep19",
    ]
    assert export_names(saver.export_root()) == expected
    assert [Path(p).name for p in returned if p is not None] == expected
    assert sum(p is None for p in returned) == SPEC.total_train_steps - len(expected)


def test_two_model_names_keep_their_own_cadence(fileroot, make_model):
    saver = ac.Saver(saver_config(fileroot, freq_steps=3), SPEC)
    actor, critic = ac.TorchEngine(make_model(1)), ac.TorchEngine(make_model(2))
    for global_step in range(9):
        saver.save(actor, 0, global_step, global_step, name="actor")
        saver.save(critic, 0, global_step, global_step, name="critic")
    expected = ["epoch0epochstep2globalstep2", "epoch0epochstep5globalstep5", "epoch0epochstep8globalstep8"]
    assert export_names(saver.export_root("actor")) == expected
    assert export_names(saver.export_root("critic")) == expected
    critic_weights = read_export_tensors(saver.export_root("critic") / expected[0])
    assert torch.equal(critic_weights["lm_head.weight"], critic.module.lm_head.weight)


def test_force_saves_off_schedule_and_not_due_returns_none(fileroot, make_model):
    saver = ac.Saver(saver_config(fileroot), SPEC)  # no trigger at all
    engine = ac.TorchEngine(make_model())
    assert saver.save(engine, 0, 0, 0) is None
    assert not saver.export_root().exists()
    assert Path(saver.save(engine, 0, 1, 1, force=True)).name == "epoch0epochstep1globalstep1"


def test_retention_keeps_newest_n_per_name_and_touches_nothing_else(fileroot, make_model):
    saver = ac.Saver(saver_config(fileroot, freq_steps=1, keep_last=2), SPEC)
    engine = ac.TorchEngine(make_model())
    keep_me = saver.export_root() / "notes"
    keep_me.mkdir(parents=True)
    other_trial = fileroot / "checkpoints/tester/exp/other-trial/default/epoch0epochstep0globalstep0"
    other_trial.mkdir(parents=True)
    saver.save(engine, 0, 0, 0, name="critic")
    for global_step in range(5):
        saver.save(engine, 0, global_step, global_step)
    visible = sorted(p.name for p in saver.export_root().iterdir() if not p.name.startswith("."))
    assert visible == ["epoch0epochstep3globalstep3", "epoch0epochstep4globalstep4", "notes"]
    saver.finalize()  # waits for the deletions handed to the helper thread
    remaining = sorted(p.name for p in saver.export_root().iterdir())
    assert remaining == ["epoch0epochstep3globalstep3", "epoch0epochstep4globalstep4", "notes"]
    assert export_names(saver.export_root("critic")) == ["epoch0epochstep0globalstep0"]
    assert other_trial.is_dir()


def test_metrics_report_seconds_bytes_and_throughput(fileroot, make_model):
    model = make_model()
    saver = ac.Saver(saver_config(fileroot), SPEC)
    saver.save(ac.TorchEngine(model), 0, 0, 0, force=True)
    metrics = saver.last_metrics
    assert metrics["bytes"] == sum(t.nbytes for t in model.state_dict().values())
    assert metrics["time/saving"] > 0
    assert metrics["gbps"] == pytest.approx(metrics["bytes"] / metrics["time/saving"] / 1e9)


def test_saver_state_dict_is_json_and_keeps_cadence_across_restart(fileroot, make_model):
    config = saver_config(fileroot, freq_steps=3)
    engine = ac.TorchEngine(make_model())
    first = ac.Saver(config, SPEC)
    for global_step in range(5):  # fires at step 2; two steps counted towards the next
        first.save(engine, 0, global_step, global_step)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = ac.Saver(config, SPEC)
    resumed.load_state_dict(state)
    assert resumed.save(engine, 0, 5, 5) is not None
    fresh = ac.Saver(config, SPEC)
    assert fresh.save(engine, 0, 5, 5) is None


def test_saving_the_same_step_again_replaces_the_folder_whole(fileroot, make_model):
    saver = ac.Saver(saver_config(fileroot), SPEC)
    first = Path(saver.save(ac.TorchEngine(make_model(1)), 0, 0, 0, force=True))
    second_model = make_model(2)
    second = Path(saver.save(ac.TorchEngine(second_model), 0, 0, 0, force=True))
    assert first == second
    assert torch.equal(read_export_tensors(second)["lm_head.weight"], second_model.lm_head.weight)
    assert [p.name for p in second.parent.iterdir()] == [second.name]  # no staging or trash left


def test_new_saver_removes_staging_left_by_a_crash(fileroot, make_model):
    saver = ac.Saver(saver_config(fileroot), SPEC)
    committed = Path(saver.save(ac.TorchEngine(make_model()), 0, 0, 0, force=True))
    leftover = committed.parent / ".export-staging.epoch0epochstep1globalstep1"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    ac.Saver(saver_config(fileroot), SPEC)
    assert not leftover.exists()
    assert committed.is_dir()


def test_retention_deletes_off_the_callers_thread_and_never_before_the_commit(fileroot, make_model, monkeypatch):
    from areal_ckpt import publish

    deleted_by: list[tuple[str, str]] = []
    real_rmtree = publish.shutil.rmtree

    def recording_rmtree(path, *args, **kwargs):
        deleted_by.append((Path(path).name, threading.current_thread().name))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(publish.shutil, "rmtree", recording_rmtree)
    saver = ac.Saver(saver_config(fileroot, freq_steps=1, keep_last=1), SPEC)
    engine = ac.TorchEngine(make_model())
    saver.save(engine, 0, 0, 0)
    newest = Path(saver.save(engine, 0, 1, 1))
    assert newest.is_dir() and export_names(saver.export_root()) == [newest.name]  # committed, then hidden
    saver.finalize()
    assert deleted_by == [(".export-trash.epoch0epochstep0globalstep0", deleted_by[0][1])]
    assert deleted_by[0][1].startswith("areal_ckpt-trash") and deleted_by[0][1] != threading.current_thread().name


def test_retention_never_deletes_through_a_linked_model_folder(fileroot, tmp_path, make_model):
    elsewhere = tmp_path / "elsewhere"
    for step in range(3):
        (elsewhere / f"epoch0epochstep{step}globalstep{step}").mkdir(parents=True)
    saver = ac.Saver(saver_config(fileroot, freq_steps=1, keep_last=1), SPEC)
    saver.trial_root.joinpath("critic").symlink_to(elsewhere)
    saver.save(ac.TorchEngine(make_model()), 0, 3, 3, name="critic")
    saver.finalize()
    assert sorted(p.name for p in elsewhere.iterdir()) == [
        "epoch0epochstep0globalstep0",
        "epoch0epochstep1globalstep1",
        "epoch0epochstep2globalstep2",
        "epoch0epochstep3globalstep3",
    ]
