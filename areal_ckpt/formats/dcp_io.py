"""Load flat tensor dicts from torch.distributed.checkpoint (DCP) folders; DCP's errors.

DCP plans (which stored chunks fill which tensors, resharding included); the bytes come through
our own storage layer (:mod:`areal_ckpt.formats.dcp_storage`, read by :mod:`areal_ckpt.formats.dcp_reader`), which reads JSON metadata and raw
byte offsets, so we never unpickle. Saving is :mod:`areal_ckpt.formats.dcp_save`.

Loads run DCP's load protocol with its default planner on each rank alone: a load's global
step changes no plan (DCP's own documentation of ``create_default_global_load_plan``), so the
plans are not sent to a coordinator and back, which ``dcp.load`` does with two collectives.
One 4-byte collective remains: every rank learns whether any rank failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.tensor import DTensor

from areal_ckpt import agree, dist
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats import cache_fill
from areal_ckpt.formats.dcp_metadata import read_metadata_json, tensor_entries
from areal_ckpt.formats.dcp_reader import RawStorageReader
from areal_ckpt.formats.range_read import PeerFiles
from areal_ckpt.fsio import FileRecord

logger = logging.getLogger(__name__)

#: The way out of a checkpoint that does not fit the model it is loaded into.
CHANGED_MODEL = (
    "; nothing was loaded: a checkpoint loads into the model it was saved from (build that model again, or "
    "train the changed model under a new trial_name, or save_dir)"
)


def tensor_index(metadata: Metadata) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Names, dtypes and full shapes of the tensors ``metadata`` describes; no I/O."""
    return {fqn: (entry.properties.dtype, tuple(entry.size)) for fqn, entry in tensor_entries(metadata).items()}


def load_tensors(
    template: dict[str, torch.Tensor],
    folder: Path,
    optional_prefixes: tuple[str, ...] = (),
    expected: dict[str, FileRecord] | None = None,
    metadata: Metadata | None = None,
    fetch: Callable[[Path], None] | None = None,
    whole: Callable[[], Metadata] | None = None,
    fill_page_cache: bool = False,
    peers: PeerFiles | None = None,
) -> None:
    """Fill ``template`` (flat name -> Tensor / DTensor, in place) from ``folder``; blocking.

    Collective when torch.distributed is initialized: every rank calls it, and a failure on
    any rank raises CheckpointError on all of them, naming the rank and its cause.
    Resharding across a different world size is DCP's. Names must match exactly, except that
    stored names starting with ``optional_prefixes`` may be left unread: missing or unexpected
    names, and shape or dtype changes, raise CheckpointError naming them. With ``expected``
    (data file name -> manifest record) every data file read is checked against its CRC-32
    and a mismatch raises CheckpointError naming the file; the template then holds partial
    data and must not be used. ``metadata`` is the folder's, when the caller read it already
    (so it is parsed once per load): this rank's slice of it when ``whole`` is given, which
    reads all of it for a load the slice does not cover (:func:`~areal_ckpt.formats.dcp_slices.rank_metadata`).
    ``fetch`` is called with each data file's path before it is read (see
    :class:`~areal_ckpt.formats.dcp_reader.RawStorageReader`). With ``fill_page_cache`` (a
    restart's load, which the next restart may repeat) the files read around the page cache
    are brought into it in the background once every rank has read
    (:mod:`~areal_ckpt.formats.cache_fill`). ``peers`` sends and receives this rank's share of
    the data files other ranks read as they arrive (see ``RawStorageReader``); those of a read
    that fails before reaching them run all the same, so no peer waits.
    """
    metadata = read_metadata_json(folder) if metadata is None else metadata
    stored = tensor_index(metadata)
    missing = sorted(set(template) - set(stored))
    unexpected = sorted(name for name in set(stored) - set(template) if not name.startswith(optional_prefixes))
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: checkpoint does not match the model: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}{CHANGED_MODEL}"
        )
    for name, tensor in template.items():
        dtype, shape = stored[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(
                f"{folder}: {name}: checkpoint has {dtype} {list(shape)}, model has {tensor.dtype} "
                f"{list(tensor.shape)}{CHANGED_MODEL}"
            )

    def read() -> None:
        try:
            _read_planned(
                template, lambda given: RawStorageReader(folder, expected, given, fetch, peers), metadata, whole
            )
        except Exception:
            if peers is not None:  # the peers wait for this rank's transfers of the folder
                try:
                    peers.exchange(folder, (), lambda name, source: None)()
                except Exception as error:  # the failure that stopped the read is the one to report
                    logger.warning("%s: a transfer after the failed read failed too: %s", folder, error)
            raise

    try:
        agree.on_every_rank(read, f"{folder}: reading DCP shards failed")  # every rank learns whether all read
    except BaseException:
        cache_fill.forget_noted()
        raise
    if fill_page_cache:
        cache_fill.fill_noted()  # every rank has read: what was read around the page cache goes into it now
    else:
        cache_fill.forget_noted()


def _read_planned(
    template: dict[str, torch.Tensor],
    reader_of: Callable[[Metadata], RawStorageReader],
    metadata: Metadata,
    whole: Callable[[], Metadata] | None,
) -> None:
    """DCP's load protocol on this rank alone: the default planner finds the stored chunks that
    overlap this rank's tensors (resharding included) and the reader fills them. When
    ``metadata`` is a slice that leaves part of a tensor uncovered, the plan is made again from
    ``whole()``. Local, blocking."""
    coordinator = dist.rank() == 0
    planner = DefaultLoadPlanner()
    planner.set_up_planner(template, metadata, coordinator)
    local = planner.create_local_plan()
    if whole is not None and not _covered(template, local):
        metadata, planner = whole(), DefaultLoadPlanner()
        planner.set_up_planner(template, metadata, coordinator)
        local = planner.create_local_plan()
    reader = reader_of(metadata)
    reader.set_up_storage_reader(metadata, coordinator)
    plan = reader.prepare_local_plan(local)
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()


def _covered(template: dict[str, torch.Tensor], plan: LoadPlan) -> bool:
    """True when ``plan`` fills every element of this rank's part of each tensor of
    ``template`` (its local shard of a DTensor). The stored chunks it reads from do not
    overlap (checked when the metadata was read), so counting elements suffices; pure."""
    filled: dict[str, int] = {}
    for item in plan.items:
        count = 1
        for length in item.lengths:
            count *= length
        filled[item.dest_index.fqn] = filled.get(item.dest_index.fqn, 0) + count
    for name, value in template.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if filled.get(name, 0) != local.numel():
            return False
    return True


def interruption_in(error: BaseException) -> BaseException | None:
    """The KeyboardInterrupt / SystemExit in ``error`` (itself, or one DCP wrapped into its
    CheckpointException), if any: this rank's own, else a new one of the same type naming the
    rank it hit, so every rank stops the same way."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return error
    interrupted = {}
    for rank, failure in getattr(error, "failures", {}).items():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            interrupted[rank] = exc
    if not interrupted:
        return None
    if dist.rank() in interrupted:
        return interrupted[dist.rank()]
    rank, exc = min(interrupted.items())
    return type(exc)(f"rank {rank} was interrupted while writing DCP shards")


def failures_text(error: CheckpointException) -> str:
    """Each rank's failure in a DCP ``CheckpointException``, one clause per rank; pure."""
    parts = []
    for rank, failure in sorted(error.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointError):  # ours already names the file
            parts.append(f"rank {rank}: {exc}")
        else:
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    return "; ".join(parts)
