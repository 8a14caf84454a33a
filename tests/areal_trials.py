"""Trials as AReaL's RecoverHandler leaves them, in its two layouts, written by our own code from
AReaL's description: SPMD trainers overwrite ``recover_info/`` and ``{engine}/recover_checkpoint/``
in place; single-controller trainers (AReaL PR #1616) write ``checkpoint_generations/
generation_step%08d/{manifest,payloads/{engine}}/`` and publish it by replacing ``LATEST``."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from recover_fixtures import SPEC, VOCAB, Setup
from test_dcp_interop import _AReaLShapedState, _flat
from torch.distributed.checkpoint.state_dict import get_state_dict
from torchdata.stateful_dataloader import StatefulDataLoader

IN_PLACE, GENERATIONS = "in_place", "generations"
LAYOUTS = (IN_PLACE, GENERATIONS)
STEPS = 8  # SPEC: 4 steps per epoch; the import resumes in epoch 1, after its first batch
DUMP_AFTER = 4  # global step 4: the first step of epoch 1


class Counter:
    """An evaluator / stats logger: state that must come back as it was."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = state["calls"]


def loader() -> StatefulDataLoader:
    return StatefulDataLoader(list(range(8)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))


def train(setups: list[Setup], batch: torch.Tensor) -> None:
    tokens = (batch.reshape(-1, 1) * 3 + torch.arange(8)) % VOCAB
    for setup in setups:
        setup.model(input_ids=tokens, labels=tokens).loss.backward()
        setup.optimizer.step()
        setup.scheduler.step()
        setup.optimizer.zero_grad()


def run(first: int, last: int, setups: list[Setup], data: StatefulDataLoader, batches: Any = None) -> Any:
    """Train global steps first..last over ``data``, a new epoch every SPEC.steps_per_epoch
    steps (``batches``: the epoch in progress, if any); returns the live iterator."""
    for global_step in range(first, last + 1):
        if batches is None or global_step % SPEC.steps_per_epoch == 0 and global_step != first:
            batches = iter(data)
        train(setups, next(batches))
    return batches


def flat_state(setup: Setup) -> dict[str, torch.Tensor]:
    return _flat(*get_state_dict(setup.model, setup.optimizer))


def _freq_ctl(steps: int, last_steps: int) -> dict[str, Any]:
    """The state of AReaL's EpochStepTimeFreqCtl, as its Saver / RecoverHandler dump it."""

    def control(count: int, last: int) -> dict[str, Any]:
        return {
            "frequence_seconds": None,
            "frequency_steps": 2,
            "start_time": 0.0,
            "steps": count,
            "last_time": 0.0,
            "last_steps": last,
            "interval_steps": 1,
            "interval_seconds": 0.1,
            "initial_value": False,
        }

    return {"epoch": control(1, 1), "step": control(steps, last_steps), "time": control(steps, 0)}


def write_recover_info(folder: Path, data: StatefulDataLoader, stats: Counter, global_step: int = DUMP_AFTER) -> None:
    """What AReaL's RecoverInfo.dump writes (json.dump, pickle.dump) into ``folder``."""
    folder.mkdir(parents=True)
    epoch, epoch_step = divmod(global_step, SPEC.steps_per_epoch)
    step = {
        "epoch": epoch,
        "epoch_step": epoch_step,
        "global_step": global_step,
        "steps_per_epoch": SPEC.steps_per_epoch,
    }
    (folder / "step_info.json").write_text(json.dumps(step, indent=4))
    (folder / "saver_info.json").write_text(json.dumps(_freq_ctl(global_step + 1, global_step)))
    (folder / "evaluator_info.json").write_text(json.dumps({"calls": 7}))
    (folder / "stats_logger_info.json").write_text(json.dumps(stats.state_dict()))
    (folder / "checkpoint_info.json").write_text(json.dumps(_freq_ctl(global_step + 1, global_step - 1)))
    with open(folder / "dataloader_info.pkl", "wb") as f:
        pickle.dump(data.state_dict(), f)


def write_payload(folder: Path, setup: Setup) -> None:
    """An FSDP engine's recovery save: ``dcp.save({"dcp": DCPState(model, optimizer)})``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process" notice
        dcp.save({"dcp": _AReaLShapedState(setup.model, setup.optimizer)}, checkpoint_id=str(folder))


def generation_name(global_step: int) -> str:
    return f"generation_step{global_step:08d}"


def publish_latest(trial: Path, global_step: int, engines: list[str]) -> None:
    """AReaL's LATEST: sorted-key JSON, written to a temporary file, fsynced, renamed over."""
    record = {"format_version": 1, "generation": generation_name(global_step), "global_step": global_step}
    record["engines"] = engines
    temporary = trial / ".LATEST.tmp"
    with open(temporary, "w") as stream:
        stream.write(json.dumps(record, indent=2, sort_keys=True))
        stream.flush()
        os.fsync(stream.fileno())
    temporary.replace(trial / "LATEST")


@dataclass
class AReaLTrial:
    """An AReaL trial after global step DUMP_AFTER and the uninterrupted run's final states
    (one per engine), each model's weights as dumped, and where its recover info and each
    engine's payload lie."""

    path: Path
    layout: str
    want: dict[str, dict[str, torch.Tensor]]
    dumped: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # each model's weights as dumped

    @property
    def info(self) -> Path:
        if self.layout == IN_PLACE:
            return self.path / "recover_info"
        return self.path / "checkpoint_generations" / generation_name(DUMP_AFTER) / "manifest"

    def payload(self, engine: str = "default") -> Path:
        if self.layout == IN_PLACE:
            return self.path / engine / "recover_checkpoint"
        return self.path / "checkpoint_generations" / generation_name(DUMP_AFTER) / "payloads" / engine

    def areal_entries(self) -> list[str]:
        """The top entries AReaL wrote in this layout (what the import moves aside), sorted."""
        if self.layout == IN_PLACE:
            return sorted(["recover_info", *self.want])
        return ["LATEST", "checkpoint_generations"]


def write_areal_trial(trial: Path, layout: str, engines: dict[str, Setup]) -> AReaLTrial:
    """Train ``engines`` (the actor as ``default``, maybe a ``critic``) DUMP_AFTER + 1 steps, dump
    them as AReaL does in ``layout``, and train on to the end for the reference states."""
    data = loader()
    setups = [engines[name] for name in sorted(engines)]
    batches = run(0, DUMP_AFTER, setups, data)
    stats = Counter()
    stats.calls = 5
    areal = AReaLTrial(trial, layout, {})
    trial.mkdir(parents=True, exist_ok=True)
    if layout == GENERATIONS:
        (areal.payload("default").parent).mkdir(parents=True)
    write_recover_info(areal.info, data, stats)
    for name, setup in engines.items():
        write_payload(areal.payload(name), setup)
        areal.dumped[name] = {key: value.clone() for key, value in setup.model.state_dict().items()}
    if layout == GENERATIONS:
        publish_latest(trial, DUMP_AFTER, list(engines))
    run(DUMP_AFTER + 1, STEPS - 1, setups, data, batches)
    areal.want = {name: flat_state(setup) for name, setup in engines.items()}
    return areal


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
        if p.name != ".areal_ckpt.lock"
    }
