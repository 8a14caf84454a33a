"""Read ``saver:`` / ``recover:`` blocks from a YAML file, AReaL style.

Supports ``${a.b}`` interpolation of other keys of the same file (resolved only where the blocks
we read need it, so unrelated parts of a full training config are left alone) and dotted
command-line overrides such as ``saver.freq_steps=10`` (also Hydra's ``+key=value`` and
``++key=value``). Every failure is one ConfigError that
names the file, the key path and the problem.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from areal_ckpt.config import CheckpointConfig, RecoverConfig, SaverConfig
from areal_ckpt.errors import ConfigError

_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_TOP_LEVEL = ("experiment_name", "trial_name", "fileroot", "user")
_BLOCKS: dict[str, type[SaverConfig | RecoverConfig]] = {"saver": SaverConfig, "recover": RecoverConfig}


def load_config(path: str | Path, overrides: Sequence[str] | None = None) -> CheckpointConfig:
    """Read ``path`` (YAML), apply ``overrides`` (``"a.b=value"``), resolve ``${...}``, validate.

    The top-level ``fileroot`` falls back to ``cluster.fileroot`` (where AReaL keeps it). Blocks
    that omit experiment_name / trial_name / fileroot / user inherit them from the top level.
    Blocking, local; raises ConfigError naming the file and key on any problem.
    """
    path = Path(path)
    document = _read_yaml(path)
    for override in overrides or ():
        _apply_override(document, override, path)
    resolver = _Resolver(document, path)
    selected: dict[str, Any] = {}
    for key in _TOP_LEVEL:
        if key in document:
            selected[key] = resolver.resolve_at((key,))
    cluster = document.get("cluster")
    if "fileroot" not in selected and isinstance(cluster, dict) and "fileroot" in cluster:
        selected["fileroot"] = resolver.resolve_at(("cluster", "fileroot"))
    for block in ("saver", "recover"):
        if block in document:
            value = resolver.resolve_at((block,))
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{path}: {block}: expected a mapping, got {type(value).__name__}")
            selected[block] = value
    try:
        return CheckpointConfig.model_validate(selected)
    except ValidationError as error:
        raise ConfigError(_describe(error, path)) from None


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types
    """PyYAML's safe loader (it builds only plain YAML values, never Python objects), refusing a
    key written twice in one mapping (YAML forbids it; PyYAML would keep the last silently).
    Merge keys (``<<``) may still be overridden."""

    @classmethod
    def parse(cls, text: str) -> Any:
        """The one document in ``text``, as ``yaml.safe_load`` returns it."""
        loader = cls(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: let the base class report it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first.line + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read config file: {error.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {error.start}: {raw[error.start : error.start + 1]!r})"
        ) from None
    try:
        document = _StrictLoader.parse(text)
    except yaml.YAMLError as error:
        where = ""
        mark = getattr(error, "problem_mark", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(document).__name__}")
    _refuse_misspelled_blocks(document, path)
    return document


def _refuse_misspelled_blocks(document: dict[str, Any], path: Path) -> None:
    """A top-level key one typo away from ``saver`` / ``recover`` (``recovr``, ``savers``) while
    the real block is absent: the block would be ignored and, for ``recover``, recovery would
    silently stay off."""
    for block in ("saver", "recover"):
        if block in document:
            continue
        close = difflib.get_close_matches(block, [str(key) for key in document], n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"{path}: {close[0]}: unknown top-level block; did you mean {block}?")


def _apply_override(document: dict[str, Any], override: str, path: Path) -> None:
    """Apply one Hydra-style override: ``a.b=v`` sets, ``++a.b=v`` adds or sets, ``+a.b=v`` adds
    a key that must not exist yet (as Hydra does)."""
    key_path, sep, raw_value = override.partition("=")
    key_path = key_path.strip()
    adding = key_path.startswith("+") and not key_path.startswith("++")
    keys = key_path.removeprefix("++").removeprefix("+").split(".")
    if not sep or not all(_KEY.match(key) for key in keys):
        raise ConfigError(f"{path}: override {override!r}: expected key.path=value, e.g. saver.freq_steps=10")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"{path}: override {override!r}: value is not valid YAML") from None
    node = document
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(keys[: depth + 1])
            raise ConfigError(f"{path}: override {override!r}: {where} is not a mapping")
        node = child
    if adding and keys[-1] in node:
        raise ConfigError(
            f"{path}: override {override!r}: {'.'.join(keys)} is already set; "
            f"use ++{'.'.join(keys)}={raw_value} (or {'.'.join(keys)}={raw_value}) to override it"
        )
    node[keys[-1]] = value


#: Values a resolved block may hold at most: YAML aliases that fan out (an "alias bomb") are
#: refused before they are expanded, instead of filling memory.
MAX_VALUES = 100_000
#: Nesting a resolved block may have at most.
MAX_DEPTH = 64


class _Resolver:
    """Resolves ``${a.b}`` references against the whole document, detecting cycles and
    bounding the expansion of aliases (count and depth)."""

    def __init__(self, document: dict[str, Any], path: Path) -> None:
        self._document = document
        self._path = path
        self._active: list[tuple[str, ...]] = []
        self._values = 0

    def resolve_at(self, key_path: tuple[str, ...]) -> Any:
        if key_path in self._active:
            chain = " -> ".join(".".join(keys) for keys in [*self._active, key_path])
            raise ConfigError(f"{self._path}: circular interpolation: {chain}")
        if len(self._active) >= MAX_DEPTH:
            raise ConfigError(f"{self._path}: {'.'.join(key_path)}: interpolations chained more than {MAX_DEPTH} deep")
        self._active.append(key_path)
        try:
            return self._resolve(self._lookup(key_path), key_path, ())
        finally:
            self._active.pop()

    def _lookup(self, key_path: tuple[str, ...]) -> Any:
        node: Any = self._document
        for key in key_path:
            if not isinstance(node, dict) or key not in node:
                raise KeyError(".".join(key_path))
            node = node[key]
        return node

    def _resolve(self, value: Any, where: tuple[str, ...], containers: tuple[int, ...]) -> Any:
        self._values += 1
        location = ".".join(where)
        if self._values > MAX_VALUES:
            raise ConfigError(
                f"{self._path}: {location}: expands to more than {MAX_VALUES} values (YAML aliases that fan out?)"
            )
        if isinstance(value, (dict, list)):
            if id(value) in containers:
                raise ConfigError(f"{self._path}: {location}: a YAML alias refers to itself")
            if len(containers) >= MAX_DEPTH:
                raise ConfigError(f"{self._path}: {location}: nested more than {MAX_DEPTH} levels deep")
            inner = (*containers, id(value))
            if isinstance(value, dict):
                return {key: self._resolve(item, (*where, str(key)), inner) for key, item in value.items()}
            return [self._resolve(item, (*where, str(index)), inner) for index, item in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _REFERENCE.fullmatch(value)
        if whole:
            return self._reference(whole.group(1), where)
        return _REFERENCE.sub(lambda match: str(self._reference(match.group(1), where)), value)

    def _reference(self, target: str, where: tuple[str, ...]) -> Any:
        keys = tuple(target.strip().split("."))
        location = ".".join(where)
        if not all(_KEY.match(key) for key in keys):
            raise ConfigError(
                f"{self._path}: {location}: unsupported interpolation ${{{target}}} "
                "(only ${key.path} references to this file are supported)"
            )
        try:
            return self.resolve_at(keys)
        except KeyError:
            raise ConfigError(
                f"{self._path}: {location}: cannot resolve ${{{target}}}: no key {target!r} in this file"
            ) from None


def _describe(error: ValidationError, path: Path) -> str:
    lines = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key" + _did_you_mean(item["loc"])
        elif "input" in item and item["type"] != "missing":
            message = f"{message} (got {item['input']!r})"
        lines.append(f"{location}: {message}")
    return f"{path}: invalid configuration: " + "; ".join(lines)


def _did_you_mean(location: tuple[int | str, ...]) -> str:
    """``; did you mean KEY?`` when the unknown key at ``location`` is close to a key of its
    block (a typo such as ``freq_step``), else nothing. Pure."""
    fields = _BLOCKS[str(location[0])].model_fields if len(location) == 2 and location[0] in _BLOCKS else {}
    close = difflib.get_close_matches(str(location[-1]), list(fields), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""
