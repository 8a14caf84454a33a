"""Each store's object writer uploads straight from the caller's memory: pieces of any size,
across part boundaries, land byte for byte, with the CRC-32 of what was written (on SeaweedFS,
fake-gcs-server and Azurite)."""

from __future__ import annotations

import io
import os
import zlib

import numpy as np

from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.parts import PART_BYTES as _PART
from areal_ckpt.storage.parts import Views as _Views
from areal_ckpt.urls import parse_object_url


def test_pieces_of_every_size_across_part_boundaries_land_byte_for_byte(object_bucket):
    url = parse_object_url(f"{object_bucket}/w", "test")
    store = store_of(url)
    rng = np.random.default_rng(0)
    pieces = [os.urandom(size) for size in (1, 3 << 20, _PART - (3 << 20) - 1, _PART + 5, 7, (2 << 20) + 3)]
    pieces.append(memoryview(rng.standard_normal(1 << 20).astype(np.float32)))  # a view of an array, not bytes
    writer = store.open_writer(url.key("object.bin"))
    for piece in pieces:
        writer.write(piece)
    record = writer.close()
    expected = b"".join(bytes(piece) for piece in pieces)
    assert record.size == len(expected) > 2 * _PART and record.crc32 == zlib.crc32(expected)
    assert store.get_bytes(url.key("object.bin")) == expected


def test_a_part_body_reads_the_same_bytes_again_after_a_seek():
    """What a retried upload does: read the body, seek back, read it again."""
    views = [memoryview(b"abc"), memoryview(b""), memoryview(b"defgh"), memoryview(b"ij")]
    body = _Views(views)
    assert body.read(4) == b"abcd" and body.tell() == 4
    assert body.read() == b"efghij"
    assert body.read(3) == b""
    body.seek(0)
    assert body.read() == b"abcdefghij"
    body.seek(-3, io.SEEK_END)
    assert body.read(2) == b"hi"
    assert body.seek(0, io.SEEK_END) == 10
