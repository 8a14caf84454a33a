"""Azure Blob Storage through azure-storage-blob (``az://container/prefix``).

The account and its credentials come from the SDK's standard variables only:
``AZURE_STORAGE_CONNECTION_STRING`` (which may name an emulator's endpoint, as Azurite's does),
or ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY``; never from a checkpoint
config, never logged. Create-only writes are ``If-None-Match: *``; large objects go up as
staged blocks that become the blob only when the block list is committed. Every call is
bounded (connect and read timeouts, a bounded number of attempts).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import azure.core.exceptions as azure_errors
from azure.storage.blob import BlobBlock, BlobServiceClient, ContainerClient, ExponentialRetry

from areal_ckpt.errors import CheckpointError, TransientError
from areal_ckpt.storage.objects import ObjectInfo, ServerFailingError, no_answer, patiently, request_timeout
from areal_ckpt.storage.parts import PART_WORKERS, PartWriter, Views
from areal_ckpt.urls import ObjectURL

logger = logging.getLogger(__name__)
# the SDK logs every request and response at INFO; a job logging at INFO would get pages of it
# per checkpoint. Quieted unless the user set that logger's level already.
_SDK_REQUESTS = logging.getLogger("azure.core.pipeline.policies.http_logging_policy")
if _SDK_REQUESTS.level == logging.NOTSET:
    _SDK_REQUESTS.setLevel(logging.WARNING)


_RETRIES = 4
_WAITS_SECONDS = 18.0  # about 1 + 3 + 5 + 9: the SDK's exponential waits before the 4 tries
_RETRY_TIMEOUTS = 4  # as GCS: a store set to wait briefly gives up about as briefly


class _LoggedRetry(ExponentialRetry):
    """The SDK's exponential retry, each wait before another try logged (no wait on the server
    goes unlogged), every wait scaled by ``scale``."""

    def __init__(self, scale: float, **settings: Any) -> None:
        super().__init__(**settings)
        self.scale = scale

    def get_backoff_time(self, settings: dict[str, Any]) -> float:
        """The SDK's back-off (with its jitter) times ``scale``."""
        return float(super().get_backoff_time(settings)) * self.scale

    def sleep(self, settings: dict[str, Any], transport: Any) -> None:
        failed = settings["history"][-1] if settings.get("history") else None
        cause = getattr(failed, "error", None) or getattr(getattr(failed, "http_response", None), "status_code", "?")
        logger.warning("Azure Blob request failed (%s); try %d of %d more", cause, settings["count"], _RETRIES)
        super().sleep(settings, transport)  # type: ignore[no-untyped-call]  # the SDK leaves it unannotated


def _settings() -> dict[str, Any]:
    """Bounded calls: connect and read timeouts (:func:`request_timeout`), 4 more tries after
    waits of about 1, 3, 5 and 9 s (shortened to about four request timeouts in all when those
    are shorter), each logged."""
    timeout = request_timeout()
    scale = min(1.0, _RETRY_TIMEOUTS * timeout / _WAITS_SECONDS)
    return {
        "connection_timeout": 10,
        "read_timeout": timeout,
        "retry_policy": _LoggedRetry(  # each kind of failure gets them all (the SDK's default: 3 each)
            scale,
            initial_backoff=1,
            increment_base=2,
            retry_total=_RETRIES,
            retry_connect=_RETRIES,
            retry_read=_RETRIES,
            retry_status=_RETRIES,
        ),
    }


_DELETE_BATCH = 256  # a batch request holds at most 256 sub-requests
_CREDENTIALS_HINT = "set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY"


def _code(error: Exception) -> str | None:
    """The service's error code (``ContainerNotFound``...), which the SDK sets on its errors."""
    code = getattr(error, "error_code", None)
    return None if code is None else str(code)


def _service() -> BlobServiceClient:
    """The account's client from the standard variables; CheckpointError naming them when
    neither form is set. Contacts nothing."""
    connection = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection:
        return BlobServiceClient.from_connection_string(connection, **_settings())
    account, key = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"), os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    if account and key:
        return BlobServiceClient(f"https://{account}.blob.core.windows.net", credential=key, **_settings())
    raise CheckpointError(f"no Azure storage account configured; {_CREDENTIALS_HINT}")


class AzureStore:
    """An :class:`~areal_ckpt.storage.objects.ObjectStore` on one Azure Blob container.
    Creating one contacts nothing; :meth:`check_access` does. Thread-safe (the SDK's clients
    may be shared between threads); not picklable: background writers make their own."""

    def __init__(self, url: ObjectURL) -> None:
        self.url = url
        request_timeout()  # a bad value is refused naming its variable, before the account is looked for
        self._container: ContainerClient | None = None
        self.endpoint = "(no account configured)"
        self._service: BlobServiceClient | None = None
        try:  # the account's endpoint is part of what a local copy of this container records
            self._service = _service()
            self.endpoint = self._service.url.rstrip("/")
        except (CheckpointError, ValueError):  # said by the first request, naming the variables to set
            pass

    def container(self) -> ContainerClient:
        """The SDK's container client, made on first use from the standard variables."""
        if self._container is None:
            try:
                service = self._service or _service()
            except CheckpointError as error:
                raise CheckpointError(f"cannot reach {self.url}: {error}") from None
            self.endpoint = service.url.rstrip("/")
            self._container = service.get_container_client(self.url.bucket)
        return self._container

    def check_access(self) -> None:
        """List one key of the container; CheckpointError naming the endpoint, container and
        cause (unreachable, no such container, denied) otherwise. Blocking."""
        with self._translated("list", self.url.key()):
            next(iter(self.container().list_blobs(name_starts_with=self.url.key(), results_per_page=1)), None)

    def put_file(self, key: str, path: Path) -> None:
        """Upload ``path`` as ``key`` (staged blocks in parallel past 64 MiB; the blob appears
        when its block list is committed). Blocking."""
        with self._translated("upload", key), path.open("rb") as source:
            self.container().upload_blob(
                key, source, length=path.stat().st_size, overwrite=True, max_concurrency=PART_WORKERS
            )

    def put_bytes(self, key: str, data: bytes, create_only: bool = False) -> bool:
        """One upload of ``data``; with ``create_only`` conditional on no blob having ``key``
        (``If-None-Match: *``): False, nothing written, when one has. Blocking."""
        try:
            with self._translated("write", key, passes=(azure_errors.ResourceExistsError,)):
                self.container().upload_blob(key, data, overwrite=not create_only)
        except azure_errors.ResourceExistsError:
            return False
        return True

    def open_writer(self, key: str) -> AzureObjectWriter:
        """A writer of the blob ``key`` that stages each 64 MiB block from memory as soon as it
        is full (see :class:`AzureObjectWriter`); contacts nothing until a block or the close."""
        return AzureObjectWriter(self, key)

    def get_bytes(self, key: str) -> bytes | None:
        """The blob ``key`` read whole, or None when there is none. Blocking."""

        def read() -> bytes | None:
            try:
                with self._translated("read", key, passes=(azure_errors.ResourceNotFoundError,)):
                    return self.container().download_blob(key).readall()
            except azure_errors.ResourceNotFoundError as error:
                if _code(error) == "ContainerNotFound":
                    raise self._missing_container("read", key) from None
                return None

        return patiently(read)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged read of ``key``: ``length`` bytes from ``start``. Blocking."""

        def read() -> bytes:
            with self._translated("read", key):
                return self.container().download_blob(key, offset=start, length=length).readall()

        return patiently(read)

    def get_file(self, key: str, path: Path) -> None:
        """Download ``key`` into ``path`` (parallel ranged reads when large). Blocking."""

        def read() -> None:
            with self._translated("download", key), path.open("wb") as target:
                self.container().download_blob(key, max_concurrency=PART_WORKERS).readinto(target)

        patiently(read)

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        """Every blob under ``prefix``, in key order. Blocking."""

        def read() -> list[ObjectInfo]:
            with self._translated("list", prefix):
                return [
                    ObjectInfo(blob.name, int(blob.size), blob.last_modified.timestamp())
                    for blob in self.container().list_blobs(name_starts_with=prefix)
                ]

        return patiently(read)

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys``, 256 per batch request; a missing key is no error, any other failure
        a CheckpointError naming the key. Blocking."""
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            with self._translated("delete", batch[0]):
                answers = list(self.container().delete_blobs(*batch, raise_on_any_failure=False))
            failed = [(key, answer.status_code) for key, answer in zip(batch, answers) if answer.status_code >= 300]
            failed = [(key, status) for key, status in failed if status != 404]
            if failed:
                raise CheckpointError(
                    f"{self.url.url_of(failed[0][0])}: delete failed (HTTP {failed[0][1]}); {len(failed)} key(s) not deleted"
                )

    def abort_uploads(self, prefix: str, spared: frozenset[str] = frozenset()) -> int:
        """Nothing to abort: blocks staged and never committed hold no blob and are discarded
        by the service (after a week). Returns 0."""
        return 0

    def _missing_container(self, action: str, key: str) -> CheckpointError:
        return CheckpointError(
            f"cannot {action} {self.url.url_of(key)} at {self.endpoint}: container {self.url.bucket!r} does not exist"
        )

    @contextlib.contextmanager
    def _translated(self, action: str, key: str, passes: tuple[type[Exception], ...] = ()) -> Iterator[None]:
        """Turn the SDK's errors into CheckpointError / TransientError naming the endpoint, the
        blob and the cause (never a credential); an error of a type in ``passes`` is re-raised
        for the caller to read."""
        try:
            yield
        except passes:
            raise
        except azure_errors.ResourceNotFoundError as error:
            if _code(error) == "ContainerNotFound":
                raise self._missing_container(action, key) from None
            raise CheckpointError(f"cannot {action} {self._where(key)}: no such object") from None
        except azure_errors.ClientAuthenticationError as error:
            raise CheckpointError(
                f"cannot {action} {self._where(key)}: access denied ({_code(error) or error.status_code}); "
                f"check the credentials ({_CREDENTIALS_HINT})"
            ) from None
        except (azure_errors.ServiceRequestError, azure_errors.ServiceResponseError) as error:
            raise TransientError(
                f"cannot {action} {self._where(key)}: the server {no_answer(error)} ({error}); the endpoint comes from AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME"
            ) from None
        except azure_errors.HttpResponseError as error:
            status = error.status_code or 0
            if status == 429 or status >= 500:
                raise ServerFailingError(
                    f"cannot {action} {self._where(key)}: the server is busy or failing ({status})"
                ) from None
            if status in (401, 403):  # a wrong account key answers AuthorizationFailure, not an authentication error
                raise CheckpointError(
                    f"cannot {action} {self._where(key)}: access denied ({_code(error) or status}); check the "
                    f"credentials ({_CREDENTIALS_HINT}) and the container's permissions"
                ) from None
            raise CheckpointError(f"cannot {action} {self._where(key)}: {_code(error) or status}") from None
        except azure_errors.AzureError as error:
            raise TransientError(f"cannot {action} {self._where(key)}: {error}") from None

    def _where(self, key: str) -> str:
        return f"{self.url.url_of(key)} at {self.endpoint}"


class AzureObjectWriter(PartWriter):
    """A blob written part by part from memory as staged blocks (see
    :class:`~areal_ckpt.storage.parts.PartWriter`): 64 MiB blocks, at most 8 in flight, the
    blob made by committing the block list; a blob under 64 MiB is one upload at ``close``.
    Staged blocks that are never committed hold no blob and are discarded by the service."""

    def __init__(self, store: AzureStore, key: str) -> None:
        super().__init__(key)
        self._store = store

    def _begin(self) -> None:
        self._blob = self._store.container().get_blob_client(self._key)

    def _upload_part(self, number: int, views: list[memoryview]) -> BlobBlock:
        block = BlobBlock(block_id=base64.b64encode(f"{number:08d}".encode()).decode())
        with self._store._translated("upload", self._key):
            self._blob.stage_block(block.id, Views(views), length=sum(len(view) for view in views))
        return block

    def _complete(self, parts: list[Any]) -> None:
        with self._store._translated("upload", self._key):
            self._blob.commit_block_list(parts)

    def _put_whole(self, views: list[memoryview]) -> None:
        with self._store._translated("upload", self._key):
            self._store.container().upload_blob(self._key, b"".join(views), overwrite=True)

    def _discard(self) -> None:
        logger.debug("%s: staged blocks left to the service to discard", self._store.url.url_of(self._key))
