"""DeepSpeed's fp32 recovery functions, for our checkpoints and for DeepSpeed's own.

The same three names, arguments and results as ``deepspeed.utils.zero_to_fp32``, so that code
importing them from there runs after changing the import:

- :func:`get_fp32_state_dict_from_zero_checkpoint`: a full state dict on the CPU, trained
  parameters in fp32 (rebuilt from the fp32 master partitions), frozen ones as stored;
- :func:`load_state_dict_from_zero_checkpoint`: that, loaded into a model (moved to the CPU);
- :func:`convert_zero_checkpoint_to_fp32_state_dict`: that, written into an output folder
  (DeepSpeed 0.19's form: ``pytorch_model.bin`` or ``model.safetensors``, sharded with an index
  above ``max_shard_size``).

A tag folder written by ``areal_ckpt.save_checkpoint`` is read through its JSON metadata, its
files checked against the manifest first. A tag folder in DeepSpeed's own layout is handed to
DeepSpeed's implementation with every ``torch.load`` forced to ``weights_only=True``, so nothing
in it can run code. All three are local, single-process and blocking; offline, without this
package, ``zero_to_fp32.py`` in the save_dir does the conversion of ours with torch and
safetensors alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.deepspeed_pickles import weights_only_deepspeed_loads
from areal_ckpt.fsio import fsync_dir, fsync_file
from areal_ckpt.tools.convert import is_ours, tag_folder, tagged_model

logger = logging.getLogger(__name__)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | Path, tag: str | None = None, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The full model state dict of checkpoint ``tag`` (None: what ``latest`` names) in
    ``checkpoint_dir``, on the CPU: parameters the optimizer trained in fp32 from its master
    copies, the rest (frozen parameters, buffers) in their stored dtype; with
    ``exclude_frozen_parameters`` only the trained ones. CheckpointError naming the file when a
    file is missing or damaged. Local, blocking."""
    folder = tag_folder(Path(checkpoint_dir), tag)
    if not is_ours(folder):
        return _deepspeed_own(folder, exclude_frozen_parameters)
    model = tagged_model(folder, None)
    trained = model.trained_names
    names = [n for n in model.names if not (exclude_frozen_parameters and trained is not None and n not in trained)]
    return dict(model.read(names))


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | Path, tag: str | None = None
) -> nn.Module:
    """Move ``model`` to the CPU and load :func:`get_fp32_state_dict_from_zero_checkpoint` into
    it (non-strict, as DeepSpeed does); returns the model. Local, blocking."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    max_shard_size: str | int = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write :func:`get_fp32_state_dict_from_zero_checkpoint` (every floating-point tensor in
    fp32) into ``output_dir``: ``model.safetensors`` with ``safe_serialization``, else
    ``pytorch_model.bin``; split by huggingface_hub at ``max_shard_size`` with an index, as
    DeepSpeed 0.19 does. Every file is fsync'd. Local, blocking."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    state_dict = {name: t.float() if t.is_floating_point() else t for name, t in state_dict.items()}
    write_state_dict(state_dict, Path(output_dir), max_shard_size, safe_serialization)


def write_state_dict(
    state_dict: Mapping[str, torch.Tensor], output_dir: Path, max_shard_size: str | int, safe_serialization: bool
) -> None:
    """Write ``state_dict`` into ``output_dir`` as DeepSpeed's converter names its files; durable.
    Local, blocking."""
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    pattern = weights.replace(".safetensors", "{suffix}.safetensors").replace(".bin", "{suffix}.bin")
    split = split_torch_state_dict_into_shards(
        dict(state_dict), filename_pattern=pattern, max_shard_size=max_shard_size
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    for file_name, names in split.filename_to_tensors.items():
        shard = {name: state_dict[name].contiguous() for name in names}
        if safe_serialization:
            save_file(shard, output_dir / file_name, metadata={"format": "pt"})
        else:
            torch.save(shard, output_dir / file_name)
        fsync_file(output_dir / file_name)
    if split.is_sharded:
        index_name = f"{weights}.index.json"
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (output_dir / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        fsync_file(output_dir / index_name)
    fsync_dir(output_dir)


def _deepspeed_own(folder: Path, exclude_frozen_parameters: bool) -> dict[str, torch.Tensor]:
    """DeepSpeed's implementation over its own layout, its loads weights-only."""
    try:
        from deepspeed.utils import zero_to_fp32
    except ImportError:
        raise CheckpointError(
            f"{folder}: a checkpoint in DeepSpeed's own layout; reading it needs DeepSpeed installed"
        ) from None
    logger.info("rebuilding full fp32 weights of %s with DeepSpeed's zero_to_fp32 (weights-only loads)", folder)
    with weights_only_deepspeed_loads():
        return dict(
            zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                str(folder.parent), tag=folder.name, exclude_frozen_parameters=exclude_frozen_parameters
            )
        )
