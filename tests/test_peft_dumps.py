"""Recovery dumps of a LoRA run store the frozen base once per trial: later dumps hard-link it
and write the adapters, their optimizer state and whatever changed; a changed or unfrozen
base parameter is written again; the linked files are checked at load like every file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from recover_fixtures import SPEC, recover_config, step_info, trial_dir

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model

VOCAB = 48
TOKENS = torch.arange(32).reshape(2, 16) % VOCAB


def lora_run(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    base = build_model(VOCAB, hidden_size=512, intermediate_size=1024)
    model = get_peft_model(base, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def committed(fileroot: Path) -> Path:
    return (trial_dir(fileroot) / ".recover/current").resolve()


def frozen_file(fileroot: Path) -> Path:
    return committed(fileroot) / "default/frozen/__0_0.distcp"


def test_later_dumps_link_the_frozen_base_and_write_little_more_than_the_adapters(fileroot):
    model, optimizer = lora_run()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    engine = ac.TorchEngine(model, optimizer)
    written, inodes = [], []
    for step in range(3):
        train_step(model, optimizer)
        handler.dump(engine, step_info(step), force=True)
        written.append(handler.last_metrics["bytes"])
        inodes.append(frozen_file(fileroot).stat().st_ino)
    handler.close()
    assert inodes[0] == inodes[1] == inodes[2]  # the base was written once, then hard-linked
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    adapters_and_moments = 3 * trained  # weights, exp_avg, exp_avg_sq (fp32)
    assert all(later < 1.1 * adapters_and_moments for later in written[1:])  # data, metadata, JSON: all of it
    base = frozen_file(fileroot).stat().st_size
    assert base > 10 * adapters_and_moments  # the bytes that are not written again
    assert all(abs(later - (written[0] - base)) < 1024 for later in written[1:])  # the first less the base

    fresh, fresh_optimizer = lora_run(seed=1)
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(fresh, fresh_optimizer))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    moments = [state["exp_avg"] for state in optimizer.state.values()]
    assert all(torch.equal(a, b["exp_avg"]) for a, b in zip(moments, fresh_optimizer.state.values()))


@pytest.mark.parametrize("change", ["value", "unfrozen"])
def test_a_changed_or_unfrozen_base_parameter_is_written_again(fileroot, change):
    model, optimizer = lora_run()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    engine = ac.TorchEngine(model, optimizer)
    train_step(model, optimizer)
    handler.dump(engine, step_info(0), force=True)
    first = frozen_file(fileroot).stat().st_ino
    embedding = model.get_base_model().model.embed_tokens.weight
    if change == "value":  # through .data, which no version counter sees
        embedding.data[0, 0] += 1.0
    else:
        embedding.requires_grad_(True)
        optimizer.add_param_group({"params": [embedding]})
        train_step(model, optimizer)
    handler.dump(engine, step_info(1), force=True)
    handler.close()
    assert frozen_file(fileroot).stat().st_ino != first

    fresh, fresh_optimizer = lora_run(seed=1)
    if change == "unfrozen":
        fresh_embedding = fresh.get_base_model().model.embed_tokens.weight.requires_grad_(True)
        fresh_optimizer.add_param_group({"params": [fresh_embedding]})
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(fresh, fresh_optimizer))
    assert torch.equal(fresh.get_base_model().model.embed_tokens.weight, embedding)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_a_damaged_linked_base_is_named_at_load_and_nothing_is_loaded(fileroot):
    model, optimizer = lora_run()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    engine = ac.TorchEngine(model, optimizer)
    for step in range(2):
        train_step(model, optimizer)
        handler.dump(engine, step_info(step), force=True)
    handler.close()
    damaged = frozen_file(fileroot)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    fresh, fresh_optimizer = lora_run(seed=1)
    with pytest.raises(ac.CheckpointError, match=r"frozen/__0_0\.distcp"):
        ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(fresh, fresh_optimizer))


def test_stock_dcp_reads_the_model_folder_and_its_frozen_part(fileroot):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = lora_run()
    train_step(model, optimizer)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(ac.TorchEngine(model, optimizer), step_info(0), force=True)
    handler.close()

    fresh, fresh_optimizer = lora_run(seed=1)  # stock torch only from here
    train_step(fresh, fresh_optimizer)  # so that its optimizer has state to load into
    model_state, optim_state = get_state_dict(fresh, fresh_optimizer)
    state = {"dcp": {"model": model_state, "optim": optim_state}}
    folder = trial_dir(fileroot) / "default/recover_checkpoint"
    for part in (folder, folder / "frozen"):
        dcp.load(state, checkpoint_id=part, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(fresh, fresh_optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_a_dump_loads_onto_a_fresh_peft_model_whose_base_comes_from_the_pretrained_folder(fileroot, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    build_model(VOCAB, hidden_size=512, intermediate_size=1024).save_pretrained(tmp_path / "base")
    config = LoraConfig(r=16, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    for step in range(2):
        train_step(model, optimizer)
        handler.dump(ac.TorchEngine(model, optimizer), step_info(step), force=True)
    handler.close()

    torch.manual_seed(5)  # other adapter initialisations: all of them come from the dump
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), config)
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(fresh)) is not None
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_rot_in_the_linked_base_is_never_carried_into_a_new_dump(fileroot, caplog):
    model, optimizer = lora_run()
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    engine = ac.TorchEngine(model, optimizer)
    train_step(model, optimizer)
    handler.dump(engine, step_info(0), force=True)
    rotten = frozen_file(fileroot)
    rotten_inode = rotten.stat().st_ino
    with rotten.open("r+b") as file:  # one byte flipped in place, after the dump
        file.seek(rotten.stat().st_size // 2)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x01]))
    inodes = []
    for step in (1, 2):
        train_step(model, optimizer)
        handler.dump(engine, step_info(step), force=True)
        inodes.append(frozen_file(fileroot).stat().st_ino)
    handler.close()
    assert "frozen/__0_0.distcp: checksum mismatch" in caplog.text and "written again" in caplog.text
    assert inodes[0] != rotten_inode and inodes[0] == inodes[1]  # written afresh once, then linked again
    fresh, fresh_optimizer = lora_run(seed=1)
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(ac.TorchEngine(fresh, fresh_optimizer))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
