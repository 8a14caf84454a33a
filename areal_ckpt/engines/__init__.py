"""Adapters over what users train with (plain torch, DDP, FSDP2; DeepSpeed later)."""

from areal_ckpt.engines.torch_engine import TorchEngine

__all__ = ["TorchEngine"]
