"""DeepSpeed against its own behaviour: world-size changes reach one outcome on every rank,
module-only loads cross stages and world sizes, hints work, ZeRO-0 converts, pickles are refused
with one line."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from test_deepspeed import deepspeed_engine
from test_recover_failures import _RunsCode

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main

pytestmark = pytest.mark.dist

VOCAB = 48


def _model(seed: int):
    from areal_ckpt.demo.tiny import build_model

    torch.manual_seed(seed)
    return build_model(VOCAB)


def _train(engine, steps: int) -> None:
    for step in range(steps):
        tokens = (torch.arange(16).reshape(2, 8) * (step + 1)) % VOCAB
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()


def _full_weights(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def save_worker(rank: int, world: int, root: str, stage: int, tag: str) -> None:
    from safetensors.torch import save_file

    engine = deepspeed_engine(_model(0), stage=stage)
    _train(engine, 3)
    ac.save_checkpoint(engine, root, tag=tag, client_state={"saved_by": rank, "world": world})
    weights = _full_weights(engine)
    if rank == 0:
        save_file(weights, f"{root}/{tag}.expected.safetensors")
        engine.module.config.save_pretrained(root)


def load_worker(rank: int, world: int, root: str, stage: int, tag: str, options: dict, report: str) -> None:
    engine = deepspeed_engine(_model(7), stage=stage)
    outcome: dict = {"rank": rank}
    try:
        path, client_state = ac.load_checkpoint(engine, root, tag=tag, **options)
        outcome.update(loaded=True, client_state=client_state, global_steps=int(engine.global_steps))
        from safetensors.torch import load_file

        expected = load_file(f"{root}/{tag}.expected.safetensors")
        weights = _full_weights(engine)
        outcome["same_weights"] = all(torch.equal(weights[name], expected[name]) for name in expected)
        _train(engine, 1)  # and it trains on
        outcome["trains"] = True
    except ac.CheckpointError as error:
        outcome.update(loaded=False, error=str(error))
    Path(f"{report}.{rank}").write_text(json.dumps(outcome))


def _reports(report: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{report}.{rank}").read_text()) for rank in range(world)]


def _save(root: Path, stage: int, world: int, tag: str) -> None:
    run_distributed(save_worker, world, str(root), stage, tag, group=True)


def _load(root: Path, stage: int, world: int, tag: str, report: Path, **options) -> list[dict]:
    run_distributed(load_worker, world, str(root), stage, tag, options, str(report), group=True)
    return _reports(report, world)


def test_more_ranks_than_saved_load_on_every_rank_and_new_ranks_get_rank_0s_client_state(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 0, 1, "zero0")
    _save(root, 2, 1, "zero2")
    for _rank, entry in enumerate(_load(root, 0, 2, "zero0", tmp_path / "full")):  # ZeRO 0, full state
        assert entry["loaded"] and entry["same_weights"] and entry["trains"], entry
        assert entry["client_state"] == {"saved_by": 0, "world": 1} and entry["global_steps"] == 3
    for entry in _load(root, 2, 2, "zero2", tmp_path / "module", load_module_only=True):
        assert entry["loaded"] and entry["same_weights"] and entry["trains"], entry
        assert entry["global_steps"] == 0  # module only: the counters stay as DeepSpeed leaves them


def test_a_forged_client_state_fails_every_rank_with_the_same_error(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 2, 2, "zero2")
    forged = root / "zero2/client_state/rank0.json"
    forged.write_text("[1, 2]")
    manifest_path = root / "zero2/areal_ckpt_manifest.json"
    import zlib

    from areal_ckpt.publish import render_manifest

    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["client_state/rank0.json"] = {
        "size": forged.stat().st_size,
        "crc32": zlib.crc32(forged.read_bytes()),
    }
    manifest_path.write_bytes(render_manifest(manifest))
    entries = _load(root, 2, 2, "zero2", tmp_path / "forged")
    assert not entries[0]["loaded"] and not entries[1]["loaded"]
    assert entries[0]["error"] == entries[1]["error"] and "rank 0:" in entries[0]["error"]
    assert "rank0.json: expected an object" in entries[0]["error"]


def test_fewer_ranks_load_a_zero2_save_with_its_optimizer_on_every_rank(tmp_path):
    # it was refused ("ZeRO optimizer partitions were written by 2 ranks and cannot be loaded
    # by 1"), and the only way on was to drop the Adam moments
    root = tmp_path / "ckpt"
    _save(root, 2, 2, "zero2")
    (entry,) = _load(root, 2, 1, "zero2", tmp_path / "full")
    assert entry["loaded"] and entry["same_weights"] and entry["trains"] and entry["global_steps"] == 3, entry
    assert entry["client_state"] == {"saved_by": 0, "world": 2}


def test_module_only_loads_cross_zero_stages_and_optimizer_loads_where_partitions_match(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 0, 2, "zero0")
    _save(root, 1, 2, "zero1")
    _save(root, 3, 2, "zero3")
    for entry in _load(root, 1, 2, "zero0", tmp_path / "0to1", load_module_only=True):
        assert entry["loaded"] and entry["same_weights"] and entry["trains"], entry
    for entry in _load(root, 2, 2, "zero1", tmp_path / "1to2"):  # the same partitions: optimizer too
        assert entry["loaded"] and entry["same_weights"] and entry["trains"] and entry["global_steps"] == 3, entry
    for entry in _load(root, 2, 2, "zero3", tmp_path / "3to2", load_module_only=True):  # flattened -> full
        assert entry["loaded"] and entry["same_weights"] and entry["trains"], entry
    for entry in _load(root, 2, 2, "zero0", tmp_path / "0to2"):
        assert not entry["loaded"] and "does not fit stage 2" in entry["error"], entry
    for entry in _load(root, 3, 2, "zero1", tmp_path / "1to3"):  # other partitions: mapped parameter by parameter
        assert entry["loaded"] and entry["same_weights"] and entry["trains"] and entry["global_steps"] == 3, entry
    for entry in _load(root, 3, 2, "zero0", tmp_path / "0to3"):  # a torch optimizer's state: refused, with the way out
        assert not entry["loaded"] and "does not fit stage 3" in entry["error"], entry
        assert "load_module_only=True" in entry["error"]


def test_zero3_loads_the_model_from_any_stage_and_world_size_and_converts(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root = tmp_path / "ckpt"
    _save(root, 3, 2, "zero3")
    _save(root, 0, 2, "zero0")
    (entry,) = _load(root, 3, 1, "zero3", tmp_path / "one")  # the optimizer's partitions mapped too
    assert entry["loaded"] and entry["same_weights"] and entry["trains"] and entry["global_steps"] == 3, entry
    (entry,) = _load(root, 3, 1, "zero3", tmp_path / "module", load_module_only=True)  # resharded
    assert entry["loaded"] and entry["same_weights"] and entry["trains"], entry
    for entry in _load(root, 3, 2, "zero0", tmp_path / "0to3", load_module_only=True):  # whole -> partitions
        assert entry["loaded"] and entry["same_weights"] and entry["trains"], entry
    out = tmp_path / "hf"
    (root / "latest").write_text("zero3\n")
    assert cli_main(["convert-deepspeed", str(root), str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    expected = load_file(root / "zero3.expected.safetensors")
    assert all(torch.equal(p, expected[name]) for name, p in loaded.named_parameters())


def native_zero0_worker(rank: int, world: int, root: str) -> None:
    from safetensors.torch import save_file

    engine = deepspeed_engine(_model(0), stage=0)
    _train(engine, 2)
    engine.save_checkpoint(f"{root}/native")
    if rank == 0:
        save_file(_full_weights(engine), f"{root}/expected.safetensors")
        engine.module.config.save_pretrained(f"{root}/native")


def test_deepspeeds_own_zero0_checkpoint_converts_from_its_module_states(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_distributed(native_zero0_worker, 2, str(tmp_path))
    out = tmp_path / "hf"
    assert cli_main(["convert-deepspeed", str(tmp_path / "native"), str(out)]) == 0
    expected = load_file(tmp_path / "expected.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert all(torch.equal(p, expected[name]) for name, p in loaded.named_parameters())


def test_a_planted_pickle_gets_the_clis_one_line_error(tmp_path, capsys):
    tag = tmp_path / "ds/global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ds/latest").write_text("global_step1")
    _model(0).config.save_pretrained(tmp_path / "ds")
    marker = tmp_path / "code-ran"
    (tag / "mp_rank_00_model_states.pt").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    assert cli_main(["convert-deepspeed", str(tmp_path / "ds"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"areal-ckpt convert-deepspeed: error: {tag / 'mp_rank_00_model_states.pt'}: refused")
    assert "Traceback" not in err and not marker.exists()


def bf16_worker(rank: int, world: int, root: str, stage: int) -> None:
    import deepspeed

    torch.manual_seed(0)
    model = _model(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config
    )
    _train(engine, 2)
    engine.save_checkpoint(f"{root}/native")
    ac.save_checkpoint(engine, f"{root}/ours")
    if rank == 0:
        engine.module.config.save_pretrained(f"{root}/native")


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_checkpoints_convert_to_their_fp32_masters_as_zero_to_fp32_does(tmp_path, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from areal_ckpt.formats.deepspeed_pickles import weights_only_deepspeed_loads

    run_distributed(bf16_worker, 2, str(tmp_path), stage)
    with weights_only_deepspeed_loads():
        oracle = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "native"))
    assert cli_main(["convert-deepspeed", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 0
    exported = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(shard))
    assert exported and all(t.dtype == torch.float32 for t in exported.values())
    differing = [name for name, tensor in exported.items() if not torch.equal(tensor, oracle[name])]
    assert differing == []
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in exported.values())  # not bf16 values
    assert cli_main(["convert-deepspeed", str(tmp_path / "ours"), str(tmp_path / "hf16"), "--dtype", "bfloat16"]) == 0
    cast = load_file(next((tmp_path / "hf16").glob("*.safetensors")))
    assert all(t.dtype == torch.bfloat16 for t in cast.values())


def test_zero3_fp32_checkpoints_store_the_weights_once(tmp_path):
    from test_deepspeed import deepspeed_checkpoints_worker

    from areal_ckpt.formats.dcp_metadata import read_metadata_json

    run_distributed(deepspeed_checkpoints_worker, 2, str(tmp_path), 3)
    ours = next((tmp_path / "ours").glob("global_step*"))
    stored = read_metadata_json(ours / "model").state_dict_metadata
    assert any(name.startswith("optim.rank0.state.") for name in stored)
    assert not any(".master." in name for name in stored)  # the fp32 weights are the masters

    def size(folder: Path) -> int:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    native = next(p for p in (tmp_path / "native").iterdir() if p.is_dir())
    # ours adds a torch.save frame per tensor and the stock .metadata (tens of KiB on this tiny
    # model); a second copy of the fp32 weights would add about a third
    assert size(ours) <= 1.10 * size(native), (size(ours), size(native))


def recover_dump_worker(rank: int, world: int, root: str, stage: int) -> None:
    from recover_fixtures import SPEC, recover_config, step_info
    from safetensors.torch import save_file

    engine = deepspeed_engine(_model(0), stage=stage)
    _train(engine, 2)
    ac.RecoverHandler(recover_config(Path(root)), SPEC).dump(engine, step_info(1), force=True)
    weights = _full_weights(engine)
    if rank == 0:
        save_file(weights, f"{root}/expected.safetensors")


def recover_load_worker(rank: int, world: int, root: str, stage: int, no_load_optim: bool, report: str) -> None:
    from recover_fixtures import SPEC, recover_config

    engine = deepspeed_engine(_model(7), stage=stage)
    outcome: dict = {}
    try:
        handler = ac.RecoverHandler(recover_config(Path(root), no_load_optim=no_load_optim), SPEC)
        handler.load(engine, drop_rank_state=True)  # another world size: per-rank RNG cannot carry over
        from safetensors.torch import load_file

        expected = load_file(f"{root}/expected.safetensors")
        weights = _full_weights(engine)
        outcome.update(loaded=True, same_weights=all(torch.equal(weights[k], expected[k]) for k in expected))
    except ac.CheckpointError as error:
        outcome.update(loaded=False, error=str(error))
    Path(f"{report}.{rank}").write_text(json.dumps(outcome))


def test_recovery_hints_on_a_world_size_change_work(tmp_path):
    from recover_fixtures import trial_dir
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    for stage in (0, 3):  # ZeRO-0's optimizer (a torch one's state) does not fit ZeRO-3's partitions
        root = tmp_path / f"zero{stage}"
        run_distributed(recover_dump_worker, 2, str(root), stage)
        run_distributed(recover_load_worker, 1, str(root), 3, False, str(tmp_path / "r"), group=True)
        (entry,) = _reports(tmp_path / "r", 1)
        if stage == 0:
            assert not entry["loaded"] and "RecoverHandler: recover.no_load_optim" in entry["error"], entry
            run_distributed(recover_load_worker, 1, str(root), 3, True, str(tmp_path / "r"), group=True)  # the hint
            (entry,) = _reports(tmp_path / "r", 1)
        assert entry["loaded"] and entry["same_weights"], entry
        if stage == 3:  # and the dump exports to an HF folder
            out = tmp_path / "hf3"
            assert cli_main(["export", str(trial_dir(root)), str(out)]) == 0
            loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
            expected = load_file(root / "expected.safetensors")
            assert all(torch.equal(p, expected[name]) for name, p in loaded.named_parameters())


def _fp32_and_moments(engine) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master and Adam moments, whole, through DeepSpeed's own per-parameter
    reads (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state = {}
    for name, parameter in engine.module.named_parameters():
        state[f"{name}.fp32"] = safe_get_full_fp32_param(parameter).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{name}.{key}"] = safe_get_full_optimizer_state(parameter, key).detach().clone()
    return state


def _adam_steps(engine) -> list[float]:
    return [float(entry["step"]) for entry in engine.optimizer.optimizer.state.values()]


def _reshard_config(fileroot: str, staging: str) -> ac.RecoverConfig:
    """The trial ``exp/trial`` under ``fileroot`` (a folder or a bucket's URL), an object trial
    staged in ``staging`` (a node's own disk)."""
    return ac.RecoverConfig(
        experiment_name="exp", trial_name="trial", fileroot=fileroot, user="tester", mode="on", staging_dir=staging
    )


def reshard_dump_worker(rank: int, world: int, fileroot: str, out: str, stage: int, environment: dict) -> None:
    from recover_fixtures import SPEC, step_info
    from safetensors.torch import save_file

    os.environ.update(environment)
    engine = deepspeed_engine(_model(0), stage=stage)
    _train(engine, 2)
    ac.RecoverHandler(_reshard_config(fileroot, f"{out}/dump-node"), SPEC).dump(engine, step_info(1), force=True)
    state = _fp32_and_moments(engine)
    if rank == 0:
        save_file(state, f"{out}/optimizer.safetensors")
        Path(f"{out}/steps.json").write_text(json.dumps(_adam_steps(engine)))


def reshard_load_worker(rank: int, world: int, fileroot: str, out: str, stage: int, environment: dict) -> None:
    from recover_fixtures import SPEC
    from safetensors.torch import load_file

    os.environ.update(environment)
    engine = deepspeed_engine(_model(7), stage=stage)
    _train(engine, 1)  # its moments exist and DeepSpeed's views of them are linked: the load must fill them
    handler = ac.RecoverHandler(_reshard_config(fileroot, f"{out}/load-node"), SPEC)  # a node that never saw it
    info = handler.load(engine, drop_rank_state=True)  # another world size: per-rank RNG cannot carry over
    handler.close()
    expected, loaded = load_file(f"{out}/optimizer.safetensors"), _fp32_and_moments(engine)
    outcome = {
        "step": info.last_step_info.global_step,
        "differing": sorted(name for name in expected if not torch.equal(expected[name], loaded[name])),
        "compared": len(expected),
        "adam_steps": sorted(set(_adam_steps(engine))),
        "saved_adam_steps": sorted(set(json.loads(Path(f"{out}/steps.json").read_text()))),
        "global_steps": int(engine.global_steps),
    }
    _train(engine, 1)  # and it trains on
    outcome["trains"] = True
    Path(f"{out}/report.{rank}").write_text(json.dumps(outcome))


def _dump_and_load_elsewhere(
    fileroot: str, out: Path, saved: tuple[int, int], loaded: tuple[int, int], env: dict
) -> None:
    """Dump ZeRO ``saved`` = (ranks, stage) under ``fileroot``, then :func:`check_loads_elsewhere`."""
    run_distributed(reshard_dump_worker, saved[0], fileroot, str(out), saved[1], env)
    check_loads_elsewhere(fileroot, out, loaded, env)


def check_loads_elsewhere(fileroot: str, out: Path, loaded: tuple[int, int], env: dict) -> None:
    """Load the dump under ``fileroot`` as ZeRO ``loaded`` = (ranks, stage); each loading rank's
    masters, moments, steps and counters are what was saved, and it trains on."""
    world, stage = loaded
    run_distributed(reshard_load_worker, world, fileroot, str(out), stage, env, group=True)
    for outcome in _reports(out / "report", world):
        assert outcome["compared"] > 0 and outcome["differing"] == [], outcome
        assert outcome["step"] == 1 and outcome["global_steps"] == 2 and outcome["trains"], outcome
        assert outcome["adam_steps"] == outcome["saved_adam_steps"] == [2.0], outcome


@pytest.mark.parametrize(
    "saved, loaded",
    [((2, 2), (1, 2)), ((2, 2), (3, 3)), ((2, 3), (1, 3)), ((2, 3), (3, 1))],
    ids=[
        "zero2 on 2 into zero2 on 1",
        "zero2 on 2 into zero3 on 3",
        "zero3 on 2 into zero3 on 1",
        "zero3 on 2 into zero1 on 3",
    ],
)
def test_zero_optimizer_state_loads_into_other_partitions(tmp_path, saved, loaded):
    """A ZeRO 1-3 recovery dump resumes with its optimizer on another number of ranks and across
    ZeRO 1 / 2 and 3: each parameter's fp32 master and Adam moments, read back whole through
    DeepSpeed's own API, are bitwise what was saved, as are Adam's step and the engine's
    counters, and training goes on."""
    _dump_and_load_elsewhere(str(tmp_path / "root"), tmp_path, saved, loaded, {})


def test_zero_optimizer_state_maps_from_a_bucket_on_a_node_that_never_held_it(object_server, object_bucket, tmp_path):
    """The same from object storage, loaded on a node whose staging folder is empty: each rank
    brings down the saved partitions it reads (another rank's data file among them)."""
    _dump_and_load_elsewhere(f"{object_bucket}/runs", tmp_path, (2, 3), (3, 1), object_server.environment())


def sgd_load_worker(rank: int, world: int, root: str, no_load_optim: bool, report: str) -> None:
    import deepspeed
    from recover_fixtures import SPEC, recover_config

    model = _model(7)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    outcome: dict = {}
    try:
        ac.RecoverHandler(recover_config(Path(root), no_load_optim=no_load_optim), SPEC).load(engine)
        outcome["loaded"] = True
    except ac.CheckpointError as error:
        unchanged = all(torch.equal(p, before[name]) for name, p in engine.module.named_parameters())
        outcome.update(loaded=False, error=str(error), unchanged=unchanged)
    Path(f"{report}.{rank}").write_text(json.dumps(outcome))


def test_an_optimizer_of_another_class_is_refused_naming_both_before_anything_loads(tmp_path):
    """A ZeRO-2 dump of AdamW loaded into a ZeRO-2 engine with SGD: refused naming both classes,
    the weights untouched, with the way on (loading the model only), which works."""
    run_distributed(recover_dump_worker, 1, str(tmp_path / "root"), 2)
    run_distributed(sgd_load_worker, 1, str(tmp_path / "root"), False, str(tmp_path / "r"), group=True)
    (entry,) = _reports(tmp_path / "r", 1)
    assert not entry["loaded"] and entry["unchanged"], entry
    assert "saved from AdamW and cannot be loaded into SGD" in entry["error"], entry
    assert "recover.no_load_optim" in entry["error"]
    run_distributed(sgd_load_worker, 1, str(tmp_path / "root"), True, str(tmp_path / "r"), group=True)  # the hint
    assert _reports(tmp_path / "r", 1)[0]["loaded"]
