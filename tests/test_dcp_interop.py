"""Our recovery checkpoints are standard DCP checkpoints: stock ``dcp.load`` (the usual
``get_state_dict`` way and an AReaL engine's ``{"dcp": DCPState}`` way) and
``dcp_to_torch_save`` read them with no help from areal_ckpt; checkpoints of format 2 (before
the records) still load."""

from __future__ import annotations

import io
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from recover_fixtures import SPEC, dump_once, make_setup, recover_config, trial_dir
from safetensors.torch import load_file
from test_recover_world_size import save_worker
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import areal_ckpt as ac
from areal_ckpt.formats import torch_record
from areal_ckpt.tensors import tensor_bytes

V2_TRIAL = Path(__file__).parent / "data" / "recover_v2"  # written by areal_ckpt 142f1b8 (format 2)
V2_MODEL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def _flat(model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors under our flat names (``model.<fqn>``, ``optim.<fqn>.<key>``)."""
    flat = {f"model.{name}": value for name, value in model_state.items()}
    for fqn, entries in optim_state["state"].items():
        flat.update({f"optim.{fqn}.{key}": value for key, value in entries.items()})
    return flat


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _stock_load(folder: Path, seed: int = 1) -> tuple[Any, dict[str, torch.Tensor]]:
    """A fresh model + AdamW loaded from ``folder`` by stock dcp.load only; its flat state."""
    setup = make_setup(seed=seed)
    model_state, optim_state = get_state_dict(setup.model, setup.optimizer)
    state = {"dcp": {"model": model_state, "optim": optim_state}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process" notice
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    set_state_dict(setup.model, setup.optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return setup, _flat(*get_state_dict(setup.model, setup.optimizer))


def test_stock_dcp_load_reads_our_dump_bitwise(tmp_path):
    dumped = dump_once(tmp_path, steps=3)
    want = {name: value.clone() for name, value in _flat(*get_state_dict(dumped.model, dumped.optimizer)).items()}
    setup, got = _stock_load(trial_dir(tmp_path) / "default" / "recover_checkpoint")
    _assert_bitwise(got, want)
    assert setup.optimizer.param_groups[0]["lr"] == dumped.optimizer.param_groups[0]["lr"]  # stored for stock


class _AReaLShapedState(Stateful):
    """What an AReaL engine hands dcp.load: model + optimizer through the state-dict helpers."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


def test_an_areal_engines_own_dcp_load_reads_our_dump(tmp_path):
    dumped = dump_once(tmp_path, steps=2)
    want = _flat(*get_state_dict(dumped.model, dumped.optimizer))
    setup = make_setup(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            {"dcp": _AReaLShapedState(setup.model, setup.optimizer)},
            checkpoint_id=str(trial_dir(tmp_path) / "default" / "recover_checkpoint"),
            no_dist=True,
        )
    _assert_bitwise(_flat(*get_state_dict(setup.model, setup.optimizer)), want)


def test_dcp_to_torch_save_converts_our_dump_bitwise(tmp_path):
    dumped = dump_once(tmp_path, steps=2)
    want = _flat(*get_state_dict(dumped.model, dumped.optimizer))
    out = tmp_path / "whole.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(trial_dir(tmp_path) / "default" / "recover_checkpoint"), str(out))
    whole = torch.load(out, weights_only=True)["dcp"]
    _assert_bitwise(_flat(whole["model"], whole["optim"]), want)
    assert whole["optim"]["param_groups"][0]["lr"] == dumped.optimizer.param_groups[0]["lr"]


@pytest.mark.dist
def test_a_two_rank_fsdp2_dump_reads_back_on_one_rank_with_stock_tools(tmp_path):
    expected = str(tmp_path / "expected.safetensors")
    run_distributed(save_worker, 2, str(tmp_path), "t", "fsdp2", expected, False, group=True)
    want = load_file(expected)
    want.pop("lr")
    folder = tmp_path / "checkpoints/tester/exp/t/default/recover_checkpoint"
    _, got = _stock_load(folder)
    _assert_bitwise(got, want)
    out = tmp_path / "whole.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(folder), str(out))
    whole = torch.load(out, weights_only=True)["dcp"]
    _assert_bitwise(_flat(whole["model"], whole["optim"]), want)


def test_a_format_2_checkpoint_still_loads_bitwise(tmp_path):
    shutil.copytree(V2_TRIAL / "checkpoints", tmp_path / "checkpoints", symlinks=True)
    want = load_file(V2_TRIAL / "expected.safetensors")
    lr = want.pop("lr").item()
    setup = make_setup(seed=1, **V2_MODEL)
    info = ac.RecoverHandler(recover_config(tmp_path), SPEC).load(setup.engine)
    assert info is not None and info.last_step_info.global_step == 1
    _assert_bitwise(_flat(*get_state_dict(setup.model, setup.optimizer)), want)
    assert setup.optimizer.param_groups[0]["lr"] == lr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
@pytest.mark.parametrize("shape", [(), (0, 3), (5,), (3, 4, 2)])
def test_a_record_frame_around_raw_bytes_is_what_torch_load_reads(dtype, shape):
    tensor = (torch.arange(max(1, torch.Size(shape).numel())) % 7)[: torch.Size(shape).numel()].reshape(shape).to(dtype)
    frame = torch_record.frame_for(dtype, shape)
    record = frame.head + bytes(tensor_bytes(tensor)) + frame.tail
    assert len(frame.head) % torch_record.ALIGNMENT == 0 and len(record) % torch_record.ALIGNMENT == 0
    loaded = torch.load(io.BytesIO(record), weights_only=True)
    assert loaded.dtype == dtype and loaded.shape == torch.Size(shape) and torch.equal(loaded, tensor)


def test_a_record_past_4_gib_uses_zip64_fields_torch_reads():
    """Offsets and sizes past 4 GiB take zip64 fields; torch's reader takes them at any size, so
    the same code path is checked here with every size and offset past the threshold."""
    tensor = torch.arange(100, dtype=torch.float32)
    frame = torch_record._frame(torch.float32, (100,), 1)
    record = frame.head + tensor.numpy().tobytes() + frame.tail
    assert b"PK\x06\x06" in frame.tail  # the zip64 end-of-directory record
    assert torch.equal(torch.load(io.BytesIO(record), weights_only=True), tensor)
