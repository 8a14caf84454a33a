"""Model and optimizer state load on a different number of ranks (FSDP2 and DDP, 2 -> 1, 1 -> 2);
a shard damaged on one rank fails the load on every rank."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from distributed import run_distributed
from safetensors.torch import load_file, save_file
from test_forged import forge
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model, warmup_cosine

pytestmark = pytest.mark.dist

VOCAB = 48
SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)


def setup(wrap: str, seed: int):
    random.seed(seed)  # python's RNG is re-seeded in forked children: seed every stream
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = build_model(VOCAB)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = warmup_cosine(optimizer, 2, 10)
    return model, optimizer, ac.TorchEngine(model, optimizer=optimizer, lr_scheduler=scheduler), scheduler


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Whole (gathered) model and optimizer state, as flat tensors, on rank 0; collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    flat = {f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    for fqn, entries in get_optimizer_state_dict(model, optimizer, options=options).get("state", {}).items():
        flat.update({f"optim.{fqn}.{key}": value for key, value in entries.items()})
    return {k: v.detach().clone().contiguous() for k, v in flat.items()}


def recover_config(root: str, trial: str) -> ac.RecoverConfig:
    return ac.RecoverConfig(experiment_name="exp", trial_name=trial, fileroot=root, user="tester", mode="on")


def save_worker(rank: int, world: int, root: str, trial: str, wrap: str, expected: str, rng_per_rank: bool) -> None:
    model, optimizer, engine, scheduler = setup(wrap, seed=0)
    tokens = (torch.arange(16).reshape(2, 8) + rank) % VOCAB
    for _ in range(3):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if rng_per_rank:
        torch.manual_seed(100 + rank)
    step = ac.StepInfo(epoch=0, epoch_step=2, global_step=2, steps_per_epoch=SPEC.steps_per_epoch)
    ac.RecoverHandler(recover_config(root, trial), SPEC).dump(engine, step, client_state={"kl": 0.5}, force=True)
    state = full_state(model, optimizer)
    if rank == 0:
        state["lr"] = torch.tensor([optimizer.param_groups[0]["lr"]], dtype=torch.float64)
        save_file(state, expected)


def load_worker(rank: int, world: int, root: str, trial: str, wrap: str, expected: str, drop: bool) -> None:
    model, optimizer, engine, scheduler = setup(wrap, seed=1)  # different weights before loading
    info = ac.RecoverHandler(recover_config(root, trial), SPEC).load(engine, drop_rank_state=drop)
    assert info is not None and info.last_step_info.global_step == 2 and info.world_size != world
    assert info.client_state == {"kl": 0.5}
    check_loaded(rank, model, optimizer, scheduler, expected)


def same_world_worker(rank: int, world: int, root: str, trial: str, wrap: str, expected: str, drop: bool) -> None:
    model, optimizer, engine, scheduler = setup(wrap, seed=1)
    info = ac.RecoverHandler(recover_config(root, trial), SPEC).load(engine)
    assert info is not None and info.world_size == world
    check_loaded(rank, model, optimizer, scheduler, expected)


def check_loaded(rank: int, model, optimizer, scheduler, expected: str) -> None:
    """Rank 0 compares the whole loaded state with what the save wrote down; collective."""
    state = full_state(model, optimizer)
    if rank == 0:
        want = load_file(expected)
        assert torch.equal(want.pop("lr"), torch.tensor([optimizer.param_groups[0]["lr"]], dtype=torch.float64))
        assert want.keys() == state.keys()
        for name in want:
            assert torch.equal(want[name], state[name]), name
        assert scheduler.last_epoch == 3


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
@pytest.mark.parametrize("saved_world, loaded_world", [(2, 1), (1, 2)])
def test_model_and_optimizer_load_on_another_world_size(tmp_path, wrap, saved_world, loaded_world):
    expected = str(tmp_path / "expected.safetensors")
    run_distributed(save_worker, saved_world, str(tmp_path), "t", wrap, expected, False, group=True)
    run_distributed(load_worker, loaded_world, str(tmp_path), "t", wrap, expected, False, group=True)


def rank_state_error_worker(rank: int, world: int, root: str, trial: str, wrap: str, expected: str, drop: bool) -> None:
    model, optimizer, engine, _ = setup(wrap, seed=1)
    with pytest.raises(ac.CheckpointError, match="drop_rank_state=True") as caught:
        ac.RecoverHandler(recover_config(root, trial), SPEC).load(engine)
    assert "rng state differs" in str(caught.value) and "saved by 2 ranks, loading on 1" in str(caught.value)


def test_per_rank_state_that_differs_is_not_silently_reassigned(tmp_path):
    expected = str(tmp_path / "expected.safetensors")
    run_distributed(save_worker, 2, str(tmp_path), "t", "fsdp2", expected, True, group=True)
    run_distributed(rank_state_error_worker, 1, str(tmp_path), "t", "fsdp2", expected, False, group=True)
    run_distributed(load_worker, 1, str(tmp_path), "t", "fsdp2", expected, True, group=True)


def damaged_shard_worker(rank: int, world: int, root: str, trial: str, wrap: str, expected: str, drop: bool) -> None:
    _, _, engine, _ = setup(wrap, seed=1)
    # rank 1's report reaches rank 0 too: each rank names every rank's failure
    with pytest.raises(ac.CheckpointError, match=r"rank 1: \S+__1_0\.distcp: checksum mismatch"):
        ac.RecoverHandler(recover_config(root, trial), SPEC).load(engine)


def test_a_shard_damaged_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    expected = str(tmp_path / "expected.safetensors")
    run_distributed(save_worker, 2, str(tmp_path), "t", "fsdp2", expected, False, group=True)
    (shard,) = [path for path in tmp_path.rglob("__1_0.distcp") if path.parent.name == "default"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    run_distributed(damaged_shard_worker, 2, str(tmp_path), "t", "fsdp2", expected, False, group=True)


def whole_metadata_refused_worker(rank: int, world: int, root: str, trial: str, *_: object) -> None:
    _, _, engine, _ = setup("fsdp2", seed=1)
    with pytest.raises(ac.CheckpointError, match=r"default/dcp_metadata\.json: malformed DCP metadata"):
        ac.RecoverHandler(recover_config(root, trial), SPEC).load(engine)


def test_a_load_at_the_same_world_size_reads_its_slice_of_the_metadata_and_another_reads_it_whole(tmp_path):
    """Each rank reads the index and its own chunk file; the whole dcp_metadata.json (every
    rank's chunks) only when its slice does not hold its shards. Shown with a whole metadata
    file that no reader accepts (forged: its manifest entry matches)."""
    expected = str(tmp_path / "expected.safetensors")
    run_distributed(save_worker, 2, str(tmp_path), "t", "fsdp2", expected, False, group=True)
    (generation,) = tmp_path.rglob("gen-*")
    forge(generation, "default/dcp_metadata.json", b"{}")
    run_distributed(same_world_worker, 2, str(tmp_path), "t", "fsdp2", expected, False, group=True)
    run_distributed(whole_metadata_refused_worker, 1, str(tmp_path), "t", group=True)
