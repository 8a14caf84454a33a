"""A tiny single-process training setup for RecoverHandler tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model, warmup_cosine

VOCAB = 48
SPEC = ac.FinetuneSpec(total_train_epochs=2, dataset_size=8, train_batch_size=2)  # 4 steps per epoch


@dataclass
class Setup:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: ac.TorchEngine


def make_setup(seed: int = 0, **model_overrides) -> Setup:
    torch.manual_seed(seed)
    model = build_model(VOCAB, **model_overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = warmup_cosine(optimizer, 2, SPEC.total_train_steps)
    return Setup(model, optimizer, scheduler, ac.TorchEngine(model, optimizer=optimizer, lr_scheduler=scheduler))


def train_step(setup: Setup, step: int) -> None:
    tokens = (torch.arange(16).reshape(2, 8) * (step + 1)) % VOCAB
    setup.model(input_ids=tokens, labels=tokens).loss.backward()
    setup.optimizer.step()
    setup.scheduler.step()
    setup.optimizer.zero_grad()


def step_info(global_step: int) -> ac.StepInfo:
    epoch, epoch_step = divmod(global_step, SPEC.steps_per_epoch)
    return ac.StepInfo(
        epoch=epoch, epoch_step=epoch_step, global_step=global_step, steps_per_epoch=SPEC.steps_per_epoch
    )


def recover_config(fileroot: Path, **fields) -> ac.RecoverConfig:
    fields.setdefault("mode", "on")
    return ac.RecoverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester", **fields)


def trial_dir(fileroot: Path) -> Path:
    return fileroot / "checkpoints/tester/exp/trial"


def committed_generation(fileroot: Path) -> Path:
    store = trial_dir(fileroot) / ".recover"
    return store / (store / "current").readlink()


def dump_once(fileroot: Path, steps: int = 2, **config) -> Setup:
    """Train ``steps`` steps and force one dump after the last; returns the trained setup."""
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot, **config), SPEC)
    for step in range(steps):
        train_step(setup, step)
    handler.dump(setup.engine, step_info(steps - 1), force=True)
    return setup
