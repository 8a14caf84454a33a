"""The second half of a recovery dump: tensor shards, agreement, commit.

The first half (:mod:`areal_ckpt.recover.prepare`) runs in the training process: it creates the
generation folder, encodes the small JSON files and captures the tensors. This half writes the
tensors through DCP, then the small files, and commits; it runs either in the training process
(sync) or in the background writers (async, :mod:`areal_ckpt.jobs.background`), collective over
whichever group runs it. A failed write is retried in place; after the last attempt the
generation is discarded, so the previous checkpoint stays the committed one whatever happens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_ckpt import agree, dist
from areal_ckpt._version import __version__
from areal_ckpt.errors import CheckpointError, CollectiveError, RankMismatchError, TransientError
from areal_ckpt.formats.dcp_save import save_tensors
from areal_ckpt.formats.hf_export import HFFiles
from areal_ckpt.fsio import FileRecord, write_file_durably
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.generations.tidy import delete_later, drop_later
from areal_ckpt.jobs.retry import retried
from areal_ckpt.jobs.shm_arena import ArenaLayout
from areal_ckpt.paths import DATA_SUFFIX, HF_FILES, MODEL_SEPARATOR, RECOVER_FORMAT, RECOVER_FORMAT_VERSION
from areal_ckpt.recover.publication import CommittedDump, KeptLocally, Publication
from areal_ckpt.state.numerics import numerics_record
from areal_ckpt.tier.nodes import first_ranks

logger = logging.getLogger(__name__)


def dump_header(step: dict[str, int], models: list[str]) -> dict[str, Any]:
    """The manifest header of a dump after ``step`` of ``models`` by this job; local."""
    return {
        "format": RECOVER_FORMAT,
        "format_version": RECOVER_FORMAT_VERSION,
        "areal_ckpt_version": __version__,
        **numerics_record(),
        "world_size": dist.world_size(),
        "models": models,
        "step": step,
    }


@dataclass(frozen=True)
class DumpJob:
    """Everything the tensor half of one dump needs; plain, picklable data.

    ``records`` are this rank's files already in the generation (an unchanged frozen model's
    linked shards); ``files`` are this rank's small files to write (path in the generation ->
    content) and ``hf`` rank 0's HF files per model; ``header`` is the manifest header;
    ``layout`` locates the staged tensors (async only). ``publication`` says what follows the
    commit in ``trial`` (:mod:`areal_ckpt.recover.publication`): nothing (a local trial); the
    generation published where the trial persists within the dump, in a commit naming the job's
    ``run_token`` (``trial`` is then a staging copy); or, for a tiered trial, another job's upload
    (:mod:`areal_ckpt.tier.upload`), whose generations ``protected`` names (kept by the
    commit's tidying; on several nodes rank 0's commit stands for every node's,
    :mod:`areal_ckpt.tier.nodes`).
    """

    trial: Path
    generation: str
    models: list[str]
    records: dict[str, tuple[int, int]]
    files: dict[str, bytes]
    hf: dict[str, HFFiles]
    param_groups: dict[str, list[dict[str, Any]]]
    header: dict[str, Any]
    retries: int
    layout: ArenaLayout | None = None
    publication: Publication = KeptLocally()
    run_token: str = ""
    protected: tuple[str, ...] = ()

    def run(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Write ``tensors`` (``"{folder}/{name}"`` -> tensor, the folder a model's or its frozen
        part's) and commit the generation.

        Collective over the current process group; blocking; durable on return. Returns the
        generation's path and the bytes this dump wrote. Raises CheckpointError (on every
        rank) after ``retries`` failed attempts, with the generation discarded;
        CollectiveError at once when a peer is gone. The bytes are those written by this dump:
        files hard-linked from the previous generation (an unchanged frozen model or part) are
        not counted. Tiered, the result also lists this rank's files (``files``), for the upload.
        """
        store = RecoverStore(self.trial)
        by_folder: dict[str, dict[str, Any]] = {}  # a model's folder, or its frozen part's
        for key, tensor in tensors.items():
            folder, _, name = key.rpartition(MODEL_SEPARATOR)
            by_folder.setdefault(folder, {})[name] = tensor

        def discard() -> None:
            if dist.rank() == 0 and _committed_or_none(store) != self.generation:
                store.discard(self.generation)

        step = self.header["step"]["global_step"]
        what = f"{store.root}: recovery dump at global step {step}"
        mine: dict[str, tuple[int, int]] = {}  # this rank's files in the generation (size, CRC-32), for its uploads
        streamed: set[str] = set()  # those written straight to the bucket (its data files)
        try:
            written, hidden, tidies_node = retried(
                lambda: self._attempt(store, by_folder, mine, streamed), self.retries, what, give_up=discard
            )
        except RankMismatchError:  # refused before anything was written: no debris either
            discard()
            raise
        delete_later(store.root, hidden, dist.rank(), self.models)  # every rank its own share on rank 0's node
        if tidies_node:  # another node's local tier: rank 0's commit superseded all but this one
            kept = {self.generation, *self.protected}
            drop_later(store.root, [name for name in store.generations() if name not in kept])
        dump = CommittedDump(self.generation, step, self.models, mine, streamed, self.run_token, self.retries)
        where = self.publication.publish(store, dump)
        return {"path": where, "bytes": written, "files": mine}

    def _attempt(
        self,
        store: RecoverStore,
        by_folder: dict[str, dict[str, Any]],
        mine: dict[str, tuple[int, int]],
        streamed: set[str],
    ) -> tuple[int, list[str], bool]:
        """One write + commit; returns (the bytes written, the hidden superseded generations,
        whether this rank tidies its node's local tier: the lowest rank of each node but rank
        0's, in a tiered trial) and puts this rank's files into ``mine``, those it wrote straight
        to the bucket (object storage: its data files) also into ``streamed``. Collective; rank
        0 commits; every rank raises the same TransientError when a rank's write or the commit
        failed."""
        folder = store.path(self.generation)

        def write() -> tuple[dict[str, tuple[int, int]], str]:
            records = dict(self.records)
            try:
                for part in sorted(by_folder):  # collective: a failed write raises on every rank
                    tensors, groups = by_folder[part], self.param_groups.get(part)
                    plan_key = f"{self.trial}/{part}"
                    (folder / part).mkdir(parents=True, exist_ok=True)  # a frozen part's; on another node any
                    open_writer = self.publication.direct_writer(self.generation, part)
                    for file_name, record in save_tensors(
                        tensors, folder / part, groups, plan_key, open_writer
                    ).items():
                        records[f"{part}/{file_name}"] = (record.size, record.crc32)
                        if open_writer is not None and file_name.endswith(DATA_SUFFIX):
                            streamed.add(f"{part}/{file_name}")
                for relative, data in self.files.items():  # local from here on
                    (folder / relative).parent.mkdir(parents=True, exist_ok=True)  # on another node than rank 0's
                    record = write_file_durably(folder / relative, data)
                    records[relative] = (record.size, record.crc32)
                for model, hf_files in self.hf.items():  # checksummed and fsync'd by the commit
                    (folder / model / HF_FILES).mkdir(exist_ok=True)
                    hf_files.write(folder / model / HF_FILES)
                node = self.publication.node(store)  # who shares this copy of the store
            except (RankMismatchError, CollectiveError):
                raise
            except Exception as error:  # retried, once every rank knows
                raise TransientError(f"{type(error).__name__}: {error}") from error
            mine.update(records)
            return records, node

        return agree.gathered_then_dealt(write, lambda every: self._commit(store, every), "writing failed")

    def _commit(
        self, store: RecoverStore, every: list[tuple[dict[str, tuple[int, int]], str]]
    ) -> list[tuple[int, list[str], bool]]:
        """Rank 0: commit the generation, given every rank's records and node; returns, for each
        rank, the bytes written for it (linked files left out), the hidden superseded
        generations and whether that rank tidies its node's local tier."""
        records = {k: FileRecord(size, crc) for part, _ in every for k, (size, crc) in part.items()}
        hidden: list[str] = []
        try:
            hidden = store.commit(self.generation, records, self.header, self.models, self.protected)
        except Exception as error:
            if _committed_or_none(store) != self.generation:
                raise TransientError(f"commit failed: {error}") from error
            logger.warning("%s: committed %s, but then: %s", store.root, self.generation, error)
        linked = sum(size for size, _ in self.records.values())  # rank 0's: unchanged parts, not written
        written = sum(record.size for record in records.values()) - linked
        nodes = [node for _, node in every]
        tidying = set(first_ranks(nodes).values()) - {0}  # one node: nobody but rank 0
        return [(written, hidden, rank in tidying) for rank in range(len(every))]


def _committed_or_none(store: RecoverStore) -> str | None:
    try:
        return store.committed()
    except CheckpointError:
        return None
