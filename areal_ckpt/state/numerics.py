"""The settings of a process that change the last bits of what a training step computes.

Bit-exact resume restores every piece of training state, but two runs from the same state agree
bit for bit only when they also compute the same way: the same intra-op thread count (a matmul's
reduction order depends on it) and the same torch build. A dump records this process's settings;
a load compares them with its own and says once what differs (docs/recovery.md, section 2).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Manifest header keys of the settings a dump records (``torch_version`` predates this module).
THREADS_KEY = "torch_num_threads"
TORCH_KEY = "torch_version"


def numerics_record() -> dict[str, Any]:
    """This process's intra-op thread count and torch version, as manifest header entries;
    local, reads only."""
    return {THREADS_KEY: torch.get_num_threads(), TORCH_KEY: torch.__version__}


def numerics_changes(saved: Mapping[str, Any]) -> list[str]:
    """What differs between ``saved`` (a manifest header) and this process, in words; empty when
    nothing does or the header predates the record. Local, pure apart from reading torch's
    settings."""
    now = numerics_record()
    changes = []
    threads = saved.get(THREADS_KEY)
    if isinstance(threads, int) and threads != now[THREADS_KEY]:
        changes.append(
            f"intra-op threads {threads} -> {now[THREADS_KEY]} (set OMP_NUM_THREADS={threads} "
            f"or call torch.set_num_threads({threads}) before training to keep the bits)"
        )
    version = saved.get(TORCH_KEY)
    if isinstance(version, str) and version != now[TORCH_KEY]:
        changes.append(f"torch {version} -> {now[TORCH_KEY]}")
    return changes


def warn_if_numerics_changed(source: str, saved: Mapping[str, Any], rank: int) -> None:
    """Log one warning, on rank 0 only, naming ``source`` and every setting that differs from
    the dump's; the load goes on (the state is whole; only the next steps' last bits change).
    Local; never raises."""
    changes = numerics_changes(saved)
    if changes and rank == 0:
        logger.warning(
            "%s: this process computes differently from the one that dumped it: %s. Training resumes from "
            "the exact saved state, but its steps will not be bit-identical to an uninterrupted run",
            source,
            "; ".join(changes),
        )
