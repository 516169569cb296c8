"""Schedule -> Plan: compute streams, copy streams, the cross-stream waits that are needed, predicted times.

Waits. Item B waits for item A whenever A ends no later than B starts in the schedule; the plan keeps only the
maximal such A (none ends before another such A starts), and drops those on B's own stream, which its stream
order implies. Every pair of items the schedule kept apart stays apart when the GPU runs each item as soon as
its waits allow, so memory, SM share and copy engines stay within what the solver checked, and no item starts
later than planned. Replaying the plan that way with the profiled durations, each op slowed by what runs beside
it (planner.co_running), gives the predicted timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from planner.co_running import settle
from planner.heuristic import cost, interference_ticks
from planner.ir import Graph
from planner.plan import Copy, Plan, Residency, ScheduledOp, Totals
from planner.problem import DRAM_CAPACITY, SM_CAPACITY, Alternative, Problem
from planner.schedule import Schedule, Timed, peak_memory, residency


@dataclass
class Item:
    kind: str  # "op", "recompute", "d2h", "h2d"
    index: int  # op index, or tensor index for the others
    start: int  # ticks in the schedule
    end: int
    duration_us: float
    stream: int = -1


def schedule_items(p: Problem, s: Schedule) -> list[Item]:
    items = [Item("op", i, s.start[i], s.end(p, i), p.ops[i].alternatives[s.alt[i]].time_us)
             for i in range(len(p.ops))]
    for t, st in s.recompute_start.items():
        alt = s.recompute(p, t)
        items.append(Item("recompute", t, st, st + alt.duration, alt.time_us))
    for t, st in s.d2h_start.items():
        items.append(Item("d2h", t, st, st + p.tensors[t].d2h_ticks, p.tensors[t].d2h_us))
    for t, st in s.h2d_start.items():
        items.append(Item("h2d", t, st, st + p.tensors[t].h2d_ticks, p.tensors[t].h2d_us))
    return sorted(items, key=lambda it: (it.start, it.end, it.kind, it.index))


def assign_streams(p: Problem, items: list[Item]) -> int:
    """Greedy interval colouring of compute items by start time (uses as many streams as ever run at once),
    preferring the stream whose last item is a dependency, which saves an event. Copies get one stream per
    direction after the compute streams. Returns the number of compute streams."""
    last: list[Item] = []
    for it in items:
        if it.kind in ("d2h", "h2d"):
            continue
        deps = set(p.ops[it.index].preds) if it.kind == "op" else set()
        free = [k for k, prev in enumerate(last) if prev.end <= it.start]
        if free:
            k = next((k for k in free if last[k].kind == "op" and last[k].index in deps), free[0])
            last[k] = it
        else:
            k = len(last)
            last.append(it)
        it.stream = k
    for it in items:
        if it.kind in ("d2h", "h2d"):
            it.stream = len(last) + (it.kind == "h2d")
    return len(last)


def maximal_predecessors(items: list[Item]) -> list[list[int]]:
    """For each item B, the items A with end(A) <= start(B) that no other such item follows. In order of their
    ends, the items ending by start(B) are a prefix, and the maximal ones are the prefix's tail that ends after
    the latest start in it."""
    starts = np.array([it.start for it in items])
    by_end = np.argsort([it.end for it in items], kind="stable")
    ends = np.array([items[a].end for a in by_end])
    before = np.searchsorted(ends, starts, side="right")  # how many end by each item's start
    latest_start = np.maximum.accumulate(starts[by_end])[np.maximum(before - 1, 0)]
    first = np.searchsorted(ends, latest_start, side="right")
    return [sorted(by_end[a:b].tolist()) for a, b in zip(first, before)]


def replayer(items: list[Item], waits: list[list[int]]) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Durations -> as-soon-as-possible start and end of each item (in us), given stream order and waits: each
    item starts once the one before it on its stream and those it waits for have ended. The settle replays one
    plan a dozen times, so the order and what each item follows are worked out once."""
    order = sorted(range(len(items)), key=lambda i: (items[i].start, items[i].end))
    last_on: dict[int, int] = {}
    follows = [list(w) for w in waits]
    for b in order:
        if (a := last_on.get(items[b].stream)) is not None:
            follows[b].append(a)
        last_on[items[b].stream] = b

    def replay(duration_us: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        start, end, duration = [0.0] * len(items), [0.0] * len(items), duration_us.tolist()
        for b in order:
            start[b] = max([end[a] for a in follows[b]], default=0.0)
            end[b] = start[b] + duration[b]
        return np.array(start), np.array(end)

    return replay


def alternative_of(p: Problem, s: Schedule, it: Item) -> Alternative:
    """The way an op or recomputation item runs in the schedule."""
    return p.ops[it.index].alternatives[s.alt[it.index]] if it.kind == "op" else s.recompute(p, it.index)


def settled(p: Problem, s: Schedule, items: list[Item], waits: list[list[int]]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, slowdown) of each item in the replay under the problem's co-running slowdown."""
    share = np.array([alternative_of(p, s, it).sm_demand / SM_CAPACITY if it.kind in ("op", "recompute") else 0.0
                      for it in items])
    return settle(np.array([it.duration_us for it in items]), share, p.co_running,
                  replayer(items, waits))


def predicted_cost(p: Problem, s: Schedule) -> float:
    """`heuristic.cost` at the timeline the plan will predict: where ops slow each other (planner.co_running),
    the settled makespan (in ticks) plus the copies' interference. The search ranks its moves by it: at times
    alone a tighter packing always looks better, and on the H100 (k 1.63) the windows' best schedule at times
    alone settles 3543.9 us where ranking by this gives 3455.2 (GoogLeNet training b32 at 50%, 60 s; 6-14 ms a
    call there)."""
    if p.co_running <= 0:
        return cost(p, s)
    items = schedule_items(p, s)
    assign_streams(p, items)
    _, end, _ = settled(p, s, items, cross_stream_waits(items))
    return float(end.max(initial=0.0)) / p.tick_us + interference_ticks(p, s.decision)


def cross_stream_waits(items: list[Item]) -> list[list[int]]:
    """Per item, the events it waits for: its maximal predecessors on other streams (its own stream orders the
    rest)."""
    return [[a for a in preds if items[a].stream != items[b].stream]
            for b, preds in enumerate(maximal_predecessors(items))]


def build_plan(graph: Graph, p: Problem, s: Schedule, totals: Totals, streams_limit: int) -> Plan:
    """The executable plan of a schedule; fills the predicted times, peak and residencies into `totals`."""
    items = schedule_items(p, s)
    compute_streams = assign_streams(p, items)
    waits = cross_stream_waits(items)
    waited = sorted({a for w in waits for a in w})
    event = {a: f"e{k}" for k, a in enumerate(waited)}
    start, end, slowdown = settled(p, s, items, waits)
    pos = {(it.kind, it.index): k for k, it in enumerate(items)}
    tm = Timed(op_start=[start[pos["op", i]] for i in range(len(p.ops))],
               op_end=[end[pos["op", i]] for i in range(len(p.ops))],
               d2h={t: (start[pos["d2h", t]], end[pos["d2h", t]]) for t in s.d2h_start},
               h2d={t: (start[pos["h2d", t]], end[pos["h2d", t]]) for t in s.h2d_start},
               recompute={t: (start[pos["recompute", t]], end[pos["recompute", t]]) for t in s.recompute_start},
               op_workspace=[o.alternatives[a].workspace_bytes for o, a in zip(p.ops, s.alt)],
               recompute_workspace={t: s.recompute(p, t).workspace_bytes for t in s.recompute_start})
    ops, copies = [], []
    for k, it in enumerate(items):
        common = dict(stream=it.stream, start_us=float(start[k]), end_us=float(end[k]), record_event=event.get(k),
                      wait_events=[event[a] for a in waits[k]])
        if it.kind in ("op", "recompute"):
            op_i = it.index if it.kind == "op" else p.tensors[it.index].producer
            op = p.ops[op_i]
            alt = alternative_of(p, s, it)
            ops.append(ScheduledOp(
                node=op.name, algorithm=alt.name, workspace_bytes=alt.workspace_bytes,
                sm_fraction=alt.sm_demand / SM_CAPACITY, dram_fraction=alt.dram_demand / DRAM_CAPACITY, **common,
                recompute_of=p.tensors[it.index].name if it.kind == "recompute" else None,
                recompute_nodes=[p.ops[o].name for o in p.tensors[it.index].recompute_chain] if it.kind == "recompute" else [],
                reads=[p.tensors[t].name for t in (op.reads if it.kind == "op" else p.tensors[it.index].recompute_reads)],
                writes=[p.tensors[t].name for t in op.writes] if it.kind == "op" else [p.tensors[it.index].name],
                deps=[p.ops[d].name for d in op.preds] if it.kind == "op" else [], slowdown=float(slowdown[k])))
        else:
            tu = p.tensors[it.index]
            copies.append(Copy(tensor=tu.name, direction=it.kind, bytes=tu.bytes, **common))
    totals.dispatch_us = p.dispatch_us
    totals.co_running = p.co_running
    totals.copy_slowdown = dict(p.device.copy_slowdown)
    lives = residency(p, s.decision, tm)
    tensors = [Residency(tensor=tu.name, bytes=tu.bytes, decision=s.decision.get(t, "keep"), intervals_us=lives[t],
                         late_readers=[p.ops[c].name for c in tu.late] if t in s.decision else [],
                         is_output=tu.is_output)
               for t, tu in enumerate(p.tensors)]
    totals.makespan_us = tm.makespan
    totals.copy_interference_us = p.device.copy_interference * sum(c.end_us - c.start_us for c in copies)
    totals.peak_bytes = peak_memory(p, s.decision, tm)[0]
    totals.resident_bytes = p.resident_bytes
    totals.streams_used = compute_streams
    totals.events_used = len(event)
    totals.offloaded_bytes = sum(p.tensors[t].bytes for t, d in s.decision.items() if d == "offload")
    totals.recomputed_bytes = sum(p.tensors[t].bytes for t, d in s.decision.items() if d == "recompute")
    totals.tick_us = p.tick_us
    totals.gap = totals.gap_to_bound()
    totals.simplifications = list(p.simplifications)
    return Plan(graph_sha256=graph.graph_sha256, model_name=graph.model_name, batch=graph.batch, dtype=graph.dtype,
                training=graph.training, device_fingerprint=p.device.fingerprint, estimated=p.estimated,
                compute_streams=max(compute_streams, 1), ops=ops, copies=copies, tensors=tensors, totals=totals)
