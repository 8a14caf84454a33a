"""TorchEngine: a transformers model (plain, DDP- or FSDP2-wrapped) with its optimizer and scheduler."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from areal_ckpt.engines.contract import CheckpointOptions
from areal_ckpt.engines.gather import round_of_files
from areal_ckpt.engines.peft_configs import active_adapters, adapter_configs, check_same_adapters
from areal_ckpt.paths import MODEL_PREFIX, OPTIM_PREFIX
from areal_ckpt.tensors import TensorSpec, local_crc32


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose state-dict keys match the HF checkpoint: strips DDP and torch.compile."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def original_class(module: nn.Module) -> type:
    """The model's own class (FSDP2's ``fully_shard`` swaps in a subclass named ``FSDP<Name>``)."""
    for cls in type(module).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls
    return type(module)


class TorchEngine:
    """What the Saver and RecoverHandler need from a torch training setup.

    ``model`` is any ``nn.Module``, optionally wrapped in DDP, compiled, or sharded with FSDP2
    ``fully_shard``; recovery needs nothing more. An HF export also needs a transformers
    ``PreTrainedModel`` (its ``.config``); a plain module's export is refused by name.
    Construction is local; :meth:`gather_round` is collective when the model is sharded.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.module = unwrap_model(model)

    @property
    def on_accelerator(self) -> bool:
        """True when the weights live off the CPU (e.g. CUDA): ``auto`` mode then saves asynchronously."""
        return any(p.device.type not in ("cpu", "meta") for p in self.module.parameters())

    @property
    def is_sharded(self) -> bool:
        """True when parameters are DTensors (FSDP2): gathering them is collective."""
        return any(isinstance(p, DTensor) for p in self.module.parameters())

    @property
    def config(self) -> Any:
        """The model's ``PretrainedConfig``; None for a plain ``nn.Module``."""
        return getattr(self.module, "config", None)

    @property
    def generation_config(self) -> Any | None:
        """The model's ``GenerationConfig`` when it generates, else None."""
        can_generate = getattr(self.module, "can_generate", None)
        if can_generate is None or not can_generate():
            return None
        return getattr(self.module, "generation_config", None)

    @property
    def architecture(self) -> str:
        """Class name recorded in ``config.json`` ``architectures``."""
        return original_class(self.module).__name__

    def _export_state(self) -> dict[str, torch.Tensor]:
        state = self.module.state_dict()
        tied = getattr(self.module, "all_tied_weights_keys", None) or {}
        return {name: tensor for name, tensor in state.items() if name not in tied}

    def export_specs(self) -> list[TensorSpec]:
        """Every exported tensor's name, full shape and dtype, in state-dict order; local.

        Tied duplicates (e.g. ``lm_head.weight`` tied to the embeddings) are left out, as
        ``save_pretrained`` does; ``from_pretrained`` re-ties them.
        """
        return [
            TensorSpec(name=name, shape=tuple(tensor.shape), dtype=tensor.dtype)
            for name, tensor in self._export_state().items()
        ]

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full tensor, on the model's device)`` for each tensor of ``files[rank]``,
        in order (nothing when ``files`` has no entry for this rank); ``files[i]`` is what rank
        ``i`` writes.

        Collective when :attr:`is_sharded`: every rank passes the same ``files`` and exhausts
        the iterator; each step makes one tensor of every file whole on its owner alone (see
        :mod:`areal_ckpt.engines.gather`). Local otherwise, and then no tensor is copied.
        """
        return round_of_files(files, self._export_state())

    # -- recovery: full training state through DCP ------------------------------------------

    @property
    def has_optimizer(self) -> bool:
        """False when nothing trains this model (no optimizer): e.g. a reference policy."""
        return self.optimizer is not None

    def step_counter(self) -> int | None:
        """None: a torch training setup keeps no global step counter of its own."""
        return None

    def checkpoint_options(self) -> CheckpointOptions:
        """The defaults: ranks that pass ``save_checkpoint`` different tags are refused."""
        return CheckpointOptions()

    def recover_state(self, include_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's state for a dump: flat tensors and the non-tensor rest; local.

        Tensors are ``{"model.<fqn>" | "optim.<fqn>.<key>": tensor}``, the live ones (DTensors
        under FSDP2), not copies. The rest holds optimizer param groups and scalar entries and
        the LR scheduler, and a PEFT model's adapter configurations. An optimizer without state (stateless, or never stepped) contributes
        only its param groups: asking torch for its state dict would first allocate a zero
        gradient for every parameter, a hidden full copy of the model.
        """
        tensors = {MODEL_PREFIX + name: value for name, value in self._model_state().items()}
        engine_state: dict[str, Any] = {}
        if include_optimizer and self.optimizer is not None:
            engine_state["optimizer_has_state"] = bool(self.optimizer.state)
            if self.optimizer.state:
                optim_state: dict[str, Any] = get_optimizer_state_dict(self.model, self.optimizer)
                engine_state["optimizer_param_groups"] = optim_state["param_groups"]
                engine_state["optimizer_scalars"] = {}
                for fqn, entries in optim_state["state"].items():
                    engine_state["optimizer_scalars"][fqn] = {}
                    for key, value in entries.items():
                        if isinstance(value, torch.Tensor):
                            tensors[f"{OPTIM_PREFIX}{fqn}.{key}"] = value
                        else:
                            engine_state["optimizer_scalars"][fqn][key] = value
            else:
                engine_state["optimizer_param_groups"] = self._param_groups_by_name()
                engine_state["optimizer_scalars"] = {}
        if self.lr_scheduler is not None:
            engine_state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if (adapters := adapter_configs(self.module)) is not None:
            engine_state["peft"] = adapters
            engine_state["peft_active"] = active_adapters(self.module)
        return tensors, engine_state

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The model's live state tensors under their HF names (DTensors under FSDP2); local.

        For the layouts this engine accepts (plain, DDP, torch.compile, FSDP2) this is exactly
        what ``get_model_state_dict`` returns, same keys and same tensors (tested), without that
        helper re-verifying its options on every call (docs/benchmarks.md, "Reading and capturing state").
        """
        return self.module.state_dict()

    def _param_groups_by_name(self) -> list[dict[str, Any]]:
        names = {id(parameter): name for name, parameter in self.module.named_parameters()}
        return [
            {
                **{key: value for key, value in group.items() if key != "params"},
                "params": [names[id(parameter)] for parameter in group["params"]],
            }
            for group in (self.optimizer.param_groups if self.optimizer is not None else [])
        ]

    def is_own_memory(self, model_state: dict[str, torch.Tensor]) -> bool:
        """True when ``model_state`` is the unsharded model's own memory (the template a load
        filled in place): copying it onto itself would only cost a pass over the model. Local."""
        if self.is_sharded:
            return False
        live = self.module.state_dict()
        return live.keys() == model_state.keys() and all(
            live[name].data_ptr() == tensor.data_ptr() and live[name].shape == tensor.shape
            for name, tensor in model_state.items()
        )

    def _load_param_groups_by_name(self, stored: list[dict[str, Any]]) -> None:
        """Restore hyperparameters saved by :meth:`_param_groups_by_name` (an optimizer without
        state: nothing else to load, and no zero gradients allocated to find that out)."""
        names = {id(parameter): name for name, parameter in self.module.named_parameters()}
        if self.optimizer is None:
            return
        groups = self.optimizer.param_groups
        if len(groups) != len(stored):
            raise ValueError(f"optimizer has {len(groups)} parameter groups, the checkpoint {len(stored)}")
        for index, (group, saved) in enumerate(zip(groups, stored)):
            if [names[id(parameter)] for parameter in group["params"]] != saved["params"]:
                raise ValueError(f"parameter group {index} holds other parameters than in the checkpoint")
            group.update({key: value for key, value in saved.items() if key != "params"})

    def recover_template(
        self, with_optimizer_tensors: bool, stored: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
    ) -> dict[str, torch.Tensor]:
        """The live tensors a load fills in place (same keys as :meth:`recover_state`); local.

        With ``with_optimizer_tensors`` the optimizer's state is initialized first if it is
        empty. ``stored`` (the checkpoint's tensor index) is not needed here.
        """
        tensors = {MODEL_PREFIX + name: value for name, value in self._model_state().items()}
        if with_optimizer_tensors and self.optimizer is not None:
            optim_state: dict[str, Any] = get_optimizer_state_dict(self.model, self.optimizer)
            for fqn, entries in optim_state["state"].items():
                for key, value in entries.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"{OPTIM_PREFIX}{fqn}.{key}"] = value
        return tensors

    def validate_recover_state(self, engine_state: dict[str, Any], include_optimizer: bool) -> None:
        """Raise ValueError when ``engine_state`` (a dump's non-tensor state) cannot be applied
        here: written by DeepSpeed, or by a PEFT model with other adapters. Local."""
        if "deepspeed" in engine_state:
            raise ValueError("written by a DeepSpeed engine; load it with areal_ckpt.DeepSpeedEngine")
        check_same_adapters(engine_state.get("peft"), adapter_configs(self.module))

    def load_recover_state(
        self,
        tensors: dict[str, torch.Tensor],
        engine_state: dict[str, Any],
        include_optimizer: bool,
        strict: bool = True,
    ) -> None:
        """Apply state loaded into the :meth:`recover_template` tensors plus ``engine_state`` (the LR
        scheduler's state when ``engine_state`` holds it). ``strict`` False tolerates model keys that
        were not loaded. Collective under FSDP2 / DDP (the state-dict helpers synchronize).
        """
        model_state: dict[str, Any] = {
            k[len(MODEL_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)
        }
        if not self.is_own_memory(model_state):
            set_model_state_dict(self.model, model_state, options=StateDictOptions(strict=strict))
        if include_optimizer and self.optimizer is not None and not engine_state.get("optimizer_has_state", True):
            self._load_param_groups_by_name(engine_state["optimizer_param_groups"])
        elif include_optimizer and self.optimizer is not None:
            state: dict[str, Any] = {fqn: dict(scalars) for fqn, scalars in engine_state["optimizer_scalars"].items()}
            for key, value in tensors.items():
                if key.startswith(OPTIM_PREFIX):
                    fqn, _, entry = key[len(OPTIM_PREFIX) :].rpartition(".")
                    state.setdefault(fqn, {})[entry] = value
            set_optimizer_state_dict(
                self.model, self.optimizer, {"state": state, "param_groups": engine_state["optimizer_param_groups"]}
            )
        if self.lr_scheduler is not None and "lr_scheduler" in engine_state:
            self.lr_scheduler.load_state_dict(engine_state["lr_scheduler"])

    def fingerprint(self) -> list[int]:
        """CRC-32 of each of this rank's weight tensors, to skip rewriting unchanged frozen models.

        Local; one read of this rank's weights, no copy (except of tensors off the CPU).
        """
        return [local_crc32(value) for value in self._model_state().values()]
