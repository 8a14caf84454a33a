"""A DeepSpeed user adopting areal_ckpt mid-run: ``load_checkpoint`` resumes from DeepSpeed's
own ``engine.save_checkpoint`` folder bit for bit (ZeRO 0-3, 2 real ranks, CPU, gloo), and its
pickles are opened by the weights-only unpickler only: a hostile one is refused by name on
every rank and runs nothing."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from helpers import deepspeed_steps
from test_deepspeed import WORLD, deepspeed_engine
from test_saver_distributed import trained_model

import areal_ckpt as ac

pytestmark = pytest.mark.dist
TOKENS = torch.arange(16).reshape(2, 8) % 48


def losses(engine, steps: int) -> list[float]:
    return deepspeed_steps(engine, TOKENS, steps)


def native_worker(rank: int, world_size: int, root: str, stage: int, report: str) -> None:
    engine = deepspeed_engine(trained_model("none"), stage=stage)
    losses(engine, 2)
    engine.save_checkpoint(f"{root}/native", client_state={"rlhf_iteration": 7})  # DeepSpeed's own writer
    continued = losses(engine, 3)
    path, client_state = ac.load_checkpoint(engine, f"{root}/native")  # ours, on DeepSpeed's layout
    resumed = losses(engine, 3)
    counters = int(engine.global_steps)
    Path(f"{report}.{rank}").write_text(
        json.dumps(
            {
                "continued": continued,
                "resumed": resumed,
                "path": path,
                "client": client_state["rlhf_iteration"],
                "steps": counters,
            }
        )
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_load_checkpoint_resumes_deepspeeds_own_checkpoint_bit_exactly(tmp_path, stage):
    run_distributed(native_worker, WORLD, str(tmp_path), stage, str(tmp_path / "report"))
    for rank in range(WORLD):
        outcome = json.loads((tmp_path / f"report.{rank}").read_text())
        assert outcome["resumed"] == outcome["continued"]  # weights, masters, moments, LR, counters
        assert Path(outcome["path"]).parent == tmp_path / "native/global_step2"  # what DeepSpeed returns
        assert outcome["client"] == 7
        assert outcome["steps"] == 5


class _Hostile:
    def __reduce__(self):
        return (Path.touch, (Path(_Hostile.marker),))


def hostile_worker(rank: int, world_size: int, root: str, report: str) -> None:
    engine = deepspeed_engine(trained_model("none"), stage=1)
    losses(engine, 1)
    engine.save_checkpoint(f"{root}/native")
    if rank == 0:
        _Hostile.marker = f"{root}/pwned"
        target = Path(f"{root}/native/global_step1/mp_rank_00_model_states.pt")
        target.write_bytes(pickle.dumps({"module": _Hostile()}))
    torch.distributed.barrier()
    try:
        ac.load_checkpoint(engine, f"{root}/native")
    except ac.CheckpointError as error:
        Path(f"{report}.{rank}").write_text(str(error))


def test_a_hostile_pickle_in_deepspeeds_layout_is_refused_on_every_rank_and_runs_nothing(tmp_path):
    run_distributed(hostile_worker, WORLD, str(tmp_path), str(tmp_path / "refused"))
    for rank in range(WORLD):
        message = (tmp_path / f"refused.{rank}").read_text()
        assert (
            "mp_rank_00_model_states.pt: refused: it holds objects the weights-only unpickler does not build" in message
        )
    assert not (tmp_path / "pwned").exists()


def test_a_deepspeed_layout_needs_a_deepspeed_engine(tmp_path):
    (tmp_path / "native/global_step1").mkdir(parents=True)
    (tmp_path / "native/global_step1/mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(
        ac.CheckpointError,
        match=r"global_step1: a checkpoint in DeepSpeed's own layout: load it into a DeepSpeed engine",
    ):
        ac.load_checkpoint(ac.TorchEngine(trained_model("none")), tmp_path / "native", tag="global_step1")
