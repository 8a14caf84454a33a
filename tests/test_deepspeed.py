"""DeepSpeed (CPU, gloo, 2 real ranks): recovery is bit-exact for ZeRO 0-3, exports match."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from helpers import deepspeed_steps, read_export_tensors, saver_config
from recovery_runs import assert_same_run, run_job
from test_saver_distributed import SHARD, SPEC, trained_model

import areal_ckpt as ac

pytestmark = pytest.mark.dist

WORLD = 2


def deepspeed_engine(model: torch.nn.Module, stage: int, node_local: bool = False) -> object:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "checkpoint": {"use_node_local_storage": node_local},
    }
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
    config = ac.SaverConfig(
        experiment_name="exp", trial_name="zero3", fileroot=fileroot, user="tester", max_shard_size=SHARD
    )
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


def deepspeed_checkpoints_worker(rank: int, world_size: int, root: str, stage: int) -> None:
    """Train a step, then save with DeepSpeed's own engine.save_checkpoint and with ours."""
    import deepspeed

    engine = deepspeed_engine(trained_model("none"), stage=stage)
    tokens = torch.arange(16).reshape(2, 8) % 48
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(f"{root}/native")
    ac.save_checkpoint(engine, f"{root}/ours")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        expected = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    if rank == 0:
        from safetensors.torch import save_file

        save_file(expected, f"{root}/expected.safetensors")
        engine.module.config.save_pretrained(f"{root}/native")  # as an HF training script keeps it


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_convert_deepspeed_checkpoints_to_loadable_hf_folders(tmp_path, stage):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from areal_ckpt.cli.main import main

    run_distributed(deepspeed_checkpoints_worker, WORLD, str(tmp_path), stage)
    expected = load_file(tmp_path / "expected.safetensors")
    for layout in ("native", "ours"):
        out = tmp_path / f"hf-{layout}"
        assert main(["convert-deepspeed", str(tmp_path / layout), str(out), "--max-shard-size", SHARD]) == 0
        loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        for name, parameter in loaded.named_parameters():
            assert torch.equal(parameter, expected[name]), f"{layout}: {name}"
    bf16 = tmp_path / "hf-bf16"
    assert main(["convert-deepspeed", str(tmp_path / "native"), str(bf16), "--dtype", "bfloat16"]) == 0
    assert AutoModelForCausalLM.from_pretrained(bf16, local_files_only=True).lm_head.weight.dtype == torch.bfloat16


def test_convert_deepspeed_without_a_config_says_what_is_missing(tmp_path, capsys):
    from areal_ckpt.cli.main import main

    (tmp_path / "ds/global_step1").mkdir(parents=True)
    (tmp_path / "ds/latest").write_text("global_step1")
    assert main(["convert-deepspeed", str(tmp_path / "ds"), str(tmp_path / "out")]) == 2
    assert "config.json: missing" in capsys.readouterr().err


def moe_worker(rank: int, world_size: int, root: str, stage: int, report: str) -> None:
    """DeepSpeed's own MoE layer with ep_size=2: each rank holds another expert under the same
    local parameter name. Train, save, train on, load, train again: the same losses."""
    import json

    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from areal_ckpt.demo.tiny import build_model

    torch.manual_seed(0)
    model = build_model(48)
    hidden = model.config.hidden_size

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = MoE(hidden_size=hidden, expert=torch.nn.Linear(hidden, hidden), num_experts=2, ep_size=2, k=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.moe(x)[0]

    model.model.layers[0].mlp = Experts()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3), config=config)
    tokens = torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(rank))

    def steps(count: int) -> list[float]:
        return deepspeed_steps(engine, tokens, count)

    steps(1)
    ac.save_checkpoint(ac.DeepSpeedEngine(engine), root, tag="step1")
    rng = torch.get_rng_state()  # the gate's random token selection draws from it; load_checkpoint leaves it
    continued = steps(3)
    ac.load_checkpoint(ac.DeepSpeedEngine(engine), root, tag="step1")
    torch.set_rng_state(rng)
    resumed = steps(3)
    metadata = json.loads((Path(root) / "step1/model/dcp_metadata.json").read_text())
    experts = sorted(name for name in metadata["tensors"] if "deepspeed_experts" in name)
    Path(f"{report}.{rank}").write_text(json.dumps({"continued": continued, "resumed": resumed, "experts": experts}))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_expert_parallel_moe_saves_every_expert_and_resumes_bit_exactly(tmp_path, stage):
    """ep_size=2 on 2 ranks: each expert is stored under its global index (both experts are in
    the checkpoint), and after a load each rank continues with its own experts, masters and
    moments: the continued losses equal the uninterrupted ones on every rank."""
    import json

    root = tmp_path / "ds"
    root.mkdir()
    run_distributed(moe_worker, WORLD, str(root), stage, str(tmp_path / "report"), timeout=600)
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"report.{rank}").read_text())
        assert report["resumed"] == report["continued"], f"rank {rank}"
        assert {".deepspeed_experts.0.weight", ".deepspeed_experts.1.weight"} <= {
            name[name.index(".deepspeed_experts") :] for name in report["experts"]
        }


def tag_validation_worker(rank: int, world_size: int, root: str, report: str) -> None:
    """Each mode of DeepSpeed's checkpoint.tag_validation, with ranks passing different tags."""
    import json
    import logging

    import deepspeed

    outcomes = {}
    for mode in ("Fail", "Warn", "Ignore"):
        torch.manual_seed(0)
        module = torch.nn.Linear(4, 4)
        config = {"train_micro_batch_size_per_gpu": 1, "checkpoint": {"tag_validation": mode}}
        engine, *_ = deepspeed.initialize(
            model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), config=config
        )
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("areal_ckpt").addHandler(handler)
        folder = Path(root) / mode
        try:
            ac.save_checkpoint(engine, folder, tag=f"rank{rank}-tag")
            outcome = sorted(os.listdir(folder))
        except ac.CheckpointError as error:
            outcome = f"{type(error).__name__}: {error}"
        finally:
            logging.getLogger("areal_ckpt").removeHandler(handler)
        outcomes[mode] = {"outcome": outcome, "warned": any("ranks passed different tags" in r for r in records)}
    Path(f"{report}.{rank}").write_text(json.dumps(outcomes))


def test_tag_validation_modes_as_deepspeed_defines_them_never_a_mixed_checkpoint(tmp_path):
    import json

    run_distributed(tag_validation_worker, WORLD, str(tmp_path / "ds"), str(tmp_path / "report"), timeout=600)
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in range(WORLD)]
    for rank, outcomes in enumerate(reports):
        assert outcomes["Fail"]["outcome"].startswith("RankMismatchError: save_checkpoint: ranks disagree on the tag")
        for mode in ("Warn", "Ignore"):
            assert outcomes[mode]["outcome"] == ["latest", "rank0-tag", "zero_to_fp32.py"], (
                rank,
                mode,
            )  # rank 0's tag, for all
        assert outcomes["Warn"]["warned"] and not outcomes["Ignore"]["warned"]  # every rank says so, as DeepSpeed
    assert (tmp_path / "ds/Warn/latest").read_text().strip() == "rank0-tag"


def node_local_worker(rank: int, world_size: int, root: str, report: str) -> None:
    import json

    import deepspeed

    outcomes = {}
    for node_local in (True, False):
        torch.manual_seed(0)
        module = torch.nn.Linear(4, 4)
        config = {"train_micro_batch_size_per_gpu": 1, "checkpoint": {"use_node_local_storage": node_local}}
        engine, *_ = deepspeed.initialize(
            model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), config=config
        )
        folder = Path(root) / str(node_local)
        try:
            ac.save_checkpoint(engine, folder, tag="step1")
            outcomes[str(node_local)] = sorted(os.listdir(folder))
        except ac.CheckpointError as error:
            outcomes[str(node_local)] = f"{error}|{folder.exists()}"
    Path(f"{report}.{rank}").write_text(json.dumps(outcomes))


def test_node_local_storage_is_refused_before_anything_is_written_and_the_default_saves(tmp_path):
    import json

    run_distributed(node_local_worker, WORLD, str(tmp_path / "ds"), str(tmp_path / "report"), timeout=600)
    for rank in range(WORLD):
        outcomes = json.loads((tmp_path / f"report.{rank}").read_text())
        refused, existed = outcomes["True"].rsplit("|", 1)
        assert (
            "checkpoint.use_node_local_storage is set" in refused
            and "Give an object store save_dir" in refused  # followed by the test of two nodes on the bucket
            and "or set use_node_local_storage to false" in refused
        )
        assert existed == "False"  # nothing was written
        assert outcomes["False"] == ["latest", "step1", "zero_to_fp32.py"]  # the hint followed


def nvme_worker(rank: int, world_size: int, root: str, report: str) -> None:
    """ZeRO-3 with the optimizer offloaded to NVMe (DeepSpeed's async_io over libaio), then the
    hint followed: offloaded to the CPU."""
    import json

    import deepspeed

    outcomes = {}
    for device in ("nvme", "cpu"):
        offload = {"device": device} | ({"nvme_path": f"{root}/swap-{rank}"} if device == "nvme" else {})
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {"stage": 3, "offload_optimizer": offload},
        }
        model = trained_model("none")
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
        tokens = torch.arange(16).reshape(2, 8) % 48
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        try:
            ac.save_checkpoint(engine, f"{root}/{device}", tag="t")
            outcomes[device] = sorted(os.listdir(f"{root}/{device}"))
        except ac.CheckpointError as error:
            outcomes[device] = str(error)
    Path(f"{report}.{rank}").write_text(json.dumps(outcomes))
    os._exit(0)  # DeepSpeed's NVMe swapper threads would keep the process alive


def test_nvme_offload_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    import json

    run_distributed(nvme_worker, WORLD, str(tmp_path), str(tmp_path / "report"), timeout=600)
    for rank in range(WORLD):
        outcomes = json.loads((tmp_path / f"report.{rank}").read_text())
        assert "offload_optimizer.device is nvme" in outcomes["nvme"] and "Offload to cpu" in outcomes["nvme"]
        assert "t" in outcomes["cpu"] and "latest" in outcomes["cpu"]  # the hint, followed
    assert not (tmp_path / "nvme").exists()


def deepspeed_apis_worker(rank: int, world_size: int, root: str, stage: int, report: str) -> None:
    """Train and dump one engine; load into a fresh one that never stepped; DeepSpeed's own
    per-parameter reads, its save_checkpoint and a step must work on it and give the saved values."""
    import json

    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    def read(engine) -> dict[str, list[torch.Tensor]]:
        values = {}
        for name, parameter in engine.module.named_parameters():
            values[name] = [
                safe_get_full_fp32_param(parameter).detach().cpu().clone(),
                *(
                    safe_get_full_optimizer_state(parameter, key).detach().cpu().clone()
                    for key in ("exp_avg", "exp_avg_sq")
                ),
            ]
        return values

    tokens = torch.arange(16).reshape(2, 8) % 48
    trained = deepspeed_engine(trained_model("none"), stage=stage)
    deepspeed_steps(trained, tokens, 2)
    saved = read(trained)
    handler = ac.RecoverHandler(ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot=root, mode="on"), SPEC)
    handler.dump(ac.DeepSpeedEngine(trained), ac.StepInfo(0, 1, 1, 10), force=True)
    handler.close()
    torch.manual_seed(123)
    fresh = deepspeed_engine(trained_model("none"), stage=stage)
    handler = ac.RecoverHandler(ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot=root, mode="on"), SPEC)
    handler.load(ac.DeepSpeedEngine(fresh))
    handler.close()
    loaded = read(fresh)
    differing = [name for name in saved if not all(torch.equal(a, b) for a, b in zip(saved[name], loaded[name]))]
    fresh.save_checkpoint(f"{root}/native-after-load")
    deepspeed_steps(fresh, tokens, 1)
    if rank == 0:
        Path(report).write_text(json.dumps({"parameters": len(saved), "differing": differing}))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_after_a_load_deepspeeds_own_apis_read_the_loaded_state_and_save(tmp_path, stage):
    """DeepSpeed links its per-parameter optimizer views at its first step; a load into an engine
    that never stepped links them too, so safe_get_full_optimizer_state (and fp32 params, and
    DeepSpeed's own save_checkpoint) work at once and give what was saved."""
    import json

    report = tmp_path / "report.json"
    run_distributed(deepspeed_apis_worker, WORLD, str(tmp_path / "root"), stage, str(report))
    result = json.loads(report.read_text())
    assert result["parameters"] > 0 and result["differing"] == []
    assert (tmp_path / "root/native-after-load/latest").is_file()
