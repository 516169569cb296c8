"""Exit 3: no schedule fits the cap. The answer names the least cap a schedule was found at, as the runner's arena
lays it out (`with_arena`), and the floor no schedule goes below (memory_bounds.memory_lower_bound, or CP-SAT's bound on
the least peak)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Sequence

from planner.arena_fit import device_bytes, plan_of
from planner.memory_bounds import memory_lower_bound
from planner.budget import CPSAT_WALL_PER_DET, MIN_SEARCH_SHARE, RUNAWAY
from planner.decisions import QUICK_EVALS, best_heuristic, fit_slack
from planner.files import PlannerError
from planner.heuristic import serial_baseline
from planner.ir import Graph
from planner.memsize import fmt_bytes
from planner.problem import Problem
from planner.schedule import Schedule, loose_horizon, peak_memory, timed

if TYPE_CHECKING:
    from planner.solve import Options

EXIT_CAP_TOO_SMALL = 3
LEANEST_TOLERANCE = 0.01  # leanest_schedules bisects the cap to within this share of the peak it found


class CapTooSmall(PlannerError):
    """No schedule fits the cap; `minimum_bytes` is the smallest cap that does (or a proven lower bound), and no
    schedule needs less than `floor_bytes`."""

    exit_code = EXIT_CAP_TOO_SMALL

    def __init__(self, message: str, minimum_bytes: int, schedule: Schedule | None = None, floor_bytes: int = 0,
                 verdict: str = "", note: str = "", found: list[tuple[Schedule, int]] | None = None):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.schedule = schedule  # one that peaks at minimum_bytes, where one was found
        self.floor_bytes = floor_bytes
        self.verdict, self.note = verdict, note  # the message's parts before and after the answer (answer)
        self.found = found or []  # every schedule the search for the least peak found, with its peak


def cap_too_small(p: Problem, cap_bytes: int, options: Options, status: str,
                  deadline: float = float("inf")) -> CapTooSmall:
    """CP-SAT found no schedule under the cap: the least peak a schedule was found at (the cap that works) and
    the floor no schedule goes below. The heuristic's leanest schedule (`leanest_schedules`) starts CP-SAT, which then
    minimises the peak for what is left of the time limit (at least MIN_SEARCH_SHARE of it): it proves the
    minimum on small graphs. From the serial schedule instead, on GoogLeNet training b32 it found no schedule at
    all and ran 118 s past a 20-s limit."""
    from planner import cpsat

    floor, least_s = memory_lower_bound(p)[0], options.time_limit_s * MIN_SEARCH_SHARE
    until = math.inf if options.deterministic else max(deadline, time.monotonic() + least_s)
    found = leanest_schedules(p, options.streams, max(floor, cap_bytes), until)
    leanest, works = found[-1]
    wall_s = max(deadline - time.monotonic(), least_s)  # deterministic: the runaway guard alone
    det_s = options.time_limit_s if options.deterministic else min(options.time_limit_s, wall_s)
    r = cpsat.solve(p, max(p.device.memory_bytes, cap_bytes * 4, works), options.streams, loose_horizon(p),
                    det_s / CPSAT_WALL_PER_DET, options.workers, options.seed,
                    hint=leanest, minimize_memory=True, max_wall_s=wall_s, wall_cap=not options.deterministic)
    if r.schedule is not None:
        found.append((r.schedule, r.peak_bytes))
    if r.status == "OPTIMAL":
        works = floor = r.peak_bytes
        leanest = r.schedule
    else:
        if r.status == "FEASIBLE" and r.peak_bytes < works:
            works, leanest = r.peak_bytes, r.schedule
        floor = max(floor, r.bound_ticks if r.status == "FEASIBLE" else 0)
    verdict = "no schedule fits" if status == "INFEASIBLE" else f"no schedule found in the time limit ({status})"
    verdict += f" under the cap {fmt_bytes(cap_bytes)}"
    note = ""
    if options.deterministic and r.status != "OPTIMAL" and r.wall_s >= wall_s:
        note = (f"; the wall clock ended the search at {RUNAWAY:g} times the time limit (CP-SAT overran its "
                f"deterministic limit): the answer may differ between runs")
    return CapTooSmall(f"{verdict}; {answer(works, floor)}{note}", works, leanest, floor, verdict, note, found)


def leanest_schedules(p: Problem, streams: int, failed_bytes: int, until: float = math.inf
                      ) -> list[tuple[Schedule, int]]:
    """(schedule, its peak bytes) for the serial schedule and every leaner one the heuristic finds, the leanest
    last, bisecting the cap (to LEANEST_TOLERANCE, or until the wall clock reads `until`) between `failed_bytes`,
    where it found none, and the serial schedule's peak. GoogLeNet training b32: 7 caps, 1-2 s each on the
    development machine; searching the larger slacks too where nothing fits found the same caps in 34.6 s, not
    15.2 (the bisection's failed caps pay each slack in full)."""
    serial, _, peak = serial_baseline(p)
    found, slack, low = [(serial, peak)], fit_slack(p, streams), failed_bytes
    while peak - low > LEANEST_TOLERANCE * peak and time.monotonic() < until:
        mid = (low + peak) // 2
        schedule = best_heuristic(p, mid, streams, slack, QUICK_EVALS, larger_slacks=False)
        if schedule is None:
            low = mid
        else:
            peak = peak_memory(p, schedule.decision, timed(p, schedule))[0]
            found.append((schedule, peak))
    return found


def with_arena(e: CapTooSmall, graph: Graph, p: Problem, streams: int,
               overflowed: Sequence[tuple[Schedule, int]] = ()) -> CapTooSmall:
    """The error with the cap the runner needs: the least arena among the schedules found (the arena lays a peak
    out with gaps, more for some schedules than others: GoogLeNet training b32, the leanest peak found, 207.52 MiB,
    needs 238.00 MiB, one peaking at 210.02 MiB 216.00), the search for the least peak's and those whose arenas
    passed the cap (`overflowed`: ResNet-50 training b32 under 395 MiB, the least peak's search named 430 MiB,
    one of those, peaking at 391.59 MiB, 408; a plan solves there)."""
    if e.schedule is None and not (overflowed and e.verdict):
        return e
    need = schedule = peak = None
    found_before = e.found or ([(e.schedule, e.minimum_bytes)] if e.schedule is not None else [])
    for found, found_peak in sorted([*found_before, *overflowed], key=lambda f: f[1]):
        if need is not None and found_peak >= need:
            break  # no arena is smaller than its peak
        found_need = device_bytes(graph, plan_of(graph, p, found, found_peak, streams))
        if need is None or found_need < need:
            need, schedule, peak = found_need, found, found_peak
    if schedule is e.schedule and need <= e.minimum_bytes:
        return e
    return CapTooSmall(f"{e.verdict}; {answer(need, e.floor_bytes, peak)}{e.note}", need, schedule, e.floor_bytes,
                       e.verdict, e.note)


def answer(works_bytes: int, floor_bytes: int, peak_bytes: int = 0) -> str:
    """What exit 3 says works, as the cap to pass to --mem: where the runner's arena needs more than the schedule's
    peak (`peak_bytes`), the arena's."""
    if works_bytes == floor_bytes:
        return f"minimum cap: {works_bytes} bytes ({fmt_bytes(works_bytes)})"
    laid_out = (f" (its schedule peaks at {fmt_bytes(peak_bytes)}, which the runner's arena lays out in that)"
                if peak_bytes else "")
    return (f"a cap of {works_bytes} bytes ({fmt_bytes(works_bytes)}) works{laid_out}; "
            f"none below {fmt_bytes(floor_bytes)} can")


def either_way(as_views: CapTooSmall, copied: CapTooSmall) -> CapTooSmall:
    """The lesser cap shown to work of the two ways (solving at it takes the views first), or the lesser floor
    where neither found one, saying where the other way's floor is lower still."""
    found = [e for e in (as_views, copied) if e.schedule is not None] or [as_views, copied]
    best = min(found, key=lambda e: e.minimum_bytes)
    other = copied if best is as_views else as_views
    if not 0 < other.floor_bytes < best.floor_bytes:
        return best
    way = "copied" if other is copied else "as views"
    return CapTooSmall(f"{best}; with the concats {way} none below {fmt_bytes(other.floor_bytes)} can",
                       best.minimum_bytes, best.schedule, other.floor_bytes)


def copied_unsearched(as_views: CapTooSmall, copied: Problem) -> CapTooSmall:
    """The views' answer where the time limit leaves the copied way no search, with what its floor allows."""
    floor = memory_lower_bound(copied)[0]
    if floor >= as_views.minimum_bytes:  # copied, no schedule needs less than the views' answer
        return as_views
    lower = f" (none of theirs needs less than {fmt_bytes(floor)})" if floor < as_views.floor_bytes else ""
    return CapTooSmall(f"{as_views}; the concats copied were not searched in the time limit{lower}",
                       as_views.minimum_bytes, as_views.schedule, min(floor, as_views.floor_bytes))
