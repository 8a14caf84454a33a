"""ZeRO-3's partitioned parameters in the shapes a dump stores and a load fills.

A ZeRO-3 dump stores each parameter's partitions as one flattened 1-D tensor (a DTensor over
the ranks), so no gather is needed; a load fills live partitions in place from such a dump, or
from a ZeRO 0-2 dump that holds parameters whole. Helpers of
:class:`~areal_ckpt.engines.deepspeed_engine.DeepSpeedEngine`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Shard

from areal_ckpt import dist
from areal_ckpt.paths import MODEL_PREFIX


def flat_shard(parameter: Any, mesh: DeviceMesh) -> DTensor:
    """This rank's partition of the ZeRO-3 ``parameter`` as a shard of the flattened parameter
    (a view) on ``mesh``, the ranks in order.

    DeepSpeed gives rank r elements [r*s, (r+1)*s) of the flattened parameter (s rounded up,
    the tail padded), which is how a DTensor shards dimension 0 unevenly.
    """
    numel, local = parameter.ds_numel, parameter.ds_tensor
    valid = max(0, min(local.numel(), numel - dist.rank() * local.numel()))
    return DTensor.from_local(
        local.view(-1)[:valid], mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,)
    )


def whole_templates(
    parameters: dict[str, torch.nn.Parameter],
    tensors: dict[str, torch.Tensor],
    stored: dict[str, tuple[torch.dtype, tuple[int, ...]]],
) -> dict[str, torch.Tensor]:
    """Full-shaped buffers for the partitioned ``parameters`` that ``stored`` holds whole (a
    ZeRO 0-2 dump); :func:`scatter_whole` copies them into the partitions."""
    whole = {}
    for name, parameter in parameters.items():
        key = MODEL_PREFIX + name
        shape = getattr(parameter, "ds_shape", None)
        if (
            key in tensors
            and key in stored
            and shape is not None
            and tuple(stored[key][1]) == tuple(shape)
            and len(shape) != 1
        ):
            whole[key] = torch.empty(tuple(shape), dtype=stored[key][0])
    return whole


def scatter_whole(parameters: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
    """Copy full-shaped loaded parameters (see :func:`whole_templates`) into their ZeRO-3
    partitions; collective (each parameter is gathered, set on every rank, re-partitioned)."""
    import deepspeed

    for name, parameter in parameters.items():
        value = tensors.get(MODEL_PREFIX + name)
        shape = getattr(parameter, "ds_shape", None)
        if value is None or isinstance(value, DTensor) or shape is None:
            continue
        with deepspeed.zero.GatheredParameters([parameter], modifier_rank=0):
            if dist.rank() == 0:
                parameter.data.copy_(value.view(shape))


def flat_views(
    tensors: dict[str, torch.Tensor], stored: dict[str, tuple[torch.dtype, tuple[int, ...]]]
) -> dict[str, torch.Tensor]:
    """1-D views of the model tensors that ``stored`` holds flattened (a ZeRO-3 dump), so DCP
    fills the live parameters in place."""
    views = {}
    for name, tensor in tensors.items():
        shape = stored.get(name, (None, None))[1]
        if (
            name.startswith(MODEL_PREFIX)
            and shape is not None
            and len(shape) == 1
            and tensor.dim() != 1
            and shape[0] == tensor.numel()
        ):
            views[name] = tensor.view(-1)
    return views


def unflattened(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with flat views (see :func:`flat_views`) shaped as ``module``'s tensors again."""
    shapes = {MODEL_PREFIX + name: value.shape for name, value in module.state_dict().items()}
    return {
        name: value.view(shapes[name]) if name in shapes and value.shape != shapes[name] else value
        for name, value in tensors.items()
    }


def master_layout(optimizer: Any, stage: int, module: torch.nn.Module) -> list[list[dict[str, Any]]]:
    """Where each trained parameter lies in the fp32 master groups, so that an export can
    rebuild full fp32 weights from the masters (as ``zero_to_fp32`` does): per group, each
    parameter's name, shape and offset; ZeRO 1 / 2 in the group's flat buffer (which the
    ranks' partitions tile, in rank order); ZeRO 3 in every rank's partition, with the
    parameter's partition size. Identical on every rank."""
    names = {id(parameter): name for name, parameter in module.named_parameters()}
    layout = []
    if stage == 3:
        for group in optimizer.fp16_groups:
            entries, offset = [], 0
            for parameter in group:
                part = parameter.ds_tensor.numel()
                entries.append(
                    {
                        "name": names[id(parameter)],
                        "shape": list(parameter.ds_shape),
                        "offset": offset,
                        "partition": part,
                    }
                )
                offset += part
            layout.append(entries)
        return layout
    for group, offsets in zip(optimizer.round_robin_bit16_groups, optimizer.round_robin_bit16_offsets):
        layout.append(
            [
                {"name": names[id(parameter)], "shape": list(parameter.shape), "offset": int(offset)}
                for parameter, offset in zip(group, offsets)
            ]
        )
    return layout
