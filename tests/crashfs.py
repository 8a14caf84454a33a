"""A FUSE file system that remembers what a power cut would keep, and the disk states after one.

``python crashfs.py BACKING MOUNT LOG`` serves BACKING at MOUNT (a real FUSE mount, libfuse3
through mfusepy): every operation is applied to BACKING at once, so the programs under test see
an ordinary file system. Beside that it appends to LOG each change to what would survive a
power cut, under a persistence model (written down in docs/reliability.md):

- a file's data survives as it was at its last ``fsync`` / ``fdatasync``; written but never
  synced, it is lost (the file is empty); ``sync_file_range`` is not durability and FUSE does
  not even see it;
- a directory's entries (creates, renames, links, unlinks, mkdir, rmdir in it) survive as they
  were at its last ``fsync``; model ``strict`` (event ``dir``) keeps only those, model
  ``eager_metadata`` (events ``dir`` and ``ns``) keeps every entry change at once, as a journal
  that commits metadata ahead of data can, so a rename of a never-synced file is seen with
  the file empty.

:func:`crash_states` replays LOG to each point where the durable state changed, and
:func:`materialize` writes one such state as an ordinary folder, to be loaded as after a reboot.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Entries = dict[str, list[Any]]  # name -> [inode, kind ("f" | "d" | "l"), symlink target or None]


class CrashFS:
    """The FUSE operations (see the module docstring); only the ones our writers use."""

    def __init__(self, backing: Path, log: Path) -> None:
        self.backing = backing
        self.blobs = log.parent / "blobs"
        self.blobs.mkdir(exist_ok=True)
        self.log = open(log, "a", buffering=1)
        self._event({"e": "root", "ino": os.lstat(backing).st_ino})
        for folder, _, files in os.walk(backing):  # what is there at mount is on disk already
            self._event({"e": "dir", "ino": os.lstat(folder).st_ino, "entries": self._entries(folder)})
            for name in files:
                path = os.path.join(folder, name)
                if not os.path.islink(path):
                    self._durable_data(os.lstat(path).st_ino, Path(path).read_bytes())

    # -- the durability log ---------------------------------------------------------------

    def _event(self, event: dict[str, Any]) -> None:
        self.log.write(json.dumps(event) + "\n")

    def _durable_data(self, inode: int, data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        if not (self.blobs / digest).exists():
            (self.blobs / digest).write_bytes(data)
        self._event({"e": "data", "ino": inode, "blob": digest})

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _entries(self, directory: str) -> Entries:
        entries: Entries = {}
        for name in os.listdir(directory):
            info = os.lstat(os.path.join(directory, name))
            kind = "d" if stat.S_ISDIR(info.st_mode) else "l" if stat.S_ISLNK(info.st_mode) else "f"
            target = os.readlink(os.path.join(directory, name)) if kind == "l" else None
            entries[name] = [info.st_ino, kind, target]
        return entries

    def _namespace(self, *paths: str) -> None:
        """Entries of the parent folders of ``paths`` changed, in one operation (a rename between
        two folders is one journal transaction: model eager_metadata keeps both sides or none)."""
        parents = {os.path.dirname(self._real(path).rstrip("/")) for path in paths}
        self._event({"e": "ns", "dirs": {str(os.lstat(parent).st_ino): self._entries(parent) for parent in parents}})

    # -- FUSE operations ------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        info = os.lstat(self._real(path))
        keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime", "st_mtime", "st_ctime", "st_ino")
        return {key: getattr(info, key) for key in keys}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._real(path))]

    def opendir(self, path: str) -> int:
        return os.open(self._real(path), os.O_RDONLY | os.O_DIRECTORY)

    def releasedir(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        real = self._real(path)
        self._event({"e": "dir", "ino": os.lstat(real).st_ino, "entries": self._entries(real)})
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._real(path), mode)
        self._namespace(path)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._real(path))
        self._namespace(path)
        return 0

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        fd = os.open(self._real(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
        self._namespace(path)
        return fd

    def open(self, path: str, flags: int) -> int:
        return os.open(self._real(path), flags & ~os.O_DIRECT)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        os.truncate(self._real(path) if fh is None else fh, length)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._durable_data(os.fstat(fh).st_ino, os.pread(fh, os.fstat(fh).st_size, 0))
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._real(old), self._real(new))
        self._namespace(old, new)
        return 0

    def link(self, target: str, source: str) -> int:
        os.link(self._real(source), self._real(target))
        self._namespace(target)
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._real(path))
        self._namespace(path)
        return 0

    def symlink(self, target: str, source: str) -> int:
        os.symlink(source, self._real(target))
        self._namespace(target)
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0

    def utimens(self, path: str, times: Any = None) -> int:
        os.utime(self._real(path), ns=times)
        return 0

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise OSError(errno.EACCES, path)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        info = os.statvfs(self._real(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize")
        return {key: getattr(info, key) for key in keys} | {"f_namemax": info.f_namemax}


def serve(backing: Path, mount: Path, log: Path) -> None:
    """Serve ``backing`` at ``mount`` until unmounted (blocking, one thread)."""
    import mfusepy

    class Operations(CrashFS, mfusepy.Operations):
        use_ns = True

    mfusepy.FUSE(Operations(backing, log), str(mount), foreground=True, nothreads=True, default_permissions=True)


# -- replay: the disk after a power cut -----------------------------------------------------


class DurableState:
    """What survives after the events replayed so far, under one model."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.root = 0
        self.dirs: dict[int, Entries] = {}
        self.data: dict[int, str] = {}

    def apply(self, event: dict[str, Any]) -> bool:
        """Take ``event``; True when it changed what survives under this model."""
        kind = event["e"]
        if kind == "root":
            self.root = event["ino"]
            return False
        if kind == "data":
            changed = self.data.get(event["ino"]) != event["blob"]
            self.data[event["ino"]] = event["blob"]
            return changed
        if kind == "dir":
            changed = self.dirs.get(event["ino"]) != event["entries"]
            self.dirs[event["ino"]] = event["entries"]
            return changed
        if kind == "ns" and self.model == "eager_metadata":
            updates = {int(inode): entries for inode, entries in event["dirs"].items()}
            changed = any(self.dirs.get(inode) != entries for inode, entries in updates.items())
            self.dirs.update(updates)
            return changed
        return False

    def snapshot(self) -> DurableState:
        copy = DurableState(self.model)
        copy.root, copy.dirs, copy.data = self.root, dict(self.dirs), dict(self.data)
        return copy


def crash_states(log: Path, model: str, after: int = 0) -> Iterator[tuple[int, DurableState]]:
    """(event index, state) after event ``after`` (the mount's snapshot of what was there) and
    after every later event that changed what survives."""
    state = DurableState(model)
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    for index, event in enumerate(events):
        if (state.apply(event) and index > after) or index == after:
            yield index, state.snapshot()


def materialize(state: DurableState, blobs: Path, target: Path) -> None:
    """Write ``state`` into the new folder ``target``: the disk as the rebooted machine sees it.

    The model keys folders by inode number, and the backing file system reuses the number of a
    deleted folder, so a stale entry of a never-synced parent can name a folder that now holds
    that parent: an entry naming a folder it is inside of is left out (a disk holds no cycle)."""
    target.mkdir(parents=True)
    placed: dict[int, Path] = {}

    def fill(directory: int, where: Path, inside: frozenset[int] = frozenset()) -> None:
        for name, (inode, kind, link_target) in sorted(state.dirs.get(directory, {}).items()):
            path = where / name
            if kind == "d":
                if inode in inside or inode == directory:
                    continue
                path.mkdir()
                fill(inode, path, inside | {directory})
            elif kind == "l":
                path.symlink_to(link_target)
            elif inode in placed:
                os.link(placed[inode], path)
            else:
                blob = state.data.get(inode)
                if blob is None:
                    path.write_bytes(b"")  # created, never synced: its data is gone
                else:
                    shutil.copyfile(blobs / blob, path)
                placed[inode] = path

    fill(state.root, target)


# -- a mount for a test or a torture scenario ------------------------------------------------

MODELS = ("strict", "eager_metadata")


def mark_returned(log: Path, returns: Path) -> None:
    """Record that a save returned now (any process may call it, e.g. a distributed worker)."""
    with open(returns, "a") as handle:
        handle.write(f"{len(log.read_text().splitlines())}\n")


class Mounted:
    """A crashfs mount for one test (of ``backing``, which may hold files already: they count as
    on disk); ``returned()`` marks where a save had returned."""

    def __init__(self, root: Path, backing: Path | None = None) -> None:
        self.backing = backing or root / "backing"
        self.mount, self.log = root / "mount", root / "events.jsonl"
        for folder in (self.backing, self.mount):
            folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(self.backing), str(self.mount), str(self.log)],
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mount):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"crashfs did not mount: {self.process.stderr.read().decode()[-2000:]}")
            time.sleep(0.02)
        self.returns_file = root / "returns.txt"
        self.mounted_at = len(self.log.read_text().splitlines()) - 1  # the snapshot of what was there

    def returned(self) -> None:
        """The save in progress returned: everything it promised is durable from here on."""
        mark_returned(self.log, self.returns_file)

    @property
    def returns(self) -> list[int]:
        """The event index at which each save returned, in order."""
        text = self.returns_file.read_text() if self.returns_file.exists() else ""
        return [int(line) for line in text.split()]

    def close(self) -> None:
        """Unmount (once) and wait for the file system's process."""
        if self.process.poll() is None and os.path.ismount(self.mount):
            subprocess.run(["fusermount3", "-u", str(self.mount)], check=False)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def count(self, model: str) -> int:
        """How many distinct disk states a cut could leave under ``model``."""
        return sum(1 for _ in crash_states(self.log, model, self.mounted_at))

    def states(self, model: str, scratch: Path, only: set[int] | None = None) -> Iterator[tuple[int, int | None, Path]]:
        """(event index, the newest save that had returned by then or None, the disk as a
        folder) for every state, or for the ``only`` ones (by their order, 0 first)."""
        for number, (index, state) in enumerate(crash_states(self.log, model, self.mounted_at)):
            if only is not None and number not in only:
                continue
            done = [save for save, at in enumerate(self.returns) if at <= index]
            target = scratch / f"{model}-{number}"
            materialize(state, self.log.parent / "blobs", target)
            yield index, (done[-1] if done else None), target
            shutil.rmtree(target)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
