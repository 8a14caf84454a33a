"""Small helpers shared by the Saver tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

import areal_ckpt as ac


def saver_config(fileroot: Path, **fields) -> ac.SaverConfig:
    defaults = {"experiment_name": "exp", "trial_name": "trial", "fileroot": str(fileroot), "user": "tester"}
    return ac.SaverConfig(**{**defaults, **fields})


def read_export_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export folder, read with the safetensors library."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118  (safe_open is not iterable)
                tensors[key] = handle.get_tensor(key)
    return tensors


def export_names(root: Path) -> list[str]:
    """Committed export folders under a model root, in global-step order."""
    leaves = [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(leaves, key=lambda leaf: int(leaf.rsplit("globalstep", 1)[1]))


def manifest(folder: Path) -> dict:
    return json.loads((folder / "areal_ckpt_manifest.json").read_text())


def wrap_model(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """``model`` as a training job would hold it: ``fsdp2`` (every decoder layer and the root
    sharded), ``ddp``, ``compiled`` (torch.compile), or ``none`` (as it is). Needs a process
    group for fsdp2 and ddp."""
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's
        for layer in base.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if kind == "compiled":
        return torch.compile(model)
    if kind != "none":
        raise ValueError(f"unknown wrapping {kind!r}")
    return model


def deepspeed_steps(engine, tokens: torch.Tensor, count: int) -> list[float]:
    """Train a DeepSpeed engine ``count`` steps on ``tokens``; the losses, in order."""
    losses = []
    for _ in range(count):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
