"""DeepSpeed (CPU, gloo, 2 real ranks): recovery is bit-exact for ZeRO 0-3, exports match."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import areal_ckpt as ac
from distributed import run_distributed
from helpers import read_export_tensors, saver_config
from recovery_runs import assert_same_run, run_job
from test_saver_distributed import SHARD, SPEC, trained_model

pytestmark = pytest.mark.dist

WORLD = 2


def deepspeed_engine(model: torch.nn.Module, stage: int) -> object:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_resume_after_a_kill_is_bit_exact(tmp_path, stage):
    # dumps after steps 1, 3, 5, 7; killed one step past a dump, so step 4 is replayed; the
    # final weights, fp32 master partitions, optimizer moments, LR, step counters and every
    # loss must equal the uninterrupted run's
    wrap = f"zero{stage}"
    run_job(tmp_path / "ref/root", tmp_path / "ref/out", world_size=WORLD, wrap=wrap)
    root, out = tmp_path / "root", tmp_path / "out"
    assert run_job(root, out, world_size=WORLD, wrap=wrap, extra=["--kill-at", "4"]) == [-9, -9]
    run_job(root, out, world_size=WORLD, wrap=wrap)
    assert_same_run(tmp_path / "ref/out", out, world_size=WORLD)


def zero3_export_worker(rank: int, world_size: int, fileroot: str) -> None:
    engine = ac.DeepSpeedEngine(deepspeed_engine(trained_model("none"), stage=3))
    assert engine.is_sharded and all(p.data.numel() == 0 for p in engine.module.parameters())  # partitioned
    config = ac.SaverConfig(experiment_name="exp", trial_name="zero3", fileroot=fileroot, user="tester",
                            max_shard_size=SHARD)
    saver = ac.Saver(config, SPEC)
    saver.save(engine, 0, 1, 1, force=True)
    saver.finalize()


def test_zero3_export_gathers_piecewise_and_equals_the_single_process_export(fileroot):
    run_distributed(zero3_export_worker, WORLD, str(fileroot))
    multi = fileroot / "checkpoints/tester/exp/zero3/default/epoch0epochstep1globalstep1"
    saver = ac.Saver(saver_config(fileroot, max_shard_size=SHARD), SPEC)
    single = Path(saver.save(ac.TorchEngine(trained_model("none")), 0, 1, 1, force=True))
    expected, actual = read_export_tensors(single), read_export_tensors(multi)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert len(list(multi.glob("model-*.safetensors"))) >= 2
