"""What ops running side by side cost each other: a plan's timeline settled under a co-running slowdown.

The SM-share cumulative lets ops run side by side when their resident-block shares sum to at most 1, but such
ops still share the SMs' issue slots, caches and DRAM: on the H200, batch-32 inference ops beside others took
x1.3-1.5 their time alone, and plans on several streams ran 8-16% over a prediction that priced each op alone (one
Inception v3 plan predicted 8.8% faster than serial ran 4.5% slower). A flat time per op cannot tell such a plan
from one whose ops mostly run alone (docs/BENCHMARKS.md, fiftieth session).

So each op runs `1 + k x occupancy` times its priced duration, where occupancy is the time-weighted SM share of
the other ops running beside it (at most 1), and k is the device's fitted `co_running` for the mode. Durations
and overlaps depend on each other, so the plan is replayed (its stream orders and waits, as the GPU runs it)
to a fixed point: every replay re-prices each op from the overlaps of the one before, damped by half. Slowing
ops keeps the replay's orders, so every pair of items the schedule kept apart stays apart: memory, SM share and
copy engines stay within what the solver checked. Copies have no SM share and are not slowed here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

ROUNDS = 12  # replays to the fixed point: a 13th moves the makespan under 0.01% (GoogLeNet, Inception v3 plans)
DAMPING = 0.5  # each round moves the durations halfway to the re-priced ones


def occupancy(start: np.ndarray, end: np.ndarray, share: np.ndarray) -> np.ndarray:
    """For each item, the SM share of the others running beside it, averaged over its own duration (at most 1):
    a sweep over the items' ends of the running share, integrated."""
    edges = np.concatenate([start, end])
    order = np.argsort(edges, kind="stable")
    steps = np.concatenate([share, -share])[order]
    times = edges[order]
    running = np.cumsum(steps)[:-1]  # the share running between consecutive edges
    integral = np.concatenate([[0.0], np.cumsum(running * np.diff(times))])
    at = lambda t: np.interp(t, times, integral)  # noqa: E731  (piecewise linear: exact between edges)
    duration = end - start
    mean = np.divide(at(end) - at(start), duration, out=np.zeros_like(duration), where=duration > 0)
    return np.clip(mean - share, 0.0, 1.0)


def settle(alone_us: np.ndarray, share: np.ndarray, k: float,
           replay: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, slowdown) of each item: `replay` maps durations to as-soon-as-possible starts and ends; the
    durations are `alone_us` slowed by `1 + k x occupancy` at the fixed point (module docstring)."""
    duration = np.asarray(alone_us, dtype=float)
    start, end = replay(duration)
    if k <= 0 or not share.any():
        return start, end, np.ones_like(duration)
    for _ in range(ROUNDS):
        target = alone_us * (1.0 + k * occupancy(start, end, share))
        duration = duration + DAMPING * (target - duration)
        start, end = replay(duration)
    return start, end, np.divide(duration, alone_us, out=np.ones_like(duration), where=alone_us > 0)
