"""areal_ckpt: crash-safe checkpoints for RL and LLM training.

Export (:class:`Saver`) writes HuggingFace folders that ``from_pretrained`` loads; recovery
checkpoints restore a whole training job.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from areal_ckpt._version import __version__

if TYPE_CHECKING:
    from areal_ckpt.config import CheckpointConfig, RecoverConfig, SaverConfig
    from areal_ckpt.config_loader import load_config
    from areal_ckpt.engines import DeepSpeedEngine, TorchEngine
    from areal_ckpt.errors import CheckpointError, CollectiveError, CommitError, ConfigError, RankMismatchError
    from areal_ckpt.export.download import download_export
    from areal_ckpt.export.saver import Saver
    from areal_ckpt.recover.handler import RecoverHandler
    from areal_ckpt.recover.read import check_if_auto_recover, check_if_recover
    from areal_ckpt.schedule import TriggerSchedule
    from areal_ckpt.state.frontier import RolloutFrontier
    from areal_ckpt.state.recover_info import RecoverInfo
    from areal_ckpt.state.sampler import ResumableDistributedSampler
    from areal_ckpt.step import FinetuneSpec, StepInfo
    from areal_ckpt.tags.api import load_checkpoint, save_checkpoint
    from areal_ckpt.tools.import_areal import import_areal_trial

#: Where each public name lives; imported on first use, so that ``import areal_ckpt`` (and the
#: ``areal-ckpt`` command line) does not load torch, transformers and DeepSpeed until needed.
_PUBLIC = {
    "CheckpointConfig": "areal_ckpt.config",
    "RecoverConfig": "areal_ckpt.config",
    "SaverConfig": "areal_ckpt.config",
    "load_config": "areal_ckpt.config_loader",
    "DeepSpeedEngine": "areal_ckpt.engines",
    "TorchEngine": "areal_ckpt.engines",
    "CheckpointError": "areal_ckpt.errors",
    "CollectiveError": "areal_ckpt.errors",
    "CommitError": "areal_ckpt.errors",
    "ConfigError": "areal_ckpt.errors",
    "RankMismatchError": "areal_ckpt.errors",
    "download_export": "areal_ckpt.export.download",
    "Saver": "areal_ckpt.export.saver",
    "RecoverHandler": "areal_ckpt.recover.handler",
    "check_if_auto_recover": "areal_ckpt.recover.read",
    "check_if_recover": "areal_ckpt.recover.read",
    "TriggerSchedule": "areal_ckpt.schedule",
    "RecoverInfo": "areal_ckpt.state.recover_info",
    "ResumableDistributedSampler": "areal_ckpt.state.sampler",
    "RolloutFrontier": "areal_ckpt.state.frontier",
    "FinetuneSpec": "areal_ckpt.step",
    "StepInfo": "areal_ckpt.step",
    "load_checkpoint": "areal_ckpt.tags.api",
    "save_checkpoint": "areal_ckpt.tags.api",
    "import_areal_trial": "areal_ckpt.tools.import_areal",
}


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first use (PEP 562)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CollectiveError",
    "CommitError",
    "ConfigError",
    "DeepSpeedEngine",
    "FinetuneSpec",
    "RankMismatchError",
    "RecoverConfig",
    "RecoverHandler",
    "RecoverInfo",
    "ResumableDistributedSampler",
    "RolloutFrontier",
    "Saver",
    "SaverConfig",
    "StepInfo",
    "TorchEngine",
    "TriggerSchedule",
    "__version__",
    "check_if_auto_recover",
    "check_if_recover",
    "download_export",
    "import_areal_trial",
    "load_checkpoint",
    "load_config",
    "save_checkpoint",
]
