"""Exports of PEFT models (LoRA...): adapter folders that serving tools load, and merged models.

A PEFT model's own state dict (``base_model.model.…lora_A.default.weight``) is neither a model
``from_pretrained`` loads nor an adapter ``PeftModel.from_pretrained`` loads. An export of one
is therefore laid out here, from ``peft``'s own API:

- ``adapter``: each adapter as ``save_pretrained`` of peft writes it: ``adapter_config.json``
  plus ``adapter_model.safetensors`` under peft's standard key names (no adapter name in them),
  the adapter named ``default`` at the folder's top, every other one in a subfolder of its name.
  Only adapter tensors are gathered: no rank ever holds the base model whole.
- ``merged``: the base model with the active LoRA adapters added into its weights (what
  ``merge_and_unload`` gives, computed the same way, without touching the live model), as an
  HF folder ``AutoModelForCausalLM.from_pretrained`` loads.
- ``both``: the merged model at the top and the adapter folder(s) under ``adapter/``.

``peft`` is optional: without it installed no model is a PEFT model.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from areal_ckpt.config import LORA_EXPORTS
from areal_ckpt.engines.accept import export_files
from areal_ckpt.engines.contract import ExportSource
from areal_ckpt.engines.peft_configs import peft_model_of
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.hf_export import ExportPlan, FolderFiles, HFFiles, names_of_rank, plan_export
from areal_ckpt.formats.hf_keys import check_loadable
from areal_ckpt.tensors import TensorSpec, export_dtype_for

ADAPTER_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def export_source(source: ExportSource, lora: str, base_model_path: str | None) -> ExportSource:
    """What an export of ``source`` writes: ``source`` itself, or a :class:`PeftExport` of it
    when its model is a PEFT model (``lora`` picks the layout); local, touches no tensor."""
    model = peft_model_of(getattr(source, "module", None))
    return source if model is None else PeftExport(source, model, lora, base_model_path)


@dataclass(frozen=True)
class _Adapter:
    """One adapter of the export: its folder (relative), config, and plan name -> key in its file."""

    folder: str
    config: Any
    keys: dict[str, str]


@dataclass(frozen=True)
class _Merge:
    """How one merged weight is made: the base weight plus each (A, B, scale) of active adapters."""

    base: str
    pairs: tuple[tuple[str, str, float], ...]
    transpose: bool


@dataclass(frozen=True)
class PeftFiles:
    """The non-tensor files of a PEFT export: the HF files (config.json only beside a merged
    model; tokenizer, processor, generation config and base model files either way) and
    each adapter's ``adapter_config.json``; picklable."""

    model: HFFiles
    adapters: tuple[tuple[str, Any], ...]

    def write(self, folder: Path) -> None:
        """Write them into ``folder`` (adapter configs into their subfolders); local, not
        fsync'd (the commit does that); only fresh regular files are created."""
        self.model.write(folder)
        for relative, config in self.adapters:
            target = folder / relative
            target.mkdir(parents=True, exist_ok=True)
            config.save_pretrained(str(target))


class PeftExport:
    """An export source for an engine whose model is a ``peft.PeftModel`` (see the module
    docstring). Its tensor names are plan names: the engine's own for adapter tensors, the
    base model's for merged ones. Construction is local and cheap; :meth:`gather_round` is
    collective when the engine's model is sharded, as the engine's is."""

    def __init__(self, engine: ExportSource, model: Any, lora: str, base_model_path: str | None) -> None:
        if lora not in LORA_EXPORTS:
            raise CheckpointError(f"saver lora: {lora!r} is not one of {', '.join(LORA_EXPORTS)}")
        self.engine = engine
        self.model = model
        self.lora = lora
        self.base_model_path = base_model_path
        self._engine_specs = {spec.name: spec for spec in engine.export_specs()}
        self._adapters = self._plan_adapters() if lora in ("adapter", "both") else []
        self._merges: dict[str, _Merge] = self._plan_merges() if lora in ("merged", "both") else {}

    # -- what the export holds -----------------------------------------------------------

    @property
    def config(self) -> Any:
        """The base model's HF config (the merged model's)."""
        return self.model.get_base_model().config

    @property
    def generation_config(self) -> Any | None:
        """The base model's generation config, when it generates."""
        return self.engine.generation_config

    @property
    def architecture(self) -> str:
        """The base model's class name (what the merged model's config.json records)."""
        return type(self.model.get_base_model()).__name__

    @property
    def on_accelerator(self) -> bool:
        """As the engine's."""
        return self.engine.on_accelerator

    def export_specs(self) -> list[TensorSpec]:
        """Every tensor written, by plan name, in the engine's dtype; local."""
        merged = [
            TensorSpec(name, self._engine_specs[m.base].shape, self._engine_specs[m.base].dtype)
            for name, m in self._merges.items()
        ]
        adapters = [self._engine_specs[name] for adapter in self._adapters for name in adapter.keys]
        return merged + adapters

    def plan(self, max_shard_size: int, dtype: torch.dtype | None) -> ExportPlan:
        """The files: the merged model split as ``save_pretrained`` splits (and indexed), each
        adapter whole in its ``adapter_model.safetensors``; local, pure."""
        specs = {spec.name: spec for spec in self.export_specs()}
        merged = plan_export([specs[name] for name in self._merges], max_shard_size, dtype) if self._merges else None
        files = dict(merged.files) if merged else {}
        planned = dict(merged.specs) if merged else {}
        for adapter in self._adapters:
            files[f"{adapter.folder}{ADAPTER_FILE}"] = list(adapter.keys)
            for name, key in adapter.keys.items():
                planned[name] = TensorSpec(key, specs[name].shape, export_dtype_for(specs[name].dtype, dtype))
        return ExportPlan(
            files=files,
            weight_map=merged.weight_map if merged else {},
            total_size=sum(spec.nbytes for spec in planned.values()),
            specs=planned,
        )

    def folder_files(
        self, dtype: torch.dtype | None, tokenizer: Any | None, processor: Any | None, assets: str | None
    ) -> FolderFiles:
        """The export's non-tensor files (see :class:`PeftFiles`); local."""
        model = export_files(self, dtype, tokenizer, processor, assets)
        configs = tuple((adapter.folder, adapter.config) for adapter in self._adapters)
        return PeftFiles(model if self._merges else dataclasses.replace(model, config=None), configs)

    def check(self, where: str) -> None:
        """Raise CheckpointError naming ``where`` unless ``from_pretrained`` of the base model
        class loads the merged names; local."""
        if self._merges:
            check_loadable(self.config, self.architecture, list(self._merges), where)

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this rank's entry of ``files`` with full tensors, merged ones computed from their
        base weight and adapters; collective exactly when the engine's is."""
        expanded = [[part for name in names for part in self._parts(name)] for names in files]
        gathered = self.engine.gather_round(expanded)
        for name in names_of_rank(files):
            parts = [tensor for _, tensor in itertools.islice(gathered, len(self._parts(name)))]
            yield name, self._combine(name, parts)
        for _ in gathered:  # the rest of the collective steps, when this rank had fewer
            pass

    # -- planning --------------------------------------------------------------------------

    def _parts(self, name: str) -> list[str]:
        merge = self._merges.get(name)
        if merge is None:
            return [name]
        return [merge.base, *(part for a, b, _ in merge.pairs for part in (a, b))]

    def _combine(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        merge = self._merges.get(name)
        if merge is None or not merge.pairs:
            return parts[0]
        weight = parts[0]
        for index, (_, _, scale) in enumerate(merge.pairs):
            weight = weight + _delta(parts[1 + 2 * index], parts[2 + 2 * index], scale, merge.transpose)
        return weight

    def _plan_adapters(self) -> list[_Adapter]:
        from peft import get_peft_model_state_dict

        prefix = "adapter/" if self.lora == "both" else ""
        placeholders = {
            name: torch.empty(spec.shape, dtype=spec.dtype, device="meta") for name, spec in self._engine_specs.items()
        }
        name_of = {id(tensor): name for name, tensor in placeholders.items()}
        adapters = []
        for adapter_name, config in self.model.peft_config.items():
            exported = get_peft_model_state_dict(self.model, state_dict=placeholders, adapter_name=adapter_name)
            keys = {}
            for key, tensor in exported.items():
                if id(tensor) not in name_of:
                    raise CheckpointError(
                        f"adapter {adapter_name!r} ({config.peft_type.value}): its tensor {key} is computed, not one of "
                        "the model's parameters or buffers, so areal_ckpt cannot export it; write this adapter "
                        "with peft's own model.save_pretrained(folder)"
                    )
                keys[name_of[id(tensor)]] = key
            folder = prefix if adapter_name == "default" else f"{prefix}{adapter_name}/"
            adapters.append(_Adapter(folder, self._adapter_config(config), keys))
        return adapters

    def _adapter_config(self, config: Any) -> Any:
        """A copy of ``config`` as peft's save_pretrained stores it: for inference, naming the base
        model folder the export was told of, else the one peft recorded when it wrapped the model."""
        stored = copy.deepcopy(config)
        stored.inference_mode = True
        stored.base_model_name_or_path = self.base_model_path or config.base_model_name_or_path
        return stored

    def _plan_merges(self) -> dict[str, _Merge]:
        """Each merged model tensor (base model name) and how it is made; what ``merge_and_unload``
        would leave, computed from the live names: LoRA layers merged, a ``modules_to_save``
        module replaced by the active adapter's copy, tied duplicates left out."""
        layers, copies = self._lora_layers(), self._saved_modules()
        tied = set(getattr(self.model.get_base_model(), "all_tied_weights_keys", None) or {})
        merges: dict[str, _Merge] = {}
        for name in self._engine_specs:
            owner = next((path for path in layers if name.startswith(f"{path}.")), None)
            if owner is not None and not name.startswith(f"{owner}.base_layer."):
                continue  # an adapter's own tensor
            wrapper = next((path for path in copies if name.startswith(f"{path}.")), None)
            if wrapper is not None and not name.startswith(copies[wrapper]):
                continue  # the copy of a modules_to_save module that is not used
            if not name.startswith(_PEFT_PREFIX):
                raise CheckpointError(f"{name}: not under {_PEFT_PREFIX}; this PEFT model cannot be merged here")
            kept = name if wrapper is None else f"{wrapper}.{name[len(copies[wrapper]) :]}"
            merged = kept[len(_PEFT_PREFIX) :].replace(".base_layer.", ".")
            if merged in tied:
                continue
            if owner is not None and name == f"{owner}.base_layer.weight":
                layer = layers[owner]
                pairs = tuple(
                    (f"{owner}.lora_A.{a}.weight", f"{owner}.lora_B.{a}.weight", float(layer.scaling[a]))
                    for a in layer.active_adapters
                    if a in layer.lora_A
                )
                merges[merged] = _Merge(name, pairs, bool(layer.fan_in_fan_out))
            else:
                merges[merged] = _Merge(name, (), False)
        return merges

    def _lora_layers(self) -> dict[str, Any]:
        """The LoRA layers by path; CheckpointError for any adapter this export cannot merge."""
        from peft.tuners.lora.layer import Linear, LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer

        methods = {name: str(config.peft_type.value) for name, config in self.model.peft_config.items()}
        if any(method != "LORA" for method in methods.values()):
            raise CheckpointError(f"adapters {methods}: only LoRA adapters can be merged into the base model")
        layers: dict[str, Any] = {}
        for path, module in self.model.named_modules():
            if isinstance(module, BaseTunerLayer) and not isinstance(module, Linear):
                raise CheckpointError(
                    f"{path}: a {type(module).__name__} adapter layer cannot be merged here (only LoRA on linear "
                    "layers); export it with lora: adapter"
                )
            if isinstance(module, LoraLayer):
                unsupported = [a for a in module.active_adapters if a in module.lora_variant or module.lora_bias.get(a)]
                if unsupported:
                    raise CheckpointError(
                        f"{path}: adapter(s) {unsupported} use DoRA or a LoRA bias, which this export cannot merge; "
                        "export with lora: adapter"
                    )
                layers[path] = module
        return layers

    def _saved_modules(self) -> dict[str, str]:
        """``{path of a modules_to_save wrapper: the prefix of the copy the merged model keeps}``:
        the active adapter's copy, or the original module when no active adapter has one."""
        from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

        copies = {}
        for path, module in self.model.named_modules():
            if isinstance(module, AuxiliaryTrainingWrapper) and not isinstance(module, ModulesToSaveWrapper):
                raise CheckpointError(
                    f"{path}: a {type(module).__name__} cannot be merged here; export it with lora: adapter"
                )
            if isinstance(module, ModulesToSaveWrapper):
                active = [a for a in module.active_adapters if a in module.modules_to_save]
                if len(active) > 1:
                    raise CheckpointError(f"{path}: adapters {active} each replace this module; merge one of them")
                copies[path] = f"{path}.modules_to_save.{active[0]}." if active else f"{path}.original_module."
        return copies


def _delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, transpose: bool) -> torch.Tensor:
    """B @ A times the scale, as peft's LoRA Linear computes it for a merge (half precision
    on the CPU through float32)."""
    dtype = lora_b.dtype
    upcast = dtype in (torch.float16, torch.bfloat16)
    product = (lora_b.float() @ lora_a.float()) if upcast else lora_b @ lora_a
    delta = (product.T if transpose else product) * scale
    return delta.to(dtype) if upcast else delta
