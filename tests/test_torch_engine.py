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


def different_values_worker(rank: int, world_size: int, root: str, report: str) -> None:
    """Each rank's model holds its own "expert" under the same name (a hand-written expert-
    parallel layer, not a DTensor): a dump must refuse it on every rank rather than keep one,
    whether the experts differ from the first dump on or drift apart after it."""
    import json
    from pathlib import Path

    from recover_fixtures import SPEC, make_setup, recover_config, step_info

    def dump(setup, handler, step: int) -> str:
        try:
            handler.dump(setup.engine, step_info(step), force=True)
            return "dumped"
        except ac.CheckpointError as error:
            return f"{type(error).__name__}: {error}"

    def generations(trial: Path) -> list[str]:
        return sorted(p.name for p in (trial / ".recover").iterdir()) if (trial / ".recover").is_dir() else []

    outcomes = {}
    for case, diverge_first in (("from the start", True), ("drifted", False)):
        trial = Path(root) / case / "checkpoints/tester/exp/trial"
        setup = make_setup()  # the same weights on every rank (seeded)
        handler = ac.RecoverHandler(recover_config(Path(root) / case), SPEC)
        if not diverge_first:
            outcomes[f"{case}, first dump"] = dump(setup, handler, 0)
        before = generations(trial)
        with torch.no_grad():  # rank r's layer-0 MLP is now its own expert
            setup.model.model.layers[0].mlp.up_proj.weight.add_(rank)
        outcomes[case] = dump(setup, handler, 1)
        handler.close()
        torch.distributed.barrier()  # rank 0 discards the refused generation; look after it did
        outcomes[f"{case}, unchanged"] = generations(trial) == before
    Path(f"{report}.{rank}").write_text(json.dumps(outcomes))


def test_a_name_whose_value_differs_between_ranks_is_refused_on_every_rank_not_merged(tmp_path):
    import json

    run_distributed(different_values_worker, 2, str(tmp_path / "root"), str(tmp_path / "report"))
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in range(2)]
    assert reports[0] == reports[1]
    outcomes = reports[0]
    name = "model.model.layers.0.mlp.up_proj.weight"
    for case, how in (("from the start", "ranks 0 | 1 hold different values"), ("drifted", "differs between ranks")):
        assert outcomes[case].startswith("RankMismatchError: "), outcomes[case]
        assert "1 tensor name(s) hold different values on different ranks" in outcomes[case]
        assert f"{name} ({how})" in outcomes[case]
        assert "must be DTensors with a Shard placement, or carry names unique to their rank" in outcomes[case]
        assert outcomes[f"{case}, unchanged"]  # the previous checkpoint (if any) and no debris
    assert outcomes["drifted, first dump"] == "dumped"
