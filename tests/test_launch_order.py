"""Host issue order: stream order kept, every event recorded before it is waited on, deadlocks refused."""

import pytest

from planner.files import PlannerError
from planner.plan import Copy, Plan, ScheduledOp, Totals
from runner.launch_order import launch_order


def _plan(ops, copies=()):
    totals = Totals(makespan_us=1, peak_bytes=0, mem_cap_bytes=1, lower_bound_us=0, baseline_makespan_us=1,
                    status="FEASIBLE", gap=0, solve_time_s=0)
    return Plan(graph_sha256="0" * 64, model_name="m", batch=1, dtype="fp32", training=False,
                device_fingerprint="d", estimated=True, compute_streams=2, ops=ops, copies=list(copies),
                totals=totals)


def op(name, stream, start, record=None, waits=()):
    return ScheduledOp(node=name, algorithm="a", stream=stream, start_us=start, end_us=start + 1,
                       record_event=record, wait_events=list(waits))


def test_records_come_before_waits_even_when_predicted_later():
    # b (stream 1) is predicted to start before a finishes recording, but waits on a's event
    plan = _plan([op("a", 0, 5, record="ea"), op("b", 1, 0, waits=["ea"]), op("c", 1, 1)])
    order = [launch.item.node for launch in launch_order(plan)]
    assert order.index("a") < order.index("b") < order.index("c")


def test_stream_order_is_kept_and_copies_are_items():
    plan = _plan([op("a", 0, 0, record="ea"), op("b", 0, 1), op("d", 0, 9, waits=["back"])],
                 [Copy(tensor="t", direction="d2h", stream=2, start_us=2, end_us=3, bytes=8, record_event="off",
                       wait_events=["ea"]),
                  Copy(tensor="t", direction="h2d", stream=3, start_us=6, end_us=7, bytes=8, record_event="back",
                       wait_events=["off"])])
    order = launch_order(plan)
    labels = [getattr(x.item, "node", None) or x.item.direction for x in order]
    assert labels == ["a", "b", "d2h", "h2d", "d"]


def test_deadlock_and_missing_events_are_refused():
    cyclic = _plan([op("a", 0, 0, record="ea", waits=["eb"]), op("b", 1, 0, record="eb", waits=["ea"])])
    with pytest.raises(PlannerError, match="deadlocks"):
        launch_order(cyclic)
    with pytest.raises(PlannerError, match="nothing records"):
        launch_order(_plan([op("a", 0, 0, waits=["nope"])]))
