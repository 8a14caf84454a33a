"""Run recover_job.py as real processes, kill them, compare their results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import recover_job
import torch
from distributed import free_port, run_distributed, start_processes
from safetensors.torch import load_file
from threads import THREADS

HERE = Path(__file__).parent
JOB = HERE / "recover_job.py"


def _args(fileroot: Path, out: Path, wrap: str, extra: list[str]) -> list[str]:
    return ["--fileroot", str(fileroot), "--out", str(out), "--wrap", wrap, *extra]


def run_job(
    fileroot: Path, out: Path, world_size: int = 1, wrap: str = "none", extra: list[str] = (), group: bool | None = None
) -> list[int]:
    """Run the job on fresh processes to completion (or to its own --kill-at); returns exit codes.
    ``group``: a process group even for one rank (as torchrun makes), default: for several."""
    return run_distributed(recover_job.run, world_size, _args(fileroot, out, wrap, list(extra)), group=group)


def run_job_torchrun(
    fileroot: Path, out: Path, world_size: int, wrap: str, extra: list[str] = (), restarts: int = 0
) -> int:
    """Run the job under real torchrun (slow: every rank imports torch), its elastic agent
    restarting the workers up to ``restarts`` times; returns the exit code. A restarting job
    rendezvouses through c10d and keeps its process group's store apart from torchrun's, as
    docs/launching.md says: otherwise a restarted rank may read a dead rank's address."""
    port = free_port()
    where = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"] if restarts else [
        "--master-addr=127.0.0.1", f"--master-port={port}"
    ]  # fmt: skip
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={world_size}",
        f"--max-restarts={restarts}",
        *where,
        str(HERE / "recover_job.py"),
        *_args(fileroot, out, wrap, list(extra)),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE)}
    if restarts:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if completed.returncode != 0 and "--kill-at" not in extra:
        raise AssertionError(f"torchrun job failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return completed.returncode


def run_job_killed_when(
    fileroot: Path,
    out: Path,
    ready: Callable[[Path], bool],
    world_size: int = 1,
    wrap: str = "none",
    victim: int = 0,
) -> None:
    """Run the job and, as soon as ``ready(trial)`` holds, SIGKILL rank ``victim``, then the others
    (as torchrun tears down a job whose rank died)."""
    trial = fileroot / "checkpoints/tester/exp/bitexact"
    processes = start_processes(recover_job.run, world_size, _args(fileroot, out, wrap, []))
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if any(not p.is_alive() for p in processes):
                raise AssertionError(f"job ended before the kill point (exit codes {[p.exitcode for p in processes]})")
            try:
                if ready(trial):
                    os.kill(processes[victim].pid, signal.SIGKILL)
                    return
            except FileNotFoundError:
                pass
        raise AssertionError("kill point never reached")
    finally:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join()


def losses(out: Path, rank: int = 0) -> dict[int, list[str]]:
    """Every recorded loss per global step (a replayed step appears more than once)."""
    recorded: dict[int, list[str]] = {}
    for line in (out / f"losses-rank{rank}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        recorded.setdefault(entry["step"], []).append(entry["loss"])
    return recorded


def thread_counts(out: Path, rank: int = 0) -> set[int]:
    """The intra-op thread counts the steps of a run were computed with."""
    lines = (out / f"losses-rank{rank}.jsonl").read_text().splitlines()
    return {json.loads(line)["threads"] for line in lines}


def assert_same_run(reference: Path, resumed: Path, world_size: int) -> None:
    """Every step of both runs computed with the suite's thread count (tests/threads.py), then:
    bitwise equal final weights, optimizer state and LR on every rank; every loss equal."""
    for rank in range(world_size):
        counts = thread_counts(reference, rank) | thread_counts(resumed, rank)
        assert counts == {THREADS}, f"rank {rank}: steps ran with {sorted(counts)} threads, the suite pins {THREADS}"
        expected, actual = (
            load_file(reference / f"final-rank{rank}.safetensors"),
            load_file(resumed / f"final-rank{rank}.safetensors"),
        )
        assert expected.keys() == actual.keys()
        different = [name for name in expected if not torch.equal(expected[name], actual[name])]
        assert not different, f"rank {rank}: differs from the uninterrupted run: {different[:5]}"
        want, got = losses(reference, rank), losses(resumed, rank)
        assert want.keys() == got.keys()
        for step, values in got.items():
            assert set(values) == set(want[step]), f"rank {rank} step {step}: loss {values} != {want[step]}"


def pending_generation(trial: Path, skip: set[str]) -> Path | None:
    """A generation folder being written (not the committed one, not in ``skip``), if any."""
    store = trial / ".recover"
    if not store.is_dir():
        return None
    committed = os.readlink(store / "current") if (store / "current").is_symlink() else None
    if committed is None:
        return None  # wait until a first checkpoint is committed: then either outcome is possible
    for entry in store.iterdir():
        if entry.name.startswith("gen-") and entry.name != committed and entry.name not in skip:
            return entry
    return None
