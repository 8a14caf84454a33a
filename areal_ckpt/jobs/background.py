"""Background writer processes: checkpoint writes that run while training continues.

Each rank of an asynchronous Saver or RecoverHandler owns one writer process (spawned, not a
thread: a thread would compete with the training loop for the GIL). The writers of a job form
their own gloo process group, so a job's collective write and commit code runs unchanged in
them. The training process stages tensors into shared memory (:mod:`areal_ckpt.jobs.shm_arena`),
hands the writer a job naming where each tensor sits, and goes on; the writer writes, fsyncs
and commits, then reports back. At most one job is in flight per writer.

A writer runs at a lower CPU priority (niceness +10) with one torch thread: where it shares
cores with the training loop, the loop wins them, and the write stretches instead.

A writer never outlives its training process: it asks the kernel to SIGKILL it when its parent
dies, leaves the job's process group and ignores Ctrl-C (a signal to the job is its parent's to
act on: a preemption dump needs the writer alive), and holds the trial lock's descriptor, so a
restarted job cannot start while an orphaned write is still running. A kill at any instant therefore has
the same effect as in a synchronous save: the previous checkpoint stays committed, and the
half-written one is debris that the next start removes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.reduction
import os
import signal
import socket
import sys
import time
import traceback
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Protocol

import torch

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.jobs.shm_arena import ArenaLayout, StagedTensors, StagingArena
from areal_ckpt.lock import held_lock_descriptor

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: The signals a job receives as a whole (a preemption, a terminal): blocked in a writer from its
#: creation until it has left the job's process group, then any that came meanwhile dropped.
_JOB_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2})
_WRITER_NICENESS = 10  # added to the training process's niceness
_STORE_TIMEOUT = timedelta(minutes=10)
_LIVENESS_POLL_SECONDS = 0.5
#: How long the training loop waits on a background save before it says so (then again after
#: twice as long each time): a save stuck on slow or silent storage never stops the loop unheard.
_BLOCKED_WARNING_SECONDS = 60.0


class BackgroundJob(Protocol):
    """A write job: picklable plain data plus the staged layout of its tensors."""

    @property
    def layout(self) -> ArenaLayout | None:
        """Where the job's tensors lie in the shared-memory arena (set when it is submitted);
        None for a job that takes no tensors (an upload of files already written)."""
        ...

    def run(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Write and commit; collective over the writers' group; returns small JSON-like data."""
        ...


@dataclass(frozen=True)
class JobOutcome:
    """What a finished background job reported, and how long it ran in the background."""

    result: dict[str, Any]
    seconds: float


class _InheritedDescriptor:
    """A file descriptor that the spawned child receives as its own duplicate."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _detach, (multiprocessing.reduction.DupFd(self.fd),)


def _detach(duplicate: Any) -> int:
    return int(duplicate.detach())


class BackgroundWriter:
    """One rank's writer process, its staging arena and the job in flight; owned by the
    training process.

    ``label`` names it in logs and errors; ``trial`` is the trial whose lock the writer holds
    along with its parent. Stage a job's tensors into :attr:`arena`, then :meth:`submit` it.
    """

    def __init__(self, label: str, trial: Path) -> None:
        self.label = label
        self.trial = trial
        self.arena = StagingArena()
        self._process: Any = None
        self._conn: Any = None
        self._in_flight = False
        self._sent_buffer: torch.Tensor | None = None

    @property
    def busy(self) -> bool:
        """True while the job in flight is still running (its result not yet sent); local,
        non-blocking. A finished job stays to be collected by :meth:`wait`."""
        return self._in_flight and self._process.is_alive() and not self._conn.poll(0)

    def _start(self) -> None:
        """Start the writer process; collective (rank 0 names where the writers meet).
        Returns without waiting for the writer to finish starting."""
        meeting = None
        if dist.rank() == 0:
            meeting = _meeting_place(self.label)
        meeting = dist.broadcast_object(meeting, src=0)
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe()
        lock_fd = held_lock_descriptor(self.trial)
        self._process = context.Process(
            target=_serve,
            args=(
                child_end,
                dist.rank(),
                dist.world_size(),
                meeting,
                os.getpid(),
                None if lock_fd is None else _InheritedDescriptor(lock_fd),
                logging.getLogger("areal_ckpt").getEffectiveLevel(),
            ),
            name=f"areal_ckpt-writer-{self.label}-rank{dist.rank()}",
            daemon=True,
        )
        with _without_main_module(), _job_signals_held():
            self._process.start()
        child_end.close()
        self._conn = parent_end
        self._sent_buffer = None
        atexit.register(self._drain_at_exit)

    def submit(self, job: BackgroundJob) -> None:
        """Hand ``job``, whose tensors are staged in :attr:`arena`, to the writer; non-blocking.

        Collective when the writer is not running yet (it is started, on every rank); local
        otherwise. The previous job must have been collected with :meth:`wait` first.
        """
        if self._in_flight:
            raise RuntimeError(f"{self.label}: a background save is still in flight; wait() for it first")
        if self._process is None:
            self._start()
        buffer = self.arena.buffer
        try:
            if buffer is not self._sent_buffer:
                self._conn.send(("buffer", buffer))
                self._sent_buffer = buffer
            self._conn.send(("job", job))
        except OSError as error:
            raise self._died(f"cannot reach it: {error}") from None
        self._in_flight = True

    def wait(self) -> JobOutcome | None:
        """Block until the job in flight has finished; local. None when nothing was in flight.
        A wait of a minute or more is logged as a warning (again at two, four, ... minutes).

        Raises CheckpointError with the writer's error when the job failed or the writer died;
        the writer is then stopped (the next :meth:`submit` starts a new one).
        """
        if not self._in_flight:
            return None
        self._in_flight = False
        started = time.monotonic()
        warn_after = _BLOCKED_WARNING_SECONDS
        try:
            while not self._conn.poll(_LIVENESS_POLL_SECONDS):
                if not self._process.is_alive():
                    raise self._died(f"exit code {self._process.exitcode}")
                waited = time.monotonic() - started
                if waited >= warn_after:
                    logger.warning(
                        "%s: the training loop has waited %.0f s for the background save in flight, which "
                        "is still running (its storage slow or not answering: the writer logs each retry); "
                        "it goes on waiting, and will say so again",
                        self.label,
                        waited,
                    )
                    warn_after *= 2
            message = self._conn.recv()
        except (EOFError, OSError) as error:
            raise self._died(str(error) or type(error).__name__) from None
        if message[0] == "failed":
            self.stop()
            logger.debug("%s: background traceback:\n%s", self.label, message[2])
            raise CheckpointError(f"{self.label}: background save failed: {message[1]}")
        return JobOutcome(result=message[1], seconds=message[2])

    def finished_within(self, seconds: float) -> bool:
        """True once the job in flight has reported back (or nothing is in flight, or the writer
        died: :meth:`wait` says which), False when it still runs after ``seconds``; local,
        blocking at most that long."""
        deadline = time.monotonic() + seconds
        while self._in_flight and self._process.is_alive():
            if self._conn.poll(max(0.0, min(_LIVENESS_POLL_SECONDS, deadline - time.monotonic()))):
                return True
            if time.monotonic() >= deadline:
                return False
        return True

    def abandon(self) -> None:
        """Kill the writer at once, dropping the job in flight (what it wrote is uncommitted, and
        removed as debris by a later start); local, idempotent."""
        if self._process is None:
            return
        atexit.unregister(self._drain_at_exit)
        self._process.kill()
        self._process.join()
        self._conn.close()
        self._process = self._conn = self._sent_buffer = None
        self._in_flight = False

    def stop(self) -> None:
        """Ask the writer to exit and join it; drops the in-flight job; local, idempotent."""
        if self._process is None:
            return
        atexit.unregister(self._drain_at_exit)
        try:
            self._conn.send(("stop", None))
        except OSError:
            pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._process = self._conn = self._sent_buffer = None
        self._in_flight = False

    def close(self) -> None:
        """Stop the writer and free the arena; local, idempotent. Collect the job first."""
        self.stop()
        self.arena.release()

    def _died(self, detail: str) -> CheckpointError:
        self._in_flight = False
        process = self._process
        self.stop()
        return CheckpointError(
            f"{self.label}: background writer process {getattr(process, 'pid', '?')} died ({detail}); "
            "the save it was running did not report back; the last checkpoint committed on disk stands"
        )

    def _drain_at_exit(self) -> None:
        """At interpreter exit, finish the job in flight so a last save is not silently lost."""
        try:
            outcome = self.wait()
            if outcome is not None:
                logger.info("%s: finished the last background save at exit: %s", self.label, outcome.result)
        except CheckpointError as error:  # its message names the writer already
            logger.error("%s", error)
        self.stop()


@contextlib.contextmanager
def _job_signals_held() -> Iterator[None]:
    """Block :data:`_JOB_SIGNALS` in the calling thread for the block: a child created meanwhile
    inherits the mask, so a signal to the job's group while the child starts (importing torch
    takes seconds) waits in it until :func:`_die_with_parent` has taken it out of the group."""
    resource_tracker.ensure_running()  # started inside the block, it would unblock SIGINT and SIGTERM itself
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _JOB_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


@contextlib.contextmanager
def _without_main_module() -> Iterator[None]:
    """Start a spawned child without re-running the training script in it.

    A spawned child normally imports the parent's ``__main__`` module again (as ``__mp_main__``),
    so a writer would pay for every import of the user's script (transformers, datasets, ...)
    and run its top-level code. The writer needs none of it: its target lives in this package.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


@dist.exchanged
@dataclass(frozen=True)
class _Meeting:
    """Where the writers of a job form their process group: under ``prefix`` in the TCPStore
    at ``host``:``port``, which is the training job's own store (``own`` False) or, when the job
    rendezvoused some other way, one the writers' rank 0 serves (``own`` True)."""

    host: str
    port: int
    prefix: str
    own: bool


def _meeting_place(label: str) -> _Meeting:
    """Rank 0: where this start's writers meet. The job's own TCPStore when it has one, so the
    writers open no port of their own; a fresh key prefix per start, so a restarted group never
    reads an earlier one's keys. Local."""
    prefix = f"areal_ckpt/writers/{label}/{uuid.uuid4().hex}"
    store: Any = None
    with contextlib.suppress(ValueError, RuntimeError, AttributeError):
        store = torch.distributed.distributed_c10d._get_default_store()
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store
    if isinstance(store, torch.distributed.TCPStore):
        return _Meeting(store.host, store.port, prefix, own=False)
    host = os.environ.get("MASTER_ADDR") or socket.gethostname()
    with socket.socket() as sock:
        sock.bind((host, 0))
        return _Meeting(host, int(sock.getsockname()[1]), prefix, own=True)


def _writers_store(meeting: _Meeting, rank: int, world: int) -> Any:
    """The store the writers' process group rendezvouses on, seen from writer ``rank``."""
    if meeting.own:
        store = torch.distributed.TCPStore(
            meeting.host, meeting.port, world, is_master=rank == 0, timeout=_STORE_TIMEOUT
        )
    else:
        store = torch.distributed.TCPStore(meeting.host, meeting.port, is_master=False, timeout=_STORE_TIMEOUT)
    return torch.distributed.PrefixStore(meeting.prefix, store)


def _die_with_parent(parent_pid: int) -> None:
    """Tie the writer to its parent alone: SIGKILL when the parent dies, and out of the job's
    process group, so a signal meant for the job (SLURM, Kubernetes and ``kill -TERM -PGID``
    signal the whole group; a terminal's Ctrl-C its foreground group) reaches the trainer, which
    decides (a preemption dump, written by this writer), and not the writer in mid-write."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)
    with contextlib.suppress(OSError):  # already a group leader (cannot happen for a spawned child)
        os.setpgid(0, 0)
    for number in _JOB_SIGNALS:  # one sent to the job while this started is dropped, not acted on
        kept = signal.signal(number, signal.SIG_IGN)
        if number != signal.SIGINT:
            signal.signal(number, kept)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _JOB_SIGNALS)


def _serve(
    conn: Any, rank: int, world: int, meeting: _Meeting, parent_pid: int, lock_fd: int | None, log_level: int
) -> None:
    """The writer process: join the writers' group, then run jobs until told to stop."""
    _die_with_parent(parent_pid)
    os.nice(_WRITER_NICENESS)
    torch.set_num_threads(1)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(name)s [writer rank {rank}] %(levelname)s: %(message)s"))
    package_logger = logging.getLogger("areal_ckpt")
    package_logger.addHandler(handler)
    package_logger.setLevel(log_level)
    if world > 1:
        store = _writers_store(meeting, rank, world)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world)
    buffer: torch.Tensor | None = None
    staged = StagedTensors()
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:  # the parent closed its end: nothing more will come
            break
        if kind == "stop":
            break
        if kind == "buffer":
            buffer = payload
            continue
        start = time.perf_counter()
        try:
            if payload.layout is None:
                tensors: dict[str, torch.Tensor] = {}
            elif buffer is None:
                raise CheckpointError("background writer: a job arrived without its staged tensors")
            else:
                tensors = staged.materialize(buffer, payload.layout)
            result = payload.run(tensors)
            conn.send(("done", result, time.perf_counter() - start))
        except BaseException as error:  # reported to the parent, which raises it
            conn.send(("failed", f"{type(error).__name__}: {error}", traceback.format_exc()))
    if lock_fd is not None:
        os.close(lock_fd)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
