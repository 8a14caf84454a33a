"""areal_ckpt: crash-safe checkpoints for RL and LLM training.

Export (:class:`Saver`) writes HuggingFace folders that ``from_pretrained`` loads; recovery
checkpoints restore a whole training job.
"""

from areal_ckpt._version import __version__
from areal_ckpt.config import CheckpointConfig, RecoverConfig, SaverConfig
from areal_ckpt.config_loader import load_config
from areal_ckpt.engines import TorchEngine
from areal_ckpt.errors import CheckpointError, CommitError, ConfigError, RankMismatchError
from areal_ckpt.saver import Saver
from areal_ckpt.schedule import TriggerSchedule
from areal_ckpt.step import FinetuneSpec, StepInfo

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CommitError",
    "ConfigError",
    "FinetuneSpec",
    "RankMismatchError",
    "RecoverConfig",
    "Saver",
    "SaverConfig",
    "StepInfo",
    "TorchEngine",
    "TriggerSchedule",
    "__version__",
    "load_config",
]
