"""Schedule -> cheaper Schedule: each op's (and recomputation's) algorithms tried one at a time, each at the first
few starts where it fits between what must end before it and what must start after it, and kept when the time
the plan will predict (streams.predicted_cost) drops and the memory cap holds.

planner.refine's windows price ops alone: where ops slow each other (co_running), a window whose makespan alone
does not change keeps the algorithms it has, though a wider, faster one beside fewer ops may settle sooner (the
weight gradient of GoogLeNet's conv2 ran 71.3 us on 15% of the SMs, 31.4 alone). With these passes ending each of
refine's stages, 120-s solves of GoogLeNet training b32 on the calibrated H100 profile went from 3217.2 to 3181.4
us uncapped, from 3410.1 to 3381.3 at 50% (docs/BENCHMARKS.md, seventy-first session).
"""

from __future__ import annotations

from planner.problem import DRAM_CAPACITY, SM_CAPACITY, Alternative, Problem
from planner.schedule import Schedule, peaks_within
from planner.streams import predicted_cost
from planner.window import Item, Move, apply, items_of, precedences

STARTS = 4  # starts tried per alternative: the earliest that fit, so that an op may also move beside other ops
# (GoogLeNet training b32 at 50% on the H100, after refine and a pass at the earliest start only: 3414.1 -> 3394.0
# us in four passes, against 3393.5 at 12)


def fits_at(others: list[tuple[int, int, Alternative]], start: int, way: Alternative, streams: int) -> bool:
    """Whether `way` may run over [start, start + its duration) beside the other compute items (start, end, what
    each runs as): at each instant there their SM shares (and DRAM shares) stay within capacity, and at most
    `streams` run."""
    end = start + way.duration
    beside = [(b, e, a) for b, e, a in others if b < end and e > start]
    for t in {start} | {b for b, _, _ in beside if b > start}:  # any order: one instant over is enough
        running = [a for b, e, a in beside if b <= t < e]
        if (len(running) >= streams or sum(a.sm_demand for a in running) + way.sm_demand > SM_CAPACITY
                or sum(a.dram_demand for a in running) + way.dram_demand > DRAM_CAPACITY):
            return False
    return True


def starts(items: list[Item], k: int, edges: list[tuple[int, int]], alt: int, streams: int) -> list[int]:
    """The first STARTS starts of item k on its alternative `alt`, earliest first, after every item it follows
    ends and such that it ends before every item that follows it starts (anywhere after, for an item nothing
    follows), where it fits (`fits_at`); its own start and alternative left out."""
    way = items[k].alternatives[alt]
    earliest = max([items[a].end for a, b in edges if b == k], default=0)
    latest = min([items[b].start for a, b in edges if a == k], default=float("inf")) - way.duration
    others = [(it.start, it.end, it.alternatives[it.chosen]) for j, it in enumerate(items) if j != k and it.compute]
    found = []
    for start in sorted({earliest} | {e for _, e, _ in others if earliest < e <= latest}):
        if len(found) == STARTS:
            break
        if (start <= latest and (alt, start) != (items[k].chosen, items[k].start)
                and fits_at(others, start, way, streams)):
            found.append(start)
    return found


def swap_pass(p: Problem, cap_bytes: int, streams: int, s: Schedule, s_cost: float, budget_s: float,
              try_s: float) -> tuple[Schedule, float, float]:
    """(the schedule, its predicted cost, the seconds charged): one sweep over the ops and recomputations in start
    order, each taking the first of its alternatives and `starts` that makes the schedule cheaper, each tried
    charged `try_s`, until the budget is spent."""
    spent, best, best_cost = 0.0, s, s_cost
    of = None  # the schedule the items and precedences below are of: they change only when a swap is kept
    for kind, index in [(it.kind, it.index) for it in items_of(p, s) if it.compute]:
        if of is not best:
            of, items = best, items_of(p, best)
            edges = precedences(p, best, items)
            at = {(it.kind, it.index): j for j, it in enumerate(items)}
        k = at[kind, index]
        ways = range(len(items[k].alternatives))
        mine = [(a, b) for a, b in edges if k in (a, b)]
        for alt, start in ((a, t) for a in ways for t in starts(items, k, mine, a, streams)):
            if spent + try_s > budget_s:
                return best, best_cost, spent
            spent += try_s
            trial = apply(best, items, Move(t1=max(it.end for it in items) + 1, shift=0, free={k: (start, alt)}))
            if (cost := predicted_cost(p, trial)) < best_cost and peaks_within(p, trial, cap_bytes):
                best, best_cost = trial, cost
                break
    return best, best_cost, spent
