"""Google Cloud Storage through google-cloud-storage (``gs://bucket/prefix``).

Credentials come from the SDK's standard chain only: ``GOOGLE_APPLICATION_CREDENTIALS`` (a
service-account file) or the machine's default credentials; ``STORAGE_EMULATOR_HOST`` points
the client at an emulator (fake-gcs-server), anonymously then. Never from a checkpoint config,
never logged. Create-only writes are ``ifGenerationMatch=0``; large objects go up as resumable
uploads, which appear only when finished. Every call is bounded (connect and read timeouts,
the SDK's bounded retry of idempotent calls).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google.api_core.exceptions as google_errors
import google.api_core.retry
import google.auth.exceptions
import requests.exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from areal_ckpt.errors import CheckpointError, TransientError
from areal_ckpt.fsio import FileRecord, RunningCrc
from areal_ckpt.storage.objects import ObjectInfo, ServerFailingError, no_answer, patiently, request_timeout
from areal_ckpt.storage.parts import PART_BYTES
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)

_RETRY_SECONDS = 30.0
_RETRY_TIMEOUTS = 4  # as the other clients: four more request timeouts at most


def _transient(error: Exception) -> bool:
    """Worth another try: the SDK's transient failures (unreachable, 429, 5xx) and a server that
    did not answer within the request timeout."""
    return bool(google.api_core.retry.if_transient_error(error)) or isinstance(error, requests.exceptions.Timeout)


def _retry(request_seconds: float) -> google.api_core.retry.Retry:
    """Every call's retry of transient failures, each try logged: for up to 30 s, or four request
    timeouts when those are shorter (a store set to wait briefly gives up as briefly)."""
    seconds = min(_RETRY_SECONDS, _RETRY_TIMEOUTS * request_seconds)

    def log_retry(error: Exception) -> None:
        logger.warning(
            "Google Cloud Storage %s (%s); trying again for up to %.1f s",
            no_answer(error, "did not answer in time" if isinstance(error, requests.exceptions.Timeout) else "failed"),
            error,
            seconds,
        )

    return google.api_core.retry.Retry(
        predicate=_transient, initial=0.5, maximum=8.0, timeout=seconds, on_error=log_retry
    )


_CREDENTIALS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file (or STORAGE_EMULATOR_HOST for an emulator)"
)


class GCSStore:
    """An :class:`~areal_ckpt.storage.objects.ObjectStore` on one Google Cloud Storage bucket.
    Creating one contacts nothing (the client and its credentials are made at the first call);
    :meth:`check_access` does. Thread-safe (one client, shared by the calling threads); not
    picklable: background writers make their own from the URL."""

    def __init__(self, url: ObjectURL) -> None:
        self.url = url
        self.endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
        self._bucket: storage.Bucket | None = None
        self._lock = threading.Lock()
        self._timeout = (10.0, request_timeout())  # connect, read (seconds)
        self._retry = _retry(self._timeout[1])

    def bucket(self) -> storage.Bucket:
        """The SDK's bucket object, its client made on first use; CheckpointError naming the
        variable to set when no credentials are found."""
        with self._lock:
            if self._bucket is None:
                with self._translated("connect to", ""):
                    if os.environ.get("STORAGE_EMULATOR_HOST"):
                        client = storage.Client(project="areal-ckpt", credentials=AnonymousCredentials())
                    else:
                        client = storage.Client()
                self._bucket = client.bucket(self.url.bucket)
            return self._bucket

    def check_access(self) -> None:
        """List one key of the bucket; CheckpointError naming the endpoint, bucket and cause
        (unreachable, no such bucket, denied) otherwise. Blocking."""
        with self._translated("list", self.url.key(), bucket_level=True):
            bucket = self.bucket()
            list(
                bucket.client.list_blobs(
                    bucket, prefix=self.url.key(), max_results=1, timeout=self._timeout, retry=self._retry
                )
            )

    def put_file(self, key: str, path: Path) -> None:
        """Upload ``path`` as ``key`` (a resumable upload past 8 MiB: the object appears when it
        is finished). Blocking."""
        with self._translated("upload", key, bucket_level=True):
            self.bucket().blob(key).upload_from_filename(str(path), timeout=self._timeout, retry=self._retry)

    def put_bytes(self, key: str, data: bytes, create_only: bool = False) -> bool:
        """One upload of ``data``; with ``create_only`` conditional on no object having ``key``
        (``ifGenerationMatch=0``): False, nothing written, when one has. Blocking."""
        condition: dict[str, Any] = {"if_generation_match": 0} if create_only else {}
        try:
            with self._translated("write", key, bucket_level=True, passes=(google_errors.PreconditionFailed,)):
                self.bucket().blob(key).upload_from_string(data, timeout=self._timeout, retry=self._retry, **condition)
        except google_errors.PreconditionFailed:
            return False
        return True

    def open_writer(self, key: str) -> GCSObjectWriter:
        """A writer of the object ``key`` whose bytes go up as a resumable upload while the caller
        writes (see :class:`GCSObjectWriter`)."""
        return GCSObjectWriter(self, key)

    def get_bytes(self, key: str) -> bytes | None:
        """The object ``key`` read whole, or None when there is none. Blocking."""

        def read() -> bytes | None:
            try:
                with self._translated("read", key, passes=(google_errors.NotFound,)):
                    return bytes(self.bucket().blob(key).download_as_bytes(timeout=self._timeout, retry=self._retry))
            except google_errors.NotFound:
                self._require_bucket("read", key)
                return None

        return patiently(read)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged read of ``key``: bytes ``start`` to ``start + length - 1``. Blocking."""

        def read() -> bytes:
            with self._translated("read", key):
                blob = self.bucket().blob(key)
                return bytes(
                    blob.download_as_bytes(
                        start=start, end=start + length - 1, timeout=self._timeout, retry=self._retry
                    )
                )

        return patiently(read)

    def get_file(self, key: str, path: Path) -> None:
        """Download ``key`` into ``path`` (checked by the SDK against the object's checksum).
        Blocking."""

        def read() -> None:
            with self._translated("download", key):
                self.bucket().blob(key).download_to_filename(str(path), timeout=self._timeout, retry=self._retry)

        patiently(read)

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix``, in key order. Blocking."""

        def read() -> list[ObjectInfo]:
            with self._translated("list", prefix, bucket_level=True):
                bucket = self.bucket()
                return [
                    ObjectInfo(blob.name, int(blob.size or 0), blob.updated.timestamp() if blob.updated else 0.0)
                    for blob in bucket.client.list_blobs(
                        bucket, prefix=prefix, timeout=self._timeout, retry=self._retry
                    )
                ]

        return patiently(read)

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` one request each (missing ones are no error). Blocking."""
        for key in keys:
            try:
                with self._translated("delete", key, passes=(google_errors.NotFound,)):
                    self.bucket().blob(key).delete(timeout=self._timeout, retry=self._retry)
            except google_errors.NotFound:
                pass

    def abort_uploads(self, prefix: str, spared: frozenset[str] = frozenset()) -> int:
        """Nothing to abort: an unfinished resumable upload holds no object and expires on its
        own (after a week). Returns 0."""
        return 0

    def _require_bucket(self, action: str, key: str) -> None:
        """CheckpointError naming the bucket when it does not exist (a missing object and a
        missing bucket both answer 404)."""
        try:
            exists = self.bucket().exists(timeout=self._timeout, retry=self._retry)
        except (google_errors.GoogleAPIError, requests.exceptions.RequestException):
            return
        if not exists:
            raise CheckpointError(
                f"cannot {action} {self.url.url_of(key)} at {self.endpoint}: bucket {self.url.bucket!r} does not exist"
            )

    @contextlib.contextmanager
    def _translated(
        self,
        action: str,
        key: str,
        bucket_level: bool = False,
        passes: tuple[type[Exception], ...] = (),
    ) -> Iterator[None]:
        """Turn the SDK's errors into CheckpointError / TransientError naming the endpoint, the
        object and the cause (never a credential); an error of a type in ``passes`` is re-raised
        for the caller to read. ``bucket_level``: a 404 means the bucket is missing."""
        where = f"{self.url.url_of(key)} at {self.endpoint}"
        try:
            yield
        except passes:
            raise
        except google_errors.NotFound:
            if bucket_level:
                raise CheckpointError(f"cannot {action} {where}: bucket {self.url.bucket!r} does not exist") from None
            raise CheckpointError(f"cannot {action} {where}: no such object") from None
        except (google_errors.Forbidden, google_errors.Unauthorized) as error:
            raise CheckpointError(
                f"cannot {action} {where}: access denied ({error.code}); check the credentials "
                "(GOOGLE_APPLICATION_CREDENTIALS) and the bucket's permissions"
            ) from None
        except (google_errors.TooManyRequests, google_errors.ServerError) as error:
            raise ServerFailingError(f"cannot {action} {where}: the server is busy or failing ({error.code})") from None
        except google_errors.RetryError as error:
            raise TransientError(
                f"cannot {action} {where}: the server {no_answer(error, 'did not answer in time')} ({error}); the endpoint comes from STORAGE_EMULATOR_HOST (unset: Google Cloud Storage itself)"
            ) from None
        except google.auth.exceptions.DefaultCredentialsError:
            raise CheckpointError(f"cannot {action} {where}: no credentials found; {_CREDENTIALS_HINT}") from None
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as error:
            raise TransientError(
                f"cannot {action} {where}: the server {no_answer(error)} ({error}); the endpoint comes from STORAGE_EMULATOR_HOST (unset: Google Cloud Storage itself)"
            ) from None
        except google_errors.GoogleAPIError as error:
            raise CheckpointError(f"cannot {action} {where}: {error}") from None


_DONE = None


class GCSObjectWriter:
    """An object written from memory as one resumable upload (the SDK's blob writer, 64 MiB
    chunks): :meth:`write` hands its views to one helper thread that sends them in order while
    the caller goes on, at most 8 pieces queued; the object appears at :meth:`close`, whole, or
    never (an unfinished upload holds no object). A :class:`~areal_ckpt.fsio.FileWriter`; used
    by one writing thread."""

    def __init__(self, store: GCSStore, key: str) -> None:
        self._store, self._key = store, key
        self._pieces: queue.Queue[memoryview | None] = queue.Queue(maxsize=8)
        self._crc = RunningCrc(max_pending=4)
        self._size = 0
        self._failure: BaseException | None = None
        self._closed = False
        self._sender = threading.Thread(target=self._send, name="areal_ckpt-gcs-upload", daemon=True)
        self._sender.start()

    def write(self, data: memoryview | bytes) -> None:
        """Queue ``data`` (kept and read until :meth:`close` returns); blocks while 8 pieces
        wait. Raises the upload's error once it failed."""
        self._raise_failure()
        view = memoryview(data).cast("B")
        self._crc.update(view)
        self._size += len(view)
        self._hand(view)

    def close(self) -> FileRecord:
        """Send what is left and finish the upload; returns the size and CRC-32. Blocking."""
        self._closed = True
        self._hand(_DONE)
        self._sender.join()
        self._raise_failure()
        return FileRecord(size=self._size, crc32=self._crc.value())

    def abort(self) -> None:
        """Stop sending; the unfinished upload never becomes an object. Idempotent."""
        if not self._closed:
            self._closed = True
            self._failure = self._failure or CheckpointError(f"{self._store.url.url_of(self._key)}: upload aborted")
            with contextlib.suppress(queue.Full):
                self._pieces.put_nowait(_DONE)
        self._sender.join()

    def _hand(self, piece: memoryview | None) -> None:
        """Queue ``piece`` for the sender; raises its error instead once it failed (it stops
        taking pieces then)."""
        while True:
            try:
                self._pieces.put(piece, timeout=1.0)
                return
            except queue.Full:
                if not self._sender.is_alive():
                    self._raise_failure()
                    raise CheckpointError(f"{self._store.url.url_of(self._key)}: the upload stopped") from None

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _send(self) -> None:
        try:
            with self._store._translated("upload", self._key, bucket_level=True):
                blob = self._store.bucket().blob(self._key)
                with blob.open(
                    "wb",
                    chunk_size=PART_BYTES,
                    ignore_flush=True,
                    timeout=self._store._timeout,
                    retry=self._store._retry,
                ) as upload:
                    while (piece := self._next_piece()) is not _DONE:
                        upload.write(piece)
                    if self._failure is not None:
                        raise self._failure  # leaves the upload unfinished: no object
        except BaseException as error:
            self._failure = self._failure or error

    def _next_piece(self) -> memoryview | None:
        piece = self._pieces.get()
        return _DONE if self._failure is not None else piece
