"""What AReaL's recovery files hold, read without running anything from them.

``recover_info/`` (or a generation's ``manifest/``): JSON files, AReaL's trigger state turned
into ours, and the pickled dataloader positions through an unpickler that builds plain data
only. A payload (``{engine}/recover_checkpoint/`` or ``payloads/{engine}/``): the stock DCP of
an FSDP engine's ``{"dcp": DCPState(model, optimizer)}``, its metadata through the allow-listed
unpickler, its records through ``torch.load(weights_only=True)``, every record checked to lie
inside its file before anything is allocated. Local, read-only.
"""

from __future__ import annotations

import io
import logging
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from areal_ckpt.errors import CheckpointError
from areal_ckpt.export.saver import saver_state
from areal_ckpt.formats.dcp_io import failures_text, interruption_in
from areal_ckpt.formats.dcp_metadata import tensor_entry
from areal_ckpt.formats.stock_dcp import SafeFileSystemReader, check_sizes, read_stock_metadata
from areal_ckpt.fsio import open_regular_file, read_json_file
from areal_ckpt.paths import GLOBAL_FILES, STEP_FILE, rank_state_file
from areal_ckpt.schedule import schedule_state
from areal_ckpt.state import safe_json
from areal_ckpt.state.plain_pickle import load_plain_pickle
from areal_ckpt.step import StepInfo

logger = logging.getLogger(__name__)

DATALOADER_PICKLE = "dataloader_info.pkl"
_MODEL, _STATE, _GROUPS = "dcp.model.", "dcp.optim.state.", "dcp.optim.param_groups."


def _schedule(areal: Any, path: Path) -> dict[str, Any] | None:
    """Our trigger state from the state of AReaL's ``EpochStepTimeFreqCtl`` (epochs and steps
    since each trigger fired; the time since the time trigger did, counted up to now); None,
    logged, when it has another shape or a count or time that is not finite (the triggers then
    count afresh)."""
    try:
        last_time = float(areal["time"]["last_time"])
        if not math.isfinite(last_time):
            raise ValueError(f"last_time {last_time}")
        return schedule_state(
            int(areal["epoch"]["steps"] - areal["epoch"]["last_steps"]),
            int(areal["step"]["steps"] - areal["step"]["last_steps"]),
            max(0.0, time.time() - last_time),
        )
    except (KeyError, TypeError, ValueError, OverflowError):  # int() of an infinite count overflows
        logger.warning("%s: not AReaL's trigger state; those triggers count afresh", path)
        return None


def read_recover_info(folder: Path, models: list[str]) -> tuple[StepInfo, dict[str, bytes], int]:
    """AReaL's recover_info: its step, our recover_info files (name -> content) and the number
    of ranks whose dataloader positions it holds. A file there that is a link is refused by
    name (the import reads AReaL's files only where AReaL writes them)."""
    for name in (STEP_FILE, *GLOBAL_FILES.values(), DATALOADER_PICKLE):
        if (folder / name).is_symlink():
            raise CheckpointError(
                f"{folder / name}: is a link; the import reads AReaL's files only where AReaL writes them, never "
                "through a link: put the file itself there (or remove the link), nothing was imported"
            )
    _, raw_step = read_json_file(folder / STEP_FILE, "AReaL step info")
    try:
        step_info = StepInfo.from_dict(raw_step)
        step_info.check_completed()
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{folder / STEP_FILE}: invalid step info: {error}") from None
    files = {STEP_FILE: safe_json.dumps(step_info.to_dict())}
    for key, name in GLOBAL_FILES.items():
        path = folder / name
        value = read_json_file(path, f"AReaL {key}")[1] if path.is_file() else None
        if key == "checkpoint_info" and value is not None:
            value = _schedule(value, path)
        elif key == "saver_info" and value is not None:
            schedule = _schedule(value, path)
            value = None if schedule is None else saver_state(dict.fromkeys(models, schedule))
        files[name] = safe_json.dumps(value)
    positions = load_plain_pickle(folder / DATALOADER_PICKLE)
    per_rank = positions if isinstance(positions, list) else [positions]
    if not per_rank:
        raise CheckpointError(f"{folder / DATALOADER_PICKLE}: an empty list of dataloader positions")
    for rank, position in enumerate(per_rank):
        try:
            files[rank_state_file(rank)] = safe_json.dumps({"dataloader": position, "rng": None, "client_state": {}})
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{folder / DATALOADER_PICKLE}: rank {rank}'s position: {error}") from None
    return step_info, files, len(per_rank)


@dataclass
class ModelState:
    tensors: dict[str, torch.Tensor]
    param_groups: list[dict[str, Any]]
    scalars: dict[str, dict[str, Any]]


def stored_tensors(folder: Path) -> tuple[Metadata, dict[str, str]]:
    """``folder``'s metadata and its tensors' stored keys -> our names, once the metadata is
    read safely, the layout is an AReaL engine's and every record lies inside its file."""
    metadata = read_stock_metadata(folder)
    keys = [key for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)]
    names = {key: _our_name(key, folder) for key in keys}
    if not any(name.startswith("model.") for name in names.values()):
        raise CheckpointError(f"{folder}: holds no model tensors under {_MODEL!r} (an AReaL FSDP engine's layout)")
    check_sizes(metadata, folder, keys)  # before anything is allocated from the metadata
    return metadata, names


def read_model(folder: Path) -> ModelState:
    """One model's whole state from AReaL's stock DCP folder, under our flat names."""
    metadata, names = stored_tensors(folder)
    entries = metadata.state_dict_metadata
    template = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in ((key, tensor_entry(metadata, key, folder)) for key in names)
    }
    extras = {
        key: _read_value(metadata, key, folder)
        for key, entry in entries.items()
        if isinstance(entry, BytesStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP's notice that it runs in one process, as intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.load(template, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
        except CheckpointException as error:  # a BaseException in DCP: make it an ordinary error
            interruption = interruption_in(error)
            if interruption is not None:
                raise interruption from None
            raise CheckpointError(f"{folder}: reading AReaL's tensors failed: {failures_text(error)}") from None
    tensors = {names[key]: tensor for key, tensor in template.items()}
    groups: dict[int, dict[str, Any]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for key, value in extras.items():
        if key.startswith(_GROUPS):
            index, _, field = key[len(_GROUPS) :].partition(".")
            if not index.isdigit() or not field:
                raise CheckpointError(f"{folder}: unexpected param group entry {key!r}")
            groups.setdefault(int(index), {})[field] = value
        elif key.startswith(_STATE):
            fqn, _, field = key[len(_STATE) :].rpartition(".")
            scalars.setdefault(fqn, {})[field] = value
        else:
            raise CheckpointError(f"{folder}: unexpected non-tensor entry {key!r}")
    for fqn in {name[len("optim.") :].rpartition(".")[0] for name in tensors if name.startswith("optim.")}:
        scalars.setdefault(fqn, {})
    return ModelState(tensors, [groups[index] for index in sorted(groups)], scalars)


def _our_name(key: str, folder: Path) -> str:
    if key.startswith(_MODEL):
        return "model." + key[len(_MODEL) :]
    if key.startswith(_STATE):
        return "optim." + key[len(_STATE) :]
    raise CheckpointError(f"{folder}: tensor {key!r} is neither under {_MODEL!r} nor {_STATE!r}")


def _read_value(metadata: Metadata, key: str, folder: Path) -> Any:
    """A non-tensor entry (a param group field), read through ``torch.load(weights_only=True)``."""
    info = metadata.storage_data.get(MetadataIndex(key))
    if info is None or not isinstance(getattr(info, "relative_path", None), str):
        raise CheckpointError(f"{folder}: no storage record for {key!r}")
    path = folder / info.relative_path
    if path.resolve().parent != folder.resolve() or info.length > (1 << 20):
        raise CheckpointError(f"{folder}: refused the record of {key!r} ({info.relative_path}, {info.length} bytes)")
    try:
        with open_regular_file(path) as stream:
            stream.seek(info.offset)
            data = stream.read(info.length)
        return torch.load(io.BytesIO(data), weights_only=True)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read {key!r}: {error.strerror}") from None
    except Exception as error:  # torch's weights-only unpickler refuses with several types
        raise CheckpointError(f"{path}: refused {key!r}: {error}; nothing in it was run") from None
