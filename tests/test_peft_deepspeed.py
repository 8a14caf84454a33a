"""DeepSpeed ZeRO 1-3 over a PEFT (LoRA) model on 2 real ranks (CPU, gloo): save_checkpoint +
load_checkpoint continue the run bit for bit, and the Saver's adapter export loads with peft."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from helpers import deepspeed_steps, read_export_tensors, saver_config
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from test_peft_distributed import SPEC, TOKENS, VOCAB, lora_model

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model

pytestmark = pytest.mark.dist


def lora_engine(stage: int) -> object:
    import deepspeed

    model = lora_model("none")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def losses(engine, steps: int) -> list[float]:
    return deepspeed_steps(engine, TOKENS, steps)


def lora_worker(rank: int, world_size: int, root: str, fileroot: str, stage: int, report: str) -> None:
    engine = lora_engine(stage)
    losses(engine, 2)
    ac.save_checkpoint(engine, f"{root}/ckpt", client_state={"rlhf_iteration": 2})
    engine.save_checkpoint(f"{root}/native")  # DeepSpeed's own, for its fp32 functions as the oracle
    saver = ac.Saver(saver_config(Path(fileroot), trial_name=f"zero{stage}"), SPEC)
    saver.save(engine, 0, 1, 2, force=True)
    continued = losses(engine, 3)
    _, client_state = ac.load_checkpoint(engine, f"{root}/ckpt")
    saver.save(engine, 0, 2, 3, force=True)  # the loaded state, exported again
    saver.finalize()
    resumed = losses(engine, 3)
    if rank == 0:
        Path(report).write_text(json.dumps({"continued": continued, "resumed": resumed, "client": client_state}))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_over_a_lora_model_resumes_bit_exactly_and_exports_its_adapter(tmp_path, fileroot, stage):
    report = tmp_path / "report.json"
    run_distributed(lora_worker, 2, str(tmp_path), str(fileroot), stage, str(report))
    outcome = json.loads(report.read_text())
    assert outcome["resumed"] == outcome["continued"]  # weights, adapter moments, LR: the same three steps
    assert outcome["client"]["rlhf_iteration"] == 2
    trial = fileroot / f"checkpoints/tester/exp/zero{stage}/default"
    saved, reloaded = trial / "epoch0epochstep1globalstep2", trial / "epoch0epochstep2globalstep3"
    written = read_export_tensors(saved)
    initial = get_peft_model_state_dict(lora_model("none"))
    assert written.keys() == initial.keys()
    assert not all(torch.equal(initial[key], written[key]) for key in written)  # trained two steps
    again = read_export_tensors(reloaded)
    assert all(torch.equal(again[key], written[key]) for key in written)  # what load_checkpoint restored
    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(build_model(VOCAB), saved)  # the base the adapters were trained on
    assert loaded(input_ids=TOKENS).logits.isfinite().all()


@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_state_dicts_of_a_lora_run_leave_out_the_frozen_base_as_deepspeed_does(tmp_path, fileroot, stage):
    from deepspeed.utils import zero_to_fp32

    from areal_ckpt.formats.deepspeed_pickles import weights_only_deepspeed_loads
    from areal_ckpt.tools.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run_distributed(lora_worker, 2, str(tmp_path), str(fileroot), stage, str(tmp_path / "report.json"))
    with weights_only_deepspeed_loads():
        oracle = dict(
            zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                str(tmp_path / "native"), exclude_frozen_parameters=True
            )
        )
    assert oracle and all("lora_" in name for name in oracle)
    for layout in ("native", "ckpt"):
        ours = get_fp32_state_dict_from_zero_checkpoint(tmp_path / layout, exclude_frozen_parameters=True)
        assert ours.keys() == oracle.keys()
        assert all(torch.equal(ours[name], oracle[name]) for name in oracle)
    script = tmp_path / "ckpt" / "zero_to_fp32.py"
    command = [sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "offline"), "--safe_serialization"]
    subprocess.run([*command, "--exclude_frozen_parameters"], check=True, capture_output=True, timeout=300)
    offline = load_file(tmp_path / "offline" / "model.safetensors")
    assert offline.keys() == oracle.keys() and all(torch.equal(offline[name], oracle[name]) for name in oracle)
