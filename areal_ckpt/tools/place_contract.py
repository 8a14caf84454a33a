"""What the ``areal-ckpt`` commands need of a location (:class:`CheckpointPlace`), implemented by
:class:`~areal_ckpt.tools.places.FolderPlace` and :class:`~areal_ckpt.tools.object_place.ObjectPlace`
and chosen once by :func:`~areal_ckpt.tools.places.place_of`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from areal_ckpt.tools.catalog import Found, Unverifiable

Progress = Callable[[Iterable[str]], Iterable[str]]


@dataclass(frozen=True)
class Repointed:
    """What ``recover-pointer`` did: the generation now committed (its every file verified),
    the newer ones skipped with their problems, whether anything changed, and the trial's path
    or URL."""

    generation: str
    skipped: dict[str, list[str]]
    changed: bool
    record: str


class CheckpointPlace(Protocol):
    """A location an ``areal-ckpt`` command reads or writes. Every method is local to the
    calling process and blocking; errors are CheckpointError naming the path or URL."""

    #: What :meth:`verify` counts in its progress bar ("file", "object").
    unit: str

    def describe(self, scratch: Path) -> dict[str, Any]:
        """The facts ``inspect`` prints of the one checkpoint this names (``scratch``: an empty
        folder for a copy, if one is needed)."""

    def found(self) -> list[Found | Unverifiable]:
        """Every committed checkpoint this names (what ``verify`` checks,
        :func:`~areal_ckpt.tools.catalog.verify_found`), and what it names but cannot check.
        Read-only."""

    def list(self) -> list[dict[str, Any]]:
        """Every export and the recovery checkpoint under this trial
        (:func:`~areal_ckpt.tools.catalog.list_found`, with what a place holds besides), newest
        first. Read-only."""

    def readable(self, scratch: Path) -> Path:
        """A local folder holding the one checkpoint this names (itself, or a checked copy in
        ``scratch``)."""

    def readable_tag(self, tag: str | None, scratch: Path) -> tuple[Path, str | None]:
        """A local save_dir holding ``tag`` (None: the one ``latest`` names), and the tag to read
        there (None: ``latest``)."""

    def output(self, scratch: Path) -> Path:
        """The new local folder a command writes its output into (this folder itself, or one
        in ``scratch`` that :meth:`commit_output` then puts here)."""

    def commit_output(self, folder: Path) -> str:
        """Make the written ``folder`` (:meth:`output`) this location's, committed; returns
        where it now is."""

    def repoint(self) -> Repointed:
        """``recover-pointer``: commit the trial's newest generation whose every file verifies,
        when the commit record is lost or names a damaged one
        (:func:`~areal_ckpt.generations.repoint.repoint_trial`, written once for every
        location); never deletes anything."""
