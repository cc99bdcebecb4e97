"""Timeline simulation against hand-solved pipelines, and the Gantt chart it draws."""

import pytest

from autopar._src import schedule, timeline
from autopar._src.plan import Plan, StagePlan


def make_plan(latencies, *, name="gpipe", num_microbatches=4, flops=None):
    flops = flops or [1.0] * len(latencies)
    stages = tuple(
        StagePlan(
            layers=(i, i + 1),
            device_ids=(i,),
            mesh_shape=(1,),
            axis_names=("data",),
            forward_flops=f,
            latency=lat,
        )
        for i, (lat, f) in enumerate(zip(latencies, flops, strict=True))
    )
    n = len(latencies)
    return Plan(
        num_microbatches=num_microbatches,
        schedule=name,
        cuts=tuple(range(1, n)),
        layer_flops=tuple(flops),
        stages=stages,
    )


def compute(tasks):
    return [t for t in tasks if t.kind != "send"]


@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("num_stages,num_mb", [(1, 1), (1, 3), (2, 1), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_equal_stages_match_closed_form(name, num_stages, num_mb):
    plan = make_plan([3.0] * num_stages, name=name, num_microbatches=num_mb)
    tasks = timeline.simulate(plan)
    assert len(tasks) == 2 * num_stages * num_mb
    assert {t.end - t.start for t in tasks if t.kind == "F"} == {1.0}
    assert {t.end - t.start for t in tasks if t.kind == "B"} == {2.0}
    assert timeline.makespan(tasks) == (num_mb + num_stages - 1) * 3
    assert timeline.bubble_fraction(tasks, num_stages) == pytest.approx(
        (num_stages - 1) / (num_mb + num_stages - 1)
    )


@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("transfers", [None, (0.25, 0.0, 0.7)])
def test_dependencies_order_and_earliest_start(name, transfers):
    num_stages, num_mb = 4, 6
    plan = make_plan([3.0, 1.5, 4.0, 2.0], name=name, num_microbatches=num_mb)
    tasks = timeline.simulate(plan, transfer_seconds=transfers)
    delays = transfers or (0.0,) * (num_stages - 1)
    by_key = {(t.stage, t.microbatch, t.kind): t for t in compute(tasks)}
    per_stage = schedule.make(name, num_stages, num_mb)
    for s in range(num_stages):
        row = [t for t in compute(tasks) if t.stage == s]
        assert [(t.microbatch, t.kind) for t in row] == [(p.microbatch, p.pass_) for p in per_stage[s]]
        assert row[0].start >= 0.0
        for prev, cur in zip(row, row[1:], strict=False):
            assert cur.start >= prev.end
    for t in compute(tasks):
        task = schedule.PipeTask(stage=t.stage, microbatch=t.microbatch, pass_=t.kind)
        ready = []
        for d in schedule.dependencies(task, num_stages):
            delay = 0.0 if d.stage == t.stage else delays[min(d.stage, t.stage)]
            ready.append(by_key[(d.stage, d.microbatch, d.pass_)].end + delay)
            assert t.start >= ready[-1] - 1e-12
        row = [u for u in compute(tasks) if u.stage == t.stage]
        i = row.index(t)
        free = row[i - 1].end if i else 0.0
        # No idling without cause: the start is the latest of "stage free" and "inputs arrived".
        assert t.start == pytest.approx(max([free, *ready]))


@pytest.mark.parametrize("name", schedule.SCHEDULES)
def test_transfers_two_stages_hand_computed(name):
    # F=1, B=2, 0.5 s per crossing. Both schedules: stage 1 runs F0 1.5-2.5, F1 2.5-3.5 (gpipe)
    # or F0, B0 2.5-4.5, ...; stage 0's last backward waits for B1 (ends 7.5) + 0.5 and ends at 10.
    plan = make_plan([3.0, 3.0], name=name, num_microbatches=2)
    base = timeline.makespan(timeline.simulate(plan))
    tasks = timeline.simulate(plan, transfer_seconds=[0.5])
    assert base == 9.0
    assert timeline.makespan(tasks) == 10.0
    sends = [t for t in tasks if t.kind == "send"]
    assert sorted((t.stage, t.microbatch) for t in sends) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ends = {(t.stage, t.microbatch, t.kind): t.end for t in compute(tasks)}
    for t in sends:
        assert t.end - t.start == 0.5
        assert t.start == ends[(t.stage, t.microbatch, "F" if t.stage == 0 else "B")]
    b0 = [t for t in tasks if t.stage == 0 and t.kind == "B"]
    assert [(t.start, t.end) for t in b0][-1] == (8.0, 10.0)
    # Bubbles ignore transfers: 2 stages * 2 microbatches * 3 s busy out of 2 * 10 s.
    assert timeline.bubble_fraction(tasks, 2) == pytest.approx(1 - 12 / 20)
    assert not [t for t in timeline.simulate(plan, transfer_seconds=[0.0]) if t.kind == "send"]


def test_measured_task_seconds_override_prediction():
    plan = make_plan([3.0, 3.0], num_microbatches=3)
    tasks = timeline.simulate(plan, task_seconds={(1, "F"): 0.5, (1, "B"): 4.0})
    durations = {(t.stage, t.kind): t.end - t.start for t in tasks}
    assert durations == {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 0.5, (1, "B"): 4.0}
    tasks = timeline.simulate(plan, forward_fraction=0.5)
    assert {(t.stage, t.kind): t.end - t.start for t in tasks} == {
        (s, p): 1.5 for s in range(2) for p in "FB"
    }


def test_flops_fallback_and_unit_times():
    plan = make_plan([0.0, 0.0], flops=[1.0, 2.0], num_microbatches=2)
    durations = {(t.stage, t.kind): t.end - t.start for t in timeline.simulate(plan)}
    assert durations == pytest.approx({(0, "F"): 1 / 6, (0, "B"): 2 / 6, (1, "F"): 2 / 6, (1, "B"): 4 / 6})
    assert durations[(1, "F")] + durations[(1, "B")] == pytest.approx(1.0)
    plan = make_plan([0.0, 0.0, 0.0], flops=[0.0, 0.0, 0.0], num_microbatches=3)
    tasks = timeline.simulate(plan)
    assert {t.end - t.start for t in tasks} == {1.0}
    assert timeline.makespan(tasks) == 2 * (3 + 3 - 1)


@pytest.mark.parametrize("name", schedule.SCHEDULES)
def test_draw_writes_png_with_one_row_per_stage(tmp_path, name):
    plan = make_plan([0.003, 0.002, 0.004], name=name, num_microbatches=4)
    tasks = timeline.simulate(plan, transfer_seconds=[0.0002, 0.0001])
    path = tmp_path / "timeline.png"
    fig = timeline.draw(tasks, str(path), num_stages=3, title="three stages")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # stage 0 on top
    assert ax.get_xlabel() == "time (ms)"
    assert "bubble" in ax.get_title() and "three stages" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward", "transfer"]


def test_plan_timeline_simulates_and_draws(tmp_path):
    plan = make_plan([3.0, 3.0], name="1f1b", num_microbatches=4)
    path = tmp_path / "plan.png"
    tasks = timeline.plan_timeline(plan, str(path), transfer_seconds=[0.5])
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert tasks == timeline.simulate(plan, transfer_seconds=[0.5])
    fallback = make_plan([0.0, 0.0], num_microbatches=2)
    timeline.plan_timeline(fallback, str(tmp_path / "fallback.png"))
    assert (tmp_path / "fallback.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_inputs_raise(tmp_path):
    plan = make_plan([3.0, 3.0])
    for fraction in (0.0, 1.0, -0.2, 1.5, float("nan")):
        with pytest.raises(ValueError, match="forward_fraction"):
            timeline.simulate(plan, forward_fraction=fraction)
    with pytest.raises(ValueError, match="transfer_seconds has 2 entries"):
        timeline.simulate(plan, transfer_seconds=[0.1, 0.1])
    with pytest.raises(ValueError, match="non-negative"):
        timeline.simulate(plan, transfer_seconds=[-0.1])
    with pytest.raises(ValueError, match=r"key \(2, 'F'\)"):
        timeline.simulate(plan, task_seconds={(2, "F"): 1.0})
    with pytest.raises(ValueError, match=r"key \(0, 'X'\)"):
        timeline.simulate(plan, task_seconds={(0, "X"): 1.0})
    with pytest.raises(ValueError, match="non-negative"):
        timeline.simulate(plan, task_seconds={(0, "B"): -1.0})
    # Without predicted latencies the other tasks would be in relative units, not seconds.
    unpredicted = make_plan([0.0, 0.0])
    with pytest.raises(ValueError, match=r"no time for \[\(0, 'B'\), \(1, 'B'\), \(1, 'F'\)\]"):
        timeline.simulate(unpredicted, task_seconds={(0, "F"): 0.01})
    every = {(s, p): 0.01 for s in range(2) for p in "FB"}
    spans = [t.end - t.start for t in timeline.simulate(unpredicted, task_seconds=every)]
    assert spans == pytest.approx([0.01] * len(spans))
    empty = Plan(num_microbatches=1, schedule="gpipe", cuts=(), layer_flops=(1.0,), stages=())
    with pytest.raises(ValueError, match="no stages"):
        timeline.simulate(empty)
    tasks = timeline.simulate(plan)
    with pytest.raises(ValueError, match="must end in .png"):
        timeline.draw(tasks, str(tmp_path / "chart.svg"), num_stages=2)
    with pytest.raises(ValueError, match=r"stages \[1\]"):
        timeline.draw(tasks, str(tmp_path / "chart.png"), num_stages=1)
    with pytest.raises(ValueError, match="num_stages"):
        timeline.bubble_fraction(tasks, 0)
    with pytest.raises(ValueError, match="makespan"):
        timeline.bubble_fraction((), 2)
    assert not (tmp_path / "chart.png").exists()
