"""Fast schedules without a solver: the framework-style baseline, and list schedules that meet a memory cap.

The baseline runs ops one at a time in graph order with the fastest algorithm each and keeps everything on the
device: what a framework does. `list_schedule` runs ops on several streams with copies on their own engines
and holds back what does not fit the cap until memory is freed; `fit_cap` chooses which saved tensors to
offload or recompute so that it fits, and as short as it can find. The result is CP-SAT's hint and the
fallback when CP-SAT finds nothing better.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.problem import DRAM_CAPACITY, SM_CAPACITY, Alternative, Problem
from planner.schedule import Decision, Schedule, timed

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


@dataclass
class Outcome:
    """A list schedule and how well it met the cap: `over` is the most bytes above it at a start that had to
    go ahead for lack of anything else to run (0: it fits), `stuck_at` the first such instant (ticks)."""

    schedule: Schedule
    makespan: int
    over: int = 0
    stuck_at: int = -1

    @property
    def fits(self) -> bool:
        return self.over == 0


def list_schedule(p: Problem, cap_bytes: int, streams: int, decision: dict[int, Decision], slack: float = 1.0
                  ) -> Outcome:
    """Several streams and copy engines under the memory cap (parallel schedule generation, event by event).

    At each instant, in order: finished items free what they held; the next offload starts on the d2h engine
    (tensors in the order their producers end); the next prefetch on the h2d engine (in the order the backward
    pass needs them) once its reader is about PREFETCH_HEADROOM copy-durations away and it fits; then the
    ready ops and recomputations, longest path to the end first, each with its fastest alternative within
    `slack` that fits the free SM share and DRAM bandwidth, a stream, and memory. What does not fit waits for
    memory to be freed; only when nothing is running does the most urgent item go ahead over the cap (recorded
    in `over`).
    A recomputation is ready once its producer ended and every other predecessor of its first backward reader
    started: late enough to hold its memory briefly, early enough to run beside that predecessor.
    """
    n, tensors = len(p.ops), p.tensors
    rec = sorted(t for t, d in decision.items() if d == "recompute")
    off = sorted(t for t, d in decision.items() if d == "offload")
    jobs = [op.alternatives for op in p.ops] + [[tensors[t].recompute] for t in rec]
    preds = [list(op.preds) for op in p.ops] + [[tensors[t].producer] for t in rec]
    tail = _tails(p, jobs, preds, rec)
    gate = [0] * len(jobs)  # unstarted predecessors of a recomputation's first reader
    gated_by: dict[int, list[int]] = {}
    for k, t in enumerate(rec):
        first = max(tensors[t].late, key=lambda c: (tail[c], -c))
        for c in tensors[t].late:
            preds[c].append(n + k)
        for a in p.ops[first].preds:
            gated_by.setdefault(a, []).append(n + k)
            gate[n + k] += 1
    blocked = [len(ps) for ps in preds]  # unfinished predecessors, plus prefetches not yet back
    for t in off:
        for c in tensors[t].late:
            blocked[c] += 1
    succs: list[list[int]] = [[] for _ in jobs]
    for b, ps in enumerate(preds):
        for a in ps:
            succs[a].append(b)
    first_left, second_left = _residency_counts(p, decision, rec)
    used = p.resident_bytes + sum(tu.bytes for tu in tensors if tu.producer is None)
    over, stuck_at = 0, -1
    s = Schedule(alt=[0] * n, start=[0] * n, decision=dict(decision), status="list")
    start, choice = [0] * len(jobs), [0] * len(jobs)
    d2h_queue = [t for t in off if tensors[t].producer is None]
    h2d_queue = sorted(off, key=lambda t: -max(tail[c] for c in tensors[t].late))
    d2h_busy = h2d_busy = None  # (end, tensor) of the copy in flight
    d2h_done: set[int] = set()
    running: list[tuple[int, int]] = []  # (end, job)
    ready = [j for j in range(len(jobs)) if not blocked[j] and not gate[j]]
    now, sm_used, dram_used, finished = 0, 0, 0, 0
    forward_left = sum(op.phase == "forward" for op in p.ops)  # nothing comes back before the backward pass

    def free(t: int, second: bool) -> None:
        nonlocal used
        left = second_left if second else first_left
        left[t] -= 1
        if not left[t] and not (tensors[t].is_output and not second):
            used -= tensors[t].bytes

    def unblock(c: int) -> None:
        blocked[c] -= 1
        if not blocked[c] and not gate[c]:
            ready.append(c)

    def launch(j: int, a: int) -> None:
        nonlocal used, sm_used, dram_used
        alt = jobs[j][a]
        start[j], choice[j] = now, a
        running.append((now + alt.duration, j))
        sm_used += alt.sm_demand
        dram_used += alt.dram_demand
        used += _allocation(p, j, alt, rec)
        ready.remove(j)
        for g in gated_by.get(j, []):
            gate[g] -= 1
            if not gate[g] and not blocked[g]:
                ready.append(g)

    while finished < len(jobs):
        for end, j in [r for r in running if r[0] <= now]:
            running.remove((end, j))
            finished += 1
            sm_used -= jobs[j][choice[j]].sm_demand
            dram_used -= jobs[j][choice[j]].dram_demand
            used -= jobs[j][choice[j]].workspace_bytes
            if j < n:
                forward_left -= p.ops[j].phase == "forward"
                for t in p.ops[j].writes:
                    free(t, False)
                    if decision.get(t) == "offload":
                        d2h_queue.append(t)
                for t in p.ops[j].reads:
                    free(t, decision.get(t, "keep") != "keep" and j in tensors[t].late)
            else:
                for u in tensors[rec[j - n]].recompute_reads:
                    free(u, False)
            for k in succs[j]:
                unblock(k)
        if d2h_busy and d2h_busy[0] <= now:
            d2h_done.add(d2h_busy[1])
            free(d2h_busy[1], False)
            d2h_busy = None
        if h2d_busy and h2d_busy[0] <= now:
            for c in tensors[h2d_busy[1]].late:
                unblock(c)
            h2d_busy = None
        if d2h_busy is None and d2h_queue:
            t = d2h_queue.pop(0)
            s.d2h_start[t] = now
            d2h_busy = (now + tensors[t].d2h_ticks, t)
        front = max([tail[j] - (now - start[j]) for _, j in running] + [tail[j] for j in ready], default=0)

        def prefetch(timely: bool, fits: bool) -> bool:
            nonlocal used, h2d_busy
            if h2d_busy is not None or not h2d_queue or h2d_queue[0] not in d2h_done or forward_left:
                return False
            t = h2d_queue[0]
            soon = front - max(tail[c] for c in tensors[t].late) <= PREFETCH_HEADROOM * tensors[t].h2d_ticks
            if (timely and not soon) or (fits and used + tensors[t].bytes > cap_bytes):
                return False
            h2d_queue.pop(0)
            s.h2d_start[t], h2d_busy = now, (now + tensors[t].h2d_ticks, t)
            used += tensors[t].bytes
            return True

        prefetch(True, True)
        ready.sort(key=lambda j: (_net(p, j, jobs[j][0], rec, decision, first_left, second_left) > 0, -tail[j], j))
        for j in list(ready):
            if len(running) >= streams:
                break
            quickest = min(alt.duration for alt in jobs[j])
            fitting = [a for a, alt in enumerate(jobs[j])
                       if sm_used + alt.sm_demand <= SM_CAPACITY and alt.duration <= slack * quickest
                       and dram_used + alt.dram_demand <= DRAM_CAPACITY
                       and used + _allocation(p, j, alt, rec) <= cap_bytes]
            if fitting:
                launch(j, min(fitting, key=lambda a: (jobs[j][a].duration, jobs[j][a].workspace_bytes)))
        if not running and d2h_busy is None and h2d_busy is None and finished < len(jobs):
            if not prefetch(False, True):
                if ready:  # nothing will free memory: the most urgent op goes ahead, over the cap
                    j = ready[0]
                    a = min(range(len(jobs[j])), key=lambda a: (_allocation(p, j, jobs[j][a], rec), jobs[j][a].duration))
                    launch(j, a)
                else:
                    prefetch(False, False)
                over, stuck_at = max(over, used - cap_bytes), now if stuck_at < 0 else stuck_at
        events = [e for e, _ in running] + [c[0] for c in (d2h_busy, h2d_busy) if c]
        if not events:
            break
        now = min(events)
    s.alt, s.start = choice[:n], start[:n]
    s.recompute_start = {t: start[n + k] for k, t in enumerate(rec)}
    return Outcome(s, s.makespan(p), over, stuck_at)


def _net(p, j, alt, rec, decision, first_left, second_left) -> int:
    """Bytes a job allocates minus those its end frees (it is the last holder of a residency)."""
    net = _allocation(p, j, alt, rec)
    if j < len(p.ops):
        for t in p.ops[j].reads:
            second = decision.get(t, "keep") != "keep" and j in p.tensors[t].late
            if (second_left if second else first_left)[t] == 1 and not p.tensors[t].is_output:
                net -= p.tensors[t].bytes
    return net


def _allocation(p: Problem, job: int, alt: Alternative, rec: list[int]) -> int:
    """Bytes a job allocates when it starts: its workspace and what it writes (an op) or recomputes."""
    if job < len(p.ops):
        return alt.workspace_bytes + sum(p.tensors[t].bytes for t in p.ops[job].writes)
    return alt.workspace_bytes + p.tensors[rec[job - len(p.ops)]].bytes


def _residency_counts(p: Problem, decision: dict[int, Decision], rec: list[int]) -> tuple[list[int], list[int]]:
    """How many ends each tensor's first and second residency wait for (see schedule.residency)."""
    first, second = [0] * len(p.tensors), [0] * len(p.tensors)
    for t, tu in enumerate(p.tensors):
        how = decision.get(t, "keep")
        first[t] = (tu.producer is not None) + len(tu.early) + (len(tu.late) if how == "keep" else 0)
        first[t] += how == "offload"
        second[t] = len(tu.late) if how != "keep" else 0
    for t in rec:
        for u in p.tensors[t].recompute_reads:
            first[u] += 1
    return first, second


def _tails(p: Problem, jobs: list[list[Alternative]], preds: list[list[int]], rec: list[int]) -> list[int]:
    """Longest path from each job's start to the end, at fastest durations (a recomputation: its reader's + its own)."""
    n = len(p.ops)
    succs: list[list[int]] = [[] for _ in range(n)]
    for b in range(n):
        for a in preds[b]:
            succs[a].append(b)
    tail = [0] * len(jobs)
    for j in _reverse_topological(preds[:n], succs):
        tail[j] = min(a.duration for a in jobs[j]) + max((tail[k] for k in succs[j]), default=0)
    for k, t in enumerate(rec):
        tail[n + k] = jobs[n + k][0].duration + max(tail[c] for c in p.tensors[t].late)
    return tail

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


def fit_cap(p: Problem, cap_bytes: int, streams: int, max_evals: int = 400) -> Outcome | None:
    """Keep/offload/recompute decisions that meet the cap with the shortest list schedule found.

    Starts: for each RECOMPUTE_LIMITS bound, recompute every tensor that cheap (per byte; cheapest first, while
    what recomputations read stays kept), then offload the fewest other saved tensors, earliest made first
    (their copies have the longest to hide in), that make the list schedule fit (bisection). The shortest
    start is improved one decision at a time (keep, offload, recompute, with what each forces), kept when it
    still fits and gets shorter. Deterministic: a budget of schedule evaluations, not of seconds.
    """
    evals = 0

    def run(decision: dict[int, Decision]) -> Outcome:
        nonlocal evals
        evals += 1
        return list_schedule(p, cap_bytes, streams, decision)

    best = run({})
    if best.fits:
        return best
    by_cost = sorted((t for t, tu in enumerate(p.tensors) if tu.can_recompute),
                     key=lambda t: (p.tensors[t].recompute.time_us / p.tensors[t].bytes, t))
    made = sorted((t for t, tu in enumerate(p.tensors) if tu.can_offload), key=lambda t: (p.tensors[t].producer or -1, t))
    best = None
    for limit in RECOMPUTE_LIMITS:
        decision: dict[int, Decision] = {}
        for t in by_cost:
            cheap = p.tensors[t].recompute.time_us / p.tensors[t].bytes * 2**20 <= limit
            if cheap and _allowed(p, {**decision, t: "recompute"}):
                decision[t] = "recompute"
        order = [t for t in made if _allowed(p, {**decision, t: "offload"})]
        lo, hi = 0, len(order)
        while lo <= hi and evals < max_evals:
            mid = (lo + hi) // 2
            out = run({**decision, **{t: "offload" for t in order[:mid]}})
            if out.fits:
                hi = mid - 1
                if best is None or out.makespan < best.makespan:
                    best = out
            else:
                lo = mid + 1
    if best is None:
        return None
    improved = True
    while improved and evals < max_evals:
        improved = False
        for t, tu in enumerate(p.tensors):
            for how in ("keep", "offload", "recompute") if tu.choosable else ():
                if how == best.schedule.decision.get(t, "keep") or evals >= max_evals:
                    continue
                trial = _with(p, best.schedule.decision, t, how)
                if _allowed(p, trial):
                    out = run(trial)
                    if out.fits and out.makespan < best.makespan:
                        best, improved = out, True
    return best


RECOMPUTE_LIMITS = (0.0, 3.0, 5.0, 10.0, float("inf"))  # us per MiB: recompute every tensor at most this dear


def _with(p: Problem, decision: dict[int, Decision], t: int, how: Decision) -> dict[int, Decision]:
    """`decision` with tensor t set to `how`, and what that forces: a recomputation's inputs kept, and a
    recomputation that reads t (now off the device) offloaded instead."""
    out = {u: d for u, d in decision.items() if u != t}
    if how == "keep":
        return out
    out[t] = how
    if how == "recompute":
        for u in p.tensors[t].recompute_reads:
            out.pop(u, None)
    for r, d in list(out.items()):
        if d == "recompute" and t in p.tensors[r].recompute_reads:
            if p.tensors[r].can_offload:
                out[r] = "offload"
            else:
                del out[r]
    return out


def _allowed(p: Problem, decision: dict[int, Decision]) -> bool:
    """Each choice is one the tensor has, and what a recomputation reads stays kept."""
    for t, how in decision.items():
        tu = p.tensors[t]
        if not (tu.can_offload if how == "offload" else tu.can_recompute):
            return False
        if how == "recompute" and any(u in decision for u in tu.recompute_reads):
            return False
    return True
