"""How ``areal-ckpt`` shows things: sizes, times, steps, tables, progress bars."""

from __future__ import annotations

import datetime
import sys
from typing import Any

from tqdm import tqdm


def progress(unit: str) -> Any:
    """A tqdm bar on stderr when it is a terminal; silent otherwise (scripts, CI logs)."""
    return lambda items: tqdm(items, unit=unit, leave=False, disable=not sys.stderr.isatty())


def when(unix: float | None) -> str:
    """A Unix time as local date and time; ``-`` when unknown."""
    if unix is None:
        return "-"
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S")


def size(size: int | None) -> str:
    """A byte count in B, KiB, MiB, GiB or TiB; ``-`` when unknown."""
    if size is None:
        return "-"
    count = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


def step(step: dict[str, Any] | None) -> str:
    """A checkpoint's step record as one phrase; ``-`` when unknown."""
    if not step:
        return "-"
    return f"global {step.get('global_step')} (epoch {step.get('epoch')}, step {step.get('epoch_step')})"


def print_table(rows: list[list[str]]) -> None:
    """Print ``rows`` as aligned columns on stdout."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def holding(entry: dict[str, Any]) -> str:
    """What one generation folder of a local tier holds, as a line (own files, copies of other
    nodes' files, committed here or not); ``entry`` as ``tools.local_tier.tier_holdings`` gives it."""
    what = f"{entry['own_files']} own files ({size(entry['own_bytes'])})"
    if entry["copied_files"]:
        what += f", copies of {entry['copied_files']} other nodes' files ({size(entry['copied_bytes'])})"
    return what + (", committed here" if entry["committed"] else "")
