"""Schedules as task lists: completeness, dependencies, in-flight memory."""

import pytest

from autopar._src import schedule


@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("num_stages,num_mb", [(1, 1), (1, 4), (2, 1), (2, 4), (4, 4), (4, 8), (3, 2)])
def test_every_task_once_and_dependencies_respected(name, num_stages, num_mb):
    per_stage = schedule.make(name, num_stages, num_mb)
    order = schedule.dispatch_order(per_stage)
    expected = {
        schedule.PipeTask(stage=s, microbatch=j, pass_=p)
        for s in range(num_stages)
        for j in range(num_mb)
        for p in "FB"
    }
    assert len(order) == len(expected) and set(order) == expected
    position = {t: i for i, t in enumerate(order)}
    for t in order:
        for d in schedule.dependencies(t, num_stages):
            assert position[d] < position[t], (t, d)
    # Each stage's tasks keep the schedule's own order.
    for s in range(num_stages):
        assert [t for t in order if t.stage == s] == list(per_stage[s])


@pytest.mark.parametrize("num_stages,num_mb", [(2, 4), (4, 4), (4, 8), (3, 6)])
def test_1f1b_bounds_in_flight_microbatches(num_stages, num_mb):
    for s, tasks in enumerate(schedule.one_f_one_b(num_stages, num_mb)):
        in_flight = peak = 0
        for t in tasks:
            in_flight += 1 if t.pass_ == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(num_stages - s, num_mb)
    gpipe_peak = max(sum(1 for t in tasks if t.pass_ == "F") for tasks in schedule.gpipe(num_stages, num_mb))
    assert gpipe_peak == num_mb


def test_1f1b_hand_checked_two_stages():
    s0, s1 = schedule.one_f_one_b(2, 3)
    assert [str(t) for t in s0] == ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "B0.2"]
    assert [str(t) for t in s1] == ["F1.0", "B1.0", "F1.1", "B1.1", "F1.2", "B1.2"]


def test_deadlock_is_reported():
    bad = (
        (
            schedule.PipeTask(stage=0, microbatch=0, pass_="B"),
            schedule.PipeTask(stage=0, microbatch=0, pass_="F"),
        ),
    )
    with pytest.raises(ValueError, match="deadlocks"):
        schedule.dispatch_order(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule='zb'"):
        schedule.make("zb", 2, 2)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        schedule.make("gpipe", 2, 0)
