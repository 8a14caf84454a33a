"""The short version of `make torture`: every hostile-conditions scenario, a few trials each."""

from __future__ import annotations

import random

import pytest
import torture

pytestmark = pytest.mark.dist


def assert_clean(row: torture.Row, trials: int) -> None:
    assert row.trials == trials, row.line()
    assert row.lost == 0 and row.wrong == 0, f"{row.line()}\n" + "\n".join(row.notes)
    assert row.resumed_correctly == trials


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", ["recover", "saver"])
@pytest.mark.parametrize("world", [1, 2])
def test_kill_during_save(tmp_path, kind, world, mode):
    assert_clean(torture.scenario_kill_during_save(2, world, kind, random.Random(world), tmp_path, mode), 2)


def test_kill_one_rank_survivor_stops_with_an_error(tmp_path):
    assert_clean(torture.scenario_kill_one_rank(2, random.Random(3), tmp_path), 2)


def test_disk_full(tmp_path):
    row = torture.scenario_disk_full(1, tmp_path)
    if "unavailable" in row.scenario:
        pytest.fail("tmpfs could not be mounted here; the disk-full scenario did not run")
    assert_clean(row, 1)


def test_corruption_of_every_file_is_detected_and_named(tmp_path):
    row = torture.scenario_corruption(tmp_path)
    assert row.trials >= 30 and row.lost == 0 and row.wrong == 0, "\n".join(row.notes)


def test_hostile_files(tmp_path):
    row = torture.scenario_hostile(tmp_path)
    assert row.trials >= 10 and row.lost == 0 and row.wrong == 0, "\n".join(row.notes)


def test_two_jobs_one_trial(tmp_path):
    assert_clean(torture.scenario_two_jobs(1, tmp_path), 1)


def test_bad_configuration(tmp_path):
    row = torture.scenario_bad_config(tmp_path)
    assert row.trials >= 15 and row.lost == 0 and row.wrong == 0, "\n".join(row.notes)


def test_ctrl_c_during_dumps_stops_the_job_and_leaves_a_whole_checkpoint(tmp_path):
    assert_clean(torture.scenario_ctrl_c(2, random.Random(5), tmp_path, torture._check_recover), 2)


def test_operator_faults(tmp_path):
    row = torture.scenario_operator(tmp_path, lambda root, trial: torture._check_recover(root, trial, model={}))
    assert_clean(row, 4)


def test_preemption_through_the_process_group_and_the_launcher_at_a_random_step(tmp_path):
    rows = torture.scenario_preemption(1, random.Random(7), tmp_path)
    assert [row.scenario for row in rows] == ["preempt-async-group", "preempt-tiered-group", "preempt-launch"]
    for row in rows:
        assert_clean(row, 1)
