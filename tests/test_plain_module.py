"""Any nn.Module, not only transformers models: recovery and DeepSpeed-shaped checkpoints need
no HF config; an HF export of a plain module is refused with the way to do it, and that way
works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from recover_fixtures import SPEC, recover_config, step_info, trial_dir
from transformers import AutoModelForCausalLM

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main
from areal_ckpt.demo.tiny import build_model


class HFShaped(torch.nn.Module):
    """A plain module (no .config) whose parameters carry a transformers model's names."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        hf = build_model(48)
        self.model, self.lm_head = hf.model, hf.lm_head
        self.hf_config = hf.config

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids=tokens).last_hidden_state)


def _trained(seed: int = 0) -> tuple[HFShaped, ac.TorchEngine]:
    module = HFShaped(seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    tokens = torch.arange(16).reshape(2, 8) % 48
    module(tokens).sum().backward()
    optimizer.step()
    return module, ac.TorchEngine(module, optimizer=optimizer)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_plain_module_dumps_and_loads_bit_exactly(fileroot):
    module, engine = _trained()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(engine, step_info(0), force=True)
    handler.close()
    fresh = HFShaped(seed=1)
    fresh_engine = ac.TorchEngine(fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(fresh_engine).last_step_info.global_step == 0
    assert _same(module, fresh)
    saved, loaded = engine.optimizer.state_dict()["state"], fresh_engine.optimizer.state_dict()["state"]
    assert all(torch.equal(saved[i]["exp_avg"], loaded[i]["exp_avg"]) for i in saved)


def test_an_hf_export_of_a_plain_module_is_refused_and_its_hint_exports_the_dump(fileroot, tmp_path, capsys):
    module, engine = _trained()
    saver = ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester"), SPEC
    )
    with pytest.raises(ac.CheckpointError) as refused:
        saver.save(engine, 0, 0, 0, force=True)
    saver.finalize()
    message = str(refused.value)
    assert "HFShaped has no HF config (.config): an HF export needs a transformers PreTrainedModel" in message
    assert "`areal-ckpt export CHECKPOINT OUT --config-from HF_DIR`" in message
    assert not list((trial_dir(fileroot) / "default").glob("epoch*"))  # nothing published

    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(engine, step_info(0), force=True)
    handler.close()
    assert cli_main(["export", str(trial_dir(fileroot)), str(tmp_path / "no-config")]) == 2
    assert "name a folder holding one with --config-from" in capsys.readouterr().err
    module.hf_config.save_pretrained(tmp_path / "hf_dir")
    out = tmp_path / "exported"
    assert cli_main(["export", str(trial_dir(fileroot)), str(out), "--config-from", str(tmp_path / "hf_dir")]) == 0
    assert _same(module, AutoModelForCausalLM.from_pretrained(out, local_files_only=True))


def test_save_checkpoint_of_a_plain_module_and_convert_deepspeed_with_its_hint(tmp_path):
    module, engine = _trained()
    assert ac.save_checkpoint(engine, tmp_path / "ds", tag="step1", client_state={"k": 1})
    fresh = HFShaped(seed=1)
    fresh_engine = ac.TorchEngine(fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    _, client_state = ac.load_checkpoint(fresh_engine, tmp_path / "ds")
    assert client_state == {"k": 1} and _same(module, fresh)
    module.hf_config.save_pretrained(tmp_path / "hf_dir")
    out = tmp_path / "exported"
    assert cli_main(["convert-deepspeed", str(tmp_path / "ds"), str(out), "--config", str(tmp_path / "hf_dir")]) == 0
    assert _same(module, AutoModelForCausalLM.from_pretrained(out, local_files_only=True))


def plain_deepspeed_worker(rank: int, world_size: int, root: str, report: str) -> None:
    """A plain nn.Sequential under DeepSpeed ZeRO-2 on 2 ranks: save_checkpoint, then a fresh
    engine loads it: weights and the next step's loss equal."""
    import deepspeed

    def engine_of(seed: int):
        torch.manual_seed(seed)
        module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
        engine, *_ = deepspeed.initialize(
            model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=1e-2), config=config
        )
        return engine

    def step(engine) -> float:
        inputs = torch.arange(32, dtype=torch.float32).reshape(2, 16) / 32 + rank
        loss = engine(inputs).pow(2).mean()
        engine.backward(loss)
        engine.step()
        return float(loss)

    engine = engine_of(0)
    step(engine)
    ac.save_checkpoint(ac.DeepSpeedEngine(engine), root, tag="step1")
    expected = step(engine)
    fresh = engine_of(1)
    ac.load_checkpoint(ac.DeepSpeedEngine(fresh), root)
    Path(f"{report}.{rank}").write_text(json.dumps({"expected": expected, "resumed": step(fresh)}))


@pytest.mark.dist
def test_a_plain_module_under_deepspeed_round_trips(tmp_path):
    run_distributed(plain_deepspeed_worker, 2, str(tmp_path / "ds"), str(tmp_path / "report"), timeout=600)
    for rank in range(2):
        outcome = json.loads((tmp_path / f"report.{rank}").read_text())
        assert outcome["resumed"] == outcome["expected"], (rank, outcome)
