"""`areal-ckpt diff A B`: checkpoints of any kind we read, compared tensor by tensor."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from recover_fixtures import SPEC, make_setup, recover_config, step_info, train_step, trial_dir
from test_deepspeed import deepspeed_checkpoints_worker

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main
from areal_ckpt.tools.diff import compare_tensors, diff_checkpoints


def dumped(fileroot: Path, steps: int, **model) -> Path:
    """A trial holding one recovery dump after ``steps`` training steps; its folder."""
    setup = make_setup(**model)
    for step in range(steps):
        train_step(setup, step)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(setup.engine, step_info(max(steps - 1, 0)), force=True)
    handler.close()
    return trial_dir(fileroot)


def test_one_checkpoint_equals_itself_and_a_step_later_every_trained_tensor_differs(tmp_path, capsys):
    first, later = dumped(tmp_path / "a", 1), dumped(tmp_path / "b", 2)
    assert cli_main(["diff", str(first), str(first)]) == 0
    assert "equal bitwise, 0 differ" in capsys.readouterr().out
    assert cli_main(["diff", str(first), str(later), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (section,) = report["sections"]
    differing = {entry["name"]: entry for entry in section["differing"]}
    assert (
        not report["equal"] and section["compared"] == len(ac.TorchEngine(make_setup().model).module.state_dict()) * 4
    )
    assert "model.lm_head.weight" in differing and "optim.lm_head.weight.exp_avg" in differing
    assert all(entry["max_abs"] > 0 and not entry["within"] for entry in differing.values())
    loose = max(entry["max_abs"] for entry in differing.values())
    result = diff_checkpoints(first, later, atol=loose)
    assert result.equal and all(d.within and not d.equal for d in result.sections[0].differing)


def test_an_export_and_the_dump_of_the_same_weights_are_equal_the_optimizer_said_not_compared(
    tmp_path, capsys, tokenizer
):
    setup = make_setup()
    train_step(setup, 0)
    handler = ac.RecoverHandler(recover_config(tmp_path), SPEC)
    handler.dump(setup.engine, step_info(0), tokenizer=tokenizer, force=True)
    handler.close()
    assert cli_main(["export", str(trial_dir(tmp_path)), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert cli_main(["diff", str(tmp_path / "hf"), str(trial_dir(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "(export)" in out and "(recover)" in out and "optimizer state: only in B, not compared" in out


def test_names_in_one_side_only_and_shape_changes_are_listed(tmp_path, capsys):
    small, wider = dumped(tmp_path / "a", 1), dumped(tmp_path / "b", 1, hidden_size=96, intermediate_size=192)
    deeper = dumped(tmp_path / "c", 1, num_hidden_layers=3)
    assert cli_main(["diff", str(small), str(wider)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"changed model\.lm_head\.weight: torch\.float32 \[48, 64\] -> torch\.float32 \[48, 96\]", out)
    assert cli_main(["diff", str(small), str(deeper)]) == 1
    assert "only in B: model.model.layers.2.mlp.up_proj.weight" in capsys.readouterr().out


def test_a_damaged_file_is_named_and_nothing_compared(tmp_path, capsys):
    trial = dumped(tmp_path, 1)
    (data,) = trial.glob(".recover/gen-*/default/__0_0.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert cli_main(["diff", str(trial), str(trial)]) == 2
    assert f"{data}: checksum mismatch" in capsys.readouterr().err


def test_deepspeed_tags_ours_and_deepspeeds_own_of_one_engine_hold_the_same_weights(tmp_path, capsys):
    """The same ZeRO-2 engine saved by our save_checkpoint and by DeepSpeed's own: the weights
    are equal (DeepSpeed's own read through its fp32 rebuild); ours alone holds optimizer state."""
    run_distributed(deepspeed_checkpoints_worker, 2, str(tmp_path), 2)
    assert cli_main(["diff", str(tmp_path / "ours"), str(tmp_path / "native")]) == 0
    out = capsys.readouterr().out
    assert "(deepspeed)" in out and "optimizer state: only in A, not compared" in out


def test_a_stock_dcp_folder_compares_with_the_dump_it_came_from(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    setup = make_setup()
    train_step(setup, 0)
    dcp.save(
        {f"model.{k}": v for k, v in setup.model.state_dict().items()},
        checkpoint_id=str(tmp_path / "stock"),
        no_dist=True,
    )
    handler = ac.RecoverHandler(recover_config(tmp_path), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.close()
    assert cli_main(["diff", str(tmp_path / "stock"), str(trial_dir(tmp_path))]) == 0
    assert "(dcp)" in capsys.readouterr().out


def test_a_checkpoint_on_object_storage_compares_with_its_local_twin(tmp_path, object_bucket, capsys):
    setup = make_setup()
    train_step(setup, 0)
    for fileroot in (tmp_path, object_bucket):
        config = recover_config(tmp_path, staging_dir=str(tmp_path / "staging")).model_copy(
            update={"fileroot": str(fileroot)}
        )
        handler = ac.RecoverHandler(config, SPEC)
        handler.dump(setup.engine, step_info(0), force=True)
        handler.close()
    url = f"{object_bucket}/checkpoints/tester/exp/trial"
    assert cli_main(["diff", url, str(trial_dir(tmp_path))]) == 0
    assert "equal" in capsys.readouterr().out


def test_the_comparison_of_two_tensors():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert compare_tensors("t", a, a.clone(), 0, 0).equal  # NaN where both are NaN: bit for bit equal
    moved = compare_tensors("t", a, torch.tensor([1.0, float("nan"), 3.5]), 0, 0)
    assert not moved.equal and moved.max_abs == 0.5 and math.isclose(moved.max_rel, 0.5 / 3.5)
    assert compare_tensors("t", a, torch.tensor([1.0, float("nan"), 3.5]), 0.5, 0).within
    assert not compare_tensors("t", a, torch.tensor([1.0, 2.0, 3.0]), 1e9, 0).within  # NaN against a number
    half = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert (
        compare_tensors("t", half, half + 1, 0, 0.5).within and not compare_tensors("t", half, half + 1, 0, 0.4).within
    )
    with pytest.raises(ac.CheckpointError, match="not a folder"):
        diff_checkpoints(Path("/nonexistent-a"), Path("/nonexistent-b"))
