"""Deep recomputations: a recomputed tensor whose chain reads another tensor that is not kept re-runs that tensor's
chain too (TensorUse.deep), so the tensor it read need not be on the device from the one's recomputation to its
own backward use. Each costs more work, and most plans do better without them; chosen one at a time, only where
the list schedule gets cheaper under the cap (GoogLeNet training b32 at 35% of its serial peak: 7093.4 -> 5450.7
us, re-running conv1 to recompute its ReLU output instead of offloading that output)."""

from __future__ import annotations

from dataclasses import replace

from planner.decisions import shortest_at_slacks
from planner.heuristic import Work, cost, list_schedule
from planner.problem import Problem
from planner.schedule import Decision, Schedule, peaks_within

DEEP_EVALS = 300  # list schedules the search may take (GoogLeNet training b32 at 35%: 4.1 s of them)


def with_deep(p: Problem, deep: set[int]) -> Problem:
    """The problem where each tensor of `deep` is recomputed its deep way."""
    tensors = list(p.tensors)
    for t in deep:
        chain, reads, alternatives = tensors[t].deep
        tensors[t] = replace(tensors[t], recompute_chain=chain, recompute_reads=reads,
                             recompute_alternatives=alternatives, deep=None)
    return replace(p, tensors=tensors)


def deep_tensors(p: Problem, shallow: Problem) -> set[int]:
    """The tensors p recomputes their deep way, p being `shallow` after with_deep."""
    return {t for t, u in enumerate(p.tensors) if u.recompute_chain != shallow.tensors[t].recompute_chain}


def deep_recomputations(p: Problem, cap_bytes: int, streams: int, hint: Schedule, slack: float,
                        work: Work | None = None, max_evals: int = DEEP_EVALS) -> tuple[Problem, Schedule] | None:
    """(the problem with deep recomputations, its schedule) cheaper than `hint` under the cap, or None. Greedy from
    the hint's decisions, biggest tensors first: recompute one more tensor its deep way (where a tensor its chain
    reads is not kept); where that goes over the cap, also offload or recompute one more tensor; keep the
    cheapest that fits, while one gains."""
    best: tuple[Problem, Schedule] | None = None
    deep: set[int] = set()
    decision: dict[int, Decision] = dict(hint.decision)
    best_cost, evals = cost(p, hint), 0
    by_size = sorted(range(len(p.tensors)), key=lambda t: (-p.tensors[t].bytes, t))
    improved = True
    while improved and evals < max_evals:
        improved = False
        for t in by_size:
            tu = p.tensors[t]
            if t in deep or tu.deep is None or all(decision.get(u, "keep") == "keep" for u in tu.recompute_reads):
                continue
            q = with_deep(p, deep | {t})
            trial: dict[int, Decision] = {**decision, t: "recompute"}
            out = list_schedule(q, cap_bytes, streams, trial, slack, work)
            evals += 1
            fitting = [out] if out.fits else []
            if not out.fits:  # one more tensor off the device
                for w, how in _one_more(p, trial):
                    if evals >= max_evals:
                        break
                    out = list_schedule(q, cap_bytes, streams, {**trial, w: how}, slack, work)
                    evals += 1
                    fitting += [out] if out.fits else []
            fitting = [o for o in fitting if peaks_within(q, o.schedule, cap_bytes)]
            cheapest = min(fitting, key=lambda o: cost(q, o.schedule), default=None)
            if cheapest is not None and cost(q, cheapest.schedule) < best_cost:
                best, best_cost = (q, cheapest.schedule), cost(q, cheapest.schedule)
                deep, decision, improved = deep | {t}, dict(cheapest.schedule.decision), True
                break
            if evals >= max_evals:
                break
    if best is None:
        return None
    q, schedule = best
    out = shortest_at_slacks(q, cap_bytes, streams, decision, work)  # as best_heuristic takes its decisions
    return q, out.schedule if out is not None and cost(q, out.schedule) < cost(q, schedule) else schedule


def _one_more(p: Problem, decision: dict[int, Decision]) -> list[tuple[int, Decision]]:
    return [(w, how) for w, wu in enumerate(p.tensors) if wu.choosable and w not in decision
            for how, can in (("offload", wu.can_offload), ("recompute", wu.can_recompute)) if can]

