"""URLs of object storage (``s3://``, ``gs://``, ``az://``) where a path could go; pure, no I/O.

:func:`locate` is the one place a configured location (a fileroot, a save_dir, a command's
argument) is told to be a local or shared folder or a prefix of an object store; the YAML's
validation and every storage factory ask it, and map its answer to their own implementation.

A value that starts with ``scheme://`` is never taken for a local path: a supported scheme
becomes an :class:`ObjectURL`, any other is refused naming it (taken as a path, ``s3://b/p``
would silently become a local folder named ``s3:``). A value that almost is a URL of a known
scheme (``s3:/b/p``, ``s3:b/p``, `` s3://b/p``) is refused too, for the same reason.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from areal_ckpt.errors import ConfigError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_ALMOST_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class SchemeRules:
    """What a scheme's URLs look like: the pattern of a bucket (container) name, what the
    store is, and where its endpoint and credentials come from (for messages)."""

    bucket: re.Pattern[str]
    bucket_rule: str
    reached_through: str


#: The schemes an object store is reached by (areal_ckpt/storage/backends.py serves each);
#: a backend registered there adds its own.
OBJECT_SCHEMES: dict[str, SchemeRules] = {
    "s3": SchemeRules(
        re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
        "3-63 of a-z, 0-9, '.', '-'",
        "s3://bucket/prefix (AWS or any S3-compatible server; endpoint from AWS_ENDPOINT_URL)",
    ),
    "gs": SchemeRules(
        re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$"),
        "3-63 of a-z, 0-9, '.', '_', '-'",
        "gs://bucket/prefix (Google Cloud Storage; GOOGLE_APPLICATION_CREDENTIALS, or STORAGE_EMULATOR_HOST)",
    ),
    "az": SchemeRules(
        re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$"),
        "3-63 of a-z, 0-9, '-', no '--'",
        "az://container/prefix (Azure Blob; AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME "
        "and AZURE_STORAGE_ACCOUNT_KEY)",
    ),
}


def url_scheme(value: str) -> str | None:
    """The scheme of ``value`` when it is written as a URL (``s3`` of ``s3://b/p``), else None.
    ConfigError (a ValueError) naming ``value`` when it almost is a URL of a known scheme (``s3:/b``,
    ``s3:b``, surrounded by spaces): taken as a path it would become a local folder. Pure."""
    match = _URL.match(value)
    if match is not None:
        return match.group(1)
    if value != value.strip() and _URL.match(value.strip()):
        raise ConfigError(f"{value!r} is a URL with spaces around it; write it without them")
    almost = _ALMOST_URL.match(value)
    if almost is not None and almost.group(1).lower() in OBJECT_SCHEMES:
        scheme = almost.group(1).lower()
        raise ConfigError(f"{value!r} is not a valid {scheme}:// URL; write {OBJECT_SCHEMES[scheme].reached_through}")
    return None


@dataclass(frozen=True)
class ObjectURL:
    """``s3://bucket/prefix`` (or ``gs://``, ``az://``): a bucket and a key prefix inside it (no leading or trailing
    slash; empty for the bucket's root)."""

    scheme: str
    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        """The key of ``parts`` joined below this prefix."""
        return "/".join(part.strip("/") for part in (self.prefix, *parts) if part.strip("/"))

    def url_of(self, key: str) -> str:
        """``scheme://bucket/key``, for messages."""
        return f"{self.scheme}://{self.bucket}/{key}"

    def child(self, *parts: str) -> ObjectURL:
        """The URL of a prefix below this one."""
        return ObjectURL(self.scheme, self.bucket, self.key(*parts))

    def parent(self) -> tuple[ObjectURL, str]:
        """The URL of the prefix one level up and the last part of this one (empty at the
        bucket's root)."""
        parent_key, _, name = self.key().rpartition("/")
        return ObjectURL(self.scheme, self.bucket, parent_key), name

    def __str__(self) -> str:
        return self.url_of(self.prefix)


def parse_object_url(value: str, what: str) -> ObjectURL:
    """``value`` as an :class:`ObjectURL`; ConfigError (a ValueError) naming ``what`` for an unsupported scheme,
    a missing or malformed bucket name, or a prefix with empty, ``.`` or ``..`` parts. Pure."""
    try:
        scheme = url_scheme(value)
    except ConfigError as error:
        raise ConfigError(f"{what} {error}") from None
    if scheme is None or scheme.lower() not in OBJECT_SCHEMES:
        shown = f"a {scheme}:// URL" if scheme else "not a URL"
        reached = "; ".join(rules.reached_through for rules in OBJECT_SCHEMES.values())
        raise ConfigError(f"{what} {value!r} is {shown}; object storage is reached through {reached}")
    rules = OBJECT_SCHEMES[scheme.lower()]
    bucket, _, prefix = value[len(scheme) + 3 :].partition("/")
    if not rules.bucket.match(bucket) or ".." in bucket:
        shown = f"{bucket!r} is not a valid bucket name" if bucket else "the bucket name is missing"
        raise ConfigError(f"{what} {value!r}: {shown} ({rules.bucket_rule})")
    parts = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
    if any(part in ("", ".", "..") for part in parts):
        raise ConfigError(f"{what} {value!r}: the key prefix has an empty, '.' or '..' part")
    return ObjectURL(scheme.lower(), bucket, "/".join(parts))


def local_path(value: str | os.PathLike[str], what: str) -> Path:
    """``value`` as a local path; ValueError naming ``what`` and the scheme when it is a URL
    (``s3://bucket/prefix``, ``gs://``...) where only a local path is supported: taken as a
    path it would become a local folder named ``s3:``. Pure."""
    scheme = url_scheme(str(value))
    if scheme is not None:
        raise ValueError(
            f"{what} {str(value)!r} is a {scheme}:// URL: object storage is not supported here yet (a "
            f"fileroot is: docs/storage.md), and as a path it would become a local folder named '{scheme}:'. Use a path on a "
            "local or shared POSIX filesystem"
        )
    return Path(value)


def locate(value: str | os.PathLike[str], what: str) -> Path | ObjectURL:
    """Where ``value`` (a fileroot, save_dir, command argument: ``what``) points: a prefix of
    the object store its URL names (any registered scheme), else a local or shared folder.
    ConfigError (a ValueError) naming ``what`` for a malformed URL or an unsupported scheme.
    Pure: contacts nothing."""
    text = str(value)
    if url_scheme(text) is None:
        return local_path(value, what)
    return parse_object_url(text, what)
