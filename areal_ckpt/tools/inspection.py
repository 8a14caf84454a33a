"""What a checkpoint folder is, whether it is intact, and what a trial holds. Read-only."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_names import tensor_summary
from areal_ckpt.generations.store import RecoverStore, resolve_recovery
from areal_ckpt.paths import (
    FROZEN_PART,
    LATEST,
    MANIFEST_NAME,
    RECOVER_MANIFEST,
    RECOVER_STORE,
    TAGGED_FORMAT,
    is_stock_dcp,
    parse_export_leaf,
    recover_pointer,
)
from areal_ckpt.publish import check_files, read_manifest
from areal_ckpt.storage.folder_location import FolderLocation
from areal_ckpt.storage.pointers import PointerFile
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
    """Every problem with the checkpoint at ``path`` (missing, truncated, corrupted, unlisted
    files; missing manifest), one line each naming the file. Empty means intact. Read-only."""
    path = Path(path)
    kind = kind_of(path) if path.is_dir() else "unknown"
    if kind == "export":
        folder, manifest_name = path, MANIFEST_NAME
    elif kind == "recover":
        folder, manifest_name = resolve_recovery(path)[0], RECOVER_MANIFEST
    elif kind == "dcp":
        return [f"{path}: stock DCP carries no checksums; nothing to verify it against"]
    elif kind == "deepspeed":
        folder, manifest_name = _tag_folder(path), MANIFEST_NAME
        if not (folder / manifest_name).is_file():
            return [f"{folder}: DeepSpeed's own layout carries no checksums; nothing to verify it against"]
    else:
        return [f"{path}: not a checkpoint folder"]
    try:
        manifest = read_manifest(folder, manifest_name)
    except CheckpointError as error:
        return [str(error)]
    files = manifest["files"]
    problems = [problem for name in progress(sorted(files)) for problem in check_files(folder, files, [name])]
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()}
    for extra in sorted(on_disk - set(files) - {manifest_name}):
        problems.append(f"{folder / extra}: not listed in the manifest (added after the checkpoint was written)")
    return problems


def checkpoints_in(path: Path) -> list[Path]:
    """What ``verify`` checks for ``path``: a trial folder's every export (by model name, then
    global step) and its recovery checkpoint (the trial folder itself); any other folder as it
    is. Read-only."""
    path = Path(path)
    exports = sorted(
        (
            export
            for model in _model_folders(path)
            for export in model.iterdir()
            if export.is_dir() and not export.is_symlink() and parse_export_leaf(export.name) is not None
        ),
        key=lambda export: (export.parent.name, parse_export_leaf(export.name)),
    )
    has_recovery = recover_pointer(path).is_symlink() or (path / RECOVER_STORE).exists()
    if not exports and not has_recovery:
        return [path]
    return [*exports, *([path] if has_recovery else [])]


def verify_each(path: Path, progress: Callable[[Iterable[str]], Iterable[str]] = iter) -> list[tuple[Path, list[str]]]:
    """(checkpoint, problems) for each checkpoint :func:`checkpoints_in` finds under ``path``;
    a trial's recovery checkpoint is found through its commit record, whose problems (missing,
    broken) are reported as such. Read-only."""
    results = []
    for checkpoint in checkpoints_in(path):
        if checkpoint == Path(path) and (checkpoint / RECOVER_STORE).exists():
            try:
                if RecoverStore(checkpoint).committed() is None:
                    results.append((checkpoint, [f"{checkpoint / RECOVER_STORE}: no committed recovery checkpoint"]))
                    continue
            except CheckpointError as error:
                results.append((checkpoint, [str(error)]))
                continue
        results.append((checkpoint, verify(checkpoint, progress)))
    return results


def _model_folders(trial: Path) -> list[Path]:
    """A trial's model folders: real folders (a link is not walked) not starting with '.'."""
    if not trial.is_dir():
        return []
    return sorted(p for p in trial.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))


def list_trial(trial: Path) -> list[dict[str, Any]]:
    """Every export (all model names) and the recovery checkpoint of a trial, newest first."""
    trial = Path(trial)
    if not trial.is_dir():
        raise CheckpointError(f"{trial}: not a folder")
    entries = []
    held = tier_holdings(trial)
    for model in sorted(p for p in trial.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for export in model.iterdir():
            parsed = parse_export_leaf(export.name)
            if parsed is None or not export.is_dir():
                continue
            size = sum(p.stat().st_size for p in export.iterdir() if p.is_file())
            entries.append(
                {
                    "kind": "export",
                    "name": model.name,
                    "epoch": parsed[0],
                    "epoch_step": parsed[1],
                    "global_step": parsed[2],
                    "bytes": size,
                    "created_unix": export.stat().st_mtime,
                    "path": str(export),
                }
            )
    if recover_pointer(trial).is_symlink():
        try:
            recovery = _describe_recovery(trial)
        except CheckpointError as error:  # shown, not hidden: a damaged checkpoint is news
            recovery = {
                "models": {},
                "step": None,
                "bytes": None,
                "created_unix": None,
                "path": str(recover_pointer(trial)),
                "problem": str(error),
            }
        step = recovery["step"] or {}
        entries.append(
            {
                "kind": "recover",
                "name": ",".join(recovery["models"]),
                "epoch": step.get("epoch"),
                "epoch_step": step.get("epoch_step"),
                "global_step": step.get("global_step"),
                "bytes": recovery["bytes"],
                "created_unix": recovery["created_unix"],
                "path": recovery["path"],
                **({"problem": recovery["problem"]} if "problem" in recovery else {}),
                "copied_files": sum(entry["copied_files"] for entry in held if entry["committed"]),
            }
        )
    entries += held_entries(held)  # a local tier: what it holds besides the committed generation
    return sorted(entries, key=lambda e: (e["global_step"] or 0, e["created_unix"] or 0), reverse=True)
