"""`planner check`: re-validate a plan from the plan file alone, by event-driven simulation.

Nothing the solver computed is trusted: the timeline is rebuilt from each stream's order, the waits and each
item's duration (every item starts as soon as its stream and its waits allow, as the GPU would run it), and
every rule is checked on that timeline: dependencies, one item at a time per stream and copy engine, tensors
on the device whenever an op touches them, memory under the cap at every instant, SM and DRAM shares at most 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.plan import Copy, Plan, ScheduledOp

TOLERANCE = 0.01  # predicted makespan and peak must match the simulation within 1%
EPS_US = 1e-6


@dataclass
class CheckReport:
    makespan_us: float
    peak_bytes: int
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def item_key(item: ScheduledOp | Copy) -> tuple:
    if isinstance(item, ScheduledOp):
        return ("op", item.node, item.recompute_of)
    return (item.direction, item.tensor)


def simulate(plan: Plan) -> tuple[dict[tuple, tuple[float, float]], list[str]]:
    """Start and end of every item when each runs as soon as its stream predecessor and waited events allow
    (streams in the plan's order: by predicted start); and the items that can never start (deadlock)."""
    queues: dict[int, list] = {}
    for item in sorted([*plan.ops, *plan.copies], key=lambda it: it.start_us):
        queues.setdefault(item.stream, []).append(item)
    times: dict[tuple, tuple[float, float]] = {}
    event_time: dict[str, float] = {}
    heads = {s: 0 for s in queues}
    stream_free = {s: 0.0 for s in queues}
    progress = True
    while progress:
        progress = False
        for s, items in queues.items():
            while heads[s] < len(items) and all(e in event_time for e in items[heads[s]].wait_events):
                it = items[heads[s]]
                start = max([stream_free[s], *(event_time[e] for e in it.wait_events)])
                times[item_key(it)] = (start, start + it.end_us - it.start_us)
                stream_free[s] = times[item_key(it)][1]
                if it.record_event:
                    event_time[it.record_event] = stream_free[s]
                heads[s] += 1
                progress = True
    stuck = [f"{item_key(items[heads[s]])} on stream {s} waits on an event never recorded before it"
             for s, items in queues.items() if heads[s] < len(items)]
    return times, stuck


def check_plan(plan: Plan) -> CheckReport:
    times, stuck = simulate(plan)
    if stuck:
        return CheckReport(0.0, 0, [f"deadlock: {stuck[0]}"])
    v: list[str] = []
    ops = {op.node: op for op in plan.ops if op.recompute_of is None}
    at = {k: t for k, t in times.items()}
    makespan = max((e for _, e in at.values()), default=0.0)

    def span(op: ScheduledOp) -> tuple[float, float]:
        return at[item_key(op)]

    for op in plan.ops:
        s, _ = span(op)
        for d in op.deps:
            if d not in ops:
                v.append(f"op {op.node} depends on {d}, which the plan does not run")
            elif span(ops[d])[1] > s + EPS_US:
                v.append(f"op {op.node} starts at {s:.1f} us before its dependency {d} ends")
    for direction in ("d2h", "h2d"):
        spans = sorted(at[item_key(c)] for c in plan.copies if c.direction == direction)
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            if b0 < a1 - EPS_US:
                v.append(f"two {direction} copies overlap at {b0:.1f} us")
    peak = _check_memory(plan, at, makespan, v)
    _check_share(plan, at, v, "sm_fraction", "SM share")
    _check_share(plan, at, v, "dram_fraction", "DRAM share")
    for name, predicted, simulated in (("makespan", plan.totals.makespan_us, makespan),
                                       ("peak memory", plan.totals.peak_bytes, peak)):
        if abs(predicted - simulated) > TOLERANCE * max(abs(simulated), 1e-9):
            v.append(f"predicted {name} {predicted:.6g} differs from the simulated {simulated:.6g} by more than 1%")
    return CheckReport(makespan, peak, v)


def _check_memory(plan: Plan, at: dict, makespan: float, v: list[str]) -> int:
    """Rebuild each tensor's residencies from the simulated times; check readers find it there; sweep the peak."""
    writers: dict[str, list[ScheduledOp]] = {}  # several for a concat_view's output
    readers: dict[str, list[ScheduledOp]] = {}
    for op in plan.ops:
        for t in op.writes:
            if op.recompute_of is None:
                writers.setdefault(t, []).append(op)
        for t in op.reads:
            readers.setdefault(t, []).append(op)
    copy = {(c.direction, c.tensor): at[item_key(c)] for c in plan.copies}
    events: list[tuple[float, int, str]] = []
    for r in plan.tensors:
        spans = [at[item_key(w)] for w in writers.get(r.tensor, [])]
        born = min((a for a, _ in spans), default=0.0)
        written = max((b for _, b in spans), default=0.0)
        early_end = max([written, *(at[item_key(op)][1] for op in readers.get(r.tensor, [])
                                    if not r.second_serves(op))])
        late_ops = [op for op in readers.get(r.tensor, []) if r.second_serves(op)]
        late_end = max((at[item_key(op)][1] for op in late_ops), default=early_end)
        if r.is_output:
            early_end = makespan
        if r.decision == "keep":
            lives = [(born, max(early_end, late_end))]
        elif r.decision == "offload":
            if ("d2h", r.tensor) not in copy or ("h2d", r.tensor) not in copy:
                v.append(f"offloaded tensor {r.tensor} lacks its copy out or back")
                continue
            d2h, h2d = copy["d2h", r.tensor], copy["h2d", r.tensor]
            if spans and d2h[0] < written - EPS_US:
                v.append(f"tensor {r.tensor} is copied out before it is written")
            if h2d[0] < d2h[1] - EPS_US:
                v.append(f"tensor {r.tensor} is copied back before its copy out ends")
            lives = [(born, max(early_end, d2h[1])), (h2d[0], late_end)]
            for op in late_ops:
                if at[item_key(op)][0] < h2d[1] - EPS_US:
                    v.append(f"op {op.node} reads offloaded {r.tensor} before it is back")
        else:
            rec = next((op for op in plan.ops if op.recompute_of == r.tensor), None)
            if rec is None:
                v.append(f"tensor {r.tensor} is marked recomputed but nothing recomputes it")
                continue
            rs, re_ = at[item_key(rec)]
            lives = [(born, early_end), (rs, late_end)]
            for op in late_ops:
                if at[item_key(op)][0] < re_ - EPS_US:
                    v.append(f"op {op.node} reads recomputed {r.tensor} before it is recomputed")
        for a, b in lives:
            events += [(a, r.bytes, r.tensor), (b, -r.bytes, r.tensor)]
        for op in readers.get(r.tensor, []):
            s, e = at[item_key(op)]
            if not any(a - EPS_US <= s and e <= b + EPS_US for a, b in lives):
                v.append(f"op {op.node} reads {r.tensor} while it is not on the device")
    for op in plan.ops:
        if op.workspace_bytes:
            s, e = at[item_key(op)]
            events += [(s, op.workspace_bytes, f"workspace of {op.node}"), (e, -op.workspace_bytes, "")]
    live, peak = plan.totals.resident_bytes, plan.totals.resident_bytes
    for instant, delta, what in sorted(events, key=lambda x: (x[0], x[1])):
        live += delta
        if live > plan.totals.mem_cap_bytes and delta > 0:
            v.append(f"memory {live} bytes exceeds the cap {plan.totals.mem_cap_bytes} at {instant:.1f} us "
                     f"when {what} is allocated")
        peak = max(peak, live)
    return peak


def _check_share(plan: Plan, at: dict, v: list[str], field_name: str, what: str) -> None:
    events = []
    for op in plan.ops:
        s, e = at[item_key(op)]
        fraction = getattr(op, field_name)
        events += [(s, fraction, op.node), (e, -fraction, op.node)]
    share = 0.0
    for instant, delta, node in sorted(events, key=lambda x: (x[0], x[1])):
        share += delta
        if share > 1.0 + 1e-6:
            v.append(f"{what} {share:.2f} above 1 at {instant:.1f} us when {node} starts")
            return
