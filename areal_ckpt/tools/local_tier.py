"""What one node's local tier of a tiered trial holds (for ``areal-ckpt list`` and ``inspect``).

A local tier (``recover.local_dir``) holds generation folders: on rank 0's node the committed
one (its ``current``) and those kept for uploads or copies in flight; on any node its own
ranks' files of each generation and, with ``recover.local_replicas``, copies of other nodes'
files (recorded by :func:`~areal_ckpt.recover.nodes.note_copies`). Read-only; nothing here
follows a link.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.paths import generation_step
from areal_ckpt.recover.nodes import copies_of, listing_of
from areal_ckpt.recover.store import RecoverStore


def tier_holdings(trial: Path) -> list[dict[str, Any]]:
    """Every generation folder of ``trial``'s store, newest first: its step, whether it is the
    committed one here, and its files and bytes split into the node's own and its copies of
    other nodes'. Empty when the trial has no store. Read-only."""
    store = RecoverStore(Path(trial))
    try:
        committed = store.committed()
    except CheckpointError:
        committed = None
    held = []
    for generation in reversed(store.generations()):
        sizes = listing_of(store.path(generation))
        copied = set(copies_of(store, generation)) & set(sizes)
        held.append(
            {
                "generation": generation,
                "global_step": generation_step(generation),
                "committed": generation == committed,
                "own_files": len(sizes) - len(copied),
                "own_bytes": sum(size for name, size in sizes.items() if name not in copied),
                "copied_files": len(copied),
                "copied_bytes": sum(sizes[name] for name in copied),
                "path": str(store.path(generation)),
            }
        )
    return held
