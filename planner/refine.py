"""Schedule -> shorter Schedule: CP-SAT on one window of the timeline at a time (large-neighbourhood search).

One model of a whole training graph is too large for CP-SAT to improve on the list schedule (ResNet-50 training
b32, 565 ops: nothing better in 160 s). A window of a few dozen items solves well in a fraction of a second, and
the list scheduler's greedy choices leave much to gain there: it packs ops side by side only as they become
ready, while a window can pick a narrower algorithm for one op so that its neighbour runs beside it. Per window:
its items (ops, recomputations, copies) get free starts and algorithms; items that started before it stay
where they are; items after it all move earlier by one `shift`. The model minimises the makespan that results;
a window is kept when the whole schedule gets cheaper and still fits the memory cap (memory is checked on the
whole schedule, not modelled in the window). Keep/offload/recompute decisions stay as they are. Windows are
solved on several threads at once, ahead of the one whose result is taken next.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ortools.sat.python import cp_model

from planner.heuristic import cost
from planner.problem import DRAM_CAPACITY, SM_CAPACITY, Alternative, Problem
from planner.schedule import Schedule, peak_memory, timed
from planner.window_memory import Residency, add_window_memory, residencies

WINDOW_SIZES = (10, 16, 24)  # items whose starts a window frees, smallest first (`refine`)
MIN_PASS_GAIN = 0.002  # a pass gaining less than this share of the cost moves on to larger windows
WINDOW_DET_LEVELS = (0.02, 0.05, 0.1, 0.2)  # CP-SAT's deterministic time per window at most, by stage: the sizes
# cycle at the first until a whole cycle gains nothing, then at the next (a window that gained nothing in a short solve
# may in a longer one). Many short windows gain more than fewer long ones, but converge early (training b32 at 50%,
# 120 s, from the same start: GoogLeNet 4186.6 us at 0.1 alone, 4177.1 at 0.05, converged after 86 s, 4177.1 staged;
# ResNet-50 8444.9 at 0.1, 8447.6 at 0.05, converged after 51 s, 8436.5 staged; 8423.2 with 16-32 items at 0.1, but
# those windows take 6% more wall time than the budget counts, and charged for it they gain nothing). The stage at
# 0.02 finds most gains of 0.05 in half the time (the windows at their limit take most of it): GoogLeNet training
# b32, budget in full, 4011.2 us at 50% (4016.9 from 0.05), 3653.0 uncapped (3654.3)
WALL_PER_DET = 18.0  # wall seconds per deterministic second of the windows taken, laid out on the lanes, and
WINDOW_OVERHEAD_S = 0.032  # the wall seconds a window costs besides: fitted to the rounds' wall times on the 2-core
# development machine (training b32, budget in full, 178 and 93 rounds of GoogLeNet at 50% and ResNet-50 at
# cap40torch: 14.2 and 0.024 together), with a quarter more for its swings, so that the budget, not the wall clock,
# ends 120-s searches and plans repeat (with a tenth more, two of four such solves still met the wall clock). They
# include the windows solved ahead and discarded and the main thread's work, which differ by model: ResNet-50 at 50%
# took a fifth more than these charges count. The first fit (7.5 and 0.015, nineteenth session) counted half the
# wall time the windows have taken since the window memory model and the shorter stages
LANES = 2  # windows solved at once, on threads (CP-SAT releases the GIL): that machine's cores
LOOKAHEAD = 16  # windows solved ahead of the one whose result is taken next, at most
FIT_EVERY = 8  # kept schedules between checks of the runner's arena (each ~0.07 s on training graphs)


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
        items.append(Item("recompute", t, st, [p.tensors[t].recompute], 0))
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
    after t1 moves earlier by `shift`."""

    t1: int
    shift: int
    free: dict[int, tuple[int, int]]  # item -> (start, alternative)


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
                 stop: Stop | None = None, memory: Memory | None = None, det_s: float = WINDOW_DET_LEVELS[-1]
                 ) -> tuple[Move | None, float]:
    """(the window's solution, or None; CP-SAT's deterministic time spent, at most `det_s` a solve). One worker: a
    window is small, and one worker's search is deterministic without interleaving. When the move found gains but
    overflows the cap, the window is solved again with `memory` in its model (window_memory): that solves slower
    (GoogLeNet training b32 at 50%, the window over the last 900 us: 0.23 deterministic s against 0.006), and most
    moves fit."""
    move, spent = _solve_window(items, edges, t0, t1, streams, seed, stop, None, det_s)
    if move is not None and memory is not None and memory.overflows(move):
        move, more = _solve_window(items, edges, t0, t1, streams, seed, stop, memory, det_s)
        spent += more
    return move, spent


def _solve_window(items: list[Item], edges: list[tuple[int, int]], t0: int, t1: int, streams: int, seed: int,
                  stop: Stop | None, memory: Memory | None, det_s: float) -> tuple[Move | None, float]:
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
    status = solver.solve(w.model)
    spent = solver.response_proto.deterministic_time
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, spent
    free = {k: (solver.value(w.start[k]), next(a for a, lit in enumerate(lits) if solver.boolean_value(lit)))
            for k, lits in w.present.items()}
    return Move(t1, solver.value(w.shift), free), spent


def apply(s: Schedule, items: list[Item], move: Move) -> Schedule:
    """The schedule with the move made."""
    out = Schedule(alt=list(s.alt), start=list(s.start), decision=dict(s.decision), d2h_start=dict(s.d2h_start),
                   h2d_start=dict(s.h2d_start), recompute_start=dict(s.recompute_start), status=s.status)
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
    return out


def signature(items: list[Item], t0: int, t1: int) -> tuple:
    """What a window's model is made of, relative to its start: a window seen before without gain is skipped."""
    lo, _, reach = _span(items, t0, t1)
    return tuple((it.kind, it.index, it.chosen, it.start - t0) for it in items if it.end > lo and it.start < reach)


Span = tuple[int, int, int, tuple]  # a window: (position in the items, t0, t1, signature)


@dataclass
class Memory:
    """What a window needs to keep its move under the cap: the schedule's residencies, the room the cap leaves
    them, and whether a move gains but overflows."""

    lives: list[Residency]
    room_bytes: int
    overflows: Callable[[Move], bool]


def sweep(p: Problem, s: Schedule, items: list[Item], width: int, k: int, fruitless: set[tuple]) -> Iterator[Span]:
    """The windows of `width` items from position k on, every width / 2 items, but those known fruitless."""
    for at in range(k, len(items), width // 2):
        t0 = items[at].start
        t1 = max(t0 + 1, items[at + width].start if at + width < len(items) else s.makespan(p))
        seen = signature(items, t0, t1)
        if seen not in fruitless:
            yield at, t0, t1, seen


def _judged(p: Problem, cap_bytes: int, s: Schedule, s_cost: float, items: list[Item], move: Move
            ) -> tuple[Schedule, bool] | None:
    """(the schedule with the move made, whether it fits the cap) if that is cheaper, else None."""
    trial = apply(s, items, move)
    if cost(p, trial) >= s_cost:
        return None
    return trial, peak_memory(p, trial.decision, timed(p, trial))[0] <= cap_bytes


def _better(p: Problem, cap_bytes: int, s: Schedule, s_cost: float, items: list[Item], move: Move | None
            ) -> Schedule | None:
    """The schedule with the move made, if that is cheaper and fits the cap."""
    judged = _judged(p, cap_bytes, s, s_cost, items, move) if move is not None else None
    return judged[0] if judged is not None and judged[1] else None


def _memory(p: Problem, cap_bytes: int, s: Schedule, s_cost: float, items: list[Item]) -> Memory | None:
    """The windows' Memory for schedule s, None where the cap cannot bind."""
    room = cap_bytes - p.resident_bytes
    if room >= sum(t.bytes for t in p.tensors):
        return None

    def overflows(move: Move) -> bool:
        judged = _judged(p, cap_bytes, s, s_cost, items, move)
        return judged is not None and not judged[1]

    return Memory(residencies(p, s, items), room, overflows)


def solve_round(pool: ThreadPoolExecutor, lanes: int, items: list[Item], edges: list[tuple[int, int]],
                memory: Memory | None, spans: Iterator[Span], streams: int, seed: int, det_s: float,
                gains: Callable[[Move | None], Schedule | None], budget_s: float, deadline: float
                ) -> tuple[list[Span], tuple[Span, Schedule] | None, float]:
    """Solves the spans in order on `lanes` threads, each lane taking the next span as soon as it is free, and
    takes their results in order up to the first that gains, or until `budget_s` is spent or the wall clock
    passes `deadline`: (the windows taken without gain, the gaining window and its schedule or None, the
    seconds spent). Windows solved past the first gain are stopped and discarded, so the windows taken are
    those one lane would take. The seconds are those of the windows taken, laid out in order on the lanes as
    the threads take them: they depend on CP-SAT's deterministic time, not on which thread finished first."""
    stop, flight, failed, gain = Stop(), deque(), [], None
    lane_free = [0.0] * lanes

    def fill() -> None:
        running = sum(not future.done() for _, future in flight)
        while running < lanes and len(flight) < LOOKAHEAD and (span := next(spans, None)) is not None:
            flight.append((span, pool.submit(solve_window, items, edges, span[1], span[2], streams, seed, stop,
                                             memory, det_s)))
            running += 1

    fill()
    while flight and gain is None and max(lane_free) < budget_s and time.monotonic() < deadline:
        span, future = flight[0]
        while not future.done():
            wait([f for _, f in flight if not f.done()], return_when=FIRST_COMPLETED)
            fill()
        flight.popleft()
        move, used = future.result()
        lane = lane_free.index(min(lane_free))
        lane_free[lane] += used * WALL_PER_DET + WINDOW_OVERHEAD_S
        trial = gains(move)
        if trial is not None:
            gain = span, trial
        else:
            failed.append(span)
            fill()
    stop()
    for _, future in flight:
        future.result()
    return failed, gain, max(lane_free)


def refine(p: Problem, cap_bytes: int, streams: int, s: Schedule, budget_s: float, seed: int = 0,
           on_progress: Callable[[int, float], None] | None = None,
           fits: Callable[[Schedule], bool] | None = None, lanes: int = LANES, fit_s: float = 0.0,
           deadline: float = float("inf")) -> tuple[Schedule, float]:
    """(the schedule improved window by window, the budget spent). Passes sweep windows of WINDOW_SIZES[i] items
    from the start of the schedule to its end, overlapping by half; a window is kept when the schedule gets cheaper
    and fits the cap. A pass that gains over MIN_PASS_GAIN repeats its size, one that does not moves on to larger
    windows; after the largest, the sizes cycle again while the cycle before gained over MIN_PASS_GAIN, then again
    with each window solved longer (WINDOW_DET_LEVELS). Windows whose model was solved before without gain at this
    length are skipped, so a later cycle solves only the windows that kept schedules changed. `lanes` threads solve
    the next windows of the sweep from the same schedule, taken in order up to the first that gains (`solve_round`):
    most windows gain nothing, so this keeps the windows one lane would, sooner (ResNet-50 training at 50%, 60 s:
    8573.6 us against 8648.8 with one lane). The budget is in seconds of the development machine, counted from
    CP-SAT's deterministic time (WALL_PER_DET, WINDOW_OVERHEAD_S) so that plans repeat for a given seed and lane
    count; no round starts after the wall clock passes `deadline` (a slower machine's plan then depends on its
    speed). Kept schedules must also pass `fits` (the runner's arena, which may need more than the peak), checked
    every FIT_EVERY of them (`_verified`), each check charged `fit_s`."""
    t_start, spent = time.monotonic(), 0.0
    best, best_cost = s, cost(p, s)
    fruitless: set[tuple] = set()
    level, size, cycle_cost = 0, 0, best_cost
    verified, unverified = s, []  # the last schedule known to fit; those kept since, with their windows

    def fitting(trial: Schedule) -> bool:
        nonlocal spent
        spent += fit_s
        return fits(trial)

    with ThreadPoolExecutor(lanes) as pool:
        while level < len(WINDOW_DET_LEVELS) and spent < budget_s and time.monotonic() < deadline:
            width, k, pass_cost = WINDOW_SIZES[size], 0, best_cost
            while True:
                items = items_of(p, best)
                edges = precedences(p, best, items)  # all three change only when a window is kept
                memory = _memory(p, cap_bytes, best, best_cost, items)
                failed, gain, used = solve_round(
                    pool, lanes, items, edges, memory, sweep(p, best, items, width, k, fruitless), streams, seed,
                    WINDOW_DET_LEVELS[level], lambda move: _better(p, cap_bytes, best, best_cost, items, move),
                    budget_s - spent, deadline)
                spent += used
                fruitless.update(seen for _, _, _, seen in failed)
                if gain is None:  # the pass or the budget is over
                    break
                (k, _, _, seen), best = gain
                unverified.append((best, seen))
                if fits is not None and len(unverified) >= FIT_EVERY:
                    best = verified = _verified(verified, unverified, fitting, fruitless)
                best_cost, k = cost(p, best), k + width // 2
                if on_progress:
                    on_progress(best.makespan(p), time.monotonic() - t_start)
            size += best_cost > pass_cost * (1 - MIN_PASS_GAIN)
            if size == len(WINDOW_SIZES):
                if best_cost >= cycle_cost * (1 - MIN_PASS_GAIN):  # converged: the next stage, every window again
                    if fits is not None and unverified:
                        best = verified = _verified(verified, unverified, fitting, fruitless)
                        best_cost = cost(p, best)
                    level += 1
                    fruitless.clear()
                size, cycle_cost = 0, best_cost
    if fits is not None and unverified:
        best = _verified(verified, unverified, fitting, fruitless)
    return best, spent


def _verified(verified: Schedule, unverified: list[tuple[Schedule, tuple]], fits: Callable[[Schedule], bool],
              fruitless: set[tuple]) -> Schedule:
    """The latest of the schedules kept since `verified` (which fits) that fits, emptying `unverified`. Once a
    kept schedule overflows, those built on it mostly do too (ResNet-50 training b32 at 50%, solved under the
    cap itself: the 39th of 88 and every later one; checked at the end only, the search fell back to the 38th,
    8753.7 us against 8499.4): a bisection finds the first that overflows, and its window is not tried again."""
    schedules = [sch for sch, _ in unverified]
    if fits(schedules[-1]):
        unverified.clear()
        return schedules[-1]
    lo, hi = -1, len(schedules) - 1  # schedules[lo] fits (-1: the one before them), schedules[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(schedules[mid]) else (lo, mid)
    fruitless.add(unverified[hi][1])
    unverified.clear()
    return schedules[lo] if lo >= 0 else verified
