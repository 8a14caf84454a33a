"""URLs of object storage (``s3://bucket/prefix``) where a path could go; pure, no I/O.

A value that starts with ``scheme://`` is never taken for a local path: a supported scheme
becomes an :class:`ObjectURL`, any other is refused naming it (taken as a path, ``s3://b/p``
would silently become a local folder named ``s3:``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Schemes an object store is reached by (see areal_ckpt/storage/s3.py).
OBJECT_SCHEMES = ("s3",)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def url_scheme(value: str) -> str | None:
    """The scheme of ``value`` when it is written as a URL (``s3`` of ``s3://b/p``), else None."""
    match = _URL.match(value)
    return None if match is None else match.group(1)


@dataclass(frozen=True)
class ObjectURL:
    """``s3://bucket/prefix``: a bucket and a key prefix inside it (no leading or trailing
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

    def __str__(self) -> str:
        return self.url_of(self.prefix)


def parse_object_url(value: str, what: str) -> ObjectURL:
    """``value`` as an :class:`ObjectURL`; ValueError naming ``what`` for an unsupported scheme,
    a missing or malformed bucket name, or a prefix with empty, ``.`` or ``..`` parts. Pure."""
    scheme = url_scheme(value)
    if scheme is None or scheme.lower() not in OBJECT_SCHEMES:
        shown = f"a {scheme}:// URL" if scheme else "not a URL"
        raise ValueError(
            f"{what} {value!r} is {shown}; object storage is reached through s3://bucket/prefix "
            "(any S3-compatible server: AWS, MinIO, SeaweedFS, Ceph; endpoint from AWS_ENDPOINT_URL)"
        )
    bucket, _, prefix = value[len(scheme) + 3 :].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(f"{what} {value!r}: {bucket!r} is not a valid bucket name (3-63 of a-z, 0-9, '.', '-')")
    parts = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{what} {value!r}: the key prefix has an empty, '.' or '..' part")
    return ObjectURL(scheme.lower(), bucket, "/".join(parts))
