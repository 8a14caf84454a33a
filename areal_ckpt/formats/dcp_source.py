"""A recovery checkpoint's model, read back from DCP shards as an export source.

Offers what :mod:`areal_ckpt.formats.hf_export` needs (config, tensor list, gathering) so the
same export code that serves a live model turns a checkpoint into a HuggingFace folder. Tensors
are read one shard file's worth at a time: peak memory is bounded by the largest output shard.
Single process, no process group needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_io import load_tensors, tensor_index
from areal_ckpt.formats.dcp_storage import check_within_files, read_metadata_json
from areal_ckpt.formats.hf_export import names_of_rank
from areal_ckpt.layout import ENGINE_STATE_FILE
from areal_ckpt.state import safe_json
from areal_ckpt.tensors import TensorSpec

MODEL_PREFIX = "model."
_SKIP_WHEN_READING = ("model.", "optim.")


class DcpModelSource:
    """The model of one ``{name}/`` folder of a recovery generation (DCP shards + ``hf/``)."""

    def __init__(self, folder: Path, hf_folder: Path) -> None:
        self.folder = folder
        if not (hf_folder / "config.json").is_file():
            raise CheckpointError(
                f"{hf_folder / 'config.json'}: missing; this checkpoint did not record the model's HF config"
            )
        self.config = AutoConfig.from_pretrained(hf_folder, local_files_only=True)
        generation = hf_folder / "generation_config.json"
        self.generation_config = (
            GenerationConfig.from_pretrained(hf_folder, local_files_only=True) if generation.is_file() else None
        )
        architectures = getattr(self.config, "architectures", None) or []
        self.architecture = architectures[0] if architectures else type(self.config).__name__
        self.on_accelerator = False
        self._metadata = read_metadata_json(folder)
        check_within_files(self._metadata, folder)  # before any tensor is allocated from it
        self._index = {
            name[len(MODEL_PREFIX):]: value
            for name, value in tensor_index(self._metadata).items()
            if name.startswith(MODEL_PREFIX)
        }
        if not self._index:
            raise CheckpointError(f"{folder}: holds no model tensors")
        self._shapes = {name: shape for name, (_, shape) in self._index.items()}
        self._shapes.update({name: tuple(shape) for name, shape in _flat_shapes(folder).items() if name in self._index})
        tied = tied_names(self.config)
        self._names = [name for name in self._index if name not in tied]

    def export_specs(self) -> list[TensorSpec]:
        """Stored model tensors (full shapes), tied duplicates left out; local, reads metadata only."""
        return [TensorSpec(name, self._shapes[name], self._index[name][0]) for name in self._names]

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each name of this rank's entry of ``files`` with its tensor read from the shards (one
        DCP read for all of them); local."""
        wanted = names_of_rank(files)
        template = {
            MODEL_PREFIX + name: torch.empty(self._index[name][1], dtype=self._index[name][0]) for name in wanted
        }
        if wanted:
            load_tensors(template, self.folder, optional_prefixes=_SKIP_WHEN_READING, metadata=self._metadata)
        for name in wanted:
            yield name, template.pop(MODEL_PREFIX + name).reshape(self._shapes[name])


def tied_names(config: Any) -> set[str]:
    """Tied duplicates (e.g. lm_head.weight) as the model class of ``config`` declares them;
    the model is built on the meta device (no memory)."""
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return set(getattr(model, "all_tied_weights_keys", None) or {})


def _flat_shapes(folder: Path) -> dict[str, list[int]]:
    """Real shapes of parameters stored flattened (DeepSpeed ZeRO-3 partitions), if any."""
    path = folder / ENGINE_STATE_FILE
    if not path.is_file():
        return {}
    try:
        extra = safe_json.loads(path.read_bytes(), str(path))
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    return (extra.get("deepspeed") or {}).get("flat_shapes") or {}
