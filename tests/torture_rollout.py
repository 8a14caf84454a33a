"""`make torture`'s async RL rows: a real asynchronous RL job (``rollout_job.py``: a rollout
thread per rank drawing through a RolloutFrontier, a trainer dumping with ``rollout=`` after
every step) SIGKILLed at random instants, relaunched until it finishes.

- ``rollout-kill-1rank`` and ``rollout-kill-2ranks``: one to three kills per trial, each a
  random 0-50 ms after a random train step's ledger line (so it lands while a rollout is
  generating, while the step's dump is written, or between).

A trial is ``resumed_correctly`` when every prompt of every epoch was trained on exactly once
(the ledger the job keeps, cut back to the loaded step at each resume) and the final weights
are bitwise those of an uninterrupted run; ``lost`` when a prompt was never trained on (or the
job failed); ``wrong`` when one was trained on twice or the weights differ."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import rollout_job
import torch
from distributed import run_distributed, start_processes
from safetensors.torch import load_file


def _arguments(work: Path, name: str, generate_seconds: float = 0.0) -> list[str]:
    return [
        "--fileroot",
        str(work / name),
        "--out",
        str(work / f"{name}-out"),
        "--generate-seconds",
        str(generate_seconds),
    ]


def run_killed(work: Path, world: int, kills: int, rng: random.Random) -> int:
    """Run the job in ``work/killed``, SIGKILL every rank ``kills`` times (each once the ledger
    shows 1-3 more steps, after a further random pause), then let it finish; returns the kills
    made (a job that ended first is not killed again)."""
    steps = rollout_job.PROMPTS // world * rollout_job.EPOCHS // rollout_job.BATCH
    ledger = work / "killed-out" / "ledger-rank0.jsonl"
    made = 0
    for _ in range(kills):
        lines = len(ledger.read_text().splitlines()) if ledger.exists() else 0
        target = min(lines + rng.randint(1, 3), steps - 2)
        processes = start_processes(rollout_job.run, world, _arguments(work, "killed", 0.01))
        deadline = time.monotonic() + 240
        try:
            while time.monotonic() < deadline and all(process.is_alive() for process in processes):
                if ledger.exists() and len(ledger.read_text().splitlines()) >= target:
                    time.sleep(rng.uniform(0, 0.05))  # while generating, dumping or in between
                    made += 1
                    break
                time.sleep(0.005)
        finally:
            for process in processes:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGKILL)
                process.join()
    run_distributed(rollout_job.run, world, _arguments(work, "killed"))
    return made


def trained_counts(out: Path, world: int) -> dict[str, int]:
    """How many times each prompt key was trained on, over every rank's ledger."""
    counts: dict[str, int] = {}
    for rank in range(world):
        for line in (out / f"ledger-rank{rank}.jsonl").read_text().splitlines():
            for key in json.loads(line)["keys"]:
                counts[key] = counts.get(key, 0) + 1
    return counts


def run_reference(work: Path, world: int) -> None:
    """The uninterrupted run, in ``work/reference``."""
    run_distributed(rollout_job.run, world, _arguments(work, "reference"))


def one_trial(work: Path, reference: Path, world: int, kills: int, rng: random.Random) -> tuple[str, str]:
    """One killed run against the uninterrupted one in ``reference``; the outcome and a note."""
    try:
        made = run_killed(work, world, kills, rng)
    except AssertionError as error:
        return "lost", f"{world} rank(s): the job failed: {str(error)[-300:]}"
    if made == 0:
        return "wrong", f"{world} rank(s): the job ended before any kill (nothing was tested)"
    counts = trained_counts(work / "killed-out", world)
    expected = {f"{epoch}:{index}" for epoch in range(rollout_job.EPOCHS) for index in range(rollout_job.PROMPTS)}
    if set(counts) != expected:
        return "lost", f"{world} rank(s), {made} kills: never trained on {sorted(expected - set(counts))[:10]}"
    repeated = sorted(key for key, count in counts.items() if count > 1)
    if repeated:
        return "wrong", f"{world} rank(s), {made} kills: trained on twice {repeated[:10]}"
    for rank in range(world):
        mine = load_file(reference / "reference-out" / f"final-rank{rank}.safetensors")
        theirs = load_file(work / "killed-out" / f"final-rank{rank}.safetensors")
        if not all(torch.equal(mine[name], theirs[name]) for name in mine):
            return "wrong", f"{world} rank(s), {made} kills: final weights differ from the uninterrupted run"
    return "resumed_correctly", ""


def scenario_rollout(trials: int, rng: random.Random, work: Path, select: str | None = None) -> list:
    """Rows ``rollout-kill-1rank`` and ``rollout-kill-2ranks`` (those whose id contains
    ``select``), ``trials`` each."""
    from torture import Row

    rows = []
    for world in (1, 2):
        row = Row(f"rollout-kill-{world}rank{'s' if world > 1 else ''}")
        if select is not None and select not in row.scenario:
            continue
        reference = work / f"{row.scenario}-reference"
        run_reference(reference, world)
        for index in range(trials):
            folder = work / f"{row.scenario}-{index}"
            folder.mkdir(parents=True)
            row.record(*one_trial(folder, reference, world, rng.randint(1, 3), rng))
        rows.append(row)
    return rows
