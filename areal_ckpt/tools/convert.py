"""Turn training checkpoints into HuggingFace export folders, offline: a recovery checkpoint
(DCP), or a DeepSpeed checkpoint (ours from ``save_checkpoint``, or DeepSpeed's own layout)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from areal_ckpt.engines.contract import ExportSource
from areal_ckpt.engines.peft_configs import peft_model_on_meta
from areal_ckpt.engines.peft_export import PeftExport
from areal_ckpt.errors import CheckpointError
from areal_ckpt.export.job import ExportResult, write_export
from areal_ckpt.formats.dcp_source import DcpModelSource, tied_names
from areal_ckpt.formats.deepspeed_pickles import weights_only_deepspeed_loads
from areal_ckpt.formats.hf_export import names_of_rank
from areal_ckpt.formats.hf_keys import architecture_of
from areal_ckpt.formats.stock_dcp import StockDcpModelSource
from areal_ckpt.generations.store import resolve_recovery
from areal_ckpt.paths import HF_FILES, LATEST, MANIFEST_NAME, RECOVER_MANIFEST, TAGGED_FORMAT
from areal_ckpt.publish import check_files, read_manifest
from areal_ckpt.storage.folder_location import FolderLocation
from areal_ckpt.storage.pointers import PointerFile
from areal_ckpt.tensors import TensorSpec
from areal_ckpt.tools.offline_zero_to_fp32 import ConversionError, committed_folder

logger = logging.getLogger(__name__)


def export_recovery(
    path: Path,
    out_dir: Path,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
    config_from: Path | None = None,
    lora: str = "adapter",
) -> ExportResult:
    """Write model ``name`` of the recovery checkpoint at ``path`` as an HF folder ``out_dir``
    (for a PEFT model: its adapter folder(s), merged model, or both, as ``lora`` says and as
    the Saver writes them, see docs/lora.md).

    Local, single process, blocking; verifies the model's files against the manifest first,
    streams one output shard at a time, and publishes ``out_dir`` atomically. Refuses to
    replace an existing ``out_dir``. The config, tokenizer and other files come from
    ``config_from`` when given, else from what the dump recorded (nothing, for a plain
    ``nn.Module``: then ``config_from`` is needed).
    """
    generation, named = resolve_recovery(path)
    manifest = read_manifest(generation, RECOVER_MANIFEST)
    models = manifest.get("models", [])
    model = name or named or (models[0] if len(models) == 1 else None)
    if model is None:
        raise CheckpointError(f"{generation}: holds models {models}; choose one with --name")
    if model not in models:
        raise CheckpointError(f"{generation}: has no model {model!r} (it holds {models})")
    files = manifest["files"]
    problems = check_files(generation, files, [f for f in files if f.startswith(f"{model}/")])
    if problems:
        raise CheckpointError(f"{generation}: model {model!r} is damaged: " + "; ".join(problems))
    hf_folder = Path(config_from) if config_from is not None else generation / model / HF_FILES
    checkpoint = DcpModelSource(generation / model, hf_folder)
    source: ExportSource = checkpoint
    if checkpoint.adapters is not None:  # a PEFT model: laid out as the Saver lays it out
        layout = peft_model_on_meta(checkpoint.config, checkpoint.adapters, checkpoint.active_adapters)
        source = PeftExport(checkpoint, layout, lora, None)
    out_dir = _new_output(out_dir)
    step = manifest.get("step", {})
    logger.info("exporting model %r of %s (global step %s) to %s", model, generation, step.get("global_step"), out_dir)
    return write_export(
        source,
        out_dir,
        max_shard_size=max_shard_size,
        dtype=dtype,
        assets=str(hf_folder),  # config, tokenizer, processor, base model files
        header={"name": model, "step": step, "converted_from": str(generation)},
        progress=progress,
    )


def export_stock_dcp(
    folder: Path,
    out_dir: Path,
    config_from: Path | None,
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
) -> ExportResult:
    """Write the model held by a stock DCP folder (``dcp.save``'s own format: AReaL's
    ``recover_checkpoint``, a torchtitan step) as an HF folder ``out_dir``; local, single
    process, blocking. Its config, tokenizer and other non-weight files come from
    ``config_from`` (e.g. the base model folder), which stock DCP does not record. The model's
    tensors are found under whatever key prefix holds all of them (``model.``, ``app.model.``...).
    Nothing in the folder can run code (see :mod:`areal_ckpt.formats.stock_dcp`)."""
    from transformers import AutoConfig

    if config_from is None or not (Path(config_from) / "config.json").is_file():
        raise CheckpointError(
            f"{folder}: a stock DCP checkpoint records no model config: pass --config-from with "
            "the model's HF folder (e.g. the base model)"
        )
    config = AutoConfig.from_pretrained(config_from, local_files_only=True)
    with torch.device("meta"):
        names = list(AutoModelForCausalLM.from_config(config).state_dict())
    tied = tied_names(config)
    source = StockDcpModelSource(folder, config, [n for n in names if n not in tied], architecture_of(config))
    header = {"name": "default", "step": None, "converted_from": str(folder)}
    return write_export(
        source,
        _new_output(out_dir),
        max_shard_size=max_shard_size,
        dtype=dtype,
        assets=str(config_from),
        header=header,
        progress=progress,
    )


def _new_output(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir}: already exists; choose a new output folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return out_dir


class _StateDictSource:
    """Full tensors in memory (a converted DeepSpeed checkpoint) plus the model's HF config."""

    def __init__(self, config: Any, tensors: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.generation_config = None
        self.architecture = architecture_of(config)
        self.on_accelerator = False
        tied = tied_names(config)
        self.tensors = {name: tensor for name, tensor in tensors.items() if name not in tied}

    def export_specs(self) -> list[TensorSpec]:
        """Every tensor's name, shape and dtype."""
        return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in self.tensors.items()]

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each name of this rank's entry of ``files`` with its tensor; local, no copy."""
        for name in names_of_rank(files):
            yield name, self.tensors[name]


def zero0_module_states(folder: Path) -> dict[str, torch.Tensor] | None:
    """The weights of a DeepSpeed ZeRO-0 checkpoint (its ``mp_rank_00_model_states.pt['module']``,
    where ``zero_to_fp32`` cannot look: that tool handles ZeRO 1-3 only); None for ZeRO 1-3.
    Read with the weights-only unpickler (the caller's context)."""
    model_states = folder / "mp_rank_00_model_states.pt"
    if not model_states.is_file():
        return None
    state = torch.load(model_states, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("param_shapes") is not None:  # ZeRO 1-3 record their partitions
        return None
    module = state.get("module")
    if not isinstance(module, dict) or not all(isinstance(t, torch.Tensor) for t in module.values()):
        raise CheckpointError(f"{model_states}: holds no 'module' state dict of tensors")
    logger.info("reading the weights of ZeRO-0 checkpoint %s from %s", folder, model_states.name)
    return dict(module)


def tag_folder(ds_dir: Path, tag: str | None) -> Path:
    """The folder of checkpoint ``tag`` in ``ds_dir`` (None: the one ``latest`` names), ours or
    DeepSpeed's own; in a save_dir copied from object storage, the folder its commit log names
    for them. CheckpointError naming what is missing. Local, read-only."""
    try:
        committed = committed_folder(ds_dir, tag)  # a save_dir copied from object storage
    except ConversionError as error:
        raise CheckpointError(str(error)) from None
    tag = committed or tag or FolderLocation(ds_dir, PointerFile(LATEST)).pointed()
    if tag is None:
        raise CheckpointError(f"{ds_dir}: no 'latest' file; name the checkpoint with --tag")
    folder = ds_dir / tag
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint tag")
    return folder


def is_ours(folder: Path) -> bool:
    """True when the tag ``folder`` was written by ``areal_ckpt.save_checkpoint`` (it has our
    manifest), False for DeepSpeed's own layout; read-only."""
    return (folder / MANIFEST_NAME).is_file()


def tagged_model(folder: Path, hf_folder: Path | None) -> DcpModelSource:
    """The model of our tag ``folder``, its files checked against the manifest first (see
    :class:`DcpModelSource` for ``hf_folder``); CheckpointError naming a damaged file. Local."""
    manifest = read_manifest(folder, MANIFEST_NAME)
    if manifest.get("format") != TAGGED_FORMAT:
        raise CheckpointError(
            f"{folder / MANIFEST_NAME}: format {manifest.get('format')!r} is not a DeepSpeed-shaped checkpoint"
        )
    problems = check_files(folder, manifest["files"], [name for name in manifest["files"] if name.startswith("model/")])
    if problems:
        raise CheckpointError(f"{folder}: damaged: " + "; ".join(problems))
    return DcpModelSource(folder / "model", hf_folder)


def export_deepspeed(
    ds_dir: Path,
    out_dir: Path,
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    config_dir: Path | None = None,
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
) -> ExportResult:
    """Write the DeepSpeed checkpoint ``ds_dir/tag`` (``tag`` None: what ``latest`` names) as an
    HF folder ``out_dir``; local, single process, blocking; ``out_dir`` must not exist.

    Our layout (``areal_ckpt.save_checkpoint``) streams one output shard at a time and takes
    config.json from ``config_dir`` when given, else from the checkpoint (which has none for a
    plain ``nn.Module``). DeepSpeed's own layout is rebuilt to full fp32 tensors by
    DeepSpeed's ``zero_to_fp32`` (all in memory, as that tool does), read with the weights-only
    unpickler; its config.json comes from ``config_dir`` (default: ``ds_dir``).
    """
    folder = tag_folder(Path(ds_dir), tag)
    tag = folder.name
    if is_ours(folder):
        hf_folder = Path(config_dir) if config_dir is not None else folder / "model" / HF_FILES
        source: Any = tagged_model(folder, hf_folder)
        header = {"name": "default", "step": {"tag": tag}, "converted_from": str(folder)}
        return write_export(
            source,
            _new_output(out_dir),
            max_shard_size=max_shard_size,
            dtype=dtype,
            assets=str(hf_folder),
            header=header,
            progress=progress,
        )
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig

    config_dir = Path(config_dir) if config_dir is not None else ds_dir
    if not (config_dir / "config.json").is_file():
        raise CheckpointError(
            f"{config_dir / 'config.json'}: missing; DeepSpeed checkpoints hold no model "
            "config: pass --config with the model's HF folder"
        )
    config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
    with weights_only_deepspeed_loads():
        tensors = zero0_module_states(folder)
        if tensors is None:
            logger.info("rebuilding full fp32 weights of %s with DeepSpeed's zero_to_fp32", folder)
            tensors = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=tag)
    header = {"name": "default", "step": {"tag": tag}, "converted_from": str(folder)}
    return write_export(
        _StateDictSource(config, dict(tensors)),
        _new_output(out_dir),
        max_shard_size=max_shard_size,
        dtype=dtype,
        header=header,
        progress=progress,
    )
