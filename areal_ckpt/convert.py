"""Turn a recovery checkpoint (DCP shards) into a HuggingFace export folder, offline."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable

import torch

from areal_ckpt.commit import check_files, read_manifest
from areal_ckpt.errors import CheckpointError
from areal_ckpt.export import ExportResult, write_export
from areal_ckpt.formats.dcp_source import DcpModelSource, load_tokenizer
from areal_ckpt.layout import HF_FILES, RECOVER_MANIFEST
from areal_ckpt.recover_store import resolve_recovery

logger = logging.getLogger("areal_ckpt.convert")


def export_recovery(
    path: Path, out_dir: Path, name: str | None = None, dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9, progress: Callable[[Iterable[int]], Iterable[int]] = iter,
) -> ExportResult:
    """Write model ``name`` of the recovery checkpoint at ``path`` as an HF folder ``out_dir``.

    Local, single process, blocking; verifies the model's files against the manifest first,
    streams one output shard at a time, and publishes ``out_dir`` atomically. Refuses to
    replace an existing ``out_dir``.
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
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir}: already exists; choose a new output folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    source = DcpModelSource(generation / model, generation / model / HF_FILES)
    step = manifest.get("step", {})
    logger.info("exporting model %r of %s (global step %s) to %s", model, generation, step.get("global_step"), out_dir)
    return write_export(
        source, out_dir, max_shard_size=max_shard_size, dtype=dtype,
        tokenizer=load_tokenizer(generation / model / HF_FILES),
        header={"name": model, "step": step, "converted_from": str(generation)}, progress=progress,
    )
