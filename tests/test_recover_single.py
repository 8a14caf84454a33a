"""RecoverHandler, single process, real SIGKILLs: bit-exact resume and crash consistency."""

from __future__ import annotations

import os
from pathlib import Path

from recovery_runs import assert_same_run, pending_generation, run_job, run_job_killed_when

STEPS_PER_EPOCH = 8  # 32 samples, batch 4, one rank


def test_resume_after_kills_is_bit_exact(reference_run, tmp_path):
    # dumps every 2 steps (after steps 1, 3, 5, ...). Kill after step 5 (right after a dump,
    # mid-epoch), after step 6 (one step past a dump: step 6 is replayed), after step 7 (the
    # epoch's last step), then let the resumed run finish.
    root, out = tmp_path / "root", tmp_path / "out"
    for kill_at in (5, 6, 7):
        assert run_job(root, out, extra=["--kill-at", str(kill_at)]) == [-9]
    run_job(root, out)
    assert_same_run(reference_run, out, world_size=1)


def _in_generation(relative: str):
    def ready(trial: Path, skip: set[str]) -> bool:
        pending = pending_generation(trial, skip)
        return pending is not None and (pending / relative).exists()

    return ready


KILL_POINTS = {
    "generation-created": _in_generation("recover_info"),
    "model-shards-written": _in_generation("default/__0_0.distcp"),
    "rank-state-written": _in_generation("recover_info/rank0.json"),
    "manifest-written": _in_generation("recover_info/areal_ckpt_manifest.json"),
}


def debris(trial: Path) -> set[str]:
    store = trial / ".recover"
    return {p.name for p in store.iterdir()} if store.is_dir() else set()


def test_kill_at_any_point_of_a_dump_leaves_a_whole_checkpoint(reference_run, tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    trial = root / "checkpoints/tester/exp/bitexact"
    for name, ready in KILL_POINTS.items():
        skip = debris(trial)
        run_job_killed_when(root, out, lambda t: ready(t, skip))
        committed = os.readlink(trial / ".recover/current")
        assert (trial / ".recover" / committed / "recover_info/areal_ckpt_manifest.json").is_file(), name
    run_job(root, out)
    assert_same_run(reference_run, out, world_size=1)
    assert sorted(p.name for p in (trial / ".recover").iterdir()) == [
        "current",
        os.readlink(trial / ".recover/current"),
    ]
