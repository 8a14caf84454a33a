"""The record a node's local tier keeps of the files it holds as copies of other nodes'
(``{store}/.copies/{generation}.json``), written after each transfer and read by the resume and
by ``areal-ckpt list`` / ``inspect``. Local file I/O only (no torch, no collective)."""

from __future__ import annotations

import json
import logging
import os
import secrets

from areal_ckpt.fsio import fsync_dir, read_regular_file, write_file_durably
from areal_ckpt.generations.store import RecoverStore

logger = logging.getLogger(__name__)

#: The folder of a local tier's store that records, per generation, the files it holds as
#: copies of other nodes' (``{generation}.json``: a sorted JSON list of names).
COPIES_FOLDER = ".copies"


def note_copies(store: RecoverStore, generation: str, names: list[str]) -> None:
    """Record that this node's local tier holds ``names`` of ``generation`` as copies of other
    nodes' files (for ``areal-ckpt list`` / ``inspect``), and drop the records of generations
    it no longer holds. Never through a link; a failure is logged (the record is a
    description, not part of the checkpoint)."""
    folder = store.root / COPIES_FOLDER
    try:
        if folder.is_symlink():
            raise OSError(f"{folder} is a link; not writing through it")
        folder.mkdir(exist_ok=True)
        held = set(store.generations())
        for record in folder.iterdir():
            if record.suffix == ".json" and record.stem not in held and not record.is_symlink():
                record.unlink()
        record = folder / f"{generation}.json"
        staged = folder / f".{generation}.{secrets.token_hex(4)}"
        write_file_durably(staged, json.dumps(sorted({*copies_of(store, generation), *names})).encode())
        os.replace(staged, record)  # replaces a link there, never writes through it
        fsync_dir(folder)
    except OSError as error:
        logger.warning("%s: could not record the copies held of %s: %s", folder, generation, error)


def copies_of(store: RecoverStore, generation: str) -> list[str]:
    """The files of ``generation`` this node's local tier holds as copies of other nodes' (what
    :func:`note_copies` recorded; empty when nothing is, or the record does not read). Local,
    read-only."""
    record = store.root / COPIES_FOLDER / f"{generation}.json"
    try:
        if record.is_symlink() or store.root.joinpath(COPIES_FOLDER).is_symlink():
            return []
        names = json.loads(read_regular_file(record, limit=16 << 20))
    except (OSError, ValueError):
        return []
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []
