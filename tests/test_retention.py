"""The one retention function and its policies (pure: no storage)."""

from __future__ import annotations

from areal_ckpt.storage.retention import Committed, KeepLast, KeepNewest, ReplaceSameLabel, doomed_by


def names(entries: list[Committed]) -> list[str]:
    return [entry.name for entry in entries]


def series(*steps: int) -> list[Committed]:
    return [Committed(f"s{step}", step, order) for order, step in enumerate(steps)]


def test_keep_last_keeps_the_count_newest_by_step_then_order() -> None:
    committed = series(30, 10, 20, 40)
    assert names(doomed_by(KeepLast(2), committed, "s40").remove) == ["s10", "s20"]
    assert names(doomed_by(KeepLast(1), committed, "s40").remove) == ["s10", "s20", "s30"]
    assert doomed_by(KeepLast(5), committed, "s40").remove == []


def test_keep_last_counts_newer_checkpoints_and_never_removes_them() -> None:
    # a job resumed from an older step exports step 20 again while steps 30 and 40 exist
    committed = series(10, 30, 40, 20)
    decided = doomed_by(KeepLast(2), committed, "s20")
    assert names(decided.remove) == ["s10"]
    assert names(decided.kept_newer) == ["s30", "s40"]


def test_the_same_step_is_ordered_by_commit_order() -> None:
    committed = [Committed("b", 5, 2), Committed("a", 5, 1), Committed("c", 5, 3)]
    assert names(doomed_by(KeepLast(2), committed, "c").remove) == ["a"]


def test_keep_newest_removes_every_older_one_but_what_is_in_flight() -> None:
    committed = series(1, 2, 3, 4)
    assert names(doomed_by(KeepNewest(), committed, "s4").remove) == ["s1", "s2", "s3"]
    assert names(doomed_by(KeepNewest(), committed, "s4", protected={"s2"}).remove) == ["s1", "s3"]


def test_keep_newest_never_removes_one_committed_after_the_newest() -> None:
    decided = doomed_by(KeepNewest(), series(1, 5, 3), "s3")
    assert names(decided.remove) == ["s1"]
    assert names(decided.kept_newer) == ["s5"]


def test_a_name_committed_twice_is_judged_by_its_latest_commit() -> None:
    # a commit log may name one folder twice (recover-pointer writes a new record for it)
    committed = [Committed("g1", -1, 1), Committed("g2", -1, 2), Committed("g1", -1, 3)]
    decided = doomed_by(KeepNewest(), committed, "g1")
    assert decided.remove == [Committed("g1", -1, 1), Committed("g2", -1, 2)]


def test_replace_same_label_removes_only_earlier_saves_of_that_tag() -> None:
    committed = [
        Committed("t1", -1, 1, "t"),
        Committed("u", -1, 2, "u"),
        Committed("t1.1", -1, 3, "t"),
        Committed("t1.2", -1, 4, "t"),
    ]
    assert names(doomed_by(ReplaceSameLabel(), committed, "t1.2").remove) == ["t1", "t1.1"]
    assert doomed_by(ReplaceSameLabel(), committed, "u").remove == []


def test_nothing_is_removed_when_the_newest_is_not_among_the_committed() -> None:
    assert doomed_by(KeepNewest(), series(1, 2), "elsewhere").remove == []
