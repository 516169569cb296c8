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
import scipy.sparse as sparse
from scipy.optimize import linprog

from planner.problem import SM_CAPACITY, Alternative

MAX_CONFIGURATIONS = 200_000  # columns of one bound's LP; past it the ops keep the bounds that price them alone
GENERATION_ROUNDS = 100  # of the LP's column generation; a round cut short still leaves a bound
GENERATED_PER_ROUND = 100
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
    durations are `alone_us` slowed by `1 + k x occupancy` at the fixed point (module docstring). Items without
    an SM share (copies, on their copy engines) keep their durations."""
    duration = np.asarray(alone_us, dtype=float)
    start, end = replay(duration)
    if k <= 0 or not share.any():
        return start, end, np.ones_like(duration)
    kernels = share > 0
    for _ in range(ROUNDS):
        target = alone_us * (1.0 + k * kernels * occupancy(start, end, share))
        duration = duration + DAMPING * (target - duration)
        start, end = replay(duration)
    return start, end, np.divide(duration, alone_us, out=np.ones_like(duration), where=alone_us > 0)


def running_sets(unrelated: np.ndarray, streams: int, limit: int) -> list[tuple[int, ...]] | None:
    """Every set of 1 to `streams` pairwise unrelated ops (what may run at one instant), or None past `limit`."""
    found: list[tuple[int, ...]] = []
    stack = [((), np.arange(len(unrelated)))]  # a set, and the later ops unrelated to all of it
    while stack:
        chosen, later = stack.pop()
        for j, v in enumerate(later):
            found.append(grown := chosen + (int(v),))
            if len(found) > limit:
                return None
            if len(grown) < streams:
                rest = later[j + 1:]
                stack.append((grown, rest[unrelated[v, rest]]))
    return found


def lower_bound_us(alternatives: list[list[Alternative]], unrelated: np.ndarray, streams: int, k: float
                   ) -> float | None:
    """A bound on the time the ops take, each slowed by what runs beside it; None past MAX_CONFIGURATIONS.

    At each instant the running ops R are pairwise unrelated, at most `streams`, their SM shares s summing to
    U <= 1 (the replay keeps apart what the schedule did). Op i among them does 1 / ((1 + k (U - s_i)) t_i) of
    its work per us: at the fixed point it runs t_i (1 + k o_i), o_i the others' share averaged over it, and
    1 / (1 + k o) is convex, so the rate at each instant averages to at least that. With x_C the time spent in
    configuration C (a running set, one alternative each):

      T >= sum_C x_C,   sum_C x_C / ((1 + k (U_C - s_iC)) t_iC) >= 1 for every op i       (an LP)

    At k 0 it still counts chains (one op of a chain per configuration) and SM work (U_C <= 1); above 0, ops
    run side by side pay for it, which the bounds that price ops alone cannot see."""
    sets = running_sets(unrelated, streams, MAX_CONFIGURATIONS)
    if sets is None:
        return None
    op_of, column_of, rates = [], [], []
    columns = 0
    for ops in sets:
        demand = np.stack([g.ravel() for g in np.meshgrid(*[[a.sm_demand for a in alternatives[v]] for v in ops],
                                                          indexing="ij")], axis=1)
        time_us = np.stack([g.ravel() for g in np.meshgrid(*[[max(a.time_us, 1e-6) for a in alternatives[v]]
                                                             for v in ops], indexing="ij")], axis=1)
        fits = demand.sum(axis=1) <= SM_CAPACITY
        demand, time_us = demand[fits], time_us[fits]
        others = (demand.sum(axis=1, keepdims=True) - demand) / SM_CAPACITY
        rates.append((1.0 / ((1.0 + k * others) * time_us)).ravel())
        op_of.append(np.tile(ops, len(demand)))
        column_of.append(np.repeat(np.arange(columns, columns + len(demand)), len(ops)))
        columns += len(demand)
        if columns > MAX_CONFIGURATIONS:
            return None
    work = sparse.csc_matrix((np.concatenate(rates), (np.concatenate(op_of), np.concatenate(column_of))),
                             shape=(len(alternatives), columns))
    return _covering_lp_us(work)


def area_us(alternatives: list[list[Alternative]], k: float) -> float:
    """A bound on the time the ops take, each slowed by what runs beside it, that needs no configurations (so it
    holds where `lower_bound_us` has too many): each op's least of t x phi(s) over its alternatives, summed,

      T >= sum_i min_a t_ia phi(s_ia),   phi(s) = min(1, s (1 + k (1 - s)))

    A narrow op either runs alone, leaving SMs idle, or beside others, slowed: either way it costs more than its
    SM work. Proof: in a configuration of shares summing to U <= 1, op j gains phi(s_j) / (1 + k (U - s_j)) <=
    s_j / U of area per us (where k s_j <= 1 from the first form, else from phi <= 1; equality at U = 1), so the
    configuration gains at most 1; this is a dual solution of `lower_bound_us`'s LP. The gain holds at every
    instant, so the ops that must run within any stretch of time take at least their areas there."""
    phi = area_rate(k)
    return float(sum(min(a.time_us * phi(a) for a in alts) for alts in alternatives))


def area_rate(k: float) -> Callable[[Alternative], float]:
    """phi of `area_us`: the share of the GPU's time an alternative's time alone costs, at least, at slowdown k."""
    def phi(a: Alternative) -> float:
        share = a.sm_demand / SM_CAPACITY
        return min(1.0, share * (1.0 + k * (1.0 - share)))

    return phi


def slot_rates(alternatives: list[list[Alternative]], streams: int, k: float) -> dict[int, float]:
    """psi: per SM demand, what an alternative's time alone costs of the GPU's time, at least, when at most
    `streams` items run at once. A narrow op that `area_rate` prices at its SM work slowed holds one of the
    streams while it runs, and few of them fill no GPU (GoogLeNet training's backward pass: 60 weight gradients
    of 5-20% of the SMs). Any psi with, for every multiset of at most `streams` demands s_j summing to U <= 1,

      sum_j psi(s_j) / (1 + k (U - s_j)) <= 1   (a demand of 0 is not slowed: its term is psi(0))

    makes y_i = min_a t_ia psi(s_ia) a dual solution of `lower_bound_us`'s LP, over every op set: a bound where
    the LP has too many configurations. phi of `area_rate` is one (the configuration gains at most 1); this is the
    one that maximises sum y over these alternatives, an LP over the demands they use, its rows generated as
    the multisets they violate (GoogLeNet training b32: 98 demands, 214k multisets, 19 rounds)."""
    demands = sorted({a.sm_demand for alts in alternatives for a in alts})
    rows = _multisets(np.array(demands), streams, k)
    ways = [(i, demands.index(a.sm_demand), a.time_us) for i, alts in enumerate(alternatives) for a in alts]
    n, m = len(demands), len(alternatives)
    tied = sparse.csr_matrix((np.r_[np.ones(len(ways)), [-t for *_, t in ways]],  # y_i <= t_ia psi(s_ia)
                              (np.r_[np.arange(len(ways)), np.arange(len(ways))],
                               np.r_[[n + i for i, *_ in ways], [d for _, d, _ in ways]])), shape=(len(ways), n + m))
    chosen = np.arange(n)  # the single demands
    psi = np.zeros(n)
    for _ in range(GENERATION_ROUNDS):
        a_ub = sparse.vstack([sparse.hstack([rows[chosen], sparse.csr_matrix((len(chosen), m))]), tied])
        lp = linprog(np.r_[np.zeros(n), -np.ones(m)], A_ub=a_ub, b_ub=np.r_[np.ones(len(chosen)), np.zeros(len(ways))],
                     bounds=(0, None), method="highs")
        if lp.status != 0:
            return {}
        psi = lp.x[:n]
        gained = rows @ psi
        violated = np.setdiff1d(np.argsort(-gained)[:2 * GENERATED_PER_ROUND], chosen)
        violated = violated[gained[violated] > 1.0 + 1e-9]
        if not violated.size:
            break
        chosen = np.concatenate([chosen, violated])
    psi = psi / max(1.0, float((rows @ psi).max()))  # feasible whatever the last round
    return dict(zip(demands, psi.tolist()))


def slot_area_us(alternatives: list[list[Alternative]], psi: dict[int, float]) -> float:
    """T >= sum_i min_a t_ia psi(s_ia) (`slot_rates`)."""
    return float(sum(min(a.time_us * psi[a.sm_demand] for a in alts) for alts in alternatives))


def _multisets(demands: np.ndarray, streams: int, k: float) -> sparse.csr_matrix:
    """One row per multiset of 1 to `streams` demands summing to at most SM_CAPACITY, the single demands first:
    its gain per demand, sum over its members of 1 / (1 + k (U - s)) (1 for a demand of 0)."""
    level = np.arange(len(demands))[:, None]  # members, as indices into demands, in ascending order
    found = [level]
    for _ in range(streams - 1):
        total = demands[level].sum(axis=1)
        grow = (np.arange(len(demands))[None, :] >= level[:, -1:]) & (total[:, None] + demands[None, :] <= SM_CAPACITY)
        r, c = np.nonzero(grow)
        level = np.concatenate([level[r], c[:, None]], axis=1)
        found.append(level)
    r, c, v = [], [], []
    start = 0
    for members in found:
        share = demands[members] / SM_CAPACITY
        gain = np.where(share > 0, 1.0 / (1.0 + k * (share.sum(axis=1, keepdims=True) - share)), 1.0)
        r.append(np.repeat(np.arange(start, start + len(members)), members.shape[1]))
        c.append(members.ravel())
        v.append(gain.ravel())
        start += len(members)
    return sparse.csr_matrix((np.concatenate(v), (np.concatenate(r), np.concatenate(c))), shape=(start, len(demands)))


def _covering_lp_us(work: sparse.csc_matrix) -> float | None:
    """min sum x s.t. work x >= 1, x >= 0, by column generation from the one-op configurations: each round
    solves the LP on the columns so far and adds those its duals y price above 1. Whatever the round, sum y
    over the largest priced column (at least 1) is a feasible dual, so a bound; at the end it is the optimum."""
    chosen = np.flatnonzero(np.diff(work.indptr) == 1)
    bound = 0.0
    for _ in range(GENERATION_ROUNDS):
        lp = linprog(np.ones(len(chosen)), A_ub=-work[:, chosen], b_ub=-np.ones(work.shape[0]), bounds=(0, None),
                     method="highs")
        if lp.status != 0:
            return None
        duals = -lp.ineqlin.marginals
        priced = work.T @ duals
        bound = max(bound, float(duals.sum()) / max(1.0, float(priced.max())))
        better = np.setdiff1d(np.argsort(-priced)[:GENERATED_PER_ROUND], chosen)
        better = better[priced[better] > 1.0 + 1e-9]
        if not better.size:
            break
        chosen = np.concatenate([chosen, better])
    return bound
