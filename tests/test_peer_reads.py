"""Data files a restart's load reads as another rank sends them (storage/peer_reads.py): two
real gloo processes; the bytes land in the reader's tensors across message boundaries, a read
that fails or never happens keeps both ranks in step, a file whose bytes are not the
manifest's is refused by name, and nothing is written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from distributed import run_distributed

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import crc32
from areal_ckpt.storage import peers
from areal_ckpt.storage.peer_reads import PeerReads, ReceivedFile
from areal_ckpt.storage.peers import Transfer

FILES = {
    "model/__0_0.distcp": bytes(range(256)) * 40,
    "model/__1_0.distcp": bytes(reversed(range(256))) * 30,
    "other/__0_0.distcp": bytes(7 for _ in range(9000)),
}


def _setup(rank: int, root: str, damaged: str | None = None) -> tuple[Path, PeerReads]:
    peers.TRANSFER_CHUNK = 4096  # every file crosses in several messages
    generation = Path(root) / f"node{rank}" / "gen"
    generation.mkdir(parents=True)
    if rank == 0:
        for name, data in FILES.items():
            (generation / name).parent.mkdir(exist_ok=True)
            (generation / name).write_bytes(data if name != damaged else b"\x00" + data[1:])
    moves = [Transfer(name, len(data), crc32(data), 0, 1, True) for name, data in FILES.items()]
    return generation, PeerReads(generation, moves)


def _arrive_case(rank: int, world_size: int, root: str) -> None:
    generation, reads = _setup(rank, root)
    if rank == 0:
        reads.exchange(generation / "model", (), lambda name, source: None)()  # sent beside this rank's reads
        reads.settle()
        assert reads.received == 0
        return
    got: dict[str, bytes] = {}

    def read(name: str, source: ReceivedFile) -> None:
        if name == "__0_0.distcp":  # a read that fails part way
            source.fill([torch.empty(100, dtype=torch.uint8)], 5000)
            raise CheckpointError("refused by the reader")
        first, second = torch.empty(3000, dtype=torch.uint8), torch.empty(500, dtype=torch.int32)
        source.fill([first, second], 1000)  # 1000-6000: across a message boundary, into two dtypes
        got[name] = first.numpy().tobytes() + second.numpy().tobytes()
        with pytest.raises(CheckpointError, match=r"asked for after"):
            source.fill([torch.empty(10, dtype=torch.uint8)], 0)
        source.checksum()

    with pytest.raises(CheckpointError, match=r"refused by the reader"):
        reads.exchange(generation / "model", {"__0_0.distcp", "__1_0.distcp"}, read)  # receives run at once
    assert got == {"__1_0.distcp": FILES["model/__1_0.distcp"][1000:6000]}  # the next transfer ran all the same
    reads.settle()  # no load reached "other": received and dropped, so rank 0 finishes
    assert reads.received == sum(len(data) for data in FILES.values())
    assert list(generation.rglob("*")) == []  # nothing written


@pytest.mark.dist
def test_a_load_reads_files_as_they_arrive_and_every_transfer_runs_to_its_end(tmp_path):
    run_distributed(_arrive_case, 2, str(tmp_path))


def _damaged_case(rank: int, world_size: int, root: str) -> None:
    generation, reads = _setup(rank, root, damaged="model/__1_0.distcp")
    if rank == 0:
        reads.exchange(generation / "model", (), lambda name, source: None)()
        reads.exchange(generation / "other", (), lambda name, source: None)()
        return
    filled: list[torch.Tensor] = []

    def reader(folder: str) -> Callable[[str, ReceivedFile], None]:
        def read(name: str, source: ReceivedFile) -> None:
            filled.append(torch.empty(len(FILES[f"{folder}/{name}"]), dtype=torch.uint8))
            source.fill([filled[-1]], 0)
            source.checksum()

        return read

    with pytest.raises(CheckpointError, match=r"model/__1_0\.distcp: received from rank 0 with CRC-32 .* not used"):
        reads.exchange(generation / "model", {"__0_0.distcp", "__1_0.distcp"}, reader("model"))
    reads.exchange(generation / "other", {"__0_0.distcp"}, reader("other"))()  # a later folder's arrives too
    assert [tensor.numpy().tobytes() for tensor in filled] == [
        FILES["model/__0_0.distcp"],
        b"\x00" + FILES["model/__1_0.distcp"][1:],
        FILES["other/__0_0.distcp"],
    ]


@pytest.mark.dist
def test_a_received_file_that_is_not_the_manifests_is_refused_naming_its_sender(tmp_path):
    run_distributed(_damaged_case, 2, str(tmp_path))


def _load_case(rank: int, world_size: int, root: str) -> None:
    import dataclasses
    import shutil

    from torch.distributed.checkpoint.metadata import Metadata

    from areal_ckpt import dist
    from areal_ckpt.formats.dcp_io import load_tensors
    from areal_ckpt.formats.dcp_metadata import read_metadata_json
    from areal_ckpt.formats.dcp_save import save_tensors

    peers.TRANSFER_CHUNK = 4096
    saved = Path(root) / "saved"
    saved.mkdir(exist_ok=True)
    state = {f"r{rank}": torch.arange(3000, dtype=torch.float32) + 1000 * rank}
    records = save_tensors(state, saved)  # rank r's tensor in __r_0.distcp
    dist.barrier()
    folder = Path(root) / f"node{rank}" / "gen" / "model"
    shutil.copytree(saved, folder, ignore=shutil.ignore_patterns("__1_0.distcp") if rank == 1 else None)
    lost = saved / "__1_0.distcp"
    size, crc = dist.all_gather_objects((lost.stat().st_size, crc32(lost.read_bytes())) if rank == 1 else None)[1]
    move = Transfer(f"model/{lost.name}", size, crc, 0, 1, True)

    # rank 1 reads its data file as rank 0 sends it, and nothing is written on its node
    template = {f"r{rank}": torch.zeros(3000)}
    load_tensors(template, folder, optional_prefixes=("r",), expected=records, peers=PeerReads(folder.parent, [move]))
    assert torch.equal(template[f"r{rank}"], state[f"r{rank}"])
    assert not (Path(root) / "node1" / "gen" / "model" / lost.name).exists()

    # rank 1's read fails before it reaches its transfer: it still takes part, and both ranks
    # raise the same error instead of waiting for each other
    metadata = read_metadata_json(folder)
    if rank == 1:  # a slice that leaves its tensor uncovered, and the whole metadata unreadable
        entries = dict(metadata.state_dict_metadata)
        entries["r1"] = dataclasses.replace(entries["r1"], chunks=[])
        metadata = dataclasses.replace(metadata, state_dict_metadata=entries)

    def whole() -> Metadata:
        raise CheckpointError("the whole metadata does not read")

    with pytest.raises(CheckpointError, match=r"rank 1: .*the whole metadata does not read"):
        load_tensors(
            {f"r{rank}": torch.zeros(3000)},
            folder,
            optional_prefixes=("r",),
            expected=records,
            metadata=metadata,
            whole=whole,
            peers=PeerReads(folder.parent, [move]),
        )


@pytest.mark.dist
def test_a_rank_whose_read_fails_before_its_transfers_still_runs_them_and_both_raise(tmp_path):
    run_distributed(_load_case, 2, str(tmp_path))
