"""S3-compatible object storage through boto3 (AWS, MinIO, SeaweedFS, Ceph...).

Endpoint, region and credentials come from boto3's standard chain only: ``AWS_ENDPOINT_URL``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE`` and the files under ``~/.aws``; never from a checkpoint config, and never
logged. Large objects move as parallel multipart uploads and parallel ranged reads
(s3transfer). Every call is bounded in time (connect and read timeouts, a bounded number of
attempts by botocore), so a stalled server becomes an error instead of a hang.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import boto3.s3.transfer
import botocore.config
import botocore.exceptions

from areal_ckpt.errors import CheckpointError, TransientError
from areal_ckpt.storage.objects import ObjectInfo, ServerFailingError, no_answer, patiently, request_timeout
from areal_ckpt.storage.parts import PART_BYTES, PART_WORKERS, PartWriter, Views
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)

_TRANSFER = boto3.s3.transfer.TransferConfig(
    multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=PART_WORKERS, use_threads=True
)
_ATTEMPTS = 4
_ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "AllAccessDisabled"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "500", "502", "503", "504"}


class S3Store:
    """An :class:`~areal_ckpt.storage.objects.ObjectStore` on one bucket of an S3-compatible
    server. Creating one contacts nothing; :meth:`check_access` does. Thread-safe (one boto3
    client, which botocore makes safe to share between threads); not picklable: background
    writers make their own from the URL."""

    def __init__(self, url: ObjectURL) -> None:
        self.url = url
        session = boto3.session.Session()
        region = session.region_name or "us-east-1"  # signing needs one; S3-compatible servers ignore it
        settings = botocore.config.Config(
            connect_timeout=10,
            read_timeout=request_timeout(),
            retries={"mode": "standard", "total_max_attempts": _ATTEMPTS},
            max_pool_connections=2 * PART_WORKERS,
        )
        self._client = session.client("s3", region_name=region, config=settings)
        self.endpoint = self._client.meta.endpoint_url
        self._client.meta.events.register("needs-retry.s3", self._log_failed_attempt)

    def _log_failed_attempt(
        self, attempts: int, operation: Any, caught_exception: Exception | None = None, response: Any = None, **_: Any
    ) -> None:
        """Log an attempt that failed (no answer, or a throttling / 5xx answer), which botocore
        is about to retry or give up on: no wait on the server goes unlogged. Decides nothing."""
        status = None if response is None else response[0].status_code
        if caught_exception is None and (status is None or (status < 500 and status != 429)):
            return
        cause = caught_exception if caught_exception is not None else f"HTTP {status}"
        logger.warning(
            "%s at %s: attempt %d of %d failed (%s)", operation.name, self.endpoint, attempts, _ATTEMPTS, cause
        )

    def check_access(self) -> None:
        """List one key of the bucket; CheckpointError naming the endpoint, bucket and cause
        (unreachable, no such bucket, denied) otherwise. Blocking."""
        with self._translated("list", self.url.key()):
            self._client.list_objects_v2(Bucket=self.url.bucket, Prefix=self.url.key(), MaxKeys=1)

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

        return patiently(read)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged GET of ``key``: bytes ``start`` to ``start + length - 1``. Blocking."""

        def read() -> bytes:
            with self._translated("read", key):
                answer = self._client.get_object(
                    Bucket=self.url.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
                )
                body: bytes = answer["Body"].read()
                return body

        return patiently(read)

    def get_file(self, key: str, path: Path) -> None:
        """Download ``key`` into ``path`` (parallel ranged GETs past 64 MiB). Blocking."""

        def read() -> None:
            with self._translated("download", key):
                self._client.download_file(self.url.bucket, key, str(path), Config=_TRANSFER)

        patiently(read)

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

        return patiently(read)

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

    def abort_uploads(self, prefix: str, spared: frozenset[str] = frozenset()) -> int:
        """Abort every unfinished multipart upload under ``prefix`` but those under a prefix in
        ``spared``; how many. Blocking."""
        aborted = 0
        with self._translated("abort uploads under", prefix):
            pages = self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self.url.bucket, Prefix=prefix)
            for page in pages:
                for upload in page.get("Uploads", []):
                    if any(upload["Key"].startswith(kept) for kept in spared):
                        continue
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
            raise TransientError(
                f"cannot {action} {where}: the server {no_answer(error)} ({error}); the endpoint comes from AWS_ENDPOINT_URL (or the profile)"
            ) from None
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


class S3ObjectWriter(PartWriter):
    """An object written part by part from memory through an S3 multipart upload (see
    :class:`~areal_ckpt.storage.parts.PartWriter`): 64 MiB parts, at most 8 in flight; an
    object under 64 MiB is one PUT at ``close``. Aborting discards the uploaded parts."""

    def __init__(self, store: S3Store, key: str) -> None:
        super().__init__(key)
        self._store, self._bucket = store, store.url.bucket
        self._upload_id: str | None = None

    def _begin(self) -> None:
        with self._store._translated("upload", self._key):
            answer = self._store._client.create_multipart_upload(Bucket=self._bucket, Key=self._key)
        self._upload_id = str(answer["UploadId"])

    def _upload_part(self, number: int, views: list[memoryview]) -> dict[str, Any]:
        with self._store._translated("upload", self._key):
            answer = self._store._client.upload_part(
                Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=Views(views)
            )
        part = {"PartNumber": number, "ETag": answer["ETag"]}
        for checksum in ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumSHA1", "ChecksumSHA256", "ChecksumCRC64NVME"):
            if checksum in answer:
                part[checksum] = answer[checksum]
        return part

    def _complete(self, parts: list[Any]) -> None:
        with self._store._translated("upload", self._key):
            self._store._client.complete_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
            )

    def _put_whole(self, views: list[memoryview]) -> None:
        with self._store._translated("upload", self._key):
            self._store._client.put_object(Bucket=self._bucket, Key=self._key, Body=b"".join(views))

    def _discard(self) -> None:
        with self._store._translated("abort the upload of", self._key):
            self._store._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
