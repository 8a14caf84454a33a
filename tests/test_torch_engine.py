"""TorchEngine on real process groups (gloo): what it hands to a dump and a load."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from helpers import wrap_model
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model

pytestmark = pytest.mark.dist


def wrapped(kind: str, tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(48, tie_word_embeddings=tied)
    model.model.layers[0].mlp.requires_grad_(False)  # a frozen part must not change the keys
    return wrap_model(model, kind)


def same_state_worker(rank: int, world_size: int) -> None:
    """The engine's model tensors are torch's ``get_model_state_dict``: same keys, same order,
    the same live storage (no copies), for every layout the engine accepts."""
    for kind in ("none", "ddp", "compiled", "fsdp2"):
        for tied in (True, False):
            model = wrapped(kind, tied)
            engine = ac.TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
            expected = {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
            for label, tensors in (("dump", engine.recover_state(False)[0]), ("load", engine.recover_template(False))):
                assert list(tensors) == list(expected), (kind, tied, label)
                for key, tensor in tensors.items():
                    assert type(tensor) is type(expected[key]), (kind, tied, label, key)
                    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                    other = expected[key].to_local() if isinstance(tensor, DTensor) else expected[key]
                    assert local.data_ptr() == other.data_ptr(), (kind, tied, label, key)
            assert isinstance(expected["model.lm_head.weight"], DTensor) == (kind == "fsdp2")


def test_recover_state_is_what_torch_state_dict_helpers_return():
    run_distributed(same_state_worker, 2)
