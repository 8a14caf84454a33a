"""The nodes of a tiered trial: what each node's local tier holds, and how a load makes it whole.

With ``recover.local_dir`` on each node's own disk, each rank writes its data files to its own
node's local tier and rank 0 writes the small files there and commits: rank 0's commit stands
for every node. Another node's local tier holds the folder of each committed generation with its
own ranks' files only, and no commit record of its own; after each commit the lowest rank of
that node drops its other generations but those uploads still need
(:func:`~areal_ckpt.generations.tidy.drop_later`). Before a load from the local tiers, each node
receives the files it lacks that its ranks read (rank 0's manifest among them), whole, from a
node that holds them, over the job's process group (:func:`fill_from_peers`), each checked
against the manifest's size and CRC-32; every rank then loads as from a local trial, except
that a data file only one rank of the node reads arrives while that rank's load reads it
instead of being written first (:mod:`areal_ckpt.storage.peer_reads`).

Ranks share a node when their local tier is the same folder (host name, device and inode), so
the rule needs no launcher variables and holds for several nodes simulated on one machine.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError, CollectiveError
from areal_ckpt.formats.dcp_slices import data_files_read_by
from areal_ckpt.fsio import FileRecord, record_of
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import DATA_SUFFIX, RECOVER_MANIFEST
from areal_ckpt.publish import read_manifest
from areal_ckpt.storage.folders import listing_of
from areal_ckpt.storage.peer_reads import PeerReads
from areal_ckpt.storage.peers import Transfer, run_transfers
from areal_ckpt.tier.copies_record import note_copies

logger = logging.getLogger(__name__)


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
    """What :func:`fill_from_peers` did on this rank: the bytes it received, the data files its
    node does not hold whole (no rank of it reads them, or the one that does receives them
    into its load; they are checked where read; a torn copy of one stays until a load needs
    it), and this rank's share of the transfers that go into the load."""

    received: int
    elsewhere: frozenset[str]
    into_load: PeerReads | None = None


def fill_from_peers(store: RecoverStore, generation: str, every_file: bool = False, into_load: bool = False) -> Filled:
    """Collective, before a load of ``generation`` (rank 0's committed one) from the local
    tiers, whose folder every node holds: each node receives, whole, the files of it that it
    lacks (or holds at another size) from a node that holds it, each checked against the
    manifest's size and CRC-32 before it takes its name. First every file but the DCP data
    files (rank 0's manifest among them, when a node has none), then the data files its ranks
    read (:func:`~areal_ckpt.formats.dcp_slices.data_files_read_by`: at the saved world size a
    rank's own shards and the tensors stored whole; every one at another world size, or with
    ``every_file``). With ``into_load``, a data file exactly one rank of the node reads is not
    written there: it is sent while that rank's load reads it (the returned ``into_load``,
    which the load runs and :meth:`~areal_ckpt.storage.peer_reads.PeerReads.settle` ends; with
    peer copies the node's tier gets it back from the background copies). Nothing is sent on
    one node. Blocking; the files written are durable on return. Raises CheckpointError on
    every rank, naming the file and the ranks, when no node holds a file a node needs or a
    transfer failed (files received whole are kept)."""
    folder = store.path(generation)
    what = f"{folder}: copying the files of other nodes"

    def roles(nodes: list[str]) -> list[tuple[bool, int]]:  # (several nodes, the lowest rank of this rank's node)
        first = first_ranks(nodes)
        return [(len(first) > 1, first[node]) for node in nodes]

    several, leader = agree.gathered_then_dealt(lambda: node_of(store.root), roles, what)
    if not several:
        return Filled(0, frozenset())
    received, _ = _fill(store, generation, leader, lambda name: not name.endswith(DATA_SUFFIX), lambda: None, False)

    def read_here() -> set[str] | None:
        files = read_manifest(folder, RECOVER_MANIFEST)
        if every_file or files.get("world_size") != dist.world_size():
            return None
        return data_files_read_by(folder, files["files"], dist.rank())

    written, streamed = _fill(store, generation, leader, lambda name: name.endswith(DATA_SUFFIX), read_here, into_load)
    return Filled(received + written, held_elsewhere(store, generation), PeerReads(folder, streamed))


def held_elsewhere(store: RecoverStore, generation: str) -> frozenset[str]:
    """The data files of ``generation`` (its manifest's) that this node's local tier does not
    hold at their size: after :func:`fill_from_peers`, those no rank of the node reads. Local,
    read-only."""
    folder = store.path(generation)
    files = read_manifest(folder, RECOVER_MANIFEST)["files"]
    held = listing_of(folder)
    return frozenset(
        name for name, entry in files.items() if name.endswith(DATA_SUFFIX) and held.get(name) != entry["size"]
    )


def _fill(
    store: RecoverStore,
    generation: str,
    leader: int,
    kind: Callable[[str], bool],
    wanted: Callable[[], set[str] | None],
    into_load: bool,
) -> tuple[int, list[Transfer]]:
    """One pass of :func:`fill_from_peers` over the files of ``kind``: each node's lowest rank
    (``leader``) lists its node's folder, every rank says which it reads (``wanted``: None,
    every one), rank 0 plans, and each node receives what it lacks of what its ranks read (a
    file by the lowest of its ranks that reads it, into its load when it is the only one and
    ``into_load``, else by its ranks in turn, :func:`spread`; sent by the holding node's ranks
    in turn); returns the bytes this rank received, and its share of the transfers into the
    load."""
    folder = store.path(generation)
    what = f"{folder}: copying the files of other nodes"
    leading = leader == dist.rank()

    def plan(asked: list[tuple[int, dict[str, int] | None, set[str] | None]]) -> list[list[Transfer]]:
        manifest = record_of(folder / RECOVER_MANIFEST)  # rank 0's; a node may have one from an earlier load
        listed = read_manifest(folder, RECOVER_MANIFEST)["files"]
        files = {name: FileRecord(entry["size"], entry["crc32"]) for name, entry in listed.items() if kind(name)}
        holders = {rank: listing for rank, (_, listing, _) in enumerate(asked) if listing is not None}
        members = node_members([node for node, _, _ in asked])
        reads: dict[int, set[str] | None] = {}  # by node: what its ranks read (None: every file)
        for node, _, names in asked:
            if node not in reads or reads[node] is not None:
                reads[node] = None if names is None else {*(reads.get(node) or ()), *names}
        everything = [(RECOVER_MANIFEST, manifest)] if kind(RECOVER_MANIFEST) else []
        transfers: list[Transfer] = []
        for index, (name, record) in enumerate([*everything, *sorted(files.items())]):
            needing = [node for node in holders if reads[node] is None or name in (reads[node] or ())]
            if name == RECOVER_MANIFEST:
                sources = [0]
                targets = [node for node in needing if name not in holders[node]]
            else:
                sources = [node for node, listing in holders.items() if listing.get(name) == record.size]
                targets = [node for node in needing if holders[node].get(name) != record.size]
            if targets and not sources:
                raise CheckpointError(f"{folder / name}: no node holds this file of {generation}")
            for offset, target in enumerate(targets):  # the senders take turns
                source = sources[(index + offset) % len(sources)]
                readers = [rank for rank in members[target] if name in (asked[rank][2] or ())]
                receiver = readers[0] if readers else spread(members[target], index)
                sender = 0 if name == RECOVER_MANIFEST else spread(members[source], index)
                streamed = into_load and len(readers) == 1
                transfers.append(Transfer(name, record.size, record.crc32, sender, receiver, streamed))
        return [[move for move in transfers if rank in (move.source, move.target)] for rank in range(len(asked))]

    mine = agree.gathered_then_dealt(lambda: (leader, listing_of(folder) if leading else None, wanted()), plan, what)
    received = receive_copies(store, generation, [move for move in mine if not move.into_load], leader)
    if received:
        logger.info("%s: received %d bytes from other nodes", folder, received)
    return received, [move for move in mine if move.into_load]


def node_members(leaders: list[int]) -> dict[int, list[int]]:
    """Every node's ranks, in order, by its lowest rank; ``leaders``: each rank's node's lowest
    rank, by rank. Pure."""
    members: dict[int, list[int]] = {}
    for rank, leader in enumerate(leaders):
        members.setdefault(leader, []).append(rank)
    return members


def spread(ranks: list[int], index: int) -> int:
    """The rank of a node's ``ranks`` that moves the ``index``-th file of a plan: the files of a
    node are sent and received by all its ranks in turn, not funnelled through one. Pure."""
    return ranks[index % len(ranks)]


def receive_copies(store: RecoverStore, generation: str, transfers: list[Transfer], leader: int) -> int:
    """Collective: every rank runs its share of ``transfers`` of ``generation``
    (:func:`run_transfers`), then the lowest rank of each node (``leader``: this rank's node's)
    records the files its node's ranks received as copies (:func:`note_copies`). Returns the
    bytes this rank received. Raises CheckpointError on every rank, naming the ranks and the
    file, when a transfer failed on any (the files received whole are kept; those of a rank
    whose own transfers all succeeded are recorded)."""
    what = f"{store.path(generation)}: copying the files of other nodes"
    names: list[str] = []

    def run() -> int:
        got = run_transfers(store.path(generation), transfers)
        names.extend(move.name for move in transfers if move.target == dist.rank())
        return got  # a rank whose own transfers all succeeded records them, whatever the others did

    failure: CheckpointError | None = None
    try:
        received = agree.on_every_rank(run, what)
    except CollectiveError:
        raise  # no rank can be asked what it received
    except CheckpointError as error:  # raised alike on every rank
        failure, received = error, 0

    def by_node(every: list[tuple[int, list[str]]]) -> list[list[str]]:
        noted: list[list[str]] = [[] for _ in every]
        for node, received_names in every:
            noted[node].extend(received_names)
        return noted

    noted = agree.gathered_then_dealt(lambda: (leader, names), by_node, what)
    if noted:
        note_copies(store, generation, noted)
    if failure is not None:
        raise failure
    return received
