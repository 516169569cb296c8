"""The chain-and-fillers bound: a dependency chain runs one op at a time, and the other ops fill the room beside
it only on alternatives that fit there.

The SM-work bound counts every op at its least area, as if any op could fill any room. Beside a data-gradient
convolution on 85% of the SMs, though, only alternatives within 15% fit, and a weight gradient's are slower and
wider than its least-area one, or none fits at all; what does not fit beside the chain adds to it. For a path P
of the DAG (its ops run one after another; `longest_path`), with x_ua the share of chain op u run on alternative
a (time t_ua, SM share s_ua, room r_ua = 1 - s_ua) and z_wua the share of filler w's work done beside it:

  T >= sum_{u,a} x_ua t_ua + sum_w (b_w - sum_ua z_wua) R(w)     (the chain, then the rest outside it)
  sum_a x_ua = 1                                                  (each chain op runs once)
  sum_w z_wua area_w(r_ua) <= x_ua t_ua r_ua                      (the SM room beside u on a)
  sum_w z_wua time_w(r_ua) <= (streams - 1) x_ua t_ua             (the streams beside u on a)
  sum_ua z_wua <= b_w                                             (each filler's work once)

z_wua exists only where w may overlap u (not its ancestor or descendant) and fits r_ua; area_w(r) and time_w(r)
are the least area and time of w's alternatives within r; R is any rate (`dag.rates`): outside the chain only
fillers run, their rates summing to at most 1. b_w is 1, or the fraction of a recomputation a cap forces
(`memory_cut_us`). The relaxation is a linear program; T bounds the time the chain and its fillers take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sparse
from scipy.optimize import linprog

from planner.problem import SM_CAPACITY, Alternative


@dataclass
class LP:
    """A linear program built column by column: min cost . x, rows <= rhs (or == rhs), bounds per column."""

    cost: list[float] = field(default_factory=list)
    bounds: list[tuple[float, float | None]] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, bool]] = field(default_factory=list)

    def columns(self, k: int, upper: float | None = None, cost: float = 0.0, lower: float = 0.0) -> int:
        """k new columns in [lower, upper]; returns the first one's index."""
        first = len(self.cost)
        self.cost += [cost] * k
        self.bounds += [(lower, upper)] * k
        return first

    def row(self, terms: dict[int, float], rhs: float, equal: bool = False) -> None:
        self.rows.append((terms, rhs, equal))

    def solve(self) -> float | None:
        """The optimum, or None when the program is infeasible (or the solver gives up)."""
        matrices = []
        for equal in (False, True):
            rows = [(t, b) for t, b, e in self.rows if e == equal]
            r = [i for i, (t, _) in enumerate(rows) for _ in t]
            c = [j for t, _ in rows for j in t]
            v = [x for t, _ in rows for x in t.values()]
            matrices.append((sparse.csr_matrix((v, (r, c)), shape=(len(rows), len(self.cost))) if rows else None,
                             np.array([b for _, b in rows]) if rows else None))
        (a_ub, b_ub), (a_eq, b_eq) = matrices
        lp = linprog(np.array(self.cost), A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=self.bounds,
                     method="highs")
        return float(lp.fun) if lp.status == 0 else None


@dataclass
class Filler:
    """An op (or a recomputation) off the chain: its alternatives, the chain positions it may run beside, and the
    column holding the share of it that must run (None: all of it)."""

    alternatives: list[Alternative]
    beside: np.ndarray  # bool per chain position
    budget: int | None = None


def longest_path(preds: list[list[int]], weights: np.ndarray) -> list[int]:
    """The heaviest dependency chain, in order (ops in topological order)."""
    end, via = np.zeros(len(preds)), [-1] * len(preds)
    for v, ps in enumerate(preds):
        if ps:
            via[v] = max(ps, key=lambda u: end[u])
            end[v] = end[via[v]]
        end[v] += weights[v]
    v, path = int(end.argmax()) if len(preds) else -1, []
    while v != -1:
        path.append(v)
        v = via[v]
    return path[::-1]


def _within(alternatives: list[Alternative]) -> tuple[np.ndarray, np.ndarray]:
    """(area, time) per room in SM units: the least area and least time of the alternatives fitting it."""
    area, time = np.full(SM_CAPACITY + 1, np.inf), np.full(SM_CAPACITY + 1, np.inf)
    for b in alternatives:
        area[b.sm_demand:] = np.minimum(area[b.sm_demand:], b.time_us * b.sm_demand / SM_CAPACITY)
        time[b.sm_demand:] = np.minimum(time[b.sm_demand:], b.time_us)
    return area, time


def add_chain_fill(lp: LP, chain: list[list[Alternative]], fillers: list[Filler], streams: int,
                   rates: list, total: int) -> None:
    """The module docstring's rows, with column `total` as T."""
    x = [lp.columns(len(alts)) for alts in chain]
    for u, alts in enumerate(chain):
        lp.row({x[u] + a: 1.0 for a in range(len(alts))}, 1.0, equal=True)
    outside: list[dict[int, float]] = [{} for _ in rates]  # per rate: column -> coefficient
    constant = np.zeros(len(rates))
    beside: dict[tuple[int, int], tuple[dict[int, float], dict[int, float]]] = {}  # (u, a) -> SM, stream terms
    for f in fillers:
        least = np.array([min(b.time_us * rate(b) for b in f.alternatives) for rate in rates])
        if f.budget is None:
            constant += least
        else:
            for k in range(len(rates)):
                outside[k][f.budget] = least[k]
        area, time = _within(f.alternatives)
        placed = {}
        for u in np.flatnonzero(f.beside):
            for a, alt in enumerate(chain[u]):
                room = SM_CAPACITY - alt.sm_demand
                if np.isinf(area[room]):
                    continue
                z = lp.columns(1)
                placed[z] = 1.0
                sm, slots = beside.setdefault((u, a), ({}, {}))
                sm[z], slots[z] = area[room], time[room]
                for k in range(len(rates)):
                    outside[k][z] = -least[k]
        if placed:
            if f.budget is None:
                lp.row(placed, 1.0)
            else:
                lp.row({**placed, f.budget: -1.0}, 0.0)
    for (u, a), (sm, slots) in beside.items():
        alt = chain[u][a]
        lp.row({**sm, x[u] + a: -alt.time_us * (SM_CAPACITY - alt.sm_demand) / SM_CAPACITY}, 0.0)
        lp.row({**slots, x[u] + a: -alt.time_us * (streams - 1)}, 0.0)
    along = {x[u] + a: alt.time_us for u, alts in enumerate(chain) for a, alt in enumerate(alts)}
    for k in range(len(rates)):
        lp.row({**along, **outside[k], total: -1.0}, -float(constant[k]))


def chain_and_fillers(dag, related: np.ndarray, ops: np.ndarray) -> tuple[np.ndarray, list[Filler]]:
    """The longest chain through `ops` (positions in topological order) at the fastest times, and the other ops
    as fillers beside the chain ops they are unrelated to."""
    index = {int(w): i for i, w in enumerate(ops)}
    path = ops[longest_path([[index[u] for u in dag.preds[w] if u in index] for w in ops], dag.fastest_us()[ops])]
    on_path = set(path.tolist())
    return path, [Filler(dag.alts[w], ~related[w, path]) for w in ops if w not in on_path]
