"""Lower bounds on the iteration time of every schedule of a Problem, and on the memory every schedule needs.

A schedule runs each op once, on one of its alternatives, after its preds end; at most `streams` ops run at once,
their sm_demand summing to at most SM_CAPACITY (and, with --dram, their dram_demand to DRAM_CAPACITY). Copies and
recomputations only add work, so bounds that leave them out hold under any cap. Times are the alternatives'
time_us, the durations the plan's replay predicts with. Every bound below holds for every schedule (C: its
makespan); `head_tail` combines them all and is the strongest:

  critical_path  C >= the longest dependency chain at each op's fastest time
  sm_work        C >= sum over ops of min over alternatives of time_us x sm_demand / 100 (dram_work likewise)
  streams        C >= sum of fastest times / streams
  disjunctive    C >= fastest times summed over big ops and one chain that can overlap neither them nor each other
  head_tail      C >= head(v) + fastest(v) + tail(v), heads and tails from window bounds (`heads_us`)

Window bounds: every op of a set S that runs within a window of length L gives L >= sum over S of base weights
+ the heaviest chain in S of chain weights (`Window`). Rates make the base weights (`rates`), big ops and
chains make the others (`clique_window`, `fill_window`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from planner.problem import DRAM_CAPACITY, SM_CAPACITY, Alternative, Problem

Rate = Callable[[Alternative], float]  # an alternative's share of the GPU per us it runs
Window = tuple[np.ndarray, np.ndarray | None]  # (base weight per op, chain weight per op or None), in us
DFF_EPSILONS = (10, 20, 30, 40, 50)  # `dff` thresholds, in SM_CAPACITY units
CLIQUE_THETAS = (1, 5, 20, 50)  # `clique_window` thresholds, in SM_CAPACITY units
CHAIN_CELLS = 1 << 23  # cells of chain matrices `heads_us` keeps (64 MiB): all five up to ~1300 ops
SINK = Alternative("sink", 0.0, 0, 0, 0)


@dataclass
class Dag:
    """The ops' precedence DAG in topological order, with each op's alternatives."""

    preds: list[list[int]]
    alts: list[list[Alternative]]

    @classmethod
    def of(cls, p: Problem) -> Dag:
        order = _topological([o.preds for o in p.ops])
        index = {op: k for k, op in enumerate(order)}
        return cls([sorted(index[u] for u in p.ops[op].preds) for op in order],
                   [p.ops[op].alternatives for op in order])

    def reversed(self) -> Dag:
        """Every edge turned around (tails of this DAG are heads of that one); op i becomes n - 1 - i."""
        n = len(self.preds)
        succs: list[list[int]] = [[] for _ in range(n)]
        for v, preds in enumerate(self.preds):
            for u in preds:
                succs[u].append(v)
        return Dag([sorted(n - 1 - s for s in succs[n - 1 - i]) for i in range(n)], self.alts[::-1])

    def with_sink(self) -> Dag:
        """A zero-length op after all others: its head bounds the makespan."""
        ends = set(range(len(self.preds))) - {u for preds in self.preds for u in preds}
        return Dag(self.preds + [sorted(ends)], self.alts + [[SINK]])

    def fastest_us(self) -> np.ndarray:
        return np.array([min(a.time_us for a in alts) for alts in self.alts])

    def least(self, rate: Rate) -> np.ndarray:
        """Per op, min over alternatives of time_us x rate: its least share-weighted time."""
        return np.array([min(a.time_us * rate(a) for a in alts) for alts in self.alts])

    def ancestors(self) -> np.ndarray:
        """anc[v, u]: u must end before v starts."""
        n = len(self.preds)
        anc = np.zeros((n, n), dtype=bool)
        for v, preds in enumerate(self.preds):
            for u in preds:
                anc[v] |= anc[u]
                anc[v, u] = True
        return anc


def _topological(preds: list[list[int]]) -> list[int]:
    """Ops in an order where each comes after its preds (the identity when they already are)."""
    if all(u < v for v, ps in enumerate(preds) for u in ps):
        return list(range(len(preds)))
    order, placed = [], [False] * len(preds)
    while len(order) < len(preds):
        before = len(order)
        for v, ps in enumerate(preds):
            if not placed[v] and all(placed[u] for u in ps):
                placed[v] = True
                order.append(v)
        if len(order) == before:
            raise ValueError("the ops' dependencies form a cycle")
    return order


def lower_bounds_us(p: Problem, streams: int) -> dict[str, float]:
    """Bounds every schedule obeys (module docstring): the dependency chain, SM work (and DRAM work with --dram),
    streams, big ops with a chain, and heads and tails that combine them all."""
    dag = Dag.of(p)
    fastest = dag.fastest_us()
    dram = any(a.dram_demand for o in p.ops for a in o.alternatives)
    bounds = {"critical_path": _longest_chain_us(dag, fastest), "sm_work": float(dag.least(sm_share).sum()),
              **({"dram_work": float(dag.least(dram_share).sum())} if dram else {}),
              "streams": float(fastest.sum()) / streams}
    if p.ops:
        bounds["disjunctive"] = disjunctive_us(dag)
        bounds["head_tail"] = head_tail_us(dag, streams, dram)
    return bounds


def sm_share(a: Alternative) -> float:
    return a.sm_demand / SM_CAPACITY


def dram_share(a: Alternative) -> float:
    return a.dram_demand / DRAM_CAPACITY


def dff(eps: int) -> Rate:
    """A dual-feasible function of the SM share: above 100 - eps counts 1, below eps 0, else the share itself.
    Its sum over running ops is <= 1: beside an op above 100 - eps only ops below eps fit, which count 0."""
    def rate(a: Alternative) -> float:
        s = a.sm_demand
        return 1.0 if s > SM_CAPACITY - eps else s / SM_CAPACITY if s >= eps else 0.0
    return rate


def rates(streams: int, dram: bool) -> list[Rate]:
    """Rates whose sum over the ops running at any instant is at most 1, so that ops run within a window of
    length L have L >= sum of min_a time_us x rate(a): the SM share; one stream slot, 1 / streams (at most
    `streams` ops at once); `dff` of the SM share; the DRAM share under --dram."""
    return [sm_share, lambda a: 1.0 / streams, *(dff(e) for e in DFF_EPSILONS), *([dram_share] if dram else [])]


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


def head_tail_us(dag: Dag, streams: int, dram: bool = False) -> float:
    """C >= head(v) + fastest(v) + tail(v) for every op v (tail(v) <= C - end(v): heads of the reversed DAG), and
    C >= the head of a sink after every op, and its mirror."""
    ends = []
    for d in (dag, dag.reversed()):
        sunk = d.with_sink()
        anc = sunk.ancestors()
        ends.append(heads_us(sunk, windows(sunk, anc, streams, dram), anc))
    heads, tails = ends[0], ends[1]
    through = heads[:-1] + dag.fastest_us() + tails[:-1][::-1]
    return float(max(heads[-1], tails[-1], through.max()))


def disjunctive_us(dag: Dag) -> float:
    """C >= max over theta of `clique_window` on all ops: big ops and a chain of ops that overlap neither them
    nor each other run one at a time."""
    best = 0.0
    for theta in CLIQUE_THETAS:
        base, chain = clique_window(dag, theta)
        best = max(best, float(base.sum()) + _longest_chain_us(dag, chain))
    return best


def memory_lower_bound(p: Problem) -> tuple[int, str]:
    """(bytes, op): the resident bytes plus, for the op that needs most, the tensors it reads and writes and
    its leanest workspace; these must all be on the device while it runs, in any schedule."""
    best, where = p.resident_bytes, ""
    for o in p.ops:
        need = p.resident_bytes + sum(p.tensors[t].bytes for t in set(o.reads) | set(o.writes))
        need += min(a.workspace_bytes for a in o.alternatives)
        if need > best:
            best, where = need, o.name
    return best, where
