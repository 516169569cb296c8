"""A plan on several streams in serial form: its ops and recomputations back to back on one stream, in the order
the plan starts them, with the plan's keep/offload/recompute decisions.

Why: serial plans run faster on the GPU than ops side by side, where those gain little (H100, ResNet-50 training
b32 fp16: uncapped, the serial baseline 7.10 ms against 7.27 on four streams; at 50% of its serial peak, the
serial form of the four-stream plan 7.78 ms against 7.86). The framework-style serial baseline does not fit under
a binding cap; the serial form of a plan that does holds, at each item's start, at most what the plan held at
that item's start: every item before it has ended (in the plan, started), none after it has started, the copies
out the plan had finished are finished (where needed, the item waits for them), the copies back it had begun are
begun, and one workspace at a time. Each op then takes its fastest algorithm, or a leaner one where the fastest's
workspace would raise the peak over the cap (`serial_form`). Solve offers it, or the framework-style serial plan
where that fits, against the plan on several streams: the one predicted faster is the answer (`serial_or`).
"""

from __future__ import annotations

import math
from typing import Callable

from planner.arena_fit import plan_of
from planner.bounds import lower_bounds_us
from planner.heuristic import fastest_alternatives
from planner.ir import Graph
from planner.plan import Plan
from planner.problem import Problem
from planner.schedule import Schedule, peak_memory, peaks_within, timed


def plan_alternatives(p: Problem, plan: Plan) -> list[int]:
    """The alternative the plan runs each op of `p` on (by op and algorithm name)."""
    index, alt = p.op_index, [0] * len(p.ops)
    for o in plan.ops:
        if o.recompute_of is None:
            i = index[o.node]
            alt[i] = next(a for a, x in enumerate(p.ops[i].alternatives) if x.name == o.algorithm)
    return alt


def serialized(p: Problem, plan: Plan, alt: list[int], wait_out: bool = True) -> Schedule:
    """The plan's compute items in the order they start, back to back on one stream, each op on `alt`. Each
    engine copies in the plan's order: a copy out once its tensor is written, a copy back after it and before
    the first item that starts after it in the plan. An item waits for the copies back it reads and, with
    `wait_out`, for the copies out that ended before it started in the plan (which keeps its memory within the
    plan's)."""
    ops, tensors = p.op_index, {t.name: i for i, t in enumerate(p.tensors)}
    s = Schedule(alt=list(alt), start=[0] * len(p.ops), status="serial form")
    s.decision = {tensors[r.tensor]: r.decision for r in plan.tensors if r.decision != "keep"}
    by_start = lambda items: sorted(items, key=lambda x: (x.start_us, x.end_us))  # noqa: E731
    copies_back = [(tensors[c.tensor], c.start_us) for c in by_start(plan.copies) if c.direction == "h2d"]
    copies_out = [tensors[c.tensor] for c in by_start(plan.copies) if c.direction == "d2h"]
    out_ends = sorted((c.end_us, tensors[c.tensor]) for c in plan.copies if c.direction == "d2h")
    now = back_free = out_free = k = j = 0
    ended: dict[int, int] = {}

    def copy_out_written() -> None:
        nonlocal out_free
        while copies_out and all(w in ended for w in p.tensors[copies_out[0]].writers):
            t = copies_out.pop(0)
            s.d2h_start[t] = max([out_free, *(ended[w] for w in p.tensors[t].writers)])
            out_free = s.d2h_start[t] + p.tensors[t].d2h_ticks

    copy_out_written()  # a graph input's, which nothing writes
    for item in by_start(plan.ops):
        while k < len(copies_back) and copies_back[k][1] <= item.start_us:
            t = copies_back[k][0]
            s.h2d_start[t] = max(back_free, now, s.d2h_start[t] + p.tensors[t].d2h_ticks)
            back_free = s.h2d_start[t] + p.tensors[t].h2d_ticks
            k += 1
        if item.recompute_of is None:
            i = ops[item.node]
            late = [t for t in p.ops[i].reads if i in p.tensors[t].late]
        else:
            i = tensors[item.recompute_of]
            late = p.tensors[i].recompute_reads
        now = max([now, *(s.h2d_start[t] + p.tensors[t].h2d_ticks for t in late if t in s.h2d_start)])
        while wait_out and j < len(out_ends) and out_ends[j][0] <= item.start_us:  # freed before it in the plan
            t = out_ends[j][1]
            now, j = max(now, s.d2h_start[t] + p.tensors[t].d2h_ticks), j + 1
        if item.recompute_of is None:
            s.start[i], now = now, now + p.ops[i].alternatives[alt[i]].duration
            ended[i] = now
        else:
            ways = p.tensors[i].recompute_alternatives
            s.recompute_alt[i] = next(a for a, x in enumerate(ways) if x.name == item.algorithm)
            s.recompute_start[i], now = now, now + s.recompute(p, i).duration
        copy_out_written()
    return s


def serial_form(p: Problem, plan: Plan, cap_bytes: int) -> Schedule | None:
    """`serialized` on the fastest alternatives, stepping an op back to a leaner one wherever its workspace
    makes the peak pass the cap: the op running at the peak takes its fastest alternative with less workspace,
    or, where it has none (or a recomputation runs there), the op whose alternative grew its workspace most over
    the plan's goes back to the plan's. Items wait for the plan's earlier copies out only where the serial form
    does not fit without (ResNet-50 training b32 under 609 MiB: a makespan of 8577 us without, 8674 with). None when
    even the plan's alternatives pass the cap."""
    own = plan_alternatives(p, plan)
    workspace = lambda i, a: p.ops[i].alternatives[a].workspace_bytes  # noqa: E731
    for wait_out in (False, True):
        own_form = serialized(p, plan, own, wait_out)
        if not peaks_within(p, own_form, cap_bytes):
            continue
        alt = fastest_alternatives(p)
        while True:
            s = serialized(p, plan, alt, wait_out)
            tm = timed(p, s)
            peak, at = peak_memory(p, s.decision, tm)
            if peak <= cap_bytes:
                return s
            running = next((i for i in range(len(p.ops)) if tm.op_start[i] <= at < tm.op_end[i]), None)
            leaner = [] if running is None else [a for a in range(len(p.ops[running].alternatives))
                                                 if workspace(running, a) < workspace(running, alt[running])]
            if leaner:
                alt[running] = min(leaner, key=lambda a: p.ops[running].alternatives[a].duration)
                continue
            grown = [i for i in range(len(p.ops)) if workspace(i, alt[i]) > workspace(i, own[i])]
            if not grown:
                break
            i = max(grown, key=lambda i: workspace(i, alt[i]) - workspace(i, own[i]))
            alt[i] = own[i]
    return None


def fitting_serial(graph: Graph, p1: Problem, serial: Schedule, serial_peak: int, cap_bytes: int,
                   fits: Callable[[Plan], bool]) -> Plan | None:
    """The serial schedule of the one-stream problem `p1` as a plan; None where its peak or its arena passes the
    cap."""
    if serial_peak <= cap_bytes and fits(serial_plan := plan_of(graph, p1, serial, cap_bytes, 1)):
        return serial_plan
    return None


def offer_serial(plan: Plan, serial_plan: Plan) -> Plan:
    """`serial_or` with the framework-style serial plan (`fitting_serial`), its makespan the one-stream bound."""
    return serial_or(plan, serial_plan, serial_plan.totals.makespan_us, "serial (one stream, every tensor kept)")


def offer_serial_form(plan: Plan, graph: Graph, p1: Problem, cap_bytes: int, fits: Callable[[Plan], bool]) -> Plan:
    """`serial_or` with the plan's serial form (planner.serialize) on the one-stream problem `p1`, where it fits
    the cap, and the bound on every one-stream plan under the cap."""
    schedule = serial_form(p1, plan, cap_bytes)
    if schedule is not None and fits(serial_plan := plan_of(graph, p1, schedule, cap_bytes, 1)):
        return serial_or(plan, serial_plan, max(lower_bounds_us(p1, 1, cap_bytes).values()),
                          "the plan's serial form (one stream, its items in the order they start, each op on its "
                          "fastest algorithm that fits)")
    return plan


def serial_or(plan: Plan, serial: Plan, one_stream_bound_us: float, what: str) -> Plan:
    """The plan, or the serial plan `what` (which fits the cap) where that is predicted faster; the lower bound
    then covers both: the lesser of the plan's and `one_stream_bound_us`, no one-stream plan's makespan being
    less. On several streams every op pays the calibrated dispatch time and the co-running slowdown of what runs
    beside it (planner.co_running); on one stream nothing runs beside it (H100 training b32, measured: ResNet-50
    serial 7.09 ms against 7.27 ms on four streams, predicted 7517.9 against 7712.3 us; at 50% of its serial peak
    the serial form 7.78 ms against 7.86, predicted 8129.2 against 8444.5; docs/BENCHMARKS.md)."""
    several_us = plan.totals.lower_bound_us
    if serial.totals.predicted_us < plan.totals.predicted_us:
        streams = f"{plan.compute_streams} stream" + "s" * (plan.compute_streams > 1)
        why = (f"{what}: predicted {serial.totals.predicted_us:.1f} us against "
               f"{plan.totals.predicted_us:.1f} us on {streams} (priced with "
               f"{plan.totals.dispatch_us:g} us per op for running side by side"
               + (f" and co-running slowdown k {plan.totals.co_running:g})" if plan.totals.co_running else ")"))
        kept = plan.totals.model_dump(include={"mem_cap_bytes", "bounds_us", "baseline_makespan_us",
                                               "baseline_peak_bytes"})
        plan = serial.model_copy(update={"totals": serial.totals.model_copy(update={
            **kept, "status": f"{why}; {plan.totals.status}"})})
    totals = plan.totals
    # where the viewed and the copied graph both offered a serial plan, the lesser of their bounds
    one_stream_us = min(totals.bounds_us.get("one_stream", math.inf), one_stream_bound_us)
    totals.bounds_us = {**totals.bounds_us, "one_stream": one_stream_us}
    totals.lower_bound_us = min(several_us, one_stream_us)
    totals.gap = totals.gap_to_bound()
    return plan
