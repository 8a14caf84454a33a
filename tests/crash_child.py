"""Child process for the Saver crash tests: exports a model again and again until it is killed."""

from __future__ import annotations

import sys

import torch

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model

CONFIG_FIELDS = dict(experiment_name="exp", trial_name="crash", user="tester", max_shard_size="2MB")


def model_for_step(step: int) -> torch.nn.Module:
    """Weights that differ per step, so a mix of two steps would be detectable."""
    torch.manual_seed(step)
    return build_model(512, hidden_size=256, intermediate_size=512, num_hidden_layers=4)


def run(rank: int, world_size: int, fileroot: str) -> None:
    """Entry point for tests/distributed.py: never returns; the test kills the process."""
    main(fileroot)


def main(fileroot: str) -> None:
    saver = ac.Saver(
        ac.SaverConfig(fileroot=fileroot, **CONFIG_FIELDS),
        ac.FinetuneSpec(total_train_epochs=1, dataset_size=10**6, train_batch_size=1),
    )
    step = 0
    while True:
        saver.save(ac.TorchEngine(model_for_step(step)), 0, step, step, force=True)
        step += 1


if __name__ == "__main__":
    main(sys.argv[1])
