"""PEFT / LoRA models (real peft, a tiny Qwen2): exports are adapter folders peft loads onto the
base, merged models from_pretrained loads, or both, each with the trained model's outputs; a
wrapper from_pretrained could not load is refused; recovery of a LoRA run round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import read_export_tensors, saver_config
from peft import LoraConfig, PeftModel, PromptTuningConfig, get_peft_model, get_peft_model_state_dict
from recover_fixtures import SPEC, recover_config, step_info, trial_dir
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main
from areal_ckpt.paths import MANIFEST_NAME
from areal_ckpt.tools.inspection import verify

TOKENS = torch.arange(16).reshape(2, 8) % 48


def _lora(make_model, seed: int = 0):
    torch.manual_seed(seed)
    model = get_peft_model(make_model(seed=seed), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # trained adapters: B is zero at initialisation, so make the update real
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    return model


def _saved(fileroot, model, tokenizer=None, **fields) -> Path:
    saver = ac.Saver(saver_config(fileroot, **fields), SPEC)
    path = saver.save(ac.TorchEngine(model), 0, 0, 0, force=True, tokenizer=tokenizer)
    saver.finalize()
    return Path(path)


def _stored_keys(file: Path) -> set[str]:
    with safe_open(file, framework="pt") as handle:
        return set(handle.keys())


def test_a_lora_export_is_an_adapter_folder_peft_loads_with_the_trained_outputs(fileroot, make_model, tokenizer):
    model = _lora(make_model)
    expected = model(input_ids=TOKENS).logits
    folder = _saved(fileroot, model, tokenizer)
    names = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", MANIFEST_NAME} <= names
    assert not names & {"config.json", "model.safetensors"}  # no base model in an adapter folder
    keys = _stored_keys(folder / "adapter_model.safetensors")
    assert keys == set(get_peft_model_state_dict(model))  # peft's own names: no ".default", no base weights
    assert not any(".default." in key for key in keys)
    stored = json.loads((folder / "adapter_config.json").read_text())
    assert stored["r"] == 4 and sorted(stored["target_modules"]) == ["q_proj", "v_proj"]
    assert stored["inference_mode"] is True

    loaded = PeftModel.from_pretrained(make_model(seed=0), folder)  # the base it was trained from
    assert torch.equal(loaded(input_ids=TOKENS).logits, expected)
    assert verify(folder) == []


def test_the_adapter_config_names_the_base_model_folder(fileroot, make_model, tmp_path):
    base = tmp_path / "base"
    make_model(seed=0).save_pretrained(base)
    model = _lora(make_model)
    saver = ac.Saver(saver_config(fileroot), SPEC)
    folder = Path(saver.save(ac.TorchEngine(model), 0, 0, 0, force=True, base_model_path=str(base)))
    saver.finalize()
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    assert not (folder / "config.json").exists()  # not a model folder: the base's config stays with the base
    assert (folder / "generation_config.json").read_bytes() == (base / "generation_config.json").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)  # transformers finds base + adapter
    torch.testing.assert_close(loaded(input_ids=TOKENS).logits, model(input_ids=TOKENS).logits, rtol=0, atol=0)


def test_a_merged_export_loads_with_from_pretrained_equal_to_peft_merge(fileroot, make_model):
    model = _lora(make_model)
    expected = model(input_ids=TOKENS).logits
    folder = _saved(fileroot, model, lora="merged", max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").exists() and not (folder / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    torch.testing.assert_close(loaded(input_ids=TOKENS).logits, expected)
    merged_by_peft = _lora(make_model).merge_and_unload().state_dict()
    assert all(torch.equal(merged_by_peft[name], tensor) for name, tensor in read_export_tensors(folder).items())
    assert torch.equal(model(input_ids=TOKENS).logits, expected)  # the live model is untouched


def test_both_puts_the_merged_model_on_top_and_the_adapter_below(fileroot, make_model):
    model = _lora(make_model)
    folder = _saved(fileroot, model, lora="both")
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert AutoModelForCausalLM.from_pretrained(folder, local_files_only=True) is not None
    loaded = PeftModel.from_pretrained(make_model(seed=0), folder / "adapter")
    assert torch.equal(loaded(input_ids=TOKENS).logits, model(input_ids=TOKENS).logits)


def test_every_adapter_of_a_multi_adapter_model_is_exported_by_name(fileroot, make_model):
    model = _lora(make_model)
    model.add_adapter("critic", LoraConfig(r=2, target_modules=["k_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B.critic" in name:
                parameter.normal_(0, 0.5)
    folder = _saved(fileroot, model)
    assert json.loads((folder / "critic" / "adapter_config.json").read_text())["r"] == 2
    for adapter, targets in (("default", {"q_proj", "v_proj"}), ("critic", {"k_proj"})):
        model.set_adapter(adapter)
        expected = model(input_ids=TOKENS).logits
        where = folder if adapter == "default" else folder / adapter
        assert {key.split(".")[-3] for key in _stored_keys(where / "adapter_model.safetensors")} == targets
        loaded = PeftModel.from_pretrained(make_model(seed=0), where)
        assert torch.equal(loaded(input_ids=TOKENS).logits, expected)


def test_a_dora_model_is_refused_for_a_merged_export_and_exports_as_an_adapter(fileroot, make_model):
    torch.manual_seed(0)
    model = get_peft_model(make_model(seed=0), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ac.CheckpointError, match=r"q_proj: adapter\(s\) \['default'\] use DoRA .* lora: adapter"):
        _saved(fileroot, model, lora="merged")
    assert not any(trial_dir(fileroot).glob("**/epoch*"))
    folder = _saved(fileroot, model)  # the hint
    loaded = PeftModel.from_pretrained(make_model(seed=0), folder)
    assert torch.equal(loaded(input_ids=TOKENS).logits, model(input_ids=TOKENS).logits)


def test_a_wrapper_whose_names_from_pretrained_does_not_know_is_refused(fileroot, make_model):
    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = make_model()
            self.config = self.inner.config

    saver = ac.Saver(saver_config(fileroot), SPEC)
    with pytest.raises(ac.CheckpointError, match=r": Wrapped is not a transformers model class"):
        saver.save(ac.TorchEngine(Wrapped()), 0, 0, 0, force=True)
    saver.finalize()


def test_a_prefixed_state_is_named_key_by_key(fileroot, make_model):
    """Names that are off for a transformers class itself: the unknown and missing ones are listed."""
    from areal_ckpt.formats.hf_keys import check_loadable

    model = make_model()
    names = [f"inner.{name}" for name in model.state_dict()]
    with pytest.raises(ac.CheckpointError) as refused:
        check_loadable(model.config, "Qwen2ForCausalLM", names, "OUT")
    message = str(refused.value)
    assert message.startswith("OUT: from_pretrained of Qwen2ForCausalLM would not load this export: ")
    assert f"{len(names)} tensor(s) it does not know (inner.lm_head.weight" in message
    assert "it expects missing (lm_head.weight" in message and "randomly initialised" in message


def test_a_lora_run_dumps_and_loads_and_its_dump_exports_as_the_saver_would(fileroot, make_model, tmp_path):
    model = _lora(make_model)
    model.add_adapter("critic", LoraConfig(r=2, target_modules=["k_proj"]))
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(ac.TorchEngine(model), step_info(0), force=True)
    handler.close()
    fresh = _lora(make_model, seed=1)
    fresh.add_adapter("critic", LoraConfig(r=2, target_modules=["k_proj"]))
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(fresh)) is not None
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))

    saved = _saved(fileroot, model, lora="both")
    out = tmp_path / "out"
    assert cli_main(["export", str(trial_dir(fileroot)), str(out), "--lora", "both"]) == 0
    for sub in ("", "adapter", "adapter/critic"):
        expected, written = read_export_tensors(saved / sub), read_export_tensors(out / sub)
        assert expected.keys() == written.keys() and written
        assert all(torch.equal(expected[name], written[name]) for name in expected), sub
    for sub in ("adapter", "adapter/critic"):
        config = json.loads((out / sub / "adapter_config.json").read_text())
        assert config == json.loads((saved / sub / "adapter_config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    torch.testing.assert_close(loaded(input_ids=TOKENS).logits, model(input_ids=TOKENS).logits)


@pytest.mark.parametrize(
    ("other", "named"),
    [
        ({"r": 8, "target_modules": ["q_proj", "v_proj"]}, "r: 4 in the checkpoint, 8 here"),
        ({"r": 4, "target_modules": ["q_proj", "k_proj"]}, "target_modules: ['q_proj', 'v_proj'] in the checkpoint"),
    ],
)
def test_a_dump_loaded_onto_another_lora_config_is_refused_naming_both(fileroot, make_model, other, named):
    model = _lora(make_model)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(ac.TorchEngine(model), step_info(0), force=True)
    handler.close()
    torch.manual_seed(1)
    mismatched = get_peft_model(make_model(seed=1), LoraConfig(**other))
    before = {name: tensor.clone() for name, tensor in mismatched.state_dict().items()}
    with pytest.raises(ac.CheckpointError) as refused:
        ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(mismatched))
    message = str(refused.value)
    assert "adapter 'default' was saved with another configuration (" in message and named in message
    assert "the checkpoint's: {" in message and "this model's: {" in message
    assert all(torch.equal(before[name], tensor) for name, tensor in mismatched.state_dict().items())  # untouched
    base_only = make_model(seed=1)
    with pytest.raises(
        ac.CheckpointError, match=r"holds a PEFT model with adapters \['default'\], this model is not one"
    ):
        ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(base_only))


def test_an_asynchronous_lora_export_equals_the_synchronous_one(fileroot, make_model, tmp_path):
    model = _lora(make_model)
    synchronous = _saved(tmp_path / "sync", model, lora="both", mode="sync")
    background = _saved(fileroot, model, lora="both", mode="async")
    for sub in ("", "adapter"):
        expected, written = read_export_tensors(synchronous / sub), read_export_tensors(background / sub)
        assert expected.keys() == written.keys() and written
        assert all(torch.equal(expected[name], written[name]) for name in expected)


def test_a_peft_method_whose_tensors_are_computed_is_refused_by_name(fileroot, make_model, tmp_path):
    model = get_peft_model(make_model(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    for lora, refusal in (
        ("adapter", r"adapter 'default' \(PROMPT_TUNING\): its tensor prompt_embeddings is computed"),
        ("merged", r"adapters {'default': 'PROMPT_TUNING'}: only LoRA adapters can be merged"),
    ):
        with pytest.raises(ac.CheckpointError, match=refusal):
            _saved(fileroot, model, lora=lora)
    assert not any(trial_dir(fileroot).glob("**/epoch*"))
    model.save_pretrained(tmp_path / "own")  # the hint: peft's own writer
    assert (tmp_path / "own" / "adapter_model.safetensors").is_file()


def test_modules_to_save_travel_with_the_adapter_and_replace_the_originals_when_merged(fileroot, make_model):
    torch.manual_seed(0)
    model = get_peft_model(make_model(seed=0), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["o_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modules_to_save" in name or "lora_B" in name:
                parameter.normal_(0, 0.5)
    folder = _saved(fileroot, model, lora="both")
    assert any("o_proj" in key for key in _stored_keys(folder / "adapter" / "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(make_model(seed=0), folder / "adapter")
    assert torch.equal(loaded(input_ids=TOKENS).logits, model(input_ids=TOKENS).logits)
    merged_by_peft = model.merge_and_unload().state_dict()  # the trained o_proj copies replace the originals
    written = read_export_tensors(folder)
    assert written.keys() <= merged_by_peft.keys() and any("o_proj" in name for name in written)
    assert all(torch.equal(merged_by_peft[name], tensor) for name, tensor in written.items())


def test_an_areal_shaped_engine_holding_a_peft_model_saves_and_recovers_unchanged(fileroot, make_model):
    class FSDPEngine:  # AReaL's shape: the model as .model, its optimizer as .optimizer
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model
            self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            self.lr_scheduler = None

    engine = FSDPEngine(_lora(make_model))
    engine.model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    engine.optimizer.step()
    folder = _saved(fileroot, engine.model)
    saver = ac.Saver(saver_config(fileroot, trial_name="areal"), SPEC)
    through_holder = Path(saver.save(engine, 0, 0, 0, force=True))
    saver.finalize()
    assert read_export_tensors(through_holder).keys() == read_export_tensors(folder).keys()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(engine, step_info(0), force=True)
    handler.close()
    fresh = FSDPEngine(_lora(make_model, seed=1))
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(fresh) is not None
    assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), fresh.model.state_dict().values()))
    moments = [state["exp_avg"] for state in engine.optimizer.state.values()]
    assert len(moments) == len(fresh.optimizer.state) > 0
    assert all(torch.equal(a, b["exp_avg"]) for a, b in zip(moments, fresh.optimizer.state.values()))
