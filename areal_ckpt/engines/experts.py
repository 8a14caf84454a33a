"""Expert-parallel layers: every rank's experts under names of their own.

Under DeepSpeed's ``MoE(num_experts=E, ep_size=P)`` each rank of an expert-parallel group holds
``E / P`` experts as ``...deepspeed_experts.{0..E/P-1}``: the same local names for different
experts on different ranks. A checkpoint that kept one value per name would keep one rank's
experts. So a dump names each expert by its global index, ``ep_rank * E/P + local``, as
DeepSpeed's own files number them (``expert_{i}``): every expert is stored once, replicas of
the same expert (expert data parallelism) share a name and a value, and a load on any rank
finds the experts it holds by their global names.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch
from torch import nn

from areal_ckpt.paths import MODEL_PREFIX, OPTIM_PREFIX

_EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


def global_expert_names(module: nn.Module) -> dict[str, str]:
    """``{local state-dict name: global name}`` for every tensor of an expert-parallel MoE layer
    (``ep_size`` > 1) in ``module``; {} without one (or without DeepSpeed loaded). Local; reads
    the expert-parallel rank from DeepSpeed's process groups."""
    if "deepspeed" not in sys.modules:
        return {}
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    names = list(module.state_dict())
    renames = {}
    for path, layer in module.named_modules():
        if not isinstance(layer, MoE) or layer.ep_size <= 1:
            continue
        first = groups._get_expert_parallel_rank(layer.expert_group_name) * layer.num_local_experts
        prefix = f"{path}.{_EXPERTS}" if path else _EXPERTS
        for name in names:
            if name.startswith(prefix):
                local, _, rest = name[len(prefix) :].partition(".")
                renames[name] = f"{prefix}{first + int(local)}.{rest}"
    return renames


def expert_prefixes(renames: Mapping[str, str]) -> list[str]:
    """The stored-key prefixes under which each rank holds only its own experts (``model.`` and
    ``optim.`` forms of every layer's experts), for a load to leave the others' unread. Pure."""
    layers = sorted({name[: name.index(_EXPERTS) + len(_EXPERTS)] for name in renames.values()})
    return [prefix + layer for layer in layers for prefix in (MODEL_PREFIX, OPTIM_PREFIX)]


def renamed(tensors: Mapping[str, torch.Tensor], renames: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``tensors`` (``model.<fqn>`` / ``optim.<fqn>.<key>`` keys) with each expert's ``fqn``
    replaced as ``renames`` says (see :func:`global_expert_names`; its inverse undoes it). Pure."""
    if not renames:
        return dict(tensors)
    result = {}
    for key, value in tensors.items():
        if key.startswith(MODEL_PREFIX) and key[len(MODEL_PREFIX) :] in renames:
            key = MODEL_PREFIX + renames[key[len(MODEL_PREFIX) :]]
        elif key.startswith(OPTIM_PREFIX):
            fqn, dot, entry = key[len(OPTIM_PREFIX) :].rpartition(".")
            if fqn in renames:
                key = f"{OPTIM_PREFIX}{renames[fqn]}{dot}{entry}"
        result[key] = value
    return result
