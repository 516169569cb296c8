"""Fast schedules without a solver: the framework-style baseline, and list schedules that meet a memory cap.

The baseline runs ops one at a time in graph order with the fastest algorithm each and keeps everything on the
device: what a framework does. `list_schedule` runs ops on several streams with copies on their own engines
and holds back what does not fit the cap until memory is freed; planner.decisions chooses which saved tensors
it offloads or recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.problem import DRAM_CAPACITY, SM_CAPACITY, Alternative, Problem
from planner.schedule import Decision, Schedule, peak_memory, timed

PREFETCH_HEADROOM = 2.0  # issue a prefetch this many copy-durations of compute before its first use


def fastest_alternatives(p: Problem) -> list[int]:
    return [min(range(len(o.alternatives)), key=lambda a: (o.alternatives[a].duration, o.alternatives[a].workspace_bytes))
            for o in p.ops]


def serial(p: Problem, alt: list[int]) -> Schedule:
    """Ops back to back in graph order, everything kept: what a framework does."""
    s = Schedule(alt=list(alt), start=[0] * len(p.ops))
    now = 0
    for i, o in enumerate(p.ops):
        s.start[i], now = now, now + o.alternatives[alt[i]].duration
    return s


def baseline(p: Problem) -> Schedule:
    s = serial(p, fastest_alternatives(p))
    s.status = "baseline"
    return s


def serial_baseline(p: Problem) -> tuple[Schedule, float, int]:
    """The framework-style schedule (serial, fastest algorithm, everything kept), its makespan and peak bytes."""
    base = baseline(p)
    return (base, sum(o.alternatives[a].time_us for o, a in zip(p.ops, base.alt)),
            peak_memory(p, base.decision, timed(p, base))[0])


@dataclass
class Work:
    """What the heuristic has done, in units that do not depend on the machine or its load: jobs list-scheduled,
    ops laid out in arenas (and placed again in the arena's rounds past its orders), ops of problems set up
    (built) and bounded. A time limit charges it by those counts (budget.charged_s), so that the search after it
    gets the same seconds on every run."""

    jobs: int = 0
    layouts: int = 0
    placed: int = 0
    setups: int = 0
    bounded: int = 0


@dataclass
class Outcome:
    """A list schedule and how well it met the cap: `over` is the most bytes above it at a start that had to
    go ahead for lack of anything else to run (0: it fits), `overflow` those bytes summed over every such start,
    `over_at` their instants (ticks)."""

    schedule: Schedule
    makespan: int
    over: int = 0
    overflow: int = 0
    over_at: list[int] = field(default_factory=list)
    reserve: bool = False  # list-scheduled with prefetches leaving room for the jobs before their readers
    slack: float = 1.0  # list-scheduled at this slack

    @property
    def fits(self) -> bool:
        return self.over == 0


def list_schedule(p: Problem, cap_bytes: int, streams: int, decision: dict[int, Decision], slack: float = 1.0,
                  work: Work | None = None, reserve: bool = False) -> Outcome:
    """Several streams and copy engines under the memory cap (parallel schedule generation, event by event).

    At each instant, in order: finished items free what they held; the next offload starts on the d2h engine
    (tensors in the order their producers end); the next prefetch on the h2d engine (in the order the backward
    pass needs them) once its reader is about PREFETCH_HEADROOM copy-durations away and it fits (with `reserve`,
    beside what every unstarted job with a longer tail than its readers' allocates: a prefetch that takes the
    room the backward chain needs next sends that chain over the cap once nothing else runs); then the
    ready ops and recomputations, longest path to the end first, each with its fastest alternative within
    `slack` that fits the free SM share and DRAM bandwidth, a stream, and memory (a recomputation, else its lean
    way). What does not fit waits for memory to be freed; only when nothing is running does the most urgent
    item go ahead over the cap (recorded in `over`).
    A recomputation is ready once its producer ended and every other predecessor of its first backward reader
    started: late enough to hold its memory briefly, early enough to run beside that predecessor. One that reads
    a tensor no longer kept waits for that tensor's copy back or recomputation (a needer of it, like a reader).
    """
    n, tensors = len(p.ops), p.tensors
    rec = sorted(t for t, d in decision.items() if d == "recompute")
    off = sorted(t for t, d in decision.items() if d == "offload")
    job_of = {t: n + k for k, t in enumerate(rec)}
    jobs = [op.alternatives for op in p.ops] + [tensors[t].recompute_alternatives for t in rec]
    preds = [list(op.preds) for op in p.ops] + [[tensors[t].producer] for t in rec]
    needers = {t: list(tensors[t].late) for t in rec + off}  # jobs that read t from its second residency
    for t in rec:
        for u in tensors[t].recompute_reads:
            if u in needers:
                needers[u].append(job_of[t])
    tail = _tails(p, jobs, preds, rec, needers)
    by_speed = [_within_slack(alts, slack) for alts in jobs]
    for ways in by_speed[n:]:  # a recomputation falls back on its lean way, where a faster one does not fit
        if 0 not in ways:
            ways.append(0)
    first_workspace = [alts[0].workspace_bytes for alts in jobs]  # ranks the ready jobs (below)
    made_bytes = [sum(tensors[t].bytes for t in op.writes if len(tensors[t].writers) == 1) for op in p.ops]
    made_bytes += [tensors[t].bytes for t in rec]
    shared = [[t for t in op.writes if len(tensors[t].writers) > 1] for op in p.ops] + [[] for _ in rec]
    last_reads = [[(t, decision.get(t, "keep") != "keep" and j in tensors[t].late, tensors[t].bytes)
                   for t in op.reads if not tensors[t].is_output] for j, op in enumerate(p.ops)] + [[] for _ in rec]

    def fresh(j: int) -> int:
        """Bytes job j allocates when it starts besides its workspace: what it writes (but not a tensor another
        writer already allocated) or recomputes."""
        if not shared[j]:
            return made_bytes[j]
        return made_bytes[j] + sum(tensors[t].bytes for t in shared[j] if t not in allocated)

    def freed(j: int) -> int:
        """Bytes job j's end frees: the residencies it is the last holder of."""
        return sum(b for t, second, b in last_reads[j] if (second_left if second else first_left)[t] == 1)
    gate = [0] * len(jobs)  # unstarted predecessors of a recomputation's first needer
    gated_by: dict[int, list[int]] = {}
    root: dict[int, int] = {}  # a recomputation's first needer, followed through recomputations to an op
    for t in sorted(rec, key=lambda t: -tensors[t].producer):  # recomputations that read t come first
        j = job_of[t]
        first = max(needers[t], key=lambda c: (tail[c], -c))
        root[j] = root.get(first, first)
        for c in needers[t]:
            preds[c].append(j)
        for a in p.ops[root[j]].preds:
            if tail[a] > tail[first]:  # never one that waits for this recomputation (its tail is shorter)
                gated_by.setdefault(a, []).append(j)
                gate[j] += 1
    blocked = [len(ps) for ps in preds]  # unfinished predecessors, plus prefetches not yet back
    for t in off:
        for c in needers[t]:
            blocked[c] += 1
    succs: list[list[int]] = [[] for _ in jobs]
    for b, ps in enumerate(preds):
        for a in ps:
            succs[a].append(b)
    first_left, second_left = _residency_counts(p, decision, rec)
    used = p.resident_bytes + sum(tu.bytes for tu in tensors if tu.producer is None)
    over, overflow, over_at = 0, 0, []
    allocated: set[int] = set()  # tensors some writer has allocated (a concat_view's output has several)
    s = Schedule(alt=[0] * n, start=[0] * n, decision=dict(decision), status="list")
    start, choice = [0] * len(jobs), [0] * len(jobs)
    d2h_queue = [t for t in off if tensors[t].producer is None]
    h2d_queue = sorted(off, key=lambda t: -max(tail[c] for c in needers[t]))
    d2h_busy = h2d_busy = None  # (end, tensor) of the copy in flight
    d2h_done: set[int] = set()
    by_tail = sorted(range(len(jobs)), key=lambda j: -tail[j]) if reserve else []
    allocates = ([made_bytes[j] + min(a.workspace_bytes for a in jobs[j]) for j in range(len(jobs))] if reserve
                 else [])  # outputs and leanest workspace, what `reserved` leaves room for
    started = [False] * len(jobs)
    top = 0  # by_tail[:top] have all started

    def reserved(reader_tail: int) -> int:
        """What the unstarted jobs with a tail above `reader_tail` allocate: the room a prefetch for a reader with
        that tail leaves them."""
        nonlocal top
        while top < len(by_tail) and started[by_tail[top]]:
            top += 1
        room = 0
        for j in by_tail[top:]:
            if tail[j] <= reader_tail:
                break
            if not started[j]:
                room += allocates[j]
        return room
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
        started[j] = True
        running.append((now + alt.duration, j))
        sm_used += alt.sm_demand
        dram_used += alt.dram_demand
        used += alt.workspace_bytes + fresh(j)
        if j < n:
            allocated.update(p.ops[j].writes)
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
                    free(u, decision.get(u, "keep") != "keep")
            for k in succs[j]:
                unblock(k)
        if d2h_busy and d2h_busy[0] <= now:
            d2h_done.add(d2h_busy[1])
            free(d2h_busy[1], False)
            d2h_busy = None
        if h2d_busy and h2d_busy[0] <= now:
            for c in needers[h2d_busy[1]]:
                unblock(c)
            h2d_busy = None
        if d2h_busy is None and d2h_queue:
            t = d2h_queue.pop(0)
            s.d2h_start[t] = now
            d2h_busy = (now + tensors[t].d2h_ticks, t)

        def prefetch(timely: bool, fits: bool) -> bool:
            """The next copy back, if it fits; a timely one only once the front (the longest tail still to run,
            measured where the event starts: timely prefetches come first in it) is near its reader's tail."""
            nonlocal used, h2d_busy
            if h2d_busy is not None or not h2d_queue or h2d_queue[0] not in d2h_done or forward_left:
                return False
            t = h2d_queue[0]
            reader_tail = max(tail[c] for c in needers[t])
            if timely:
                front = max([tail[j] - (now - start[j]) for _, j in running] + [tail[j] for j in ready], default=0)
                if front - reader_tail > PREFETCH_HEADROOM * tensors[t].h2d_ticks:
                    return False
            if fits and used + tensors[t].bytes > cap_bytes:
                return False
            if reserve and timely and used + tensors[t].bytes + reserved(reader_tail) > cap_bytes:
                return False
            h2d_queue.pop(0)
            s.h2d_start[t], h2d_busy = now, (now + tensors[t].h2d_ticks, t)
            used += tensors[t].bytes
            return True

        prefetch(True, True)
        if len(ready) > 1:
            ready.sort(key=lambda j: (first_workspace[j] + fresh(j) > freed(j), -tail[j], j))
        for j in list(ready):
            if len(running) >= streams:
                break
            room = cap_bytes - used - fresh(j)
            for a in by_speed[j]:
                alt = jobs[j][a]
                if (sm_used + alt.sm_demand <= SM_CAPACITY and dram_used + alt.dram_demand <= DRAM_CAPACITY
                        and alt.workspace_bytes <= room):
                    launch(j, a)
                    break
        if not running and d2h_busy is None and h2d_busy is None and finished < len(jobs):
            if not prefetch(False, True):
                if ready:  # nothing will free memory: the most urgent op goes ahead, over the cap
                    j = ready[0]
                    a = min(range(len(jobs[j])), key=lambda a: (jobs[j][a].workspace_bytes, jobs[j][a].duration))
                    launch(j, a)
                else:
                    prefetch(False, False)
                if used > cap_bytes:
                    over, overflow = max(over, used - cap_bytes), overflow + used - cap_bytes
                    over_at.append(now)
        events = [e for e, _ in running] + [c[0] for c in (d2h_busy, h2d_busy) if c]
        if not events:
            break
        now = min(events)
    if work is not None:
        work.jobs += len(jobs)
    s.alt, s.start = choice[:n], start[:n]
    s.recompute_start = {t: start[n + k] for k, t in enumerate(rec)}
    s.recompute_alt = {t: choice[n + k] for k, t in enumerate(rec)}
    return Outcome(s, s.makespan(p), over, overflow, over_at, reserve, slack)


def _within_slack(alts: list[Alternative], slack: float) -> list[int]:
    """The alternatives at most `slack` times slower than the fastest, fastest (then leanest) first."""
    quickest = min(alt.duration for alt in alts)
    return sorted((a for a, alt in enumerate(alts) if alt.duration <= slack * quickest),
                  key=lambda a: (alts[a].duration, alts[a].workspace_bytes))


def _residency_counts(p: Problem, decision: dict[int, Decision], rec: list[int]) -> tuple[list[int], list[int]]:
    """How many ends each tensor's first and second residency wait for (see schedule.residency)."""
    first, second = [0] * len(p.tensors), [0] * len(p.tensors)
    for t, tu in enumerate(p.tensors):
        how = decision.get(t, "keep")
        first[t] = len(tu.writers) + len(tu.early) + (len(tu.late) if how == "keep" else 0)
        first[t] += how == "offload"
        second[t] = len(tu.late) if how != "keep" else 0
    for t in rec:
        for u in p.tensors[t].recompute_reads:
            if decision.get(u, "keep") == "keep":
                first[u] += 1
            else:
                second[u] += 1
    return first, second


def _tails(p: Problem, jobs: list[list[Alternative]], preds: list[list[int]], rec: list[int],
           needers: dict[int, list[int]]) -> list[int]:
    """Longest path from each job's start to the end, at fastest durations (a recomputation: its own plus its
    first needer's)."""
    n = len(p.ops)
    succs: list[list[int]] = [[] for _ in range(n)]
    for b in range(n):
        for a in preds[b]:
            succs[a].append(b)
    tail = [0] * len(jobs)
    for j in _reverse_topological(preds[:n], succs):
        tail[j] = min(a.duration for a in jobs[j]) + max((tail[k] for k in succs[j]), default=0)
    for k, t in sorted(enumerate(rec), key=lambda kt: -p.tensors[kt[1]].producer):
        tail[n + k] = min(a.duration for a in jobs[n + k]) + max(tail[c] for c in needers[t])
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


def interference_ticks(p: Problem, decision: dict[int, Decision]) -> float:
    """The compute time the offloads' copies are expected to cost the ops beside them (DeviceInfo.copy_interference
    per tick of copy). A makespan assumes copies disturb nothing; measured, a plan that keeps the copy engines
    busy runs late by about that much."""
    return p.device.copy_interference * sum(p.tensors[t].d2h_ticks + p.tensors[t].h2d_ticks
                                            for t, how in decision.items() if how == "offload")


def cost(p: Problem, s: Schedule) -> float:
    """What the heuristic and CP-SAT minimise: the makespan plus the copies' interference."""
    return s.makespan(p) + interference_ticks(p, s.decision)
