"""Schedule -> cheaper Schedule: each stretch of the timeline that nothing crosses searched alone, at the time the
plan will predict.

Where no item runs across an instant of the schedule (times alone), every item after it waits for every item
before it in the plan (streams.cross_stream_waits), so the items between two such instants settle apart from all
others: the stretch's settled span depends on its own schedule alone, and where ops slow each other (planner.
co_running) it can be searched on its own and judged exactly, hundreds of times cheaper than the whole plan.
Separators of the DAG make such instants (GoogLeNet's inception blocks in the forward pass), and so does the
schedule in the backward pass. refine's windows search at times alone and judge settled; they left GoogLeNet
training's forward inception blocks 0.9-7.1 us each over what this search finds (docs/BENCHMARKS.md,
seventy-third session).

The search anneals each item's algorithm and a priority order. A serial list schedule at times alone places the
items in priority order, each at its earliest start after its predecessors where the SM shares, DRAM shares and
streams fit; the plan's waits come from that schedule, and the stretch's span settled under them judges it. It
starts from the stretch as the schedule has it, and the best placement found replaces the stretch (the items
after it shift by the span's change) when the whole schedule's predicted cost drops and the memory cap holds.
"""

from __future__ import annotations

import math
import random
import time

import numpy as np

from planner.co_running import settle
from planner.problem import SM_CAPACITY, Alternative, Problem
from planner.schedule import Schedule, peaks_within
from planner.streams import Item as PlanItem
from planner.streams import maximal_predecessors, predicted_cost, replayer
from planner.swaps import fits_at
from planner.window import Item, Move, apply, items_of, precedences

MAX_ITEMS = 16  # consecutive stretches are searched together up to this many items (an inception block: 13)
STEPS_PER_ITEM = 150  # annealing steps per item of a stretch (an inception block: 1950)
START_TEMPERATURE_US = 2.0  # a step that lengthens the span by this much is taken with probability 1/e at first;
# the temperature falls linearly to TEMPERATURE_FLOOR_US
TEMPERATURE_FLOOR_US = 0.01
PLACEMENT_S_PER_ITEM = 8e-5  # what placing and settling a stretch costs per item (0.6-1.0 ms for 13), charged per
# placement not judged before


def stretches(items: list[Item]) -> list[list[int]]:
    """Items (positions in start order) between instants no item runs across, consecutive ones joined up to
    MAX_ITEMS; only those of compute items, from three to MAX_ITEMS."""
    runs, reach = [], -1
    for k, it in enumerate(items):
        if it.start >= reach:
            runs.append([])
        runs[-1].append(k)
        reach = max(reach, it.end)
    joined: list[list[int]] = []
    for run in runs:
        if joined and len(joined[-1]) + len(run) <= MAX_ITEMS:
            joined[-1] += run
        else:
            joined.append(list(run))
    return [run for run in joined if 3 <= len(run) <= MAX_ITEMS and all(items[k].compute for k in run)]


def place(ways: list[Alternative], preds: list[list[int]], priority: list[int], streams: int) -> list[int]:
    """Starts in ticks from 0: items in priority order among those whose preds are placed, each at the earliest
    start after its preds where it fits beside those placed (`swaps.fits_at`: SM share, DRAM share, streams)."""
    n = len(ways)
    start, end, done, placed = [0] * n, [0] * n, [False] * n, []
    while len(placed) < n:
        v = min((v for v in range(n) if not done[v] and all(done[u] for u in preds[v])), key=priority.__getitem__)
        way = ways[v]
        earliest = max((end[u] for u in preds[v]), default=0)
        start[v] = next(t for t in sorted({earliest} | {e for _, e, _ in placed if e > earliest})
                        if fits_at(placed, t, way, streams))
        end[v], done[v] = start[v] + way.duration, True
        placed.append((start[v], end[v], way))
    return start


def _chain(preds: list[list[int]]) -> bool:
    """Whether every two items are related (one must end before the other starts): nothing can run beside."""
    below: list[set[int]] = []
    for pr in preds:  # in start order, so every pred comes first
        below.append(set(pr).union(*(below[u] for u in pr)))
    return all(len(b) == v for v, b in enumerate(below))


def settled_span_us(ways: list[Alternative], start: list[int], k: float) -> float:
    """The span of items started at these ticks, replayed as the plan runs them (each after every item that ends
    by its start: streams.maximal_predecessors and streams.replayer, each item on a stream of its own) and settled
    under co-running slowdown k."""
    items = [PlanItem("op", v, s, s + w.duration, w.time_us, stream=v) for v, (s, w) in enumerate(zip(start, ways))]
    share = np.array([w.sm_demand / SM_CAPACITY for w in ways])
    st, en, _ = settle(np.array([w.time_us for w in ways]), share, k, replayer(items, maximal_predecessors(items)))
    return float(en.max() - st.min())


def anneal(options: list[list[Alternative]], preds: list[list[int]], alt: list[int], priority: list[int],
           streams: int, k: float, steps: int, rng: random.Random) -> tuple[float, list[int], list[int], int]:
    """(the least settled span found, its alternatives, its starts, the placements judged): simulated annealing
    from this alternative per item and priority order, each step changing one item's alternative or swapping two
    priorities."""
    seen: dict[tuple, float] = {}

    def judged(alt: list[int], priority: list[int]) -> tuple[float, list[int]]:
        ways = [o[a] for o, a in zip(options, alt)]
        start = place(ways, preds, priority, streams)
        key = (*alt, *start)
        if key not in seen:
            seen[key] = settled_span_us(ways, start, k)
        return seen[key], start

    cur, start = judged(alt, priority)
    best = (cur, list(alt), start)
    n = len(options)
    for step in range(steps):
        temperature = START_TEMPERATURE_US * (1 - step / steps) + TEMPERATURE_FLOOR_US
        alt2, priority2 = list(alt), list(priority)
        if rng.random() < 0.5:
            v = rng.randrange(n)
            alt2[v] = rng.randrange(len(options[v]))
        else:
            u, v = rng.randrange(n), rng.randrange(n)
            priority2[u], priority2[v] = priority2[v], priority2[u]
        span, start = judged(alt2, priority2)
        if span < cur or rng.random() < math.exp((cur - span) / temperature):
            alt, priority, cur = alt2, priority2, span
            if span < best[0]:
                best = (span, list(alt2), start)
    return (*best, len(seen))


def polish(p: Problem, cap_bytes: int, streams: int, s: Schedule, s_cost: float, budget_s: float, seed: int,
           searched: dict[tuple, tuple] | None = None, deadline: float = float("inf")
           ) -> tuple[Schedule, float, float]:
    """(the schedule, its predicted cost, the seconds charged): each stretch of s (`stretches`) annealed from its
    own algorithms and start order, its best placement kept where the whole schedule gets cheaper and fits the
    cap. Each placement judged is charged PLACEMENT_S_PER_ITEM per item; a stretch whose search the budget left
    cannot pay in full, or that would begin past the wall clock's `deadline`, is not searched. `searched` keeps
    how each stretch was placed when last searched (or by its search): a stretch still placed so is not searched
    again."""
    searched = {} if searched is None else searched
    spent = 0.0
    if p.co_running <= 0 or streams < 2:
        return s, s_cost, spent
    of, (items, edges, at) = s, _timeline(p, s)
    for members in [[(items[k].kind, items[k].index) for k in run] for run in stretches(items)]:
        if of is not s:  # a stretch was kept: the items after it moved
            of, (items, edges, at) = s, _timeline(p, s)
        mine = [at[m] for m in members]
        t0, t1 = items[mine[0]].start, max(items[k].end for k in mine)
        placed = tuple((items[k].chosen, items[k].start - t0) for k in mine)
        if searched.get(tuple(members)) == placed:
            continue
        steps = STEPS_PER_ITEM * len(mine)
        if spent + steps * len(mine) * PLACEMENT_S_PER_ITEM > budget_s or time.monotonic() > deadline:
            break
        searched[tuple(members)] = placed
        position = {k: v for v, k in enumerate(mine)}
        preds: list[list[int]] = [[] for _ in mine]
        for a, b in edges:
            if a in position and b in position:
                preds[position[b]].append(position[a])
        if _chain(preds):
            continue
        options = [items[k].alternatives for k in mine]
        now = settled_span_us([o[items[k].chosen] for o, k in zip(options, mine)],
                              [items[k].start - t0 for k in mine], p.co_running)
        span, alt, start, judged = anneal(options, preds, [items[k].chosen for k in mine], list(range(len(mine))),
                                          streams, p.co_running, steps, random.Random(seed * 7919 + t0))
        spent += judged * len(mine) * PLACEMENT_S_PER_ITEM
        if span >= now:
            continue
        length = max(st + o[a].duration for o, a, st in zip(options, alt, start))
        trial = apply(s, items, Move(t1, (t1 - t0) - length, {k: (t0 + st, a) for k, a, st in zip(mine, alt, start)}))
        if (cost := predicted_cost(p, trial)) < s_cost and peaks_within(p, trial, cap_bytes):
            s, s_cost = trial, cost
            searched[tuple(members)] = tuple(zip(alt, start))
    return s, s_cost, spent


def _timeline(p: Problem, s: Schedule) -> tuple[list[Item], list[tuple[int, int]], dict[tuple[str, int], int]]:
    """The schedule's items in start order, their precedences, and each item's position by (kind, index)."""
    items = items_of(p, s)
    return items, precedences(p, s, items), {(it.kind, it.index): k for k, it in enumerate(items)}
