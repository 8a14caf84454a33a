"""A test-only object store, the worked example of docs/storage.md "Adding a backend": one class
implementing the ObjectStore Protocol over a local folder, registered for the scheme
``folder://`` when this module is imported (a spawned process that imports it serves the scheme
too). Objects are files under ``$AREAL_CKPT_TEST_FOLDER_STORE/{bucket}/{key}``: written to a
temporary name and renamed (whole or not at all), create-only through ``O_EXCL`` on a link.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import ChecksummedWriter, FileRecord
from areal_ckpt.storage.backends import Backend, register_backend
from areal_ckpt.storage.objects import ObjectInfo
from areal_ckpt.urls import ObjectURL

ROOT_VARIABLE = "AREAL_CKPT_TEST_FOLDER_STORE"


class FolderStore:
    """An ObjectStore whose bucket is a local folder (for the test of a new backend only)."""

    def __init__(self, url: ObjectURL) -> None:
        self.url = url
        self.root = Path(os.environ[ROOT_VARIABLE]) / url.bucket
        self.endpoint = f"file://{self.root.parent}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def check_access(self) -> None:
        if not self.root.is_dir():
            raise CheckpointError(f"cannot list {self.url}: bucket {self.url.bucket!r} does not exist")

    def _staged(self, key: str) -> Path:
        self._path(key).parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        os.close(handle)
        return Path(name)

    def put_file(self, key: str, path: Path) -> None:
        staged = self._staged(key)
        shutil.copyfile(path, staged)
        os.replace(staged, self._path(key))

    def put_bytes(self, key: str, data: bytes, create_only: bool = False) -> bool:
        staged = self._staged(key)
        staged.write_bytes(data)
        if not create_only:
            os.replace(staged, self._path(key))
            return True
        try:
            os.link(staged, self._path(key))  # fails when the key exists: one winner
        except FileExistsError:
            return False
        finally:
            staged.unlink()
        return True

    def open_writer(self, key: str) -> _FolderWriter:
        return _FolderWriter(self._staged(key), self._path(key))

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with self._path(key).open("rb") as file:
                file.seek(start)
                return file.read(length)
        except FileNotFoundError:
            raise CheckpointError(f"cannot read {self.url.url_of(key)}: no such object") from None

    def get_file(self, key: str, path: Path) -> None:
        if not self._path(key).is_file():
            raise CheckpointError(f"cannot download {self.url.url_of(key)}: no such object")
        shutil.copyfile(self._path(key), path)

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        found = []
        for path in self.root.rglob("*"):
            key = path.relative_to(self.root).as_posix()
            if path.is_file() and not path.name.startswith(".upload-") and key.startswith(prefix):
                found.append(ObjectInfo(key, path.stat().st_size, path.stat().st_mtime))
        return sorted(found, key=lambda item: item.key)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def abort_uploads(self, prefix: str, spared: frozenset[str] = frozenset()) -> int:
        return 0


class _FolderWriter:
    """A FileWriter whose object appears (renamed into place) at close."""

    def __init__(self, staged: Path, final: Path) -> None:
        self._writer, self._staged, self._final = ChecksummedWriter(staged, durable=False), staged, final

    def write(self, data: memoryview | bytes) -> None:
        self._writer.write(data)

    def close(self) -> FileRecord:
        record = self._writer.close()
        os.replace(self._staged, self._final)
        return record

    def abort(self) -> None:
        self._writer.abort()
        self._staged.unlink(missing_ok=True)


register_backend("folder", Backend(FolderStore, (ROOT_VARIABLE,)))
