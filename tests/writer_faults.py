"""Faults injected into a background writer at an exact point of its job (imported by the
spawned writer process, so it lives in a module of its own)."""

from __future__ import annotations

import os
import signal
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
