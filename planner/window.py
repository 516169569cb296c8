"""One window of the timeline as a CP-SAT model (planner.refine solves them one after another): its items' starts
and algorithms free, items before it fixed, items after it shifted earlier together; and the move its solution
makes on the whole schedule."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from ortools.sat.python import cp_model

from planner.problem import DRAM_CAPACITY, SM_CAPACITY, Alternative, Problem
from planner.schedule import Schedule
from planner.window_memory import Residency, add_window_memory


@dataclass
class Item:
    """One thing the schedule starts: an op, a recomputation or a copy, with what it may run as."""

    kind: str  # "op", "recompute", "d2h", "h2d"
    index: int  # op index, or tensor index for the others
    start: int  # ticks
    alternatives: list[Alternative]  # copies: one, with the copy's duration and no SM share
    chosen: int

    @property
    def end(self) -> int:
        return self.start + self.alternatives[self.chosen].duration

    @property
    def compute(self) -> bool:
        return self.kind in ("op", "recompute")


@dataclass
class Window:
    """The CP-SAT model of one window: `free` items move, `fixed` ones (started before it) stay, `shifted` ones
    (after it) move by `shift`."""

    model: cp_model.CpModel
    shift: cp_model.IntVar
    t0: int  # free items start in [t0, t1)
    t1: int
    span: tuple[int, int, int]  # (lo, E, reach): see new_window
    start: dict[int, object] = field(default_factory=dict)  # item -> start expression (free and shifted items)
    end: dict[int, object] = field(default_factory=dict)
    present: dict[int, list] = field(default_factory=dict)  # free item -> literal per alternative
    intervals: list[tuple[object, int, Alternative]] = field(default_factory=list)  # (interval, item, what it runs)


def items_of(p: Problem, s: Schedule) -> list[Item]:
    """Every op, recomputation and copy of the schedule, in start order."""
    items = [Item("op", i, s.start[i], o.alternatives, s.alt[i]) for i, o in enumerate(p.ops)]
    for t, st in s.recompute_start.items():
        items.append(Item("recompute", t, st, p.tensors[t].recompute_alternatives, s.recompute_alt.get(t, 0)))
    for kind, starts, ticks in (("d2h", s.d2h_start, "d2h_ticks"), ("h2d", s.h2d_start, "h2d_ticks")):
        for t, st in starts.items():
            items.append(Item(kind, t, st, [Alternative(kind, 0.0, getattr(p.tensors[t], ticks), 0, 0)], 0))
    return sorted(items, key=lambda it: (it.start, it.kind, it.index))


def precedences(p: Problem, s: Schedule, items: list[Item]) -> list[tuple[int, int]]:
    """(a, b): item b starts after item a ends. Op dependencies, and for the tensors' decisions what
    cpsat.add_keep_offload_recompute states: producer -> copy out -> copy back -> backward readers and
    recomputations reading it; producer -> recomputation -> backward readers and recomputations reading it."""
    at = {(it.kind, it.index): k for k, it in enumerate(items)}
    edges = [(at["op", a], at["op", b]) for b, o in enumerate(p.ops) for a in o.preds]
    readers: dict[int, list[int]] = {}  # tensor -> recomputations that read it
    for t in s.recompute_start:
        for u in p.tensors[t].recompute_reads:
            readers.setdefault(u, []).append(at["recompute", t])
    for t, how in s.decision.items():
        tu = p.tensors[t]
        if how == "offload":
            first, last = at["d2h", t], at["h2d", t]
            edges.append((first, last))
        else:
            first = last = at["recompute", t]
        if tu.producer is not None:
            edges.append((at["op", tu.producer], first))
        edges += [(last, at["op", c]) for c in tu.late] + [(last, r) for r in readers.get(t, [])]
    return edges


def new_window(items: list[Item], edges: list[tuple[int, int]], t0: int, t1: int) -> Window | None:
    """Items starting in [t0, t1) are free, from lo = t0 - (t1 - t0) on (items before them that end after lo
    are fixed intervals) and ending by E, the latest end of an item started before t1. Items starting after
    t1 move by shift <= t1 - t0; those starting past E + (t1 - t0) meet neither free nor fixed items, so they
    stay out of the model."""
    free = [k for k, it in enumerate(items) if t0 <= it.start < t1]
    if not free:
        return None
    lo, latest, reach = _span(items, t0, t1)
    m = cp_model.CpModel()
    w = Window(m, m.new_int_var(0, t1 - t0, "shift"), t0, t1, (lo, latest, reach))
    for k, it in enumerate(items):
        alt = it.alternatives[it.chosen]
        if it.start < t0 and it.end > lo:
            w.intervals.append((m.new_fixed_size_interval_var(it.start, alt.duration, f"fixed{k}"), k, alt))
        elif t1 <= it.start < reach:
            w.start[k] = it.start - w.shift
            w.end[k] = it.end - w.shift
            w.intervals.append((m.new_fixed_size_interval_var(w.start[k], alt.duration, f"shifted{k}"), k, alt))
    for k in free:
        it = items[k]
        start, end = m.new_int_var(lo, latest, f"start{k}"), m.new_int_var(lo, latest, f"end{k}")
        w.start[k], w.end[k], w.present[k] = start, end, []
        for a, alt in enumerate(it.alternatives):
            lit = m.new_constant(1) if len(it.alternatives) == 1 else m.new_bool_var(f"x{k}_{a}")
            w.present[k].append(lit)
            w.intervals.append((m.new_optional_fixed_size_interval_var(start, alt.duration, lit, f"run{k}_{a}"),
                                k, alt))
            m.add(end == start + alt.duration).only_enforce_if(lit)
        if len(it.alternatives) > 1:
            m.add_exactly_one(w.present[k])
            for a, lit in enumerate(w.present[k]):
                m.add_hint(lit, a == it.chosen)
        m.add_hint(start, it.start)
        m.add_hint(end, it.end)
    add_window_precedences(w, items, edges)
    return w


def _span(items: list[Item], t0: int, t1: int) -> tuple[int, int, int]:
    """(lo, E, reach) of the window [t0, t1): see new_window."""
    latest = max(it.end for it in items if it.start < t1)
    return max(0, 2 * t0 - t1), latest, latest + (t1 - t0)


def add_window_precedences(w: Window, items: list[Item], edges: list[tuple[int, int]]) -> None:
    """end(a) <= start(b) for every precedence touching a free or shifted item; a fixed a gives a constant end.
    The other pairs hold already: both fixed, both shifted, or b past E + (t1 - t0) >= E + shift."""
    for a, b in edges:
        if b not in w.start or (a in w.start and a not in w.present and b not in w.present):
            continue
        if a in w.end or items[a].start < items[b].start:
            w.model.add(w.end.get(a, items[a].end) <= w.start[b])


def add_window_resources(w: Window, items: list[Item], streams: int) -> None:
    """In the window as in cpsat: the SM shares of running ops and recomputations sum to <= 1 (DRAM shares too,
    when measured); at most `streams` of them run at once; copies in one direction never overlap."""
    compute = [(iv, alt) for iv, k, alt in w.intervals if items[k].compute]
    w.model.add_cumulative([iv for iv, _ in compute], [a.sm_demand for _, a in compute], SM_CAPACITY)
    if any(a.dram_demand for _, a in compute):
        w.model.add_cumulative([iv for iv, _ in compute], [a.dram_demand for _, a in compute], DRAM_CAPACITY)
    w.model.add_cumulative([iv for iv, _ in compute], [1] * len(compute), streams)
    for kind in ("d2h", "h2d"):
        w.model.add_no_overlap([iv for iv, k, _ in w.intervals if items[k].kind == kind])


def set_window_objective(w: Window, items: list[Item]) -> None:
    """minimise M, M >= end of every free item, M >= the schedule's last end - shift: the new makespan."""
    last = max(it.end for it in items)
    bound = w.model.new_int_var(0, last, "makespan")
    for k in w.present:
        w.model.add(bound >= w.end[k])
    w.model.add(bound >= last - w.shift)
    w.model.minimize(bound)


@dataclass
class Move:
    """What solving one window changes: its free items' starts and alternatives, and every item starting at or
    after t1 moves earlier by `shift`. `runner_ups`: solutions CP-SAT found before this one, latest first, each
    longer at times alone but perhaps cheaper settled (planner.refine judges them too)."""

    t1: int
    shift: int
    free: dict[int, tuple[int, int]]  # item -> (start, alternative)
    runner_ups: list[Move] = field(default_factory=list)


class Stop:
    """Stops windows still being solved once an earlier one of their round gained: theirs would be discarded."""

    def __init__(self):
        self.lock, self.solvers, self.stopped = threading.Lock(), [], False

    def watch(self, solver: cp_model.CpSolver) -> bool:
        """False once stopped; a solver watched just before its solve begins may run to its limit (harmless)."""
        with self.lock:
            self.solvers.append(solver)
            return not self.stopped

    def __call__(self) -> None:
        with self.lock:
            self.stopped = True
            for solver in self.solvers:
                solver.stop_search()


def solve_window(items: list[Item], edges: list[tuple[int, int]], t0: int, t1: int, streams: int, seed: int,
                 det_s: float, stop: Stop | None = None, memory: Memory | None = None, runner_ups: int = 0
                 ) -> tuple[Move | None, float]:
    """(the window's solution, or None; CP-SAT's deterministic time spent, at most `det_s` a solve). One worker: a
    window is small, and one worker's search is deterministic without interleaving. When the move found gains but
    overflows the cap, the window is solved again with `memory` in its model (window_memory): that solves slower
    (GoogLeNet training b32 at 50%, the window over the last 900 us: 0.23 deterministic s against 0.006), and most
    moves fit. The move carries up to `runner_ups` of the solutions CP-SAT found before its last (`Move`)."""
    move, spent = _solve_window(items, edges, t0, t1, streams, seed, stop, None, det_s, runner_ups)
    if move is not None and memory is not None and memory.overflows(move):
        move, more = _solve_window(items, edges, t0, t1, streams, seed, stop, memory, det_s, runner_ups)
        spent += more
    return move, spent


class _Solutions(cp_model.CpSolverSolutionCallback):
    """The moves of the solutions CP-SAT finds, in order (each shorter at times alone than the one before), but
    those that move nothing (the hint)."""

    def __init__(self, w: Window, items: list[Item]):
        super().__init__()
        self.w, self.items, self.moves = w, items, []

    def on_solution_callback(self) -> None:
        move = _move(self.w, self)
        if move.shift or any(at != (self.items[k].start, self.items[k].chosen) for k, at in move.free.items()):
            self.moves.append(move)


def _move(w: Window, solution: cp_model.CpSolver | cp_model.CpSolverSolutionCallback) -> Move:
    """The move a solution of the window's model makes."""
    free = {k: (solution.value(w.start[k]), next(a for a, lit in enumerate(lits) if solution.boolean_value(lit)))
            for k, lits in w.present.items()}
    return Move(w.t1, solution.value(w.shift), free)


def _solve_window(items: list[Item], edges: list[tuple[int, int]], t0: int, t1: int, streams: int, seed: int,
                  stop: Stop | None, memory: Memory | None, det_s: float, runner_ups: int = 0
                  ) -> tuple[Move | None, float]:
    w = new_window(items, edges, t0, t1)
    if w is None:
        return None, 0.0
    add_window_resources(w, items, streams)
    if memory is not None:
        add_window_memory(w, items, memory.lives, memory.room_bytes)
    set_window_objective(w, items)
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.max_deterministic_time = det_s
    prm.num_workers = 1
    prm.random_seed = seed
    prm.linearization_level = 0  # small models: LP relaxation, symmetry and probing cost more than they save
    prm.symmetry_level = 0
    prm.cp_model_probing_level = 0
    if stop is not None and not stop.watch(solver):
        return None, 0.0
    found = _Solutions(w, items)  # a callback only where runner-ups are wanted: it takes the GIL each solution
    status = solver.solve(w.model, found if runner_ups else None)
    spent = solver.response_proto.deterministic_time
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, spent
    move = _move(w, solver)
    earlier = found.moves[:-1] if found.moves and found.moves[-1].free == move.free else found.moves
    move.runner_ups = earlier[::-1][:runner_ups]
    return move, spent


def apply(s: Schedule, items: list[Item], move: Move) -> Schedule:
    """The schedule with the move made."""
    out = Schedule(alt=list(s.alt), start=list(s.start), decision=dict(s.decision), d2h_start=dict(s.d2h_start),
                   h2d_start=dict(s.h2d_start), recompute_start=dict(s.recompute_start),
                   recompute_alt=dict(s.recompute_alt), status=s.status)
    starts = {"d2h": out.d2h_start, "h2d": out.h2d_start, "recompute": out.recompute_start}
    for k, it in enumerate(items):
        if k in move.free:
            start, alt = move.free[k]
        elif it.start >= move.t1:
            start, alt = it.start - move.shift, it.chosen
        else:
            continue
        if it.kind == "op":
            out.start[it.index], out.alt[it.index] = start, alt
        else:
            starts[it.kind][it.index] = start
        if it.kind == "recompute":
            out.recompute_alt[it.index] = alt
    return out


def signature(items: list[Item], t0: int, t1: int) -> tuple:
    """What a window's model is made of, relative to its start: a window seen before without gain is skipped."""
    lo, _, reach = _span(items, t0, t1)
    return tuple((it.kind, it.index, it.chosen, it.start - t0) for it in items if it.end > lo and it.start < reach)


@dataclass
class Memory:
    """What a window needs to keep its move under the cap: the schedule's residencies, the room the cap leaves
    them, and whether a move gains but overflows."""

    lives: list[Residency]
    room_bytes: int
    overflows: Callable[[Move], bool]
