"""The second half of a recovery dump: tensor shards, agreement, commit.

The first half (:mod:`areal_ckpt.recover.handler`) runs in the training process: it creates the
generation folder, encodes the small JSON files and captures the tensors. This half writes the
tensors through DCP, then the small files, and commits; it runs either in the training process
(sync) or in the background writers (async, :mod:`areal_ckpt.jobs.background`), collective over
whichever group runs it. A failed write is retried in place; after the last attempt the
generation is discarded, so the previous checkpoint stays the committed one whatever happens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from areal_ckpt import dist
from areal_ckpt._version import __version__
from areal_ckpt.errors import CheckpointError, CollectiveError, RankMismatchError
from areal_ckpt.formats.dcp_save import save_tensors
from areal_ckpt.formats.hf_export import HFFiles
from areal_ckpt.fsio import FileRecord, write_file_durably
from areal_ckpt.paths import HF_FILES
from areal_ckpt.recover.store import RecoverStore
from areal_ckpt.jobs.shm_arena import StagedLayout

logger = logging.getLogger(__name__)

RECOVER_FORMAT = "areal_ckpt.recover"
RECOVER_FORMAT_VERSION = 3  # 2: raw DCP data files; 3: torch.save records + .metadata around them
#: Versions this release reads: 2 differs only in the data files, which the same reader reads.
READABLE_RECOVER_VERSIONS = (2, 3)

#: Separates the model name from the tensor name in a dump's flat tensor dict.
MODEL_SEPARATOR = "/"


def dump_header(step: dict[str, int], models: list[str]) -> dict[str, Any]:
    """The manifest header of a dump after ``step`` of ``models`` by this job; local."""
    return {
        "format": RECOVER_FORMAT,
        "format_version": RECOVER_FORMAT_VERSION,
        "areal_ckpt_version": __version__,
        "torch_version": torch.__version__,
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
    ``layout`` locates the staged tensors (async only).
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
    layout: StagedLayout | None = None

    def run(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Write ``tensors`` (``"{model}/{name}"`` -> tensor) and commit the generation.

        Collective over the current process group; blocking; durable on return. Returns the
        generation's path and the bytes of all its files. Raises CheckpointError (on every
        rank) after ``retries`` failed attempts, with the generation discarded;
        CollectiveError at once when a peer is gone.
        """
        store = RecoverStore(self.trial)
        by_model: dict[str, dict[str, Any]] = {}
        for key, tensor in tensors.items():
            model, _, name = key.partition(MODEL_SEPARATOR)
            by_model.setdefault(model, {})[name] = tensor
        for attempt in range(self.retries + 1):
            outcome = self._attempt(store, by_model)
            if not isinstance(outcome, str):
                written, hidden = outcome
                store.delete_rank_files(hidden, dist.rank(), self.models)  # every rank its own share
                return {"path": str(store.path(self.generation)), "bytes": written}
            failure = outcome
            if attempt == self.retries:
                if dist.rank() == 0 and _committed_or_none(store) != self.generation:
                    store.discard(self.generation)
                raise CheckpointError(
                    f"{store.root}: recovery dump at global step {self.header['step']['global_step']} failed "
                    f"after {attempt + 1} attempts: {failure}; the previous checkpoint is intact"
                )
            delay = min(0.5 * 2**attempt, 10.0)
            logger.warning("recovery dump attempt %d failed (%s); retrying in %.1f s", attempt + 1, failure, delay)
            time.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _attempt(self, store: RecoverStore, by_model: dict[str, dict[str, Any]]) -> tuple[int, list[str]] | str:
        """One write + commit; returns (the generation's bytes, the hidden superseded
        generations) or why it failed. Collective; rank 0 commits, every rank gets its outcome."""
        rank = dist.rank()
        folder = store.path(self.generation)
        records = dict(self.records)
        local_error: str | None = None
        try:
            for model in sorted(by_model):  # collective: a failed write raises on every rank
                tensors, groups = by_model[model], self.param_groups.get(model)
                plan_key = f"{self.trial}/{model}"
                for file_name, record in save_tensors(tensors, folder / model, groups, plan_key).items():
                    records[f"{model}/{file_name}"] = (record.size, record.crc32)
            for relative, data in self.files.items():  # local from here on
                record = write_file_durably(folder / relative, data)
                records[relative] = (record.size, record.crc32)
            for model, hf_files in self.hf.items():  # checksummed and fsync'd by the commit
                (folder / model / HF_FILES).mkdir(exist_ok=True)
                hf_files.write(folder / model / HF_FILES)
        except (RankMismatchError, CollectiveError):
            raise
        except Exception as error:  # DCP raises on every rank; local failures are agreed below
            local_error = f"rank {rank}: {type(error).__name__}: {error}"
        outcomes = dist.gather_objects(local_error or records, dst=0)  # O(own files) from each rank
        result = self._commit(store, outcomes) if outcomes is not None else None
        return dist.broadcast_object(result, src=0)

    def _commit(self, store: RecoverStore, outcomes: list[Any]) -> tuple[int, list[str]] | str:
        errors = [o for o in outcomes if isinstance(o, str)]
        if errors:
            return "; ".join(errors)
        records = {k: FileRecord(size, crc) for o in outcomes for k, (size, crc) in o.items()}
        hidden: list[str] = []
        try:
            hidden = store.commit(self.generation, records, self.header, self.models)
        except Exception as error:
            if _committed_or_none(store) != self.generation:
                return f"commit failed: {error}"
            logger.warning("%s: committed %s, but then: %s", store.root, self.generation, error)
        return sum(record.size for record in records.values()), hidden


def _committed_or_none(store: RecoverStore) -> str | None:
    try:
        return store.committed()
    except CheckpointError:
        return None
