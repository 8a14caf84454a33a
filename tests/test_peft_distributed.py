"""LoRA exports on 2 real processes (gloo), FSDP2 and DDP: the same folders as one process
writes, and an adapter export gathers adapter tensors only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from helpers import read_export_tensors, saver_config, wrap_model
from peft import LoraConfig, PeftModel, get_peft_model
from recovery_runs import assert_same_run, run_job

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model
from areal_ckpt.engines.peft_export import PeftExport

pytestmark = pytest.mark.dist

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)
VOCAB = 48
TOKENS = torch.arange(16).reshape(2, 8) % VOCAB


def lora_model(wrap: str) -> torch.nn.Module:
    """The same trained LoRA model on every rank and in one process: seeded, adapters made non-zero."""
    torch.manual_seed(0)
    model = get_peft_model(build_model(VOCAB), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    return wrap_model(model, wrap)


def export_worker(rank: int, world_size: int, fileroot: str, wrap: str) -> None:
    saver = ac.Saver(saver_config(Path(fileroot), trial_name=wrap, lora="both", max_shard_size="40KB"), SPEC)
    saver.save(ac.TorchEngine(lora_model(wrap)), 0, 0, 0, force=True)
    saver.finalize()


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_two_rank_lora_exports_equal_the_single_process_ones(fileroot, wrap):
    run_distributed(export_worker, 2, str(fileroot), wrap)
    multi = fileroot / f"checkpoints/tester/exp/{wrap}/default/epoch0epochstep0globalstep0"
    saver = ac.Saver(saver_config(fileroot, lora="both", max_shard_size="40KB"), SPEC)
    single = Path(saver.save(ac.TorchEngine(lora_model("none")), 0, 0, 0, force=True))
    saver.finalize()
    for sub in ("", "adapter"):
        expected, written = read_export_tensors(single / sub), read_export_tensors(multi / sub)
        assert expected.keys() == written.keys() and len(written) > 0
        assert all(torch.equal(expected[name], written[name]) for name in expected), sub
    assert len(list(multi.glob("model-*.safetensors"))) >= 2  # both ranks wrote merged shards
    torch.manual_seed(0)  # the base the adapters were trained on
    loaded = PeftModel.from_pretrained(build_model(VOCAB), multi / "adapter")
    assert torch.equal(loaded(input_ids=TOKENS).logits, lora_model("none")(input_ids=TOKENS).logits)


def test_an_adapter_export_reads_adapter_tensors_only():
    model = lora_model("none")
    source = PeftExport(ac.TorchEngine(model), model, "adapter", None)
    names = [spec.name for spec in source.export_specs()]
    assert names and all(".lora_A." in name or ".lora_B." in name for name in names)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    assert source.plan(10**9, None).total_size == adapter_bytes


@pytest.mark.parametrize(("world", "wrap"), [(1, "none"), (2, "fsdp2"), (2, "ddp"), (2, "zero2"), (2, "zero3")])
def test_a_lora_run_killed_after_a_dump_resumes_bit_exactly(tmp_path, world, wrap):
    # LoRA (with dropout, so the RNG matters) on a frozen base, stored once and linked by later
    # dumps: dumps after steps 1, 3, 5, 7; killed one step past a dump; adapters, their moments,
    # LR, RNG and data must continue exactly
    lora = ["--lora"]
    run_job(tmp_path / "ref/root", tmp_path / "ref/out", world_size=world, wrap=wrap, extra=lora)
    root, out = tmp_path / "root", tmp_path / "out"
    assert run_job(root, out, world_size=world, wrap=wrap, extra=[*lora, "--kill-at", "4"]) == [-9] * world
    run_job(root, out, world_size=world, wrap=wrap, extra=lora)
    assert_same_run(tmp_path / "ref/out", out, world_size=world)
    generation = (root / "checkpoints/tester/exp/bitexact/.recover/current").resolve()
    assert (generation / "default/frozen/dcp_metadata.json").is_file()  # the base went through its own part


def mismatch_worker(rank: int, world_size: int, fileroot: str, report: str) -> None:
    from recover_fixtures import recover_config, step_info

    model = lora_model("fsdp2")
    handler = ac.RecoverHandler(recover_config(Path(fileroot)), SPEC)
    handler.dump(ac.TorchEngine(model), step_info(0), force=True)
    handler.close()
    torch.manual_seed(0)
    other = wrap_model(
        get_peft_model(build_model(VOCAB), LoraConfig(r=8, target_modules=["q_proj", "v_proj"])), "fsdp2"
    )
    handler = ac.RecoverHandler(recover_config(Path(fileroot)), SPEC)
    try:
        handler.load(ac.TorchEngine(other))
    except ac.CheckpointError as error:
        Path(f"{report}.{rank}").write_text(str(error))
    finally:
        handler.close()


def test_a_dump_loaded_onto_another_lora_config_is_refused_on_every_rank(fileroot, tmp_path):
    run_distributed(mismatch_worker, 2, str(fileroot), str(tmp_path / "refused"))
    for rank in range(2):
        message = (tmp_path / f"refused.{rank}").read_text()
        assert "adapter 'default' was saved with another configuration (r: 4 in the checkpoint, 8 here" in message
