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


@pytest.mark.parametrize(
    "freq_epochs, freq_steps", list(itertools.product([None, 1, 2], [None, 1, 3, 4, 10, 25]))
)
def test_count_triggers_match_their_definition(freq_epochs, freq_steps):
    schedule = ac.TriggerSchedule(freq_epochs, freq_steps, None)
    fired = [
        g for g in range(SPEC.total_train_steps) if schedule.should_fire(SPEC.is_epoch_last_step(g % 10))
    ]
    assert fired == reference_steps(freq_epochs, freq_steps)


def test_spec_arithmetic_and_step_info_rollover():
    assert SPEC.steps_per_epoch == 10 and SPEC.total_train_steps == 20
    assert ac.FinetuneSpec(total_train_epochs=1, dataset_size=41, train_batch_size=4).steps_per_epoch == 11
    assert ac.FinetuneSpec(total_train_epochs=1, dataset_size=41, train_batch_size=4, drop_last=True).steps_per_epoch == 10
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


def test_any_checkpoint_restarts_the_timer_but_not_the_step_cadence():
    clock = ManualClock()
    schedule = ac.TriggerSchedule(None, 4, 60, clock=clock)
    results = []
    for _ in range(8):
        clock.now += 20
        results.append(schedule.should_fire(False))
    # steps 1..8 at t=20..160: time fires at call 3 (60 s), steps at 4 and 8; the step firing at
    # call 4 restarts the timer, so call 7 (60 s after call 4) fires by time as well.
    assert results == [False, False, True, True, False, False, True, True]


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
