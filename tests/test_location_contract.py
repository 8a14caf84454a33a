"""The location contract's own tests (:class:`areal_ckpt.storage.location.Location`), run unchanged
against a folder and each object store (SeaweedFS, fake-gcs-server, Azurite on 127.0.0.1): what
a commit makes visible, what a pointer and a label name, what an unfinished save leaves, what
retention removes. The consumers (exports, DeepSpeed tags, the command line's outputs) rely on
exactly these."""

from __future__ import annotations

import secrets
import zlib

import pytest

from areal_ckpt.errors import CheckpointError
from areal_ckpt.fsio import FileRecord, write_file_durably
from areal_ckpt.paths import MANIFEST_NAME, RECOVER_MANIFEST, generation_name, generation_step, is_generation_name
from areal_ckpt.publish import write_manifest
from areal_ckpt.storage.folders import check_checkpoint
from areal_ckpt.storage.location import Location, location_of, recommit_newest_intact, recovery_location_of, retain
from areal_ckpt.storage.retention import ReplaceSameLabel
from areal_ckpt.urls import locate


def _step_of(name: str) -> int | None:
    """A folder location's series: the names this suite commits."""
    return 0 if name.startswith("save") else None


def _save(
    location: Location,
    label: str,
    payload: bytes,
    *,
    point: bool,
    recorded: bytes | None = None,
    manifest: str = MANIFEST_NAME,
) -> str:
    """One whole save of ``label`` by a world of one: reserve the label, stage, write a file
    (through the location's writer when it has one), put, manifest, commit recording the label.
    ``recorded``: the bytes the manifest's record of that file describes, when not ``payload``
    (a file that rotted after its record was taken); ``manifest``: the location's manifest
    name. Returns the reserved name."""
    reserved = location.reserve(label)
    staging = location.stage(label, 0)
    write = location.writer_of(reserved)
    if write is None:
        record = write_file_durably(staging / "data.bin", payload)
        uploaded: set[str] = set()
    else:
        writer = write("data.bin")
        writer.write(payload)
        record = writer.close()
        uploaded = {"data.bin"}
    if recorded is not None:
        record = FileRecord(len(recorded), zlib.crc32(recorded))
    note = write_file_durably(staging / "note.txt", label.encode())
    location.put_own(staging, reserved, ["note.txt"])
    (staging / manifest).parent.mkdir(parents=True, exist_ok=True)
    write_manifest(staging, manifest, {"data.bin": record, "note.txt": note}, {"label": label})
    location.commit(staging, reserved, uploaded | {"note.txt"}, {"tag": label}, point=point)
    location.unstage(staging, 0)
    return reserved


@pytest.fixture
def location(persistent_root) -> Location:  # type: ignore[no-untyped-def]
    """A fresh location on each store in turn: a folder, and a prefix of each object store."""
    return location_of(f"{persistent_root.root}/saves-{secrets.token_hex(3)}", "location", pointer="latest")


def test_an_empty_location_has_nothing_committed_no_pointer_and_no_label(location):
    assert location.committed(_step_of) == []
    assert location.pointed() is None
    assert location.named("t1") is None


def test_a_commit_is_listed_pointed_at_named_and_read_back_byte_for_byte(location, tmp_path):
    reserved = _save(location, "save1", b"weights-1" * 1000, point=True)
    assert [entry.name for entry in location.committed(_step_of)] == [reserved]
    assert location.pointed() == reserved and location.named("save1") == reserved
    location.files_of(reserved).get_file("data.bin", tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == b"weights-1" * 1000
    opened = location.open(reserved, secrets.token_hex(4))
    assert (opened.folder / MANIFEST_NAME).is_file() and (opened.folder / "note.txt").read_bytes() == b"save1"


def test_a_commit_that_does_not_point_leaves_the_pointer_where_it_was(location):
    first = _save(location, "save1", b"a", point=True)
    second = _save(location, "save2", b"b", point=False)
    assert location.pointed() == first and location.named("save2") == second
    assert sorted(entry.name for entry in location.committed(_step_of)) == sorted([first, second])


def test_a_label_saved_again_replaces_its_older_save_and_keeps_the_others(location, tmp_path):
    kept = _save(location, "save-other", b"o", point=False)
    _save(location, "save1", b"old", point=False)
    newest = _save(location, "save1", b"new", point=True)
    retain(location, ReplaceSameLabel(), newest)
    names = sorted(entry.name for entry in location.committed(_step_of))
    assert names == sorted([kept, newest])
    assert location.named("save1") == newest and location.pointed() == newest
    location.files_of(newest).get_file("data.bin", tmp_path / "newest.bin")
    assert (tmp_path / "newest.bin").read_bytes() == b"new"


def test_an_unfinished_save_is_never_committed_and_leaves_nothing_once_discarded_and_tidied(location, tmp_path):
    committed = _save(location, "save1", b"a", point=True)
    reserved = location.reserve("save2")
    staging = location.stage("save2", 0)
    write = location.writer_of(reserved)
    if write is not None:
        writer = write("data.bin")
        writer.write(b"half")
        writer.close()
    location.discard(reserved)
    location.unstage(staging, 0)
    location.tidy()
    assert [entry.name for entry in location.committed(_step_of)] == [committed]
    assert location.pointed() == committed
    with pytest.raises(CheckpointError, match="data.bin"):  # nothing of it is left to read
        location.files_of(reserved).get_file("data.bin", tmp_path / "half.bin")


def test_a_commits_files_are_listed_and_checked_where_they_lie(location):
    """What ``verify`` and ``recover-pointer`` go by on every location: each file's size from
    one listing and its CRC-32 read where it lies, checked against the manifest; a manifest
    record that is not the file's bytes is named."""
    intact = _save(location, "save1", b"weights" * 1000, point=True)
    files = location.files_of(intact)
    listing = files.listing()
    assert set(listing) == {"data.bin", "note.txt", MANIFEST_NAME} and listing["data.bin"] == 7000
    assert files.crc32("data.bin", 7000) == zlib.crc32(b"weights" * 1000)
    assert check_checkpoint(files, MANIFEST_NAME) == []

    lying = _save(location, "save2", b"rotten", point=True, recorded=b"intact")
    problems = check_checkpoint(location.files_of(lying), MANIFEST_NAME)
    assert problems == [f"{location.files_of(lying).where('data.bin')}: checksum mismatch (corrupted)"]


def test_a_recovery_location_is_repaired_to_its_newest_intact_checkpoint_and_keeps_every_one(persistent_root):
    """``recover-pointer``'s repair over the contract, on a trial's recovery location of every
    kind (a ``.recover`` folder whose ``current`` commits, a ``.recover`` prefix): a committed
    checkpoint whose file is not its record is skipped, named, and the newest intact one is
    committed again; a second repair changes nothing; nothing is deleted."""
    generations = recovery_location_of(locate(f"{persistent_root.root}/trial-{secrets.token_hex(3)}", "trial"))
    intact = _save(generations, generation_name(1, "aaaaaaaa"), b"weights", point=True, manifest=RECOVER_MANIFEST)
    rotten = _save(
        generations,
        generation_name(2, "bbbbbbbb"),
        b"rotten",
        point=True,
        recorded=b"intact",
        manifest=RECOVER_MANIFEST,
    )
    newest = generations.newest()
    assert newest is not None and newest.name == rotten

    def repair() -> tuple[str, dict[str, list[str]], bool]:
        return recommit_newest_intact(
            generations,
            RECOVER_MANIFEST,
            is_generation_name,
            generation_step,
            lambda name: {"repaired": name},
        )

    name, skipped, changed = repair()
    assert (name, changed) == (intact, True) and list(skipped) == [rotten]
    assert skipped[rotten] == [f"{generations.files_of(rotten).where('data.bin')}: checksum mismatch (corrupted)"]
    newest = generations.newest()
    assert newest is not None and newest.name == intact
    assert repair() == (intact, {}, False)
    assert {intact, rotten} <= set(generations.present())


def test_a_file_that_is_not_its_record_is_never_put_into_a_recovery_location(persistent_root):
    """What a publisher relies on, on every kind of a trial's recovery location (a ``.recover``
    folder, where files are copied in; a ``.recover`` prefix, where they are uploaded): with its
    record given, a file whose bytes are not that record is refused by name and nothing is
    committed; the same file with its true record is put and commits."""
    generations = recovery_location_of(locate(f"{persistent_root.root}/trial-{secrets.token_hex(3)}", "trial"))
    name = generation_name(1, "cccccccc")
    reserved = generations.reserve(name)
    staging = generations.stage(name, 0)
    record = write_file_durably(staging / "data.bin", b"rotted on the local tier")
    with pytest.raises(CheckpointError, match="data.bin"):
        generations.put_own(staging, reserved, ["data.bin"], {"data.bin": (record.size, record.crc32 ^ 1)})
    assert generations.newest() is None
    generations.put_own(staging, reserved, ["data.bin"], {"data.bin": (record.size, record.crc32)})
    (staging / RECOVER_MANIFEST).parent.mkdir(parents=True, exist_ok=True)
    write_manifest(staging, RECOVER_MANIFEST, {"data.bin": record}, {"label": name})
    generations.commit(staging, reserved, {"data.bin"}, {"run": "token"})
    generations.unstage(staging, 0)
    newest = generations.newest()
    assert newest is not None and newest.name == reserved and newest.facts["run"] == "token"
    assert check_checkpoint(generations.files_of(reserved), RECOVER_MANIFEST) == []
