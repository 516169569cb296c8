"""The CP-SAT model: algorithm, start, and keep/offload/recompute of saved tensors, in one model.

Data and variables follow OR-Tools' flexible job-shop example: each op has one optional interval per candidate
algorithm sharing the op's start and end, tied by presence literals of which exactly one holds. Constraints
are added by family, one `add_*` function each; the objective is the makespan, then the peak memory.
Time is in integer ticks (Problem.tick_us), memory in bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ortools.sat.python import cp_model

from planner.problem import DRAM_CAPACITY, SM_CAPACITY, Alternative, Problem
from planner.schedule import Schedule, residency, timed

PEAK_LEVELS = 100  # the objective's second term: peak memory in hundredths of the cap
CHUNK_DET_S = 1.0  # OR-Tools' interleaved search runs each full-problem worker in chunks of this deterministic time


@dataclass
class Vars:
    start: list = field(default_factory=list)
    end: list = field(default_factory=list)
    present: list[list] = field(default_factory=list)  # [op][alternative] -> literal
    runs: list[list] = field(default_factory=list)  # [op][alternative] -> optional interval
    keep: dict = field(default_factory=dict)  # tensor -> literal (choosable tensors only)
    offload: dict = field(default_factory=dict)
    recompute: dict = field(default_factory=dict)
    d2h: dict = field(default_factory=dict)  # tensor -> optional interval
    h2d: dict = field(default_factory=dict)
    rec: dict = field(default_factory=dict)  # tensor -> optional interval (or Span) of the recomputation
    rec_runs: dict = field(default_factory=dict)  # tensor -> [(literal, optional interval)] per way it may run as
    first_end: dict = field(default_factory=dict)  # tensor -> end of its first residency
    second: dict = field(default_factory=dict)  # tensor -> optional interval of its second residency
    memory: list = field(default_factory=list)  # (interval, bytes)
    makespan: object = None
    peak: object = None


@dataclass
class Span:
    """Start and end of a recomputation with several ways to run, each its own optional interval (`Vars.rec_runs`),
    tied to them as an op's alternatives are."""

    start: cp_model.IntVar
    end: cp_model.IntVar

    def start_expr(self) -> cp_model.IntVar:
        return self.start

    def end_expr(self) -> cp_model.IntVar:
        return self.end


def new_variables(m: cp_model.CpModel, p: Problem, horizon: int) -> Vars:
    """Per op a start, an end and one optional fixed-size interval per alternative on that start, the end tied by
    an equality enforced by the alternative's literal (intervals sharing a start and an end variable made OR-Tools
    9.15 abort or answer INFEASIBLE on feasible models: test_solver); per choosable tensor its decision literals
    and copy or recomputation intervals."""
    v = Vars()
    for i, op in enumerate(p.ops):
        v.start.append(m.new_int_var(0, horizon, f"start{i}"))
        v.end.append(m.new_int_var(0, horizon, f"end{i}"))
        lits, runs = [], []
        for a, alt in enumerate(op.alternatives):
            lit = m.new_constant(1) if len(op.alternatives) == 1 else m.new_bool_var(f"x{i}_{a}")
            lits.append(lit)
            runs.append(m.new_optional_fixed_size_interval_var(v.start[i], alt.duration, lit, f"run{i}_{a}"))
            m.add(v.end[i] == v.start[i] + alt.duration).only_enforce_if(lit)
        v.present.append(lits)
        v.runs.append(runs)
    for t, tu in enumerate(p.tensors):
        if not tu.choosable:
            continue
        v.keep[t] = m.new_bool_var(f"keep{t}")
        v.offload[t] = m.new_bool_var(f"off{t}") if tu.can_offload else m.new_constant(0)
        v.recompute[t] = m.new_bool_var(f"rec{t}") if tu.can_recompute else m.new_constant(0)
        if tu.can_offload:
            v.d2h[t] = _optional_fixed(m, horizon, tu.d2h_ticks, v.offload[t], f"d2h{t}")
            v.h2d[t] = _optional_fixed(m, horizon, tu.h2d_ticks, v.offload[t], f"h2d{t}")
        if tu.can_recompute:
            _recompute_variables(m, v, t, tu.recompute_alternatives, horizon)
    v.makespan = m.new_int_var(0, horizon, "makespan")
    return v


def _recompute_variables(m: cp_model.CpModel, v: Vars, t: int, ways: list[Alternative], horizon: int) -> None:
    """One optional interval where the recomputation runs one way; else a Span, one interval per way on its
    start, the end tied by the way's literal, and sum of the ways' literals = recompute[t]."""
    if len(ways) == 1:
        v.rec[t] = _optional_fixed(m, horizon, ways[0].duration, v.recompute[t], f"rec{t}")
        v.rec_runs[t] = [(v.recompute[t], v.rec[t])]
        return
    start, end = m.new_int_var(0, horizon, f"rec{t}_start"), m.new_int_var(0, horizon, f"rec{t}_end")
    v.rec[t], v.rec_runs[t] = Span(start, end), []
    for a, way in enumerate(ways):
        lit = m.new_bool_var(f"rec{t}_{a}")
        v.rec_runs[t].append((lit, m.new_optional_fixed_size_interval_var(start, way.duration, lit, f"rec{t}_{a}")))
        m.add(end == start + way.duration).only_enforce_if(lit)
    m.add(sum(lit for lit, _ in v.rec_runs[t]) == v.recompute[t])


def _optional_fixed(m: cp_model.CpModel, horizon: int, size: int, lit, name: str):
    s = m.new_int_var(0, horizon, f"{name}_start")
    return m.new_optional_interval_var(s, size, s + size, lit, name)


def add_one_algorithm(m: cp_model.CpModel, p: Problem, v: Vars) -> None:
    """sum_a x[o,a] = 1 for every op o: exactly one candidate algorithm runs."""
    for lits in v.present:
        if len(lits) > 1:
            m.add_exactly_one(lits)


def add_precedences(m: cp_model.CpModel, p: Problem, v: Vars) -> None:
    """end[a] <= start[b] for every dependency a -> b (data edges and in-place update after its readers)."""
    for b, op in enumerate(p.ops):
        for a in op.preds:
            m.add(v.end[a] <= v.start[b])


def add_sm_capacity(m: cp_model.CpModel, p: Problem, v: Vars) -> None:
    """sum of sm_fraction over the ops (and recomputations) running at any instant <= 1."""
    _add_share(m, p, v, "sm_demand", SM_CAPACITY)


def add_dram_bandwidth(m: cp_model.CpModel, p: Problem, v: Vars) -> None:
    """sum of dram_fraction over the ops (and recomputations) running at any instant <= 1: kernels that each
    need most of the memory bandwidth would only slow each other down side by side."""
    _add_share(m, p, v, "dram_demand", DRAM_CAPACITY)


def _add_share(m: cp_model.CpModel, p: Problem, v: Vars, demand: str, capacity: int) -> None:
    intervals, demands = [], []
    for i, op in enumerate(p.ops):
        for a, alt in enumerate(op.alternatives):
            intervals.append(v.runs[i][a])
            demands.append(getattr(alt, demand))
    for t, runs in v.rec_runs.items():
        for (_, iv), way in zip(runs, p.tensors[t].recompute_alternatives):
            intervals.append(iv)
            demands.append(getattr(way, demand))
    m.add_cumulative(intervals, demands, capacity)


def add_stream_limit(m: cp_model.CpModel, p: Problem, v: Vars, streams: int) -> None:
    """number of ops (and recomputations) running at any instant <= streams."""
    intervals = [iv for runs in v.runs for iv in runs] + [iv for runs in v.rec_runs.values() for _, iv in runs]
    m.add_cumulative(intervals, [1] * len(intervals), streams)


def add_copy_engines(m: cp_model.CpModel, p: Problem, v: Vars) -> None:
    """Copies in one direction never overlap: NoOverlap(d2h), NoOverlap(h2d)."""
    m.add_no_overlap(list(v.d2h.values()))
    m.add_no_overlap(list(v.h2d.values()))


def add_keep_offload_recompute(m: cp_model.CpModel, p: Problem, v: Vars) -> None:
    """keep[t] + offload[t] + recompute[t] = 1, and their timing:

    offload:   end[producer] <= start(d2h) ; end(d2h) <= start(h2d) ; end(h2d) <= start[c] for backward readers c
    recompute: end(rec) <= start[c] for backward readers c ; for each input u of the chain that is not kept,
               end(h2d[u]) <= start(rec) if u is offloaded, end(rec[u]) <= start(rec) if u is recomputed
    """
    for t, keep in v.keep.items():
        tu = p.tensors[t]
        m.add_exactly_one([keep, v.offload[t], v.recompute[t]])
        if t in v.d2h:
            off, d2h, h2d = v.offload[t], v.d2h[t], v.h2d[t]
            if tu.producer is not None:
                m.add(v.end[tu.producer] <= d2h.start_expr()).only_enforce_if(off)
            m.add(d2h.end_expr() <= h2d.start_expr()).only_enforce_if(off)
            for c in tu.late:
                m.add(h2d.end_expr() <= v.start[c]).only_enforce_if(off)
        if t in v.rec:
            rec = v.rec[t]
            m.add(v.end[tu.producer] <= rec.start_expr()).only_enforce_if(v.recompute[t])
            for c in tu.late:
                m.add(rec.end_expr() <= v.start[c]).only_enforce_if(v.recompute[t])
            for u in tu.recompute_reads:
                if u in v.h2d:
                    m.add(v.h2d[u].end_expr() <= rec.start_expr()).only_enforce_if([v.recompute[t], v.offload[u]])
                if u in v.rec:
                    m.add(v.rec[u].end_expr() <= rec.start_expr()).only_enforce_if([v.recompute[t], v.recompute[u]])


def add_lifetimes(m: cp_model.CpModel, p: Problem, v: Vars, horizon: int) -> None:
    """Each tensor's residencies as intervals (see schedule.residency):

    first:  [min start[writer], e1) with e1 >= end of every writer and of every forward reader (every reader when
            kept), e1 >= end(d2h) if offloaded, e1 >= end(rec) of a recomputation reading it while it is kept,
            e1 = makespan for a graph output
    second: [s2, e2), present unless kept, s2 = start(h2d) or start(rec), s2 >= e1, e2 >= end of every
            backward reader and of every recomputation reading it
    """
    readers_by_rec: dict[int, list[int]] = {}
    for t in v.rec:
        for u in p.tensors[t].recompute_reads:
            readers_by_rec.setdefault(u, []).append(t)
    for t, tu in enumerate(p.tensors):
        born = v.start[tu.producer] if tu.producer is not None else 0
        if len(tu.writers) > 1:  # several ops write into it (concat_view): it exists from the first one's start
            born = m.new_int_var(0, horizon, f"born_{t}")
            m.add_min_equality(born, [v.start[w] for w in tu.writers])
        e1 = m.new_int_var(0, horizon, f"e1_{t}")
        v.first_end[t] = e1
        for c in tu.writers + tu.early:
            m.add(e1 >= v.end[c])
        for c in tu.late:
            m.add(e1 >= v.end[c]).only_enforce_if(v.keep[t])
        for r in readers_by_rec.get(t, []):
            m.add(e1 >= v.rec[r].end_expr()).only_enforce_if([v.recompute[r], *([v.keep[t]] if t in v.keep else [])])
        if tu.is_output:
            m.add(e1 >= v.makespan)
        if tu.producer is not None:
            size = m.new_int_var(0, horizon, f"l1_{t}")
            v.memory.append((m.new_interval_var(born, size, e1, f"life1_{t}"), tu.bytes))
        else:
            v.memory.append((m.new_interval_var(0, e1, e1, f"life1_{t}"), tu.bytes))
        if t not in v.keep:
            continue
        s2, e2 = m.new_int_var(0, horizon, f"s2_{t}"), m.new_int_var(0, horizon, f"e2_{t}")
        away = v.keep[t].Not()
        second = m.new_optional_interval_var(s2, m.new_int_var(0, horizon, f"l2_{t}"), e2, away, f"life2_{t}")
        v.second[t] = second
        v.memory.append((second, tu.bytes))
        m.add(s2 >= e1).only_enforce_if(away)
        for c in tu.late:
            m.add(e2 >= v.end[c]).only_enforce_if(away)
        for r in readers_by_rec.get(t, []):
            m.add(e2 >= v.rec[r].end_expr()).only_enforce_if([v.recompute[r], away])
        if t in v.h2d:
            m.add(s2 == v.h2d[t].start_expr()).only_enforce_if(v.offload[t])
            m.add(e1 >= v.d2h[t].end_expr()).only_enforce_if(v.offload[t])
        if t in v.rec:
            m.add(s2 == v.rec[t].start_expr()).only_enforce_if(v.recompute[t])


def add_memory(m: cp_model.CpModel, p: Problem, v: Vars, cap_bytes: int) -> None:
    """resident + sum of live tensors and running workspaces at any instant <= peak <= cap."""
    intervals = [iv for iv, _ in v.memory]
    demands = [b for _, b in v.memory]
    for i, op in enumerate(p.ops):
        for a, alt in enumerate(op.alternatives):
            if alt.workspace_bytes:
                intervals.append(v.runs[i][a])
                demands.append(alt.workspace_bytes)
    for t, runs in v.rec_runs.items():
        for (_, iv), way in zip(runs, p.tensors[t].recompute_alternatives):
            if way.workspace_bytes:
                intervals.append(iv)
                demands.append(way.workspace_bytes)
    v.peak = m.new_int_var(0, max(0, cap_bytes - p.resident_bytes), "peak")
    m.add_cumulative(intervals, demands, v.peak)


def add_makespan(m: cp_model.CpModel, p: Problem, v: Vars) -> None:
    """makespan >= end[o] for every op."""
    m.add_max_equality(v.makespan, v.end)


def set_objective(m: cp_model.CpModel, p: Problem, v: Vars, cap_bytes: int) -> int:
    """minimise (makespan + sum_t offload[t] * round(copy_interference * (d2h[t] + h2d[t]))) * (levels + 1)
    + ceil(peak / unit), unit about a hundredth of the free memory (so the peak only breaks ties between equal
    costs); the first term is the heuristic's cost (heuristic.interference_ticks); returns its weight."""
    interference = sum(lit * round(p.device.copy_interference * (p.tensors[t].d2h_ticks + p.tensors[t].h2d_ticks))
                       for t, lit in v.offload.items() if p.tensors[t].can_offload)
    free = max(1, cap_bytes - p.resident_bytes)
    unit = max(1, free // PEAK_LEVELS)
    levels = -(-free // unit)
    level = m.new_int_var(0, levels, "peak_level")
    m.add(v.peak <= level * unit)
    m.minimize((v.makespan + interference) * (levels + 1) + level)
    return levels + 1


def add_hint(m: cp_model.CpModel, p: Problem, v: Vars, s: Schedule) -> None:
    """Every decision of a known schedule as CP-SAT's starting point."""
    for i, op in enumerate(p.ops):
        m.add_hint(v.start[i], s.start[i])
        m.add_hint(v.end[i], s.end(p, i))
        for a, lit in enumerate(v.present[i]):
            if len(op.alternatives) > 1:
                m.add_hint(lit, a == s.alt[i])
    tm = timed(p, s)
    lives = residency(p, s.decision, tm)
    for t, keep in v.keep.items():
        how = s.decision.get(t, "keep")
        m.add_hint(keep, how == "keep")
        if p.tensors[t].can_offload:
            m.add_hint(v.offload[t], how == "offload")
        if p.tensors[t].can_recompute:
            m.add_hint(v.recompute[t], how == "recompute")
            if len(v.rec_runs[t]) > 1:
                for a, (lit, _) in enumerate(v.rec_runs[t]):
                    m.add_hint(lit, how == "recompute" and s.recompute_alt.get(t, 0) == a)
        if how == "offload":
            m.add_hint(v.d2h[t].start_expr(), s.d2h_start[t])
            m.add_hint(v.h2d[t].start_expr(), s.h2d_start[t])
    for t, e1 in v.first_end.items():
        m.add_hint(e1, int(lives[t][0][1]))
    m.add_hint(v.makespan, s.makespan(p))


@dataclass
class SolveResult:
    schedule: Schedule | None
    status: str
    bound_ticks: int
    wall_s: float
    solutions: int
    peak_bytes: int = 0  # with minimize_memory: the smallest peak found
    det_s: float = 0.0  # CP-SAT's deterministic time spent


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, weight: int, on_progress: Callable[[int, int, float], None] | None):
        super().__init__()
        self.weight, self.on_progress, self.count, self.t0 = weight, on_progress, 0, time.monotonic()

    def on_solution_callback(self) -> None:
        self.count += 1
        if self.on_progress:
            self.on_progress(int(self.objective_value) // self.weight, int(self.best_objective_bound) // self.weight,
                             time.monotonic() - self.t0)


def solve(p: Problem, cap_bytes: int, streams: int, horizon: int, time_limit_s: float = 60.0, workers: int = 8,
          seed: int = 0, hint: Schedule | None = None, on_progress=None, log: bool = False,
          minimize_memory: bool = False, max_wall_s: float = float("inf"), wall_cap: bool = True) -> SolveResult:
    """Build the model and solve it; deterministic for a given seed and worker count (deterministic time limit),
    unless the wall clock reaches four times the limit, or `max_wall_s`, first (without `wall_cap`, only
    `max_wall_s` ends it: a runaway guard).

    Several workers search interleaved, each in chunks of CHUNK_DET_S, and the limit is checked only between
    chunks: under a limit below one chunk per worker, one worker searches, checking the limit as it goes. With
    eight, a 2-s limit ran 11 deterministic seconds, 161 s of wall on the development machine (Inception v3
    inference b32).

    With minimize_memory the objective is the peak alone (the smallest cap any schedule fits, for exit 3), and
    the bound returned is in bytes, the schedule one that peaks at `peak_bytes`.
    """
    m = cp_model.CpModel()
    v = new_variables(m, p, horizon)
    add_one_algorithm(m, p, v)
    add_precedences(m, p, v)
    add_sm_capacity(m, p, v)
    if any(a.dram_demand for o in p.ops for a in o.alternatives):
        add_dram_bandwidth(m, p, v)
    add_stream_limit(m, p, v, streams)
    add_copy_engines(m, p, v)
    add_keep_offload_recompute(m, p, v)
    add_makespan(m, p, v)
    add_lifetimes(m, p, v, horizon)
    add_memory(m, p, v, cap_bytes)
    if minimize_memory:
        m.minimize(v.peak)
        weight = 1
    else:
        weight = set_objective(m, p, v, cap_bytes)
    if hint is not None:
        add_hint(m, p, v, hint)
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.max_deterministic_time = time_limit_s
    wall_s = min(time_limit_s * 4, max_wall_s) if wall_cap else max_wall_s
    if wall_s < float("inf"):
        prm.max_time_in_seconds = max(0.0, wall_s)
    prm.num_workers = workers if time_limit_s >= workers * CHUNK_DET_S else 1
    prm.random_seed = seed
    prm.interleave_search = True
    prm.log_search_progress = log
    callback = _Progress(weight, on_progress)
    t0 = time.monotonic()
    status = solver.solve(m, callback)
    wall = time.monotonic() - t0
    name = solver.status_name(status)
    det_s = solver.response_proto.deterministic_time
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(None, name, 0, wall, callback.count, det_s=det_s)
    s = Schedule(alt=[next(a for a, lit in enumerate(lits) if solver.boolean_value(lit)) for lits in v.present],
                 start=[solver.value(x) for x in v.start], status=name)
    for t in v.keep:
        if solver.boolean_value(v.offload[t]):
            s.decision[t] = "offload"
            s.d2h_start[t] = solver.value(v.d2h[t].start_expr())
            s.h2d_start[t] = solver.value(v.h2d[t].start_expr())
        elif solver.boolean_value(v.recompute[t]):
            s.decision[t] = "recompute"
            s.recompute_start[t] = solver.value(v.rec[t].start_expr())
            s.recompute_alt[t] = next(a for a, (lit, _) in enumerate(v.rec_runs[t]) if solver.boolean_value(lit))
    if minimize_memory:
        return SolveResult(s, name, p.resident_bytes + int(solver.best_objective_bound), wall, callback.count,
                           p.resident_bytes + solver.value(v.peak), det_s)
    return SolveResult(s, name, int(solver.best_objective_bound) // weight, wall, callback.count, det_s=det_s)
