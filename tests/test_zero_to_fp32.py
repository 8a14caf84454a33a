"""DeepSpeed's fp32 recovery functions (get_fp32_state_dict_from_zero_checkpoint,
load_state_dict_from_zero_checkpoint, convert_zero_checkpoint_to_fp32_state_dict) and the
offline zero_to_fp32.py script, on 2 real DeepSpeed ranks (CPU, gloo, ZeRO 1-3): on DeepSpeed's
own checkpoints they equal DeepSpeed's functions, on ours they give the same state."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from safetensors.torch import load_file
from test_deepspeed import WORLD, deepspeed_checkpoints_worker
from test_saver_distributed import trained_model

import areal_ckpt as ac
from areal_ckpt.formats.deepspeed_pickles import weights_only_deepspeed_loads
from areal_ckpt.tools.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

pytestmark = pytest.mark.dist

SHARD = "40KB"


def deepspeed_oracle(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own function on DeepSpeed's own checkpoint (its loads made weights-only)."""
    from deepspeed.utils import zero_to_fp32

    with weights_only_deepspeed_loads():
        return dict(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir)))


def same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    different = [k for k in expected if expected[k].dtype != actual[k].dtype or not torch.equal(expected[k], actual[k])]
    assert not different, different[:5]


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_three_functions_and_the_script_equal_deepspeeds_own(tmp_path, stage):
    run_distributed(deepspeed_checkpoints_worker, WORLD, str(tmp_path), stage)
    native, ours = tmp_path / "native", tmp_path / "ours"
    oracle = deepspeed_oracle(native)
    assert oracle and all(t.dtype == torch.float32 for t in oracle.values())

    same(oracle, get_fp32_state_dict_from_zero_checkpoint(native))  # DeepSpeed's layout, through us
    same(oracle, get_fp32_state_dict_from_zero_checkpoint(ours))  # ours: the same training state
    same(oracle, get_fp32_state_dict_from_zero_checkpoint(ours, tag="global_step1"))

    model = load_state_dict_from_zero_checkpoint(trained_model("none"), ours)
    same({k: v for k, v in oracle.items() if k in dict(model.named_parameters())}, dict(model.named_parameters()))

    from deepspeed.utils import zero_to_fp32

    with weights_only_deepspeed_loads():
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
            str(native), str(tmp_path / "by-deepspeed"), max_shard_size=SHARD, safe_serialization=True
        )
    convert_zero_checkpoint_to_fp32_state_dict(ours, tmp_path / "by-us", max_shard_size=SHARD, safe_serialization=True)
    files = sorted(p.name for p in (tmp_path / "by-deepspeed").iterdir())
    assert sorted(p.name for p in (tmp_path / "by-us").iterdir()) == files and len(files) > 2  # shards + index
    same(read_folder(tmp_path / "by-deepspeed"), read_folder(tmp_path / "by-us"))

    # offline: the script in the save_dir, with areal_ckpt and DeepSpeed unimportable
    script = ours / "zero_to_fp32.py"
    blocked = (
        "import runpy, sys; sys.modules['areal_ckpt'] = sys.modules['deepspeed'] = None; "
        f"sys.argv = [{str(script)!r}, *sys.argv[1:]]; runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    command = [sys.executable, "-c", blocked, str(ours), str(tmp_path / "offline"), "--safe_serialization"]
    completed = subprocess.run([*command, "--max_shard_size", SHARD], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    same(oracle, read_folder(tmp_path / "offline"))
    index = (tmp_path / "offline/model.safetensors.index.json").read_text()
    assert '"weight_map"' in index


def test_the_script_refuses_a_damaged_file_by_name(tmp_path):
    run_distributed(deepspeed_checkpoints_worker, WORLD, str(tmp_path), 2)
    ours = tmp_path / "ours"
    data = next((ours / "global_step1/model").glob("__1_0.distcp"))
    damaged = bytearray(data.read_bytes())
    damaged[-100] ^= 0xFF
    data.write_bytes(bytes(damaged))
    completed = subprocess.run(
        [sys.executable, str(ours / "zero_to_fp32.py"), str(ours), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 2
    assert f"{data}: CRC-32 differs from the manifest's: the file is damaged" in completed.stderr
    with pytest.raises(ac.CheckpointError, match=r"__1_0\.distcp"):
        get_fp32_state_dict_from_zero_checkpoint(ours)
