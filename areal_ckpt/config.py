"""Validated configuration models for the ``saver:`` and ``recover:`` blocks.

Pure data: no I/O here (YAML reading lives in :mod:`areal_ckpt.config_loader`).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from areal_ckpt.errors import ConfigError
from areal_ckpt.urls import local_path, locate

PositiveInt = Annotated[int, Field(gt=0, strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]

# A name becomes one folder level: no separators, no "." / "..", no leading dot (dot-names are
# reserved for staging and trash folders).
_SAFE_NAME = re.compile(r"[A-Za-z0-9_+=@-][A-Za-z0-9_.+=@-]*")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


#: Longest folder name most filesystems take (bytes).
MAX_NAME_BYTES = 255
#: Longest fileroot: PATH_MAX (4096) less room for user / experiment / trial / model / file names.
MAX_ROOT_BYTES = 2048


def check_path_component(value: str, what: str) -> str:
    """Return ``value`` if it is safe as one folder name, else raise ValueError naming ``what``."""
    if not _SAFE_NAME.fullmatch(value) or value in {".", ".."}:
        raise ValueError(
            f"{what} {value!r} cannot be used as a folder name: use letters, digits and _ . + = @ -, "
            "not starting with '.'"
        )
    if len(value.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"{what} is {len(value.encode())} bytes long; a folder name may have at most {MAX_NAME_BYTES}")
    return value


def parse_size(value: int | str) -> int:
    """Bytes in ``value``: an int, or a string like ``"5GB"`` (decimal, as HF writes it) or ``"512MiB"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '5GB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        if not match:
            raise ValueError(f"expected a size like '5GB' or '512MiB', got {value!r}")
        size = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "B").upper()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


class _TimerBlock(BaseModel):
    """Fields shared by ``saver:`` and ``recover:``: where checkpoints go and when they are taken."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def of(cls, config: Any) -> Self:
        """``config`` as this class: itself when it is one, else any object holding AReaL's
        fields (AReaL's own dataclass, an OmegaConf DictConfig, a namespace, a mapping). Each of
        this class's fields the object has is read (ours it lacks keep our defaults) and
        validated as YAML is; ConfigError (a ValueError) naming the field otherwise. Pure."""
        if isinstance(config, cls):
            return config
        fields = {}
        for name in cls.model_fields:
            if isinstance(config, Mapping):
                if name in config:
                    fields[name] = config[name]
            elif hasattr(config, name):
                fields[name] = getattr(config, name)
        try:
            return cls(**fields)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise ConfigError(f"{cls.__name__} from a {type(config).__name__}: {problems}") from None

    experiment_name: str
    trial_name: str
    fileroot: str
    # The ``{user}`` folder level; None means the current login name (see layout.default_user).
    user: str | None = None
    # Triggers combine with OR; None disables one. Epoch ticks happen on an epoch's last step.
    freq_epochs: PositiveInt | None = None
    freq_steps: PositiveInt | None = None
    # Seconds on a monotonic clock since the last checkpoint of this model name.
    freq_secs: PositiveInt | None = None
    # Ours: with fileroot on object storage (s3://, gs://, az://), the local folder where each
    # node stages a checkpoint's small files (config, manifests, recovery state) before
    # uploading them; shards go up from memory, never staged (docs/storage.md). None:
    # areal_ckpt-staging-{uid} in the system's temporary folder, private. An export's files are
    # removed after its upload; a recovery dump's newest small files stay (the next dump's
    # base). Ignored under a POSIX fileroot (the trial itself is the staging folder).
    staging_dir: str | None = None

    @field_validator("experiment_name", "trial_name", "user")
    @classmethod
    def _safe_component(cls, value: str | None, info: Any) -> str | None:
        return None if value is None else check_path_component(value, info.field_name)

    @field_validator("staging_dir")
    @classmethod
    def _local_staging(cls, value: str | None) -> str | None:
        if value is not None:
            local_path(value, "staging_dir")
        return value

    @field_validator("fileroot")
    @classmethod
    def _usable_root(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("fileroot must not be empty")
        if "\x00" in value:
            raise ValueError("fileroot must not contain a NUL character")
        locate(value, "fileroot")  # a folder or object storage, or a ValueError naming the scheme
        if len(value.encode()) > MAX_ROOT_BYTES:
            raise ValueError(
                f"fileroot is {len(value.encode())} bytes long; at most {MAX_ROOT_BYTES} leave room for "
                "the folders below it"
            )
        return value


SAVER_MODES = ("auto", "sync", "async")
#: The floating-point dtypes an export may be written in (``export_dtype``, ``--dtype``).
ExportDtypeName = Literal["bfloat16", "float16", "float32"]
EXPORT_DTYPE_NAMES: tuple[str, ...] = get_args(ExportDtypeName)
#: What an export of a PEFT model writes (``lora``, ``--lora``; docs/lora.md).
LoraExport = Literal["adapter", "merged", "both"]
LORA_EXPORTS: tuple[str, ...] = get_args(LoraExport)


class SaverConfig(_TimerBlock):
    """``saver:`` block: HuggingFace exports on epoch / step / time triggers."""

    # sync: block until durable; async: staged to shared memory and written in the background;
    # auto: async for a model on an accelerator, sync for a CPU-trained one (see jobs/background.py).
    mode: Literal["auto", "sync", "async"] = "auto"
    # Keep the newest N exports per model name; None keeps all.
    keep_last: PositiveInt | None = None
    # Largest safetensors file before the export is split into shards plus an index.
    max_shard_size: int = 5 * 10**9
    # Exported floating-point dtype; None keeps the trained dtype.
    export_dtype: ExportDtypeName | None = None
    # A PEFT (LoRA) model's export (docs/lora.md): its adapter folder(s), peft's own files, which
    # peft loads onto the base model; the merged full model; or both (merged on top, adapters in adapter/).
    lora: LoraExport = "adapter"

    @field_validator("mode", mode="before")
    @classmethod
    def _known_mode(cls, value: Any) -> Any:
        if value not in SAVER_MODES:  # AReaL's text, which AReaL's tests match on
            raise ValueError(f"Invalid mode '{value}'. Valid options: {', '.join(SAVER_MODES)}")
        return value

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _parse_shard_size(cls, value: Any) -> int:
        if not isinstance(value, (int, str)):
            raise ValueError(f"expected a size like '5GB', got {value!r}")
        return parse_size(value)


RECOVER_MODES = ("on", "auto", "sync", "async", "off", "disabled")
#: The signals ``preemption_signals`` may name.
CATCHABLE_SIGNALS = frozenset(s.name for s in signal.Signals) - {"SIGKILL", "SIGSTOP"}


class RecoverConfig(_TimerBlock):
    """``recover:`` block: full-state recovery checkpoints (model, optimizer, loop state)."""

    # on / auto / sync / async: dump on the schedule and resume when a checkpoint exists;
    # off / disabled: no-op. sync blocks until a dump is durable, async writes it in the
    # background; on / auto pick async only for a model on an accelerator (see jobs/background.py).
    mode: Literal["on", "auto", "sync", "async", "off", "disabled"] = "disabled"
    # As in AReaL: how many times `areal-ckpt launch` relaunches a failed job while recovery
    # is enabled (the training process itself never reads it).
    retries: Annotated[int, Field(ge=0, le=1000, strict=True)] = 3
    # Ours: attempts after a failed dump write, inside one dump, before the error is raised
    # (with back-off up to 10 s each, so 100 already means a quarter of an hour).
    write_retries: Annotated[int, Field(ge=0, le=100, strict=True)] = 3
    no_save_optim: StrictBool = False
    no_load_optim: StrictBool = False
    # Ours: a load on another number of ranks than the dump's (docs/recovery.md section 4). refuse:
    # per-rank state that differs between the saved ranks (RNG streams, client_state, a per-rank
    # data position) is an error; fresh_rng: elastic resume, each new rank gets a fresh RNG stream
    # derived from the checkpoint and its rank, other differing state is still an error;
    # drop_rank_state: all of it is left out, logged (what load(drop_rank_state=True) asks).
    on_world_size_change: Literal["refuse", "fresh_rng", "drop_rank_state"] = "refuse"
    # Ours: a folder on this node's own disk that becomes the fast tier in front of fileroot
    # (object storage, or a shared file system such as Lustre / NFS; docs/storage.md, "Tiers"):
    # a dump commits there, blocking as a local dump does, and goes to fileroot in the
    # background; a restart resumes from whichever tier holds the newest commit. It takes
    # staging_dir's place. None: dumps go straight to fileroot.
    local_dir: str | None = None
    # Ours, with local_dir on several nodes: how many other nodes keep a copy of each node's
    # files of the newest local commit (placed on the ring of nodes, sent over the job's process
    # group in the background), so a restart after up to this many nodes lost their disks
    # resumes from the nodes, not from fileroot (docs/storage.md, "Peer copies"). 0: none.
    local_replicas: Annotated[int, Field(ge=0, le=64, strict=True)] = 0
    # Ours, with local_dir: only every N-th local commit goes to fileroot (the last one at
    # close always does); the local tiers and their copies hold the newer ones. 1: every one.
    upload_every: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] = 1
    # Ours: signals that mean "dump at the end of this step, then exit" (a spot notice, SLURM's
    # --signal, Kubernetes' SIGTERM): docs/recovery.md, "Preemption". Empty: signals keep their
    # usual effect.
    preemption_signals: tuple[str, ...] = ()
    # Ours, with local_dir: after a preemption dump (committed on the local tier), how many seconds
    # the newest local commit's upload to fileroot is given before the job exits; one not done by
    # then (fileroot slow or down) is left to the next run, logged. Keep it inside the grace
    # period your cluster gives after its signal, less a step and a dump.
    preemption_upload_seconds: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] = 10.0

    @field_validator("preemption_signals")
    @classmethod
    def _catchable(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if name not in CATCHABLE_SIGNALS:
                raise ValueError(f"{name!r} is not a signal a process can catch; e.g. SIGTERM, SIGUSR1, SIGUSR2")
        return value

    @field_validator("local_dir")
    @classmethod
    def _local_tier(cls, value: str | None) -> str | None:
        if value is not None:
            local_path(value, "local_dir")
        return value

    @model_validator(mode="after")
    def _local_tier_apart(self) -> Self:
        if self.local_dir is None:
            for name, unset in (("local_replicas", 0), ("upload_every", 1)):
                if getattr(self, name) != unset:
                    raise ValueError(
                        f"{name}={getattr(self, name)} needs local_dir (the node-local tier it applies to); set "
                        f"local_dir, or drop {name}"
                    )
            return self
        if os.path.realpath(self.fileroot) == os.path.realpath(self.local_dir):  # a URL never names a folder
            raise ValueError(
                f"local_dir {self.local_dir!r} is fileroot itself; the local tier must be another folder (the node's "
                "own disk), or drop local_dir"
            )
        if self.staging_dir is not None:
            raise ValueError(
                "local_dir and staging_dir both name the node's local copy of the trial; with local_dir set "
                "the dump commits there (the local tier): drop staging_dir"
            )
        return self

    @field_validator("mode", mode="before")
    @classmethod
    def _known_mode(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `on` / `off` as a boolean: take them as the words meant.
        if value is True:
            return "on"
        if value is False:
            return "off"
        if value not in RECOVER_MODES:
            raise ValueError(
                f"Invalid recover mode '{value}'. Valid options: {', '.join(RECOVER_MODES)}. "
                "Note: the 'fault' and 'resume' modes were removed, as in AReaL"
            )
        return value

    @property
    def enabled(self) -> bool:
        """True when recovery dumps and resumes (mode on / auto / sync / async)."""
        return self.mode in ("on", "auto", "sync", "async")


_INHERITED = ("experiment_name", "trial_name", "fileroot", "user")


class CheckpointConfig(BaseModel):
    """Top level: names shared by both blocks, which inherit them unless they set their own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    experiment_name: str | None = None
    trial_name: str | None = None
    fileroot: str | None = None
    user: str | None = None
    saver: SaverConfig
    recover: RecoverConfig

    @model_validator(mode="before")
    @classmethod
    def _inherit_names(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for block in ("saver", "recover"):
            raw = data.get(block)
            if raw is None:
                raw = {}
            if isinstance(raw, dict):
                merged = dict(raw)
                for key in _INHERITED:
                    if merged.get(key) is None and data.get(key) is not None:
                        merged[key] = data[key]
                data[block] = merged
        return data
