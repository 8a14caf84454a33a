"""Triggers: epoch / step / seconds combined with OR, per model name, resumable."""

from __future__ import annotations

import itertools
import time

import pytest

import areal_ckpt as ac

SPEC = ac.FinetuneSpec(total_train_epochs=2, dataset_size=40, train_batch_size=4)  # 10 steps per epoch


class ManualClock:
    """A clock the test advances by hand (time is an input of the schedule)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reference_steps(freq_epochs, freq_steps):
    """Global steps (0-based) that must fire over the 2-epoch run, computed from the definition."""
    fired = []
    for global_step in range(SPEC.total_train_steps):
        epoch, epoch_step = divmod(global_step, SPEC.steps_per_epoch)
        by_steps = freq_steps is not None and (global_step + 1) % freq_steps == 0
        by_epochs = freq_epochs is not None and epoch_step == 9 and (epoch + 1) % freq_epochs == 0
        if by_steps or by_epochs:
            fired.append(global_step)
    return fired


@pytest.mark.parametrize("freq_epochs, freq_steps", list(itertools.product([None, 1, 2], [None, 1, 3, 4, 10, 25])))
def test_count_triggers_match_their_definition(freq_epochs, freq_steps):
    schedule = ac.TriggerSchedule(freq_epochs, freq_steps, None)
    fired = [g for g in range(SPEC.total_train_steps) if schedule.should_fire(SPEC.is_epoch_last_step(g % 10))]
    assert fired == reference_steps(freq_epochs, freq_steps)


def test_spec_arithmetic_and_step_info_rollover():
    assert SPEC.steps_per_epoch == 10 and SPEC.total_train_steps == 20
    # AReaL's arithmetic (drop_last): an incomplete final batch is not a step; positional as in AReaL.
    assert ac.FinetuneSpec(1, 10, 4).steps_per_epoch == 2
    assert ac.FinetuneSpec(total_train_epochs=3, dataset_size=41, train_batch_size=4).total_train_steps == 30
    assert (
        ac.FinetuneSpec(total_train_epochs=1, dataset_size=41, train_batch_size=4, drop_last=False).steps_per_epoch
        == 11
    )
    step = ac.StepInfo(epoch=0, epoch_step=8, global_step=8, steps_per_epoch=10)
    assert step.next() == ac.StepInfo(epoch=0, epoch_step=9, global_step=9, steps_per_epoch=10)
    assert step.next().next() == ac.StepInfo(epoch=1, epoch_step=0, global_step=10, steps_per_epoch=10)


def test_time_trigger_uses_elapsed_seconds_since_last_checkpoint():
    clock = ManualClock()
    schedule = ac.TriggerSchedule(None, None, 60, clock=clock)
    clock.now += 59
    assert not schedule.should_fire(False)
    clock.now += 1
    assert schedule.should_fire(False)
    clock.now += 30
    assert not schedule.should_fire(False)
    clock.now += 30
    assert schedule.should_fire(False)


def test_time_trigger_keeps_its_own_clock_as_in_areal():
    # The case measured against AReaL's EpochStepTimeFreqCtl: freq_steps=2, freq_secs=5 and
    # 2 s per step fire at calls [1, 2, 3, 5, 7, 8, 9, 11] (0-based) there. Steps fire every 2nd
    # call; time fires at t=6, 12, 18, 24 s, each 5+ s after the previous time firing, whatever
    # the step trigger did in between.
    clock = ManualClock()
    schedule = ac.TriggerSchedule(None, 2, 5, clock=clock)
    fired = []
    for call in range(12):
        clock.now += 2
        if schedule.should_fire(False):
            fired.append(call)
    assert fired == [1, 2, 3, 5, 7, 8, 9, 11]


def test_disabled_schedule_never_fires():
    schedule = ac.TriggerSchedule(None, None, None)
    assert not any(schedule.should_fire(True) for _ in range(50))


def test_state_dict_resumes_counters_and_elapsed_time():
    clock = ManualClock()
    first = ac.TriggerSchedule(2, 5, 100, clock=clock)
    for _ in range(3):
        clock.now += 30
        first.should_fire(False)
    state = first.state_dict()
    assert state["steps_since"] == 3 and state["secs_since_last"] == pytest.approx(90)

    later = ManualClock()
    later.now = 5.0  # a new process: its monotonic clock has another origin
    resumed = ac.TriggerSchedule(2, 5, 100, clock=later)
    resumed.load_state_dict(state)
    later.now += 9
    assert not resumed.should_fire(False)  # step 4, 99 s
    later.now += 0.5
    assert resumed.should_fire(False)  # step 5 fires by count


def test_time_trigger_fires_with_a_real_clock():
    schedule = ac.TriggerSchedule(None, None, 1)
    assert not schedule.should_fire(False)
    time.sleep(1.05)
    assert schedule.should_fire(False)


def test_step_info_is_areal_shaped_and_rejects_what_is_not_a_step():
    import dataclasses

    # AReaL builds "no step yet" as -1 everywhere, positionally or by keyword, and reads it back
    # with dataclasses.asdict.
    none_yet = ac.StepInfo(-1, -1, -1, 10)
    assert dataclasses.asdict(none_yet) == {"epoch": -1, "epoch_step": -1, "global_step": -1, "steps_per_epoch": 10}
    assert none_yet.next() == ac.StepInfo(epoch=-1, epoch_step=0, global_step=0, steps_per_epoch=10)
    with pytest.raises(ValueError, match="StepInfo.epoch must be >= 0, got -1"):
        none_yet.check_completed()
    with pytest.raises(ValueError, match="StepInfo.epoch must be an int"):
        ac.StepInfo(epoch="1", epoch_step=0, global_step=0, steps_per_epoch=10)
    with pytest.raises(ValueError, match="FinetuneSpec.train_batch_size must be >= 1"):
        ac.FinetuneSpec(1, 10, 0)
