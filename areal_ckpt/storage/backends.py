"""Which store serves a URL: one backend per scheme, resolved here and nowhere else.

Each backend names the module and class of its :class:`~areal_ckpt.storage.objects.ObjectStore`
(imported on first use, so a job on S3 never imports the other clouds' SDKs) and the standard
variables that choose its endpoint and credentials (whether a location is a folder or an
object store's prefix is :func:`areal_ckpt.urls.locate`'s to say); :func:`store_of` is
the one factory of stores every caller uses; :func:`register_backend` adds a scheme (a test-only backend, another cloud) without
touching any caller (docs/storage.md, "Adding a backend").
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from areal_ckpt.storage.objects import TIMEOUT_VARIABLE, ObjectStore
from areal_ckpt.urls import OBJECT_SCHEMES, ObjectURL, SchemeRules


@dataclass(frozen=True)
class Backend:
    """How one scheme's stores are made: ``make`` builds a store of one bucket (contacting
    nothing); ``environment`` lists the variables whose values select the endpoint and
    credentials (a store is made again when one of them changes)."""

    make: Callable[[ObjectURL], ObjectStore]
    environment: tuple[str, ...]


def _lazily(module: str, name: str) -> Callable[[ObjectURL], ObjectStore]:
    def make(url: ObjectURL) -> ObjectStore:
        store: ObjectStore = getattr(importlib.import_module(module), name)(url)
        return store

    return make


_BACKENDS: dict[str, Backend] = {
    "s3": Backend(
        _lazily("areal_ckpt.storage.s3", "S3Store"),
        ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"),
    ),
    "gs": Backend(
        _lazily("areal_ckpt.storage.gcs", "GCSStore"), ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS")
    ),
    "az": Backend(
        _lazily("areal_ckpt.storage.azure", "AzureStore"),
        ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"),
    ),
}
_stores: dict[tuple[int, str], ObjectStore] = {}


def register_backend(scheme: str, backend: Backend, rules: SchemeRules | None = None) -> None:
    """Serve ``scheme://bucket/prefix`` with ``backend`` from now on, in this process (a
    spawned writer registers again when it imports the module that called this). ``rules``:
    its bucket names and the message naming it (default: S3's names)."""
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ValueError(f"{scheme!r} is not a URL scheme")
    OBJECT_SCHEMES[scheme] = rules or SchemeRules(
        OBJECT_SCHEMES["s3"].bucket, OBJECT_SCHEMES["s3"].bucket_rule, f"{scheme}://bucket/prefix"
    )
    _BACKENDS[scheme] = backend


def store_of(url: ObjectURL) -> ObjectStore:
    """This process's store for ``url``'s bucket, made on first use (a forked or spawned
    writer makes its own) and again when the environment names another endpoint or
    credentials. Contacts nothing."""
    backend = _BACKENDS[url.scheme]
    chosen = "|".join(os.environ.get(name, "") for name in (*backend.environment, TIMEOUT_VARIABLE))
    key = (os.getpid(), f"{url.scheme}://{url.bucket}|{chosen}")
    if key not in _stores:
        _stores[key] = backend.make(ObjectURL(url.scheme, url.bucket, ""))
    return _stores[key]
