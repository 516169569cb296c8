"""A Chrome/Perfetto trace of one measured CUDA-graph replay: every kernel, copy and memset on the track of the
plan stream whose item launched it, labelled with that plan op or copy.

The graph runs its nodes on streams of its own choosing, so CUPTI's stream ids say nothing about the plan.
Nodes are numbered in the order capture created them (the low 32 bits of CUPTI's graph node id), and capture
issues exactly what an eager iteration issues; the per-op pass records that sequence (`NodeOwner`s), and each
replayed kernel's name is checked against it before it is labelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.cupti_trace import Activity, record_activity

NODE_KINDS = ("kernel", "memcpy", "memset")


@dataclass(frozen=True)
class NodeOwner:
    label: str  # the plan op or copy, or "iteration start" / "iteration end"
    stream: int
    kind: str
    name: str


def owners(label: str, stream: int, activities: list[Activity]) -> list[NodeOwner]:
    return [NodeOwner(label, stream, a.kind, a.name) for a in activities]


def stream_names(plan) -> dict[int, str]:
    names = {op.stream: f"compute stream {op.stream}" for op in plan.ops}
    names |= {c.stream: f"copy {c.direction}" for c in plan.copies}
    return names | {0: "compute stream 0 (origin)"}


def replay_trace(replay, origin, nodes: list[NodeOwner], plan) -> dict:
    """Replay once under CUPTI and build the trace (Chrome trace event format, times in us)."""
    with record_activity(origin.synchronize, NODE_KINDS) as activities:
        replay.launch(origin)
    t0 = min((a.start_ns for a in activities), default=0)
    names = stream_names(plan)
    events, unmatched = [], 0
    for a in activities:
        index = a.graph_node_id & 0xFFFFFFFF
        index = replay.replaced.get(index, index)  # a fill kernel issued as a memset (runner/graphs.py)
        owner = nodes[index] if index < len(nodes) else None
        same = owner is not None and (owner.kind, owner.name) == (a.kind, a.name)
        by_driver = owner is not None and owner.kind != "kernel" and a.kind == "kernel"  # a memset run as kernel
        if not (same or by_driver):
            unmatched += 1
            owner = NodeOwner("unmatched", -1, a.kind, a.name)
        events.append({"name": owner.label, "cat": a.kind, "ph": "X", "pid": 0, "tid": owner.stream,
                       "ts": (a.start_ns - t0) / 1e3, "dur": (a.end_ns - a.start_ns) / 1e3,
                       "args": {"kernel" if a.kind == "kernel" else "what": a.name, "bytes": a.bytes}})
    names[-1] = "not matched to the plan"
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"{plan.model_name} measured replay"}}]
    meta += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
             for tid, name in sorted(names.items())]
    return {"traceEvents": meta + events, "displayTimeUnit": "ns",
            "otherData": {"activities": len(activities), "unmatched": unmatched}}
