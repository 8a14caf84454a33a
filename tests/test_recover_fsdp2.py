"""RecoverHandler on 2 ranks with FSDP2 (gloo), real SIGKILLs: bit-exact resume, crash consistency."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from recovery_runs import assert_same_run, pending_generation, run_job, run_job_killed_when, run_job_torchrun

pytestmark = pytest.mark.dist

WORLD = 2  # 32 samples over 2 ranks, batch 4: 4 steps per epoch, dumps after steps 1, 3, 5, 7


def test_fsdp2_resume_after_kills_is_bit_exact(reference_run_fsdp2, tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    # step 3 is the last step of epoch 0 (killed right after its dump), under real torchrun;
    # step 4 is one step past a dump (replayed after resume)
    assert run_job_torchrun(root, out, WORLD, "fsdp2", ["--kill-at", "3"]) != 0
    assert run_job(root, out, world_size=WORLD, wrap="fsdp2", extra=["--kill-at", "4"]) == [-9, -9]
    run_job(root, out, world_size=WORLD, wrap="fsdp2")
    assert_same_run(reference_run_fsdp2, out, world_size=WORLD)


def _pending_has(relative: str, skip: set[str]):
    def ready(trial: Path) -> bool:
        pending = pending_generation(trial, skip)
        return pending is not None and (pending / relative).exists()

    return ready


def test_killing_either_rank_mid_dump_leaves_a_whole_checkpoint(reference_run_fsdp2, tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    trial = root / "checkpoints/tester/exp/bitexact"
    for relative, victim in [
        ("default/__1_0.distcp", 1),
        ("recover_info/rank1.json", 0),
        ("recover_info/areal_ckpt_manifest.json", 1),
    ]:
        store = trial / ".recover"
        skip = {p.name for p in store.iterdir()} if store.is_dir() else set()
        run_job_killed_when(root, out, _pending_has(relative, skip), world_size=WORLD, wrap="fsdp2", victim=victim)
        committed = os.readlink(store / "current")
        assert (store / committed / "recover_info/areal_ckpt_manifest.json").is_file(), relative
    run_job(root, out, world_size=WORLD, wrap="fsdp2")
    assert_same_run(reference_run_fsdp2, out, world_size=WORLD)
