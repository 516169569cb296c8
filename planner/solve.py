"""Graph + Profile + memory cap -> Plan: the `planner solve` stage.

Order of work: the problem; the framework-style baseline; a memory lower bound (exit 3 below it); the greedy
serial schedule under the cap (hint and fallback); CP-SAT; the better schedule becomes the plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Literal, Sequence

from planner import serialize
from planner.files import PlannerError
from planner.bounds import lower_bounds_us, memory_lower_bound
from planner.fuse import concat_view_candidates, concat_view_nodes, with_concat_views
from planner.memsize import fmt_bytes
from planner.decisions import fit_cap
from planner.heuristic import Work, baseline, cost, list_schedule
from planner.ir import Graph
from planner.plan import Plan, Totals
from planner.problem import Problem, build_problem
from planner.profile import Profile
from planner.schedule import Schedule, peak_memory, timed
from planner.streams import build_plan

EXIT_CAP_TOO_SMALL = 3
LIST_SLACKS = (1.0, 1.1, 1.3, 1.5, 1.7, 2.0, 2.5, 3.0, float("inf"))  # how much slower an alternative the list
# scheduler may take: a slower one that leaves SMs to a neighbour can shorten the whole (GoogLeNet training b32:
# 5447 us at 1.0, 4858 us at 2.0)
COPY_MARGINS = (1.0, 1.2)  # the heuristic also chooses its offloads with copies priced 20% slower (see best_heuristic)
PLACEMENT_MARGIN = 0.002  # a binding cap: the search starts this share of the arena's room below it (solver_cap)
ARENA_STEP = 0.01  # ... and is lowered in steps of 1% of the room above resident bytes
ARENA_STEPS = 30  # ... until the runner's arena fits the user's cap
REFINED = ("CP-SAT on windows of the timeline (planner.refine; on the whole model first up to 200 ops): each window's "
           "ops free, the keep/offload/recompute decisions fixed")
WHOLE_MODEL_OPS = 200  # problems up to this size go to CP-SAT whole first (`_search`)
WHOLE_MODEL_SHARE = 0.25  # ... for this share of the time limit
QUICK_EVALS = 40  # fit_cap's budget for the first valid plan (its starts, no one-decision improvements)
FIT_EVALS = 400  # ... and for the plan CP-SAT starts from
FIT_SHARE = 0.25  # under a time limit, that second fit_cap may take this share of what the limit leaves
# The heuristic's work (heuristic.Work) in seconds of the 2-core development machine, measured on GoogLeNet and
# ResNet-50 training b32 (refitted in the nineteenth session, jobs and setups again in the thirty-sixth: 22-30 us
# and 0.11-0.22 ms, the most taken; docs/BENCHMARKS.md):
LIST_S_PER_JOB = 30e-6  # a job list-scheduled (with the rest of the heuristic's Python around it)
LAYOUT_S_PER_OP = 2.3e-4  # an op of a plan built and laid out until a placement order fits the cap (fits_device)
PLACE_S_PER_OP = 8e-5  # an op of a plan placed again in a round past the orders (arena.placements; 0.05 s a round
# on GoogLeNet training b32's 636 ops)
SETUP_S_PER_OP = 2e-4  # an op of a problem built
BOUND_S_PER_OP = 3.5e-3  # an op of a problem bounded (lower_bounds_us under a cap, chain_fill's LPs included)
CPSAT_WALL_PER_DET = 7.5  # wall seconds per deterministic second of CP-SAT on a whole model (`_search`)
RUNAWAY = 3.0  # --deterministic: only the wall clock at this many times the limit ends the search. CP-SAT on a
# whole training graph can overrun its deterministic limit tenfold (GoogLeNet training b32 under 270 MB, where the
# heuristic found no schedule: 0.77 deterministic s spent 7.29 in 64 s of wall; a 30-s solve took 6 minutes)
MIN_SEARCH_SHARE = 0.1  # the search gets at least this share of the time limit, whatever the heuristic took
LEANEST_TOLERANCE = 0.01  # _leanest bisects the cap to within this share of the peak it found
FINAL_LAYOUTS = 6  # arena layouts the search leaves time for before the wall-clock deadline (the plan's checks)


def device_bytes(graph: Graph, plan: Plan) -> int:
    """What the runner will allocate for the plan (arena plus persistent tensors)."""
    from runner.arena import device_bytes as arena_device_bytes  # pure Python; runner is imported lazily

    return arena_device_bytes(graph, plan)


def serial_device_bytes(graph: Graph, profile: Profile) -> int:
    """What the runner allocates for the framework-style serial plan: its peak laid out in the driver's pages,
    the least cap it runs under (ResNet-50 inference b32: 160.00 MiB at a 158.95-MiB peak)."""
    return device_bytes(graph, solve_plan(graph, profile, profile.device.memory_bytes, Options(baseline=True)))


def fits_device(graph: Graph, plan: Plan, cap_bytes: int, work: Work | None = None) -> bool:
    """device_bytes(graph, plan) <= cap_bytes, sooner; `work` counts the placements past the arena's orders."""
    from runner.arena import PLACEMENT_ORDERS, placements_to_fit

    fits, tried = placements_to_fit(graph, plan, cap_bytes)
    if work is not None:
        work.placed += len(plan.ops) * max(0, tried - len(PLACEMENT_ORDERS))
    return fits


class CapTooSmall(PlannerError):
    """No schedule fits the cap; `minimum_bytes` is the smallest cap that does (or a proven lower bound), and no
    schedule needs less than `floor_bytes`."""

    exit_code = EXIT_CAP_TOO_SMALL

    def __init__(self, message: str, minimum_bytes: int, schedule: Schedule | None = None, floor_bytes: int = 0,
                 verdict: str = "", note: str = "", found: list[tuple[Schedule, int]] | None = None):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.schedule = schedule  # one that peaks at minimum_bytes, where one was found
        self.floor_bytes = floor_bytes
        self.verdict, self.note = verdict, note  # the message's parts before and after the answer (_answer)
        self.found = found or []  # every schedule the search for the least peak found, with its peak


@dataclass
class Options:
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
    deterministic: bool = False  # the time limit counts work alone: the wall clock ends the search only at RUNAWAY


def solve_plan(graph: Graph, profile: Profile, cap_bytes: int, options: Options = Options(),
               on_progress: Callable[[float, float, float], None] | None = None,
               on_plan: Callable[[Plan], None] | None = None) -> Plan:
    """The plan of one graph under one cap. Where concats can be views (fuse.concat_view_candidates) and the
    profile measured their producers writing strided, `concat` "auto" list-schedules the graph without a cap
    with every such concat a view and with none, and solves the faster way with the whole time limit (copied
    if no plan with views fits): a strided conv is slower (on H100 most cuDNN engines wrap it in slice copies)
    but runs beside its sibling branches, while the copy it saves sits on the critical path. Solving both ways
    with half the time each gave GoogLeNet training at 50% 4556.4 us where views alone gave 4509.0 in 120 s;
    the uncapped list schedules ranked the ways as the solved plans did on every shipped GoogLeNet plan. "view"
    forces views, "copy" (and the framework-style baseline) never makes them. `on_plan` gets the first valid
    plan (the quick heuristic's, within seconds) while the search goes on. The time limit covers the whole solve:
    the search gets what the work before it leaves (`charged_s`), and `solve_time_s` is the whole solve's. The
    budget counts work, so that plans repeat; the wall clock at the limit ends the search all the same, unless
    `deterministic`: then the same plan comes on any machine, past the limit where the machine is slower than the
    budget counts (up to RUNAWAY times the limit, where the status says the plan may differ)."""
    t0, work = time.monotonic(), Work()
    plan = _solve_concats(graph, profile, cap_bytes, options, on_progress, on_plan, work, t0)
    plan.totals.solve_time_s = time.monotonic() - t0
    return plan


def _solve_concats(graph: Graph, profile: Profile, cap_bytes: int, options: Options, on_progress, on_plan,
                   work: Work, t0: float) -> Plan:
    """`solve_plan` with its concats as views or copied (see there)."""
    views = [] if options.concat == "copy" or options.baseline else concat_view_candidates(graph)
    if options.concat == "auto" and not all(n.signature in profile.ops for n in concat_view_nodes(graph)):
        views = []
    solve = lambda g, prof, hand_on=on_plan: _solve_graph(  # noqa: E731
        g, prof, cap_bytes, options, on_progress, hand_on, work, t0)
    if not views:
        return solve(graph, profile)
    if profile.graph_sha256 not in (None, graph.graph_sha256):
        raise PlannerError("the profile was assembled for another graph (model, batch, dtype or mode differ)")
    viewed_graph, viewed_profile = with_concat_views(graph, views), profile.model_copy(update={"graph_sha256": None})
    why = ""
    if options.concat == "auto":
        list_us = [_list_schedule_us(g, prof, options, work)
                   for g, prof in ((viewed_graph, viewed_profile), (graph, profile))]
        why = f" (uncapped list schedules: as views {list_us[0]:.1f} us, copied {list_us[1]:.1f} us)"
        if list_us[1] <= list_us[0]:
            plan = solve(graph, profile)
            plan.totals.status += f"; {len(views)} concats copied{why}"
            return plan
    one_stream = _problem(graph, profile, options, work, streams=1)
    serial, serial_us, serial_peak = _baseline(one_stream)

    def on_model(plan: Plan) -> Plan:  # the viewed graph's plan, for the model as given (its concats as views)
        return plan.model_copy(update={"graph_sha256": graph.graph_sha256, "concat_views": views})

    charged_before = charged_s(work)
    try:
        plan = solve(viewed_graph, viewed_profile, (lambda first: on_plan(on_model(first))) if on_plan else None)
    except CapTooSmall as as_views:
        if options.concat == "view":
            raise
        setup_s = charged_s(work) - charged_before  # the copied way's work before its search is about as much
        left_s = options.time_limit_s - (charged_s(work) if options.deterministic else time.monotonic() - t0)
        if options.time_limit_s > 0 and left_s < setup_s + options.time_limit_s * MIN_SEARCH_SHARE:
            raise _copied_unsearched(as_views, _problem(graph, profile, options, work)) from None
        try:
            plan = solve(graph, profile)
        except CapTooSmall as copied:
            raise _either(as_views, copied) from None
        plan.totals.status += f"; {len(views)} concats copied (as views no plan fits){why}"
        return plan
    plan = on_model(plan)
    plan.totals.status += f"; {len(views)} concats as views{why}"
    if options.streams > 1:  # the framework's serial plan copies its concats
        serial_plan = _fitting_serial(graph, one_stream, serial, serial_peak, cap_bytes,
                                      lambda serial_plan: fits_device(graph, serial_plan, cap_bytes))
        plan = _offer_serial(plan, serial_plan) if serial_plan else plan
    return _framework_baseline(plan, (serial_us, serial_peak))


def _either(as_views: CapTooSmall, copied: CapTooSmall) -> CapTooSmall:
    """The lesser cap shown to work of the two ways (solving at it takes the views first), or the lesser floor
    where neither found one, saying where the other way's floor is lower still."""
    found = [e for e in (as_views, copied) if e.schedule is not None] or [as_views, copied]
    best = min(found, key=lambda e: e.minimum_bytes)
    other = copied if best is as_views else as_views
    if not 0 < other.floor_bytes < best.floor_bytes:
        return best
    way = "copied" if other is copied else "as views"
    return CapTooSmall(f"{best}; with the concats {way} none below {fmt_bytes(other.floor_bytes)} can",
                       best.minimum_bytes, best.schedule, other.floor_bytes)


def _copied_unsearched(as_views: CapTooSmall, copied: Problem) -> CapTooSmall:
    """The views' answer where the time limit leaves the copied way no search, with what its floor allows."""
    floor = memory_lower_bound(copied)[0]
    if floor >= as_views.minimum_bytes:  # copied, no schedule needs less than the views' answer
        return as_views
    lower = f" (none of theirs needs less than {fmt_bytes(floor)})" if floor < as_views.floor_bytes else ""
    return CapTooSmall(f"{as_views}; the concats copied were not searched in the time limit{lower}",
                       as_views.minimum_bytes, as_views.schedule, min(floor, as_views.floor_bytes))


def _list_schedule_us(graph: Graph, profile: Profile, options: Options, work: Work) -> float:
    """The shortest list schedule without a cap over LIST_SLACKS: a quick ranking of concats as views or copied."""
    p = _problem(graph, profile, options, work)
    return min(list_schedule(p, float("inf"), options.streams, {}, slack, work).makespan
               for slack in LIST_SLACKS) * p.tick_us


def charged_s(work: Work) -> float:
    """The seconds the heuristic's work takes on the development machine, by its counts: what the time limit
    charges for it, the same on every run (a wall clock would make plans depend on the machine's load)."""
    return (work.jobs * LIST_S_PER_JOB + work.layouts * LAYOUT_S_PER_OP + work.placed * PLACE_S_PER_OP
            + work.setups * SETUP_S_PER_OP
            + work.bounded * BOUND_S_PER_OP)


def final_checks_s(p: Problem) -> float:
    """The seconds the plan's checks after the search take (FINAL_LAYOUTS arena layouts): the search's budget and
    its wall-clock deadline both leave them."""
    return FINAL_LAYOUTS * len(p.ops) * LAYOUT_S_PER_OP


def _problem(graph: Graph, profile: Profile, options: Options, work: Work, streams: int | None = None) -> Problem:
    """The graph's Problem under the options (for plans on `streams`, default the options'), its setup counted in
    `work`."""
    p = build_problem(graph, profile, options.max_alternatives, options.offload, options.recompute, options.dram,
                      streams or options.streams)
    work.setups += len(p.ops)
    return p


def _baseline(p: Problem) -> tuple[Schedule, float, int]:
    """The framework-style schedule (serial, fastest algorithm, everything kept), its makespan and peak bytes."""
    base = baseline(p)
    return (base, sum(o.alternatives[a].time_us for o, a in zip(p.ops, base.alt)),
            peak_memory(p, base.decision, timed(p, base))[0])


def _framework_baseline(plan: Plan, copying: tuple[float, int]) -> Plan:
    """The plan, its baseline (makespan, peak bytes) that of the graph whose concats copy (`_baseline`): a
    framework's serial run copies them, so that is what the speed-up and the serial peak compare against."""
    plan.totals.baseline_makespan_us, plan.totals.baseline_peak_bytes = copying
    return plan


def _solve_graph(graph: Graph, profile: Profile, cap_bytes: int, options: Options,
                 on_progress: Callable[[float, float, float], None] | None,
                 on_plan: Callable[[Plan], None] | None, work: Work, t0: float) -> Plan:
    p = _problem(graph, profile, options, work)
    p1 = p if options.streams == 1 else _problem(graph, profile, options, work, streams=1)  # priced on one stream
    base, base_us, base_peak = _baseline(p1)
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
    serial_plan = _fitting_serial(graph, p1, base, base_peak, cap_bytes, fits) if p1 is not p else None
    offer_serial_form = p1 is not p and serial_plan is None
    work.bounded += len(p.ops) * offer_serial_form
    slack = fit_slack(p, options.streams, work)
    refined = options.time_limit_s > 0  # the search follows the heuristic (decisions.recompute_over_offload)
    first_s = None
    if on_progress and p1 is not p and not offer_serial_form:  # the serial plan is offered at the end (done)
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
            bounds.update(lower_bounds_us(p, options.streams, cap_bytes))
        plan = _solve_under(graph, p, target, base_us, base_peak, bounds, replace(options, time_limit_s=search_s),
                            on_progress, hint, fits, own_bound=target == cap_bytes,
                            deadline=t0 + RUNAWAY * limit if options.deterministic
                            else t0 + limit - offer_serial_form * len(p.ops) * BOUND_S_PER_OP)
        if limit > 0:
            plan.totals.status += (f"; the search had {search_s:.1f} s of the {limit:g} s limit, the heuristic's "
                                   f"work {charged:.1f} s")
        return plan

    def done(plan: Plan) -> Plan:
        if p1 is not p:
            plan = (_offer_serial_form(plan, graph, p1, cap_bytes, fits) if offer_serial_form
                    else _offer_serial(plan, serial_plan))
        plan.totals.first_plan_s = first_s if first_s is not None else time.monotonic() - t0
        return plan

    if base_peak <= cap_bytes:  # the peak does not bind; the arena, in driver pages, may still
        hint = best_heuristic(p, cap_bytes, options.streams, slack, work=work, refined=refined)
        if hint is not None and fits(first(cap_bytes, hint)):
            return done(final(cap_bytes, hint))

    overflowed: list[tuple[Schedule, int]] = []  # heuristic schedules whose arenas passed the cap, with peaks

    def arena_fit(start_bytes: int, max_evals: int) -> tuple[int, Schedule | None, int]:
        return _arena_fit(graph, p, cap_bytes, start_bytes, options.streams, slack, max_evals, fits, work, refined,
                          overflowed)

    before_s, start_bytes = charged_s(work), solver_cap(graph, p.resident_bytes, cap_bytes)
    target, hint, tries = arena_fit(start_bytes, QUICK_EVALS)
    if hint is not None:
        first(target, hint)
    charged = charged_s(work)
    evals = fit_evals(options.time_limit_s, charged, (charged - before_s) / tries)
    if evals > QUICK_EVALS:  # from the target found (one try, unless the fuller plan's arena overflows), or anew
        fuller_target, fuller, _ = arena_fit(target if hint else start_bytes, evals)
        if fuller is not None and (hint is None or cost(p, fuller) <= cost(p, hint)):
            target, hint = fuller_target, fuller
            if first_s is None:  # the quick heuristic fitted nothing: this is the first valid plan
                first(target, hint)
    try:
        plan = final(target, hint)
    except CapTooSmall as e:
        raise _with_arena(e, graph, p, options.streams, overflowed) from None
    if hint is None and not fits(plan):
        need = device_bytes(graph, plan)
        raise CapTooSmall(f"CP-SAT's plan peaks under the cap {fmt_bytes(cap_bytes)} but its arena needs "
                          f"{fmt_bytes(need)}; try a larger cap", need)
    if target < cap_bytes:
        plan.totals.status += f"; solved under {fmt_bytes(target)} so that the runner's arena fits the cap"
    plan.totals.mem_cap_bytes = cap_bytes
    return done(plan)


def _with_arena(e: CapTooSmall, graph: Graph, p: Problem, streams: int,
                overflowed: Sequence[tuple[Schedule, int]] = ()) -> CapTooSmall:
    """The error with the cap the runner needs: the least arena among the schedules found (the arena lays a peak
    out with gaps, more for some schedules than others: GoogLeNet training b32, the leanest peak found, 207.52 MiB,
    needs 238.00 MiB, one peaking at 210.02 MiB 216.00), the search for the least peak's and those whose arenas
    passed the cap (`overflowed`: ResNet-50 training b32 under 395 MiB, the least peak's search named 430 MiB,
    one of those, peaking at 391.59 MiB, 408; a plan solves there)."""
    if e.schedule is None and not (overflowed and e.verdict):
        return e
    need = schedule = peak = None
    found_before = e.found or ([(e.schedule, e.minimum_bytes)] if e.schedule is not None else [])
    for found, found_peak in sorted([*found_before, *overflowed], key=lambda f: f[1]):
        if need is not None and found_peak >= need:
            break  # no arena is smaller than its peak
        found_need = device_bytes(graph, _plan_of(graph, p, found, found_peak, streams))
        if need is None or found_need < need:
            need, schedule, peak = found_need, found, found_peak
    if schedule is e.schedule and need <= e.minimum_bytes:
        return e
    return CapTooSmall(f"{e.verdict}; {_answer(need, e.floor_bytes, peak)}{e.note}", need, schedule, e.floor_bytes,
                       e.verdict, e.note)


def _answer(works_bytes: int, floor_bytes: int, peak_bytes: int = 0) -> str:
    """What exit 3 says works, as the cap to pass to --mem: where the runner's arena needs more than the schedule's
    peak (`peak_bytes`), the arena's."""
    if works_bytes == floor_bytes:
        return f"minimum cap: {works_bytes} bytes ({fmt_bytes(works_bytes)})"
    laid_out = (f" (its schedule peaks at {fmt_bytes(peak_bytes)}, which the runner's arena lays out in that)"
                if peak_bytes else "")
    return (f"a cap of {works_bytes} bytes ({fmt_bytes(works_bytes)}) works{laid_out}; "
            f"none below {fmt_bytes(floor_bytes)} can")


def _fitting_serial(graph: Graph, p1: Problem, serial: Schedule, serial_peak: int, cap_bytes: int,
                    fits: Callable[[Plan], bool]) -> Plan | None:
    """The serial schedule of the one-stream problem `p1` as a plan; None where its peak or its arena passes the
    cap."""
    if serial_peak <= cap_bytes and fits(serial_plan := _plan_of(graph, p1, serial, cap_bytes, 1)):
        return serial_plan
    return None


def _offer_serial(plan: Plan, serial_plan: Plan) -> Plan:
    """`_serial_or` with the framework-style serial plan (`_fitting_serial`), its makespan the one-stream bound."""
    return _serial_or(plan, serial_plan, serial_plan.totals.makespan_us, "serial (one stream, every tensor kept)")


def _offer_serial_form(plan: Plan, graph: Graph, p1: Problem, cap_bytes: int, fits: Callable[[Plan], bool]) -> Plan:
    """`_serial_or` with the plan's serial form (planner.serialize) on the one-stream problem `p1`, where it fits
    the cap, and the bound on every one-stream plan under the cap."""
    schedule = serialize.serial_form(p1, plan, cap_bytes)
    if schedule is not None and fits(serial_plan := _plan_of(graph, p1, schedule, cap_bytes, 1)):
        return _serial_or(plan, serial_plan, max(lower_bounds_us(p1, 1, cap_bytes).values()),
                          "the plan's serial form (one stream, its items in the order they start, each op on its "
                          "fastest algorithm that fits)")
    return plan


def _serial_or(plan: Plan, serial: Plan, one_stream_bound_us: float, what: str) -> Plan:
    """The plan, or the serial plan `what` (which fits the cap) where that is predicted faster; the lower bound
    then covers both: the lesser of the plan's and `one_stream_bound_us`, no one-stream plan's makespan being
    less. On several streams every op pays the calibrated dispatch time, which stands in for the slowdown of ops
    run side by side; on one stream nothing runs beside it (H100 training b32, measured: ResNet-50 serial 7.09 ms
    against 7.27 ms on four streams, predicted 7517.9 against 7712.3 us; at 50% of its serial peak the serial
    form 7.78 ms against 7.86, predicted 8129.2 against 8444.5; docs/BENCHMARKS.md)."""
    several_us = plan.totals.lower_bound_us
    if serial.totals.predicted_us < plan.totals.predicted_us:
        why = (f"{what}: predicted {serial.totals.predicted_us:.1f} us against "
               f"{plan.totals.predicted_us:.1f} us on {plan.compute_streams} streams (priced with "
               f"{plan.totals.dispatch_us:g} us per op for running side by side)")
        kept = plan.totals.model_dump(include={"mem_cap_bytes", "bounds_us", "baseline_makespan_us",
                                               "baseline_peak_bytes"})
        plan = serial.model_copy(update={"totals": serial.totals.model_copy(update={
            **kept, "status": f"{why}; {plan.totals.status}"})})
    totals = plan.totals
    # where the viewed and the copied graph both offered a serial plan, the lesser of their bounds
    one_stream_us = min(totals.bounds_us.get("one_stream", math.inf), one_stream_bound_us)
    totals.bounds_us = {**totals.bounds_us, "one_stream": one_stream_us}
    totals.lower_bound_us = min(several_us, one_stream_us)
    totals.gap = totals.gap_to_bound()
    return plan


def solver_cap(graph: Graph, resident_bytes: int, cap_bytes: int) -> int:
    """The cap a binding search starts under. No peak above the resident bytes plus the arena's room (the cap
    in whole driver pages, less the persistent tensors) fits the runner's arena, and the windows pack the peak
    up to the solver's cap, where placement adds its gaps: PLACEMENT_MARGIN of the room is left for them.
    GoogLeNet training b32 at 50%: refined under the cap itself, a schedule whose peak fits overflows the arena
    by 32 KiB (peak 284.31 MB, best placement 284.53, room 284.50) and the search falls back to the last that
    fits (120 s: 4234.7 us; from this cap, 4189.1)."""
    from runner.arena import arena_room_bytes  # pure Python; runner is imported lazily

    room = arena_room_bytes(graph, cap_bytes)
    return min(cap_bytes, resident_bytes + room - int(PLACEMENT_MARGIN * room))


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


def _arena_fit(graph: Graph, p: Problem, cap_bytes: int, start_bytes: int, streams: int, slack: float,
               max_evals: int, fits: Callable[[Plan], bool], work: Work, refined: bool,
               overflowed: list[tuple[Schedule, int]] | None = None) -> tuple[int, Schedule | None, int]:
    """(solver cap, schedule, caps tried): the largest solver cap, stepping down from `start_bytes`, whose
    heuristic plan (fit_cap with `max_evals`) the runner can lay out within the user's cap: placement leaves gaps
    (3-5% over the peak on capped training plans, more as offloads multiply), so a plan whose peak meets the cap
    exactly may not fit as an arena. The gap is not monotone in the cap (GoogLeNet training at 50%: a plan 4%
    below fits, 5-14% below do not), hence small steps."""
    room = cap_bytes - p.resident_bytes
    for k in range(ARENA_STEPS):
        target = start_bytes - int(k * ARENA_STEP * room)
        hint = best_heuristic(p, target, streams, slack, max_evals, work, refined)
        if hint is None:
            return cap_bytes, None, k + 1
        if fits(_plan_of(graph, p, hint, target, streams)):
            return target, hint, k + 1
        if overflowed is not None:
            overflowed.append((hint, peak_memory(p, hint.decision, timed(p, hint))[0]))
    return cap_bytes, None, ARENA_STEPS  # no heuristic plan fits: CP-SAT alone, or the computed minimum cap


def _plan_of(graph: Graph, p: Problem, schedule: Schedule, cap_bytes: int, streams: int) -> Plan:
    totals = Totals(makespan_us=0.0, peak_bytes=0, mem_cap_bytes=cap_bytes, lower_bound_us=0.0,
                    solver_makespan_us=schedule.makespan(p) * p.tick_us, baseline_makespan_us=0.0,
                    status="", gap=0.0, solve_time_s=0.0)
    return build_plan(graph, p, schedule, totals, streams)


def _solve_under(graph: Graph, p: Problem, cap_bytes: int, base_us: float, base_peak: int, bounds: dict[str, float],
                 options: Options, on_progress, hint: Schedule | None, fits: Callable[[Plan], bool] = lambda plan: True,
                 own_bound: bool = True, deadline: float = float("inf")) -> Plan:
    """The best schedule `_search` finds from the heuristic hint under `cap_bytes` whose plan `fits`, as a plan,
    reporting `bounds` and, with `own_bound`, CP-SAT's (which holds only under the user's cap, not under a lower
    target). The search ends by the wall clock's `deadline`, less the time the plan's checks take."""
    horizon = hint.makespan(p) if hint else _loose_horizon(p)
    bounds = dict(bounds)
    tick = p.tick_us

    def progress(makespan_ticks: int, bound_ticks: int, elapsed_s: float) -> None:
        if on_progress:
            on_progress(makespan_ticks * tick, max(bound_ticks * tick if own_bound else 0.0, *bounds.values()),
                        elapsed_s)

    if options.time_limit_s <= 0:  # the heuristic alone: no OR-Tools needed
        if hint is None:
            need = memory_lower_bound(p)[0]
            raise CapTooSmall(f"the heuristic found no schedule under the cap {fmt_bytes(cap_bytes)}; give CP-SAT "
                              f"a time limit to search further or compute the minimum (no schedule needs less "
                              f"than {fmt_bytes(need)})", need, floor_bytes=need)
        found = [(hint, "heuristic (CP-SAT not run: time limit 0)", False)]
    else:
        fits_schedule = lambda s: fits(_plan_of(graph, p, s, cap_bytes, options.streams))  # noqa: E731
        deadline -= final_checks_s(p)
        found, solver_bound_ticks = _search(p, cap_bytes, horizon, hint, options, progress, fits_schedule, deadline)
        if own_bound and solver_bound_ticks > 0:
            bounds["solver"] = solver_bound_ticks * tick
        if time.monotonic() >= deadline:
            when = (f"at {RUNAWAY:g} times the time limit (CP-SAT overran its deterministic limit)"
                    if options.deterministic else "at the time limit (this machine ran slower than the budget counts)")
            found = [(s, f"{how}; the wall clock ended the search {when}: the plan may differ between runs", refined)
                     for s, how, refined in found]
    for k, (schedule, status, refined) in enumerate(found):  # the runner's arena must fit too: the best that does
        if k:
            status += " (the better schedules' arenas overflow the cap)"
        totals = Totals(makespan_us=0.0, peak_bytes=0, mem_cap_bytes=cap_bytes, lower_bound_us=max(bounds.values()),
                        bounds_us=bounds, solver_makespan_us=schedule.makespan(p) * tick,
                        baseline_makespan_us=base_us,
                        baseline_peak_bytes=base_peak, status=status, gap=0.0, solve_time_s=0.0)
        plan = build_plan(graph, replace(p, simplifications=p.simplifications + [REFINED] * refined), schedule,
                          totals, options.streams)
        if fits(plan):
            break
    return plan


def _search(p: Problem, cap_bytes: int, horizon: int, hint: Schedule | None, options: Options,
            progress: Callable[[int, int, float], None], fits: Callable[[Schedule], bool],
            deadline: float = float("inf")) -> tuple[list[tuple[Schedule, str, bool]], int]:
    """(the schedules found, best first, each with how and whether windows refined it; CP-SAT's bound in ticks).
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
    bound, elapsed = 0, 0.0

    def whole(limit_s: float) -> str:
        nonlocal bound
        start = found[0][0] if found else None
        result = cpsat.solve(p, cap_bytes, options.streams, horizon, limit_s, options.workers, options.seed, start,
                             lambda ms, at_bound, at: progress(ms, at_bound, elapsed + at),
                             max_wall_s=deadline - time.monotonic(), wall_cap=not options.deterministic)
        bound = result.bound_ticks
        if result.schedule is not None and (start is None or cost(p, result.schedule) < cost(p, start)):
            if start is None or found[0][1] == "heuristic":
                found.insert(0, (result.schedule, result.status, False))
            else:
                found.insert(0, (result.schedule, f"{found[0][1]}, then {result.status}", found[0][2]))
        elif not found:
            raise _cap_too_small(p, cap_bytes, options, result.status, deadline)
        else:
            found[0] = (start, f"{found[0][1]} (CP-SAT: {result.status})", found[0][2])
        return result.status

    def windows(budget_s: float) -> None:
        start, how, _ = found[0]
        out, _ = refine(p, cap_bytes, options.streams, start, budget_s, options.seed,
                        lambda ms, at: progress(ms, 0, elapsed + at), fits, min(options.workers, LANES),
                        len(p.ops) * LAYOUT_S_PER_OP, deadline)
        if cost(p, out) < cost(p, start):
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
    return found, bound


def fit_slack(p: Problem, streams: int, work: Work | None = None) -> float:
    """The slack of LIST_SLACKS whose list schedule without a cap is shortest: the one decisions.fit_cap searches
    its decisions at (GoogLeNet training b32 at 50%: 5462 us fitted at slack 1.0, 5110 us at 2.0)."""
    return min(LIST_SLACKS, key=lambda slack: (list_schedule(p, float("inf"), streams, {}, slack, work).makespan,
                                               slack))


def best_heuristic(p: Problem, cap_bytes: int, streams: int, slack: float, max_evals: int = FIT_EVALS,
                   work: Work | None = None, refined: bool = False) -> Schedule | None:
    """The keep/offload/recompute decisions decisions.fit_cap finds at `slack`, once for each of COPY_MARGINS,
    list-scheduled at each of LIST_SLACKS: the shortest that fits the cap (checked again on the schedule's own
    residencies), or None. Why the margin: copies run one at a time per direction, so when a plan's offloads
    nearly fill the copy engines, every late copy delays all later ones and the ops waiting for them
    (ResNet-50 training b32 at 50%, measured on H100: the prefetch chain ran 0.2-0.9 ms behind its prediction).
    Decisions chosen with dearer copies offload less (there: 138 MiB instead of 187 MiB, 0.3% shorter predicted)."""
    best = None
    for margin, reserve in [(m, False) for m in COPY_MARGINS] + [(1.0, True)]:
        if reserve and best is not None:
            break
        fitted = fit_cap(with_copy_margin(p, margin), cap_bytes, streams, max_evals, slack, work, refined, reserve)
        if fitted is None:
            continue
        for other in LIST_SLACKS:
            out = list_schedule(p, cap_bytes, streams, fitted.schedule.decision, other, work, fitted.reserve)
            if out.fits and (best is None or cost(p, out.schedule) < cost(p, best.schedule)):
                if peak_memory(p, out.schedule.decision, timed(p, out.schedule))[0] <= cap_bytes:
                    best = out
        if not fitted.schedule.decision:
            break  # the cap does not bind (nothing offloaded or recomputed): the margin changes nothing
    return best.schedule if best else None


def with_copy_margin(p: Problem, margin: float) -> Problem:
    """The problem with every host copy `margin` times longer."""
    if margin == 1.0:
        return p
    return replace(p, tensors=[replace(t, d2h_ticks=math.ceil(t.d2h_ticks * margin),
                                       h2d_ticks=math.ceil(t.h2d_ticks * margin)) for t in p.tensors])


def _loose_horizon(p: Problem) -> int:
    """Every op, copy and recomputation one after another at its slowest: no optimal schedule is longer."""
    total = sum(max(a.duration for a in o.alternatives) for o in p.ops)
    total += sum(t.d2h_ticks + t.h2d_ticks + (t.recompute.duration if t.recompute else 0) for t in p.tensors)
    return total


def _cap_too_small(p: Problem, cap_bytes: int, options: Options, status: str,
                   deadline: float = float("inf")) -> CapTooSmall:
    """CP-SAT found no schedule under the cap: the least peak a schedule was found at (the cap that works) and
    the floor no schedule goes below. The heuristic's leanest schedule (`_leanest`) starts CP-SAT, which then
    minimises the peak for what is left of the time limit (at least MIN_SEARCH_SHARE of it): it proves the
    minimum on small graphs. From the serial schedule instead, on GoogLeNet training b32 it found no schedule at
    all and ran 118 s past a 20-s limit."""
    from planner import cpsat

    floor, least_s = memory_lower_bound(p)[0], options.time_limit_s * MIN_SEARCH_SHARE
    until = math.inf if options.deterministic else max(deadline, time.monotonic() + least_s)
    found = _leanest(p, options.streams, max(floor, cap_bytes), until)
    leanest, works = found[-1]
    wall_s = max(deadline - time.monotonic(), least_s)  # deterministic: the runaway guard alone
    det_s = options.time_limit_s if options.deterministic else min(options.time_limit_s, wall_s)
    r = cpsat.solve(p, max(p.device.memory_bytes, cap_bytes * 4, works), options.streams, _loose_horizon(p),
                    det_s / CPSAT_WALL_PER_DET, options.workers, options.seed,
                    hint=leanest, minimize_memory=True, max_wall_s=wall_s, wall_cap=not options.deterministic)
    if r.schedule is not None:
        found.append((r.schedule, r.peak_bytes))
    if r.status == "OPTIMAL":
        works = floor = r.peak_bytes
        leanest = r.schedule
    else:
        if r.status == "FEASIBLE" and r.peak_bytes < works:
            works, leanest = r.peak_bytes, r.schedule
        floor = max(floor, r.bound_ticks if r.status == "FEASIBLE" else 0)
    verdict = "no schedule fits" if status == "INFEASIBLE" else f"no schedule found in the time limit ({status})"
    verdict += f" under the cap {fmt_bytes(cap_bytes)}"
    note = ""
    if options.deterministic and r.status != "OPTIMAL" and r.wall_s >= wall_s:
        note = (f"; the wall clock ended the search at {RUNAWAY:g} times the time limit (CP-SAT overran its "
                f"deterministic limit): the answer may differ between runs")
    return CapTooSmall(f"{verdict}; {_answer(works, floor)}{note}", works, leanest, floor, verdict, note, found)


def _leanest(p: Problem, streams: int, failed_bytes: int, until: float = math.inf) -> list[tuple[Schedule, int]]:
    """(schedule, its peak bytes) for the serial schedule and every leaner one the heuristic finds, the leanest
    last, bisecting the cap (to LEANEST_TOLERANCE, or until the wall clock reads `until`) between `failed_bytes`,
    where it found none, and the serial schedule's peak. GoogLeNet training b32: 7 caps, 1-2 s each on the
    development machine."""
    serial, _, peak = _baseline(p)
    found, slack, low = [(serial, peak)], fit_slack(p, streams), failed_bytes
    while peak - low > LEANEST_TOLERANCE * peak and time.monotonic() < until:
        mid = (low + peak) // 2
        schedule = best_heuristic(p, mid, streams, slack, QUICK_EVALS)
        if schedule is None:
            low = mid
        else:
            peak = peak_memory(p, schedule.decision, timed(p, schedule))[0]
            found.append((schedule, peak))
    return found
