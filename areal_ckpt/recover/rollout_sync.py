"""After a load, push the recovered weights to an RL trainer's rollout server, as AReaL does.

Only the objects' own methods are called (see the Protocols in
:mod:`areal_ckpt.engines.contract`); nothing here knows how weights travel.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from areal_ckpt.engines.contract import (
    ColocatedRolloutEngine,
    RolloutEngine,
    WeightSource,
    WeightUpdateMeta,
    require,
)
from areal_ckpt.errors import CheckpointError, ConfigError


def _require_colocation_protocol(rollout: object) -> None:
    """NotImplementedError, as AReaL raises it, naming what a colocated (AWEX) rollout engine
    lacks of ``pause_generation_sync()`` and ``offload(tags=...)``."""
    missing = []
    if not callable(getattr(rollout, "pause_generation_sync", None)):
        missing.append("pause_generation_sync()")
    offload = getattr(rollout, "offload", None)
    try:
        takes_tags = callable(offload) and "tags" in inspect.signature(offload).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): trust it, as AReaL does
        takes_tags = True
    if not takes_tags:
        missing.append("offload(tags=...)")
    if missing:
        raise NotImplementedError(
            f"RecoverHandler.load: the colocated rollout engine {type(rollout).__name__} lacks {', '.join(missing)}, "
            "which recovery with colocated_rollout and an awex weight update needs; nothing was paused or loaded"
        )


@dataclass(frozen=True)
class RolloutSync:
    """One weight update of ``rollout`` from ``source`` at the end of a load."""

    source: WeightSource
    rollout: RolloutEngine
    meta: WeightUpdateMeta
    #: AWEX colocation: the rollout engine frees its memory before the checkpoint is loaded.
    release_memory_first: bool

    @classmethod
    def checked(
        cls,
        engines: Mapping[str, object],
        inference_engine: object | None,
        meta: object | None,
        update_from: str,
        colocated: bool,
    ) -> RolloutSync | None:
        """The weight update a load ends with (None without an ``inference_engine``), its
        arguments checked before anything is loaded; ``engines`` are the load's engines as the
        caller gave them, by model name. Raises ConfigError for a missing ``meta`` (AReaL's
        ValueError), NotImplementedError (AReaL's) when a colocated rollout engine lacks
        ``pause_generation_sync()`` or an ``offload`` taking ``tags``, and CheckpointError naming
        what else is missing. Pure: nothing is paused or loaded before these checks."""
        if inference_engine is None:
            return None
        if meta is None:
            raise ConfigError("RecoverHandler.load: weight_update_meta is required with inference_engine")
        if update_from not in engines:
            raise CheckpointError(
                f"RecoverHandler.load: inference_engine_update_from={update_from!r} is not one of the "
                f"engines given ({sorted(engines)})"
            )
        update = require(meta, WeightUpdateMeta, "RecoverHandler.load: weight_update_meta")
        source = require(engines[update_from], WeightSource, f"RecoverHandler.load: engine {update_from!r}")
        awex = colocated and update.type == "awex"
        if awex:
            _require_colocation_protocol(inference_engine)
        rollout = require(
            inference_engine, ColocatedRolloutEngine if awex else RolloutEngine, "RecoverHandler.load: inference_engine"
        )
        return cls(source, rollout, update, release_memory_first=awex)

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
