"""Durable file primitives: the checksums and sizes recorded are those of the bytes on disk."""

from __future__ import annotations

import os
import zlib

from areal_ckpt.fsio import ChecksummedWriter, crc32, record_of, write_file_durably


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
