"""Small helpers shared by the Saver tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

import areal_ckpt as ac


def saver_config(fileroot: Path, **fields) -> ac.SaverConfig:
    return ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=str(fileroot), user="tester", **fields)


def read_export_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export folder, read with the safetensors library."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    return tensors


def export_names(root: Path) -> list[str]:
    """Committed export folders under a model root, in global-step order."""
    leaves = [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(leaves, key=lambda leaf: int(leaf.rsplit("globalstep", 1)[1]))


def manifest(folder: Path) -> dict:
    return json.loads((folder / "areal_ckpt_manifest.json").read_text())
