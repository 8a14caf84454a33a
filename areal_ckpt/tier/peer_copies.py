"""Peer copies of a tiered trial's local tiers: each node's files also kept on other nodes.

With ``recover.local_replicas`` K on a job whose local tiers are on several nodes, every file
of a committed generation (the manifest and small files rank 0's node wrote, each node's own
ranks' data files) ends up on K+1 nodes (at most all of them). The nodes, ordered by their
lowest rank (node 0 holds rank 0), form a ring; a file held by one node only is copied to the K
nodes after it on the ring, so a node's copies never sit on that node. The copies travel over
the job's process group (the uploaders', :mod:`areal_ckpt.tier.upload`), sent and received
by all the ranks of each node in turn rather than through one
(:func:`~areal_ckpt.tier.nodes.spread`), after the local
commit, in the background, each written beside its place and given its name only once its size
and CRC-32 match the manifest (:func:`~areal_ckpt.storage.peers.run_transfers`): a crash at any
instant leaves whole files only. The local tiers keep the previous generation until the copies
of the next one are complete (:attr:`~areal_ckpt.tier.upload.Uploads.protected`).

A restart looks at what every node holds (:func:`holdings_of`) and resumes from the newest
generation the surviving tiers hold whole (:func:`assemble`): up to K lost local tiers resume
from the nodes. Only a generation whose manifest rank 0's node committed, or whose manifest a
peer received as a copy (copies are made after the commit), counts: a dump interrupted before
its commit is never resumed from.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import FileRecord, record_of
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import RECOVER_MANIFEST, generation_step, is_generation_name
from areal_ckpt.publish import check_files, read_manifest
from areal_ckpt.storage.folders import listing_of
from areal_ckpt.storage.peer_reads import PeerReads
from areal_ckpt.storage.peers import Transfer
from areal_ckpt.tier.copies_record import copies_of
from areal_ckpt.tier.nodes import (
    fill_from_peers,
    first_ranks,
    node_members,
    node_of,
    receive_copies,
    spread,
)

logger = logging.getLogger(__name__)


def node_ranks(store: RecoverStore) -> list[list[int]]:
    """Every node's ranks, in ring order: nodes ordered by their lowest rank (the index of a
    node in this list is its node index). Collective; the same list on every rank."""
    nodes = agree.gathered_then_dealt(
        lambda: node_of(store.root), lambda every: [every] * len(every), f"{store.root}: finding the nodes"
    )
    first = first_ranks(nodes)
    members = node_members([first[node] for node in nodes])
    return [members[leader] for leader in sorted(members)]


def node_leaders(store: RecoverStore) -> list[int]:
    """Every node's lowest rank, in ring order (:func:`node_ranks`). Collective."""
    return [ranks[0] for ranks in node_ranks(store)]


def replicate(store: RecoverStore, generation: str, copies: int) -> int:
    """Collective, after ``generation`` committed on rank 0's node: every file of it held by
    fewer than ``copies`` + 1 nodes is sent, whole and checked, to the nodes after the lowest
    node holding it on the ring until that many hold it, the files of a node sent and received
    by its ranks in turn (:func:`~areal_ckpt.tier.nodes.spread`). Returns the bytes this rank
    received. Blocking; durable on return. Raises CheckpointError on every rank naming the file and ranks
    when a transfer failed (the files received whole are kept) or no node holds a file."""
    folder = store.path(generation)
    what = f"{folder}: copying to other nodes"
    nodes = node_ranks(store)
    leaders = [ranks[0] for ranks in nodes]
    if len(leaders) < 2 or copies < 1:
        return 0
    wanted = min(copies, len(leaders) - 1) + 1

    def plan(listings: list[dict[str, int] | None]) -> list[list[Transfer]]:
        files = read_manifest(folder, RECOVER_MANIFEST)["files"]
        records = [(RECOVER_MANIFEST, record_of(folder / RECOVER_MANIFEST))]
        records += [(name, FileRecord(entry["size"], entry["crc32"])) for name, entry in sorted(files.items())]
        transfers: list[Transfer] = []
        for index, (name, record) in enumerate(records):
            holders = [node for node, leader in enumerate(leaders) if (listings[leader] or {}).get(name) == record.size]
            if not holders:
                raise CheckpointError(f"{folder / name}: no node holds this file of {generation}")
            origin = holders[0]
            for hop in range(1, len(leaders)):
                if len(holders) >= wanted:
                    break
                node = (origin + hop) % len(leaders)
                if node not in holders:
                    sender, receiver = spread(nodes[origin], index), spread(nodes[node], index)
                    transfers.append(Transfer(name, record.size, record.crc32, sender, receiver))
                    holders.append(node)
        return [[move for move in transfers if rank in (move.source, move.target)] for rank in range(len(listings))]

    leading = dist.rank() in leaders
    mine = agree.gathered_then_dealt(lambda: listing_of(folder) if leading else None, plan, what)
    received = receive_copies(store, generation, mine, next(ranks[0] for ranks in nodes if dist.rank() in ranks))
    if received:
        logger.info("%s: received %d bytes of other nodes' files (local_replicas=%d)", folder, received, copies)
    return received


def shares_held(store: RecoverStore, generation: str) -> dict[str, tuple[int, int]]:
    """Collective: this rank's share of sending ``generation`` on as the nodes hold it (an upload
    after a resume that gave each node only what its ranks read): every file of its manifest
    goes to the lowest node leader holding it at its size, by name with its size and CRC-32;
    rank 0's share is left empty, since rank 0 sends whatever no other rank does. The same
    plan on every rank."""
    folder = store.path(generation)
    leaders = node_leaders(store)

    def deal(listings: list[dict[str, int] | None]) -> list[dict[str, tuple[int, int]]]:
        shares: list[dict[str, tuple[int, int]]] = [{} for _ in listings]
        for name, entry in read_manifest(folder, RECOVER_MANIFEST)["files"].items():
            holder = next((rank for rank in leaders if (listings[rank] or {}).get(name) == entry["size"]), 0)
            if holder:
                shares[holder][name] = (entry["size"], entry["crc32"])
        return shares

    return agree.gathered_then_dealt(
        lambda: listing_of(folder) if dist.rank() in leaders else None, deal, f"{folder}: who sends which file"
    )


@dist.exchanged
@dataclass(frozen=True)
class Holding:
    """What one node's local tier holds of one generation: the file list of its manifest when
    it holds a manifest that counts (None else), and the size of every file it holds."""

    files: dict[str, tuple[int, int]] | None
    listing: dict[str, int]


def holdings_of(store: RecoverStore) -> dict[str, Holding]:
    """This node's holdings, by generation. A manifest counts only where a commit made it
    count, whichever node rank 0 runs on now: a copy another node sent (copies are made after
    a commit; :func:`~areal_ckpt.tier.copies_record.copies_of`), or this tier's own manifest of the
    generation its own ``current`` names or of an older one (kept for uploads or copies); its
    own manifest of a newer generation does not (a dump interrupted before its switch). A
    manifest that does not read (damaged) counts as absent. Local, read-only."""
    held: dict[str, Holding] = {}
    committed = own_committed(store)
    newest = None if committed is None else generation_step(committed)
    for generation in store.generations():
        folder = store.path(generation)
        files: dict[str, tuple[int, int]] | None = None
        own = newest is not None and (generation == committed or generation_step(generation) < newest)
        if own or RECOVER_MANIFEST in copies_of(store, generation):
            try:
                listed = read_manifest(folder, RECOVER_MANIFEST)["files"]
                files = {name: (entry["size"], entry["crc32"]) for name, entry in listed.items()}
            except CheckpointError as error:
                if (folder / RECOVER_MANIFEST).exists():
                    logger.warning("%s: not used to resume: %s", folder / RECOVER_MANIFEST, error)
        held[generation] = Holding(files, listing_of(folder))
    return held


def own_committed(store: RecoverStore) -> str | None:
    """The generation this tier's own ``current`` names (None without one, or when it is
    broken: then logged, and none of this tier's own manifests counts). Local, read-only."""
    try:
        target = store.current.read(store.root)
    except CheckpointError as error:
        logger.warning("%s: its own recovery generations are not used to resume: %s", store.root, error)
        return None
    if target is not None and not is_generation_name(target):
        logger.warning(
            "%s: its own recovery generations are not used to resume: %s names %r", store.root, store.pointer, target
        )
        return None
    return target


@dataclass(frozen=True)
class Assembly:
    """Whether a generation can be resumed from the local tiers: ``manifest_from`` (a rank
    whose node holds its manifest), and the files no node holds (empty: whole)."""

    generation: str
    manifest_from: int
    missing: list[str]

    @property
    def whole(self) -> bool:
        """True when every file is held by some node."""
        return not self.missing


def assemblies(held: dict[int, dict[str, Holding]]) -> list[Assembly]:
    """Every generation some node holds a manifest of that counts, newest first, with what no
    node holds of it; ``held``: each node leader's holdings by its rank. Pure."""
    found: dict[str, Assembly] = {}
    for rank, holdings in sorted(held.items()):
        for generation, holding in holdings.items():
            if holding.files is None or generation in found:
                continue
            needed = {RECOVER_MANIFEST: -1, **{name: size for name, (size, _) in holding.files.items()}}
            missing = [
                name
                for name, size in sorted(needed.items())
                if not any(
                    name in other.get(generation, Holding(None, {})).listing
                    and (size < 0 or other[generation].listing[name] == size)
                    for other in held.values()
                )
            ]
            found[generation] = Assembly(generation, rank, missing)
    return sorted(found.values(), key=lambda entry: (generation_step(entry.generation), entry.generation), reverse=True)


#: Beside a file of a local tier's generation that failed its check: ``{name}{DAMAGED}{token}``,
#: kept for a look (removed with its generation), never read again.
DAMAGED = ".damaged-"


def set_aside_damaged(store: RecoverStore, generation: str) -> int:
    """Collective, after a load of ``generation`` from the local tiers failed: the lowest rank
    of each node checks every file its tier holds of it against the manifest (size and CRC-32,
    all read; a link or other entry in a file's place fails too) and renames each that fails
    to ``{name}.damaged-{token}``, so the next assembly brings it from a node whose copy is
    intact. Returns how many files every node set aside together (the same on every rank).
    Blocking."""
    folder = store.path(generation)
    what = f"{folder}: checking the local tiers' files"
    files = agree.decided_by_rank0(lambda: read_manifest(folder, RECOVER_MANIFEST)["files"], what)
    leaders = node_leaders(store)

    def own() -> int:
        if dist.rank() not in leaders:
            return 0
        token, moved = secrets.token_hex(4), 0
        for name in sorted(files):
            path = folder / name
            if (path.exists() or path.is_symlink()) and check_files(folder, files, [name]):
                logger.warning("%s fails its check; set aside, to be brought from another node's copy", path)
                path.rename(path.with_name(f"{path.name}{DAMAGED}{token}"))
                moved += 1
        return moved

    counts = agree.gathered_then_decided(own, lambda every: every, what)
    return sum(counts)


def assemble(
    store: RecoverStore, generation: str, manifest_from: int, every_file: bool = False, into_load: bool = False
) -> tuple[bool, PeerReads | None]:
    """Collective, before a load from the local tiers: make ``generation`` whole on every node
    and committed on rank 0's node. Rank 0 first receives its manifest from ``manifest_from``
    when its node lacks it, then every node receives what it lacks of what its ranks read (of
    every file with ``every_file``; with ``into_load`` a data file one rank of a node reads
    goes into its load instead; :func:`~areal_ckpt.tier.nodes.fill_from_peers`, each file
    checked against the manifest), then rank 0 points ``current`` at it (durable). Returns
    whether some node was left without data files of it (the same on every rank), and this
    rank's share of the transfers the load runs. Raises CheckpointError on every rank naming
    the file when a copy fails its check; nothing is committed then."""
    folder = store.path(generation)
    what = f"{folder}: assembling it from the nodes' local tiers"
    if manifest_from != 0:

        def manifest_record() -> tuple[int, int] | None:
            if dist.rank() != manifest_from:
                return None
            record = record_of(folder / RECOVER_MANIFEST)
            return record.size, record.crc32

        def plan(records: list[tuple[int, int] | None]) -> list[list[Transfer]]:
            size, crc = records[manifest_from] or (0, 0)
            move = Transfer(RECOVER_MANIFEST, size, crc, manifest_from, 0)
            return [[move] if rank in (0, manifest_from) else [] for rank in range(len(records))]

        moves = agree.gathered_then_dealt(manifest_record, plan, what)
        receive_copies(store, generation, moves, next(ranks[0] for ranks in node_ranks(store) if dist.rank() in ranks))
        agree.decided_by_rank0(lambda: read_manifest(folder, RECOVER_MANIFEST) and None, what)
    filled = fill_from_peers(store, generation, every_file, into_load)
    partial = not dist.all_true(not filled.elsewhere)

    agree.decided_by_rank0(lambda: store.location.recommit(generation, {}), what)
    return partial, filled.into_load
