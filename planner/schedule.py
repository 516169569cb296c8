"""A solution of the scheduling problem in ticks (from the heuristic or CP-SAT), and the memory it needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from planner.problem import Alternative, Problem

Decision = Literal["keep", "offload", "recompute"]


@dataclass
class Schedule:
    alt: list[int]  # chosen alternative per op
    start: list[int]  # per op, ticks
    decision: dict[int, Decision] = field(default_factory=dict)  # per tensor; absent = keep
    d2h_start: dict[int, int] = field(default_factory=dict)
    h2d_start: dict[int, int] = field(default_factory=dict)
    recompute_start: dict[int, int] = field(default_factory=dict)
    recompute_alt: dict[int, int] = field(default_factory=dict)  # per recomputed tensor its way; absent: the lean one
    status: str = "heuristic"

    def end(self, p: Problem, op: int) -> int:
        return self.start[op] + p.ops[op].alternatives[self.alt[op]].duration

    def makespan(self, p: Problem) -> int:
        return max((self.end(p, i) for i in range(len(p.ops))), default=0)

    def recompute(self, p: Problem, t: int) -> Alternative:
        """What tensor t's recomputation runs as."""
        return p.tensors[t].recompute_alternatives[self.recompute_alt.get(t, 0)]


@dataclass
class Timed:
    """Start and end of every op, copy and recomputation, in any time unit (ticks or microseconds)."""

    op_start: list[float]
    op_end: list[float]
    d2h: dict[int, tuple[float, float]]
    h2d: dict[int, tuple[float, float]]
    recompute: dict[int, tuple[float, float]]
    op_workspace: list[int]
    recompute_workspace: dict[int, int]

    @property
    def makespan(self) -> float:
        return max([*self.op_end, *(e for _, e in self.h2d.values()), *(e for _, e in self.d2h.values()),
                    *(e for _, e in self.recompute.values())], default=0.0)


def timed(p: Problem, s: Schedule) -> Timed:
    """The schedule's own times, in ticks."""
    rec = {t: (st, st + s.recompute(p, t).duration) for t, st in s.recompute_start.items()}
    return Timed(
        op_start=list(s.start), op_end=[s.end(p, i) for i in range(len(p.ops))],
        d2h={t: (st, st + p.tensors[t].d2h_ticks) for t, st in s.d2h_start.items()},
        h2d={t: (st, st + p.tensors[t].h2d_ticks) for t, st in s.h2d_start.items()},
        recompute=rec, op_workspace=[o.alternatives[a].workspace_bytes for o, a in zip(p.ops, s.alt)],
        recompute_workspace={t: s.recompute(p, t).workspace_bytes for t in rec})


def residency(p: Problem, decision: dict[int, Decision], tm: Timed) -> list[list[tuple[float, float]]]:
    """When each tensor occupies device memory: [start, end) intervals, at most two (before and after a gap).

    A kept tensor lives from its first writer's start (0 for a graph input) to its last reader's end (the end of
    the iteration for a graph output); an offloaded one until its copy out and its forward readers are done,
    then again from its copy back; a recomputed one again from its recomputation. A recomputation reads its
    chain's inputs, which live until it ends: in their first residency if kept, else in their second (which
    must have begun: the input was copied back or recomputed before).
    """
    extra_reads: dict[tuple[int, bool], list[float]] = {}  # (tensor, second residency) -> recomputation ends
    for t, (_, rec_end) in tm.recompute.items():
        for u in p.tensors[t].recompute_reads:
            extra_reads.setdefault((u, decision.get(u, "keep") != "keep"), []).append(rec_end)
    out = []
    for i, t in enumerate(p.tensors):
        born = min((tm.op_start[w] for w in t.writers), default=0.0)
        first_end = max([tm.op_end[w] for w in t.writers] or [born])
        first_end = max([first_end, *(tm.op_end[c] for c in t.early), *extra_reads.get((i, False), [])])
        if t.is_output:
            first_end = tm.makespan
        how = decision.get(i, "keep")
        late_end = max([*(tm.op_end[c] for c in t.late), *extra_reads.get((i, True), [])], default=first_end)
        if how == "keep":
            out.append([(born, max(first_end, late_end))])
        elif how == "offload":
            out.append([(born, max(first_end, tm.d2h[i][1])), (tm.h2d[i][0], late_end)])
        else:
            out.append([(born, first_end), (tm.recompute[i][0], late_end)])
    return out


def memory_events(p: Problem, decision: dict[int, Decision], tm: Timed) -> list[tuple[float, int, str]]:
    """(instant, byte change, what) for every allocation and free, frees first at equal instants."""
    events = []
    for i, intervals in enumerate(residency(p, decision, tm)):
        for a, b in intervals:
            events += [(a, p.tensors[i].bytes, p.tensors[i].name), (b, -p.tensors[i].bytes, p.tensors[i].name)]
    for o, ws in enumerate(tm.op_workspace):
        if ws:
            events += [(tm.op_start[o], ws, f"workspace of {p.ops[o].name}"), (tm.op_end[o], -ws, "")]
    for t, ws in tm.recompute_workspace.items():
        if ws:
            a, b = tm.recompute[t]
            events += [(a, ws, f"workspace of recomputing {p.tensors[t].name}"), (b, -ws, "")]
    return sorted(events, key=lambda e: (e[0], e[1]))


def peak_memory(p: Problem, decision: dict[int, Decision], tm: Timed) -> tuple[int, float]:
    """(peak bytes including the resident ones, the first instant it is reached)."""
    live, peak, at = p.resident_bytes, p.resident_bytes, 0.0
    for instant, delta, _ in memory_events(p, decision, tm):
        live += delta
        if live > peak:
            peak, at = live, instant
    return peak, at


def peaks_within(p: Problem, s: Schedule, cap_bytes: int) -> bool:
    """The schedule's own residencies peak within the cap (list_schedule's `fits` counts as it goes)."""
    return peak_memory(p, s.decision, timed(p, s))[0] <= cap_bytes


def loose_horizon(p: Problem) -> int:
    """Every op, copy and recomputation one after another at its slowest: no optimal schedule is longer."""
    total = sum(max(a.duration for a in o.alternatives) for o in p.ops)
    total += sum(t.d2h_ticks + t.h2d_ticks + max((a.duration for a in t.recompute_alternatives), default=0)
                 for t in p.tensors)
    return total
