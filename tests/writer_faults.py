"""Faults injected into a background writer at an exact point of its job (imported by the
spawned writer process, so it lives in a module of its own)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DiesAfterCommitting:
    """A real job that runs to its end (written, committed, tidied) and then kills its writer
    with SIGKILL before the writer can report back: a writer lost right after its commit."""

    job: Any

    @property
    def layout(self) -> Any:
        return self.job.layout

    def run(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        self.job.run(tensors)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: the writer was killed")


@dataclass(frozen=True)
class WaitsForRelease:
    """A real job that first waits until the file ``release`` exists, at most ``up_to`` seconds
    (a save held up by its storage for as long as the test chooses), then runs to its end."""

    job: Any
    release: str
    up_to: float = 120.0

    @property
    def layout(self) -> Any:
        return self.job.layout

    def run(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        deadline = time.monotonic() + self.up_to
        while not os.path.exists(self.release) and time.monotonic() < deadline:
            time.sleep(0.05)
        result: dict[str, Any] = self.job.run(tensors)
        return result
