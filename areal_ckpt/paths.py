"""Where each artifact lives. Pure functions: nothing here creates, reads or removes anything."""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import tempfile
from pathlib import Path

from areal_ckpt.config import check_path_component
from areal_ckpt.errors import ConfigError
from areal_ckpt.urls import ObjectURL, local_path

#: Prefix of an export being written; never loaded, removed by the next Saver.
EXPORT_STAGING_PREFIX = ".export-staging."
#: Prefix of an export being deleted (renamed first so that it vanishes atomically).
EXPORT_TRASH_PREFIX = ".export-trash."
#: Manifest written into every committed export.
MANIFEST_NAME = "areal_ckpt_manifest.json"
#: Our DCP metadata, as JSON, beside each DCP checkpoint's data files.
METADATA_JSON = "dcp_metadata.json"
#: DCP's standard metadata file: a pickle that only stock torch tools read (never we).
STOCK_METADATA = ".metadata"


def is_stock_dcp(folder: Path) -> bool:
    """True for a folder written by stock DCP (a ``.metadata`` pickle, none of our JSON)."""
    return (Path(folder) / STOCK_METADATA).is_file() and not (Path(folder) / METADATA_JSON).is_file()


def data_file_of(rank: int) -> str:
    """The name of ``rank``'s DCP data file in a checkpoint folder."""
    return f"__{rank}_0.distcp"


_EXPORT_LEAF = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")


def default_user() -> str:
    """The ``{user}`` folder level when the config sets none: the login name, else ``unknown``.

    Validated exactly as a ``user:`` field is: a login name taken from ``$USER`` /
    ``$LOGNAME`` that is not one safe folder name (``/abs/path``, ``../x``) raises ConfigError,
    so it can never place checkpoints outside ``fileroot``.
    """
    name, source = "unknown", "the default"
    for variable in ("USER", "LOGNAME"):
        if os.environ.get(variable):
            name, source = os.environ[variable], f"${variable}"
            break
    else:
        try:
            name, source = getpass.getuser(), "the login name"
        except (KeyError, OSError):
            pass
    try:
        return check_path_component(name, f"user (from {source})")
    except ValueError as error:
        raise ConfigError(f"{error}; set `user:` in the config to choose the folder level") from None


def trial_root(fileroot: str | Path, user: str, experiment_name: str, trial_name: str) -> Path:
    """``{fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}``; ConfigError for a URL
    ``fileroot`` (see :func:`local_path`): the callers that take object storage (the Saver,
    ``recover.location.trial_location``) check for a URL first and stage the trial with :func:`staging_trial_root`."""
    try:
        root = local_path(fileroot, "fileroot")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return root / "checkpoints" / user / experiment_name / trial_name


def default_staging_base() -> Path:
    """``areal_ckpt-staging-{uid}`` in the system's temporary folder: where a trial on object
    storage is staged when no ``staging_dir`` is set (made private by the storage layer)."""
    return Path(tempfile.gettempdir()) / f"areal_ckpt-staging-{os.getuid()}"


def staging_trial_root(staging_dir: str | None, url: ObjectURL, endpoint: str) -> Path:
    """The local folder where a trial on object storage (``url``: its ``{...}/{trial}`` prefix,
    on the store reached at ``endpoint``) is staged and cached:
    ``{staging_dir}/{scheme}/{endpoint name}/{bucket}/{key prefix}``, ``staging_dir`` defaulting
    to :func:`default_staging_base`; the endpoint's name is its readable part and a digest of
    it, so two stores holding one bucket name never share a folder."""
    base = local_path(staging_dir, "staging_dir") if staging_dir else default_staging_base()
    readable = re.sub(r"[^A-Za-z0-9.-]+", "_", endpoint.split("://", 1)[-1]).strip("_")[:64] or "default"
    digest = hashlib.sha256(endpoint.encode()).hexdigest()[:8]
    return base / url.scheme / f"{readable}-{digest}" / url.bucket / url.prefix


def check_model_name(name: str) -> str:
    """``name`` if it can name a model's folder (``actor``, ``default``); ValueError naming it
    when it is not a safe folder name or is one a trial and a generation already use for
    something else (``recover_info``)."""
    check_path_component(name, "model name")
    if name == RECOVER_INFO:
        raise ValueError(
            f"model name {name!r} is taken: a trial and each recovery dump keep their {RECOVER_INFO}/ there"
        )
    return name


def model_root(trial: Path, name: str) -> Path:
    """Folder of one model name (``actor``, ``default``) inside a trial; ValueError for a name
    :func:`check_model_name` refuses."""
    return trial / check_model_name(name)


def export_leaf(epoch: int, epoch_step: int, global_step: int) -> str:
    """Folder name of one export, as AReaL writes it."""
    return f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"


def parse_export_leaf(leaf: str) -> tuple[int, int, int] | None:
    """``(epoch, epoch_step, global_step)`` of an export folder name, or None if it is not one."""
    match = _EXPORT_LEAF.match(leaf)
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def export_staging(final: Path) -> Path:
    """Staging folder beside ``final`` in which that export is written before it is published."""
    return final.parent / f"{EXPORT_STAGING_PREFIX}{final.name}"


def export_trash(final: Path) -> Path:
    """Name ``final`` is renamed to while it is being deleted."""
    return final.parent / f"{EXPORT_TRASH_PREFIX}{final.name}"


# -- recovery checkpoints ------------------------------------------------------------------
# Generations live in {trial}/.recover/gen-<global_step>-<token>/; the symlink
# {trial}/.recover/current names the committed one and is switched with one atomic rename.
# {trial}/recover_info and {trial}/{name}/recover_checkpoint are fixed symlinks through
# `current`, so the folders AReaL users know always show the committed generation.

RECOVER_STORE = ".recover"
RECOVER_CURRENT = "current"
#: A superseded generation is renamed to this prefix + its name, then deleted by every rank.
RECOVER_TRASH_PREFIX = ".trash-"
RECOVER_INFO = "recover_info"
RECOVER_CHECKPOINT = "recover_checkpoint"
RECOVER_MANIFEST = f"{RECOVER_INFO}/{MANIFEST_NAME}"
#: The global files of ``recover_info/`` (as AReaL names them): each component's state, the step.
GLOBAL_FILES = {
    "saver_info": "saver_info.json",
    "evaluator_info": "evaluator_info.json",
    "stats_logger_info": "stats_logger_info.json",
    "checkpoint_info": "checkpoint_info.json",
}
STEP_FILE = "step_info.json"
#: Inside each model's folder of a generation: optimizer / scheduler state, and HF config + tokenizer.
ENGINE_STATE_FILE = "engine_state.json"
HF_FILES = "hf"
#: Inside a model's folder of a generation: the parameters that do not train (a LoRA run's base),
#: a DCP checkpoint of its own, written once and hard-linked by later generations while unchanged.
FROZEN_PART = "frozen"
_GENERATION = re.compile(r"^gen-(\d+)-([0-9a-f]{8})$")


def recover_store(trial: Path) -> Path:
    """Folder holding every recovery generation of a trial."""
    return trial / RECOVER_STORE


def recover_pointer(trial: Path) -> Path:
    """Symlink naming the committed generation (absent before the first dump)."""
    return recover_store(trial) / RECOVER_CURRENT


def generation_name(global_step: int, token: str) -> str:
    """Folder name of one recovery generation."""
    return f"gen-{global_step:08d}-{token}"


def generation_step(name: str) -> int:
    """The global step in a name made by :func:`generation_name` (ValueError for another name)."""
    match = _GENERATION.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a generation name")
    return int(match.group(1))


def is_generation_name(name: str) -> bool:
    """True for names made by :func:`generation_name` (nothing else in the store is ours)."""
    return _GENERATION.match(name) is not None


def recover_info_link(trial: Path) -> Path:
    """``{trial}/recover_info`` (symlink to the committed generation's recover_info/)."""
    return trial / RECOVER_INFO


def recover_checkpoint_link(trial: Path, name: str) -> Path:
    """``{trial}/{name}/recover_checkpoint`` (symlink to that model's folder in the committed generation)."""
    return model_root(trial, name) / RECOVER_CHECKPOINT


def rank_state_file(rank: int) -> str:
    """Per-rank state (RNG, dataloader, client state) inside recover_info/."""
    return f"rank{rank}.json"


# -- format identifiers (a manifest's "format" / "format_version") and tensor names ---------------

RECOVER_FORMAT = "areal_ckpt.recover"
RECOVER_FORMAT_VERSION = 3  # 2: raw DCP data files; 3: torch.save records + .metadata around them
#: Versions this release reads: 2 differs only in the data files, which the same reader reads.
READABLE_RECOVER_VERSIONS = (2, 3)
TAGGED_FORMAT = "areal_ckpt.tagged"
TAGGED_FORMAT_VERSION = 2  # 2: data files of torch.save records (readable by stock DCP)
READABLE_TAGGED_VERSIONS = (1, 2)
EXPORT_FORMAT = "areal_ckpt.hf_export"

#: A DeepSpeed-style checkpoint folder: ``latest`` names the newest tag; a tag holds the model's
#: state under ``model/`` and each rank's client_state under ``client_state/``.
LATEST = "latest"
TAG_MODEL = "model"
TAG_CLIENT_STATE = "client_state"

#: A data file of DCP shards (``__{rank}_0.distcp``).
DATA_SUFFIX = ".distcp"
#: Flat tensor names of one model's state: ``model.<fqn>`` and ``optim.<fqn>.<key>``.
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
#: Separates the model name from the tensor name in a dump's flat tensor dict.
MODEL_SEPARATOR = "/"
