"""Fast schedules without a solver: the framework-style baseline, and a serial schedule that offloads greedily.

The baseline runs ops one at a time in graph order with the fastest algorithm each and keeps everything on the
device: what a framework does. `greedy_serial` is the same order with two levers for a memory cap, pulled at
the peak until it fits: offload the largest saved tensor that sits idle across the peak (prefetched back just
in time, copies on their own engines), or switch an op running at the peak to an algorithm with less
workspace. It is CP-SAT's first hint and the fallback when CP-SAT finds nothing better.
"""

from __future__ import annotations

from planner.problem import SM_CAPACITY, Problem
from planner.schedule import Schedule, peak_memory, residency, timed

PREFETCH_HEADROOM = 2.0  # issue a prefetch this many copy-durations of compute before its first use


def fastest_alternatives(p: Problem) -> list[int]:
    return [min(range(len(o.alternatives)), key=lambda a: (o.alternatives[a].duration, o.alternatives[a].workspace_bytes))
            for o in p.ops]


def serial(p: Problem, alt: list[int], offloaded: set[int] = frozenset(), recomputed: set[int] = frozenset()
           ) -> Schedule:
    """Ops back to back in graph order; offloaded tensors copied out after their producer and back ahead of
    their first backward reader, which waits for the copy if it is late; recomputations run on the same stream
    just before their first backward reader."""
    dur = [o.alternatives[a].duration for o, a in zip(p.ops, alt)]
    trigger: dict[int, list[int]] = {}
    for t in offloaded:
        first_late = min(p.tensors[t].late)
        k, covered = first_late, 0
        while k > 0 and covered < PREFETCH_HEADROOM * p.tensors[t].h2d_ticks:
            k -= 1
            covered += dur[k]
        last_early = max([p.tensors[t].producer or 0, *p.tensors[t].early])
        trigger.setdefault(max(k, last_early + 1), []).append(t)
    produced_by: dict[int, list[int]] = {}
    for t in offloaded:
        if p.tensors[t].producer is not None:
            produced_by.setdefault(p.tensors[t].producer, []).append(t)
    waits: dict[int, list[int]] = {}
    for t in offloaded:
        for c in p.tensors[t].late:
            waits.setdefault(c, []).append(t)
    recompute_before: dict[int, list[int]] = {}
    for t in recomputed:
        recompute_before.setdefault(min(p.tensors[t].late), []).append(t)
    s = Schedule(alt=list(alt), start=[0] * len(p.ops), decision={t: "offload" for t in offloaded})
    s.decision.update({t: "recompute" for t in recomputed})
    now = d2h_free = h2d_free = 0
    for t in offloaded:  # graph inputs are there from the start
        if p.tensors[t].producer is None:
            s.d2h_start[t] = d2h_free
            d2h_free += p.tensors[t].d2h_ticks
    for i in range(len(p.ops)):
        for t in sorted(trigger.get(i, []), key=lambda t: min(p.tensors[t].late)):
            s.h2d_start[t] = max(h2d_free, now, s.d2h_start[t] + p.tensors[t].d2h_ticks)
            h2d_free = s.h2d_start[t] + p.tensors[t].h2d_ticks
        for t in recompute_before.get(i, []):
            s.recompute_start[t], now = now, now + p.tensors[t].recompute.duration
        start = max([now, *(s.h2d_start[t] + p.tensors[t].h2d_ticks for t in waits.get(i, []))])
        s.start[i], now = start, start + dur[i]
        for t in produced_by.get(i, []):
            s.d2h_start[t] = max(d2h_free, now)
            d2h_free = s.d2h_start[t] + p.tensors[t].d2h_ticks
    return s


def baseline(p: Problem) -> Schedule:
    s = serial(p, fastest_alternatives(p))
    s.status = "baseline"
    return s


def greedy_serial(p: Problem, cap_bytes: int, max_passes: int = 8) -> tuple[Schedule, int]:
    """The serial schedule made to fit `cap_bytes` if its levers allow; returns it and its peak.

    Passes over the saved tensors: recomputations first (cheapest bytes per microsecond first), then offloads
    (earliest produced first: the longest idle time to hide copies in), then leaner algorithms for the ops at
    the peak. A move is kept when the tensor sits idle across the peak and the peak does not rise.
    """
    alt = fastest_alternatives(p)
    offloaded: set[int] = set()
    recomputed: set[int] = set()

    def evaluate(alt, off, rec):
        sch = serial(p, alt, off, rec)
        t = timed(p, sch)
        return (sch, t, *peak_memory(p, sch.decision, t))

    s, tm, peak, at = evaluate(alt, offloaded, recomputed)
    order = sorted((t for t, tu in enumerate(p.tensors) if tu.can_recompute),
                   key=lambda t: -p.tensors[t].bytes / p.tensors[t].recompute.time_us)
    moves = [("recompute", t) for t in order]
    moves += [("offload", t) for t, tu in sorted(enumerate(p.tensors), key=lambda x: (x[1].producer or -1, x[0]))
              if tu.can_offload]
    for _ in range(max_passes):
        before = peak
        for how, t in moves:
            if peak <= cap_bytes:
                return s, peak
            tu = p.tensors[t]
            if t in s.decision or (how == "recompute" and any(u in s.decision for u in tu.recompute_reads)):
                continue
            if any(t in p.tensors[r].recompute_reads for r in recomputed):
                continue
            if not tm.op_end[max([tu.producer or 0, *tu.early])] <= at < tm.op_start[min(tu.late)]:
                continue
            off, rec = set(offloaded), set(recomputed)
            (off if how == "offload" else rec).add(t)
            trial = evaluate(alt, off, rec)
            if trial[2] <= peak:
                offloaded, recomputed = off, rec
                s, tm, peak, at = trial
        running = [o for o in range(len(p.ops)) if tm.op_start[o] <= at < tm.op_end[o]]
        for o in running:
            leaner = min(range(len(p.ops[o].alternatives)), key=lambda a: (p.ops[o].alternatives[a].workspace_bytes,
                                                                          p.ops[o].alternatives[a].time_us))
            if leaner != alt[o]:
                trial_alt = list(alt)
                trial_alt[o] = leaner
                trial = evaluate(trial_alt, offloaded, recomputed)
                if trial[2] <= peak:
                    alt = trial_alt
                    s, tm, peak, at = trial
        if peak >= before:
            break
    return s, peak


def list_schedule(p: Problem, base: Schedule, streams: int, slack: float = 1.0) -> Schedule | None:
    """Several streams (parallel schedule generation): at each instant, the ready ops in order of their longest
    path to the end start if the SM share (sum <= 1) and the stream count allow, each with its fastest
    alternative that fits the free SM share and is at most `slack` times slower than its fastest. Keeps `base`'s recomputations (as extra ops before their first
    reader); returns None when `base` offloads, whose copy timing this does not model."""
    if any(d == "offload" for d in base.decision.values()):
        return None
    n = len(p.ops)
    rec = sorted(t for t, d in base.decision.items() if d == "recompute")
    jobs = [[a for a in op.alternatives] for op in p.ops] + [[p.tensors[t].recompute] for t in rec]
    preds = [list(op.preds) for op in p.ops] + [[p.tensors[t].producer] for t in rec]
    for k, t in enumerate(rec):
        for c in p.tensors[t].late:
            preds[c].append(n + k)
    succs: list[list[int]] = [[] for _ in jobs]
    for b, ps in enumerate(preds):
        for a in ps:
            succs[a].append(b)
    tail = [0] * len(jobs)
    for j in _reverse_topological(preds, succs):
        tail[j] = min(a.duration for a in jobs[j]) + max((tail[k] for k in succs[j]), default=0)
    waiting = [len(ps) for ps in preds]
    ready = [j for j in range(len(jobs)) if not waiting[j]]
    running: list[tuple[int, int, int]] = []  # (end, job, sm)
    start, choice = [0] * len(jobs), [0] * len(jobs)
    now, sm_used = 0, 0
    while ready or running:
        ready.sort(key=lambda j: (-tail[j], j))
        for j in list(ready):
            if len(running) >= streams:
                break
            quickest = min(alt.duration for alt in jobs[j])
            fitting = [a for a, alt in enumerate(jobs[j])
                       if sm_used + alt.sm_demand <= SM_CAPACITY and alt.duration <= slack * quickest]
            if not fitting:
                continue
            a = min(fitting, key=lambda a: (jobs[j][a].duration, jobs[j][a].workspace_bytes))
            start[j], choice[j] = now, a
            running.append((now + jobs[j][a].duration, j, jobs[j][a].sm_demand))
            sm_used += jobs[j][a].sm_demand
            ready.remove(j)
        now = min(e for e, _, _ in running)
        for e, j, sm in [r for r in running if r[0] == now]:
            running.remove((e, j, sm))
            sm_used -= sm
            for k in succs[j]:
                waiting[k] -= 1
                if not waiting[k]:
                    ready.append(k)
    s = Schedule(alt=choice[:n], start=start[:n], decision=dict(base.decision), status="list")
    s.recompute_start = {t: start[n + k] for k, t in enumerate(rec)}
    return s


def _reverse_topological(preds: list[list[int]], succs: list[list[int]]) -> list[int]:
    remaining = [len(s) for s in succs]
    order, stack = [], [j for j in range(len(succs)) if not succs[j]]
    while stack:
        j = stack.pop()
        order.append(j)
        for a in preds[j]:
            remaining[a] -= 1
            if not remaining[a]:
                stack.append(a)
    return order
