"""Copies of a tiered trial's local tier on several nodes (two ranks, each its own local tier
as on two nodes): before a load, each node receives whole the files only another node holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_distributed

from areal_ckpt import dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import FileRecord, crc32
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import RECOVER_MANIFEST, generation_name
from areal_ckpt.publish import check_files, read_manifest
from areal_ckpt.storage import peers
from areal_ckpt.tier import nodes

SHARED = "recover_info/step_info.json"


def _contents(rank: int) -> dict[str, bytes]:
    """The files of the generation rank ``rank`` writes: its data file, and on rank 0 the shared one."""
    data = {f"default/__{rank}_0.distcp": bytes((rank * 7 + index) % 251 for index in range(10_000))}
    return {**data, SHARED: b'{"global_step": 5}'} if rank == 0 else data


def _dump(store: RecoverStore, step: int, listed: dict[str, bytes]) -> str:
    """This rank's node: write this rank's files of a generation; rank 0 commits it listing ``listed``."""
    generation = generation_name(step, "feedbeef")
    for name, data in _contents(dist.rank()).items():
        (store.path(generation) / name).parent.mkdir(parents=True, exist_ok=True)
        (store.path(generation) / name).write_bytes(data)
    if dist.rank() == 0:
        records = {name: FileRecord(len(data), crc32(data)) for name, data in listed.items()}
        store.commit(generation, records, {"step": {"global_step": step}}, ["default"])
    return generation


def _fill_case(rank: int, world_size: int, root: str) -> None:
    peers.TRANSFER_CHUNK = 4096  # a data file crosses in several messages
    store = RecoverStore(Path(root) / f"node{rank}" / "trial")
    everything = {name: data for peer in range(world_size) for name, data in _contents(peer).items()}
    generation = _dump(store, 5, everything)
    if rank == 1:  # a copy torn by a crash: the wrong size, so it is received again
        (store.path(generation) / SHARED).parent.mkdir()
        (store.path(generation) / SHARED).write_bytes(b"{")
    received = nodes.fill_from_peers(store, generation).received
    manifest = (store.path(generation) / RECOVER_MANIFEST).read_bytes()
    assert dist.all_gather_objects(manifest) == [manifest, manifest]  # rank 0's, on both nodes
    files = read_manifest(store.path(generation), RECOVER_MANIFEST)["files"]
    assert check_files(store.path(generation), files, list(everything)) == []
    others = sum(len(data) for name, data in everything.items() if name not in _contents(rank))
    assert received == others + (len(manifest) if rank == 1 else 0)
    assert nodes.fill_from_peers(store, generation).received == 0  # whole on both nodes: nothing to send again
    lost = {**everything, "default/__9_0.distcp": b"held by no node"}
    generation = _dump(store, 7, lost)
    with pytest.raises(CheckpointError, match=r"__9_0\.distcp: no node holds this file of gen-00000007"):
        nodes.fill_from_peers(store, generation)


@pytest.mark.dist
def test_each_node_receives_whole_the_files_only_another_node_holds(tmp_path):
    run_distributed(_fill_case, 2, str(tmp_path))


def _one_node_case(rank: int, world_size: int, root: str) -> None:
    store = RecoverStore(Path(root) / "trial")  # both ranks share this local tier
    generation = generation_name(3, "0000cafe")
    if rank == 0:
        (store.path(generation) / "recover_info").mkdir(parents=True)
        store.commit(generation, {}, {"step": {"global_step": 3}}, ["default"])
    dist.barrier()
    assert nodes.fill_from_peers(store, generation) == nodes.Filled(0, frozenset())


@pytest.mark.dist
def test_ranks_sharing_a_local_tier_send_nothing(tmp_path):
    run_distributed(_one_node_case, 2, str(tmp_path))
