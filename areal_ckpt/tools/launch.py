"""`areal-ckpt launch`: relaunch a crashed training job, as many times as ``recover.retries`` says.

What AReaL's launchers do with ``recover.retries``, as a command a user puts in front of their
own (``torchrun ...``, ``python train.py ...``). Policy:

- exit 0: done, the launcher exits 0;
- a failure (non-zero exit, or death by a signal) while recovery is enabled: relaunched, at most
  ``recover.retries`` times; the job resumes by itself from its last recovery dump;
- a failure before the job's first dump (no new recovery checkpoint was committed during the
  attempt) with the same error as the attempt before, which also made no dump: not relaunched,
  since a third try would fail the same way (a bad config, a missing file);
- Ctrl-C, SIGTERM or SIGHUP (its terminal closed), or a signal ``recover.preemption_signals``
  names (SIGUSR1, as SLURM's ``--signal`` sends it), to the launcher: forwarded to the job's
  whole process group once (a second one kills the group); no relaunch. torchrun is told to
  pass the preemption signals on to its workers (:data:`TORCHRUN_SIGNALS_VARIABLE`, unless the
  environment already sets it): it would die of SIGUSR1 and leave them unsignalled.
  A preemption signal N makes the launcher exit with 128 + N, whatever the job's main process
  returned (torchrun exits 1), saying in one line whether a new recovery dump was committed: a
  relauncher (SLURM's requeue, a Kubernetes restart policy) sees a preemption, not a failure. A
  signal the launcher was started ignoring (SIGHUP under ``nohup``, SIGINT in a background job)
  stays ignored, for it and for the job, as for any program;
- recovery disabled: the job runs once.

Each attempt runs in a process group of its own. It is over when its main process exits: what
it left in its group (a rollout server, a worker) gets SIGTERM, and SIGKILL after a grace
period, so nothing of it holds the trial, its ports or its GPUs when the next attempt starts,
and a process outside the group that still holds the job's stderr is no longer waited for. If
the launcher itself dies (even by SIGKILL), the kernel sends the job's main process SIGTERM
(a parent-death signal), so the job does not run on unsupervised; torchrun ends its workers
then, a wrapper shell may not end what it started.

The launcher exits with the last attempt's status (128 + N for death by signal N, as a shell
reports it), or 128 + N after forwarding the preemption signal N. Each attempt sees
``AREAL_CKPT_LAUNCH_ATTEMPT`` (0 for the first). Messages go to stderr, prefixed
``areal-ckpt launch:``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from areal_ckpt.config import RecoverConfig
from areal_ckpt.errors import CheckpointError
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.recover.location import trial_store

#: Environment variable telling each attempt its number (0 for the first).
ATTEMPT_VARIABLE = "AREAL_CKPT_LAUNCH_ATTEMPT"
#: Signals to the launcher that end the job and the launch (forwarded to the job's group),
#: besides the configured preemption signals.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds what an attempt left in its process group gets after SIGTERM, before SIGKILL.
_GRACE_SECONDS = 10.0
#: torchrun's variable naming the signals its agent catches and sends on to its workers (they
#: run in sessions of their own, so a signal to torchrun's group reaches them only so).
TORCHRUN_SIGNALS_VARIABLE = "PET_SIGNALS_TO_HANDLE"  # its --signals-to-handle
_TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's own default
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b(: .*)?$")


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: its exit status (shell convention), the first exception line it
    printed on stderr (None if none), and whether a new recovery checkpoint was committed."""

    status: int
    error: str | None
    made_progress: bool

    @property
    def signature(self) -> tuple[int, str | None]:
        """What "the same error" compares."""
        return self.status, self.error


def launch(recover: RecoverConfig, command: Sequence[str], err: IO[str] = sys.stderr) -> int:
    """Run ``command`` until it succeeds or the policy above stops it; returns the exit status.

    Blocking; forwards SIGINT / SIGTERM / SIGHUP and the configured preemption signals to the
    job's process group while it runs (installs handlers on the main thread and restores them
    on return).
    """
    if not command:
        raise ValueError("areal-ckpt launch: no command given after '--'")
    retries = recover.retries if recover.enabled else 0
    store = trial_store(recover)
    preemption = {int(signal.Signals[name]) for name in recover.preemption_signals} if recover.enabled else set()
    forwarded = (*_FORWARDED, *sorted(preemption - set(_FORWARDED)))
    previous: Outcome | None = None
    attempt = 0
    while True:
        _say(err, f"attempt {attempt + 1}: {' '.join(command)}")
        before = _committed(store)
        status, error, signalled = _run_once(command, attempt, err, forwarded)
        after = _committed(store)
        outcome = Outcome(status, error, made_progress=after != before)
        if signalled in preemption:
            name = signal.Signals(signalled).name
            dumped = f"it committed {after}" if outcome.made_progress else "no new recovery dump was committed"
            _say(err, f"preempted by {name} (the job exited with {status}; {dumped}); exiting with {128 + signalled}")
            return 128 + signalled
        if status == 0:
            return 0
        why = f"attempt {attempt + 1} failed with exit status {status}" + (f" ({error})" if error else "")
        if signalled is not None:
            _say(err, f"{why}; interrupted, not relaunching")
            return status
        if not recover.enabled:
            _say(err, f"{why}; recovery is disabled (recover.mode={recover.mode}), not relaunching")
            return status
        if (
            previous is not None
            and not previous.made_progress
            and not outcome.made_progress
            and previous.signature == outcome.signature
        ):
            _say(err, f"{why}; it failed the same way twice in a row before its first recovery dump, not relaunching")
            return status
        if attempt >= retries:
            _say(err, f"{why}; recover.retries={recover.retries} relaunches used, giving up")
            return status
        attempt += 1
        _say(err, f"{why}; relaunch {attempt} of recover.retries={recover.retries}")
        previous = outcome


def _committed(store: RecoverStore) -> str | None:
    """The committed generation's name, or a description of why it cannot be read."""
    try:
        return store.committed()
    except CheckpointError as error:
        return f"unreadable: {error}"


def _run_once(
    command: Sequence[str], attempt: int, err: IO[str], forwarded: Sequence[int]
) -> tuple[int, str | None, int | None]:
    """Run one attempt in its own process group, forwarding ``forwarded`` to it; returns
    (status, first exception line, the first signal the launcher received, None if none)."""
    env = {**os.environ, ATTEMPT_VARIABLE: str(attempt)}
    if TORCHRUN_SIGNALS_VARIABLE not in env:
        names = [signal.Signals(number).name for number in forwarded]
        env[TORCHRUN_SIGNALS_VARIABLE] = ",".join(dict.fromkeys([*_TORCHRUN_SIGNALS, *names]))
    child = subprocess.Popen(
        list(command),
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        process_group=0,
        preexec_fn=functools.partial(_end_with, os.getpid()),
    )
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        try:
            os.killpg(child.pid, signum if len(received) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in forwarded if signal.getsignal(sig) is not signal.SIG_IGN}
    first_error: list[str] = []
    reader = threading.Thread(target=_tee, args=(child.stderr, err, first_error), daemon=True)
    reader.start()
    try:
        code = child.wait()
        _end_group(child.pid)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    reader.join(_GRACE_SECONDS)
    if reader.is_alive():
        _say(err, "a process outside the job's process group still holds its stderr; no longer waiting for it")
    status = 128 - code if code < 0 else code
    return status, (first_error[0] if first_error else None), (received[0] if received else None)


def _end_with(launcher: int) -> None:
    """In the forked child, before the job's command runs: ask for SIGTERM when the launcher
    dies, and exit at once if it already has."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:
        os._exit(1)


def _end_group(group: int) -> None:
    """After an attempt's main process exited: SIGTERM to what is left in its process group,
    SIGKILL to what is still there after the grace period. Blocking, at most that long."""
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return  # nothing left
    deadline = time.monotonic() + _GRACE_SECONDS
    while _group_exists(group) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


def _group_exists(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _tee(source: IO[str] | None, sink: IO[str], first_error: list[str]) -> None:
    """Copy the job's stderr through, remembering the first line that names an exception."""
    assert source is not None
    for line in source:
        sink.write(line)
        sink.flush()
        if not first_error and _EXCEPTION_LINE.match(line.strip()):
            first_error.append(line.strip())


def _say(err: IO[str], message: str) -> None:
    err.write(f"areal-ckpt launch: {message}\n")
    err.flush()
