"""An HF export is only as good as its names: exactly the tensors ``from_pretrained`` loads.

transformers' ``from_pretrained`` only warns about checkpoint keys it does not know and model
keys it does not find, and runs with those weights randomly initialised. So before an export
is written, its tensor names are held against the model class it names (built on the meta
device: no memory, no weights), and a mismatch is an error, not a folder that loads garbage.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from areal_ckpt.errors import CheckpointError

_SHOWN = 5
_REMEMBERED = 16  # model configs whose loadable names are kept (a run exports one or a few)
_LOADABLE: dict[tuple[str, str], tuple[frozenset[str], frozenset[str]]] = {}


def architecture_of(config: Any) -> str:
    """The model class name ``config`` records (``architectures``), else the causal-LM class
    transformers maps its type to, else the config's own class name. Pure."""
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return str(architectures[0])
    mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(getattr(config, "model_type", "")))
    return mapped if isinstance(mapped, str) else type(config).__name__


def loadable_names(config: Any, architecture: str) -> tuple[set[str], set[str]] | None:
    """(the names ``from_pretrained`` of ``architecture`` loads for ``config``, the tied ones among
    them that an export may leave out), or None when ``architecture`` is no transformers model
    class. Local; builds the model on the meta device once per (architecture, config as JSON):
    every export of a run asks again, and the build costs tens of milliseconds of the loop."""
    cls = getattr(transformers, architecture, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return None
    key = (architecture, config.to_json_string(use_diff=False))
    if key not in _LOADABLE:
        if len(_LOADABLE) >= _REMEMBERED:
            _LOADABLE.clear()
        _LOADABLE[key] = _built_names(cls, config)
    names, tied = _LOADABLE[key]
    return set(names), set(tied)


def _built_names(cls: type[Any], config: Any) -> tuple[frozenset[str], frozenset[str]]:
    with torch.device("meta"):
        model = cls._from_config(config)
    return frozenset(model.state_dict()), frozenset(getattr(model, "all_tied_weights_keys", None) or {})


def check_loadable(config: Any, architecture: str, names: Iterable[str], where: str) -> None:
    """Raise CheckpointError naming ``where`` unless ``architecture`` is a transformers model
    class whose ``from_pretrained`` loads exactly ``names`` (tied duplicates, and keys the class
    itself says to ignore, may be missing). Local, pure apart from building the meta model."""
    found = loadable_names(config, architecture)
    if found is None:
        raise CheckpointError(
            f"{where}: {architecture} is not a transformers model class, so from_pretrained could not load this "
            "export (a wrapper, such as a PEFT / LoRA model?). Export the transformers model itself; for LoRA, "
            "merge the adapters into it first (model.merge_and_unload()) and pass the merged model"
        )
    expected, tied = found
    exported = set(names)
    cls = getattr(transformers, architecture)
    missing = {name for name in expected - exported - tied if not _ignored(cls._keys_to_ignore_on_load_missing, name)}
    unknown = {name for name in exported - expected if not _ignored(cls._keys_to_ignore_on_load_unexpected, name)}
    if missing or unknown:
        raise CheckpointError(
            f"{where}: from_pretrained of {architecture} would not load this export: {len(unknown)} tensor(s) it does "
            f"not know ({_few(unknown)}) and {len(missing)} it expects missing ({_few(missing)}), which would be "
            "randomly initialised. Export the transformers model itself, not a wrapper around it"
        )


def _ignored(patterns: Iterable[str] | None, name: str) -> bool:
    return any(re.search(pattern, name) for pattern in patterns or ())


def _few(names: set[str]) -> str:
    shown = sorted(names)[:_SHOWN]
    return ", ".join(shown) + (", ..." if len(names) > _SHOWN else "") if shown else "none"
