"""What the Saver, RecoverHandler and the DeepSpeed-style API accept as an engine.

Three shapes are accepted wherever an engine is (``Saver.save``, ``RecoverHandler.dump`` /
``load``, ``save_checkpoint`` / ``load_checkpoint``, a dict of engines by model name):

- an :class:`~areal_ckpt.engines.contract.Engine`: our adapters
  (:class:`~areal_ckpt.engines.TorchEngine`, :class:`~areal_ckpt.engines.DeepSpeedEngine`) or
  anything implementing the same Protocol;
- a DeepSpeed engine (``deepspeed.initialize``'s first result), wrapped in a DeepSpeedEngine;
- a :class:`~areal_ckpt.engines.contract.ModelHolder`: anything that holds a torch model as
  ``.model`` (plain, DDP or FSDP2) and optionally ``.optimizer`` / ``.lr_scheduler``, as AReaL's
  FSDPEngine does; it is used as if wrapped in ``TorchEngine(obj.model, obj.optimizer,
  obj.lr_scheduler)``.

Anything else is refused with a CheckpointError that says what an engine must provide.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from areal_ckpt.engines.contract import Engine, EngineLike, EnginesLike, ExportSource, ModelHolder
from areal_ckpt.engines.deepspeed_engine import DeepSpeedEngine
from areal_ckpt.engines.torch_engine import TorchEngine
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.hf_export import HFFiles, hf_files

logger = logging.getLogger(__name__)

_WHAT_AN_ENGINE_IS = (
    "pass areal_ckpt.TorchEngine(model, optimizer, lr_scheduler), a DeepSpeed engine, or an object "
    "that holds a torch.nn.Module as .model (optionally .optimizer and .lr_scheduler)"
)


def as_engine(obj: EngineLike, where: str) -> Engine:
    """Our engine for ``obj`` (see the module docstring); local, cheap (no tensor is touched).

    Raises CheckpointError naming ``where`` and the type when ``obj`` is not an engine.
    """
    if isinstance(obj, (TorchEngine, DeepSpeedEngine)):
        return obj
    if _is_deepspeed_engine(obj):
        return DeepSpeedEngine(obj)  # type: ignore[arg-type]  # DeepSpeed's engine is DeepSpeedLike
    if isinstance(obj, Engine):
        return obj
    if isinstance(obj, ModelHolder) and isinstance(obj.model, nn.Module):
        try:
            return TorchEngine(obj.model, getattr(obj, "optimizer", None), getattr(obj, "lr_scheduler", None))
        except TypeError as error:
            raise CheckpointError(f"{where}: {type(obj).__name__}.model: {error}") from None
    raise CheckpointError(f"{where}: {type(obj).__name__} is not an engine: {_WHAT_AN_ENGINE_IS}")


def _is_deepspeed_engine(obj: object) -> bool:
    deepspeed = sys.modules.get("deepspeed")  # a DeepSpeed engine exists only once it is imported
    return deepspeed is not None and isinstance(obj, deepspeed.DeepSpeedEngine)


def named_engines(engine: EnginesLike) -> dict[str, EngineLike]:
    """``{model name: engine as given}``: one engine is named ``default``; pure."""
    return dict(engine) if isinstance(engine, Mapping) else {"default": engine}


def check_engines(engine: EnginesLike, where: str) -> None:
    """CheckpointError, as :func:`as_engine` raises it, when ``engine`` (or a value of a mapping
    of them) is not an engine; builds nothing, so it is cheap enough for every step. Local."""
    by_name = isinstance(engine, Mapping)
    for name, value in named_engines(engine).items():
        holds_model = isinstance(value, ModelHolder) and isinstance(value.model, nn.Module)
        if not (
            isinstance(value, (TorchEngine, DeepSpeedEngine, Engine)) or _is_deepspeed_engine(value) or holds_model
        ):
            label = f"{where}[{name!r}]" if by_name else where
            raise CheckpointError(f"{label}: {type(value).__name__} is not an engine: {_WHAT_AN_ENGINE_IS}")


def engines_by_name(engine: EnginesLike, where: str) -> dict[str, Engine]:
    """``{model name: our engine}`` for one engine or a mapping of them (see :func:`as_engine`); local."""
    by_name = isinstance(engine, Mapping)
    return {
        name: as_engine(value, f"{where}[{name!r}]" if by_name else where)
        for name, value in named_engines(engine).items()
    }


@dataclass(frozen=True)
class HFAssets:
    """What an export holds besides weights and config: a tokenizer, a processor, and a base
    model folder whose non-weight files are copied (see ``Saver.save``); picklable."""

    tokenizer: Any | None = None
    processor: Any | None = None
    base_model_path: str | None = None

    @classmethod
    def of(
        cls, engine: EngineLike, tokenizer: Any | None, processor: Any | None, base_model_path: str | None
    ) -> HFAssets:
        """The assets of a ``save`` / ``dump`` call: ``base_model_path`` None means an
        AReaL-shaped engine's ``config.path`` when that is a local folder (ours: AReaL passes
        None on; a hub name is skipped with a warning); local."""
        if base_model_path is None:
            base_model_path = _usable_base_model(_configured_model_path(engine))
        return cls(tokenizer, processor, base_model_path)


def _configured_model_path(obj: object) -> str | None:
    """``obj.config.path`` of an engine configuration (AReaL's TrainEngineConfig), else None;
    our adapters' ``config`` is a model's HF config, which names no folder."""
    if isinstance(obj, (TorchEngine, DeepSpeedEngine)):
        return None
    path = getattr(getattr(obj, "config", None), "path", None)
    return path if isinstance(path, str) and path else None


def _usable_base_model(path: str | None) -> str | None:
    if path is None or os.path.isdir(path):
        return path
    logger.warning("not copying base model files into the export: %s is not a local folder", path)
    return None


def export_files(
    source: ExportSource,
    dtype: torch.dtype | None,
    tokenizer: Any | None = None,
    processor: Any | None = None,
    assets: str | None = None,
) -> HFFiles:
    """The HF files (config, generation config, tokenizer, processor, base model files) of an
    export of ``source`` in ``dtype`` (see :func:`areal_ckpt.formats.hf_export.hf_files`); local.
    CheckpointError saying how to export instead when ``source`` has no HF config (a plain
    ``nn.Module``)."""
    if source.config is None:
        raise CheckpointError(
            f"{source.architecture} has no HF config (.config): an HF export needs a transformers "
            "PreTrainedModel. Recovery dumps and save_checkpoint need none; to write their weights as an HF "
            "folder, use `areal-ckpt export CHECKPOINT OUT --config-from HF_DIR` (recovery) or `areal-ckpt "
            "convert-deepspeed DIR OUT --config HF_DIR` (save_checkpoint), HF_DIR holding a config.json whose "
            "model has these parameter names"
        )
    return hf_files(
        source.config,
        source.generation_config,
        source.architecture,
        source.export_specs(),
        dtype,
        tokenizer,
        processor,
        assets,
    )
