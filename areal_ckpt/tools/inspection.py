"""What a checkpoint folder is, whether it is intact, and what a trial holds. Read-only."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_names import tensor_summary
from areal_ckpt.generations.store import resolve_recovery
from areal_ckpt.paths import (
    FROZEN_PART,
    LATEST,
    MANIFEST_NAME,
    RECOVER_MANIFEST,
    TAGGED_FORMAT,
    is_stock_dcp,
    parse_export_leaf,
)
from areal_ckpt.publish import read_manifest
from areal_ckpt.storage.folder_location import FolderLocation
from areal_ckpt.storage.location import recovery_location_of
from areal_ckpt.storage.pointers import PointerFile
from areal_ckpt.storage.retention import Committed
from areal_ckpt.tools.catalog import Found, Unverifiable, list_found, verify_found
from areal_ckpt.tools.local_tier import describe_tier, held_entries, tier_holdings

_MAX_SAFETENSORS_HEADER = 100 << 20


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file; CheckpointError on an absurd or malformed header."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_SAFETENSORS_HEADER, path.stat().st_size - 8):
            raise CheckpointError(f"{path}: header claims {length} bytes, more than the file holds")
        try:
            header = json.loads(handle.read(length))
        except ValueError as error:
            raise CheckpointError(f"{path}: malformed safetensors header: {error}") from None
        except RecursionError:
            raise CheckpointError(f"{path}: malformed safetensors header: nested too deeply") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed safetensors header")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            and isinstance(entry.get("dtype"), str)
        ):
            raise CheckpointError(
                f"{path}: malformed safetensors header entry {str(name)[:100]!r}: "
                "expected a dtype and a shape of non-negative integers"
            )
    return header


def deepspeed_folder(path: Path) -> Path | None:
    """The DeepSpeed checkpoint tag folder ``path`` is or names (through ``latest``), if any:
    ours (``save_checkpoint``) or DeepSpeed's own layout. Read-only."""
    if (path / LATEST).is_file():
        tag = FolderLocation(path, PointerFile(LATEST)).pointed()
        return None if tag is None else path / tag
    if (path / MANIFEST_NAME).is_file():
        try:
            return path if read_manifest(path, MANIFEST_NAME).get("format") == TAGGED_FORMAT else None
        except CheckpointError:
            return None
    return path if any(path.glob("*model_states.pt")) else None


def _tag_folder(path: Path) -> Path:
    """The DeepSpeed tag folder of ``path``, which :func:`kind_of` found; raises CheckpointError
    if it has gone since."""
    folder = deepspeed_folder(path)
    if folder is None:
        raise CheckpointError(f"{path}: no DeepSpeed checkpoint tag here any more")
    return folder


def kind_of(path: Path) -> str:
    """``export``, ``recover``, ``dcp`` (stock DCP), ``deepspeed`` or ``unknown`` for a folder; read-only."""
    try:
        resolve_recovery(path)
        return "recover"
    except CheckpointError:
        pass
    if is_stock_dcp(path):
        return "dcp"
    if deepspeed_folder(path) is not None:
        return "deepspeed"
    if (path / MANIFEST_NAME).is_file() or any(path.glob("*.safetensors")):
        return "export"
    return "unknown"


def describe(path: Path) -> dict[str, Any]:
    """Facts about the checkpoint at ``path`` (kind, step, world size, models, sizes, dtypes,
    parameters, creation time, complete?), as JSON-ready data."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder")
    kind = kind_of(path)
    if kind == "export":
        return _describe_export(path)
    if kind == "recover":
        held = tier_holdings(path)
        return {
            **_describe_recovery(path),
            **({"held": held} if len(held) > 1 or any(e["copied_files"] for e in held) else {}),
        }
    if kind == "deepspeed":
        return _describe_deepspeed(_tag_folder(path))
    if kind == "dcp":
        return _describe_stock_dcp(path)
    held = tier_holdings(path)
    if held:  # another node's local tier: generation folders, no commit record of its own
        return describe_tier(path, held)
    raise CheckpointError(f"{path}: neither an HF export, a recovery checkpoint nor a DeepSpeed checkpoint")


def _describe_export(path: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = {}
    if (path / MANIFEST_NAME).is_file():
        manifest = read_manifest(path, MANIFEST_NAME)
    dtypes: dict[str, int] = {}
    parameters = 0
    for shard in sorted(path.glob("*.safetensors")):
        for name, entry in read_safetensors_header(shard).items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            parameters += count
            dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + count
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    listed = set(manifest.get("files", {}))
    return {
        "kind": "export",
        "path": str(path),
        "name": manifest.get("name"),
        "step": manifest.get("step"),
        "world_size": manifest.get("world_size"),
        "created_unix": manifest.get("created_unix"),
        "parameters": parameters,
        "dtypes": dtypes,
        "bytes": sum(files.values()),
        "files": len(files),
        "complete": bool(manifest) and listed <= set(files),
    }


def _model_facts(folder: Path, manifest: dict[str, Any], model: str) -> dict[str, Any]:
    """Parameters, dtypes, optimizer presence and bytes of one DCP model folder, from its
    metadata as JSON (no torch); CheckpointError naming the metadata file when it is damaged."""
    tensors = tensor_summary(folder / model)
    parts = [tensors]
    if (folder / model / FROZEN_PART).is_dir():  # parameters that do not train, stored once
        parts.append(tensor_summary(folder / model / FROZEN_PART))
    dtypes: dict[str, int] = {}
    for part in parts:
        for name, (dtype, count) in part.items():
            if name.startswith("model."):
                dtypes[dtype] = dtypes.get(dtype, 0) + count
    return {
        "parameters": sum(dtypes.values()),
        "dtypes": dtypes,
        "optimizer": any(name.startswith("optim.") for name in tensors),
        "bytes": sum(e["size"] for f, e in manifest["files"].items() if f.startswith(f"{model}/")),
    }


def _describe_stock_dcp(path: Path) -> dict[str, Any]:
    """A folder written by stock DCP: its tensors by top-level key, read from ``.metadata``
    with the allow-listed unpickler (nothing in it runs); no manifest, so completeness is unknown.
    Imports torch (DCP's metadata types)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from areal_ckpt.formats.stock_dcp import read_stock_metadata

    metadata = read_stock_metadata(path)
    groups: dict[str, dict[str, Any]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        group = groups.setdefault(key.split(".", 1)[0], {"tensors": 0, "elements": 0, "dtypes": set()})
        if isinstance(entry, TensorStorageMetadata):
            group["tensors"] += 1
            group["elements"] += entry.size.numel()
            group["dtypes"].add(str(entry.properties.dtype).removeprefix("torch."))
    files = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
    return {
        "kind": "dcp",
        "path": str(path),
        "step": None,
        "world_size": None,
        "created_unix": None,
        "groups": {name: {**group, "dtypes": sorted(group["dtypes"])} for name, group in sorted(groups.items())},
        "bytes": sum(files.values()),
        "files": len(files),
        "complete": None,
    }


def _describe_deepspeed(folder: Path) -> dict[str, Any]:
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    facts: dict[str, Any] = {
        "kind": "deepspeed",
        "path": str(folder),
        "step": {"tag": folder.name},
        "bytes": sum(files.values()),
        "files": len(files),
    }
    if not (folder / MANIFEST_NAME).is_file():  # DeepSpeed's own layout: no manifest to go by
        return {
            **facts,
            "layout": "deepspeed",
            "world_size": None,
            "created_unix": None,
            "models": {},
            "complete": None,
        }
    manifest = read_manifest(folder, MANIFEST_NAME)
    return {
        **facts,
        "layout": "areal_ckpt",
        "world_size": manifest.get("world_size"),
        "created_unix": manifest.get("created_unix"),
        "models": {"model": _model_facts(folder, manifest, "model")},
        "complete": all(name in files for name in manifest["files"]),
    }


def _describe_recovery(path: Path) -> dict[str, Any]:
    generation, _ = resolve_recovery(path)
    manifest = read_manifest(generation, RECOVER_MANIFEST)
    models = {model: _model_facts(generation, manifest, model) for model in manifest.get("models", [])}
    return {
        "kind": "recover",
        "path": str(generation),
        "step": manifest.get("step"),
        "world_size": manifest.get("world_size"),
        "created_unix": manifest.get("created_unix"),
        "models": models,
        "versions": {"areal_ckpt": manifest.get("areal_ckpt_version"), "torch": manifest.get("torch_version")},
        "bytes": sum(entry["size"] for entry in manifest["files"].values()),
        "files": len(manifest["files"]),
        "complete": all((generation / f).is_file() for f in manifest["files"]),
    }


def verify(path: Path, progress: Callable[[Iterable[str]], Iterable[str]] = iter) -> list[str]:
    """Every problem with the one checkpoint at ``path`` (:func:`found_at`; missing, truncated,
    corrupted, unlisted files; missing manifest), one line each naming the file. Empty means
    intact. Read-only."""
    return [problem for _, problems in verify_found([found_at(Path(path))], progress) for problem in problems]


def found_at(path: Path) -> Found | Unverifiable:
    """The one checkpoint at ``path`` (an export, a recovery checkpoint through any of its
    paths, a DeepSpeed tag or save_dir), or why there is none to check. Read-only."""
    kind = kind_of(path) if path.is_dir() else "unknown"
    if kind == "export":
        return Found("export", path.parent.name, FolderLocation(path.parent), _entry(path), MANIFEST_NAME)
    if kind == "recover":
        generation = resolve_recovery(path)[0]
        return Found("recover", "", FolderLocation(generation.parent), _entry(generation), RECOVER_MANIFEST)
    if kind == "dcp":
        return Unverifiable(str(path), f"{path}: stock DCP carries no checksums; nothing to verify it against")
    if kind == "deepspeed":
        folder = _tag_folder(path)
        if not (folder / MANIFEST_NAME).is_file():
            return Unverifiable(
                str(path), f"{folder}: DeepSpeed's own layout carries no checksums; nothing to verify it against"
            )
        return Found("deepspeed", folder.name, FolderLocation(folder.parent), _entry(folder), MANIFEST_NAME)
    return Unverifiable(str(path), f"{path}: not a checkpoint folder")


def _entry(folder: Path) -> Committed:
    """A checkpoint folder's entry in its parent (step unknown; its time the folder's)."""
    return Committed(folder.name, -1, 0, when=folder.stat().st_mtime)


def _export_step(name: str) -> int | None:
    """The global step an export folder's name holds; None for any other name."""
    leaf = parse_export_leaf(name)
    return None if leaf is None else leaf[2]


def found_in(path: Path) -> list[Found | Unverifiable]:
    """What ``verify`` and ``list`` go through for ``path``: a trial folder's every committed
    export (by model name, then global step) and its recovery checkpoint (the generation its
    commit record names; a broken or missing record is reported as such); any other folder as
    the one checkpoint it is (:func:`found_at`). Read-only."""
    path = Path(path)
    exports: list[Found | Unverifiable] = [
        Found("export", model.name, location, entry, MANIFEST_NAME)
        for model in _model_folders(path)
        for location in [FolderLocation(model)]
        for entry in sorted(location.committed(_export_step), key=lambda entry: entry.step)
    ]
    generations = recovery_location_of(path)
    if not os.path.lexists(generations.where()):
        return exports or [found_at(path)]
    try:
        committed = generations.newest()
    except CheckpointError as error:
        return [*exports, Unverifiable(str(path), str(error), "recover")]
    if committed is None:
        return [*exports, Unverifiable(str(path), f"{generations.where()}: no committed recovery checkpoint")]
    return [*exports, Found("recover", "", generations, committed, RECOVER_MANIFEST)]


def _model_folders(trial: Path) -> list[Path]:
    """A trial's model folders: real folders (a link is not walked) not starting with '.'."""
    if not trial.is_dir():
        return []
    return sorted(p for p in trial.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))


def list_trial(trial: Path) -> list[dict[str, Any]]:
    """Every committed export (all model names) and the recovery checkpoint of a trial
    (:func:`~areal_ckpt.tools.catalog.list_found`), and what a local tier holds besides, newest
    first; CheckpointError when ``trial`` is no folder."""
    trial = Path(trial)
    if not trial.is_dir():
        raise CheckpointError(f"{trial}: not a folder")
    held = tier_holdings(trial)
    entries = list_found(found_in(trial))
    for entry in entries:
        if entry["kind"] == "recover":
            entry["copied_files"] = sum(held_entry["copied_files"] for held_entry in held if held_entry["committed"])
    entries += held_entries(held)  # a local tier: what it holds besides the committed generation
    return sorted(entries, key=lambda e: (e["global_step"] or 0, e["created_unix"] or 0), reverse=True)
