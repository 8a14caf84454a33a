"""Run test code on real processes, started fast from a fork server that has torch preloaded.

Importing torch + transformers costs ~10 s per process on these machines; forking from a
server that imported them once makes a process start in milliseconds. The processes are real:
their own address space, real gloo process groups, real SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import threads

threads.pin()
# DeepSpeed on CPU; its ops are built once per virtual environment (tests/build_ops.py, run by
# `make` when it creates .venv) into the environment's own folder, else into the clone's .cache
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(sys.prefix, "torch_extensions")
    if sys.prefix != sys.base_prefix
    else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "torch_extensions"),
)
_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "transformers",
    "areal_ckpt",
    "areal_ckpt.demo.tiny",
    "torchdata.stateful_dataloader",
    "safetensors.torch",
    "deepspeed",
]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(_PRELOAD)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, errors: Any, group: bool
) -> None:
    import torch.distributed as torch_dist

    threads.pin()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if group:
        torch_dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        if errors is not None:
            errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def start_processes(
    fn: Callable[..., Any], world_size: int, *args: Any, errors: Any = None, group: bool | None = None
) -> list[Any]:
    """Start ``fn(rank, world_size, *args)`` on ``world_size`` processes.

    A gloo process group joins them when ``group`` is True (default: when more than one).
    """
    port = free_port()
    group = world_size > 1 if group is None else group
    processes = [
        _CONTEXT.Process(target=_worker, args=(fn, rank, world_size, port, args, errors, group), daemon=False)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    return processes


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0, group: bool | None = None
) -> list[int]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes and wait.

    Raises with every rank's traceback when a rank fails or hangs. A rank that kills itself
    (SIGKILL) is not a failure: the exit codes are returned (-9 for a killed rank).
    """
    errors = _CONTEXT.Queue()
    processes = start_processes(fn, world_size, *args, errors=errors, group=group)
    for process in processes:
        process.join(timeout)
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    codes = [process.exitcode for process in processes]
    if failures or hung or any(code not in (0, -9) for code in codes):
        details = "\n".join(f"rank {rank}:\n{trace}" for rank, trace in sorted(failures))
        raise AssertionError(f"processes failed (exit codes {codes}, hung ranks {hung})\n{details}")
    return codes
