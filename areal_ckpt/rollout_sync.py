"""After a load, push the recovered weights to an RL trainer's rollout server, as AReaL does.

Only the objects' own methods are called (see the Protocols in
:mod:`areal_ckpt.engines.contract`); nothing here knows how weights travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from areal_ckpt.engines.contract import ColocatedRolloutEngine, RolloutEngine, WeightSource, WeightUpdateMeta


@dataclass(frozen=True)
class RolloutSync:
    """One weight update of ``rollout`` from ``source`` at the end of a load."""

    source: WeightSource
    rollout: RolloutEngine
    meta: WeightUpdateMeta
    #: AWEX colocation: the rollout engine frees its memory before the checkpoint is loaded.
    release_memory_first: bool

    def run(self, version: int, load: Callable[[], None]) -> None:
        """Call ``load`` (the checkpoint into the training engines) and update the rollout
        engine's weights to ``version``. Collective as the engines' own methods are (AReaL
        calls them on every rank). The rollout engine is resumed even when the update failed,
        so a failed load never leaves it paused; the versions are set only on success."""
        versioned = self.meta.with_version(version)
        if not self.release_memory_first:
            load()
        self.source.connect_engine(self.rollout, versioned)
        self.rollout.pause()
        try:
            if self.release_memory_first:
                assert isinstance(self.rollout, ColocatedRolloutEngine)
                self.rollout.pause_generation_sync()
                self.rollout.offload(tags=["kv_cache"])
                self.rollout.offload(tags=["weights"])
                load()
            self.source.update_weights(versioned)
        finally:
            self.rollout.resume()
        self.source.set_version(version)
        self.rollout.set_version(version)
