"""Durable file primitives: the checksums and sizes recorded are those of the bytes on disk."""

from __future__ import annotations

import errno
import os
import zlib

import pytest

from areal_ckpt.fsio import ChecksummedWriter, copy_durably, crc32, record_of, write_file_durably


def test_crc32_has_zlib_values_also_when_chained():
    data = os.urandom(3 << 20)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[12345:], crc32(data[:12345])) == zlib.crc32(data)


def test_a_streamed_file_is_recorded_as_written_across_writeback_steps(tmp_path):
    pieces = [os.urandom(n) for n in (1, 5 << 20, 7 << 20, 3, 9 << 20)]  # crosses several 8 MiB writeback steps
    writer = ChecksummedWriter(tmp_path / "data.bin")
    for piece in pieces:
        writer.write(memoryview(piece))
    record = writer.close()
    on_disk = (tmp_path / "data.bin").read_bytes()
    assert on_disk == b"".join(pieces)
    assert (record.size, record.crc32) == (len(on_disk), zlib.crc32(on_disk))
    assert record_of(tmp_path / "data.bin") == record


def test_write_file_durably_replaces_the_content(tmp_path):
    path = tmp_path / "state.json"
    write_file_durably(path, b"x" * 100)
    record = write_file_durably(path, b"{}")
    assert path.read_bytes() == b"{}" and record.size == 2 and record.crc32 == zlib.crc32(b"{}")


def test_record_of_matches_zlib_for_a_file_of_one_piece_and_of_several(tmp_path, monkeypatch):
    monkeypatch.setattr("areal_ckpt.fsio._CHUNK", 1 << 20)
    for name, size in (("one.bin", 1 << 20), ("several.bin", (3 << 20) + 17)):
        data = os.urandom(size)
        (tmp_path / name).write_bytes(data)
        record = record_of(tmp_path / name)
        assert (record.size, record.crc32) == (size, zlib.crc32(data))


def _refuse_kernel_copy(errno_value: int, after: int = 0):  # type: ignore[no-untyped-def]
    """os.copy_file_range that moves ``after`` bytes once, then fails with ``errno_value``."""
    real = os.copy_file_range
    calls = {"n": 0}

    def copy_file_range(source: int, target: int, count: int) -> int:
        calls["n"] += 1
        if calls["n"] == 1 and after:
            return real(source, target, after)
        raise OSError(errno_value, os.strerror(errno_value))

    return copy_file_range


@pytest.mark.parametrize("route", ["kernel copy", "read-write loop"])
def test_copy_durably_copies_whole_and_records_the_copys_bytes(tmp_path, monkeypatch, route):
    data = os.urandom((9 << 20) + 123)  # more than one read buffer, not a multiple of it
    (tmp_path / "source").write_bytes(data)
    (tmp_path / "out").mkdir()
    if route == "read-write loop":  # what a pair of file systems without an in-kernel copy gets
        monkeypatch.setattr(os, "copy_file_range", _refuse_kernel_copy(errno.EXDEV))
    record = copy_durably(tmp_path / "source", tmp_path / "out/copy")
    assert (tmp_path / "out/copy").read_bytes() == data
    assert (record.size, record.crc32) == (len(data), zlib.crc32(data))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["copy"]  # no temporary file left


def test_a_copy_that_fails_part_way_is_an_error_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "source").write_bytes(os.urandom(4 << 20))
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(os, "copy_file_range", _refuse_kernel_copy(errno.EIO, after=1 << 20))
    with pytest.raises(OSError, match="Input/output error"):
        copy_durably(tmp_path / "source", tmp_path / "out/copy")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_kernel_copy_that_moves_nothing_of_a_file_that_holds_bytes_falls_back_to_the_read_write_loop(
    tmp_path, monkeypatch
):
    data = os.urandom((3 << 20) + 5)
    (tmp_path / "source").write_bytes(data)
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(os, "copy_file_range", lambda source, target, count: 0)  # some file systems answer so
    record = copy_durably(tmp_path / "source", tmp_path / "out/copy")
    assert (tmp_path / "out/copy").read_bytes() == data
    assert (record.size, record.crc32) == (len(data), zlib.crc32(data))
    (tmp_path / "empty").write_bytes(b"")
    assert copy_durably(tmp_path / "empty", tmp_path / "out/empty").size == 0  # an empty file stays one
