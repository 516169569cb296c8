"""Plans the runner can lay out under the user's cap. The runner's arena (runner/arena.py) places a schedule's
residencies with gaps, a few percent over its peak, in the driver's 2-MiB pages: a binding search starts a little
under the cap (`solver_cap`) and steps down until the heuristic's plan fits as an arena (`arena_fit`), and so do
the deep recomputations that follow it (`deep_fit`)."""

from __future__ import annotations

from typing import Callable

from planner.decisions import best_heuristic
from planner.deep import deep_recomputations
from planner.heuristic import Work
from planner.ir import Graph
from planner.plan import Plan, Totals
from planner.problem import Problem
from planner.schedule import Schedule, peak_memory, timed
from planner.streams import build_plan

PLACEMENT_MARGIN = 0.002  # a binding cap: the search starts this share of the arena's room below it (solver_cap)
ARENA_STEP = 0.01  # ... and is lowered in steps of 1% of the room above resident bytes
ARENA_STEPS = 30  # ... until the runner's arena fits the user's cap
DEEP_ARENA_STEPS = 4  # deep recomputations whose arena overflows are searched again up to this many steps lower


def device_bytes(graph: Graph, plan: Plan) -> int:
    """What the runner will allocate for the plan (arena plus persistent tensors)."""
    from runner.arena import device_bytes as arena_device_bytes  # pure Python; runner is imported lazily

    return arena_device_bytes(graph, plan)


def fits_device(graph: Graph, plan: Plan, cap_bytes: int, work: Work | None = None) -> bool:
    """device_bytes(graph, plan) <= cap_bytes, sooner; `work` counts the placements past the arena's orders."""
    from runner.arena import PLACEMENT_ORDERS, placements_to_fit

    fits, tried = placements_to_fit(graph, plan, cap_bytes)
    if work is not None:
        work.placed += len(plan.ops) * max(0, tried - len(PLACEMENT_ORDERS))
    return fits


def solver_cap(graph: Graph, resident_bytes: int, cap_bytes: int) -> int:
    """The cap a binding search starts under. No peak above the resident bytes plus the arena's room (the cap
    in whole driver pages, less the persistent tensors) fits the runner's arena, and the windows pack the peak
    up to the solver's cap, where placement adds its gaps: PLACEMENT_MARGIN of the room is left for them.
    GoogLeNet training b32 at 50%: refined under the cap itself, a schedule whose peak fits overflows the arena
    by 32 KiB (peak 284.31 MB, best placement 284.53, room 284.50) and the search falls back to the last that
    fits (120 s: 4234.7 us; from this cap, 4189.1)."""
    from runner.arena import arena_room_bytes  # pure Python; runner is imported lazily

    room = arena_room_bytes(graph, cap_bytes)
    return min(cap_bytes, resident_bytes + room - int(PLACEMENT_MARGIN * room))


def arena_fit(graph: Graph, p: Problem, cap_bytes: int, start_bytes: int, streams: int, slack: float,
              max_evals: int, fits: Callable[[Plan], bool], work: Work, refined: bool,
              overflowed: list[tuple[Schedule, int]] | None = None, largest_first: bool = False,
              steps: int = ARENA_STEPS) -> tuple[int, Schedule | None, int]:
    """(solver cap, schedule, caps tried): the largest solver cap, stepping down from `start_bytes`, whose
    heuristic plan (fit_cap with `max_evals`) the runner can lay out within the user's cap: placement leaves gaps
    (3-5% over the peak on capped training plans, more as offloads multiply), so a plan whose peak meets the cap
    exactly may not fit as an arena. The gap is not monotone in the cap (GoogLeNet training at 50%: a plan 4%
    below fits, 5-14% below do not), hence small steps."""
    room = cap_bytes - p.resident_bytes
    for k in range(steps):
        target = start_bytes - int(k * ARENA_STEP * room)
        hint = best_heuristic(p, target, streams, slack, max_evals, work, refined, largest_first)
        if hint is None:
            return cap_bytes, None, k + 1
        if fits(plan_of(graph, p, hint, target, streams)):
            return target, hint, k + 1
        if overflowed is not None:
            overflowed.append((hint, peak_memory(p, hint.decision, timed(p, hint))[0]))
    return cap_bytes, None, steps  # no heuristic plan fits: CP-SAT alone, or the computed minimum cap


def deep_fit(graph: Graph, p: Problem, cap_bytes: int, target: int, streams: int, hint: Schedule, slack: float,
             fits: Callable[[Plan], bool], work: Work) -> tuple[int, Problem, Schedule] | None:
    """(solver cap, problem, schedule): deep recomputations cheaper than `hint` (deep.deep_recomputations) under
    `target`, or up to DEEP_ARENA_STEPS of arena_fit's steps below it, whose plan the runner can lay out within the
    user's cap; None where none is. A deep way's workspace is one large block (a convolution's output held while
    its BatchNormalization re-applies), which placement may not fit where the peak does: GoogLeNet training b32
    at 35%, under the solver cap of the heuristic's plan (221.88 MiB), the deep plan's arena overflows the
    225.69-MiB cap, one step lower it fits."""
    room = cap_bytes - p.resident_bytes
    for k in range(DEEP_ARENA_STEPS + 1):
        lower = target - int(k * ARENA_STEP * room)
        deeper = deep_recomputations(p, lower, streams, hint, slack, work)
        if deeper is None:  # nothing cheaper here, nor under a lower cap
            return None
        if fits(plan_of(graph, *deeper, lower, streams)):
            return lower, *deeper
    return None


def plan_of(graph: Graph, p: Problem, schedule: Schedule, cap_bytes: int, streams: int) -> Plan:
    totals = Totals(makespan_us=0.0, peak_bytes=0, mem_cap_bytes=cap_bytes, lower_bound_us=0.0,
                    solver_makespan_us=schedule.makespan(p) * p.tick_us, baseline_makespan_us=0.0,
                    status="", gap=0.0, solve_time_s=0.0)
    return build_plan(graph, p, schedule, totals, streams)
