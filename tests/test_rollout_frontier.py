"""The async RL frontier (areal_ckpt.RolloutFrontier): the prompts in flight are committed with
the weights, so a resumed job neither skips nor repeats a prompt (docs/recovery.md, "The
rollout frontier")."""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path

import pytest
import torch
import torture_rollout
from conftest import OBJECT_SERVERS, fresh_bucket
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import areal_ckpt as ac
from areal_ckpt.state.frontier_files import frontier_files

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=40, train_batch_size=2)


def loader(length: int = 10, seed: int = 1, shuffle: bool = True) -> StatefulDataLoader:
    """A shuffled data source whose order is a function of (seed, epoch): the frontier calls
    set_epoch, so every epoch's order is the same after a resume (docs/recovery.md)."""
    data = [{"id": index} for index in range(length)]
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    return StatefulDataLoader(data, batch_size=3, sampler=sampler, collate_fn=list)


def frontier_of(source: StatefulDataLoader, **options) -> ac.RolloutFrontier:
    return ac.RolloutFrontier(source, identity=lambda prompt: prompt["id"], **options)


def handler(tmp_path: Path, **where: str) -> ac.RecoverHandler:
    """A handler of the trial ``t`` under ``tmp_path``, or where ``where`` says (``fileroot``,
    ``staging_dir``, ``local_dir``; ``mode``)."""
    place = {"fileroot": str(tmp_path), "mode": "on", **where}
    config = ac.RecoverConfig(experiment_name="e", trial_name="t", user="tester", **place)
    return ac.RecoverHandler(config, SPEC)


def engine() -> ac.TorchEngine:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return ac.TorchEngine(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def weights(target: ac.TorchEngine) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in target.module.state_dict().items()}


def drawn(frontier: ac.RolloutFrontier, count: int) -> list[str]:
    return [frontier.next()[0] for _ in range(count)]


def dump(
    tmp_path: Path,
    frontier: ac.RolloutFrontier | None,
    target: ac.TorchEngine | None = None,
    where: dict[str, str] | None = None,
    **extra,
) -> None:
    recover = handler(tmp_path, **(where or {}))
    try:
        recover.dump(target or engine(), ac.StepInfo(0, 0, 0, 20), rollout=frontier, force=True, **extra)
    finally:
        recover.close()


def load(
    tmp_path: Path,
    frontier: ac.RolloutFrontier | None,
    target: ac.TorchEngine | None = None,
    where: dict[str, str] | None = None,
    **extra,
):
    recover = handler(tmp_path, **(where or {}))
    try:
        return recover.load(target or engine(), rollout=frontier, **extra)
    finally:
        recover.close()


PLACES = [
    "folder",
    *(f"{how}-{scheme}" for how in ("object", "tiered") for scheme in ("s3", "gs", "az")),
    "tiered-posix",
]


@pytest.fixture(params=PLACES)
def where(request, tmp_path) -> dict[str, str]:
    """Where the trial lives: a folder; a bucket on each object store (staged in a local
    folder); a local tier in front of each object store and of a shared folder."""
    if request.param == "folder":
        return {"fileroot": str(tmp_path / "trials")}
    how, scheme = request.param.split("-")
    if scheme == "posix":
        return {"fileroot": str(tmp_path / "shared"), "local_dir": str(tmp_path / "local")}
    server = request.getfixturevalue(OBJECT_SERVERS[scheme])
    bucket = fresh_bucket(server, scheme, request.getfixturevalue("monkeypatch"), request)
    if how == "object":
        return {"fileroot": bucket, "staging_dir": str(tmp_path / "staging")}
    return {"fileroot": bucket, "local_dir": str(tmp_path / "local")}


def test_a_resume_issues_the_prompts_in_flight_first_in_draw_order_then_goes_on_as_if_never_stopped(tmp_path, where):
    """On every location: a folder, each object store, a local tier in front of each."""
    frontier = frontier_of(loader(), epochs=2)
    keys = drawn(frontier, 5)  # two batches of three drawn: one prompt still queued
    frontier.set_version(4)
    frontier.finished(keys[3], {"ids": torch.arange(4), "reward": 0.5})
    frontier.finished(keys[1], {"ids": torch.arange(2)})
    frontier.finished(keys[0], {"ids": torch.arange(3)})
    frontier.consumed([keys[1]])
    dump(tmp_path, frontier, where=where)
    never_stopped = drawn(frontier, 15)  # the rest of both epochs

    resumed = frontier_of(loader(), epochs=2)
    elsewhere = {
        key: f"{value}-another-node" if key in ("staging_dir", "local_dir") else value for key, value in where.items()
    }
    assert load(tmp_path, resumed, where=elsewhere) is not None  # a new node: all of it from the location
    assert [(key, {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in trajectory.items()})
            for key, trajectory in resumed.buffered()] == [
        (keys[3], {"ids": [0, 1, 2, 3], "reward": 0.5}), (keys[0], {"ids": [0, 1, 2]})
    ]  # fmt: skip
    assert resumed.counts() == {"queued": 3, "generating": 0, "finished": 2, "consumed": 1}
    assert resumed.version == 4
    reissued = drawn(resumed, 3)
    assert reissued == [keys[2], keys[4], never_stopped[0]]  # keys[2], keys[4] were generating or queued
    assert [resumed.seed_of(key) for key in reissued] == [frontier.seed_of(key) for key in reissued]
    assert reissued[2:] + drawn(resumed, 14) == never_stopped
    with pytest.raises(StopIteration):
        resumed.next()
    epochs = [key.split(":")[0] for key in [*keys, *never_stopped]]
    assert epochs.count("0") == 10 and epochs.count("1") == 10  # every prompt drawn once per epoch


def test_an_asynchronous_dump_commits_the_frontier_as_it_was_when_dump_returned(tmp_path):
    """mode: async: the frontier is snapshotted before dump returns; what the rollout side does
    while the background writer writes is not in that dump."""
    frontier = frontier_of(loader())
    first = drawn(frontier, 2)
    frontier.finished(first[0], {"ids": torch.arange(5)})
    recover = handler(tmp_path, mode="async")
    try:
        recover.dump(engine(), ac.StepInfo(0, 0, 0, 20), rollout=frontier, force=True)
        later = drawn(frontier, 2)  # while the writer may still write
        frontier.finished(first[1], {"ids": torch.arange(1)})
        recover.wait()
    finally:
        recover.close()
    resumed = frontier_of(loader())
    load(tmp_path, resumed)
    assert [key for key, _ in resumed.buffered()] == [first[0]]
    assert drawn(resumed, 3) == [first[1], *later]


def test_a_dump_while_a_rollout_thread_draws_accounts_for_every_prompt_once(tmp_path):
    """The snapshot and the data source's position are taken at one instant: whatever the thread
    was doing, the prompts consumed before the dump, those in the frontier and those drawn after
    the resume are every prompt exactly once."""
    frontier = frontier_of(loader(length=60), epochs=1)
    consumed: list[str] = []
    stop = threading.Event()

    def rollouts() -> None:
        for key, _ in frontier:
            frontier.finished(key, {"token": torch.tensor([len(key)])})
            if stop.is_set():
                return

    worker = threading.Thread(target=rollouts)
    worker.start()
    while len(frontier.buffered()) < 4:
        time.sleep(0.001)
    batch = [key for key, _ in frontier.buffered()[:4]]
    frontier.consumed(batch)
    consumed += batch
    dump(tmp_path, frontier)
    stop.set()
    worker.join()

    resumed = frontier_of(loader(length=60), epochs=1)
    load(tmp_path, resumed)
    after = [key for key, _ in resumed.buffered()] + [key for key, _ in resumed]
    everything = sorted(consumed + after, key=lambda key: int(key.split(":")[1]))
    assert everything == [f"0:{index}" for index in range(60)]


def test_a_frontier_beyond_its_bound_is_a_config_error_at_the_dump_and_the_previous_checkpoint_stays(tmp_path):
    """One job dumps within the bound, then beyond it (trajectories, then bytes): a ConfigError,
    nothing committed, the checkpoint before stays what a restart loads."""
    frontier = frontier_of(loader(), max_trajectories=1, max_bytes=16)
    recover, target = handler(tmp_path), engine()
    try:
        recover.dump(target, ac.StepInfo(0, 0, 0, 20), rollout=frontier, force=True)  # empty: within its bound
        first, second = drawn(frontier, 2)
        frontier.finished(first, {"ids": torch.arange(3)})
        frontier.finished(second, {"ids": torch.arange(3)})
        with pytest.raises(ac.ConfigError, match="2 finished trajectories .* more than max_trajectories=1"):
            recover.dump(target, ac.StepInfo(0, 1, 1, 20), rollout=frontier, force=True)
        frontier.consumed([first])  # one trajectory left: 24 bytes of int64
        with pytest.raises(ac.ConfigError, match="hold 24 bytes of tensors, more than max_bytes=16"):
            recover.dump(target, ac.StepInfo(0, 1, 1, 20), rollout=frontier, force=True)
    finally:
        recover.close()
    resumed = frontier_of(loader())
    info = load(tmp_path, resumed)
    assert info is not None and info.last_step_info.global_step == 0
    assert resumed.counts() == {"queued": 0, "generating": 0, "finished": 0, "consumed": 0}


@pytest.mark.parametrize(
    ("field", "other", "saved", "given"),
    [
        ("length", {"length": 12}, "10", "12"),
        ("shuffle", {"shuffle": False}, "True", "False"),
        ("sampler_seed", {"seed": 2}, "1", "2"),
    ],
)
def test_a_frontier_of_another_data_source_is_refused_naming_the_field_before_any_weight_loads(
    tmp_path, field, other, saved, given
):
    saved_engine = engine()
    with torch.no_grad():
        saved_engine.module.weight.add_(1.0)
    dump(tmp_path, frontier_of(loader()), saved_engine)
    target = engine()
    before = weights(target)
    with pytest.raises(
        ac.CheckpointError, match=rf"rank0.json: .*another data source: {field} was {saved}, .* {given}"
    ):
        load(tmp_path, frontier_of(loader(**other)), target)
    assert all(torch.equal(before[name], value) for name, value in weights(target).items())


def test_a_damaged_trajectory_file_is_refused_naming_it_and_the_engines_stay_untouched(tmp_path):
    frontier = frontier_of(loader())
    key = drawn(frontier, 1)[0]
    frontier.finished(key, {"ids": torch.arange(100)})
    saved_engine = engine()
    with torch.no_grad():
        saved_engine.module.weight.add_(1.0)
    dump(tmp_path, frontier, saved_engine)
    (generation,) = (tmp_path / "checkpoints/tester/e/t/.recover").glob("gen-*")
    tensors = generation / frontier_files(0)[1]
    data = bytearray(tensors.read_bytes())
    data[-3] ^= 0xFF
    tensors.write_bytes(bytes(data))
    target = engine()
    before = weights(target)
    with pytest.raises(ac.CheckpointError, match=rf"damaged: rank 0: {re.escape(str(tensors))}: checksum mismatch"):
        load(tmp_path, frontier_of(loader()), target)
    assert all(torch.equal(before[name], value) for name, value in weights(target).items())


def test_a_dump_without_a_frontier_is_refused_by_a_load_given_one_and_the_hint_works(tmp_path):
    source = loader()
    first = drawn(frontier_of(source), 3)  # the loader's position: one batch yielded
    dump(tmp_path, None, dataloader=source)
    with pytest.raises(ac.CheckpointError, match="holds no rollout frontier .* as dataloader= and without rollout="):
        load(tmp_path, frontier_of(loader()))
    again = loader()
    load(tmp_path, None, dataloader=again)  # the hint: the data source's position, no frontier
    resumed = frontier_of(again)
    rest = [key for key, _ in resumed]
    assert len(rest) == 7 and sorted(first + rest) == sorted(f"0:{index}" for index in range(10))


def test_misuse_names_the_key_and_the_source():
    frontier = frontier_of(loader())
    key = drawn(frontier, 1)[0]
    with pytest.raises(ValueError, match=r"consumed: \['" + key + r"'\] are not finished"):
        frontier.consumed([key])
    with pytest.raises(ValueError, match="'nope' is not in the frontier, not generating"):
        frontier.finished("nope", {})
    with pytest.raises(ValueError, match=r"trajectory\[.text.\]: cannot store a builtins.object without pickle"):
        frontier.finished(key, {"text": object()})
    with pytest.raises(ac.ConfigError, match="no state_dict / load_state_dict; give it a torchdata StatefulDataLoader"):
        ac.RolloutFrontier([1, 2, 3])


@pytest.mark.parametrize("world", [1, 2])
def test_a_killed_async_rl_job_trains_every_prompt_once_per_epoch_and_ends_bit_equal(tmp_path, world):
    """SIGKILLed at random instants (while generating, while dumping, between) and relaunched:
    every prompt of every epoch is trained on exactly once (none skipped, none repeated), and
    with seeds derived from each prompt's key the final weights equal an uninterrupted run's
    (`make torture`'s rollout rows, one trial each)."""
    torture_rollout.run_reference(tmp_path / "reference", world)
    seed = random.randrange(2**32)
    (tmp_path / "trial").mkdir()
    outcome, note = torture_rollout.one_trial(tmp_path / "trial", tmp_path / "reference", world, 2, random.Random(seed))
    assert (outcome, note) == ("resumed_correctly", ""), f"seed {seed}"


def two_rank_dump_worker(rank: int, world: int, root: str) -> None:
    """Each rank's frontier over its own shard: a prompt generating, one finished; dumped."""
    data = [{"id": index} for index in range(12)]
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    frontier = frontier_of(StatefulDataLoader(data, batch_size=2, sampler=sampler, collate_fn=list))
    first, _ = drawn(frontier, 2)
    frontier.finished(first, {"ids": torch.arange(3)})
    dump(Path(root), frontier)


def test_a_frontier_dumped_by_two_ranks_is_refused_on_one_unless_per_rank_state_is_dropped(tmp_path, caplog):
    """Each rank's frontier belongs to its data shard: on another number of ranks the load is
    refused before any weight loads (fresh RNG streams allowed, so the frontier is what stops
    it), naming the way out; the way out (drop_rank_state) loads the rest and starts the data
    afresh, logged."""
    from distributed import run_distributed

    run_distributed(two_rank_dump_worker, 2, str(tmp_path))
    target = engine()
    before = weights(target)
    with pytest.raises(ac.CheckpointError, match="dumped by 2 ranks, loading on 1: each rank's rollout frontier .* "
                       "set recover.on_world_size_change: drop_rank_state"):  # fmt: skip
        load(tmp_path, frontier_of(loader(length=12)), target, where={"on_world_size_change": "fresh_rng"})
    assert all(torch.equal(before[name], value) for name, value in weights(target).items())
    fresh = frontier_of(loader(length=12))
    assert load(tmp_path, fresh, target, drop_rank_state=True) is not None
    assert fresh.counts() == {"queued": 0, "generating": 0, "finished": 0, "consumed": 0}
    assert len([key for key, _ in fresh]) == 12
    assert "the rollout frontier is not restored (drop_rank_state)" in caplog.text
