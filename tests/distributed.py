"""Run a test body on several real processes joined by a gloo process group."""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, errors) -> None:
    import torch.distributed as torch_dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
    )
    torch_dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        torch_dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; raise on any failure.

    ``fn`` must be a module-level function (it is sent to the workers by reference).
    """
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(fn, rank, world_size, port, args, errors)) for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
    hung = [index for index, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures or hung or any(p.exitcode != 0 for p in processes):
        details = "\n".join(f"rank {rank}:\n{trace}" for rank, trace in sorted(failures))
        codes = [p.exitcode for p in processes]
        raise AssertionError(f"distributed run failed (exit codes {codes}, hung ranks {hung})\n{details}")
