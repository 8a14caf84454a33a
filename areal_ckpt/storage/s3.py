"""S3-compatible object storage through boto3 (AWS, MinIO, SeaweedFS, Ceph...).

Endpoint, region and credentials come from boto3's standard chain only: ``AWS_ENDPOINT_URL``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE`` and the files under ``~/.aws``; never from a checkpoint config, and never
logged. Large objects move as parallel multipart uploads and parallel ranged reads
(s3transfer). Every call is bounded in time (connect and read timeouts, a bounded number of
attempts by botocore), so a stalled server becomes an error instead of a hang.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import boto3
import boto3.s3.transfer
import botocore.config
import botocore.exceptions

from areal_ckpt.errors import CheckpointError, TransientError
from areal_ckpt.fsio import FileRecord, RunningCrc
from areal_ckpt.storage.objects import ObjectInfo
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)

_PART = 64 << 20
_WORKERS = 8
_CLIENT_SETTINGS = botocore.config.Config(
    connect_timeout=10,
    read_timeout=120,
    retries={"mode": "standard", "max_attempts": 4},
    max_pool_connections=2 * _WORKERS,
)
_TRANSFER = boto3.s3.transfer.TransferConfig(
    multipart_threshold=_PART, multipart_chunksize=_PART, max_concurrency=_WORKERS, use_threads=True
)
_ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "AllAccessDisabled"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "500", "502", "503", "504"}
_READ_PATIENCE_SECONDS = 30.0  # a server that answers "failing" (5xx) right after a restart recovers within seconds
T = TypeVar("T")


class ServerFailingError(TransientError):
    """The server answered, but with a failure of its own (5xx, throttling): reads wait for it."""


class S3Store:
    """An :class:`~areal_ckpt.storage.objects.ObjectStore` on one bucket of an S3-compatible
    server. Creating one contacts nothing; :meth:`check_access` does. Thread-safe (one boto3
    client, which botocore makes safe to share between threads); not picklable: background
    writers make their own from the URL."""

    def __init__(self, url: ObjectURL) -> None:
        self.url = url
        session = boto3.session.Session()
        region = session.region_name or "us-east-1"  # signing needs one; S3-compatible servers ignore it
        self._client = session.client("s3", region_name=region, config=_CLIENT_SETTINGS)
        self.endpoint = self._client.meta.endpoint_url

    def check_access(self) -> None:
        """List one key of the bucket; CheckpointError naming the endpoint, bucket and cause
        (unreachable, no such bucket, denied) otherwise. Blocking."""
        with self._translated("list", self.url.key()):
            self._client.list_objects_v2(Bucket=self.url.bucket, Prefix=self.url.key(), MaxKeys=1)

    def _patiently(self, read: Callable[[], T]) -> T:
        """``read()`` (idempotent), tried again with back-off while the server answers with a
        failure of its own, for up to 30 s (botocore's own attempts come first)."""
        deadline, delay = time.monotonic() + _READ_PATIENCE_SECONDS, 0.5
        while True:
            try:
                return read()
            except ServerFailingError as failure:
                if time.monotonic() + delay > deadline:
                    raise
                logger.warning("%s; trying again in %.1f s", failure, delay)
                time.sleep(delay)
                delay = min(2 * delay, 8.0)

    def put_file(self, key: str, path: Path) -> None:
        """Upload ``path`` as ``key``: one PUT, or a parallel multipart upload past 64 MiB whose
        object appears only at its completion. Blocking."""
        with self._translated("upload", key):
            self._client.upload_file(str(path), self.url.bucket, key, Config=_TRANSFER)

    def put_bytes(self, key: str, data: bytes, create_only: bool = False) -> bool:
        """One PUT of ``data``; with ``create_only`` conditional on no object having ``key``
        (``If-None-Match: *``): False, nothing written, when one has. Blocking."""
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        try:
            with self._translated("write", key, passes={"PreconditionFailed", "412"}):
                self._client.put_object(Bucket=self.url.bucket, Key=key, Body=data, **extra)
        except botocore.exceptions.ClientError:
            return False
        return True

    def open_writer(self, key: str) -> S3ObjectWriter:
        """A writer of the object ``key`` that uploads each 64 MiB part from memory as soon as it
        is full (see :class:`S3ObjectWriter`); contacts nothing until a part or the close."""
        return S3ObjectWriter(self, key)

    def get_bytes(self, key: str) -> bytes | None:
        """The object ``key`` read whole, or None when there is none. Blocking."""

        def read() -> bytes | None:
            try:
                with self._translated("read", key, passes=_MISSING_CODES):
                    body: bytes = self._client.get_object(Bucket=self.url.bucket, Key=key)["Body"].read()
                    return body
            except botocore.exceptions.ClientError:
                return None

        return self._patiently(read)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged GET of ``key``: bytes ``start`` to ``start + length - 1``. Blocking."""

        def read() -> bytes:
            with self._translated("read", key):
                answer = self._client.get_object(
                    Bucket=self.url.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
                )
                body: bytes = answer["Body"].read()
                return body

        return self._patiently(read)

    def get_file(self, key: str, path: Path) -> None:
        """Download ``key`` into ``path`` (parallel ranged GETs past 64 MiB). Blocking."""

        def read() -> None:
            with self._translated("download", key):
                self._client.download_file(self.url.bucket, key, str(path), Config=_TRANSFER)

        self._patiently(read)

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix``, in key order. Blocking."""

        def read() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            with self._translated("list", prefix):
                pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.url.bucket, Prefix=prefix)
                for page in pages:
                    found.extend(
                        ObjectInfo(item["Key"], int(item["Size"]), item["LastModified"].timestamp())
                        for item in page.get("Contents", [])
                    )
            return found

        return self._patiently(read)

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys``, a thousand per request; a key that fails is a CheckpointError
        naming it. Blocking."""
        for start in range(0, len(keys), 1000):
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            with self._translated("delete", batch[0]["Key"]):
                answer = self._client.delete_objects(Bucket=self.url.bucket, Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise CheckpointError(
                    f"{self.url.url_of(first['Key'])}: delete failed ({first.get('Code')}: {first.get('Message')}); "
                    f"{len(answer['Errors'])} key(s) not deleted"
                )

    def abort_uploads(self, prefix: str) -> int:
        """Abort every unfinished multipart upload under ``prefix``; how many. Blocking."""
        aborted = 0
        with self._translated("abort uploads under", prefix):
            pages = self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self.url.bucket, Prefix=prefix)
            for page in pages:
                for upload in page.get("Uploads", []):
                    self._client.abort_multipart_upload(
                        Bucket=self.url.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
        return aborted

    @contextlib.contextmanager
    def _translated(self, action: str, key: str, passes: frozenset[str] | set[str] = frozenset()) -> Iterator[None]:
        """Turn botocore's errors into CheckpointError / TransientError naming the endpoint, the
        object and the cause (never a credential); a ClientError whose code is in ``passes``
        is re-raised for the caller to read."""
        where = f"{self.url.url_of(key)} at {self.endpoint}"
        try:
            yield
        except botocore.exceptions.ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in passes:
                raise
            raise self._client_error(action, where, code, error) from None
        except boto3.exceptions.S3UploadFailedError as error:
            raise self._upload_error(where, str(error)) from None
        except (
            botocore.exceptions.EndpointConnectionError,
            botocore.exceptions.ConnectionClosedError,
            botocore.exceptions.ConnectTimeoutError,
            botocore.exceptions.ReadTimeoutError,
        ) as error:
            raise TransientError(f"cannot {action} {where}: the server did not answer ({error})") from None
        except botocore.exceptions.NoCredentialsError:
            raise CheckpointError(
                f"cannot {action} {where}: no credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE naming a profile in ~/.aws"
            ) from None
        except botocore.exceptions.BotoCoreError as error:
            raise TransientError(f"cannot {action} {where}: {error}") from None

    def _client_error(self, action: str, where: str, code: str, error: Exception) -> CheckpointError:
        """The error a server's refusal becomes: missing bucket, denied and missing key named
        as such; throttling and 5xx transient."""
        if code == "NoSuchBucket":
            return CheckpointError(f"cannot {action} {where}: bucket {self.url.bucket!r} does not exist")
        if code in _ACCESS_CODES:
            return CheckpointError(
                f"cannot {action} {where}: access denied ({code}); check the credentials "
                "(AWS_ACCESS_KEY_ID / AWS_PROFILE) and the bucket's policy"
            )
        if code in _MISSING_CODES:
            return CheckpointError(f"cannot {action} {where}: no such object")
        if code in _TRANSIENT_CODES:
            return ServerFailingError(f"cannot {action} {where}: the server is busy or failing ({code})")
        return CheckpointError(f"cannot {action} {where}: {error}")

    def _upload_error(self, where: str, message: str) -> CheckpointError:
        """s3transfer wraps the server's refusal in a message; name the cause found in it."""
        for code in ("NoSuchBucket", *sorted(_ACCESS_CODES)):
            if f"({code})" in message:
                return self._client_error("upload", where, code, Exception(message))
        return TransientError(f"cannot upload {where}: {message}")


class S3ObjectWriter:
    """An object written part by part from memory: a :class:`~areal_ckpt.fsio.FileWriter` that
    uploads instead of writing a local file. What :meth:`write` is given is not copied: each
    64 MiB part is a list of views of it (checksummed meanwhile), read by the upload straight
    from the caller's memory (as the FileWriter Protocol allows: it stays unchanged until
    :meth:`close`). Each full part goes up on a helper thread, at most 8 at once, and
    :meth:`write` waits while 8 are in flight, so what the parts keep alive stays bounded at
    about 9 parts. :meth:`close` sends the last part and completes the multipart upload, so the
    object appears whole or not at all; an object under 64 MiB is one PUT at :meth:`close`.
    Errors are the store's (CheckpointError / TransientError naming the key); after one, or on
    :meth:`abort`, the parts are discarded on the server. Used by one writing thread."""

    def __init__(self, store: S3Store, key: str) -> None:
        self._store, self._key, self._bucket = store, key, store.url.bucket
        self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="areal_ckpt-part")
        self._slots = threading.BoundedSemaphore(_WORKERS)
        self._parts: list[Future[dict[str, Any]]] = []
        self._views: list[memoryview] = []  # the part being gathered
        self._filled, self._size = 0, 0
        self._crc = RunningCrc(max_pending=4)
        self._upload_id: str | None = None

    def write(self, data: memoryview | bytes) -> None:
        """Append ``data`` (kept and read until :meth:`close` returns, never copied); blocks
        while 8 parts are in flight. Raises the first failed part's error."""
        view = memoryview(data).cast("B")
        self._crc.update(view)
        self._size += len(view)
        while view:
            piece = view[: _PART - self._filled]
            self._views.append(piece)
            self._filled += len(piece)
            view = view[len(piece) :]
            if self._filled == _PART:
                self._send(self._views)
                self._views, self._filled = [], 0

    def close(self) -> FileRecord:
        """Upload what is left and complete the object; returns its size and CRC-32. Blocking;
        aborts the upload on failure."""
        try:
            if self._upload_id is None:
                with self._store._translated("upload", self._key):
                    self._store._client.put_object(Bucket=self._bucket, Key=self._key, Body=b"".join(self._views))
            else:
                if self._filled:
                    self._send(self._views)
                parts = [part.result() for part in self._parts]
                with self._store._translated("upload", self._key):
                    self._store._client.complete_multipart_upload(
                        Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
                    )
                self._upload_id = None
            return FileRecord(size=self._size, crc32=self._crc.value())
        except BaseException:
            self.abort()
            raise
        finally:
            self._pool.shutdown(cancel_futures=True)

    def abort(self) -> None:
        """Stop: queued parts cancelled, those in flight waited for, the upload aborted on the
        server (best effort: the next start removes what is left). Idempotent."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        upload, self._upload_id = self._upload_id, None
        if upload is not None:
            try:
                with self._store._translated("abort the upload of", self._key):
                    self._store._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=upload)
            except CheckpointError as error:
                logger.warning("%s", error)

    def _send(self, part: list[memoryview]) -> None:
        for done in self._parts:  # fail early: a part that failed stops the writer at its next part
            if done.done() and done.exception() is not None:
                done.result()
        if self._upload_id is None:
            with self._store._translated("upload", self._key):
                answer = self._store._client.create_multipart_upload(Bucket=self._bucket, Key=self._key)
            self._upload_id = str(answer["UploadId"])
        self._slots.acquire()
        self._parts.append(self._pool.submit(self._upload_part, len(self._parts) + 1, part))

    def _upload_part(self, number: int, views: list[memoryview]) -> dict[str, Any]:
        try:
            with self._store._translated("upload", self._key):
                answer = self._store._client.upload_part(
                    Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=_Views(views)
                )
        finally:
            self._slots.release()
        part = {"PartNumber": number, "ETag": answer["ETag"]}
        for checksum in ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumSHA1", "ChecksumSHA256", "ChecksumCRC64NVME"):
            if checksum in answer:
                part[checksum] = answer[checksum]
        return part


class _Views(io.RawIOBase):
    """A seekable, read-only file over a list of memory views, end to end: the body of one
    part, read (and re-read on a retry) by the HTTP client without first copying it into one
    buffer."""

    def __init__(self, views: list[memoryview]) -> None:
        super().__init__()
        self._views = views
        self._starts = list(itertools.accumulate((len(view) for view in views), initial=0))
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._starts[-1]}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        copied = 0
        index = bisect.bisect_right(self._starts, self._position) - 1
        while copied < len(target) and index < len(self._views):
            view = self._views[index][self._position - self._starts[index] :]
            take = min(len(view), len(target) - copied)
            target[copied : copied + take] = view[:take]
            copied += take
            self._position += take
            index += 1
        return copied
