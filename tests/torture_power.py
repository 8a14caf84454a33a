"""`make torture`'s power-loss rows: dumps of a larger model on the crash file system
(tests/crashfs.py), cut at random points among every state a power cut could leave, each
rebuilt and loaded as after a reboot (see tests/test_power_loss.py for the short, exhaustive
version on small dumps)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from crashfs import MODELS, Mounted
from recover_fixtures import SPEC, make_setup, recover_config, step_info, train_step

import areal_ckpt as ac

LARGER = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=3)  # ~2 MB of weights


def scenario_power_loss(trials: int, rng: random.Random, work: Path) -> list:
    """One row per persistence model: ``trials`` random cut points of three recovery dumps."""
    from torture import Row

    mounted = Mounted(work / "power-loss")
    saved = []
    try:
        setup = make_setup(**LARGER)
        handler = ac.RecoverHandler(recover_config(mounted.mount, mode="sync"), SPEC)
        for step in range(3):
            train_step(setup, step)
            handler.dump(setup.engine, step_info(step), force=True)
            mounted.returned()
            saved.append({name: tensor.clone() for name, tensor in setup.model.state_dict().items()})
        handler.close()
    finally:
        mounted.close()
    rows = []
    for model in MODELS:
        row = Row(f"power-loss-{model}")
        total = mounted.count(model)
        picked = set(rng.sample(range(total), min(trials, total)))
        for index, newest, folder in mounted.states(model, work / "power-loss-states", picked):
            row.record(*_check(folder, newest, saved, index))
        rows.append(row)
    return rows


def _check(folder: Path, newest: int | None, saved: list[dict[str, torch.Tensor]], index: int) -> tuple[str, str]:
    """``resumed_correctly``; ``lost`` (an error, or older than the newest returned dump);
    ``wrong`` (weights not those of the step loaded, or a step never dumped)."""
    fresh = make_setup(seed=1, **LARGER)
    handler = ac.RecoverHandler(recover_config(folder, mode="sync"), SPEC)
    try:
        info = handler.load(fresh.engine)
    except ac.CheckpointError as error:
        return "lost", f"cut after event {index}: {error}"
    finally:
        handler.close()
    step = None if info is None else info.last_step_info.global_step
    if newest is not None and (step is None or step < newest):
        return "lost", f"cut after event {index}: loaded step {step}, step {newest} had returned"
    if step is not None and (step >= len(saved) or (newest is not None and step > newest + 1)):
        return "wrong", f"cut after event {index}: loaded step {step}, never dumped by then"
    if step is not None and not all(torch.equal(fresh.model.state_dict()[k], v) for k, v in saved[step].items()):
        return "wrong", f"cut after event {index}: weights are not those of step {step}"
    return "resumed_correctly", ""
