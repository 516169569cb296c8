"""One graph's solve under one cap (`solve_graph`), after solve.py has chosen its rewrites (fused BatchNormalization
and ReLU, concats as views): the baseline, the memory floor (exit 3 below it), the bounds, the heuristic's schedule
fitted to the runner's arena (arena_fit.py), CP-SAT on the whole model or window by window for what the time
limit leaves (budget.py), and the plan that settles fastest, offered against its serial form (serialize.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Literal

from planner.arena_fit import ARENA_STEPS, arena_fit, deep_fit, device_bytes, fits_device, plan_of, solver_cap
from planner.bounds import lower_bounds_us
from planner.budget import (BOUND_S_PER_OP, CPSAT_WALL_PER_DET, LAYOUT_S_PER_OP, MIN_SEARCH_SHARE, RUNAWAY, charged_s,
                            final_checks_s)
from planner.deep import deep_tensors, with_deep
from planner.decisions import FIT_EVALS, QUICK_EVALS, best_heuristic, fit_slack
from planner.heuristic import Work, cost, list_schedule, serial_baseline
from planner.ir import Graph
from planner.memory_bounds import memory_lower_bound
from planner.memsize import fmt_bytes
from planner.minimum_cap import CapTooSmall, cap_too_small, with_arena
from planner.plan import Plan, Totals
from planner.problem import Problem, build_problem
from planner.profile import Profile
from planner.schedule import Schedule, loose_horizon
from planner.serialize import fitting_serial, offer_serial, offer_serial_form
from planner.streams import build_plan, predicted_cost

REFINED = ("CP-SAT on windows of the timeline (planner.refine; on the whole model first up to 200 ops): each window's "
           "ops free, the keep/offload/recompute decisions fixed")
WHOLE_MODEL_OPS = 200  # problems up to this size go to CP-SAT whole first (`_search`)
WHOLE_MODEL_SHARE = 0.25  # ... for this share of the time limit
FIT_SHARE = 0.25  # under a time limit, the second fit_cap may take this share of what the limit leaves (fit_evals)
COSTLY_CAP = 1.2  # a heuristic plan this many times the uncapped list schedule searches its decisions twice
SECOND_ORDER_STEPS = 6  # ... the second time largest first, from its solver cap down this many arena steps at most
# (ResNet-50 training b32 at 30% with BatchNormalizations and ReLUs fused, on the H200: that order's plans overflow
# the arena three steps down and fit at the fourth, 10435.7 -> 7889.0 us predicted)


@dataclass
class Options:
    """`planner solve`'s choices (solve.solve_plan says what each does)."""

    streams: int = 4
    time_limit_s: float = 60.0
    workers: int = 8
    seed: int = 0
    offload: bool = True
    recompute: bool = True
    max_alternatives: int = 8
    dram: bool = False  # DRAM bandwidth as a second cumulative beside the SM share
    baseline: bool = False  # emit the framework-style plan instead: serial, fastest algorithm, everything kept
    concat: Literal["auto", "view", "copy"] = "auto"  # concats written in place by their producers (see solve_plan)
    bn_relu: Literal["auto", "fused", "apart"] = "auto"  # BatchNormalizations running their ReLUs (see solve_plan)
    deterministic: bool = False  # the time limit counts work alone: the wall clock ends the search only at RUNAWAY


def problem_for(graph: Graph, profile: Profile, options: Options, work: Work, streams: int | None = None) -> Problem:
    """The graph's Problem under the options (for plans on `streams`, default the options'), its setup counted in
    `work`."""
    p = build_problem(graph, profile, options.max_alternatives, options.offload, options.recompute, options.dram,
                      streams or options.streams)
    work.setups += len(p.ops)
    return p


def solve_graph(graph: Graph, profile: Profile, cap_bytes: int, options: Options,
                on_progress: Callable[[float, float, float], None] | None,
                on_plan: Callable[[Plan], None] | None, work: Work, t0: float) -> Plan:
    """The plan of one graph, as solve.solve_plan describes (its rewrites already chosen); `t0` is when the whole
    solve began and `work` what it has charged so far, so that the time limit covers the rewrites' checks too."""
    p = shallow = problem_for(graph, profile, options, work)  # p: with the deep recomputations the heuristic takes
    p1 = p if options.streams == 1 else problem_for(graph, profile, options, work, streams=1)  # priced on one stream
    base, base_us, base_peak = serial_baseline(p1)
    need, op = memory_lower_bound(p)
    if cap_bytes < need:
        raise CapTooSmall(f"the cap {fmt_bytes(cap_bytes)} is below the {fmt_bytes(need)} any schedule needs "
                          f"(resident {fmt_bytes(p.resident_bytes)}, plus what op {op} reads, writes, its "
                          f"leanest workspace and the tensors that must stay while it runs, whichever ops run "
                          f"before it); minimum cap: {need} bytes", need, floor_bytes=need)
    if options.baseline:
        if base_peak > cap_bytes:
            raise CapTooSmall(f"the serial baseline needs {fmt_bytes(base_peak)}, over the cap "
                              f"{fmt_bytes(cap_bytes)}", base_peak)
        bounds = lower_bounds_us(p1, 1)
        totals = Totals(makespan_us=0.0, peak_bytes=0, mem_cap_bytes=cap_bytes, lower_bound_us=max(bounds.values()),
                        bounds_us=bounds, baseline_makespan_us=0.0, baseline_peak_bytes=base_peak,
                        status="baseline (serial, fastest algorithm per op)", gap=0.0, solve_time_s=0.0)
        plan = build_plan(graph, p1, base, totals, 1)
        plan.totals.baseline_makespan_us = plan.totals.makespan_us
        return plan

    def fits(plan: Plan) -> bool:
        work.layouts += len(p.ops)
        return fits_device(graph, plan, cap_bytes, work)

    # under the user's cap, not the arena's target; with a search to come, the first plan reports the quick ones
    # and the search all (`final`), so that the first plan comes sooner
    quick = options.time_limit_s > 0
    bounds = lower_bounds_us(p, options.streams, cap_bytes, quick)
    work.bounded += len(p.ops)
    # where the serial plan does not fit (its peak or its arena) `done` offers the plan in serial form, whose
    # one-stream bound is charged now
    serial_plan = fitting_serial(graph, p1, base, base_peak, cap_bytes, fits) if p1 is not p else None
    serial_form_offered = p1 is not p and serial_plan is None
    work.bounded += len(p.ops) * serial_form_offered
    slack = fit_slack(p, options.streams, work)
    refined = options.time_limit_s > 0  # the search follows the heuristic (decisions.recompute_over_offload)
    first_s = None
    if on_progress and p1 is not p and not serial_form_offered:  # the serial plan is offered at the end (done)
        report = on_progress

        def on_progress(makespan_us: float, bound_us: float, elapsed_s: float) -> None:
            report(min(makespan_us, base_us), min(bound_us, base_us), elapsed_s)

    built: dict[tuple[int, int], Plan] = {}  # (solver cap, id of the hint): the heuristic's plan

    def first(target: int, hint: Schedule) -> Plan:
        """The heuristic's plan, handed to on_plan when it is the first valid one."""
        nonlocal first_s
        plan = _solve_under(graph, p, target, base_us, base_peak, bounds, replace(options, time_limit_s=0), None, hint)
        plan.totals.mem_cap_bytes = cap_bytes
        built[target, id(hint)] = plan
        if fits(plan) and first_s is None:
            first_s = plan.totals.first_plan_s = plan.totals.solve_time_s = time.monotonic() - t0
            if on_plan:
                on_plan(plan)
        return plan

    def final(target: int, hint: Schedule | None) -> Plan:
        """CP-SAT from the hint for what is left of the time limit (its wall clock leaving the serial form's
        bound time); without CP-SAT (time limit 0) the heuristic's plan, built once."""
        if options.time_limit_s <= 0 and hint is not None and (target, id(hint)) in built:
            return built[target, id(hint)]
        limit, charged = options.time_limit_s, charged_s(work)
        search_s = max(limit - charged - final_checks_s(p), limit * MIN_SEARCH_SHARE)
        if quick:
            bounds.update(lower_bounds_us(shallow, options.streams, cap_bytes))
        plan = _solve_under(graph, p, target, base_us, base_peak, bounds, replace(options, time_limit_s=search_s),
                            on_progress, hint, fits, own_bound=target == cap_bytes and p is shallow,
                            deadline=t0 + RUNAWAY * limit if options.deterministic
                            else t0 + limit - serial_form_offered * len(p.ops) * BOUND_S_PER_OP)
        if limit > 0:
            plan.totals.status += (f"; the search had {search_s:.1f} s of the {limit:g} s limit, the heuristic's "
                                   f"work {charged:.1f} s")
        return plan

    def done(plan: Plan) -> Plan:
        if p1 is not shallow:
            plan = (offer_serial_form(plan, graph, p1, cap_bytes, fits) if serial_form_offered
                    else offer_serial(plan, serial_plan))
        plan.totals.first_plan_s = first_s if first_s is not None else time.monotonic() - t0
        return plan

    if base_peak <= cap_bytes:  # the peak does not bind; the arena, in driver pages, may still
        hint = best_heuristic(p, cap_bytes, options.streams, slack, work=work, refined=refined)
        if hint is not None and fits(first(cap_bytes, hint)):
            return done(final(cap_bytes, hint))

    overflowed: list[tuple[Schedule, int]] = []  # heuristic schedules whose arenas passed the cap, with peaks

    def fit_at(start_bytes: int, max_evals: int, largest_first: bool = False, steps: int = ARENA_STEPS
               ) -> tuple[int, Schedule | None, int]:
        return arena_fit(graph, p, cap_bytes, start_bytes, options.streams, slack, max_evals, fits, work, refined,
                         overflowed, largest_first, steps)

    before_s, start_bytes = charged_s(work), solver_cap(graph, p.resident_bytes, cap_bytes)
    target, hint, tries = fit_at(start_bytes, QUICK_EVALS)
    if hint is not None:
        first(target, hint)
    charged = charged_s(work)
    quick_s = (charged - before_s) / tries
    evals = fit_evals(options.time_limit_s, charged, quick_s)
    if evals > QUICK_EVALS:  # from the target found (one try, unless the fuller plan's arena overflows), or anew
        fuller_target, fuller, _ = fit_at(target if hint else start_bytes, evals)
        if fuller is not None and (hint is None or predicted_cost(p, fuller) <= predicted_cost(p, hint)):
            target, hint = fuller_target, fuller
            if first_s is None:  # the quick heuristic fitted nothing: this is the first valid plan
                first(target, hint)
        evals = fit_evals(options.time_limit_s, charged_s(work), quick_s)
        if hint is not None and evals > QUICK_EVALS and cost(p, hint) > COSTLY_CAP * uncapped_cost(
                p, options.streams, slack, work):
            other_target, other, _ = fit_at(target, evals, largest_first=True, steps=SECOND_ORDER_STEPS)
            if other is not None and predicted_cost(p, other) < predicted_cost(p, hint):
                target, hint = other_target, other
    deeper = (deep_fit(graph, p, cap_bytes, target, options.streams, hint, slack, fits, work) if hint is not None
              else None)
    if deeper is not None:  # the bounds stay those of the shallow problem: a deep recomputation only adds work
        target, p, hint = deeper
        if p1 is not shallow:  # the serial form (`done`) runs the same recomputations
            p1 = with_deep(p1, deep_tensors(p, shallow))
    try:
        plan = final(target, hint)
    except CapTooSmall as e:
        raise with_arena(e, graph, shallow, options.streams, overflowed) from None
    if hint is None and not fits(plan):
        need = device_bytes(graph, plan)
        raise CapTooSmall(f"CP-SAT's plan peaks under the cap {fmt_bytes(cap_bytes)} but its arena needs "
                          f"{fmt_bytes(need)}; try a larger cap", need)
    if target < cap_bytes:
        plan.totals.status += f"; solved under {fmt_bytes(target)} so that the runner's arena fits the cap"
    plan.totals.mem_cap_bytes = cap_bytes
    return done(plan)


def uncapped_cost(p: Problem, streams: int, slack: float, work: Work) -> float:
    """The list schedule's cost without a cap. Where the cap costs more than COSTLY_CAP of it, the decisions
    (keep, offload, recompute) are most of the plan, and their local search, one tensor at a time, ends where its
    order leads it: ResNet-50 training b32 at 30% of its serial peak on the H200 profile, 9958 us as the tensors
    are made, 8881 largest first; elsewhere the first order wins. Such a plan takes the better of the two
    (docs/BENCHMARKS.md, fifty-seventh session)."""
    return cost(p, list_schedule(p, float("inf"), streams, {}, slack, work).schedule)


def fit_evals(limit_s: float, charged: float, quick_s: float) -> int:
    """fit_cap's budget for the plan the search starts from: FIT_EVALS, or, when the time limit leaves too little
    for them, the evaluations that take FIT_SHARE of what it leaves, priced at what one try of the first plan's
    QUICK_EVALS cost (`quick_s`, charged seconds; the first plan may step the cap down several times for the
    arena, the fuller one starts where it ended). GoogLeNet training b32 at 50% charges 1.3 s for those and
    17.8 s for FIT_EVALS: a limit of 8 s would otherwise end about 25 s late. A limit of 0 (the heuristic's plan
    alone) takes FIT_EVALS."""
    if limit_s <= 0 or quick_s <= 0:
        return FIT_EVALS
    return min(FIT_EVALS, int(FIT_SHARE * max(0.0, limit_s - charged) * QUICK_EVALS / quick_s))


def _solve_under(graph: Graph, p: Problem, cap_bytes: int, base_us: float, base_peak: int, bounds: dict[str, float],
                 options: Options, on_progress, hint: Schedule | None, fits: Callable[[Plan], bool] = lambda plan: True,
                 own_bound: bool = True, deadline: float = float("inf")) -> Plan:
    """The best schedule `_search` finds from the heuristic hint under `cap_bytes` whose plan `fits`, as a plan,
    reporting `bounds` and, with `own_bound`, CP-SAT's (which holds only under the user's cap, not under a lower
    target). The search ends by the wall clock's `deadline`, less the time the plan's checks take."""
    horizon = hint.makespan(p) if hint else loose_horizon(p)
    bounds = dict(bounds)
    tick = p.tick_us
    ratio, untimed = p.bound_scale()

    def real_bound_us(bound_ticks: int) -> float:
        """CP-SAT's bound, of times rounded to ticks, in real time (Problem.bound_scale)."""
        return max(0, bound_ticks - untimed) * tick * ratio

    def progress(makespan_ticks: int, bound_ticks: int, elapsed_s: float) -> None:
        """The search's makespans price ops alone, so its progress leaves out the bound that does not."""
        if on_progress:
            alone = [v for name, v in bounds.items() if name != "co_running"]
            bound_us = real_bound_us(bound_ticks) if own_bound else 0.0
            on_progress(makespan_ticks * tick, max(bound_us, *alone), elapsed_s)

    if options.time_limit_s <= 0:  # the heuristic alone: no OR-Tools needed
        if hint is None:
            need = memory_lower_bound(p)[0]
            raise CapTooSmall(f"the heuristic found no schedule under the cap {fmt_bytes(cap_bytes)}; give CP-SAT "
                              f"a time limit to search further or compute the minimum (no schedule needs less "
                              f"than {fmt_bytes(need)})", need, floor_bytes=need)
        found = [(hint, "heuristic (CP-SAT not run: time limit 0)", False)]
    else:
        fits_schedule = lambda s: fits(plan_of(graph, p, s, cap_bytes, options.streams))  # noqa: E731
        deadline -= final_checks_s(p)
        found, solver_bound_ticks, wall_ended = _search(p, cap_bytes, horizon, hint, options, progress,
                                                        fits_schedule, deadline)
        if own_bound and solver_bound_ticks > 0:
            bounds["solver"] = real_bound_us(solver_bound_ticks)
        if wall_ended or time.monotonic() >= deadline:
            when = (f"at {RUNAWAY:g} times the time limit (CP-SAT overran its deterministic limit)"
                    if options.deterministic else "at the time limit (this machine ran slower than the budget counts)")
            found = [(s, f"{how}; the wall clock ended the search {when}: the plan may differ between runs", refined)
                     for s, how, refined in found]
    settled = p.co_running > 0 and options.streams > 1
    fitting: list[Plan] = []
    for k, (schedule, status, refined) in enumerate(found):  # the runner's arena must fit too: the best that does
        if k and not fitting:
            status += " (the better schedules' arenas overflow the cap)"
        totals = Totals(makespan_us=0.0, peak_bytes=0, mem_cap_bytes=cap_bytes, lower_bound_us=max(bounds.values()),
                        bounds_us=bounds, solver_makespan_us=schedule.makespan(p) * tick,
                        baseline_makespan_us=base_us,
                        baseline_peak_bytes=base_peak, status=status, gap=0.0, solve_time_s=0.0)
        plan = build_plan(graph, replace(p, simplifications=p.simplifications + [REFINED] * refined), schedule,
                          totals, options.streams)
        if fits(plan):
            fitting.append(plan)
            if not settled:
                break
    return least_settled(fitting) if fitting else plan


def least_settled(plans: list[Plan]) -> Plan:
    """Of the fitting plans, best at times alone first, the one predicted fastest once each op is slowed by what
    runs beside it (planner.co_running): the search ranks schedules at times alone, and a tighter packing loses
    more to co-running. H200, Inception v3 training b32: the refined plan ran 9742.4 us, the heuristic's 9460.0;
    settled at the fitted k 1.34 they are 9684.5 and 9436.9 (docs/BENCHMARKS.md, fifty-second session)."""
    best = min(plans, key=lambda plan: plan.totals.predicted_us)
    if best is not plans[0]:
        best.totals.status += (f" (kept over the better schedule at times alone, predicted "
                               f"{plans[0].totals.predicted_us:.1f} us once co-running is priced)")
    return best


def _search(p: Problem, cap_bytes: int, horizon: int, hint: Schedule | None, options: Options,
            progress: Callable[[int, int, float], None], fits: Callable[[Schedule], bool],
            deadline: float = float("inf")) -> tuple[list[tuple[Schedule, str, bool]], int, bool]:
    """(the schedules found, best first, each with how and whether windows refined it; CP-SAT's bound in ticks;
    whether the wall clock ended the windows before their budget, which they stop short of `deadline`).
    A problem of at most WHOLE_MODEL_OPS ops goes to CP-SAT whole first (GoogLeNet and ResNet-50 inference:
    proven optimal within a second) for WHOLE_MODEL_SHARE of the time limit, then, unless proven optimal, to
    `refine` for the rest. A larger one is only refined: training graphs of 565-636 ops, CP-SAT on the whole
    model found nothing better than the list schedule in 60 s, nor better than the windows in what they left of
    120 s (at 50%: GoogLeNet 12 s, status UNKNOWN; ResNet-50 about 40 s, the same plan without it), while
    windows gain 5-9% in 30-90 s. The time limit is in seconds of the 2-core development machine: CP-SAT gets
    1 / CPSAT_WALL_PER_DET of them as deterministic time; neither it nor the windows run past the wall clock's
    `deadline`."""
    from planner import cpsat  # OR-Tools only where CP-SAT runs: baseline and heuristic plans work without it
    from planner.refine import LANES, refine

    found = [(hint, "heuristic", False)] if hint is not None else []
    bound, elapsed, wall_ended = 0, 0.0, False

    def whole(limit_s: float) -> str:
        nonlocal bound
        start = found[0][0] if found else None
        result = cpsat.solve(p, cap_bytes, options.streams, horizon, limit_s, options.workers, options.seed, start,
                             lambda ms, at_bound, at: progress(ms, at_bound, elapsed + at),
                             max_wall_s=deadline - time.monotonic(), wall_cap=not options.deterministic)
        bound = result.bound_ticks
        if result.schedule is not None and (start is None
                                            or predicted_cost(p, result.schedule) < predicted_cost(p, start)):
            if start is None or found[0][1] == "heuristic":
                found.insert(0, (result.schedule, result.status, False))
            else:
                found.insert(0, (result.schedule, f"{found[0][1]}, then {result.status}", found[0][2]))
        elif not found:
            raise cap_too_small(p, cap_bytes, options, result.status, deadline)
        else:
            found[0] = (start, f"{found[0][1]} (CP-SAT: {result.status})", found[0][2])
        return result.status

    def windows(budget_s: float) -> None:
        nonlocal wall_ended
        start, how, _ = found[0]
        out, _, wall_ended = refine(p, cap_bytes, options.streams, start, budget_s, options.seed,
                                    lambda ms, at: progress(ms, 0, elapsed + at), fits,
                                    min(options.workers, LANES), len(p.ops) * LAYOUT_S_PER_OP, deadline)
        if predicted_cost(p, out) < predicted_cost(p, start):
            found.insert(0, (out, f"{how}; refined window by window from {start.makespan(p) * p.tick_us:.1f} us",
                             True))

    limit = options.time_limit_s
    if len(p.ops) <= WHOLE_MODEL_OPS or hint is None:
        whole_s = limit * WHOLE_MODEL_SHARE
        if whole(whole_s / CPSAT_WALL_PER_DET) != "OPTIMAL":
            elapsed = whole_s
            windows(limit - whole_s)
    else:
        windows(limit)
    return found, bound, wall_ended
