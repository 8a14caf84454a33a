"""Running a prepared recovery dump: written in the calling process (a synchronous dump), or its
tensors staged in shared memory and handed to the background writer (an asynchronous one)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from areal_ckpt import agree, dist
from areal_ckpt.errors import CollectiveError
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.jobs.background import JobOutcome
from areal_ckpt.jobs.lifecycle import SaveLifecycle
from areal_ckpt.jobs.shm_arena import arena_layout_of
from areal_ckpt.recover.write import DumpJob
from areal_ckpt.step import StepInfo

#: Called once a generation committed: (generation, fingerprints, this rank's files or None).
Committed = Callable[[str, dict[str, list[int]], Mapping[str, tuple[int, int]] | None], None]


def stopped(store: RecoverStore, step: StepInfo, lost: CollectiveError) -> CollectiveError:
    """The error of a dump that lost a rank: the committed checkpoint stands, a restart resumes."""
    return CollectiveError(
        f"{store.root}: recovery dump at global step {step.global_step} stopped: {lost}. "
        "The committed checkpoint is untouched; restart the job to resume from it."
    )


@dataclass(frozen=True)
class DumpRuns:
    """The two ways a prepared :class:`DumpJob` is run for a RecoverHandler: its lifecycle
    (``jobs``), its ``store``, and what to call once a generation committed."""

    jobs: SaveLifecycle
    store: RecoverStore
    committed: Committed

    def write(
        self,
        job: DumpJob,
        tensors: dict[str, torch.Tensor],
        fingerprints: dict[str, list[int]],
        step: StepInfo,
        start: float,
    ) -> str:
        """Write and commit ``job`` in this process; collective, durable on return. Returns the
        generation's path."""
        try:
            result = job.run(tensors)
        except CollectiveError as lost:
            raise stopped(self.store, step, lost) from lost
        self.committed(job.generation, fingerprints, result.get("files"))
        path = str(result["path"])
        self.jobs.finished(
            time.perf_counter() - start,
            result["bytes"],
            f"recovery checkpoint at global step {step.global_step}: {path}",
        )
        return path

    def hand_off(
        self, job: DumpJob, tensors: dict[str, torch.Tensor], fingerprints: dict[str, list[int]], start: float
    ) -> str:
        """Stage ``tensors`` in shared memory and hand ``job`` to the background writer (the
        generation is discarded if staging failed); collective, returns once staged. Returns the
        path the generation will have once committed."""
        layout = arena_layout_of(tensors)
        try:
            self.jobs.arena.stage(layout, tensors.items())
        except BaseException:
            if dist.rank() == 0:
                self.store.discard(job.generation)
            raise

        def collected(outcome: JobOutcome) -> str:
            self.committed(job.generation, fingerprints, outcome.result.get("files"))
            return f"recovery checkpoint {outcome.result['path']} committed"

        def committed_anyway() -> str | None:
            if not agree.decided_by_rank0(lambda: self.store.committed() == job.generation, "RecoverHandler.wait"):
                return None
            self.committed(job.generation, fingerprints, None)
            return f"recovery checkpoint {self.store.path(job.generation)} committed"

        self.jobs.submit(
            dataclasses.replace(job, layout=layout),
            time.perf_counter() - start,
            layout.nbytes,
            collected,
            committed_anyway,
        )
        return str(self.store.path(job.generation))
