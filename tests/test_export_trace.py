"""Predicted-timeline trace: one track per stream, copies on their own tracks, memory as a counter."""

import json

from planner.export_trace import memory_counter, plan_to_trace, trace_json
from planner.plan import Copy, Plan, Residency, ScheduledOp, Totals


def _plan():
    ops = [ScheduledOp(node="a", algorithm="x", stream=0, start_us=0, end_us=10, workspace_bytes=100),
           ScheduledOp(node="b", algorithm="y", stream=1, start_us=2, end_us=6),
           ScheduledOp(node="c", algorithm="z", stream=0, start_us=10, end_us=20, wait_events=["e1"]),
           ScheduledOp(node="b", algorithm="y", stream=1, start_us=12, end_us=14, recompute_of="t")]
    copies = [Copy(tensor="t", direction="d2h", stream=4, start_us=6, end_us=8, bytes=1000),
              Copy(tensor="t", direction="h2d", stream=5, start_us=12, end_us=14, bytes=1000)]
    tensors = [Residency(tensor="t", bytes=1000, decision="offload", intervals_us=[(2, 8), (12, 20)]),
               Residency(tensor="u", bytes=50, intervals_us=[(0, 20)])]
    totals = Totals(makespan_us=20, peak_bytes=1150, mem_cap_bytes=2000, lower_bound_us=18,
                    baseline_makespan_us=24, status="OPTIMAL", gap=0, solve_time_s=0.1)
    return Plan(graph_sha256="0" * 64, model_name="m", batch=1, dtype="fp16", training=True,
                device_fingerprint="dev", estimated=False, compute_streams=2, ops=ops, copies=copies,
                tensors=tensors, totals=totals)


def test_tracks_and_events():
    trace = plan_to_trace(_plan())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {0: "compute stream 0", 1: "compute stream 1", 4: "copy d2h (stream 4)",
                     5: "copy h2d (stream 5)"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 6
    assert {e["name"] for e in spans if e["cat"] == "copy"} == {"d2h t", "h2d t"}
    assert [e["name"] for e in spans if e["cat"] == "op"] == ["a", "b", "c", "recompute t (b)"]  # as run --trace


def test_memory_counter_follows_residency_and_workspace():
    levels = dict(memory_counter(_plan()))
    assert levels[0] == 150  # u + workspace of a
    assert levels[2] == 1150  # t arrives
    assert levels[8] == 150  # t offloaded; a's workspace lives until a ends at 10
    assert levels[10] == 50
    assert levels[12] == 1050 and levels[20] == 0
    assert max(levels.values()) == 1150


def test_trace_is_valid_json():
    data = json.loads(trace_json(_plan()))
    assert data["otherData"]["makespan_us"] == 20
