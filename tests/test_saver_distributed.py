"""Saver on 2 real processes (gloo): FSDP2 and DDP exports equal the single-process export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from helpers import manifest, read_export_tensors, saver_config, wrap_model
from transformers import AutoModelForCausalLM

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model
from areal_ckpt.formats.hf_export import plan_export

pytestmark = pytest.mark.dist

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)
VOCAB = 48
SHARD = "40KB"


def trained_model(wrap: str) -> torch.nn.Module:
    """Same weights on every rank and in the single-process run: seed, then one SGD step on fixed data."""
    torch.manual_seed(0)
    model = wrap_model(build_model(VOCAB), wrap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.arange(16).reshape(2, 8) % VOCAB
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    return model


def export_worker(rank: int, world_size: int, fileroot: str, wrap: str, trial: str) -> None:
    config = ac.SaverConfig(
        experiment_name="exp", trial_name=trial, fileroot=fileroot, user="tester", max_shard_size=SHARD, freq_steps=2
    )
    saver = ac.Saver(config, SPEC)
    engine = ac.TorchEngine(trained_model(wrap))
    paths = [saver.save(engine, 0, step, step) for step in range(2)]
    assert paths[0] is None and paths[1] is not None
    assert Path(paths[1]).is_dir()  # visible to every rank when save returns


def single_process_export(fileroot: Path) -> Path:
    saver = ac.Saver(saver_config(fileroot, max_shard_size=SHARD), SPEC)
    return Path(saver.save(ac.TorchEngine(trained_model("none")), 0, 1, 1, force=True))


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_two_rank_export_equals_single_process_export(fileroot, wrap):
    run_distributed(export_worker, 2, str(fileroot), wrap, f"{wrap}-trial")
    multi = fileroot / f"checkpoints/tester/exp/{wrap}-trial/default/epoch0epochstep1globalstep1"
    single = single_process_export(fileroot)

    single_tensors, multi_tensors = read_export_tensors(single), read_export_tensors(multi)
    assert single_tensors.keys() == multi_tensors.keys()
    for name in single_tensors:
        assert torch.equal(single_tensors[name], multi_tensors[name]), name
    shards = sorted(p.name for p in multi.glob("model-*.safetensors"))
    assert shards == sorted(p.name for p in single.glob("model-*.safetensors")) and len(shards) >= 2
    assert json.loads((multi / "model.safetensors.index.json").read_text()) == json.loads(
        (single / "model.safetensors.index.json").read_text()
    )
    assert manifest(multi)["world_size"] == 2
    assert [p.name for p in multi.parent.iterdir()] == [multi.name]  # no staging left behind
    loaded = AutoModelForCausalLM.from_pretrained(multi, local_files_only=True)
    assert torch.equal(loaded.lm_head.weight, single_tensors["lm_head.weight"])


def test_shard_files_are_dealt_to_both_ranks():
    specs = ac.TorchEngine(build_model(VOCAB)).export_specs()
    plan = plan_export(
        specs,
        ac.SaverConfig(experiment_name="e", trial_name="t", fileroot="/r", max_shard_size=SHARD).max_shard_size,
        None,
    )
    mine = [plan.files_of_rank(rank, 2) for rank in range(2)]
    assert mine[0] and mine[1]
    assert sorted(mine[0] + mine[1]) == sorted(plan.files)


def uneven_gather_worker(rank: int, world_size: int) -> None:
    """FSDP2 shards of uneven rows (47-row embeddings: 24 + 23; a 1-row tensor: 1 + 0), a
    replicated DTensor and one sharded by columns (all-gathered between the point-to-point
    steps) come back whole on their owners, in order, whether one rank receives
    while the other only sends, both receive at once (opposite orders, so each step sends one
    tensor each way), or one rank's file runs out before the other's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = build_model(47)
    model.register_parameter("one_row", torch.nn.Parameter(torch.arange(4.0).reshape(1, 4)))
    reference = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    replicated = torch.arange(6.0).reshape(2, 3)
    mesh = init_device_mesh("cpu", (world_size,))
    model.register_parameter("replicated", torch.nn.Parameter(distribute_tensor(replicated, mesh, [Replicate()])))
    reference["replicated"] = replicated
    columns = torch.arange(15.0).reshape(3, 5)
    model.register_parameter("columns", torch.nn.Parameter(distribute_tensor(columns, mesh, [Shard(1)])))
    reference["columns"] = columns
    engine = ac.TorchEngine(model)
    names = [spec.name for spec in engine.export_specs()]
    assert {"one_row", "model.embed_tokens.weight", "replicated", "columns"} <= set(names)
    rounds = [[[], names], [names], [names, names[::-1]], [names[:3], names]]
    for files in rounds:
        expected = files[rank] if rank < len(files) else []
        received = list(engine.gather_round(files))
        assert [name for name, _ in received] == expected, files
        for name, tensor in received:
            assert torch.equal(tensor, reference[name]), name


def test_fsdp2_gathers_rebuild_uneven_shards_exactly():
    run_distributed(uneven_gather_worker, 2)


def drifting_clock_worker(rank: int, world_size: int, decisions_file: str) -> None:
    """Rank 1's clock runs 7x faster than rank 0's: only rank 0's clock may decide."""
    ticks = [0.0]

    def clock() -> float:
        return ticks[0] * (7.0 if rank == 1 else 1.0)

    schedule = ac.TriggerSchedule(None, 5, 10, clock=clock)
    decisions = []
    for _ in range(12):
        ticks[0] += 3.0
        decisions.append(schedule.should_fire(False))
    Path(f"{decisions_file}.{rank}").write_text(json.dumps(decisions))


def test_ranks_agree_on_time_triggers_despite_clock_drift(tmp_path):
    run_distributed(drifting_clock_worker, 2, str(tmp_path / "decisions"))
    rank0 = json.loads((tmp_path / "decisions.0").read_text())
    rank1 = json.loads((tmp_path / "decisions.1").read_text())
    assert rank0 == rank1
    # rank 0's clock gives 3 s per step: time fires at steps 4, 8, 12 (every 12 s, its own clock
    # untouched by the count trigger), count at steps 5 and 10; rank 1's own clock would have
    # fired at step 2 already
    assert rank0 == [False, False, False, True, True, False, False, True, False, True, False, True]


def unshared_root_worker(rank: int, world_size: int, base: str) -> None:
    """Each rank sees its own folder under the same relative fileroot: two nodes whose
    "shared" file system is not shared."""
    import os

    node = Path(base) / f"node{rank}"
    node.mkdir(parents=True, exist_ok=True)
    os.chdir(node)
    config = ac.SaverConfig(experiment_name="exp", trial_name="t", fileroot="root", user="tester", max_shard_size=SHARD)
    saver = ac.Saver(config, SPEC)
    with pytest.raises(ac.CheckpointError, match=r"export failed \(nothing was published\)"):
        saver.save(ac.TorchEngine(trained_model("ddp")), 0, 1, 1, force=True)
    saver.finalize()


def test_a_rank_that_does_not_share_the_fileroot_fails_the_export_on_every_rank(tmp_path):
    # rank 1 writes its shards where rank 0 cannot see them: committing would publish an export
    # missing them, so the export fails on every rank and nothing is published
    run_distributed(unshared_root_worker, 2, str(tmp_path))
    model = tmp_path / "node0/root/checkpoints/tester/exp/t/default"
    published = [path.name for path in model.iterdir() if not path.name.startswith(".")] if model.exists() else []
    assert published == []
    assert not list((tmp_path / "node1").rglob("*.safetensors"))
