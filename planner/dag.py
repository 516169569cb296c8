"""The ops' precedence DAG as the bounds see it (topological order, each op's alternatives), and rates: shares of
the GPU whose sum over the ops running at any instant is at most 1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from planner.problem import DRAM_CAPACITY, SM_CAPACITY, Alternative, Problem

Rate = Callable[[Alternative], float]  # an alternative's share of the GPU per us it runs
DFF_EPSILONS = (10, 20, 30, 40, 50)  # `dff` thresholds, in SM_CAPACITY units
SINK = Alternative("sink", 0.0, 0, 0, 0)


@dataclass
class Dag:
    """The ops' precedence DAG in topological order, with each op's alternatives."""

    preds: list[list[int]]
    alts: list[list[Alternative]]
    order: list[int] | None = None  # the Problem's op at each position (Dag.of)

    @classmethod
    def of(cls, p: Problem) -> Dag:
        order = _topological([o.preds for o in p.ops])
        index = {op: k for k, op in enumerate(order)}
        return cls([sorted(index[u] for u in p.ops[op].preds) for op in order],
                   [p.ops[op].alternatives for op in order], order)

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
