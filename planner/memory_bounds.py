"""Bounds under a memory cap: the bytes any schedule needs (`memory_lower_bound`), and what the cap forces off the
device at an op every path passes through (`Cut`), priced in time (`memory_cut_us`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sparse

from planner.chain_fill import LP, Filler, add_chain_fill, chain_and_fillers
from planner.co_running import area_rate
from planner.dag import Dag, rates, sm_share
from planner.memory_floor import memory_floor, own_bytes
from planner.problem import Problem

CHAIN_FILL_CUTS = 2  # cuts whose memory_cut also takes `chain_fill`'s rows (the strongest; each ~0.5 s on ResNet-50)


def memory_lower_bound(p: Problem) -> tuple[int, str]:
    """(bytes, op): what the op that needs most holds on the device while it runs, in any schedule: the resident
    bytes, the tensors it reads and writes, its leanest workspace, and the tensors that must stay while it runs:
    where every path passes through it (`Cut`), every tensor made before it and read after it that can neither be
    offloaded nor recomputed; anywhere, those its minimum cut splits (`planner.memory_floor`)."""
    best, where = p.resident_bytes, ""
    dag = Dag.of(p)
    anc = dag.ancestors()
    cut_at = {dag.order[c.v]: c for c in cuts(p, dag, anc)}
    for i, o in enumerate(p.ops):
        need = cut_at[i].held_bytes if i in cut_at else p.resident_bytes + own_bytes(p, i)
        if need > best:
            best, where = need, o.name
    split, op = memory_floor(p, dag.order, anc, best)
    if op >= 0:
        best, where = split, p.ops[op].name
    return best, where


def cuts(p: Problem, dag: Dag, anc: np.ndarray) -> list[Cut]:
    """A `Cut` at each op every path passes through: each other op is its ancestor or its descendant, so none
    runs beside it. One sparse product per kind of use tells, for every tensor and cut op v at once, whether one
    of its writers (early readers, late readers) is v or runs before it, or is v or runs after it (DenseNet-121
    training b32: 0.04 s, where a loop over the tensors at each cut took 1.2)."""
    related = (anc | anc.T).sum(axis=1)
    at = np.flatnonzero(related == len(anc) - 1)
    if not at.size:
        return []
    pos = {op: k for k, op in enumerate(dag.order)}
    itself = np.arange(len(anc))[:, None] == at
    up = (anc[at].T | itself).astype(np.int32)  # up[u, i]: u is cut op i or one of its ancestors
    down = (anc[:, at] | itself).astype(np.int32)  # down[w, i]: w is cut op i or a descendant

    def uses(ops_of) -> sparse.csr_matrix:
        rows = [(t, pos[u]) for t, tu in enumerate(p.tensors) for u in ops_of(tu)]
        r, c = zip(*rows) if rows else ((), ())
        return sparse.csr_matrix((np.ones(len(rows), dtype=np.int32), (r, c)), shape=(len(p.tensors), len(anc)))

    writers, early, late = uses(lambda tu: tu.writers), uses(lambda tu: tu.early), uses(lambda tu: tu.late)
    written_before = (writers @ up > 0) | (writers.getnnz(axis=1) == 0)[:, None]
    used_after = (writers + early) @ down > 0
    read_late_after = late @ down > 0
    late_before = late @ up > 0
    is_output = np.array([tu.is_output for tu in p.tensors], dtype=bool)[:, None]
    choosable = np.array([tu.choosable for tu in p.tensors], dtype=bool)[:, None]
    live = written_before & (is_output | used_after | read_late_after)  # made before the cut op, used after
    away = live & choosable & ~used_after & ~late_before
    size_bytes = np.array([tu.bytes for tu in p.tensors], dtype=np.int64)
    out = []
    for i, v in enumerate(at):
        op = p.ops[dag.order[v]]
        own = np.zeros(len(p.tensors), dtype=bool)
        own[list({*op.reads, *op.writes})] = True
        gone = away[:, i] & ~own
        held = (p.resident_bytes + min(a.workspace_bytes for a in op.alternatives) + int(size_bytes[own].sum())
                + int(size_bytes[live[:, i] & ~own & ~gone].sum()))
        out.append(Cut(int(v), held, np.flatnonzero(gone).tolist(), int(size_bytes[gone].sum())))
    return out


@dataclass
class Cut:
    """The device memory at the start of a cut op v: `held_bytes` are there in every schedule (resident bytes,
    v's leanest workspace, what v reads and writes, every tensor made before v and used after it that must stay);
    each of `away` (saved tensors whose forward readers all precede v and backward readers all follow it) is
    there unless offloaded (its copy out ended before v starts, its copy back starts after) or recomputed (after
    v starts)."""

    v: int  # position in the Dag
    held_bytes: int
    away: list[int]  # tensors
    away_bytes: int

    def excess_bytes(self, cap_bytes: int) -> int:
        """What the cap forces off the device here (at most away_bytes when the cap is at least held_bytes)."""
        return self.held_bytes + self.away_bytes - cap_bytes


def memory_cut_us(p: Problem, cap_bytes: int, dag: Dag, anc: np.ndarray, heads: np.ndarray, tails: np.ndarray,
                  streams: int, dram: bool = False, psi: dict[int, float] | None = None) -> float:
    """C + copy interference >= the least, over fractional offload o_t and recompute r_t of the `Cut`'s away
    tensors freeing sum (o_t + r_t) bytes_t >= held + away bytes - cap, of H + A + copy_interference x sum o_t
    (d2h_t + h2d_t), for the cut op that gives most; H = start(v), A = C - start(v):
      H >= head(v);  H >= m + sum o_t d2h_t over t made from m on, each m   (one copy engine, done by start(v))
      A >= fastest(v) + tail(v);  A >= q + sum o_t h2d_t over t whose readers' fastest + tail >= q, each q
      A >= work of v and its descendants + sum r_t x the recomputation's work   (recomputations after start(v))
      H + A >= work of every op + sum r_t x the recomputation's work
    where work is time x rate, for the SM share, for 1 / streams (on one stream: every op's time, which the SM
    share leaves out) and, with a co-running slowdown k on several streams, for `co_running.area_rate` (a narrow
    op leaves SMs idle or runs slowed: without it the co-running tails, which price no recomputation, hid what the
    cap costs, ResNet-50 training b32 at 50% on the H200 6198.4 us against a plan of 6854.1) and for
    `co_running.slot_rates`' psi (a narrow op holds one of the streams). Offloading and
    recomputing only add work, so nothing else changes; the relaxation is a linear program. On the
    CHAIN_FILL_CUTS cuts that give most, A also bounds `chain_fill` over v and its descendants, the
    recomputations among the fillers (each a share r_t of itself)."""
    fastest = dag.fastest_us()
    slowed = [area_rate(p.co_running)] if p.co_running > 0 and streams > 1 else []
    slowed += [lambda alt: psi[alt.sm_demand]] if psi else []
    works = [(rate, dag.least(rate)) for rate in (sm_share, lambda alt: 1.0 / streams, *slowed)]
    pos = {op: k for k, op in enumerate(dag.order)}
    related = anc | anc.T
    programs = []
    for cut in cuts(p, dag, anc):
        v, excess = cut.v, cut.excess_bytes(cap_bytes)
        if excess <= 0:
            continue
        away = [p.tensors[t] for t in cut.away]
        lp = LP()
        o = lp.columns(len(away))
        r = lp.columns(len(away))
        h = lp.columns(1, cost=1.0, lower=float(heads[v]))
        a = lp.columns(1, cost=1.0, lower=float(fastest[v] + tails[v]))
        for i, t in enumerate(away):
            lp.bounds[o + i], lp.bounds[r + i] = (0.0, float(t.can_offload)), (0.0, float(t.can_recompute))
            lp.cost[o + i] = p.device.copy_interference * (t.d2h_us + t.h2d_us) if t.can_offload else 0.0
            lp.row({o + i: 1.0, r + i: 1.0}, 1.0)
        made = [heads[pos[t.producer]] + fastest[pos[t.producer]] if t.producer is not None else 0.0 for t in away]
        back = [min(fastest[pos[c]] + tails[pos[c]] for c in t.late) for t in away]
        for release in sorted(set(made)):
            lp.row({**{o + i: t.d2h_us for i, t in enumerate(away) if t.can_offload and made[i] >= release},
                    h: -1.0}, -release)
        for due in sorted(set(back)):
            lp.row({**{o + i: t.h2d_us for i, t in enumerate(away) if t.can_offload and back[i] >= due},
                    a: -1.0}, -due)
        for rate, least in works:
            recomputed = {r + i: min(x.time_us * rate(x) for x in t.recompute_alternatives)
                          for i, t in enumerate(away) if t.can_recompute}
            lp.row({**recomputed, a: -1.0}, -float(least[v] + least[anc[:, v]].sum()))
            lp.row({**recomputed, h: -1.0, a: -1.0}, -float(least.sum()))
        lp.row({**{o + i: -float(t.bytes) for i, t in enumerate(away)},
                **{r + i: -float(t.bytes) for i, t in enumerate(away)}}, -float(excess))
        best = lp.solve()
        if best is not None:
            programs.append((best, v, away, lp, r, a))
    programs.sort(key=lambda x: -x[0])
    for k, (best, v, away, lp, r, a) in enumerate(programs[:CHAIN_FILL_CUTS]):
        path, fillers = chain_and_fillers(dag, related, np.r_[v, np.flatnonzero(anc[:, v])])  # v, descendants
        for i, t in enumerate(away):  # a recomputation ends before its backward readers start
            if t.can_recompute:
                readers = [pos[c] for c in t.late]
                ahead = np.array([not any(u == c or anc[u, c] for c in readers) for u in path])
                fillers.append(Filler(t.recompute_alternatives, ahead, budget=r + i))
        add_chain_fill(lp, [dag.alts[u] for u in path], fillers, streams, rates(streams, dram), a)
        stronger = lp.solve()
        if stronger is not None:
            programs[k] = (max(best, stronger), *programs[k][1:])
    return max((best for best, *_ in programs), default=0.0)


def worst_cut(p: Problem, cap_bytes: int) -> tuple[int, set[int]]:
    """(bytes, tensors): at the cut op where the cap forces most off the device, how much and what may go."""
    dag = Dag.of(p)
    worst = (0, set())
    for cut in cuts(p, dag, dag.ancestors()):
        worst = max(worst, (cut.excess_bytes(cap_bytes), set(cut.away)), key=lambda w: w[0])
    return worst
