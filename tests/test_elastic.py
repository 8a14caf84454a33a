"""Elastic resume of the data stream: a ResumableDistributedSampler's position carries to any
number of ranks, every sample of the epoch is seen exactly once (plus padding); any other
per-rank position is refused on a world-size change, on every rank, unless explicitly dropped."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from recover_fixtures import committed_generation, make_setup, recover_config
from test_forged import edit_json
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import areal_ckpt as ac
from areal_ckpt.state.components import RESUMABLE_POSITION

DATASET = list(range(96))
BATCH = 2
SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=96, train_batch_size=BATCH)


@pytest.mark.parametrize(
    "size, replicas, shuffle, drop_last",
    list(itertools.product([96, 97, 5], [1, 2, 3, 4], [True, False], [False, True])),
)
def test_same_order_as_distributed_sampler(size, replicas, shuffle, drop_last):
    data = list(range(size))
    for rank in range(replicas):
        ours = ac.ResumableDistributedSampler(data, replicas, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        torchs = DistributedSampler(data, replicas, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs) and len(ours) == len(torchs)


def _consume(replicas: int, batches: int, epoch: int = 0) -> tuple[list[int], list[dict]]:
    """Ranks 0..replicas-1 each take ``batches`` batches of the epoch; returns what they saw
    and their positions."""
    seen, positions = [], []
    for rank in range(replicas):
        sampler = ac.ResumableDistributedSampler(DATASET, replicas, rank, seed=3)
        sampler.set_epoch(epoch)
        iterator = iter(sampler)
        seen += [next(iterator) for _ in range(batches * BATCH)]
        positions.append(sampler.position())
    return seen, positions


RESHARDS = [
    (old, new, batches)
    for old, new in [(4, 2), (4, 3), (4, 1), (2, 4), (1, 3), (3, 4)]
    for batches in (0, 5, 15, 24)
    if batches * BATCH * old < len(DATASET)
]  # mid-epoch, within it


@pytest.mark.parametrize("old, new, batches", RESHARDS)
def test_the_global_position_carries_to_any_number_of_ranks_exactly_once(old, new, batches):
    from areal_ckpt.state.sampler import global_position

    before, positions = _consume(old, batches)
    epoch, start = global_position(positions, "test")
    after = []
    for rank in range(new):
        sampler = ac.ResumableDistributedSampler(DATASET, new, rank, seed=3)
        sampler.resume_at(epoch, start)
        after += list(sampler)
    counts = Counter(before + after)
    assert set(counts) == set(DATASET)  # never skipped
    remaining = len(DATASET) - start
    padding = -remaining % new
    assert sum(counts.values()) - len(DATASET) == padding  # seen twice: only the padding


# -- through RecoverHandler, real ranks --------------------------------------------------------


def _loader(world: int, rank: int, kind: str, seed: int = 3) -> StatefulDataLoader:
    sampler = (
        ac.ResumableDistributedSampler(DATASET, world, rank, seed=seed)
        if kind == "resumable"
        else DistributedSampler(DATASET, world, rank, seed=seed)
    )
    sampler.set_epoch(0)
    return StatefulDataLoader(DATASET, batch_size=BATCH, sampler=sampler)


def elastic_dump(
    rank: int, world: int, root: str, kind: str, batches: int, report: str, rank_streams: bool = False
) -> None:
    setup = make_setup()
    if rank_streams:
        torch.manual_seed(100 + rank)  # per-rank RNG streams, as a job with per-rank dropout seeds has
    loader = _loader(world, rank, kind)
    iterator = iter(loader)
    seen = [value for _ in range(batches) for value in next(iterator).tolist()]
    handler = ac.RecoverHandler(recover_config(Path(root)), SPEC)
    handler.dump(
        setup.engine, ac.StepInfo(0, batches - 1, batches - 1, SPEC.steps_per_epoch), dataloader=loader, force=True
    )
    handler.close()
    Path(f"{report}.{rank}").write_text(json.dumps(seen))


def elastic_load(rank: int, world: int, root: str, kind: str, drop: bool, report: str, seed: int = 3) -> None:
    setup = make_setup(seed=1)
    loader = _loader(world, rank, kind, seed)
    try:
        info = ac.RecoverHandler(recover_config(Path(root)), SPEC).load(
            setup.engine, dataloader=loader, drop_rank_state=drop
        )
        if info.last_step_info.next().epoch > 0:  # the dump ended epoch 0: the loop goes on with epoch 1
            outcome = {"seen": []}
        else:
            loader.sampler.set_epoch(0)  # as the loop does at the top of the epoch
            outcome = {"seen": [value for batch in loader for value in batch.tolist()]}
    except ac.CheckpointError as error:
        outcome = {"error": str(error)}
    Path(f"{report}.{rank}").write_text(json.dumps(outcome))


def _run(tmp_path: Path, old: int, new: int, kind: str, batches: int, drop: bool) -> tuple[list[int], list[dict]]:
    root = tmp_path / f"root-{old}-{new}-{kind}-{drop}"
    run_distributed(elastic_dump, old, str(root), kind, batches, str(tmp_path / "before"), group=True)
    run_distributed(elastic_load, new, str(root), kind, drop, str(tmp_path / "after"), group=True)
    before = [v for r in range(old) for v in json.loads(Path(f"{tmp_path / 'before'}.{r}").read_text())]
    after = [json.loads(Path(f"{tmp_path / 'after'}.{r}").read_text()) for r in range(new)]
    return before, after


@pytest.mark.dist
@pytest.mark.parametrize("old, new, batches", [(4, 3, 5), (2, 4, 15)])
def test_a_resumable_sampler_resumes_on_another_world_size_exactly_once(tmp_path, old, new, batches):
    before, after = _run(tmp_path, old, new, "resumable", batches, drop=True)  # RNG is per rank: dropped
    assert all("seen" in entry for entry in after), after
    counts = Counter(before + [v for entry in after for v in entry["seen"]])
    assert set(counts) == set(DATASET)
    remaining = len(DATASET) - old * batches * BATCH
    assert sum(counts.values()) - len(DATASET) == -remaining % new
    assert len({len(entry["seen"]) for entry in after}) == 1  # every rank as many samples


@pytest.mark.dist
def test_another_sampler_is_refused_on_every_rank_and_both_ways_forward_work(tmp_path):
    before, after = _run(tmp_path, 4, 2, "distributed", 5, drop=False)
    errors = {entry.get("error") for entry in after}
    assert len(errors) == 1 and None not in errors
    error = errors.pop()
    assert "saved by 4 ranks, loading on 2" in error and "ResumableDistributedSampler" in error
    assert "drop_rank_state=True" in error
    # way forward 1: drop the position explicitly: the saved epoch restarts from its first batch
    _, after = _run(tmp_path, 4, 2, "distributed", 5, drop=True)
    assert all(len(entry["seen"]) == len(DATASET) // 2 for entry in after)
    # way forward 2: the resumable sampler (test above)


def test_a_resumable_sampler_on_the_same_world_size_resumes_bit_exactly(fileroot):
    setup = make_setup()
    loader = _loader(1, 0, "resumable")
    iterator = iter(loader)
    for _ in range(7):
        next(iterator)
    expected = [batch.tolist() for batch in iterator]
    loader = _loader(1, 0, "resumable")
    iterator = iter(loader)
    for _ in range(7):
        next(iterator)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    handler.dump(setup.engine, ac.StepInfo(0, 6, 6, SPEC.steps_per_epoch), dataloader=loader, force=True)
    handler.close()
    fresh = _loader(1, 0, "resumable")
    ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine, dataloader=fresh)
    fresh.sampler.set_epoch(0)
    assert [batch.tolist() for batch in fresh] == expected


@pytest.mark.dist
def test_a_sampler_with_another_seed_is_refused_on_every_rank_and_the_saved_seed_resumes(tmp_path):
    """2 -> 1 ranks with seed 9 where 3 was saved would repeat some samples and skip others."""
    root, report = tmp_path / "root", tmp_path / "report"
    run_distributed(elastic_dump, 2, str(root), "resumable", 3, str(report), group=True)
    before = [v for r in range(2) for v in json.loads(Path(f"{report}.{r}").read_text())]
    run_distributed(elastic_load, 1, str(root), "resumable", True, str(report), 9, group=True)
    error = json.loads(Path(f"{report}.0").read_text())["error"]
    assert "rank0.json: the data order was saved by another sampler (seed saved 3, this sampler 9)" in error
    assert "Build the ResumableDistributedSampler with the saved values" in error
    run_distributed(elastic_load, 1, str(root), "resumable", True, str(report), 3, group=True)  # the hint
    assert sorted(before + json.loads(Path(f"{report}.0").read_text())["seen"]) == DATASET


def _dumped_with_a_resumable_sampler(fileroot: Path, batches: int = 2) -> None:
    loader = _loader(1, 0, "resumable")
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    handler = ac.RecoverHandler(recover_config(fileroot), SPEC)
    step = ac.StepInfo(0, batches - 1, batches - 1, SPEC.steps_per_epoch)
    handler.dump(make_setup().engine, step, dataloader=loader, force=True)
    handler.close()


@pytest.mark.parametrize(
    "seed, dataset, message",
    [
        (9, DATASET, "seed saved 3, this sampler 9"),
        (3, DATASET[:-1], f"dataset_len saved {len(DATASET)}, this sampler {len(DATASET) - 1}"),
    ],
)
def test_another_order_on_the_same_world_size_is_refused_before_anything_is_loaded(fileroot, seed, dataset, message):
    _dumped_with_a_resumable_sampler(fileroot)
    fresh = make_setup(seed=1)
    before = {name: tensor.clone() for name, tensor in fresh.model.state_dict().items()}
    sampler = ac.ResumableDistributedSampler(dataset, 1, 0, seed=seed)
    loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler)
    with pytest.raises(ac.CheckpointError, match=message):
        ac.RecoverHandler(recover_config(fileroot), SPEC).load(fresh.engine, dataloader=loader)
    assert all(torch.equal(before[name], tensor) for name, tensor in fresh.model.state_dict().items())
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(fresh.engine, dataloader=_loader(1, 0, "resumable"))


@pytest.mark.parametrize(
    "field, value",
    [("start", -2), ("epoch", -1), ("start", 2.5), ("consumed", 10**6), ("start", "3"), ("seed", True), ("version", 7)],
)
def test_a_forged_sampler_position_is_refused_by_name(fileroot, field, value):
    _dumped_with_a_resumable_sampler(fileroot)
    edit_json(
        committed_generation(fileroot),
        "recover_info/rank0.json",
        lambda state: state["dataloader"][RESUMABLE_POSITION].update({field: value}),
    )
    with pytest.raises(ac.CheckpointError) as caught:
        ac.RecoverHandler(recover_config(fileroot), SPEC).load(
            make_setup().engine, dataloader=_loader(1, 0, "resumable")
        )
    error = str(caught.value)
    assert "recover_info/rank0.json" in error and "sampler position" in error and repr(value) in error, error


def yaml_load(rank: int, world: int, config_path: str, report: str) -> None:
    setup = make_setup(seed=1)
    loader = _loader(world, rank, "resumable")
    config = ac.load_config(config_path)
    try:
        ac.RecoverHandler(config.recover, SPEC).load(setup.engine, None, None, None, loader)  # AReaL's positional call
        loader.sampler.set_epoch(0)
        outcome = {"seen": [v for batch in loader for v in batch.tolist()], "draws": torch.rand(3).tolist()}
    except ac.CheckpointError as error:
        outcome = {"error": str(error)}
    Path(f"{report}.{rank}").write_text(json.dumps(outcome))


def _yaml(tmp_path: Path, root: Path, policy: str) -> Path:
    path = tmp_path / f"{policy}.yaml"
    path.write_text(
        f"experiment_name: exp\ntrial_name: trial\nfileroot: {root}\n"
        f'recover:\n  mode: "on"\n  user: tester\n  on_world_size_change: {policy}\n'
    )
    return path


@pytest.mark.dist
@pytest.mark.parametrize("new", [1, 3])
def test_an_elastic_resume_from_2_ranks_is_configured_in_yaml_alone(tmp_path, new):
    root = tmp_path / "root"
    run_distributed(elastic_dump, 2, str(root), "resumable", 5, str(tmp_path / "before"), True, group=True)
    before = [v for r in range(2) for v in json.loads(Path(f"{tmp_path / 'before'}.{r}").read_text())]

    run_distributed(yaml_load, new, str(_yaml(tmp_path, root, "refuse")), str(tmp_path / "refused"), group=True)
    errors = {json.loads(Path(f"{tmp_path / 'refused'}.{r}").read_text()).get("error") for r in range(new)}
    assert len(errors) == 1 and "the per-rank rng state differs" in next(iter(errors))
    assert "recover.on_world_size_change: fresh_rng" in next(iter(errors))  # the hint, followed below

    runs = []
    for attempt in range(2):
        report = tmp_path / f"after{attempt}"
        run_distributed(yaml_load, new, str(_yaml(tmp_path, root, "fresh_rng")), str(report), group=True)
        runs.append([json.loads(Path(f"{report}.{r}").read_text()) for r in range(new)])
    after = runs[0]
    counts = Counter(before + [v for entry in after for v in entry["seen"]])
    assert set(counts) == set(DATASET)  # every sample seen
    assert sum(counts.values()) - len(DATASET) == -(len(DATASET) - 2 * 5 * BATCH) % new  # twice: only the padding
    draws = [tuple(entry["draws"]) for entry in after]
    assert len(set(draws)) == new  # a fresh stream per new rank
    assert draws == [tuple(entry["draws"]) for entry in runs[1]]  # derived from the checkpoint: deterministic
