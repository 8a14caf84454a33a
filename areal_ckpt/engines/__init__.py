"""Adapters over what users train with: plain torch, DDP, FSDP2 (TorchEngine) and DeepSpeed."""

from areal_ckpt.engines.deepspeed_engine import DeepSpeedEngine
from areal_ckpt.engines.torch_engine import TorchEngine

__all__ = ["DeepSpeedEngine", "TorchEngine"]
