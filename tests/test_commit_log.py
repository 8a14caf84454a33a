"""The commit log on a real S3 server: create-only records, idempotent retries, retention that
never deletes what a remaining record names."""

from __future__ import annotations

import pytest

import areal_ckpt as ac
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.commits import CommitLog
from areal_ckpt.urls import parse_object_url


def test_an_append_whose_answer_was_lost_is_not_written_twice(object_bucket):
    parent = parse_object_url(f"{object_bucket}/trial/.recover", "test")
    log = CommitLog(store_of(parent), parent)
    first = log.append({"folder": "gen-00000001-aa", "run": "r"})
    again = log.append({"folder": "gen-00000001-aa", "run": "r"})  # the client's retry of the same commit
    assert again.sequence == first.sequence == 1 and log.sequences() == [1]
    assert log.append({"folder": "gen-00000002-bb", "run": "r"}).sequence == 2


def test_a_writer_that_lost_the_race_for_a_number_is_refused(object_bucket, monkeypatch):
    parent = parse_object_url(f"{object_bucket}/trial/default", "test")
    mine, theirs = CommitLog(store_of(parent), parent), CommitLog(store_of(parent), parent)
    mine.append({"folder": "a"})
    monkeypatch.setattr(mine, "sequences", lambda: [1])  # listed before the other writer's commit landed
    theirs.append({"folder": "b"})
    with pytest.raises(ac.CommitError, match=r"000000000002.json: another job committed .* at the same time"):
        mine.append({"folder": "c"})
    assert theirs.newest().folder == "b"  # the winner's record stands, untouched


def test_retention_keeps_a_folder_that_a_remaining_record_names(object_bucket):
    parent = parse_object_url(f"{object_bucket}/trial/.recover", "test")
    store = store_of(parent)
    store.put_bytes(parent.key("gen-00000001-aa", "data"), b"weights")
    log = CommitLog(store, parent)
    older = log.append({"folder": "gen-00000001-aa", "run": "r", "attempt": 1})
    newer = log.append({"folder": "gen-00000001-aa", "run": "r", "attempt": 2})  # one dump, two records
    log.remove(older, kept={newer.folder})
    assert log.sequences() == [2]
    assert store.get_bytes(parent.key("gen-00000001-aa", "data")) == b"weights"
