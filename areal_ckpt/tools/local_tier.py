"""What one node's local tier of a tiered trial holds (for ``areal-ckpt list`` and ``inspect``).

A local tier (``recover.local_dir``) holds generation folders: on rank 0's node the committed
one (its ``current``) and those kept for uploads or copies in flight; on any node its own
ranks' files of each generation and, with ``recover.local_replicas``, copies of other nodes'
files (recorded by :func:`~areal_ckpt.tier.copies_record.note_copies`). Read-only; nothing here
follows a link.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import generation_step
from areal_ckpt.storage.folders import listing_of
from areal_ckpt.tier.copies_record import copies_of


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


def describe_tier(path: Path, held: list[dict[str, Any]]) -> dict[str, Any]:
    """``inspect``'s facts about a local tier without a commit record of its own (another
    node's): what it holds (``held``, :func:`tier_holdings`), in all. Pure."""
    return {
        "kind": "local tier",
        "path": str(path),
        "bytes": sum(entry["own_bytes"] + entry["copied_bytes"] for entry in held),
        "files": sum(entry["own_files"] + entry["copied_files"] for entry in held),
        "complete": None,
        "models": {},
        "held": held,
    }


def held_entries(held: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``list``'s rows for the generation folders of ``held`` (:func:`tier_holdings`) other than
    the committed one (listed as the recovery checkpoint). Reads each folder's time."""
    return [
        {
            "kind": "held",
            "name": "",
            "epoch": None,
            "epoch_step": None,
            "global_step": entry["global_step"],
            "bytes": entry["own_bytes"] + entry["copied_bytes"],
            "created_unix": Path(entry["path"]).stat().st_mtime,
            **entry,
        }
        for entry in held
        if not entry["committed"]
    ]
