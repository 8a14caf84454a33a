"""The one place a ``save_dir`` / ``load_dir`` becomes a :class:`~areal_ckpt.tags.contract.TagLocation`."""

from __future__ import annotations

import os
from pathlib import Path

from areal_ckpt.errors import CheckpointError
from areal_ckpt.tags.contract import TagLocation
from areal_ckpt.tags.folder import FolderTags
from areal_ckpt.tags.objects import ObjectTags
from areal_ckpt.urls import locate


def tag_location(value: str | os.PathLike[str], what: str) -> TagLocation:
    """``value`` as a save_dir: a prefix on the object store its URL names, or a folder.
    CheckpointError naming ``what`` for a malformed URL or one of an unsupported scheme. Pure."""
    try:
        where = locate(value, what)
        return FolderTags(where) if isinstance(where, Path) else ObjectTags(where)
    except ValueError as error:
        raise CheckpointError(f"{what}: {error}" if what not in str(error) else str(error)) from None
