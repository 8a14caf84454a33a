"""Peer copies of the local tiers (recover.local_replicas): three ranks as three nodes, each its
own local tier; copies placed on the ring, a node that lost its disk assembled from the others,
a copy that fails its check never used."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import run_distributed
from recovery_runs import assert_same_run, losses, run_job

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import FileRecord, crc32
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import RECOVER_MANIFEST, generation_name, generation_step
from areal_ckpt.publish import check_files, read_manifest, write_manifest
from areal_ckpt.storage import folders, peers
from areal_ckpt.tier import copies_record, nodes, peer_copies

SHARED = "recover_info/step_info.json"


def _contents(rank: int, step: int) -> dict[str, bytes]:
    """The files rank ``rank`` writes of the dump at ``step``: its data file, on rank 0 also a shared one."""
    data = {f"default/__{rank}_0.distcp": bytes((rank * 7 + step + index) % 251 for index in range(10_000))}
    return {**data, SHARED: b'{"global_step": %d}' % step} if rank == 0 else data


def _everything(world_size: int, step: int) -> dict[str, bytes]:
    return {name: data for peer in range(world_size) for name, data in _contents(peer, step).items()}


def _dump(store: RecoverStore, step: int, world_size: int, models: bool = False) -> str:
    """Every rank writes its files of a generation on its own node; rank 0 commits it (its
    manifest naming the model folder with ``models``, as a publish needs)."""
    generation = generation_name(step, "feedbeef")
    for name, data in _contents(dist.rank(), step).items():
        (store.path(generation) / name).parent.mkdir(parents=True, exist_ok=True)
        (store.path(generation) / name).write_bytes(data)
    if dist.rank() == 0:
        listed = _everything(world_size, step)
        records = {name: FileRecord(len(data), crc32(data)) for name, data in listed.items()}
        header = {"step": {"global_step": step}, **({"models": ["default"]} if models else {})}
        store.commit(generation, records, header, ["default"])
    dist.barrier()
    return generation


def _lose_disk(store: RecoverStore, rank: int) -> None:
    """Rank ``rank``'s node loses its local tier; the restarted job claims an empty one."""
    dist.barrier()
    if dist.rank() == rank:
        shutil.rmtree(store.trial)
        store.root.mkdir(parents=True)
    dist.barrier()


def _assemblies(store: RecoverStore) -> list[peer_copies.Assembly]:
    held = dist.all_gather_objects(peer_copies.holdings_of(store))
    return peer_copies.assemblies(dict(enumerate(held)))


def _ring_case(rank: int, world_size: int, root: str) -> None:
    peers.TRANSFER_CHUNK = 4096  # a data file crosses in several messages
    store = RecoverStore(Path(root) / f"node{rank}" / "trial")
    generation = _dump(store, 5, world_size)
    peer_copies.replicate(store, generation, copies=1)
    held = set(folders.listing_of(store.path(generation)))
    before = (rank - 1) % world_size  # the node before this one on the ring
    expected = {*_contents(rank, 5), *_contents(before, 5)} | ({RECOVER_MANIFEST} if rank in (0, 1) else set())
    assert held == expected  # its own files and its predecessor's; node 0's manifest on node 1 too
    assert peer_copies.replicate(store, generation, copies=1) == 0  # each file on two nodes already

    _lose_disk(store, 1)  # node 1's own files live on as node 2's copies
    (found, *_) = _assemblies(store)
    assert (found.generation, found.whole, found.manifest_from) == (generation, True, 0)
    peer_copies.assemble(store, generation, found.manifest_from)
    files = read_manifest(store.path(generation), RECOVER_MANIFEST)["files"]
    assert check_files(store.path(generation), files, list(_everything(world_size, 5))) == []

    later = _dump(store, 7, world_size)
    peer_copies.replicate(store, later, copies=1)
    _lose_disk(store, 0)  # rank 0's node, with the commit record: its manifest lives on as node 1's copy
    (found, *_) = _assemblies(store)
    assert (found.generation, found.whole, found.manifest_from) == (later, True, 1)
    peer_copies.assemble(store, later, found.manifest_from)
    if rank == 0:
        assert store.committed() == later  # committed again on rank 0's node
    files = read_manifest(store.path(later), RECOVER_MANIFEST)["files"]
    assert check_files(store.path(later), files, list(_everything(world_size, 7))) == []

    newest = _dump(store, 9, world_size)
    peer_copies.replicate(store, newest, copies=1)
    _lose_disk(store, 1)
    if rank == 2:  # the only copy of node 1's data file rots on node 2
        damaged = store.path(newest) / "default/__1_0.distcp"
        data = bytearray(damaged.read_bytes())
        data[100] ^= 0x01
        damaged.write_bytes(bytes(data))
    (found, *_) = _assemblies(store)
    assert found.generation == newest and found.whole  # same size: the transfer's check catches it
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: cannot receive it from rank 2: .*CRC-32"):
        peer_copies.assemble(store, newest, found.manifest_from)
    if rank in (0, 1):  # the damaged copy was never given the file's name
        assert not (store.path(newest) / "default/__1_0.distcp").exists()


@pytest.mark.dist
def test_copies_sit_on_the_ring_and_a_lost_node_is_assembled_from_them(tmp_path):
    run_distributed(_ring_case, 3, str(tmp_path))


def _two_ranks_per_node_case(rank: int, world_size: int, root: str) -> None:
    peers.TRANSFER_CHUNK = 4096
    store = RecoverStore(Path(root) / f"node{rank // 2}" / "trial")  # ranks 0-1 on node 0, 2-3 on node 1
    generation = _dump(store, 5, world_size)
    assert peer_copies.node_ranks(store) == [[0, 1], [2, 3]]
    received = dist.all_gather_objects(peer_copies.replicate(store, generation, copies=1))
    assert all(count > 0 for count in received), received  # every rank of a node moves its share
    folder = store.path(generation)
    assert all((folder / name).read_bytes() == data for name, data in _everything(world_size, 5).items())
    theirs = _everything(world_size, 5).keys() - {*_contents(2 * (rank // 2), 5), *_contents(2 * (rank // 2) + 1, 5)}
    own_manifest = {RECOVER_MANIFEST} if rank >= 2 else set()
    assert set(copies_record.copies_of(store, generation)) == theirs | own_manifest  # one record per node, none lost

    _lose_disk(store, 2)  # node 1, both of its ranks
    filled = dist.all_gather_objects(nodes.fill_from_peers(store, generation).received)
    assert filled[2] > 0 and filled[3] > 0, filled  # node 1's ranks both receive, not its lowest alone
    assert all((folder / name).read_bytes() == data for name, data in _everything(world_size, 5).items())


@pytest.mark.dist
def test_the_ranks_of_a_node_share_its_transfers(tmp_path):
    run_distributed(_two_ranks_per_node_case, 4, str(tmp_path))


def _uncommitted_case(rank: int, world_size: int, root: str) -> None:
    store = RecoverStore(Path(root) / f"node{rank}" / "trial")
    committed = _dump(store, 3, world_size)
    peer_copies.replicate(store, committed, copies=1)
    interrupted = generation_name(5, "0badf00d")  # every file and a manifest, but killed before the switch
    for name, data in _contents(rank, 5).items():
        (store.path(interrupted) / name).parent.mkdir(parents=True, exist_ok=True)
        (store.path(interrupted) / name).write_bytes(data)
    if rank == 0:
        listed = _everything(world_size, 5)
        write_manifest(
            store.path(interrupted),
            RECOVER_MANIFEST,
            {name: FileRecord(len(data), crc32(data)) for name, data in listed.items()},
            {"step": {"global_step": 5}},
        )
    dist.barrier()
    assert [entry.generation for entry in _assemblies(store)] == [committed]  # never the uncommitted one


@pytest.mark.dist
def test_a_dump_interrupted_before_its_commit_is_never_assembled(tmp_path):
    run_distributed(_uncommitted_case, 2, str(tmp_path))


def _shared_step(root: Path) -> int | None:
    """The step the shared fileroot's trial has committed (None: none)."""
    pointer = root / "checkpoints/tester/exp/bitexact/.recover/current"
    return generation_step(pointer.readlink().name) if pointer.is_symlink() else None


@pytest.mark.dist
def test_nodes_that_lost_their_disks_in_turn_resume_from_the_copies_bit_exact(reference_run_fsdp2, tmp_path):
    root, out, local = tmp_path / "shared", tmp_path / "out", tmp_path / "local"
    tiered = ["--local-dir", str(local), "--local-replicas", "1", "--upload-every", "1000"]
    killed = ["--wait-before-kill", "--kill-at"]  # its copies are complete when it dies
    assert run_job(root, out, world_size=2, wrap="fsdp2", extra=[*tiered, *killed, "3"]) == [-9, -9]
    assert _shared_step(root) is None  # nothing uploaded: the nodes hold it alone
    shutil.rmtree(local / "node1")
    assert run_job(root, out, world_size=2, wrap="fsdp2", extra=[*tiered, *killed, "5"]) == [-9, -9]
    assert _shared_step(root) is None
    shutil.rmtree(local / "node0")  # rank 0's node, with its commit record
    run_job(root, out, world_size=2, wrap="fsdp2", extra=tiered)
    assert_same_run(reference_run_fsdp2, out, world_size=2)
    for rank in range(2):  # each resumed after its last dump: no step ran twice
        assert all(len(values) == 1 for values in losses(out, rank).values())
    assert _shared_step(root) == 7  # close uploads the newest whatever upload_every says


def _flip_a_byte(tier: Path, pattern: str) -> None:
    """The one file under the local tier ``tier`` that matches ``pattern``, one bit of it flipped."""
    (path,) = tier.rglob(pattern)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.dist
@pytest.mark.parametrize("damage", ["a flipped byte in the only copy", "both local tiers lost"])
def test_what_the_nodes_cannot_assemble_whole_resumes_from_the_remote_newest(reference_run_fsdp2, tmp_path, damage):
    root, out, local = tmp_path / "shared", tmp_path / "out", tmp_path / "local"
    tiered = ["--local-dir", str(local), "--local-replicas", "1", "--upload-every", "3"]  # dumps 1 3 5 7: 5 uploaded
    first = [*tiered, "--wait-after-dumps", "--kill-at", "7"]
    assert run_job(root, out, world_size=2, wrap="fsdp2", extra=first) == [-9, -9]
    assert _shared_step(root) == 5
    shutil.rmtree(local / "node1")
    if damage == "both local tiers lost":
        shutil.rmtree(local / "node0")
    else:  # node 0 holds the only copy of rank 1's data file of step 7
        _flip_a_byte(local / "node0", "gen-00000007-*/default/__1_0.distcp")
    run_job(root, out, world_size=2, wrap="fsdp2", extra=tiered)
    assert_same_run(reference_run_fsdp2, out, world_size=2)
    for rank in range(2):  # resumed after step 5: steps 6 and 7 ran again, nothing before them
        assert {step: len(values) for step, values in losses(out, rank).items()} == {
            **dict.fromkeys(range(6), 1),
            6: 2,
            7: 2,
        }


def _listing_case(rank: int, world_size: int, root: str) -> None:
    import contextlib
    import io

    from areal_ckpt.cli.main import main as cli
    from areal_ckpt.tools.inspection import describe

    store = RecoverStore(Path(root) / f"node{rank}" / "trial")
    generation = _dump(store, 5, world_size)
    peer_copies.replicate(store, generation, copies=1)
    facts = describe(store.trial)
    (held,) = facts["held"]
    if rank == 0:  # its commit, its own data and shared files, a copy of rank 1's data file
        assert facts["kind"] == "recover"
        assert (held["committed"], held["own_files"], held["copied_files"]) == (True, 3, 1)
    else:  # no commit of its own: its data file, copies of rank 0's data, shared file and manifest
        assert facts["kind"] == "local tier"
        assert (held["committed"], held["own_files"], held["copied_files"]) == (False, 1, 3)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli(["inspect", str(store.trial)]) == 0
        assert cli(["list", str(store.trial)]) == 0
    text = printed.getvalue()
    assert f"holds {generation}" in text and "other nodes' files" in text
    assert ("recover (with copies)" if rank == 0 else "held (with copies)") in text


@pytest.mark.dist
def test_list_and_inspect_tell_a_local_tiers_own_files_from_its_copies(tmp_path):
    run_distributed(_listing_case, 2, str(tmp_path))


@pytest.mark.parametrize("field, value", [("local_replicas", 1), ("upload_every", 5)])
def test_copies_and_upload_cadence_need_a_local_tier(tmp_path, field, value):
    import areal_ckpt as ac
    from areal_ckpt.errors import ConfigError

    block = {"experiment_name": "e", "trial_name": "t", "fileroot": str(tmp_path / "shared"), field: value}
    with pytest.raises(ConfigError, match=f"{field}={value} needs local_dir .* set local_dir, or drop {field}"):
        ac.RecoverConfig.of(block)
    followed = ac.RecoverConfig.of({**block, "local_dir": str(tmp_path / "local")})  # the hint followed
    assert getattr(followed, field) == value
    with pytest.raises(ConfigError, match="local_replicas"):
        ac.RecoverConfig.of({**block, "local_dir": str(tmp_path / "local"), "local_replicas": -1})


def _orphans_case(rank: int, world_size: int, root: str) -> None:
    from areal_ckpt.persistence.generations import PersistentGenerations
    from areal_ckpt.tier.resume import choose_tier

    store = RecoverStore(Path(root) / f"node{rank}" / "trial")
    behind = PersistentGenerations(Path(root) / "shared" / "trial")
    generation = _dump(store, 5, world_size)  # killed before its copies were made
    _lose_disk(store, 0)
    with pytest.raises(CheckpointError, match=r"hold files of gen-00000005-feedbeef, rank 0's node holds none.*"):
        choose_tier(store, behind)
    dist.barrier()
    if rank == 1:  # the hint followed: those folders removed
        shutil.rmtree(store.path(generation))
    dist.barrier()
    assert choose_tier(store, behind).generation is None  # a fresh start, said by None


@pytest.mark.dist
def test_files_no_manifest_can_be_found_for_are_never_a_silent_fresh_start(tmp_path):
    run_distributed(_orphans_case, 2, str(tmp_path))


def _one_node_case(rank: int, world_size: int, root: str) -> None:
    store = RecoverStore(Path(root) / "trial")  # both ranks share this local tier: one node
    generation = _dump(store, 5, world_size)
    assert peer_copies.node_leaders(store) == [0]
    assert peer_copies.replicate(store, generation, copies=1) == 0  # no other node to copy to
    assert not (store.root / copies_record.COPIES_FOLDER).exists()


@pytest.mark.dist
def test_ranks_sharing_one_local_tier_make_no_copies(tmp_path):
    run_distributed(_one_node_case, 2, str(tmp_path))


def _hostile_case(rank: int, world_size: int, root: str) -> None:
    store = RecoverStore(Path(root) / f"node{rank}" / "trial")
    generation = _dump(store, 5, world_size)
    outside = Path(root) / f"outside{rank}"
    (outside / "info").mkdir(parents=True)
    (outside / "copies").mkdir()
    if rank == 1:  # links where the copies would land: the record's folder, a folder of the generation
        (store.root / copies_record.COPIES_FOLDER).symlink_to(outside / "copies")
        (store.path(generation) / "recover_info").symlink_to(outside / "info")
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"recover_info: a link in the local tier; not writing through it"):
        peer_copies.replicate(store, generation, copies=1)
    dist.barrier()
    if rank == 1:
        (store.path(generation) / "recover_info").unlink()
    dist.barrier()
    peer_copies.replicate(store, generation, copies=1)  # the record's folder is a link: no record, a warning
    assert not any(outside.rglob("*.json"))
    if rank == 1:
        assert (store.path(generation) / SHARED).read_bytes() == _contents(0, 5)[SHARED]
    assert copies_record.copies_of(store, generation) == ([] if rank == 1 else ["default/__1_0.distcp"])

    _lose_disk(store, 0)  # the only manifest left is node 1's copy, and one byte of it flips
    if rank == 1:
        manifest = store.path(generation) / RECOVER_MANIFEST
        data = bytearray(manifest.read_bytes())
        data[len(data) // 2] ^= 0x01
        manifest.write_bytes(bytes(data))
    dist.barrier()
    assert _assemblies(store) == []  # a damaged manifest is never used to assemble


@pytest.mark.dist
def test_copies_never_land_through_a_link_and_a_flipped_manifest_copy_is_not_used(tmp_path):
    run_distributed(_hostile_case, 2, str(tmp_path))


def _sharded_model(sharded: bool) -> tuple:
    import torch
    from torch.distributed.fsdp import fully_shard

    from areal_ckpt.demo.tiny import build_model

    torch.manual_seed(0)
    model = build_model(48, hidden_size=256, intermediate_size=512)  # data files far larger than the small ones
    if sharded:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.arange(24).reshape(2, 12)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    return model, optimizer


def _full_state(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in model.state_dict().items()
    }


@contextlib.contextmanager
def _messages(name: str, level: int) -> Iterator[list[str]]:
    """What the logger ``name`` logs at ``level`` and above while inside, as text."""
    logger, captured = logging.getLogger(name), []
    handler = logging.Handler(level)
    handler.emit = lambda record: captured.append(record.getMessage())
    old_level = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield captured
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _received(messages: list[str], how: str = "from other nodes") -> int:
    return sum(int(found) for found in re.findall(rf"received (\d+) bytes {how}", " ".join(messages)))


def _slices_case(rank: int, world_size: int, root: str) -> None:
    import torch

    import areal_ckpt as ac

    spec = ac.FinetuneSpec(total_train_epochs=1, dataset_size=100, train_batch_size=1)

    def config() -> ac.RecoverConfig:
        return ac.RecoverConfig(
            experiment_name="exp", trial_name="slices", fileroot=f"{root}/shared", user="tester", mode="sync",
            local_dir=f"{root}/node{rank}", local_replicas=1, upload_every=1000,
        )  # fmt: skip

    def lose_node1() -> None:
        dist.barrier()
        if rank == 1:
            shutil.rmtree(f"{root}/node1")
        dist.barrier()

    def node1_data_files() -> set[str]:
        return {path.name for path in Path(f"{root}/node1").rglob("gen-*/**/*.distcp")}

    model, optimizer = _sharded_model(sharded=True)
    saved = _full_state(model)
    handler = ac.RecoverHandler(config(), spec)
    handler.dump(ac.TorchEngine(model, optimizer=optimizer), ac.StepInfo(0, 3, 3, 100), force=True)
    handler.wait()
    handler.close()
    assert node1_data_files() == {"__0_0.distcp", "__1_0.distcp"}  # its own and its copy of node 0's
    (generation,) = [found for found in Path(f"{root}/node0").rglob("gen-*") if found.is_dir()]
    sizes = {
        Path(name).name: entry["size"] for name, entry in read_manifest(generation, RECOVER_MANIFEST)["files"].items()
    }
    dist.barrier()
    if rank == 0:  # close published it: gone, so only the nodes can serve the restarts below
        shutil.rmtree(f"{root}/shared")
    lose_node1()

    # the same sharding: node 1 receives the data file its rank reads, not node 0's, straight into
    # its rank's load (its tier gets the small files), and after the load the background copy
    # brings both back (every file on two nodes again)
    fresh, fresh_optimizer = _sharded_model(sharded=True)
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.add_(1)
    loader = ac.RecoverHandler(config(), spec)
    with _messages("areal_ckpt", logging.INFO) as sent:
        info = loader.load(ac.TorchEngine(fresh, optimizer=fresh_optimizer))
    assert info is not None and info.last_step_info.global_step == 3
    assert all(torch.equal(saved[name], value) for name, value in _full_state(fresh).items())
    into_load = _received(sent, r"from rank \d+ straight into the load")
    if rank == 1:
        assert into_load == sizes["__1_0.distcp"]
        assert 0 < _received(sent) < sizes["__0_0.distcp"]  # the small files only
    else:
        assert (into_load, _received(sent)) == (0, 0)
    loader.close()  # waits for the copies
    assert node1_data_files() == {"__0_0.distcp", "__1_0.distcp"}
    lose_node1()

    # unsharded (each rank the whole model): beyond its slice, so every file is sent and it loads
    whole, whole_optimizer = _sharded_model(sharded=False)
    loader = ac.RecoverHandler(config(), spec)
    with _messages("areal_ckpt.tier.resume", logging.WARNING) as warned:
        info = loader.load(ac.TorchEngine(whole, optimizer=whole_optimizer))
    assert info is not None and info.last_step_info.global_step == 3  # from the nodes, not a fresh start
    assert all(torch.equal(saved[name], value) for name, value in _full_state(whole).items())
    assert node1_data_files() == {"__0_0.distcp", "__1_0.distcp"}
    assert any("did not load with the files each node's ranks read" in message for message in warned)
    loader.close()


@pytest.mark.dist
def test_a_restarted_node_receives_what_its_ranks_read_and_everything_when_they_read_more(tmp_path):
    run_distributed(_slices_case, 2, str(tmp_path))


def _shares_case(rank: int, world_size: int, root: str) -> None:
    from areal_ckpt.persistence.generations import PersistentGenerations

    store = RecoverStore(Path(root) / f"node{rank}" / "trial")
    generation = _dump(store, 5, world_size, models=True)  # node 0 lacks node 1's data file, as after a resume
    behind = PersistentGenerations(Path(root) / "shared" / "trial")
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp"):  # rank 0 cannot send what it lacks
        behind.publish(store.path(generation), {}, "run", 5)
    shares = peer_copies.shares_held(store, generation)
    assert shares == (
        {} if rank == 0 else {"default/__1_0.distcp": (10_000, crc32(_contents(1, 5)["default/__1_0.distcp"]))}
    )
    own = store.path(generation) / "default/__1_0.distcp"
    if rank == 1:  # a byte of the file node 1 is to send flips: refused by name, nothing committed
        own.write_bytes(bytes([own.read_bytes()[0] ^ 0x01]) + own.read_bytes()[1:])
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp"):
        behind.publish(store.path(generation), shares, "run", 5)
    assert behind.newest() is None
    if rank == 1:
        own.write_bytes(_contents(1, 5)["default/__1_0.distcp"])
    behind.publish(store.path(generation), shares, "run", 5)  # each node sends what it holds
    assert behind.newest() == generation
    shared = Path(behind.where(generation))
    assert all((shared / name).read_bytes() == data for name, data in _everything(world_size, 5).items())


@pytest.mark.dist
def test_a_generation_the_nodes_hold_in_parts_is_uploaded_by_the_nodes_that_hold_each_file(tmp_path):
    run_distributed(_shares_case, 2, str(tmp_path))


def _swap_nodes(local: Path) -> None:
    """The attacker's move: the restarted job's ranks land on each other's nodes (rank 0 now runs
    where rank 1's local tier is, and the other way round)."""
    (local / "node0").rename(local / "moving")
    (local / "node1").rename(local / "node0")
    (local / "moving").rename(local / "node1")


@pytest.mark.dist
@pytest.mark.parametrize("move", ["rank 0 lands on the node that holds the copies", "a flipped byte in rank 0's file"])
def test_peer_copies_hold_on_any_placement_and_a_damaged_file_comes_from_an_intact_copy(
    reference_run_fsdp2, tmp_path, move
):
    # rank 0 on the copies' node was refused ("commit record is missing"); a flipped byte in rank
    # 0's own data file blocked every restart although the other node held an intact copy of it
    root, out, local = tmp_path / "shared", tmp_path / "out", tmp_path / "local"
    tiered = ["--local-dir", str(local), "--local-replicas", "1", "--upload-every", "1000"]
    killed = [*tiered, "--wait-before-kill", "--kill-at", "3"]  # step 3 committed, its copies made
    assert run_job(root, out, world_size=2, wrap="fsdp2", extra=killed) == [-9, -9]
    assert _shared_step(root) is None  # the nodes hold it alone
    if move.startswith("rank 0 lands"):
        _swap_nodes(local)
    else:
        _flip_a_byte(local / "node0", "gen-00000003-*/default/__0_0.distcp")
    run_job(root, out, world_size=2, wrap="fsdp2", extra=tiered)
    assert_same_run(reference_run_fsdp2, out, world_size=2)
    for rank in range(2):  # resumed after step 3: nothing ran twice
        assert all(len(values) == 1 for values in losses(out, rank).values()), losses(out, rank)


def _interrupted_then_moved_case(rank: int, world_size: int, root: str) -> None:
    from areal_ckpt.persistence.generations import PersistentGenerations
    from areal_ckpt.tier.resume import choose_tier

    behind = PersistentGenerations(Path(root) / "shared" / "trial")
    here, there = (RecoverStore(Path(root) / f"node{node}" / "trial") for node in (rank, 1 - rank))
    early = _dump(there, 1, world_size)  # an earlier run had rank 0 on node 1: its own commit there
    peer_copies.replicate(there, early, copies=1)
    committed = _dump(here, 3, world_size)  # then on node 0
    peer_copies.replicate(here, committed, copies=1)
    interrupted = generation_name(5, "feedbeef")  # step 5's files and manifest written, killed before the switch
    for name, data in _contents(rank, 5).items():
        (here.path(interrupted) / name).parent.mkdir(parents=True, exist_ok=True)
        (here.path(interrupted) / name).write_bytes(data)
    if rank == 0:
        records = {name: FileRecord(len(data), crc32(data)) for name, data in _everything(world_size, 5).items()}
        write_manifest(here.path(interrupted), RECOVER_MANIFEST, records, {"step": {"global_step": 5}})
    dist.barrier()
    choice = choose_tier(there, behind)  # the restart: rank 0 on node 1 again
    assert (choice.local, choice.generation) == (True, committed), choice  # never the one no switch committed


@pytest.mark.dist
def test_a_generation_never_committed_is_never_resumed_wherever_rank_0_lands(tmp_path):
    # once rank 0 moved to the other node, its old node's manifest of an interrupted dump counted
    run_distributed(_interrupted_then_moved_case, 2, str(tmp_path))


def test_a_newer_commit_the_local_tier_cannot_resume_is_named_in_a_warning(tmp_path, caplog):
    # one file of the newest commit replaced by a link: the restart resumed the older one without a word
    from areal_ckpt.persistence.generations import PersistentGenerations
    from areal_ckpt.tier.resume import choose_tier

    store = RecoverStore(tmp_path / "node0" / "trial")
    older = generation_name(3, "feedbeef")
    for step, generation in ((3, older), (5, generation_name(5, "feedbeef"))):
        for name, data in _contents(0, step).items():
            (store.path(generation) / name).parent.mkdir(parents=True, exist_ok=True)
            (store.path(generation) / name).write_bytes(data)
        records = {name: FileRecord(len(data), crc32(data)) for name, data in _contents(0, step).items()}
        store.commit(generation, records, {"step": {"global_step": step}}, ["default"], protected=(older,))
    newest = store.path(generation_name(5, "feedbeef")) / "default/__0_0.distcp"
    newest.unlink()
    newest.symlink_to(tmp_path / "elsewhere.distcp")
    with caplog.at_level(logging.WARNING, logger="areal_ckpt.tier.resume"):
        choice = choose_tier(store, PersistentGenerations(tmp_path / "shared" / "trial"))
    assert (choice.local, choice.generation) == (True, older)
    (warned,) = [record.getMessage() for record in caplog.records if "is newer than" in record.getMessage()]
    assert "gen-00000005-feedbeef" in warned and "default/__0_0.distcp" in warned and older in warned
