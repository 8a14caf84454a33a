"""A recovery checkpoint's model, read back from DCP shards as an export source.

Offers what :mod:`areal_ckpt.formats.hf_export` needs (config, tensor list, gathering) so the
same export code that serves a live model turns a checkpoint into a HuggingFace folder. Tensors
are read one shard file's worth at a time: peak memory is bounded by the largest output shard.
Single process, no process group needed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_io import load_tensors, tensor_index
from areal_ckpt.formats.dcp_metadata import check_within_files, read_metadata_json
from areal_ckpt.formats.hf_export import names_of_rank
from areal_ckpt.formats.hf_keys import architecture_of
from areal_ckpt.paths import ENGINE_STATE_FILE, FROZEN_PART, MODEL_PREFIX, OPTIM_PREFIX
from areal_ckpt.state import safe_json
from areal_ckpt.tensors import TensorSpec

_SKIP_WHEN_READING = (MODEL_PREFIX, OPTIM_PREFIX)


class DcpModelSource:
    """The model of one ``{name}/`` folder of a recovery generation or tag (DCP shards +
    ``hf/``). With ``hf_folder`` None no HF config is read: every stored tensor is offered
    (tied duplicates too), and :meth:`read` serves a state dict rather than an HF export."""

    def __init__(self, folder: Path, hf_folder: Path | None) -> None:
        self.folder = folder
        self.config: Any = None
        self.generation_config: Any = None
        self.architecture = "a model without an HF config"
        if hf_folder is not None:
            if not (hf_folder / "config.json").is_file():
                raise CheckpointError(
                    f"{hf_folder / 'config.json'}: missing; this checkpoint did not record the model's HF config (a "
                    "plain nn.Module has none): name a folder holding one with --config-from (areal-ckpt export) or "
                    "--config (areal-ckpt convert-deepspeed)"
                )
            self.config = AutoConfig.from_pretrained(hf_folder, local_files_only=True)
            generation = hf_folder / "generation_config.json"
            if generation.is_file():
                self.generation_config = GenerationConfig.from_pretrained(hf_folder, local_files_only=True)
            self.architecture = architecture_of(self.config)
        self.on_accelerator = False
        self._metadata = read_metadata_json(folder)
        engine_state = _engine_state(folder)
        self._folders = [(folder, self._metadata)]  # the model's, then its frozen part's
        if engine_state.get("frozen_part"):
            self._folders.append((folder / FROZEN_PART, read_metadata_json(folder / FROZEN_PART)))
        self._index: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._home: dict[str, tuple[Path, Any]] = {}  # the folder (and its metadata) a tensor is in
        for where, metadata in self._folders:
            check_within_files(metadata, where)  # before any tensor is allocated from it
            for name, value in tensor_index(metadata).items():
                if name.startswith(MODEL_PREFIX):
                    self._index[name[len(MODEL_PREFIX) :]] = value
                    self._home[name[len(MODEL_PREFIX) :]] = (where, metadata)
        if not self._index:
            raise CheckpointError(f"{folder}: holds no model tensors")
        deepspeed = engine_state.get("deepspeed") or {}
        #: A PEFT model's recorded adapter configurations and active adapters (None otherwise).
        self.adapters: dict[str, Any] | None = engine_state.get("peft")
        self.active_adapters: list[str] | None = engine_state.get("peft_active")
        self._shapes = {name: shape for name, (_, shape) in self._index.items()}
        self._shapes.update(
            {name: tuple(shape) for name, shape in (deepspeed.get("flat_shapes") or {}).items() if name in self._index}
        )
        tied = tied_names(self.config) if self.config is not None else set()
        self._names = [name for name in self._index if name not in tied]
        self._masters = _MasterLayout.of(deepspeed, self._metadata, folder)
        self._trained = _MasterLayout.trained(deepspeed, folder)
        self._from_masters: dict[str, torch.Tensor] | None = None

    @property
    def names(self) -> list[str]:
        """Every model tensor offered, in stored order (tied duplicates left out with a config)."""
        return list(self._names)

    @property
    def trained_names(self) -> set[str] | None:
        """The parameters a DeepSpeed ZeRO 1-3 checkpoint has fp32 masters of (the trained
        ones; the rest were frozen), None for any other checkpoint."""
        return self._trained

    def export_specs(self) -> list[TensorSpec]:
        """Stored model tensors (full shapes), tied duplicates left out; local, reads metadata only.
        Parameters a DeepSpeed checkpoint also holds as fp32 masters are exported from those, in
        float32 (as ``zero_to_fp32`` does): the module's copy may be bf16 / fp16."""
        return [TensorSpec(name, self._shapes[name], self._dtype(name)) for name in self._names]

    def _dtype(self, name: str) -> torch.dtype:
        return torch.float32 if self._masters is not None and name in self._masters.names else self._index[name][0]

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each name of this rank's entry of ``files`` with its tensor (see :meth:`read`); local."""
        return self.read(names_of_rank(files))

    def read(self, wanted: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each of ``wanted`` with its full tensor read from the shards (one DCP read per folder
        for all of them; the fp32 masters, when there are some, are read once, whole, at the
        first call); local."""
        if self._masters is not None and self._from_masters is None and wanted:
            self._from_masters = self._masters.rebuild(self.folder, self._metadata)
        from_masters = self._from_masters or {}
        stored = [name for name in wanted if name not in from_masters]
        template = {
            MODEL_PREFIX + name: torch.empty(self._index[name][1], dtype=self._index[name][0]) for name in stored
        }
        for where, metadata in self._folders:  # one DCP read per folder that holds some of them
            here = {key: value for key, value in template.items() if self._home[key[len(MODEL_PREFIX) :]][0] == where}
            if here:
                load_tensors(here, where, optional_prefixes=_SKIP_WHEN_READING, metadata=metadata)
        for name in wanted:
            if name in from_masters:
                yield name, from_masters.pop(name)
            else:
                yield name, template.pop(MODEL_PREFIX + name).reshape(self._shapes[name])


class _MasterLayout:
    """A DeepSpeed ZeRO 1-3 checkpoint's fp32 master partitions and where each parameter lies in
    them (recorded at save time by DeepSpeedEngine)."""

    def __init__(self, layout: list[list[dict[str, Any]]], world: int, stage: int) -> None:
        self.layout, self.world, self.stage = layout, world, stage
        self.names = {entry["name"] for group in layout for entry in group}

    @classmethod
    def of(cls, deepspeed: dict[str, Any], metadata: Any, folder: Path) -> _MasterLayout | None:
        """The layout when the checkpoint records one and holds every rank's masters, else None."""
        layout = deepspeed.get("masters")
        if not layout:
            return None
        try:
            world, stage = int(deepspeed["world_size"]), int(deepspeed["zero_stage"])
            stored = metadata.state_dict_metadata
            if not all(f"{OPTIM_PREFIX}rank{r}.master.{g}" in stored for r in range(world) for g in range(len(layout))):
                return None
            return cls(layout, world, stage)
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{folder / ENGINE_STATE_FILE}: malformed master layout: {error}") from None

    @staticmethod
    def trained(deepspeed: dict[str, Any], folder: Path) -> set[str] | None:
        """The names the recorded layout places in the masters (whether the masters are stored
        apart or, in fp32 training, as the weights themselves); None without a layout."""
        layout = deepspeed.get("masters")
        if not layout:
            return None
        try:
            return {str(entry["name"]) for group in layout for entry in group}
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"{folder / ENGINE_STATE_FILE}: malformed master layout: {error}") from None

    def rebuild(self, folder: Path, metadata: Any) -> dict[str, torch.Tensor]:
        """Full fp32 parameters from every rank's master partitions; reads them all (local)."""
        keys = {(r, g): f"{OPTIM_PREFIX}rank{r}.master.{g}" for r in range(self.world) for g in range(len(self.layout))}
        index = tensor_index(metadata)
        template = {key: torch.empty(index[key][1], dtype=index[key][0]) for key in keys.values()}
        load_tensors(template, folder, optional_prefixes=_SKIP_WHEN_READING, metadata=metadata)
        full: dict[str, torch.Tensor] = {}
        try:
            for g, entries in enumerate(self.layout):
                partitions = [template[keys[(r, g)]] for r in range(self.world)]
                flat = torch.cat(partitions) if self.stage < 3 else None
                for entry in entries:
                    shape, offset = tuple(entry["shape"]), int(entry["offset"])
                    numel = _numel(shape)
                    if flat is not None:
                        piece = flat[offset : offset + numel]
                    else:
                        part = int(entry["partition"])
                        piece = torch.cat([p[offset : offset + part] for p in partitions])[:numel]
                    if piece.numel() != numel:
                        raise ValueError(f"{entry['name']}: the masters hold {piece.numel()} of {numel} elements")
                    full[entry["name"]] = piece.reshape(shape).to(torch.float32).clone()
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"{folder / ENGINE_STATE_FILE}: master layout does not match the masters: {error}"
            ) from None
        return full


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def tied_names(config: Any) -> set[str]:
    """Tied duplicates (e.g. lm_head.weight) as the model class of ``config`` declares them;
    the model is built on the meta device (no memory)."""
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return set(getattr(model, "all_tied_weights_keys", None) or {})


def _engine_state(folder: Path) -> dict[str, Any]:
    """The folder's engine_state.json ({} when there is none); CheckpointError naming it."""
    path = folder / ENGINE_STATE_FILE
    if not path.is_file():
        return {}
    try:
        extra = safe_json.loads(path.read_bytes(), str(path))
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    if not isinstance(extra, dict) or not all(isinstance(extra.get(key) or {}, dict) for key in ("deepspeed", "peft")):
        raise CheckpointError(f"{path}: expected an object")
    if not isinstance(extra.get("peft_active") or [], list):
        raise CheckpointError(f"{path}: peft_active: expected a list")
    return extra
