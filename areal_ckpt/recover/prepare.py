"""The first half of a recovery dump, in the training process: the generation folder, the
small JSON files, the tensors to write.

The second half (:mod:`areal_ckpt.recover.write`) writes the tensors and commits; the handler
(:mod:`areal_ckpt.recover.handler`) decides when, retries, and runs the second half here or in
the background writers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from areal_ckpt import agree, dist
from areal_ckpt.config import RecoverConfig
from areal_ckpt.engines.accept import HFAssets, export_files
from areal_ckpt.engines.contract import Engine
from areal_ckpt.errors import CollectiveError, ConfigError, RankMismatchError, TransientError
from areal_ckpt.formats.hf_export import HFFiles
from areal_ckpt.fsio import FileRecord
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import ENGINE_STATE_FILE, MODEL_SEPARATOR, RECOVER_INFO, check_model_name
from areal_ckpt.recover.frozen import fingerprint as fingerprint_of
from areal_ckpt.recover.frozen import frozen_names, frozen_part
from areal_ckpt.recover.publication import Publication
from areal_ckpt.recover.write import DumpJob, dump_header
from areal_ckpt.state import safe_json
from areal_ckpt.state.recover_info import encode_global_info, encode_rank_state
from areal_ckpt.step import StepInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreviousDump:
    """What this process committed or loaded last: the generation (None before any) and the
    weight fingerprints of its frozen models and of its models' frozen parts, by folder (an
    unchanged one is hard-linked, not rewritten)."""

    generation: str | None
    fingerprints: dict[str, list[int]]


@dataclass
class _Files:
    """What the capture of one dump collects besides the tensors."""

    records: dict[str, FileRecord]  # files linked into the generation (unchanged frozen models and parts)
    files: dict[str, bytes]  # small files to write, by path in the generation
    hf: dict[str, HFFiles]  # rank 0: each model's HF files
    param_groups: dict[str, list[dict[str, Any]]]  # each model's optimizer groups, for stock readers
    fingerprints: dict[str, list[int]]  # of frozen models and frozen parts, by folder


def prepare_dump(
    store: RecoverStore,
    publication: Publication,
    config: RecoverConfig,
    previous: PreviousDump,
    begin: Callable[[int, list[str]], str],
    engines: dict[str, Engine],
    step_info: StepInfo,
    components: dict[str, Any],
    rank_state: dict[str, Any],
    assets: dict[str, HFAssets],
    run: str = "",
    own_files: Callable[[], Mapping[str, bytes]] | None = None,
) -> tuple[DumpJob, dict[str, torch.Tensor], dict[str, list[int]]]:
    """Create the generation (rank 0, with ``begin``), encode its JSON files, capture the
    tensors; returns the second half's job, the tensors and the frozen models' fingerprints.
    ``run`` names the job in its commits where the trial persists; ``publication`` says when
    the commit reaches there (:mod:`areal_ckpt.recover.publication`); ``own_files``: what
    makes this rank's further small files, by path in the generation (its rollout frontier's,
    snapshotted as the tensors are captured; a ConfigError it raises is every rank's, not retried).

    Collective. Raises RankMismatchError when ranks disagree on the step or the models, the
    refusal ``begin`` raises, or TransientError on every rank (after discarding the
    generation) when a rank failed; nothing is written to a committed generation.
    """
    rank = dist.rank()
    names = sorted(engines)
    for name in names:
        check_model_name(name)
    agree.require_same([step_info.global_step, names], "RecoverHandler.dump: ranks disagree on (global_step, models)")
    generation = agree.decided_by_rank0(lambda: begin(step_info.global_step, names), "RecoverHandler.dump")
    collected = _Files({}, {}, {}, {}, {})
    tensors: dict[str, torch.Tensor] = {}

    def capture() -> None:
        try:
            for name in names:
                if not engines[name].has_optimizer:
                    collected.fingerprints[name] = engines[name].fingerprint()
                parts = _capture_engine(
                    store, config, previous, engines[name], name, generation, assets[name], collected
                )
                for folder, part in parts.items():
                    tensors.update({f"{folder}{MODEL_SEPARATOR}{key}": value for key, value in part.items()})
            if rank == 0:
                for file_name, data in encode_global_info(step_info, components).items():
                    collected.files[f"{RECOVER_INFO}/{file_name}"] = data
            file_name, data = encode_rank_state(rank, rank_state)
            collected.files[f"{RECOVER_INFO}/{file_name}"] = data
            if own_files is not None:
                collected.files.update(own_files())
        except (RankMismatchError, CollectiveError, ConfigError):
            raise
        except Exception as error:  # retried, once every rank knows
            raise TransientError(f"{type(error).__name__}: {error}") from error

    try:
        agree.on_every_rank(capture, "capturing the state failed")
    except BaseException:
        if rank == 0:
            store.discard(generation)
        raise
    job = DumpJob(
        trial=store.trial,
        generation=generation,
        models=names,
        records={k: (r.size, r.crc32) for k, r in collected.records.items()},
        files=collected.files,
        hf=collected.hf,
        param_groups=collected.param_groups,
        header=dump_header(step_info.to_dict(), names),
        retries=config.write_retries,
        publication=publication,
        run_token=run,
    )
    return job, tensors, collected.fingerprints


def _capture_engine(
    store: RecoverStore,
    config: RecoverConfig,
    previous: PreviousDump,
    engine: Engine,
    name: str,
    generation: str,
    assets: HFAssets,
    collected: _Files,
) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's tensors of one model by the folder they go to: the model's, and its frozen
    part's (see :mod:`areal_ckpt.recover.frozen`) unless that is unchanged and linked; nothing
    when an unchanged frozen model is linked whole (rank 0 adds the linked files' records).
    Adds its engine state and HF files (rank 0), its optimizer's param groups and its frozen
    part's fingerprint to ``collected``. Collective (one or two reductions)."""
    fingerprint = collected.fingerprints.get(name)
    if _link_unchanged(store, previous, name, fingerprint, generation, collected):
        return {}
    include_optimizer = not config.no_save_optim
    tensors, engine_state = engine.recover_state(include_optimizer)
    parts = {name: tensors}
    frozen = frozen_names(engine.module, tensors)
    if frozen:
        part = frozen_part(name)
        engine_state["frozen_part"] = frozen
        collected.fingerprints[part] = fingerprint_of(frozen, tensors)
        frozen_tensors = {key: tensors.pop(key) for key in frozen}
        if not _link_unchanged(store, previous, part, collected.fingerprints[part], generation, collected):
            parts[part] = frozen_tensors
    if engine_state.get("optimizer_param_groups"):
        collected.param_groups[name] = engine_state["optimizer_param_groups"]
    if dist.rank() == 0:
        engine_state["optimizer_saved"] = include_optimizer and engine.has_optimizer
        collected.files[f"{name}/{ENGINE_STATE_FILE}"] = safe_json.dumps(engine_state)
        if engine.config is not None:  # what `areal-ckpt export` needs besides the shards
            collected.hf[name] = export_files(engine, None, assets.tokenizer, assets.processor, assets.base_model_path)
    return parts


def _link_unchanged(
    store: RecoverStore,
    previous: PreviousDump,
    folder: str,
    fingerprint: list[int] | None,
    generation: str,
    collected: _Files,
) -> bool:
    """True when ``folder`` (a frozen model, or a model's frozen part) has the fingerprint it
    had in the previous generation on every rank and its files there still match their records
    (size and CRC-32, all read, each rank a slice): rank 0 then hard-links them into
    ``generation`` and adds their records. A file that rotted is named in a warning and the
    part is written again, so no rot is carried into a new generation. Collective (one
    reduction). Only where the store can (:attr:`RecoverStore.links_previous_data`);
    elsewhere the part is written again."""
    if not store.links_previous_data:
        return False
    unchanged = (
        fingerprint is not None and previous.fingerprints.get(folder) == fingerprint and previous.generation is not None
    )
    if unchanged and previous.generation is not None:
        problems = store.check_model(previous.generation, folder, dist.rank(), dist.world_size())
        if problems:
            logger.warning(
                "%s: not linked from the previous generation, written again: %s", folder, "; ".join(problems)
            )
            unchanged = False
    if not (dist.all_true(unchanged) and previous.generation is not None):
        return False
    if dist.rank() == 0:
        collected.records.update(store.link_model(previous.generation, generation, folder))
    return True
