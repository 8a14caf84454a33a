"""The trial lock when its holder is dead but the holder's background writers still run."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_ckpt import lock
from areal_ckpt.errors import CheckpointError

# A job that takes the lock, hands its descriptor to a child (as an async job's writer holds
# it), prints the child's pid and dies; the child keeps the lock until it exits: `sleep 60`,
# or `cat FIFO`, which exits when the test opens and closes the FIFO (an event, not a delay).
_DYING_JOB = """
import subprocess, sys
from pathlib import Path
from areal_ckpt.lock import acquire_trial_lock, held_lock_descriptor
trial = Path(sys.argv[1])
acquire_trial_lock(trial)
writer = subprocess.Popen(sys.argv[2:], pass_fds=[held_lock_descriptor(trial)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(writer.pid)
"""


@pytest.fixture
def orphaned_lock(tmp_path: Path) -> Iterator:
    """Make a trial whose lock outlives its (dead) job in a child for ``seconds``."""
    children: list[int] = []

    def make(seconds: float | None = None, fifo: Path | None = None) -> Path:
        trial = tmp_path / "trial"
        writer = ["sleep", str(seconds)] if fifo is None else ["cat", str(fifo)]
        done = subprocess.run(
            [sys.executable, "-c", _DYING_JOB, str(trial), *writer], capture_output=True, text=True, check=True
        )
        children.append(int(done.stdout))
        return trial

    yield make
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_locked(trial: Path) -> bool:
    fd = os.open(trial / lock.LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_restart_waits_for_the_writers_of_a_dead_job(orphaned_lock, tmp_path):
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    trial = orphaned_lock(fifo=fifo)
    assert _is_locked(trial)  # the dead job's child still holds it

    class ReleaseWhenWaiting(logging.Handler):
        """Lets the writer exit once the restart has started waiting for it."""

        def emit(self, record: logging.LogRecord) -> None:
            if "waiting up to" in record.getMessage():
                threading.Thread(target=lambda: os.close(os.open(fifo, os.O_WRONLY))).start()

    handler = ReleaseWhenWaiting()
    logging.getLogger("areal_ckpt.lock").addHandler(handler)
    try:
        lock.acquire_trial_lock(trial)
    finally:
        logging.getLogger("areal_ckpt.lock").removeHandler(handler)
    try:
        holder = json.loads((trial / lock.LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid()
    finally:
        lock.release_trial_lock(trial)


def test_writers_of_a_dead_job_that_never_exit_are_refused_after_the_wait(orphaned_lock, monkeypatch):
    trial = orphaned_lock(60)
    monkeypatch.setattr(lock, "ORPHAN_WAIT_SECONDS", 0.3)
    with pytest.raises(CheckpointError, match="its process is gone, its writers did not exit within") as error:
        lock.acquire_trial_lock(trial)
    assert str(trial / lock.LOCK_NAME) in str(error.value)
    assert _is_locked(trial)  # never taken while held


def test_holder_on_another_host_is_refused_at_once(orphaned_lock):
    trial = orphaned_lock(60)
    path = trial / lock.LOCK_NAME
    path.write_text(json.dumps({"pid": 2**22 + 1, "host": "another-host", "since_unix": 0.0}))
    with pytest.raises(CheckpointError, match="another-host") as error:
        lock.acquire_trial_lock(trial)
    assert "its process is gone" not in str(error.value)  # a process elsewhere cannot be checked
