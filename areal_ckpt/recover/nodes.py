"""The nodes of a tiered trial: what each node's local tier holds, and how a load makes it whole.

With ``recover.local_dir`` on each node's own disk, each rank writes its data files to its own
node's local tier and rank 0 writes the small files there and commits: rank 0's commit stands
for every node. Another node's local tier holds the folder of each committed generation with its
own ranks' files only, and no commit record of its own; after each commit the lowest rank of
that node drops its other generations but those uploads still need
(:func:`~areal_ckpt.recover.tidy.drop_later`). Before a load from the local tiers, each node
receives the files it lacks that its ranks read (rank 0's manifest among them), whole, from a
node that holds them, over the job's process group (:func:`fill_from_peers`), each checked
against the manifest's size and CRC-32; every rank then loads as from a local trial.

Ranks share a node when their local tier is the same folder (host name, device and inode), so
the rule needs no launcher variables and holds for several nodes simulated on one machine.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_slices import data_files_read_by
from areal_ckpt.fsio import (
    FileRecord,
    fsync_dir,
    read_regular_file,
    record_of,
    write_file_durably,
)
from areal_ckpt.paths import DATA_SUFFIX, RECOVER_MANIFEST
from areal_ckpt.publish import read_manifest
from areal_ckpt.recover.store import RecoverStore
from areal_ckpt.storage.peers import Transfer, listing_of, run_transfers

logger = logging.getLogger(__name__)

#: The folder of a local tier's store that records, per generation, the files it holds as
#: copies of other nodes' (``{generation}.json``: a sorted JSON list of names).
COPIES_FOLDER = ".copies"


def node_of(folder: Path) -> str:
    """Which node ``folder`` (an existing local tier's store) is on: its host name, device and
    inode, the same for every rank sharing it. Local."""
    status = folder.stat()
    return f"{socket.gethostname()}:{status.st_dev}:{status.st_ino}"


def first_ranks(nodes: list[str]) -> dict[str, int]:
    """Every node of ``nodes`` (each rank's :func:`node_of`, by rank) and its lowest rank; pure."""
    first: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, rank)
    return first


@dataclass(frozen=True)
class Filled:
    """What :func:`fill_from_peers` did on this rank: the bytes it received, and the data files
    its node does not hold whole because no rank of it reads them (they are checked where
    read; a torn copy of one stays until a load needs it)."""

    received: int
    elsewhere: frozenset[str]


def fill_from_peers(store: RecoverStore, generation: str, every_file: bool = False) -> Filled:
    """Collective, before a load of ``generation`` (rank 0's committed one) from the local
    tiers, whose folder every node holds: each node receives, whole, the files of it that it
    lacks (or holds at another size) from a node that holds it, each checked against the
    manifest's size and CRC-32 before it takes its name. First every file but the DCP data
    files (rank 0's manifest among them, when a node has none), then the data files its ranks
    read (:func:`~areal_ckpt.formats.dcp_slices.data_files_read_by`: at the saved world size a
    rank's own shards and the tensors stored whole; every one at another world size, or with
    ``every_file``). Nothing is sent on one node. Blocking; durable on return. Raises
    CheckpointError on every rank, naming the file and the ranks, when no node holds a file a
    node needs or a transfer failed (files received whole are kept)."""
    folder = store.path(generation)
    what = f"{folder}: copying the files of other nodes"

    def roles(nodes: list[str]) -> list[tuple[bool, int]]:  # (several nodes, the lowest rank of this rank's node)
        first = first_ranks(nodes)
        return [(len(first) > 1, first[node]) for node in nodes]

    several, leader = agree.gathered_then_dealt(lambda: node_of(store.root), roles, what)
    if not several:
        return Filled(0, frozenset())
    received = _fill(store, generation, leader, lambda name: not name.endswith(DATA_SUFFIX), lambda: None)

    def read_here() -> set[str] | None:
        files = read_manifest(folder, RECOVER_MANIFEST)
        if every_file or files.get("world_size") != dist.world_size():
            return None
        return data_files_read_by(folder, files["files"], dist.rank())

    received += _fill(store, generation, leader, lambda name: name.endswith(DATA_SUFFIX), read_here)
    files = read_manifest(folder, RECOVER_MANIFEST)["files"]
    held = listing_of(folder)
    return Filled(
        received,
        frozenset(
            name for name, entry in files.items() if name.endswith(DATA_SUFFIX) and held.get(name) != entry["size"]
        ),
    )


def _fill(
    store: RecoverStore,
    generation: str,
    leader: int,
    kind: Callable[[str], bool],
    wanted: Callable[[], set[str] | None],
) -> int:
    """One pass of :func:`fill_from_peers` over the files of ``kind``: each node's lowest rank
    (``leader``) lists its node's folder, every rank says which it reads (``wanted``: None,
    every one), rank 0 plans, and each node receives what it lacks of what its ranks read;
    returns the bytes this rank received."""
    folder = store.path(generation)
    what = f"{folder}: copying the files of other nodes"
    leading = leader == dist.rank()

    def plan(asked: list[tuple[int, dict[str, int] | None, set[str] | None]]) -> list[list[Transfer]]:
        manifest = record_of(folder / RECOVER_MANIFEST)  # rank 0's; a node may have one from an earlier load
        listed = read_manifest(folder, RECOVER_MANIFEST)["files"]
        files = {name: FileRecord(entry["size"], entry["crc32"]) for name, entry in listed.items() if kind(name)}
        holders = {rank: listing for rank, (_, listing, _) in enumerate(asked) if listing is not None}
        reads: dict[int, set[str] | None] = {}  # by node: what its ranks read (None: every file)
        for node, _, names in asked:
            if node not in reads or reads[node] is not None:
                reads[node] = None if names is None else {*(reads.get(node) or ()), *names}
        everything = [(RECOVER_MANIFEST, manifest)] if kind(RECOVER_MANIFEST) else []
        transfers: list[Transfer] = []
        for index, (name, record) in enumerate([*everything, *sorted(files.items())]):
            needing = [rank for rank in holders if reads[rank] is None or name in (reads[rank] or ())]
            if name == RECOVER_MANIFEST:
                sources = [0]
                targets = [rank for rank in needing if name not in holders[rank]]
            else:
                sources = [rank for rank, listing in holders.items() if listing.get(name) == record.size]
                targets = [rank for rank in needing if holders[rank].get(name) != record.size]
            if targets and not sources:
                raise CheckpointError(f"{folder / name}: no node holds this file of {generation}")
            for offset, target in enumerate(targets):  # the senders take turns
                source = sources[(index + offset) % len(sources)]
                transfers.append(Transfer(name, record.size, record.crc32, source, target))
        return [[move for move in transfers if rank in (move.source, move.target)] for rank in range(len(asked))]

    mine = agree.gathered_then_dealt(lambda: (leader, listing_of(folder) if leading else None, wanted()), plan, what)
    received = agree.on_every_rank(lambda: receive_copies(store, generation, mine), what)
    if received:
        logger.info("%s: received %d bytes from other nodes", folder, received)
    return received


def receive_copies(store: RecoverStore, generation: str, transfers: list[Transfer]) -> int:
    """This rank's share of ``transfers`` of ``generation`` (:func:`run_transfers`), then the
    files it received noted as copies (:func:`note_copies`); returns the bytes received."""
    received = run_transfers(store.path(generation), transfers)
    names = [move.name for move in transfers if move.target == dist.rank()]
    if names:
        note_copies(store, generation, names)
    return received


def note_copies(store: RecoverStore, generation: str, names: list[str]) -> None:
    """Record that this node's local tier holds ``names`` of ``generation`` as copies of other
    nodes' files (for ``areal-ckpt list`` / ``inspect``), and drop the records of generations
    it no longer holds. Never through a link; a failure is logged (the record is a
    description, not part of the checkpoint)."""
    folder = store.root / COPIES_FOLDER
    try:
        if folder.is_symlink():
            raise OSError(f"{folder} is a link; not writing through it")
        folder.mkdir(exist_ok=True)
        held = set(store.generations())
        for record in folder.iterdir():
            if record.suffix == ".json" and record.stem not in held and not record.is_symlink():
                record.unlink()
        record = folder / f"{generation}.json"
        staged = folder / f".{generation}.{secrets.token_hex(4)}"
        write_file_durably(staged, json.dumps(sorted({*copies_of(store, generation), *names})).encode())
        os.replace(staged, record)  # replaces a link there, never writes through it
        fsync_dir(folder)
    except OSError as error:
        logger.warning("%s: could not record the copies held of %s: %s", folder, generation, error)


def copies_of(store: RecoverStore, generation: str) -> list[str]:
    """The files of ``generation`` this node's local tier holds as copies of other nodes' (what
    :func:`note_copies` recorded; empty when nothing is, or the record does not read). Local,
    read-only."""
    record = store.root / COPIES_FOLDER / f"{generation}.json"
    try:
        if record.is_symlink() or store.root.joinpath(COPIES_FOLDER).is_symlink():
            return []
        names = json.loads(read_regular_file(record, limit=16 << 20))
    except (OSError, ValueError):
        return []
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []
