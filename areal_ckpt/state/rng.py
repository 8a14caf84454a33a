"""Capture and restore every random stream a training process draws from."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


@contextlib.contextmanager
def python_random_kept() -> Iterator[None]:
    """Leave Python's global ``random`` stream as this block (or decorated function) found it.

    botocore draws the jitter of its retries from that stream, which a training loop seeds and
    a recovery checkpoint records (before any request): a request retried during a dump would
    otherwise shift the loop's later draws, and a resumed run would no longer match the
    uninterrupted one. Local; another thread drawing from the stream meanwhile sees its draws
    come again."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch CPU and (when present) CUDA RNG states; local."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def fresh_rng_state(seed: int) -> dict[str, Any]:
    """RNG states of python, numpy, torch CPU (and CUDA, when in use) seeded from ``seed``, in
    :func:`capture_rng_state`'s form; pure (scratch generators, no stream of this process
    changes)."""
    seed %= 2**63
    state: dict[str, Any] = {
        "python": random.Random(seed).getstate(),
        "numpy": np.random.RandomState(seed % 2**32).get_state(legacy=True),
        "torch_cpu": torch.Generator().manual_seed(seed).get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [
            torch.Generator(device=f"cuda:{index}").manual_seed(seed).get_state()
            for index in range(torch.cuda.device_count())
        ]
    return state


def check_rng_state(state: Any) -> None:
    """Raise ValueError unless :func:`restore_rng_state` would take ``state``; changes no stream
    of this process (each part is tried on a scratch generator)."""
    try:
        if not isinstance(state, dict):
            raise TypeError(f"expected an object, got {type(state).__name__}")
        random.Random().setstate(state["python"])
        np.random.RandomState().set_state(state["numpy"])
        torch.Generator().set_state(state["torch_cpu"])
        cuda = state.get("torch_cuda")
        if cuda is not None and not (isinstance(cuda, list) and all(isinstance(t, torch.Tensor) for t in cuda)):
            raise TypeError("torch_cuda must be a list of tensors")
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as error:
        raise ValueError(f"RNG state is malformed: {type(error).__name__}: {error}") from None


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` returned; local. Raises ValueError on a bad state."""
    try:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch_cpu"])
        if "torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["torch_cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"RNG state is malformed: {error}") from None
