"""What the object-storage tests read and write behind the library's back, on any store: keys
listed, objects read, damaged or planted, commit records read. Through the library's own store
(its contract is tested on every server in test_object_store.py), so one helper serves s3://,
gs:// and az:// alike."""

from __future__ import annotations

import json

from areal_ckpt.storage.backends import store_of
from areal_ckpt.urls import parse_object_url


def _store(bucket_url: str):  # type: ignore[no-untyped-def]
    url = parse_object_url(bucket_url, "test")
    return store_of(url), url


def keys_under(bucket_url: str, prefix: str = "") -> list[str]:
    """Every key under ``prefix`` in the bucket of ``bucket_url``, in key order."""
    store, _ = _store(bucket_url)
    return [item.key for item in store.list_prefix(prefix)]


def read_object(bucket_url: str, key: str) -> bytes:
    """The object ``key`` of the bucket (it must exist)."""
    store, _ = _store(bucket_url)
    data = store.get_bytes(key)
    assert data is not None, key
    return data


def write_object(bucket_url: str, key: str, data: bytes) -> None:
    """Replace (or create) the object ``key`` of the bucket with ``data``."""
    store, _ = _store(bucket_url)
    store.put_bytes(key, data)


def commit_records(bucket_url: str, trial: str) -> list[dict]:
    """The bodies of the recovery commit records of ``trial`` (a key prefix), oldest first."""
    keys = keys_under(bucket_url, f"{trial}/.recover/.commits/")
    return [json.loads(read_object(bucket_url, key)) for key in keys]
