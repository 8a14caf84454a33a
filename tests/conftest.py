"""Shared fixtures: a tiny tokenizer and model built locally, and a checkpoint root per test."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from areal_ckpt.demo.tiny import build_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def make_model(tokenizer):
    """Build a tiny Qwen2 with a fixed seed (same weights for the same seed and overrides)."""

    def build(seed: int = 0, **overrides):
        torch.manual_seed(seed)
        return build_model(len(tokenizer), **overrides)

    return build


@pytest.fixture
def fileroot(tmp_path: Path) -> Path:
    root = tmp_path / "fileroot"
    root.mkdir()
    return root


@pytest.fixture(autouse=True)
def _library_logs(caplog):
    caplog.set_level(logging.INFO, logger="areal_ckpt")
