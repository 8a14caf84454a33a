"""The read side of recovery: find the committed generation, verify it, load a model's state.

Every function here reads; none changes a committed generation. Collective ones say so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_ckpt import agree, dist
from areal_ckpt._version import __version__
from areal_ckpt.config import RecoverConfig
from areal_ckpt.engines.contract import LoadTarget
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats.dcp_io import load_tensors, tensor_index
from areal_ckpt.formats.dcp_slices import rank_metadata, read_when_needed
from areal_ckpt.formats.range_read import PeerFiles
from areal_ckpt.fsio import FileRecord
from areal_ckpt.generations.store import RecoverStore, find_committed
from areal_ckpt.paths import (
    DATA_SUFFIX,
    ENGINE_STATE_FILE,
    FROZEN_PART,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    READABLE_RECOVER_VERSIONS,
    RECOVER_FORMAT,
    RECOVER_INFO,
    RECOVER_MANIFEST,
    STEP_FILE,
    generation_step,
)
from areal_ckpt.persistence.reading import ReadFrom, fetch_committed
from areal_ckpt.publish import check_files, read_manifest
from areal_ckpt.recover.location import trial_location
from areal_ckpt.schedule import TriggerSchedule
from areal_ckpt.state import safe_json
from areal_ckpt.state.components import Stateful, check_dataloader_state
from areal_ckpt.state.frontier import FrontierSnapshot, RolloutFrontier
from areal_ckpt.state.frontier_files import frontier_to_restore
from areal_ckpt.state.numerics import warn_if_numerics_changed
from areal_ckpt.state.recover_info import RecoverInfo, read_recover_info
from areal_ckpt.state.rng import check_rng_state
from areal_ckpt.storage.folders import OnDemandFiles
from areal_ckpt.tier.nodes import held_elsewhere

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenedGeneration:
    """A committed generation opened for a load: its ``name`` and ``folder`` in the local
    store, its verified ``manifest``, this rank's recover ``info``, what brings a data file
    into the local copy before it is read (``fetch``; None when it is all there) and the data
    files other ranks send into the load (``peers``), this rank's rollout frontier when the load
    restores one (``frontier``). Plain data, local to the rank."""

    name: str
    folder: Path
    manifest: dict[str, Any]
    info: RecoverInfo
    fetch: Callable[[Path], None] | None = None
    peers: PeerFiles | None = None
    frontier: FrontierSnapshot | None = None


def open_committed(
    store: RecoverStore,
    read_from: ReadFrom,
    models: list[str],
    on_world_size_change: str,
    dataloader: Stateful | None = None,
    rollout: RolloutFrontier | None = None,
) -> OpenedGeneration | None:
    """The committed generation of ``store``, read as ``read_from`` says
    (:class:`~areal_ckpt.persistence.reading.ReadFrom`), or None when there is none. With a
    source, its newest commit is the one and None when it holds none (whatever the local copy
    holds); the generation's small files come down to the node's local copy first and its
    data files only as a rank reads them (each rank the files its share needs). Assembled (a
    tiered trial resuming from its local tiers): each node holds what its ranks read but the
    files that arrive into their loads, and the data files it lacks are not looked for
    (:func:`~areal_ckpt.tier.nodes.held_elsewhere`).
    Collective: rank 0 finds it (removing debris), every rank verifies its share and reads its
    info. Raises CheckpointError on every rank when the
    commit record is broken, the trial holds AReaL's folders, a file is damaged, ``models``
    names one it does not hold (:func:`check_models`), the three records of its step disagree,
    or a component cannot be restored (``dataloader``, ``rollout``: the ones the load restores,
    :func:`~areal_ckpt.state.frontier_files.frontier_to_restore`); nothing is loaded then."""
    source = read_from.source
    if source is not None:
        if read_from.newest is None:
            return None  # where the trial persists decides: no commit there is a fresh start, whatever the node holds
        fetch_committed(source, read_from.newest, store.root, deferred=read_when_needed)
    found = agree.decided_by_rank0(lambda: find_committed(store), "RecoverHandler.load")
    if found is None:
        return None
    folder = store.path(found)
    elsewhere = held_elsewhere(store, found) if read_from.assembled else frozenset()
    manifest = verify_checkpoint(folder, data_on_demand=source is not None, elsewhere=elsewhere)
    fetch = None if source is None else OnDemandFiles(source.files_of(found), folder, manifest["files"]).ensure
    check_models(folder, manifest["models"], models)
    info = read_recover_info(
        folder / RECOVER_INFO, dist.rank(), dist.world_size(), manifest["world_size"], on_world_size_change
    )
    check_one_step(folder, manifest, info)
    check_restorable(info, dataloader)  # before any weight is loaded: a failed load changes nothing
    frontier = frontier_to_restore(folder, manifest, rollout, on_world_size_change)
    warn_if_numerics_changed(str(folder), manifest, dist.rank())
    return OpenedGeneration(found, folder, manifest, info, fetch, read_from.peers, frontier)


def check_models(folder: Path, held: list[str], given: list[str]) -> None:
    """Raise CheckpointError unless every model a load was ``given`` is ``held`` by the
    checkpoint in ``folder``. A load given only some of them (AReaL's RL trainer dumps actor
    and critic and loads the actor) loads those; the others keep the state they have, said in
    a warning on rank 0 naming them. Pure, the same on every rank."""
    lacking = sorted(set(given) - set(held))
    if lacking:
        raise CheckpointError(
            f"{folder}: checkpoint holds models {held}, load was given {given}; it has no {', '.join(lacking)}"
        )
    left = sorted(set(held) - set(given))
    if left and dist.rank() == 0:
        logger.warning(
            "%s: holds models %s; this load was given %s only, so %s keep(s) the state they have now "
            "(pass every engine to load to restore them all)",
            folder,
            held,
            given,
            ", ".join(left),
        )


def check_one_step(folder: Path, manifest: dict[str, Any], info: RecoverInfo) -> None:
    """Raise CheckpointError naming all three unless the generation's folder name, its
    manifest's ``step`` and ``recover_info/step_info.json`` record the same global step (a dump
    writes it three times; a load trusts none alone). Pure: reads what was read already, the
    same on every rank."""
    records = {
        f"folder name {folder.name}": generation_step(folder.name),
        f"{RECOVER_MANIFEST} step": manifest["step"].get("global_step"),
        f"{RECOVER_INFO}/{STEP_FILE}": info.last_step_info.global_step,
    }
    if len(set(records.values())) != 1:
        described = ", ".join(f"{where}: {step!r}" for where, step in records.items())
        raise CheckpointError(f"{folder}: the dump's global step is recorded differently ({described}); not loading it")


def _check_header(path: Path, manifest: dict[str, Any], recovery: bool) -> None:
    """Raise CheckpointError naming ``path`` unless the manifest's world size (and, for a
    recovery generation, models and step) have the types a load relies on."""
    world = manifest.get("world_size")
    models = manifest.get("models")
    step = manifest.get("step")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{path}: world_size must be a positive integer, got {world!r}")
    if not recovery:
        return
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise CheckpointError(f"{path}: models must be a list of names, got {str(models)[:100]}")
    if not isinstance(step, dict):
        raise CheckpointError(f"{path}: step must be an object, got {str(step)[:100]}")


def verify_checkpoint(
    folder: Path,
    manifest_name: str = RECOVER_MANIFEST,
    fmt: str = RECOVER_FORMAT,
    versions: tuple[int, ...] = READABLE_RECOVER_VERSIONS,
    data_on_demand: bool = False,
    elsewhere: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Check the manifest's format, every file's presence and size, and the CRC-32 of every
    file but the tensor data files (those are checked while :func:`load_engine` reads them,
    saving a full pass); returns the manifest. Defaults: a recovery generation. With
    ``data_on_demand`` (a local copy of a checkpoint on object storage) the DCP files (data,
    chunks, metadata) are not looked at here: each is brought down, and checked, when a rank
    reads it. ``elsewhere``: data files this node does not hold because none of its ranks
    reads them (a load from several nodes' local tiers); not looked at here either.

    Collective: the files are dealt out to the ranks, each checks its share, all agree.
    Raises CheckpointError naming every damaged file.
    """
    manifest = read_manifest(folder, manifest_name)
    _check_header(folder / manifest_name, manifest, recovery=fmt == RECOVER_FORMAT)
    if manifest.get("format") != fmt or manifest.get("format_version") not in versions:
        raise CheckpointError(
            f"{folder / manifest_name}: format {manifest.get('format')!r} version "
            f"{manifest.get('format_version')!r} cannot be read by areal_ckpt {__version__} "
            f"(reads {fmt!r} versions {', '.join(map(str, versions))})"
        )
    files = manifest["files"]
    mine = [
        name
        for index, name in enumerate(sorted(files))
        if index % dist.world_size() == dist.rank() and name not in elsewhere
    ]

    def check_share() -> None:
        later = [name for name in mine if data_on_demand and read_when_needed(name)]
        problems = check_files(folder, files, [n for n in mine if not n.endswith(DATA_SUFFIX) and n not in later])
        if not data_on_demand:
            problems += check_files(folder, files, [n for n in mine if n.endswith(DATA_SUFFIX)], checksum=False)
        if problems:
            raise CheckpointError("; ".join(problems))

    agree.on_every_rank(check_share, f"{folder}: recovery checkpoint is damaged")
    return manifest


def load_engine(
    engine: LoadTarget,
    folder: Path,
    manifest: dict[str, Any],
    no_load_optim: bool,
    load_scheduler: bool = True,
    strict: bool = True,
    load_counters: bool = True,
    fetch: Callable[[Path], None] | None = None,
    peers: PeerFiles | None = None,
) -> None:
    """Load one model's weights (and optimizer unless ``no_load_optim`` or not saved; LR
    scheduler when ``load_scheduler``; an engine's step counters when ``load_counters``) from
    its folder of a checkpoint checked by
    :func:`verify_checkpoint`, checking the data files' CRC-32 as they are read. ``strict``
    False loads the model tensors both sides have and logs the others. ``fetch`` brings a
    data file into a local copy before it is read (:class:`~areal_ckpt.storage.folders.OnDemandFiles`);
    ``peers`` sends and receives the data files a restart from the local tiers reads as they
    arrive (:class:`~areal_ckpt.storage.peer_reads.PeerReads`).
    Files read around the page cache are brought into it in the background afterwards, so a
    restart that loads them again reads memory (:mod:`~areal_ckpt.formats.cache_fill`).
    Collective (DCP; FSDP2 / DDP / DeepSpeed state-dict helpers)."""
    try:
        engine_state = safe_json.loads((folder / ENGINE_STATE_FILE).read_bytes(), str(folder / ENGINE_STATE_FILE))
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    # an engine without an optimizer (evaluation, a reference model) takes the weights alone
    include_optimizer = bool(engine_state.get("optimizer_saved")) and not no_load_optim and engine.optimizer is not None
    if engine.optimizer is not None and not include_optimizer:
        logger.warning(
            "%s: optimizer state not restored (%s)",
            folder,
            "not requested: no_load_optim / load_optimizer_states=False" if no_load_optim else "it was not saved",
        )
    if not load_counters and isinstance(engine_state.get("deepspeed"), dict):
        engine_state["deepspeed"].pop("counters", None)
    if not load_scheduler:
        engine_state.pop("lr_scheduler", None)
    elif (
        engine.lr_scheduler is not None
        and "lr_scheduler" not in engine_state
        and engine_state.get("imported_from") == "areal"
    ):
        logger.warning(
            "%s: imported from AReaL, which saves no LR scheduler state: the scheduler is left as "
            "constructed; step it once per completed step to continue its schedule",
            folder,
        )
    elif engine.lr_scheduler is not None and "lr_scheduler" not in engine_state:
        raise CheckpointError(
            f"{folder / ENGINE_STATE_FILE}: no LR scheduler state was saved, but this engine has a scheduler"
        )
    try:
        engine.validate_recover_state(engine_state, include_optimizer)
    except ValueError as error:
        raise CheckpointError(f"{folder / ENGINE_STATE_FILE}: {error}") from None
    metadata, whole = rank_metadata(folder, dist.rank(), fetch)
    stored = tensor_index(metadata)
    frozen = folder / FROZEN_PART if engine_state.get("frozen_part") else None
    frozen_metadata, frozen_whole = rank_metadata(frozen, dist.rank(), fetch) if frozen is not None else (None, None)
    frozen_stored = tensor_index(frozen_metadata) if frozen_metadata is not None else {}
    stored.update(frozen_stored)
    template = engine.recover_template(include_optimizer and engine_state.get("optimizer_has_state", True), stored)
    optional: tuple[str, ...] = ()
    if not strict:
        skipped = sorted(name for name in template if name.startswith(MODEL_PREFIX) and name not in stored)
        template = {name: value for name, value in template.items() if name not in skipped}
        optional += (MODEL_PREFIX,)
        if skipped:
            logger.warning("%s: not in the checkpoint, left as they are: %s", folder, skipped[:10])
    # partitions that other ranks own (ZeRO) are theirs to read, and so are experts other ranks hold
    optional += tuple(f"{OPTIM_PREFIX}rank{r}." for r in range(manifest["world_size"]) if r != dist.rank())
    optional += tuple(str(prefix) for prefix in engine_state.get("rank_local_prefixes") or ())
    if frozen is not None:  # the frozen part first: its own DCP checkpoint, its own files
        frozen_template = {name: template.pop(name) for name in list(template) if name in frozen_stored}
        load_tensors(
            frozen_template,
            frozen,
            optional_prefixes=optional,
            expected=_data_files(manifest, f"{folder.name}/{FROZEN_PART}/"),
            metadata=frozen_metadata,
            fetch=fetch,
            whole=frozen_whole,
            fill_page_cache=True,
            peers=peers,
        )
    load_tensors(
        template,
        folder,
        optional_prefixes=optional if include_optimizer else optional + (OPTIM_PREFIX,),
        expected=_data_files(manifest, f"{folder.name}/"),
        metadata=metadata,
        fetch=fetch,
        whole=whole,
        fill_page_cache=True,
        peers=peers,
    )
    if frozen is not None:
        template.update(frozen_template)
    try:
        engine.load_recover_state(template, engine_state, include_optimizer, strict)
    except (KeyError, ValueError, RuntimeError, TypeError, AttributeError, IndexError) as error:
        raise CheckpointError(
            f"{folder / ENGINE_STATE_FILE}: cannot restore model / optimizer / scheduler: "
            f"{type(error).__name__}: {error}"
        ) from None


def _data_files(manifest: dict[str, Any], prefix: str) -> dict[str, FileRecord]:
    """The manifest's records of the data files directly in the folder ``prefix`` names in the
    generation (a model's, or its frozen part), by file name; pure."""
    return {
        name[len(prefix) :]: FileRecord(entry["size"], entry["crc32"])
        for name, entry in manifest["files"].items()
        if name.startswith(prefix) and "/" not in name[len(prefix) :] and name.endswith(DATA_SUFFIX)
    }


def check_if_auto_recover(config: RecoverConfig | Any) -> bool:
    """True when the trial has a committed recovery checkpoint (whatever ``mode`` says): on
    where the trial persists (object storage's commit log, a shared folder's commit); tiered,
    also on this node's local tier. Local.

    Raises CheckpointError when a commit record exists but is broken, or when the trial holds
    AReaL's own recovery folders, so a launcher never mistakes a checkpoint for a fresh trial.
    Checksums are verified by ``RecoverHandler.load``.
    """
    store, publication = trial_location(RecoverConfig.of(config))
    return publication.has_checkpoint(store)


def check_if_recover(config: RecoverConfig | Any, _run_id: int = 0) -> bool:
    """True when recovery is enabled (mode on/auto/sync/async) and the trial has a committed
    recovery checkpoint (see :func:`check_if_auto_recover`); local. ``_run_id`` is unused, as in
    AReaL (kept, under AReaL's name, so AReaL's call runs unchanged)."""
    config = RecoverConfig.of(config)
    return config.enabled and check_if_auto_recover(config)


def check_restorable(info: RecoverInfo, dataloader: Stateful | None = None) -> None:
    """Raise CheckpointError (on every rank) unless this rank's RNG state, its data position
    (into ``dataloader``) and the trigger state of ``info`` can be restored; checked on scratch
    objects or read-only, so nothing changes. Collective."""

    def check() -> None:
        check_dataloader_state(f"{info.path}/{RECOVER_INFO}/rank{dist.rank()}.json", info.dataloader_info, dataloader)
        try:
            if info.rng_state is not None:
                check_rng_state(info.rng_state)
        except ValueError as error:
            raise CheckpointError(f"{info.path}/{RECOVER_INFO}/rank{dist.rank()}.json: {error}") from None
        if info.checkpoint_info is not None:
            try:
                TriggerSchedule(None, None, None).load_state_dict(info.checkpoint_info)
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                raise CheckpointError(
                    f"{info.path}/{RECOVER_INFO}/checkpoint_info.json: malformed: {type(error).__name__}: {error}"
                ) from None

    agree.on_every_rank(check, f"{info.path}: recover info cannot be restored")
