"""The names and numbers of our DCP metadata file (``dcp_metadata.json``) as plain JSON: where
our flat tensor names are stored, and what a file claims of each tensor (dtype, element count),
read without torch (the command line's ``inspect`` and ``list``). The full reading into DCP's
types, with every consistency check a load needs, is :mod:`areal_ckpt.formats.dcp_metadata`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import read_json_file
from areal_ckpt.paths import METADATA_JSON

#: Where our flat tensor names live in the stored state dict (format 3): ``model.<fqn>`` under
#: ``dcp.model.<fqn>``, ``optim.<fqn>.<key>`` under ``dcp.optim.state.<fqn>.<key>``, which is
#: what ``dcp.save({"dcp": {"model": ..., "optim": ...}})`` of ``get_state_dict``'s two dicts
#: writes (an AReaL engine's own layout); any other name ``n`` under ``dcp.n``. Format 2 stored
#: the flat names as they are.
STORED_PREFIXES = {"model.": "dcp.model.", "optim.": "dcp.optim.state.", "": "dcp."}
#: The ``key_prefixes`` a metadata file records: stored prefix -> our prefix.
KEY_PREFIXES = {stored: ours for ours, stored in STORED_PREFIXES.items()}

#: Largest dimension, element count or byte count a checkpoint may claim (2**48: 256 TiB).
LARGEST = 1 << 48


def checked_ints(values: Any) -> list[int]:
    """``values`` when it is a list of integers from 0 to 2**48; ValueError otherwise. Pure."""
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= LARGEST for v in values
    ):
        raise ValueError(f"expected non-negative integers up to 2**48, got {str(values)[:200]}")
    return values


def our_name(stored: str, prefixes: dict[str, str]) -> str:
    """The flat name of the stored entry ``stored`` under the file's ``prefixes`` (none: format 2);
    ValueError when it is under none of them. Pure."""
    if not prefixes:
        return stored
    for prefix, ours in sorted(prefixes.items(), key=lambda pair: -len(pair[0])):  # the longest first
        if stored.startswith(prefix):
            return ours + stored[len(prefix) :]
    raise ValueError(f"entry {stored!r} is under none of the stored prefixes {sorted(prefixes)}")


def tensor_summary(folder: Path) -> dict[str, tuple[str, int]]:
    """Each tensor ``folder``'s metadata file claims, by our flat name: its dtype's name and
    element count. CheckpointError naming the file when it does not read or is malformed.
    Local, read-only; imports no torch."""
    source = Path(folder) / METADATA_JSON
    _, data = read_json_file(source, "DCP metadata")
    try:
        if not isinstance(data, dict):
            raise ValueError(f"expected an object, got {type(data).__name__}")
        prefixes = data.get("key_prefixes", {})
        if not isinstance(prefixes, dict) or not all(isinstance(v, str) for v in prefixes.values()):
            raise ValueError(f"key_prefixes must map strings to strings, got {str(prefixes)[:200]}")
        summary = {}
        for stored, entry in data["tensors"].items():
            if not isinstance(entry["dtype"], str):
                raise ValueError(f"dtype of {stored!r} is not a name")
            count = 1
            for size in checked_ints(entry["size"]):
                count *= size
            summary[our_name(stored, prefixes)] = (entry["dtype"], count)
        return summary
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{source}: malformed DCP metadata: {type(error).__name__}: {error}") from None
