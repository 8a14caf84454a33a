"""What a dump records of a PEFT (LoRA...) model, and the check a load makes against it.

A dump of a PEFT model stores each adapter's configuration beside the engine state, so that a
load onto a model built with another LoRA configuration (rank, alpha, target modules...) is
refused naming both, before any tensor is read, instead of failing deep inside DCP on a shape
or silently leaving adapters out; and so that an export from the dump can rebuild the model's
layout. ``peft`` is optional: without it installed no model is a PEFT model.
"""

from __future__ import annotations

import enum
import importlib.util
from typing import Any

import torch
from torch import nn

from areal_ckpt.errors import CheckpointError

#: Fields of an adapter's configuration that do not change what it computes or stores.
_IRRELEVANT = frozenset({"inference_mode", "base_model_name_or_path", "revision", "runtime_config"})


def peft_model_of(module: nn.Module | None) -> Any | None:
    """``module`` when it is a ``peft.PeftModel`` (also under FSDP2), else None; local."""
    if module is None or importlib.util.find_spec("peft") is None:
        return None
    from peft import PeftModel

    return module if isinstance(module, PeftModel) else None


def adapter_configs(module: nn.Module | None) -> dict[str, dict[str, Any]] | None:
    """``{adapter name: its configuration as plain JSON data}`` of a PEFT model, else None; local."""
    model = peft_model_of(module)
    if model is None:
        return None
    return {name: _plain(config.to_dict()) for name, config in model.peft_config.items()}


def active_adapters(module: nn.Module | None) -> list[str] | None:
    """The adapters a PEFT model computes with (what a merge adds into the base), else None; local."""
    model = peft_model_of(module)
    return None if model is None else list(model.active_adapters)


def peft_model_on_meta(config: Any, adapters: dict[str, dict[str, Any]], active: list[str] | None) -> Any:
    """A PEFT model with the layout a dump recorded (the causal LM of the HF ``config`` with
    ``adapters`` as :func:`adapter_configs` gave them, ``active`` ones switched on), built on
    the meta device: names, shapes and LoRA scales, no memory. CheckpointError when peft is
    not installed or a configuration does not build. Local."""
    if importlib.util.find_spec("peft") is None:
        raise CheckpointError("this checkpoint holds a PEFT model; install peft to export it")
    import peft
    from transformers import AutoModelForCausalLM

    configs: Any = peft.PeftConfig  # untyped in peft
    names = sorted(adapters, key=lambda name: name != "default")
    try:
        with torch.device("meta"):
            model: Any = peft.get_peft_model(
                AutoModelForCausalLM.from_config(config),
                configs.from_peft_type(**adapters[names[0]]),
                adapter_name=names[0],
            )
            for name in names[1:]:
                model.add_adapter(name, configs.from_peft_type(**adapters[name]))
        for name in names:  # peft names the base it was given (here the checkpoint's config folder)
            model.peft_config[name].base_model_name_or_path = adapters[name].get("base_model_name_or_path")
        if active:
            model.base_model.set_adapter(active)
    except (TypeError, ValueError, KeyError) as error:
        raise CheckpointError(f"the recorded adapter configurations {sorted(adapters)} do not build: {error}") from None
    return model


def check_same_adapters(stored: dict[str, Any] | None, live: dict[str, dict[str, Any]] | None) -> None:
    """Raise ValueError naming both configurations unless a dump's adapters (``stored``, as
    :func:`adapter_configs` recorded them) are the live model's; pure."""
    if stored is None and live is None:
        return
    if live is None:
        raise ValueError(
            f"the checkpoint holds a PEFT model with adapters {sorted(stored or {})}, this model is not one"
        )
    if stored is None:
        raise ValueError(f"this model is a PEFT model with adapters {sorted(live)}, the checkpoint holds none")
    if sorted(stored) != sorted(live):
        raise ValueError(f"the checkpoint has the adapters {sorted(stored)}, this model {sorted(live)}")
    for name in sorted(stored):
        ours, theirs = _relevant(stored[name]), _relevant(live[name])
        if ours != theirs:
            differ = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
            shown = ", ".join(f"{key}: {ours.get(key)!r} in the checkpoint, {theirs.get(key)!r} here" for key in differ)
            raise ValueError(
                f"adapter {name!r} was saved with another configuration ({shown}); the checkpoint's: "
                f"{ours}; this model's: {theirs}. Build the model with the checkpoint's configuration"
            )


def _relevant(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key not in _IRRELEVANT}


def _plain(value: Any) -> Any:
    """``value`` as JSON data: enums by value, sets as sorted lists, tuples as lists."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, set | frozenset):
        return sorted((_plain(item) for item in value), key=repr)
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)
