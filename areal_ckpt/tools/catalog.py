"""What the ``areal-ckpt`` commands find at a path or URL, and how ``verify`` and ``list``
report it, written once for every location.

Each kind of place finds its committed checkpoints its own way (a folder by its layout, a bucket
by its commit records: :meth:`~areal_ckpt.tools.place_contract.CheckpointPlace.found`) and
hands them on as :class:`Found`: a checkpoint's
:class:`~areal_ckpt.storage.location.Location` and its entry there. From then on nothing asks
which kind it was: :func:`verify_found` checks every file where it lies through the location's
:meth:`~areal_ckpt.storage.location.Location.files_of`
(:func:`~areal_ckpt.storage.folders.check_checkpoint`), :func:`list_found` makes ``list``'s
rows. What a place names but cannot check (a stock DCP folder, DeepSpeed's own layout, a broken
commit record) is an :class:`Unverifiable`, reported with its reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.paths import parse_export_leaf
from areal_ckpt.storage.folders import FileSource, check_checkpoint, manifest_of
from areal_ckpt.storage.location import Location
from areal_ckpt.storage.retention import Committed

#: A row's facts that a checkpoint whose record is broken cannot tell.
_UNKNOWN = {"epoch": None, "epoch_step": None, "global_step": None, "bytes": None, "created_unix": None}


@dataclass(frozen=True)
class Found:
    """One committed checkpoint: ``kind`` (``export``, ``recover``, ``deepspeed``), ``name``
    (the model, or the DeepSpeed tag; empty for a recovery checkpoint, whose models its
    manifest names), the ``location`` it is committed in, its ``entry`` there and the name of
    its ``manifest``."""

    kind: str
    name: str
    location: Location
    entry: Committed
    manifest: str

    @property
    def where(self) -> str:
        """The checkpoint's path or URL."""
        return self.location.where(self.entry.name)

    def files(self) -> FileSource:
        """Its files where they lie."""
        return self.location.files_of(self.entry.name)


@dataclass(frozen=True)
class Unverifiable:
    """Something a place names that is no checkpoint it can check: ``where`` it is and why;
    ``kind``: what ``list`` shows it as (a recovery checkpoint whose commit record is broken),
    empty when it is not listed."""

    where: str
    problem: str
    kind: str = ""


def verify_found(
    found: list[Found | Unverifiable], progress: Callable[[Iterable[str]], Iterable[str]] = iter
) -> list[tuple[str, list[str]]]:
    """(path or URL, problems) for each of ``found``: every file of a checkpoint checked by size
    and CRC-32 where it lies (:func:`~areal_ckpt.storage.folders.check_checkpoint`), an
    unverifiable one with its reason. Blocking; read-only."""
    return [
        (item.where, [item.problem])
        if isinstance(item, Unverifiable)
        else (item.where, check_checkpoint(item.files(), item.manifest, progress))
        for item in found
    ]


def newest_recovery(found: Callable[[], list[Found | Unverifiable]]) -> str | None:
    """The recovery generation a read of the place ``found`` lists would read now: the one its
    newest recovery commit names; None when it names none or cannot be read (a job that dumps
    again supersedes it). Read-only."""
    try:
        recoveries = [item for item in found() if isinstance(item, Found) and item.kind == "recover"]
    except (CheckpointError, OSError):
        return None
    return max(recoveries, key=lambda item: item.entry.order).entry.name if recoveries else None


def list_found(found: list[Found | Unverifiable]) -> list[dict[str, Any]]:
    """``list``'s rows for the checkpoints of ``found``: kind, name, steps, bytes, commit time and
    path or URL; a recovery checkpoint's steps and models from its manifest (a damaged one is
    listed with its ``problem``). Unverifiable entries are not listed. Blocking; read-only."""
    rows = []
    for item in found:
        if isinstance(item, Unverifiable):
            if item.kind:
                rows.append({"kind": item.kind, "name": "", **_UNKNOWN, "path": item.where, "problem": item.problem})
            continue
        files = item.files()
        listing = files.listing()  # once: the row's size and, for a recovery checkpoint, the size check
        row: dict[str, Any] = {
            "kind": item.kind,
            "name": item.name,
            "bytes": sum(size for size in listing.values() if size is not None),
            "created_unix": item.entry.when,
            "path": item.where,
        }
        step: Any = {}
        if item.kind == "export":
            step = item.entry.facts.get("step") or {}
            if not step and (leaf := parse_export_leaf(item.entry.name.split(".")[0])) is not None:
                step = dict(zip(("epoch", "epoch_step", "global_step"), leaf, strict=True))
        elif item.kind == "recover":
            try:
                manifest = manifest_of(files, item.manifest)
                step, row["name"] = manifest.get("step") or {}, ",".join(manifest.get("models", []))
                row["created_unix"] = row["created_unix"] or manifest.get("created_unix")
                _check_sizes(files, listing, manifest)
            except CheckpointError as error:  # shown, not hidden: a damaged checkpoint is news
                row["problem"] = str(error)
        if not isinstance(step, dict):
            step = {}
        rows.append({**row, **{key: step.get(key) for key in ("epoch", "epoch_step", "global_step")}})
    return rows


def _check_sizes(files: FileSource, listing: dict[str, int | None], manifest: dict[str, Any]) -> None:
    """CheckpointError naming the first file the manifest lists that is missing or of another
    size in ``listing`` (``files``' own; no data read: ``list`` is quick; ``verify`` reads every
    byte)."""
    for name, entry in sorted(manifest["files"].items()):
        if listing.get(name) != entry["size"]:
            found = "missing" if name not in listing else f"{listing[name]} bytes, manifest says {entry['size']}"
            raise CheckpointError(f"{files.where(name)}: {found}")
