"""Lower bounds on the iteration time of every schedule of a Problem (under a cap, with planner.memory_bounds).

A schedule runs each op once, on one of its alternatives, after its preds end; at most `streams` ops run at once,
their sm_demand summing to at most SM_CAPACITY (and, with --dram, their dram_demand to DRAM_CAPACITY). Copies and
recomputations only add work, so bounds that leave them out hold under any cap. Times are the alternatives'
time_us, the durations the plan's replay predicts with. Every bound below holds for every schedule (C: its
makespan); `head_tail` combines them all and is the strongest without a cap:

  critical_path  C >= the longest dependency chain at each op's fastest time
  sm_work        C >= sum over ops of min over alternatives of time_us x sm_demand / 100 (dram_work likewise)
  streams        C >= sum of fastest times / streams
  disjunctive    C >= fastest times summed over big ops and one chain that can overlap neither them nor each other
  head_tail      C >= head(v) + fastest(v) + tail(v), heads and tails from window bounds (`heads_us`) and from the
                 segments the DAG runs as one after another (`segment_heads_tails`)
  chain_fill     C >= the longest chain plus what of the other ops cannot fit in the room beside it
                 (`planner.chain_fill`, an LP)
  co_running     C >= the segments' bounds summed, each segment's at least what its ops take when each runs
                 slowed by the SM share beside it (`planner.co_running`: an LP, and each op's SM work raised by
                 what running alone or beside others costs it; with a co-running slowdown only)
  memory_cut     C + copy interference >= heads, tails and SM work (with a co-running slowdown, the co-running
                 area too; on the strongest cuts, the chain and its fillers) plus what sending the bytes a cap
                 forces off the device at a cut op costs at least (an LP; under a cap only; `planner.memory_bounds`)

Window bounds: every op of a set S that runs within a window of length L gives L >= sum over S of base weights
+ the heaviest chain in S of chain weights (`Window`). Rates make the base weights (`rates`), big ops and
chains make the others (`clique_window`, `fill_window`). The DAG and the rates are in planner.dag.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import numpy as np

from planner.chain_fill import LP, add_chain_fill, chain_and_fillers
from planner.co_running import area_us as co_running_area_us
from planner.co_running import lower_bound_us as co_running_us
from planner.co_running import slot_area_us, slot_rates
from planner.dag import Dag, dram_share, rates, sm_share
from planner.memory_bounds import memory_cut_us
from planner.problem import SM_CAPACITY, Problem

Window = tuple[np.ndarray, np.ndarray | None]  # (base weight per op, chain weight per op or None), in us
CLIQUE_THETAS = (1, 5, 20, 50)  # `clique_window` thresholds, in SM_CAPACITY units
CHAIN_CELLS = 1 << 23  # cells of chain matrices `heads_us` keeps (64 MiB): all five up to ~1300 ops
SEGMENT_OPS = 64  # segments up to this size get head_tail and chain_fill of their own (an inception block: 19 ops)


def lower_bounds_us(p: Problem, streams: int, cap_bytes: int | None = None, quick: bool = False
                    ) -> dict[str, float]:
    """Bounds every schedule obeys (module docstring): the dependency chain, SM work (and DRAM work with --dram),
    streams, big ops with a chain, heads and tails that combine them all, and under a cap what the cap forces
    off the device (`memory_cut_us`). `quick` leaves out those that solve linear programs (chain_fill,
    co_running and memory_cut: 1.8-2.2 of 1.9-2.4 s on GoogLeNet training b32 at 50% on the H100)."""
    dag = Dag.of(p)
    fastest = dag.fastest_us()
    dram = any(a.dram_demand for o in p.ops for a in o.alternatives)
    bounds = {"critical_path": _longest_chain_us(dag, fastest), "sm_work": float(dag.least(sm_share).sum()),
              **({"dram_work": float(dag.least(dram_share).sum())} if dram else {}),
              "streams": float(fastest.sum()) / streams}
    if p.ops:
        bounds["disjunctive"] = disjunctive_us(dag)
        heads, tails, head_tail = heads_tails_us(dag, streams, dram)
        anc = dag.ancestors()
        heads, tails, segments = segment_heads_tails(dag, anc, heads, tails, streams, dram)
        bounds["head_tail"] = max(head_tail, segments, float((heads + fastest + tails).max()))
        if quick:
            return bounds
        bounds["chain_fill"] = chain_fill_us(dag, anc, streams, dram)
        psi = None  # solved once, where a segment or a cut needs it
        if p.co_running > 0 and streams > 1:
            psi = cache(lambda: slot_rates(dag.alts + [t.recompute_alternatives for t in p.tensors if t.can_recompute],
                                           streams, p.co_running))
            heads, tails, bounds["co_running"] = segment_heads_tails(dag, anc, heads, tails, streams, dram,
                                                                     p.co_running, psi)
        if cap_bytes is not None and any(t.choosable for t in p.tensors):
            bounds["memory_cut"] = memory_cut_us(p, cap_bytes, dag, anc, heads, tails, streams, dram,
                                                 psi() if psi else None)
    return bounds


def _longest_chain_us(dag: Dag, weights: np.ndarray) -> float:
    """The heaviest dependency chain: its ops run one after another."""
    end = np.zeros(len(dag.preds))
    for v, preds in enumerate(dag.preds):
        end[v] = max((end[u] for u in preds), default=0.0) + weights[v]
    return float(end.max(initial=0.0))


def clique_window(dag: Dag, theta: int) -> Window:
    """Big ops (every alternative above 100 - theta of the SMs, theta <= 50) overlap no other big op, nor any op
    whose every alternative takes >= theta; the ops of a chain never overlap each other. So big ops and a chain
    of such ops run one at a time: L >= fastest times of the big ops in S + the heaviest chain in S of the
    others (>= theta) at their fastest times."""
    fastest = dag.fastest_us()
    least = np.array([min(a.sm_demand for a in alts) for alts in dag.alts])
    big = least > SM_CAPACITY - theta
    return np.where(big, fastest, 0.0), np.where(~big & (least >= theta), fastest, 0.0)


def fill_window(dag: Dag, anc: np.ndarray, streams: int) -> Window:
    """Chain ops run one at a time, and beside chain op u on alternative a run only ops unrelated to u, at most
    streams - 1, each on an alternative fitting 100 - s_a: their SM share F(u, a) is at most the largest
    streams - 1 such shares and at most 1 - s_a/100. Counting each op's SM share but 1 - F for chain ops sums to
    <= 1 at any instant, so L >= least areas over S + the heaviest chain in S of min_a time (1 - F) - least area."""
    n = len(dag.preds)
    unrelated = ~(anc | anc.T)
    np.fill_diagonal(unrelated, False)
    widest = np.zeros((n, SM_CAPACITY + 1))  # widest[w, room]: w's largest SM demand that fits in room
    for w, alts in enumerate(dag.alts):
        for a in alts:
            widest[w, a.sm_demand:] = np.maximum(widest[w, a.sm_demand:], a.sm_demand)
    area = dag.least(sm_share)
    chain = np.zeros(n)
    for u, alts in enumerate(dag.alts):
        others = np.flatnonzero(unrelated[u])
        ends = []
        for a in alts:
            room = SM_CAPACITY - a.sm_demand
            beside = np.sort(widest[others, room])[::-1][:streams - 1].sum() if streams > 1 else 0.0
            ends.append(a.time_us * (1 - min(beside, room) / SM_CAPACITY))
        chain[u] = max(0.0, min(ends) - area[u])
    return area, chain


def windows(dag: Dag, anc: np.ndarray, streams: int, dram: bool) -> list[Window]:
    """Rates first, then chain windows, the most useful first (`heads_us` may leave the last ones out)."""
    cliques = [clique_window(dag, t) for t in CLIQUE_THETAS]
    return [(dag.least(r), None) for r in rates(streams, dram)] + [cliques[0], fill_window(dag, anc, streams),
                                                                   *cliques[1:]]


def _chains_from(dag: Dag, weights: np.ndarray) -> np.ndarray:
    """chain[v, k, a]: the heaviest chain of weights[k] that starts at ancestor a of v and ends at an ancestor of
    v (-inf where a is not one); weights are >= 0, so the heaviest ends at a pred of v."""
    n = len(dag.preds)
    chain = np.full((n, len(weights), n), -np.inf)
    for v, preds in enumerate(dag.preds):
        for u in preds:
            via = chain[u] + weights[:, u:u + 1]
            via[:, u] = weights[:, u]
            np.maximum(chain[v], via, out=chain[v])
    return chain


def heads_us(dag: Dag, wins: list[Window], anc: np.ndarray) -> np.ndarray:
    """head(v) <= start(v) in every schedule. head(v) >= head(u) + fastest(u) for each pred u; and for each
    threshold t among its ancestors' heads, the ancestors with head >= t start after t and end before v starts,
    so head(v) >= t + their window bound (t = 0: all ancestors; t = head(a): a and every op between a and v,
    with more besides). A chain starting at an op with head >= t stays there: heads grow along edges.
    Chains take n x n cells each: past CHAIN_CELLS the last chain windows keep only their base weights."""
    n = len(dag.preds)
    fastest = dag.fastest_us()
    base = np.stack([b for b, _ in wins])
    chained = [k for k, (_, c) in enumerate(wins) if c is not None][:CHAIN_CELLS // n ** 2]
    chains = _chains_from(dag, np.stack([wins[k][1] for k in chained])) if chained else None
    head = np.zeros(n)
    for v, preds in enumerate(dag.preds):
        best = max((head[u] + fastest[u] for u in preds), default=0.0)
        before = np.flatnonzero(anc[v])
        if before.size:
            order = before[np.argsort(-head[before], kind="stable")]
            total = head[order] + np.cumsum(base[:, order], axis=1)
            if chains is not None:
                total[chained] += np.maximum.accumulate(chains[v][:, order], axis=1)
            best = max(best, float(total.max()))
        head[v] = best
    return head


def heads_tails_us(dag: Dag, streams: int, dram: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """(head, tail, bound): per op, head(v) <= start(v) and tail(v) <= C - end(v) (heads of the reversed DAG) in
    every schedule; the bound is C >= head(v) + fastest(v) + tail(v) for every op v, and C >= the head of a sink
    after every op, and its mirror."""
    ends = []
    for d in (dag, dag.reversed()):
        sunk = d.with_sink()
        anc = sunk.ancestors()
        ends.append(heads_us(sunk, windows(sunk, anc, streams, dram), anc))
    heads, tails = ends[0][:-1], ends[1][:-1][::-1]
    through = heads + dag.fastest_us() + tails
    return heads, tails, float(max(ends[0][-1], ends[1][-1], through.max()))


def head_tail_us(dag: Dag, streams: int, dram: bool = False) -> float:
    return heads_tails_us(dag, streams, dram)[2]


def separators(anc: np.ndarray) -> list[int]:
    """Positions j (in topological order) where every op from j on descends from every op before j: all that
    runs before j ends before anything from j on starts. A concat written in place leaves no op that every path
    passes through between two inception blocks, but a separator still."""
    first_other = (~anc | np.eye(len(anc), dtype=bool)).argmax(axis=1)  # per op, its first non-ancestor
    after = np.minimum.accumulate(first_other[::-1])[::-1]
    return [j for j in range(1, len(anc)) if after[j] >= j]


def segment_us(dag: Dag, anc: np.ndarray, first: int, end: int, streams: int, dram: bool,
               co_running: float = 0.0, psi: Callable[[], dict[int, float]] | None = None) -> float:
    """A bound on the time the ops at positions [first, end) take, alone: head_tail and chain_fill of their own
    DAG from 2 up to SEGMENT_OPS ops, the chain and the SM work otherwise (one op: its fastest time); with a
    co-running slowdown on several streams, also what running side by side costs them (`co_running`: the
    configuration LP; where it has too many configurations, the area bound and the stream-slot one at `psi()`,
    which hold there)."""
    sub = Dag([[u - first for u in dag.preds[v] if u >= first] for v in range(first, end)], dag.alts[first:end])
    best = max(_longest_chain_us(sub, sub.fastest_us()), float(sub.least(sm_share).sum()))
    if 1 < end - first <= SEGMENT_OPS:
        best = max(best, head_tail_us(sub, streams, dram), chain_fill_us(sub, anc[first:end, first:end], streams, dram))
    if co_running > 0 and streams > 1 and end - first > 1:
        related = anc[first:end, first:end] | anc[first:end, first:end].T | np.eye(end - first, dtype=bool)
        exact = co_running_us(sub.alts, ~related, streams, co_running)
        slots = slot_area_us(sub.alts, psi()) if exact is None and psi else 0.0
        best = max(best, exact or 0.0, slots, co_running_area_us(sub.alts, co_running))
    return best


def segment_heads_tails(dag: Dag, anc: np.ndarray, heads: np.ndarray, tails: np.ndarray, streams: int,
                        dram: bool = False, co_running: float = 0.0,
                        psi: Callable[[], dict[int, float]] | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """(heads, tails, the segments' bounds summed): the segments between `separators` run one after another, so
    an op starts after the bounds of the segments before its own (`segment_us`) add up, and ends before those
    after it. The window bounds of `heads_us` count SM work, not chain_fill's fit (GoogLeNet training b32: the
    head of the loss 9.7 us higher). One segment, the whole DAG, adds nothing to the other bounds but what
    running side by side costs."""
    edges = [0, *separators(anc), len(anc)]
    if len(edges) == 2 and not (co_running > 0 and streams > 1):
        return heads, tails, 0.0
    spans = [segment_us(dag, anc, a, b, streams, dram, co_running, psi) for a, b in zip(edges, edges[1:])]
    before = np.concatenate([[0.0], np.cumsum(spans)])
    heads, tails = heads.copy(), tails.copy()
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        heads[a:b] = np.maximum(heads[a:b], before[k])
        tails[a:b] = np.maximum(tails[a:b], before[-1] - before[k + 1])
    return heads, tails, float(before[-1])


def disjunctive_us(dag: Dag) -> float:
    """C >= max over theta of `clique_window` on all ops: big ops and a chain of ops that overlap neither them
    nor each other run one at a time."""
    best = 0.0
    for theta in CLIQUE_THETAS:
        base, chain = clique_window(dag, theta)
        best = max(best, float(base.sum()) + _longest_chain_us(dag, chain))
    return best


def chain_fill_us(dag: Dag, anc: np.ndarray, streams: int, dram: bool = False) -> float:
    """`chain_fill`'s bound on the whole DAG."""
    path, fillers = chain_and_fillers(dag, anc | anc.T, np.arange(len(dag.preds)))
    lp = LP()
    total = lp.columns(1, cost=1.0)
    add_chain_fill(lp, [dag.alts[u] for u in path], fillers, streams, rates(streams, dram), total)
    return lp.solve() or 0.0
