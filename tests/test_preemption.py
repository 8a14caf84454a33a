"""Preemption (`recover.preemption_signals`): a signal to any rank makes every rank dump the step
it is in and exit with 128 + the signal's number; the restart runs every step exactly once and
ends bitwise equal to an uninterrupted run. Real processes, real signals: to one rank, during an
asynchronous dump, twice, to torchrun's whole process group, and under torchrun's own elastic
agent, which restarts the job by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import recover_job
from distributed import free_port, start_processes
from object_helpers import keys_under
from recovery_runs import HERE, assert_same_run, run_job, run_job_torchrun

import areal_ckpt as ac
from areal_ckpt.paths import generation_step

TRIAL = "checkpoints/tester/exp/bitexact"
NO_PERIODIC_DUMPS = ["--freq-steps", "100"]  # the only dump is the preemption's (besides the last step's)


def preempted_run(fileroot: Path, out: Path, world_size: int, wrap: str, extra: list[str]) -> list[int]:
    """Run the job until it exits by itself; its exit codes (no rank may hang)."""
    args = ["--fileroot", str(fileroot), "--out", str(out), "--wrap", wrap, *extra]
    processes = start_processes(recover_job.run, world_size, args)
    for process in processes:
        process.join(300)
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
    assert not hung, f"ranks {hung} hung"
    return [process.exitcode for process in processes]


def held_job(command: list[str], held: Path, ranks: int, environment: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``command`` (a recover_job with ``--hold held``; ``environment`` added to this one) in
    a session of its own; return once every rank is held mid-run, so the test signals a job that
    is surely still training."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE), **(environment or {})}
    job = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a bound on a job that hangs, not a race with it
    while not all((held / f"held-rank{rank}").exists() for rank in range(ranks)):
        assert job.poll() is None and time.monotonic() < deadline, "the job never reached its hold"
        time.sleep(0.05)
    return job


def committed_step(fileroot: Path) -> int:
    return generation_step((fileroot / TRIAL / ".recover/current").readlink().name)


def steps_run(out: Path, rank: int = 0) -> list[int]:
    return [json.loads(line)["step"] for line in (out / f"losses-rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.dist
def test_a_signal_to_one_rank_makes_every_rank_dump_that_step_and_exit(reference_run_fsdp2, tmp_path):
    fileroot, out = tmp_path / "root", tmp_path / "out"
    extra = ["--preemption-signals", "SIGUSR1,SIGTERM", "--signal-at", "5", "--signal-ranks", "1", *NO_PERIODIC_DUMPS]
    assert preempted_run(fileroot, out, 2, "fsdp2", extra) == [128 + signal.SIGUSR1] * 2
    assert committed_step(fileroot) == 5 and not (out / "final-rank0.safetensors").exists()
    run_job(fileroot, out, world_size=2, wrap="fsdp2", extra=NO_PERIODIC_DUMPS)
    assert steps_run(out, 0) == steps_run(out, 1) == list(range(8))  # every step exactly once
    assert_same_run(reference_run_fsdp2, out, world_size=2)


@pytest.mark.parametrize(
    "when",
    [
        ["--mode", "async", "--freq-steps", "2", "--signal-at", "4"],  # step 3's dump still being written
        ["--freq-steps", "2", "--signal-in-dump-at", "3"],  # while step 3's due dump is taken
        ["--freq-steps", "2", "--signal-at", "3", "--signal-in-dump-at", "3"],  # and again during that dump
    ],
    ids=["during-an-async-dump", "during-a-dump", "twice"],
)
def test_a_signal_during_a_dump_or_twice_ends_the_job_after_a_whole_dump(reference_run, tmp_path, when):
    fileroot, out = tmp_path / "root", tmp_path / "out"
    preempted = int(when[when.index("--signal-at") + 1]) if "--signal-at" in when else 3
    assert preempted_run(fileroot, out, 1, "none", ["--preemption-signals", "SIGUSR1", *when]) == [138]
    assert committed_step(fileroot) == preempted and steps_run(out) == list(range(preempted + 1))
    run_job(fileroot, out, extra=["--freq-steps", "2"])
    assert steps_run(out) == list(range(16))
    assert_same_run(reference_run, out, world_size=1)


def test_a_loop_that_asks_stops_by_itself_after_the_dump(reference_run, tmp_path):
    fileroot, out = tmp_path / "root", tmp_path / "out"
    extra = ["--preemption-signals", "SIGTERM", "--signal", "SIGTERM", "--signal-at", "6", "--ask", *NO_PERIODIC_DUMPS]
    assert preempted_run(fileroot, out, 1, "none", extra) == [0]  # the loop's own clean return
    assert committed_step(fileroot) == 6 and steps_run(out) == list(range(7))
    run_job(fileroot, out, extra=NO_PERIODIC_DUMPS)
    assert_same_run(reference_run, out, world_size=1)


def test_without_preemption_signals_a_signal_keeps_its_usual_effect(tmp_path):
    fileroot, out = tmp_path / "root", tmp_path / "out"
    codes = preempted_run(fileroot, out, 1, "none", ["--signal", "SIGTERM", "--signal-at", "2", *NO_PERIODIC_DUMPS])
    assert codes == [-signal.SIGTERM] and not (fileroot / TRIAL / ".recover/current").exists()


def test_an_unknown_signal_name_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"'SIGKILL' is not a signal a process can catch"):
        ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot=str(tmp_path), preemption_signals=["SIGKILL"])
    config = ac.RecoverConfig(
        experiment_name="e", trial_name="t", fileroot=str(tmp_path), preemption_signals=["SIGUSR2"]
    )
    assert config.preemption_signals == ("SIGUSR2",)  # the hint's form


@pytest.mark.dist
@pytest.mark.parametrize("event", ["preempted", "killed"])
def test_torchruns_elastic_agent_restarts_the_job_which_resumes_bit_exact(reference_run_fsdp2, tmp_path, event):
    fileroot, out = tmp_path / "root", tmp_path / "out"
    if event == "preempted":
        extra = ["--preemption-signals", "SIGUSR1", "--signal-at", "5", *NO_PERIODIC_DUMPS]
    else:
        extra = ["--kill-at", "5", "--freq-steps", "2"]  # SIGKILL right after step 5's dump, on both ranks
    assert run_job_torchrun(fileroot, out, 2, "fsdp2", extra, restarts=1) == 0  # its agent restarted it
    assert steps_run(out, 0) == steps_run(out, 1) == list(range(8))  # on after step 5, every step once
    assert_same_run(reference_run_fsdp2, out, world_size=2)


@pytest.mark.dist
def test_sigterm_to_torchruns_process_group_dumps_the_step_every_rank_is_in(reference_run_fsdp2, tmp_path):
    """As SLURM and Kubernetes signal a job: its whole process group, torchrun included, at a
    step mid-run; the restart (by the cluster, here the test) resumes after it."""
    fileroot, out, held = tmp_path / "root", tmp_path / "out", tmp_path / "held"
    held.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(HERE / "recover_job.py"),
        "--fileroot", str(fileroot), "--out", str(out), "--wrap", "fsdp2", "--preemption-signals", "SIGTERM",
        "--hold", str(held), "--hold-at", "2", *NO_PERIODIC_DUMPS,
    ]  # fmt: skip
    job = held_job(command, held, ranks=2)
    os.killpg(job.pid, signal.SIGTERM)
    (held / "go").touch()
    _, stderr = job.communicate(timeout=300)
    assert job.returncode != 0, stderr[-3000:]
    dumped = committed_step(fileroot)
    assert steps_run(out, 0) == steps_run(out, 1) == list(range(dumped + 1)), stderr[-3000:]
    assert run_job_torchrun(fileroot, out, 2, "fsdp2", NO_PERIODIC_DUMPS) == 0
    assert steps_run(out, 0) == steps_run(out, 1) == list(range(8))  # every step exactly once
    assert_same_run(reference_run_fsdp2, out, world_size=2)


@pytest.mark.parametrize("tier", [False, True], ids=["async", "async-tiered"])
def test_sigterm_to_an_async_jobs_process_group_spares_its_writer_and_dumps_the_step(reference_run, tmp_path, tier):
    """SLURM, Kubernetes and `kill -TERM -PGID` signal the whole group: the background writer
    (and a tiered trial's uploader) must not die of it, so the preemption dump completes."""
    fileroot, out, held = tmp_path / "root", tmp_path / "out", tmp_path / "held"
    held.mkdir()
    tiered = ["--local-dir", str(tmp_path / "local")] if tier else []
    command = [
        sys.executable, str(HERE / "recover_job.py"), "--fileroot", str(fileroot), "--out", str(out),
        "--mode", "async", "--freq-steps", "2", "--preemption-signals", "SIGTERM", *tiered,
        "--hold", str(held), "--hold-at", "3",  # just after step 3's dump went to the background writer
    ]  # fmt: skip
    job = held_job(command, held, ranks=1)
    os.killpg(job.pid, signal.SIGTERM)
    (held / "go").touch()
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    trial = (tmp_path / "local/node0" if tier else fileroot) / TRIAL
    dumped = generation_step((trial / ".recover/current").readlink().name)
    assert steps_run(out) == list(range(dumped + 1)), stderr[-3000:]  # the step it was in, dumped
    run_job(fileroot, out, extra=["--freq-steps", "2", *tiered])
    assert steps_run(out) == list(range(16))  # every step exactly once
    assert_same_run(reference_run, out, world_size=1)


def test_a_preempted_tiered_job_whose_persistent_tier_is_down_exits_128_plus_n_leaving_the_upload(
    reference_run, own_s3_server, tmp_path
):
    """The local commit is the preemption's promise; the upload to a store that does not answer
    is given recover.preemption_upload_seconds, then left to the next run (it used to be retried
    at close for about 110 s, and the job exited 1)."""
    server = own_s3_server
    server.make_bucket("preempted")
    fileroot, out, local, held = "s3://preempted/root", tmp_path / "out", tmp_path / "local", tmp_path / "held"
    held.mkdir()
    command = [
        sys.executable, str(HERE / "recover_job.py"), "--fileroot", fileroot, "--out", str(out),
        "--local-dir", str(local), "--preemption-signals", "SIGTERM", "--freq-steps", "2",
        "--hold", str(held), "--hold-at", "3",
    ]  # fmt: skip
    job = held_job(command, held, ranks=1, environment={"AREAL_CKPT_STORAGE_TIMEOUT": "2"})
    deadline = time.monotonic() + 300
    while not any("/.recover/.commits/" in key for key in keys_under("s3://preempted", "root/")):
        assert job.poll() is None and time.monotonic() < deadline, "the job never uploaded"  # a live store
        time.sleep(0.1)
    server.kill()
    os.killpg(job.pid, signal.SIGTERM)  # recorded while held; the next step's dump is the preemption dump
    (held / "go").touch()
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "is not uploaded within recover.preemption_upload_seconds=10; the local tier keeps it" in stderr
    trial = local / "node0" / TRIAL
    dumped = generation_step((trial / ".recover/current").readlink().name)
    assert steps_run(out) == list(range(dumped + 1))  # the step it was in, committed locally
    server.start()
    environment = ["--environment", json.dumps(server.environment())]
    run_job(fileroot, out, extra=["--freq-steps", "2", "--local-dir", str(local), *environment])
    assert steps_run(out) == list(range(16))  # every step exactly once
    assert_same_run(reference_run, out, world_size=1)
