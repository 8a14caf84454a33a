"""DeepSpeed-shaped save_checkpoint / load_checkpoint: tags, `latest`, per-rank client_state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from recover_fixtures import make_setup, train_step
from test_deepspeed import deepspeed_engine

import areal_ckpt as ac

VOCAB = 48


def test_torch_engine_round_trip_and_latest_is_replaced_not_rewritten(tmp_path):
    setup = make_setup()
    train_step(setup, 0)
    assert ac.load_checkpoint(setup.engine, tmp_path) == (None, None)  # nothing saved yet
    with pytest.raises(ValueError, match="tag is required"):
        ac.save_checkpoint(setup.engine, tmp_path)
    assert ac.save_checkpoint(setup.engine, tmp_path, tag="step1", client_state={"kl": 0.5, "seen": [1, 2]})
    first_inode = os.stat(tmp_path / "latest").st_ino
    train_step(setup, 1)
    ac.save_checkpoint(setup.engine, tmp_path, tag="step2", client_state={"kl": 0.25})
    assert (tmp_path / "latest").read_text().strip() == "step2"
    assert os.stat(tmp_path / "latest").st_ino != first_inode  # a new file renamed over the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step1",
        "step2",
        "zero_to_fp32.py",
    ]  # no staging left

    fresh = make_setup(seed=3)
    path, client_state = ac.load_checkpoint(fresh.engine, tmp_path)
    assert path == str(tmp_path / "step2") and client_state == {"kl": 0.25}
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(tensor, fresh.model.state_dict()[name]), name
    assert fresh.optimizer.state_dict()["state"][0]["exp_avg"].equal(
        setup.optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert fresh.scheduler.state_dict() == setup.scheduler.state_dict()

    older = make_setup(seed=4)
    path, client_state = ac.load_checkpoint(older.engine, tmp_path, tag="step1", load_module_only=True)
    assert client_state == {"kl": 0.5, "seen": [1, 2]} and not older.optimizer.state


def test_damaged_and_misnamed_checkpoints_are_refused_by_name(tmp_path):
    setup = make_setup()
    ac.save_checkpoint(setup.engine, tmp_path, tag="good")
    data = next((tmp_path / "good/model").glob("*.distcp"))
    data.write_bytes(bytes([data.read_bytes()[0] ^ 1]) + data.read_bytes()[1:])
    with pytest.raises(ac.CheckpointError, match=r"__0_0.distcp: checksum mismatch"):
        ac.load_checkpoint(make_setup(seed=1).engine, tmp_path)
    (tmp_path / "latest").write_text("../elsewhere\n")
    with pytest.raises(ac.CheckpointError, match=r"latest: names '\.\./elsewhere', not a checkpoint of this location"):
        ac.load_checkpoint(make_setup(seed=1).engine, tmp_path)
    with pytest.raises(ValueError, match="tag"):
        ac.save_checkpoint(setup.engine, tmp_path, tag="a/b")


def _ds_step(engine, step: int) -> None:
    tokens = (torch.arange(16).reshape(2, 8) * (step + 1)) % VOCAB
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()


def deepspeed_tagged_worker(rank: int, world_size: int, root: str, report: str) -> None:
    from areal_ckpt.demo.tiny import build_model

    torch.manual_seed(0)
    trained = deepspeed_engine(build_model(VOCAB), stage=2)
    for step in range(3):
        _ds_step(trained, step)
    ac.save_checkpoint(trained, root, client_state={"rank": rank, "noise": 0.5 + rank})
    try:  # DeepSpeed's default checkpoint.tag_validation is Warn: saved under rank 0's tag
        ac.save_checkpoint(trained, root, tag=f"differs-on-rank-{rank}", save_latest=False)
        mismatch = "saved"
    except ac.RankMismatchError:
        mismatch = "refused"
    torch.manual_seed(1)
    fresh = deepspeed_engine(build_model(VOCAB), stage=2)
    path, client_state = ac.load_checkpoint(fresh, root)
    _ds_step(trained, 3)
    _ds_step(fresh, 3)  # resumed training continues exactly
    same = all(torch.equal(a, b) for a, b in zip(trained.module.parameters(), fresh.module.parameters()))
    Path(f"{report}.{rank}").write_text(
        json.dumps(
            {
                "path": path,
                "client_state": client_state,
                "mismatch": mismatch,
                "same": same,
                "global_steps": fresh.global_steps,
                "entries": sorted(p.name for p in Path(root).iterdir()),
            }
        )
    )


@pytest.mark.dist
def test_deepspeed_tags_latest_and_per_rank_client_state(tmp_path):
    root, report = tmp_path / "ckpt", tmp_path / "report"
    run_distributed(deepspeed_tagged_worker, 2, str(root), str(report))
    reports = [json.loads(Path(f"{report}.{rank}").read_text()) for rank in range(2)]
    for rank, entry in enumerate(reports):
        assert entry["path"] == str(root / "global_step3")  # DeepSpeed's default tag
        assert entry["client_state"] == {"rank": rank, "noise": 0.5 + rank}  # each rank its own
        assert entry["mismatch"] == "saved" and entry["same"] and entry["global_steps"] == 4
        assert entry["entries"] == [
            "differs-on-rank-0",
            "global_step3",
            "latest",
            "zero_to_fp32.py",
        ]  # one tag, never a mix


def test_cli_inspects_and_verifies_a_tagged_checkpoint(tmp_path, capsys):
    from areal_ckpt.cli.main import main

    setup = make_setup()
    train_step(setup, 0)
    ac.save_checkpoint(setup.engine, tmp_path, tag="step7")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["kind"] == "deepspeed" and facts["path"] == str(tmp_path / "step7") and facts["complete"]
    assert facts["models"]["model"]["optimizer"] and facts["world_size"] == 1
    assert main(["verify", str(tmp_path)]) == 0
    (tmp_path / "step7/client_state/rank0.json").write_text('{"forged": true}')
    assert main(["verify", str(tmp_path)]) == 1
    assert "client_state/rank0.json: size" in capsys.readouterr().out


def test_a_client_state_that_cannot_be_stored_safely_is_refused_and_nothing_is_written(tmp_path):
    setup = make_setup()
    ac.save_checkpoint(setup.engine, tmp_path, tag="good", client_state={"baseline": torch.zeros(2)})
    with pytest.raises(ac.CheckpointError) as refused:
        ac.save_checkpoint(setup.engine, tmp_path, tag="bad", client_state={"sampler": object()})
    assert "checkpoint not saved (earlier tags and latest are untouched): rank 0: " in str(refused.value)
    assert "state.sampler: cannot store a builtins.object without pickle" in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "latest", "zero_to_fp32.py"]
    assert (tmp_path / "latest").read_text().strip() == "good"


def test_client_state_of_the_types_deepspeed_users_keep_round_trips_exactly(tmp_path):
    """numpy scalars and arrays, tuples, sets, frozensets, tensors: each comes back as it went
    in, type and dtype included (an np.float64 is not turned into a float)."""
    import numpy as np

    setup = make_setup()
    client_state = {
        "kl": np.float64(0.125),
        "iteration": np.int32(7),
        "done": np.bool_(False),
        "returns": np.arange(4, dtype=np.float32),
        "shape": (2, [3, 4]),
        "seen": {3, 1, (2, "a")},
        "tags": frozenset({"x", "y"}),
        "baseline": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    }
    ac.save_checkpoint(setup.engine, tmp_path, tag="step1", client_state=client_state)
    _, loaded = ac.load_checkpoint(make_setup(seed=1).engine, tmp_path)
    assert loaded.keys() == client_state.keys()
    for key, value in client_state.items():
        assert type(loaded[key]) is type(value), key
        if isinstance(value, np.ndarray):
            assert loaded[key].dtype == value.dtype and np.array_equal(loaded[key], value)
        elif isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value)
        else:
            assert loaded[key] == value, key
