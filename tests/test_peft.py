"""PEFT / LoRA models (real peft, a tiny Qwen2): an HF export that from_pretrained would load with
random weights is refused, and the way it names (merge, then export) gives a folder with the
trained model's outputs; recovery of a LoRA run round-trips."""

from __future__ import annotations

import pytest
import torch
from helpers import saver_config
from peft import LoraConfig, get_peft_model
from recover_fixtures import SPEC, recover_config, step_info, trial_dir
from transformers import AutoModelForCausalLM

import areal_ckpt as ac
from areal_ckpt.tools.cli import main as cli_main

TOKENS = torch.arange(16).reshape(2, 8) % 48


def _lora(make_model, seed: int = 0):
    torch.manual_seed(seed)
    model = get_peft_model(make_model(seed=seed), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # trained adapters: B is zero at initialisation, so make the update real
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    return model


def test_a_lora_export_is_refused_and_the_merged_model_exports_with_its_outputs(fileroot, make_model):
    model = _lora(make_model)
    expected = model(input_ids=TOKENS).logits
    saver = ac.Saver(saver_config(fileroot), SPEC)
    with pytest.raises(ac.CheckpointError) as refused:
        saver.save(ac.TorchEngine(model), 0, 0, 0, force=True)
    message = str(refused.value)
    assert "is not a transformers model class, so from_pretrained could not load this export" in message
    assert "merge the adapters into it first (model.merge_and_unload())" in message
    assert not any(trial_dir(fileroot).glob("**/epoch*"))  # nothing published

    merged = model.merge_and_unload()  # the hint
    path = saver.save(ac.TorchEngine(merged), 0, 0, 0, force=True)
    saver.finalize()
    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    torch.testing.assert_close(loaded(input_ids=TOKENS).logits, expected)


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


def test_a_lora_run_dumps_and_loads_and_its_export_is_refused(fileroot, make_model, tmp_path, capsys):
    model = _lora(make_model)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(ac.TorchEngine(model), step_info(0), force=True)
    handler.close()
    fresh = _lora(make_model, seed=1)
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(fresh)) is not None
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert cli_main(["export", str(trial_dir(fileroot)), str(tmp_path / "out")]) == 2
    assert "is not a transformers model class" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
