"""`make torture`'s preemption rows: a real job (``recover_job.py``, one rank, asynchronous dumps
every 4 steps) preempted at a random step the way clusters deliver it, then restarted.

- ``preempt-async-group``: SIGTERM to the job's whole process group (SLURM, Kubernetes);
- ``preempt-tiered-group``: the same for a tiered trial (``local_dir`` in front of a folder);
- ``preempt-launch``: SIGUSR1 to ``areal-ckpt launch`` in front of the job (SLURM's ``--signal``).

A trial is ``resumed_correctly`` when the preempted job (or the launcher) exits 128 + N, the
step it was in is the committed one, and the restart runs every later step exactly once to the
end; ``lost`` when a step it had run is not committed (or the restart fails), ``wrong`` for any
other exit status or a step run twice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from recover_job import BATCH, DATASET, EPOCHS

from areal_ckpt.paths import generation_step

HERE = Path(__file__).parent
STEPS = DATASET // BATCH * EPOCHS
TRIAL = "checkpoints/tester/exp/bitexact"


def _steps_run(out: Path) -> list[int]:
    path = out / "losses-rank0.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _job(work: Path, tiered: bool) -> list[str]:
    command = [
        sys.executable,
        str(HERE / "recover_job.py"),
        "--fileroot",
        str(work / "root"),
        "--out",
        str(work / "out"),
    ]
    command += ["--mode", "async", "--freq-steps", "4", "--step-seconds", "0.2"]
    return command + (["--local-dir", str(work / "local")] if tiered else [])


def _one_trial(work: Path, how: str, at: int) -> tuple[str, str]:
    """Preempt the job ``how`` during step ``at``, restart it; the outcome and a note."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE)}
    tiered = how == "tiered-group"
    sig = signal.SIGUSR1 if how == "launch" else signal.SIGTERM
    job = [*_job(work, tiered), "--preemption-signals", sig.name]
    if how == "launch":
        config = work / "job.yaml"
        config.write_text(
            f"experiment_name: exp\ntrial_name: bitexact\nfileroot: {work / 'root'}\nuser: tester\n"
            f"recover:\n  mode: async\n  retries: 3\n  preemption_signals: [{sig.name}]\n"
        )
        job = [sys.executable, "-m", "areal_ckpt.cli.main", "launch", "--config", str(config), "--", *job]
    process = subprocess.Popen(job, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(_steps_run(work / "out")) < at:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            return "lost", f"{how} at {at}: the job ended or hung before step {at} ({process.returncode})"
        time.sleep(0.02)
    if how == "launch":
        process.send_signal(sig)
    else:
        os.killpg(process.pid, sig)
    try:
        _, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return "lost", f"{how} at {at}: no exit within 300 s of the signal"
    ran = _steps_run(work / "out")
    pointer = (work / "local/node0" if tiered else work / "root") / TRIAL / ".recover/current"
    if process.returncode != 128 + sig:
        return "wrong", f"{how} at {at}: exit status {process.returncode}, not {128 + sig}: {stderr[-300:]}"
    if not pointer.is_symlink() or generation_step(pointer.readlink().name) != ran[-1]:
        return (
            "lost",
            f"{how} at {at}: ran to step {ran[-1]}, committed {pointer.readlink() if pointer.is_symlink() else None}",
        )
    resumed = subprocess.run(_job(work, tiered), env=env, capture_output=True, text=True, timeout=600)
    if resumed.returncode != 0:
        return "lost", f"{how} at {at}: the restart failed ({resumed.returncode}): {resumed.stderr[-300:]}"
    if _steps_run(work / "out") != list(range(STEPS)):
        return "wrong", f"{how} at {at}: steps run {_steps_run(work / 'out')}"
    return "resumed_correctly", ""


def scenario_preemption(trials: int, rng: random.Random, work: Path, select: str | None = None) -> list:
    """Rows ``preempt-async-group``, ``preempt-tiered-group`` and ``preempt-launch`` (those whose
    id contains ``select``), ``trials`` each at steps drawn at random (each step once per
    ``STEPS - 2`` trials, before the last)."""
    from torture import Row

    rows = []
    for how in ("async-group", "tiered-group", "launch"):
        row = Row(f"preempt-{how}")
        if select is not None and select not in row.scenario:
            continue
        steps = list(range(1, STEPS - 1))  # the signal lands in a step with one after it
        for index in range(trials):
            if index % len(steps) == 0:
                rng.shuffle(steps)
            folder = work / f"preempt-{how}-{index}"
            folder.mkdir(parents=True)
            row.record(*_one_trial(folder, how, steps[index % len(steps)]))
        rows.append(row)
    return rows
