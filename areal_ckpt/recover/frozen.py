"""Parameters that do not train are stored once per trial, not once per dump.

With LoRA (or a frozen vision tower, frozen embeddings) most of a model's bytes never change:
only the adapters and their optimizer state do. A dump therefore puts a model's parameters
that do not require grad, when others do, in a part of their own (``{model}/frozen/``, a DCP
checkpoint like the model's folder) and remembers a fingerprint of them: CRC-32 of every
rank's local bytes, and of their names. A later dump whose fingerprint is the same on every
rank hard-links that part from the previous generation (its manifest records are carried over,
so a load checks its CRC-32 as for any file) instead of writing it; a changed value, a newly
frozen or unfrozen parameter changes the fingerprint and the part is written again.

Policy (which tensors, when unchanged) lives here; the linking is the store's, the writing
DCP's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from areal_ckpt.engines.contract import DumpSource
from areal_ckpt.fsio import crc32
from areal_ckpt.paths import FROZEN_PART, MODEL_PREFIX
from areal_ckpt.tensors import local_crc32


def frozen_part(model: str) -> str:
    """The folder (in a generation) of ``model``'s frozen part; pure."""
    return f"{model}/{FROZEN_PART}"


def frozen_names(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The dump keys (``model.<fqn>``) of ``module``'s parameters that do not require grad,
    sorted, when some other parameter does (a model nothing trains is linked whole when it is
    unchanged, see :mod:`areal_ckpt.recover.prepare`); else []. Tied names count. Local, pure."""
    parameters = list(module.named_parameters(remove_duplicate=False))
    if not any(parameter.requires_grad for _, parameter in parameters):
        return []
    names = {MODEL_PREFIX + name for name, parameter in parameters if not parameter.requires_grad}
    return sorted(name for name in names if name in tensors)


def fingerprint(names: list[str], tensors: Mapping[str, torch.Tensor]) -> list[int]:
    """CRC-32 of ``names`` and of this rank's bytes of each of their ``tensors`` (the local
    shard of a DTensor); local, one read, no copy unless a tensor is off the CPU."""
    return [crc32("\n".join(names).encode()), *(local_crc32(tensors[name]) for name in names)]


def part_fingerprint(engine: DumpSource) -> list[int]:
    """The fingerprint of ``engine``'s frozen part as a dump now would take it (after a load:
    what the loaded generation holds, so the next dump links it); local."""
    tensors, _ = engine.recover_state(include_optimizer=False)
    return fingerprint(frozen_names(engine.module, tensors), tensors)
