"""areal_ckpt: crash-safe checkpoints for RL and LLM training.

Export (:class:`Saver`) writes HuggingFace folders that ``from_pretrained`` loads; recovery
checkpoints restore a whole training job.
"""

from areal_ckpt._version import __version__
from areal_ckpt.config import CheckpointConfig, RecoverConfig, SaverConfig
from areal_ckpt.config_loader import load_config
from areal_ckpt.engines import DeepSpeedEngine, TorchEngine
from areal_ckpt.errors import CheckpointError, CollectiveError, CommitError, ConfigError, RankMismatchError
from areal_ckpt.export.download import download_export
from areal_ckpt.export.saver import Saver
from areal_ckpt.recover.handler import RecoverHandler
from areal_ckpt.recover.read import check_if_auto_recover, check_if_recover
from areal_ckpt.schedule import TriggerSchedule
from areal_ckpt.state.recover_info import RecoverInfo
from areal_ckpt.state.sampler import ResumableDistributedSampler
from areal_ckpt.step import FinetuneSpec, StepInfo
from areal_ckpt.tags.api import load_checkpoint, save_checkpoint
from areal_ckpt.tools.import_areal import import_areal_trial

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
