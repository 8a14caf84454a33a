"""DeepSpeed's own checkpoint files are pickles: they are read here only through torch's
weights-only unpickler, which builds nothing but tensors, containers and the few plain
DeepSpeed classes those files hold, so nothing in them can run code."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from areal_ckpt.errors import CheckpointError
from areal_ckpt.paths import MANIFEST_NAME


@contextlib.contextmanager
def weights_only_deepspeed_loads() -> Iterator[None]:
    """Run DeepSpeed's checkpoint readers with ``torch.load(weights_only=True)``.

    DeepSpeed's reconstruction (``zero_to_fp32``) asks ``torch.load`` for full unpickling;
    here every call is forced to the weights-only unpickler, which can build nothing but
    tensors, containers and the few plain DeepSpeed classes these files hold (loss scaler
    settings, the ZeRO stage enum, parameter fragment addresses).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    original = torch.load

    def weights_only_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            return original(*args, **kwargs)
        except (pickle.UnpicklingError, RuntimeError) as error:  # refused by the weights-only unpickler
            source = args[0] if args else kwargs.get("f", "a DeepSpeed file")
            cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointError(
                f"{source}: refused: it holds objects the weights-only unpickler does not "
                f"build, so nothing in it was run ({cause})"
            ) from None

    torch.load = weights_only_load  # DeepSpeed looks torch.load up at each call
    try:
        with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
            yield
    finally:
        torch.load = original


def is_deepspeed_own(folder: Path) -> bool:
    """True when the tag ``folder`` is in DeepSpeed's own layout (``*model_states.pt`` files,
    no areal_ckpt manifest); read-only."""
    return not (folder / MANIFEST_NAME).exists() and any(folder.glob("*model_states.pt"))


def check_pickles(files: list[Path]) -> None:
    """Open each of ``files`` with the weights-only unpickler and DeepSpeed's allow-listed
    classes, memory-mapped (tensor data is not read); CheckpointError naming the first one it
    refuses, having run nothing in it. Local, read-only."""
    with weights_only_deepspeed_loads():
        for path in files:
            torch.load(path, map_location="cpu", mmap=True)
