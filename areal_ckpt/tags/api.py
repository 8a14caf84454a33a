"""DeepSpeed-shaped checkpoints: ``save_checkpoint`` / ``load_checkpoint`` with tags and ``latest``.

For code that already calls ``engine.save_checkpoint(save_dir, tag, client_state)``: the same
call shape and semantics, with our guarantees. Layout::

    {save_dir}/latest                        the newest committed tag (one line of text)
    {save_dir}/zero_to_fp32.py               offline converter to a full fp32 state dict (torch +
                                             safetensors only), as DeepSpeed places its own
    {save_dir}/{tag}/model/...               DCP data files, dcp_metadata.json, engine_state.json,
                                             hf/config.json
    {save_dir}/{tag}/client_state/rank{r}.json   each rank's own client_state (JSON)
    {save_dir}/{tag}/areal_ckpt_manifest.json    sizes and CRC-32 of every file

A tag folder is written under a staging name and renamed into place whole; ``latest`` is then
replaced by renaming a new file over it (never rewritten in place), so it always names a
complete tag. Nothing here takes the trial lock: ``save_dir`` is the caller's. A ``save_dir``
on object storage (``s3://bucket/prefix``) is committed there by a create-only record instead
of renames (:mod:`areal_ckpt.tags.save_dir`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from areal_ckpt import agree, dist
from areal_ckpt._version import __version__
from areal_ckpt.config import check_path_component
from areal_ckpt.engines.accept import as_engine, export_files
from areal_ckpt.engines.contract import Engine, EngineLike
from areal_ckpt.engines.deepspeed_engine import DeepSpeedEngine
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_save import save_tensors
from areal_ckpt.formats.deepspeed_pickles import check_pickles, is_deepspeed_own, weights_only_deepspeed_loads
from areal_ckpt.fsio import FileRecord, write_file_durably
from areal_ckpt.paths import (
    ENGINE_STATE_FILE,
    HF_FILES,
    LATEST,
    MANIFEST_NAME,
    MODEL_PREFIX,
    READABLE_TAGGED_VERSIONS,
    TAG_CLIENT_STATE,
    TAG_MODEL,
    TAGGED_FORMAT,
    TAGGED_FORMAT_VERSION,
)
from areal_ckpt.publish import write_manifest
from areal_ckpt.recover.read import load_engine, verify_checkpoint
from areal_ckpt.state import safe_json
from areal_ckpt.state.numerics import numerics_record, warn_if_numerics_changed
from areal_ckpt.state.rng import python_random_kept
from areal_ckpt.storage.folders import OnDemandFiles
from areal_ckpt.tags.save_dir import save_dir_of

logger = logging.getLogger(__name__)


def _default_tag(engine: Engine) -> str:
    step = engine.step_counter()
    if step is None:
        raise ValueError(f"tag is required with a {type(engine).__name__} (it keeps no global step counter)")
    return f"global_step{step}"


def _agreed_tag(engine: Engine, tag: str) -> str:
    """The tag every rank saves under (see :func:`save_checkpoint`); collective."""
    check_path_component(tag, "tag")
    mode = engine.checkpoint_options().tag_validation
    if mode == "Fail":
        agree.require_same(tag, "save_checkpoint: ranks disagree on the tag (nothing was written)")
        return tag
    chosen: str = dist.broadcast_object(tag, src=0)
    if not dist.all_true(tag == chosen) and mode == "Warn":
        logger.warning(
            "save_checkpoint: ranks passed different tags (this rank %r); every rank saves under rank 0's %r "
            "(checkpoint.tag_validation=Warn)",
            tag,
            chosen,
        )
    return chosen


@python_random_kept()  # a retried request to object storage draws from it (botocore's jitter)
def save_checkpoint(
    engine: EngineLike,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Save model, optimizer, LR scheduler and this rank's ``client_state`` as ``save_dir/tag``.

    Collective: every rank calls it. ``tag`` defaults to ``global_step{N}`` (DeepSpeed's
    counter). Ranks that pass different tags follow the engine's ``tag_validation`` (DeepSpeed's
    ``checkpoint.tag_validation``): ``Fail`` raises RankMismatchError on every rank before
    anything is written; ``Warn`` logs it and ``Ignore`` does not, and both save every rank's
    state under rank 0's tag, so no checkpoint is ever mixed from two tags. ``client_state``
    must be what JSON state can hold (see :mod:`areal_ckpt.state.safe_json`; other objects are
    refused naming the key: nothing is pickled). With ``exclude_frozen_parameters`` parameters that do
    not require grad are left out. Durable on return, then ``latest`` names ``tag`` (when
    ``save_latest``). Returns True; on failure raises on every rank, leaving earlier tags and
    ``latest`` as they were. ``save_dir`` may be an ``s3://`` URL (see
    :mod:`areal_ckpt.tags.save_dir`): every rank uploads its own files, and the tag is
    committed by a record rank 0 writes last.
    """
    engine = as_engine(engine, "save_checkpoint")
    location = save_dir_of(save_dir, "save_checkpoint: save_dir")
    location.check_node_local_storage(engine.checkpoint_options().node_local_storage)
    tag = _agreed_tag(engine, tag if tag is not None else _default_tag(engine))
    save = location.begin(tag)
    failed = f"{save.where}: checkpoint not saved (earlier tags and {LATEST} are untouched)"
    succeeded = False
    try:
        # local work first: every rank must know it went well before the collective write
        tensors, engine_state, records = agree.on_every_rank(
            lambda: _write_rank_files(engine, save.staging, client_state, exclude_frozen_parameters), failed
        )
        groups = engine_state.get("optimizer_param_groups")

        def write_shards() -> dict[str, tuple[int, int]]:
            open_writer = location.data_writer(save)
            for name, record in save_tensors(
                tensors, save.staging / TAG_MODEL, groups, save.plan_key, open_writer
            ).items():
                records[f"{TAG_MODEL}/{name}"] = (record.size, record.crc32)
            location.put_own(save, sorted(records))
            return records

        def finish(every: list[dict[str, tuple[int, int]]]) -> None:
            _write_tag_manifest(save.staging, tag, every)
            location.commit(save, tag, {name for part in every for name in part}, save_latest)

        agree.gathered_then_decided(write_shards, finish, failed)
        succeeded = True
    except CheckpointError as error:
        if not str(error).startswith(failed):  # the same on every rank
            raise type(error)(f"{failed}: {error}") from error
        raise
    finally:
        location.close(save, failed=not succeeded)
    return True


def _write_rank_files(
    engine: Engine, staging: Path, client_state: dict[str, Any] | None, exclude_frozen_parameters: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, tuple[int, int]]]:
    """This rank's tensors, the engine's state and the records of the small files it wrote
    (its client_state; rank 0 also the engine state and HF files). Local."""
    tensors, engine_state = engine.recover_state(include_optimizer=True)
    if exclude_frozen_parameters:
        frozen = {f"{MODEL_PREFIX}{name}" for name, p in engine.module.named_parameters() if not p.requires_grad}
        tensors = {name: value for name, value in tensors.items() if name not in frozen}
    own = f"{TAG_CLIENT_STATE}/rank{dist.rank()}.json"
    record = write_file_durably(staging / own, safe_json.dumps(dict(client_state or {})))
    if dist.rank() == 0:
        engine_state["optimizer_saved"] = engine.has_optimizer
        write_file_durably(staging / TAG_MODEL / ENGINE_STATE_FILE, safe_json.dumps(engine_state))
        if engine.config is not None:  # what convert-deepspeed needs for config.json
            (staging / TAG_MODEL / HF_FILES).mkdir()
            export_files(engine, None).write(staging / TAG_MODEL / HF_FILES)
    return tensors, engine_state, {own: (record.size, record.crc32)}


def _write_tag_manifest(staging: Path, tag: str, every: list[dict[str, tuple[int, int]]]) -> None:
    """Rank 0: the tag's manifest, listing every rank's files (``every``) and rank 0's others."""
    records = {name: FileRecord(*entry) for records in every for name, entry in records.items()}
    header = {
        "format": TAGGED_FORMAT,
        "format_version": TAGGED_FORMAT_VERSION,
        "tag": tag,
        "world_size": dist.world_size(),
        "areal_ckpt_version": __version__,
        **numerics_record(),
    }
    write_manifest(staging, MANIFEST_NAME, records, header)


@python_random_kept()  # a retried request to object storage draws from it (botocore's jitter)
def load_checkpoint(
    engine: EngineLike,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load ``load_dir/tag`` (``tag`` None: what ``latest`` names) into ``engine``.

    Collective: every rank calls it. Returns ``(tag folder, this rank's client_state)``, or
    ``(None, None)`` when no tag is given and there is no ``latest``. Each rank gets the
    client_state it saved; on more ranks than saved, the new ranks get rank 0's (with a
    warning), as DeepSpeed gives every rank. ``load_module_only`` leaves the engine's step
    counters alone, as DeepSpeed does. Every check that can fail on one rank is agreed: all
    ranks load, or all raise the same error.
    Every file is checked against the manifest; damage raises CheckpointError naming the
    file. A tag in DeepSpeed's own layout (``engine.save_checkpoint``'s) is loaded by
    DeepSpeed itself into a DeepSpeed engine, its pickles through the weights-only unpickler
    (a file it refuses is named on every rank, and nothing is loaded). ``load_module_only``
    skips optimizer and scheduler; ``load_module_strict`` False
    loads the model tensors present on both sides and logs the rest. ``load_dir`` may be an
    ``s3://`` URL: the committed tag is brought into a local copy per node, checked against its
    manifest, and loaded from there; the returned path is then the tag's URL.
    """
    engine = as_engine(engine, "load_checkpoint")
    opened = save_dir_of(load_dir, "load_checkpoint: load_dir").open(tag)
    if opened is None:
        return None, None
    folder = opened.folder
    if agree.decided_by_rank0(lambda: is_deepspeed_own(folder), "load_checkpoint"):
        flags = (load_module_strict, load_optimizer_states, load_lr_scheduler_states, load_module_only)
        return _load_deepspeed_own(engine, folder, *flags)
    on_demand = opened.source is not None
    manifest = verify_checkpoint(folder, MANIFEST_NAME, TAGGED_FORMAT, READABLE_TAGGED_VERSIONS, on_demand)
    fetch = None if opened.source is None else OnDemandFiles(opened.source, folder, manifest["files"]).ensure
    client_state = _client_state(folder, manifest)  # agreed by every rank before any weight is loaded
    if not load_module_only:  # a continued run, as opposed to weights taken for something else
        warn_if_numerics_changed(str(folder), manifest, dist.rank())
    load_engine(
        engine,
        folder / TAG_MODEL,
        manifest,
        no_load_optim=load_module_only or not load_optimizer_states,
        load_scheduler=load_lr_scheduler_states and not load_module_only,
        strict=load_module_strict,
        load_counters=not load_module_only,
        fetch=fetch,
    )
    return opened.shown, client_state


def _load_deepspeed_own(
    engine: Engine,
    folder: Path,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load a tag in DeepSpeed's own layout with DeepSpeed's own loader (what it wrote, it reads
    bit for bit), every pickle in it opened by the weights-only unpickler: first each rank
    checks its share of the files, and all ranks agree, so a refused file stops every rank
    before anything is loaded; then DeepSpeed loads, with every ``torch.load`` weights-only."""
    if not isinstance(engine, DeepSpeedEngine):
        raise CheckpointError(
            f"{folder}: a checkpoint in DeepSpeed's own layout: load it into a DeepSpeed engine "
            f"(deepspeed.initialize's), not a {type(engine).__name__}"
        )
    files = sorted(folder.glob("*.pt"))
    agree.on_every_rank(
        lambda: check_pickles(files[dist.rank() :: dist.world_size()]), f"{folder}: not loaded (nothing in it ran)"
    )
    logger.log(dist.job_info(), "%s: DeepSpeed's own layout, loaded by DeepSpeed with weights-only unpickling", folder)
    with weights_only_deepspeed_loads():
        path, client_state = engine.ds_engine.load_checkpoint(
            str(folder.parent),
            tag=folder.name,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
    return path, client_state


def _client_state(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """This rank's client_state; collective: every rank reads its own (a rank the checkpoint has
    none for, when loading on more ranks than saved, gets rank 0's, as DeepSpeed gives every
    rank), and all raise the same error, naming each failed rank, if any rank cannot."""
    rank = dist.rank()
    own = f"{TAG_CLIENT_STATE}/rank{rank}.json"
    source = folder / (own if own in manifest["files"] else f"{TAG_CLIENT_STATE}/rank0.json")

    def read() -> dict[str, Any]:
        client_state = safe_json.loads(source.read_bytes(), str(source))
        if not isinstance(client_state, dict):
            raise CheckpointError(f"{source}: expected an object, got {type(client_state).__name__}")
        return client_state

    client_state = agree.on_every_rank(read, f"{folder}: client_state cannot be loaded")
    if source.name != f"rank{rank}.json":
        logger.warning(
            "%s: written by %d ranks; rank %d gets rank 0's client_state (as DeepSpeed does)",
            folder,
            manifest["world_size"],
            rank,
        )
    return client_state
