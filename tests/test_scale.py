"""Per-rank cost of a recovery dump and load does not grow with the number of ranks.

Every collective of the package goes through ``areal_ckpt.dist``, which counts what each rank
sends and receives. A 2-rank and a 4-rank FSDP2 job (gloo) dump the same model three times and
load it back; a non-zero rank's bytes and calls must be the same at 4 ranks as at 2 (the model
is the same, so its shards only get smaller), where ``dcp.save``'s metadata broadcast alone
would grow them by a chunk record per rank and tensor. The full elastic matrix (1 <-> 2 <-> 3
<-> 4 ranks, mid-epoch and at an epoch boundary) and the DeepSpeed ZeRO matrix (ZeRO 1-3 on 1-3
ranks into ZeRO 1-3 on 1-3 ranks, the optimizer mapped) are marked ``scale`` and run in ``make
scale``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from helpers import wrap_model
from test_elastic import BATCH, DATASET, _run

import areal_ckpt as ac
from areal_ckpt import dist
from areal_ckpt.demo.tiny import build_model, warmup_cosine

pytestmark = pytest.mark.dist

VOCAB = 48
SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=2)


def _engine() -> tuple[torch.nn.Module, ac.TorchEngine]:
    torch.manual_seed(0)
    model = wrap_model(build_model(VOCAB), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = warmup_cosine(optimizer, 2, 10)
    tokens = torch.arange(16).reshape(2, 8) % VOCAB
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    scheduler.step()
    return model, ac.TorchEngine(model, optimizer=optimizer, lr_scheduler=scheduler)


def _config(root: str) -> ac.RecoverConfig:
    return ac.RecoverConfig(experiment_name="exp", trial_name="scale", fileroot=root, user="tester", mode="on")


def traffic_worker(rank: int, world: int, root: str, report: str) -> None:
    _, engine = _engine()
    handler = ac.RecoverHandler(_config(root), SPEC)
    measured = {}
    for step in range(3):
        before = dist.traffic()
        handler.dump(engine, ac.StepInfo(0, step, step, SPEC.steps_per_epoch), force=True)
        measured[f"dump {step}"] = dist.traffic() - before
    handler.close()
    _, fresh = _engine()
    before = dist.traffic()
    ac.RecoverHandler(_config(root), SPEC).load(fresh)
    measured["load"] = dist.traffic() - before
    Path(f"{report}.{rank}").write_text(json.dumps({k: vars(v) for k, v in measured.items()}))


def _traffic(tmp_path: Path, world: int) -> list[dict[str, dict[str, int]]]:
    report = tmp_path / f"traffic-{world}"
    run_distributed(traffic_worker, world, str(tmp_path / f"root-{world}"), str(report), group=True)
    return [json.loads(Path(f"{report}.{rank}").read_text()) for rank in range(world)]


def test_a_non_zero_ranks_traffic_per_dump_and_load_is_flat_from_2_to_4_ranks(tmp_path):
    two, four = _traffic(tmp_path, 2), _traffic(tmp_path, 4)
    for phase in ("dump 0", "dump 1", "dump 2", "load"):
        calls = {entry[phase]["calls"] for entry in two[1:] + four[1:]}
        assert len(calls) == 1, (phase, calls)  # the same collectives, whatever the world size
        base = max(entry[phase]["sent"] + entry[phase]["received"] for entry in two[1:])
        for rank, entry in enumerate(four[1:], start=1):
            moved = entry[phase]["sent"] + entry[phase]["received"]
            assert moved <= base * 1.05 + 64, (phase, rank, moved, base)  # flat: not + O(ranks) per tensor
    # after the first dump the plan is reused: no plans are sent to rank 0 and back
    for later in ("dump 1", "dump 2"):
        assert two[1][later]["calls"] < two[1]["dump 0"]["calls"]
        assert two[1][later]["received"] < two[1]["dump 0"]["received"] / 10
    # rank 0 gathers every rank's results: it is the one whose traffic grows with the ranks
    assert four[0]["dump 1"]["received"] > two[0]["dump 1"]["received"]


def test_superseded_dumps_are_deleted_by_every_rank_and_leave_nothing(tmp_path):
    _traffic(tmp_path, 2)  # three dumps: the first two are superseded and deleted
    store = tmp_path / "root-2/checkpoints/tester/exp/scale/.recover"
    entries = sorted(path.name for path in store.iterdir())
    assert len([name for name in entries if name.startswith("gen-")]) == 1, entries
    assert not [name for name in entries if name.startswith(".trash-")], entries


# -- the full elastic matrix: `make scale` --------------------------------------------------------

MATRIX = [
    (old, new, batches)
    for old in (1, 2, 3, 4)
    for new in (1, 2, 3, 4)
    if old != new
    for batches in (5, len(DATASET) // (old * BATCH))
]  # mid-epoch, and the epoch's end


@pytest.mark.scale
@pytest.mark.parametrize("old, new, batches", MATRIX)
def test_the_data_stream_continues_exactly_once_on_any_number_of_ranks(tmp_path, old, new, batches):
    before, after = _run(tmp_path, old, new, "resumable", batches, drop=True)  # RNG is per rank: dropped
    assert all("seen" in entry for entry in after), after
    seen = before + [v for entry in after for v in entry["seen"]]
    counts = Counter(seen)
    assert set(counts) == set(DATASET)
    remaining = len(DATASET) - old * batches * BATCH
    assert len(seen) - len(DATASET) == (-remaining % new if remaining else 0)
    assert len({len(entry["seen"]) for entry in after}) == 1


@pytest.mark.scale
@pytest.mark.parametrize("old, new", [(old, new) for old in (1, 2, 3, 4) for new in (1, 2, 3, 4) if old != new])
def test_a_per_rank_position_is_refused_on_every_rank_for_any_change(tmp_path, old, new):
    _, after = _run(tmp_path, old, new, "distributed", 3, drop=False)
    errors = {entry.get("error") for entry in after}
    assert len(errors) == 1 and None not in errors, errors
    assert f"saved by {old} ranks, loading on {new}" in errors.pop()


def test_a_rank_deletes_only_its_own_files_and_never_through_a_link(tmp_path):
    from areal_ckpt.generations.store import RecoverStore
    from areal_ckpt.generations.tidy import delete_rank_files, remove_trash

    store = RecoverStore(tmp_path / "trial")
    hidden = store.root / ".trash-gen-00000001-0123abcd"
    for rank in (0, 1):
        (hidden / "default").mkdir(parents=True, exist_ok=True)
        (hidden / "default" / f"__{rank}_0.distcp").write_bytes(b"x")
        (hidden / "recover_info").mkdir(exist_ok=True)
        (hidden / "recover_info" / f"rank{rank}.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "__1_0.distcp").write_bytes(b"keep")
    (hidden / "actor").symlink_to(outside)
    delete_rank_files(store.root, [hidden.name], 1, ["default", "actor"])
    left = sorted(str(path.relative_to(hidden)) for path in hidden.rglob("*") if path.is_file())
    assert left == ["default/__0_0.distcp", "recover_info/rank0.json"]  # rank 0's are rank 0's to delete
    assert (outside / "__1_0.distcp").read_bytes() == b"keep"
    remove_trash(store.root)
    assert not hidden.exists() and (outside / "__1_0.distcp").exists()


ZERO_LAYOUTS = [(world, stage) for world in (1, 2, 3) for stage in (1, 2, 3)]


@pytest.mark.scale
@pytest.mark.parametrize("saved", ZERO_LAYOUTS, ids=[f"zero{s} on {w}" for w, s in ZERO_LAYOUTS])
def test_a_zero_dump_loads_with_its_optimizer_into_every_zero_layout(tmp_path, saved):
    """One ZeRO dump, loaded into ZeRO 1, 2 and 3 on 1, 2 and 3 ranks: every fp32 master and
    Adam moment bitwise what was saved (read through DeepSpeed's own API), training goes on."""
    from test_deepspeed_oracle import check_loads_elsewhere, reshard_dump_worker

    run_distributed(reshard_dump_worker, saved[0], str(tmp_path / "root"), str(tmp_path), saved[1], {})
    for loaded in ZERO_LAYOUTS:
        check_loads_elsewhere(str(tmp_path / "root"), tmp_path, loaded, {})
