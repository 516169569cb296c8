"""Which saved tensors to keep, offload or recompute so that the list schedule fits the cap, as short as it can be
found (`fit_cap`), and the heuristic's schedule from them (`best_heuristic`): the first plan, CP-SAT's hint and the
fallback when CP-SAT finds nothing better."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from planner.dag import sm_share
from planner.memory_bounds import worst_cut
from planner.heuristic import Outcome, Work, cost, interference_ticks, list_schedule
from planner.problem import Problem
from planner.schedule import Decision, Schedule, peaks_within, residency, timed

LIST_SLACKS = (1.0, 1.1, 1.3, 1.5, 1.7, 2.0, 2.5, 3.0, float("inf"))  # how much slower an alternative the list
# scheduler may take: a slower one that leaves SMs to a neighbour can shorten the whole (GoogLeNet training b32:
# 5447 us at 1.0, 4858 us at 2.0)
COPY_MARGINS = (1.0, 2.0)  # the heuristic also chooses its offloads with copies priced twice as slow (best_heuristic)
COPY_TOLERANCE = 0.01  # ... and takes the dearest-copy decisions whose list schedule is this close to the best
QUICK_EVALS = 40  # fit_cap's budget for the first valid plan (its starts, no one-decision improvements)
FIT_EVALS = 400  # ... and for the plan CP-SAT starts from


def fit_cap(p: Problem, cap_bytes: int, streams: int, max_evals: int = FIT_EVALS, slack: float = 1.0,
            work: Work | None = None, refined: bool = False, reserve: bool = False,
            largest_first: bool = False) -> Outcome | None:
    """Keep/offload/recompute decisions that meet the cap with the shortest list schedule (at `slack`) found.

    Starts: recompute the cheapest (per byte) that free the tightest cut's excess (`cheapest_cover`), the same
    without recomputations that read one another (`chain_free`), or, for
    each RECOMPUTE_LIMITS bound, every tensor that cheap; then offload the fewest other saved tensors, earliest
    made first (their copies have the longest to hide in), that make the list schedule fit (bisection). The
    shortest start is improved one decision at a time (keep, offload, recompute), kept when it still fits and
    gets shorter; where none fits, the one least over the cap is, by changes that bring it closer (`_shortfall`:
    only tensors on the device where it goes over, and `_chain_swaps`). Then, when the windows will `refine` the
    schedule, offloads cheaper to recompute are recomputed (`recompute_over_offload`). Deterministic: a budget of
    schedule evaluations, not of seconds.
    """
    run, left = budgeted_runs(p, cap_bytes, streams, slack, work, reserve, max_evals)
    closest = run({})
    if closest.fits:
        return closest
    by_cost = sorted((t for t, tu in enumerate(p.tensors) if tu.can_recompute),
                     key=lambda t: (p.tensors[t].recompute.time_us / p.tensors[t].bytes, t))
    made = sorted((t for t, tu in enumerate(p.tensors) if tu.can_offload), key=lambda t: (p.tensors[t].producer or -1, t))
    best = None
    starts = [[t for t in by_cost if p.tensors[t].recompute.time_us / p.tensors[t].bytes * 2**20 <= limit]
              for limit in RECOMPUTE_LIMITS]
    worst = worst_cut(p, cap_bytes)
    covers = [cheapest_cover(p, worst, by_cost, chain_free) for chain_free in (False, True)]
    for recomputed in [*dict.fromkeys(tuple(c) for c in covers), *starts]:
        decision: dict[int, Decision] = {t: "recompute" for t in recomputed}
        order = [t for t in made if t not in decision]
        lo, hi = 0, len(order)
        while lo <= hi and left():
            mid = (lo + hi) // 2
            out = run({**decision, **{t: "offload" for t in order[:mid]}})
            if out.fits:
                hi = mid - 1
                if best is None or cost(p, out.schedule) < cost(p, best.schedule):
                    best = out
            else:
                lo = mid + 1
                if _shortfall(p, out) < _shortfall(p, closest):
                    closest = out
    best = improve(p, best or closest, run, left, largest_first=largest_first)
    if not best.fits:
        return None
    return recompute_over_offload(p, best, run) if refined else best


def budgeted_runs(p: Problem, cap_bytes: int, streams: int, slack: float, work: Work | None, reserve: bool,
                  max_evals: int) -> tuple[Callable[[dict[int, Decision]], Outcome], Callable[[], bool]]:
    """(run, left): `run` list-schedules decisions at one slack and counts it; `left()` says whether fewer than
    `max_evals` have run, the budget that keeps the search deterministic."""
    evals = 0

    def run(decision: dict[int, Decision]) -> Outcome:
        nonlocal evals
        evals += 1
        return list_schedule(p, cap_bytes, streams, decision, slack, work, reserve)

    return run, lambda: evals < max_evals


def improve(p: Problem, best: Outcome, run: Callable[[dict[int, Decision]], Outcome], left: Callable[[], bool],
            ways: tuple[Decision, ...] = ("keep", "offload", "recompute"), largest_first: bool = False) -> Outcome:
    """`best` improved one decision at a time (to one of `ways`), each change kept when the list schedule `run`
    gives still fits and gets shorter, tensors in the order they are made or, `largest_first`, biggest first (each
    order ends in its own local optimum, see solve_graph.uncapped_cost); where `best` does not fit, changes that bring
    it closer (`_shortfall`: only tensors on the device where it goes over, and `_chain_swaps`), while `left()` allows
    more runs."""
    in_order = sorted(range(len(p.tensors)), key=lambda t: (-p.tensors[t].bytes, t)) if largest_first else None
    improved = True
    while improved and left():
        improved = False
        for t in (in_order or range(len(p.tensors))) if best.fits else _resident_over(p, best):
            tu = p.tensors[t]
            for how in ways if tu.choosable else ():
                if how == best.schedule.decision.get(t, "keep") or not left():
                    continue
                if how == "offload" and not tu.can_offload or how == "recompute" and not tu.can_recompute:
                    continue
                trial = {u: d for u, d in best.schedule.decision.items() if u != t}
                if how != "keep":
                    trial[t] = how
                out = run(trial)
                if _shortfall(p, out) < _shortfall(p, best):
                    best, improved = out, True
        for trial in _chain_swaps(p, best.schedule.decision, _resident_over(p, best)) if not best.fits else ():
            if not left():
                break
            out = run(trial)
            if _shortfall(p, out) < _shortfall(p, best):
                best, improved = out, True
                break
    return best


def _resident_over(p: Problem, out: Outcome) -> list[int]:
    """The tensors on the device where `out`'s list schedule went over the cap: what a change must free to fit."""
    residencies = residency(p, out.schedule.decision, timed(p, out.schedule))
    return [t for t, spans in enumerate(residencies) if any(a <= at < b for a, b in spans for at in out.over_at)]


def _chain_swaps(p: Problem, decision: dict[int, Decision], over: list[int]) -> list[dict[int, Decision]]:
    """`decision` with a recomputed tensor offloaded instead and a tensor its recomputation reads recomputed, where
    either is on the device where the cap is passed (`over`): a recomputation keeps what it reads on the device
    from then to that tensor's own backward use, which neither change alone frees (GoogLeNet training b32 under
    240 MiB: conv1's ReLU output recomputed from its convolution's output holds both through the ReLU's backward
    pass, 15.8 MiB over; offloaded, with the convolution's output recomputed from the batch after that pass, it
    fits)."""
    return [{**decision, t: "offload", u: "recompute"} for t, how in sorted(decision.items())
            if how == "recompute" and p.tensors[t].can_offload
            for u in p.tensors[t].recompute_reads
            if p.tensors[u].can_recompute and decision.get(u) != "recompute" and (t in over or u in over)]


def _shortfall(p: Problem, out: Outcome) -> tuple[int, int, float]:
    """How far a list schedule is from fitting, then its cost: bytes over the cap summed over the items that went
    ahead over it, the most over at once, the cost. A fitting schedule is (0, 0, cost)."""
    return out.overflow, out.over, cost(p, out.schedule)


def recompute_over_offload(p: Problem, best: Outcome, run: Callable[[dict[int, Decision]], Outcome]) -> Outcome:
    """`best` with each offload whose recomputation's SM work (time x SM share) is below the copies' interference
    made a recomputation, where the list schedule still fits: the bound's LP prices the two so. The list schedule
    puts a recomputation on the critical path, just before its reader, and prices it in full; the windows
    (planner.refine) then hide it in SM gaps, where a copy back still binds the backward readers it feeds. Without
    the windows the list schedule is the plan, and its price stands (GoogLeNet at 50%: 10 us longer).
    GoogLeNet training b32 at 50%, the 120-s budget spent in full: four offloads recomputed, 4060.4 -> 4004.0 us
    predicted (docs/BENCHMARKS.md)."""
    for t in sorted(t for t, how in best.schedule.decision.items() if how == "offload"):
        tu = p.tensors[t]
        if not tu.can_recompute:
            continue
        if tu.recompute.duration * sm_share(tu.recompute) < interference_ticks(p, {t: "offload"}):
            out = run({**best.schedule.decision, t: "recompute"})
            if out.fits:
                best = out
    return best


def cheapest_cover(p: Problem, worst: tuple[int, set[int]], by_cost: list[int], chain_free: bool = False
                   ) -> list[int]:
    """The cheapest recomputations (`by_cost` order) that free what the cap forces away at its tightest cut
    (`worst`: memory_bounds.worst_cut, computed once for both covers): the integral start the memory_cut bound's
    relaxation points at. `chain_free` skips those that read a chosen one or are read by one: a recomputation
    that reads another recomputed tensor brings that one back with it, at the later one's backward use, and both
    stay until the earlier one's readers run (ResNet-50 training b32 at 40% of its serial peak: the cover
    recomputes layer3.1-3.4's block outputs together at layer4.0's backward, 85 MiB over, and no start fit;
    without chains fit_cap ends at 9464.0 us, not 9676.0; at 30%, 13688.9, not 17652.0, and the 120-s plan runs
    24.8% faster on the H100). It may then free less than the excess: offloads cover the rest."""
    excess, away = worst
    chosen, read, freed = [], set(), 0
    for t in by_cost:
        if freed >= excess:
            break
        reads = set(p.tensors[t].recompute_reads)
        if t in away and not (chain_free and (reads & set(chosen) or t in read)):
            chosen.append(t)
            read |= reads
            freed += p.tensors[t].bytes
    return chosen


RECOMPUTE_LIMITS = (0.0, 3.0, 5.0, 10.0, float("inf"))  # us per MiB: recompute every tensor at most this dear


def fit_slack(p: Problem, streams: int, work: Work | None = None) -> float:
    """The slack of LIST_SLACKS whose list schedule without a cap is shortest: the one fit_cap searches its
    decisions at (GoogLeNet training b32 at 50%: 5462 us fitted at slack 1.0, 5110 us at 2.0)."""
    return min(LIST_SLACKS, key=lambda slack: (list_schedule(p, float("inf"), streams, {}, slack, work).makespan,
                                               slack))


def best_heuristic(p: Problem, cap_bytes: int, streams: int, slack: float, max_evals: int = FIT_EVALS,
                   work: Work | None = None, refined: bool = False, largest_first: bool = False,
                   larger_slacks: bool = True) -> Schedule | None:
    """The keep/offload/recompute decisions fit_cap finds at `slack`, once for each of COPY_MARGINS,
    list-scheduled at each of LIST_SLACKS: of those that fit the cap (checked again on the schedule's own
    residencies), the dearest-copy one within COPY_TOLERANCE of the shortest, or None. Why the margin: copies run
    one at a time per direction, so when a plan's offloads nearly fill the copy engines, every late copy delays
    all later ones and the ops waiting for them (ResNet-50 training b32 at 50%, measured on H100: the prefetch
    chain ran 0.2-0.9 ms behind its prediction).
    Decisions chosen with dearer copies offload less (there, at 1.2: 138 MiB instead of 187 MiB, 0.3% shorter).
    Why the tolerance: the list schedule prices a recomputation in full on the critical path, where the windows
    (planner.refine) then hide it beside other ops, and a copy without the queue behind it, so it ranks offloads
    too high (GoogLeNet training b32 at 50% on the H200 profile: decisions at margin 2.0 list-scheduled 0.4%
    longer than at 1.0, and refined to 4015.2 us against 4138.6). The one taken is `polished` where it schedules
    shortest at another slack than fit_cap's.
    Where no decisions fit at `slack`, and `larger_slacks`, fit_cap searches again at each larger slack of
    LIST_SLACKS until some do: at a small slack an op whose fast ways' workspace does not fit waits for room
    while copies back take it, then goes ahead over the cap, whatever is offloaded (the GPU tests' small training
    network at batch 512, one of its H200 profiles under 17 MiB: nothing fitted at 1.0; at 1.1 the gemm took its
    lean way and fitted). Under a cap nothing fits, that search costs each slack's fit_cap in full."""
    for fit_at in [slack, *(s for s in LIST_SLACKS if s > slack and larger_slacks)]:
        found = _fitted(p, cap_bytes, streams, fit_at, max_evals, work, refined, largest_first)
        if found:
            break
    else:
        return None
    least = min(cost(p, out.schedule) for _, out in found)
    margin, chosen = next((m, out) for m, out in reversed(found)
                          if cost(p, out.schedule) <= least * (1 + COPY_TOLERANCE))
    if chosen.slack != fit_at and max_evals > QUICK_EVALS:  # not for the first plan, which comes sooner without
        decision = polished(with_copy_margin(p, margin), cap_bytes, streams, chosen, max_evals // 2, work)
        again = shortest_at_slacks(p, cap_bytes, streams, decision, work, chosen.reserve)
        if again is not None and cost(p, again.schedule) < cost(p, chosen.schedule):
            chosen = again
    return chosen.schedule


def _fitted(p: Problem, cap_bytes: int, streams: int, slack: float, max_evals: int, work: Work | None,
            refined: bool, largest_first: bool) -> list[tuple[float, Outcome]]:
    """(copy margin, outcome) of fit_cap's decisions at `slack` for each of COPY_MARGINS (then with a copy
    reserve where none fitted), each list-scheduled at its best slack; dearer copies last."""
    found = []
    for margin, reserve in [(m, False) for m in COPY_MARGINS] + [(1.0, True)]:
        if reserve and found:
            break
        fitted = fit_cap(with_copy_margin(p, margin), cap_bytes, streams, max_evals, slack, work, refined, reserve,
                         largest_first)
        if fitted is None:
            continue
        out = shortest_at_slacks(p, cap_bytes, streams, fitted.schedule.decision, work, fitted.reserve)
        if out is not None:
            found.append((margin, out))
        if not fitted.schedule.decision:
            break  # the cap does not bind (nothing offloaded or recomputed): the margin changes nothing
    return found


def shortest_at_slacks(p: Problem, cap_bytes: int, streams: int, decision: dict[int, Decision],
                       work: Work | None = None, reserve: bool = False) -> Outcome | None:
    """The decisions list-scheduled at each of LIST_SLACKS: the cheapest that fits the cap (the first on ties),
    checked again on the schedule's own residencies (`peaks_within`), or None."""
    best = None
    for slack in LIST_SLACKS:
        out = list_schedule(p, cap_bytes, streams, decision, slack, work, reserve)
        if out.fits and (best is None or cost(p, out.schedule) < cost(p, best.schedule)):
            if peaks_within(p, out.schedule, cap_bytes):
                best = out
    return best


def polished(p: Problem, cap_bytes: int, streams: int, out: Outcome, max_evals: int, work: Work | None = None
             ) -> dict[int, Decision]:
    """`out`'s decisions improved one tensor at a time, kept or recomputed, where the list schedule at the slack
    they schedule shortest at still fits and gets shorter: fit_cap chose them at another slack, where such a
    change may go over the cap. ResNet-50 training b32 at 30% of its serial peak on the H200 profile: fit_cap
    searching at 1.7 offloads layer2.0's block output, whose copies queue behind the others on both engines; at
    the slack its decisions schedule shortest at keeping it fits, 5.5% shorter (the fifty-fifth session's plan,
    polished so with weight gradients still resident, ran 3.1% faster; docs/BENCHMARKS.md). No
    offloads: the list schedule prices a recomputation in full where the windows hide it, so offloads in its place
    gained here and lost after the windows (GoogLeNet training b32 at 50%: 4022.5 -> 4043.5 us)."""
    run, left = budgeted_runs(p, cap_bytes, streams, out.slack, work, out.reserve, max_evals)
    best = improve(p, run(out.schedule.decision), run, left, ("keep", "recompute"))
    return best.schedule.decision


def with_copy_margin(p: Problem, margin: float) -> Problem:
    """The problem with every host copy `margin` times longer."""
    if margin == 1.0:
        return p
    return replace(p, tensors=[replace(t, d2h_ticks=math.ceil(t.d2h_ticks * margin),
                                       h2d_ticks=math.ceil(t.h2d_ticks * margin)) for t in p.tensors])
