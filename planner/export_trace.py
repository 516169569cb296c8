"""Plan -> Chrome/Perfetto trace of the predicted timeline (open in ui.perfetto.dev or chrome://tracing).

Compute streams and the two copy directions are tracks of one process; device memory is a counter track.
"""

from __future__ import annotations

import json

from planner.plan import Plan

PID = 1


def _track_names(plan: Plan) -> dict[int, str]:
    names = {op.stream: f"compute stream {op.stream}" for op in plan.ops}
    for c in plan.copies:
        names[c.stream] = f"copy {c.direction} (stream {c.stream})"
    return names


def step_levels(intervals) -> list[tuple[float, float]]:
    """(time, level from then on) at every change of the sum of (start, end, amount) intervals."""
    deltas: dict[float, float] = {}
    for start, end, amount in intervals:
        deltas[start] = deltas.get(start, 0) + amount
        deltas[end] = deltas.get(end, 0) - amount
    level, out = 0, []
    for t in sorted(deltas):
        level += deltas[t]
        out.append((t, level))
    return out


def memory_counter(plan: Plan) -> list[tuple[float, int]]:
    """(time_us, bytes on the device) at every change, from the residency intervals and op workspaces."""
    return step_levels([*((start, end, r.bytes) for r in plan.tensors for start, end in r.intervals_us),
                        *((op.start_us, op.end_us, op.workspace_bytes) for op in plan.ops if op.workspace_bytes)])


def plan_to_trace(plan: Plan) -> dict:
    events: list[dict] = [{"ph": "M", "pid": PID, "name": "process_name",
                           "args": {"name": f"{plan.model_name} b{plan.batch} {plan.dtype} (predicted)"}}]
    for tid, name in sorted(_track_names(plan).items()):
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": name}})
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    for op in plan.ops:
        events.append({
            "ph": "X", "pid": PID, "tid": op.stream, "ts": op.start_us, "dur": max(op.end_us - op.start_us, 0.001),
            "name": op.trace_label, "cat": "op",
            "args": {"algorithm": op.algorithm, "workspace_bytes": op.workspace_bytes,
                     "sm_fraction": op.sm_fraction, "waits": op.wait_events, "records": op.record_event},
        })
    for c in plan.copies:
        events.append({
            "ph": "X", "pid": PID, "tid": c.stream, "ts": c.start_us, "dur": max(c.end_us - c.start_us, 0.001),
            "name": c.trace_label, "cat": "copy", "args": {"bytes": c.bytes},
        })
    for t, level in memory_counter(plan):
        events.append({"ph": "C", "pid": PID, "ts": t, "name": "device memory",
                       "args": {"MiB": round(level / 2**20, 3)}})
    meta = {"makespan_us": plan.totals.makespan_us, "peak_bytes": plan.totals.peak_bytes,
            "mem_cap_bytes": plan.totals.mem_cap_bytes, "estimated_profile": plan.estimated}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def trace_json(plan: Plan) -> str:
    return json.dumps(plan_to_trace(plan), indent=None, separators=(",", ":"))
