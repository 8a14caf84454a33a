"""The contracts between the engine layer and everything above it, as Protocols.

An engine gives three things, each declared once here:

- :class:`ExportSource`: what an HF export reads (config, tensor specs, full tensors by round);
- :class:`DumpSource`: what a recovery dump or a DeepSpeed-style save captures;
- :class:`LoadTarget`: what a recovery load or ``load_checkpoint`` restores into.

:class:`Engine` is all three; our adapters (:class:`~areal_ckpt.engines.TorchEngine`,
:class:`~areal_ckpt.engines.DeepSpeedEngine`) implement it, and adding an engine (Megatron, a
new AReaL engine) means implementing it. What callers may pass where an engine is expected
(:data:`EngineLike`) is adapted to an Engine by :mod:`areal_ckpt.engines.accept`.

The rest describes AReaL's objects that a load drives after restoring the weights (the
rollout server, the weight update), as far as a load uses them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.hf_export import ExportPlan, FolderFiles, TensorSource
from areal_ckpt.tensors import TensorSpec

P = TypeVar("P")

#: One dump's tensors by flat name (``model.<fqn>``, ``optim.<fqn>.<key>``...), and the
#: engine's JSON-able rest (param groups, scheduler, counters): its ``engine_state``.
EngineState = dict[str, Any]


@runtime_checkable
class ExportSource(TensorSource, Protocol):
    """What an HF export reads from an engine (or from a checkpoint read as one): the tensors
    (:class:`~areal_ckpt.formats.hf_export.TensorSource`), their specs, and the model's config."""

    @property
    def config(self) -> Any: ...  # the model's transformers PretrainedConfig; None: no HF export

    @property
    def generation_config(self) -> Any | None: ...  # its GenerationConfig, when it generates

    @property
    def architecture(self) -> str: ...  # the class name config.json records

    @property
    def on_accelerator(self) -> bool: ...  # weights off the CPU: auto mode saves asynchronously

    def export_specs(self) -> list[TensorSpec]: ...


@runtime_checkable
class SelfPlannedExport(ExportSource, Protocol):
    """An export source that lays out its own folder (a PEFT model's adapter files) instead of
    one HF model's shards: its file plan, its non-tensor files, and its own loadability check."""

    def plan(self, max_shard_size: int, dtype: torch.dtype | None) -> ExportPlan: ...

    def folder_files(
        self, dtype: torch.dtype | None, tokenizer: Any | None, processor: Any | None, assets: str | None
    ) -> FolderFiles: ...

    def check(self, where: str) -> None: ...  # CheckpointError naming where if it would not load


@dataclass(frozen=True)
class CheckpointOptions:
    """How ``save_checkpoint`` treats an engine: DeepSpeed's ``checkpoint`` config section."""

    tag_validation: str = "Fail"  # ranks that pass different tags: "Ignore", "Warn" or "Fail"
    node_local_storage: bool = False  # each node saves to a save_dir of its own


@runtime_checkable
class DumpSource(Protocol):
    """What a recovery dump (and ``save_checkpoint``) captures from an engine."""

    module: nn.Module  # the unwrapped model, for its parameters' requires_grad

    @property
    def has_optimizer(self) -> bool: ...  # False for a model nothing trains (a reference policy)

    def recover_state(self, include_optimizer: bool) -> tuple[dict[str, torch.Tensor], EngineState]: ...

    def fingerprint(self) -> list[int]: ...  # changes whenever a weight changes (frozen models)

    def step_counter(self) -> int | None: ...  # the engine's own global step, None if it keeps none

    def checkpoint_options(self) -> CheckpointOptions: ...  # how save_checkpoint treats it


@runtime_checkable
class LoadTarget(Protocol):
    """What a recovery load (and ``load_checkpoint``) restores into."""

    optimizer: Any  # a torch optimizer, DeepSpeed's wrapper, or None
    lr_scheduler: Any  # anything with state_dict / load_state_dict, or None

    def recover_template(
        self, with_optimizer_tensors: bool, stored: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
    ) -> dict[str, torch.Tensor]: ...

    def validate_recover_state(self, engine_state: EngineState, include_optimizer: bool) -> None: ...

    def load_recover_state(
        self, tensors: dict[str, torch.Tensor], engine_state: EngineState, include_optimizer: bool, strict: bool = True
    ) -> None: ...


@runtime_checkable
class Engine(ExportSource, DumpSource, LoadTarget, Protocol):
    """An engine: exported, dumped and loaded (see each Protocol for the meaning of a member)."""


@runtime_checkable
class ModelHolder(Protocol):
    """An AReaL-shaped engine: a torch model as ``.model``; ``.optimizer`` and ``.lr_scheduler``
    are read when present (None otherwise)."""

    model: nn.Module


@runtime_checkable
class DeepSpeedLike(Protocol):
    """What :class:`~areal_ckpt.engines.DeepSpeedEngine` reads of ``deepspeed.initialize``'s engine."""

    module: nn.Module
    optimizer: Any
    lr_scheduler: Any
    global_steps: int
    device: torch.device

    def zero_optimization_stage(self) -> int: ...

    def checkpoint_tag_validation_enabled(self) -> bool: ...

    def checkpoint_tag_validation_fail(self) -> bool: ...

    def use_node_local_storage(self) -> bool: ...

    def zero_offload_optimizer(self) -> Any: ...  # DeepSpeed's offload config (.device), or None

    def zero_offload_param(self) -> Any: ...

    def load_checkpoint(self, load_dir: str, **options: Any) -> tuple[str | None, Any]: ...  # DeepSpeed's own layout


#: Anything accepted where an engine is expected (see :func:`areal_ckpt.engines.accept.as_engine`).
EngineLike = Engine | ModelHolder | DeepSpeedLike
#: One engine, or several by model name (``{"actor": ..., "ref": ...}``).
EnginesLike = EngineLike | Mapping[str, EngineLike]


# -- an RL trainer's rollout server, updated after a load (AReaL's load(inference_engine=...)) ---


@runtime_checkable
class WeightUpdateMeta(Protocol):
    """AReaL's WeightUpdateMeta: how weights travel to the rollout server; ``type`` names the
    transport (``disk``, ``xccl``, ``awex``)."""

    type: str

    def with_version(self, version: int) -> WeightUpdateMeta: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """AReaL's InferenceEngine, as far as a load uses it."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def set_version(self, version: int) -> None: ...


@runtime_checkable
class ColocatedRolloutEngine(RolloutEngine, Protocol):
    """A rollout engine sharing devices with training (AReaL's AWEX colocation): it releases
    its memory before the checkpoint is loaded."""

    def pause_generation_sync(self) -> None: ...

    def offload(self, tags: list[str]) -> None: ...


@runtime_checkable
class WeightSource(Protocol):
    """AReaL's TrainEngine, as far as it pushes its weights to a rollout engine."""

    def connect_engine(self, engine: RolloutEngine, meta: WeightUpdateMeta) -> None: ...

    def update_weights(self, meta: WeightUpdateMeta) -> None: ...

    def set_version(self, version: int) -> None: ...


_MEMBERS: dict[type, str] = {
    WeightUpdateMeta: "type, with_version(version)",
    RolloutEngine: "pause(), resume(), set_version(version)",
    ColocatedRolloutEngine: "pause(), resume(), set_version(version), pause_generation_sync(), offload(tags=...)",
    WeightSource: "connect_engine(engine, meta), update_weights(meta), set_version(version)",
}


def require(obj: object, protocol: type[P], what: str) -> P:
    """``obj``, typed as ``protocol``; raises CheckpointError naming ``what`` and the members
    ``protocol`` asks for unless ``obj`` implements it. Pure."""
    if not isinstance(obj, protocol):
        raise CheckpointError(f"{what}: {type(obj).__name__} must provide {_MEMBERS[protocol]}")
    return obj
