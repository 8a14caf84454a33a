"""`areal-ckpt launch` never leaves a job behind: a closed terminal (SIGHUP), a SIGKILLed
launcher, a wrapper shell and an attempt's leftover children all end the processes they should,
and a leftover holding the job's stderr does not stop the relaunch. Every wait is for an event
(a file the job writes, a process ending), bounded so that a regression fails instead of hanging."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_areal_dropin import _job_yaml

DEADLINE = 120.0


def _launcher(config: Path, *job: str, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "areal_ckpt.cli.main", "launch", "--config", str(config), "--", *job]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True, **popen)


def _python_job(pid_file: Path, then: str = "while True: time.sleep(0.05)") -> list[str]:
    """A job that writes its pid to ``pid_file`` (the event the test waits for), then ``then``."""
    script = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n{then}\n"
    return [sys.executable, "-c", script]


def _running(pid: int) -> bool:
    """True while ``pid`` is a live process (not gone, not a zombie awaiting its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_for(condition, launcher: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if launcher is not None and launcher.poll() is not None:
            raise AssertionError(f"the launcher ended first: {launcher.stderr.read()}")
        assert time.monotonic() < deadline, "the awaited event never came"
        time.sleep(0.02)


def _pid(pid_file: Path) -> int:
    return int(pid_file.read_text())


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_hangup_or_term_to_the_launcher_ends_the_job_and_does_not_relaunch(tmp_path, fileroot, sig):
    pid_file = tmp_path / "job.pid"
    launcher = _launcher(_job_yaml(tmp_path, fileroot, retries=5), *_python_job(pid_file))
    try:
        _wait_for(pid_file.exists, launcher)
        launcher.send_signal(sig)
        stderr = launcher.communicate(timeout=DEADLINE)[1]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if pid_file.exists() and _running(_pid(pid_file)):  # never leave the job behind, whatever failed
            os.kill(_pid(pid_file), signal.SIGKILL)
    assert launcher.returncode == 128 + sig
    assert "interrupted, not relaunching" in stderr and stderr.count("areal-ckpt launch: attempt ") == 2
    assert not _running(_pid(pid_file))


def test_a_killed_launcher_takes_its_job_with_it(tmp_path, fileroot):
    pid_file = tmp_path / "job.pid"
    launcher = _launcher(_job_yaml(tmp_path, fileroot, retries=5), *_python_job(pid_file))
    try:
        _wait_for(pid_file.exists, launcher)
        launcher.kill()  # SIGKILL: no handler of the launcher's runs
        launcher.wait()
        _wait_for(lambda: not _running(_pid(pid_file)))
    finally:
        if pid_file.exists() and _running(_pid(pid_file)):
            os.kill(_pid(pid_file), signal.SIGKILL)


def test_a_term_reaches_the_job_behind_a_wrapper_shell(tmp_path, fileroot):
    pid_file = tmp_path / "job.pid"
    shell = f"{shlex.join(_python_job(pid_file))}; echo after"
    launcher = _launcher(_job_yaml(tmp_path, fileroot, retries=5), "bash", "-c", shell)
    try:
        _wait_for(pid_file.exists, launcher)
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=DEADLINE)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if pid_file.exists() and _running(_pid(pid_file)):
            os.kill(_pid(pid_file), signal.SIGKILL)
    assert launcher.returncode != 0 and not _running(_pid(pid_file))


def test_an_attempt_that_leaves_a_child_holding_its_stderr_is_relaunched_and_the_child_ended(tmp_path, fileroot):
    """Attempt 0 starts a long sleeper that inherits its stderr, then fails; attempt 1 succeeds.
    The sleeper is ended with its attempt, so the relaunch happens and the launch finishes."""
    sleeper_file = tmp_path / "sleeper.pid"
    script = (
        "import os, pathlib, subprocess, sys\n"
        "if os.environ['AREAL_CKPT_LAUNCH_ATTEMPT'] == '0':\n"
        "    sleeper = subprocess.Popen(['sleep', '600'])\n"
        f"    pathlib.Path({str(sleeper_file)!r}).write_text(str(sleeper.pid))\n"
        "    sys.exit(5)\n"
    )
    launcher = _launcher(_job_yaml(tmp_path, fileroot, retries=1), sys.executable, "-c", script)
    try:
        stderr = launcher.communicate(timeout=DEADLINE)[1]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if sleeper_file.exists() and _running(_pid(sleeper_file)):
            os.kill(_pid(sleeper_file), signal.SIGKILL)
    assert launcher.returncode == 0, stderr
    assert "attempt 1 failed with exit status 5; relaunch 1 of recover.retries=1" in stderr
    assert not _running(_pid(sleeper_file))


def test_a_launcher_started_under_nohup_keeps_ignoring_sighup(tmp_path, fileroot):
    """Started with SIGHUP ignored (nohup), the launcher and its job stay deaf to it, as any
    program would: the job then ends by the SIGTERM sent after the SIGHUP (143), which could
    not be had if the SIGHUP had been forwarded (129, or 137 for the second signal)."""
    pid_file = tmp_path / "job.pid"
    ignore_hangups = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)
    launcher = _launcher(_job_yaml(tmp_path, fileroot, retries=5), *_python_job(pid_file), preexec_fn=ignore_hangups)
    try:
        _wait_for(pid_file.exists, launcher)
        launcher.send_signal(signal.SIGHUP)
        launcher.send_signal(signal.SIGTERM)
        stderr = launcher.communicate(timeout=DEADLINE)[1]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if pid_file.exists() and _running(_pid(pid_file)):
            os.kill(_pid(pid_file), signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted, not relaunching" in stderr and not _running(_pid(pid_file))


@pytest.mark.parametrize("under", ["python", "torchrun"])
def test_a_preemption_signal_to_the_launcher_reaches_the_job_which_dumps_and_the_launcher_exits_128_plus_n(
    tmp_path, under
):
    """SLURM's `--signal=B:USR1@120` signals the launcher: SIGUSR1 (which the launcher used to die
    of) is forwarded, every rank dumps the step it is in, and the launcher exits 138 (torchrun
    itself dies of SIGUSR1 or exits 1: the launcher's status says preemption all the same)."""
    from recovery_runs import HERE
    from test_preemption import TRIAL, steps_run

    from areal_ckpt.paths import generation_step

    fileroot, out, held = tmp_path / "root", tmp_path / "out", tmp_path / "held"
    held.mkdir()
    config = tmp_path / "job.yaml"
    config.write_text(
        f"experiment_name: exp\ntrial_name: bitexact\nfileroot: {fileroot}\nuser: tester\n"
        "recover:\n  mode: async\n  retries: 3\n  preemption_signals: [SIGUSR1]\n"
    )
    job = [str(HERE / "recover_job.py"), "--fileroot", str(fileroot), "--out", str(out), "--mode", "async"]
    job += ["--preemption-signals", "SIGUSR1", "--freq-steps", "100", "--hold", str(held), "--hold-at", "2"]
    job += ["--step-seconds", "0.3"]  # slack for the launcher's forwarding hop: 13 steps remain after go
    if under == "torchrun":
        from distributed import free_port

        job = ["-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", *job, "--wrap", "ddp"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE)}
    launcher = _launcher(config, sys.executable, *job, env=env)
    try:
        ranks = 2 if under == "torchrun" else 1
        _wait_for(lambda: all((held / f"held-rank{rank}").exists() for rank in range(ranks)), launcher)
        launcher.send_signal(signal.SIGUSR1)  # forwarded by the launcher; the step it reaches is dumped
        (held / "go").touch()
        _, stderr = launcher.communicate(timeout=DEADLINE)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    assert (fileroot / TRIAL / ".recover/current").is_symlink(), stderr[-3000:]
    dumped = generation_step((fileroot / TRIAL / ".recover/current").readlink().name)
    assert steps_run(out) == list(range(dumped + 1)), stderr[-3000:]  # the step it was in, dumped
    assert "preempted by SIGUSR1 (the job exited with" in stderr and "exiting with 138" in stderr
    assert "relaunch" not in stderr.split("preempted by")[-1]
