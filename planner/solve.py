"""Graph + Profile + memory cap -> Plan: the `planner solve` stage.

Order of work: which rewrites the graph is solved with (BatchNormalizations running their ReLUs, ReLU backwards
adding up their gradients, concats as views; fuse.py), then one graph's solve (solve_graph.py): the framework-style
baseline, a memory lower bound (exit 3 below it), the heuristic's schedule under the cap as the runner's arena lays
it out, CP-SAT for what the time limit leaves, and the better schedule as the plan, offered against its serial form.
Where nothing fits, exit 3 names the cap that works (minimum_cap.py).
"""

from __future__ import annotations

import time
from typing import Callable

from planner.arena_fit import device_bytes, fits_device, solver_cap
from planner.bounds import lower_bounds_us
from planner.budget import MIN_SEARCH_SHARE, charged_s
from planner.decisions import LIST_SLACKS, QUICK_EVALS, best_heuristic, fit_slack
from planner.files import PlannerError
from planner.fuse import (bn_relu_candidates, bn_relu_nodes, concat_view_candidates, concat_view_nodes,
                          relu_sum_candidates, relu_sum_nodes, with_bn_relu, with_concat_views, with_relu_sums)
from planner.heuristic import Work, cost, list_schedule, serial_baseline
from planner.ir import Graph
from planner.memory_bounds import memory_lower_bound
from planner.minimum_cap import CapTooSmall, copied_unsearched, either_way
from planner.plan import Plan
from planner.profile import Profile
from planner.serialize import fitting_serial, offer_serial
from planner.solve_graph import COSTLY_CAP, Options, problem_for, solve_graph, uncapped_cost

__all__ = ["CapTooSmall", "Options", "lower_bounds_us", "memory_lower_bound", "serial_device_bytes", "solve_plan"]


def serial_device_bytes(graph: Graph, profile: Profile) -> int:
    """What the runner allocates for the framework-style serial plan: its peak laid out in the driver's pages,
    the least cap it runs under (ResNet-50 inference b32: 160.00 MiB at a 158.95-MiB peak)."""
    return device_bytes(graph, solve_plan(graph, profile, profile.device.memory_bytes, Options(baseline=True)))


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
    budget counts (up to RUNAWAY times the limit, where the status says the plan may differ).

    Before the concats, `bn_relu` "auto" fuses each training BatchNormalization with the ReLU after it (and a
    residual Add between them; fuse.with_bn_relu) where the profile measured the fused ops: they do the same work
    in fewer passes and launches, and leave the solver the same choices. "fused" insists on all, "apart" (and the
    baseline) never fuses."""
    t0, work = time.monotonic(), Work()
    plan = _solve_fused(graph, profile, cap_bytes, options, on_progress, on_plan, work, t0)
    plan.totals.solve_time_s = time.monotonic() - t0
    return plan


def _solve_fused(graph: Graph, profile: Profile, cap_bytes: int, options: Options, on_progress, on_plan,
                 work: Work, t0: float) -> Plan:
    """`solve_plan` with BatchNormalizations and ReLUs fused or not (see there). A framework runs them apart, so
    the baseline stays the unfused graph's."""
    fusing = options.bn_relu != "apart" and not options.baseline
    fused = bn_relu_candidates(graph) if fusing else []
    fused = _measured(fused, bn_relu_nodes(with_bn_relu(graph, fused)), profile, options,
                      lambda n: n.forward_of or n.name)
    bn_graph = with_bn_relu(graph, fused)
    sums = relu_sum_candidates(bn_graph) if fusing else []
    sums = _measured(sums, relu_sum_nodes(with_relu_sums(bn_graph, sums)), profile, options, lambda n: n.name)
    if not fused and not sums:
        return _solve_concats(graph, profile, cap_bytes, options, on_progress, on_plan, work, t0)
    if profile.graph_sha256 not in (None, graph.graph_sha256):
        raise PlannerError("the profile was assembled for another graph (model, batch, dtype or mode differ)")
    profile = profile.model_copy(update={"graph_sha256": None})  # for the fused graph
    fused_graph = with_relu_sums(bn_graph, sums)
    kept_apart = bool(sums) and options.bn_relu == "auto" and _costly_cap(fused_graph, profile, cap_bytes, options,
                                                                            work)
    sums, fused_graph = ([], bn_graph) if kept_apart else (sums, fused_graph)

    def on_model(plan: Plan) -> Plan:
        """The fused graph's plan, for the model as given (in place: the first plan may be the plan,
        `--time-limit 0`)."""
        plan.graph_sha256, plan.bn_relu_fused, plan.relu_sums_fused = graph.graph_sha256, fused, sums
        return plan

    plan = on_model(_solve_concats(fused_graph, profile, cap_bytes, options, on_progress,
                                   (lambda first: on_plan(on_model(first))) if on_plan else None, work, t0))
    plan.totals.status += f"; {len(fused)} BatchNormalizations run their ReLUs" + (
        f", {len(sums)} ReLU backwards add up their gradients" if sums else "") + (
        "; the ReLU backwards leave their gradients' sums apart under this costly cap" if kept_apart else "")
    _, serial_us, serial_peak = serial_baseline(problem_for(graph, profile, options, work, streams=1))
    return _framework_baseline(plan, (serial_us, serial_peak))


def _costly_cap(graph: Graph, profile: Profile, cap_bytes: int, options: Options, work: Work) -> bool:
    """Whether the quick heuristic's plan under the cap list-schedules over COSTLY_CAP times the uncapped one (or
    none fits). There the fused gradient sums are left apart. A ReLU backward that adds up its gradients holds
    them beside the ReLU's output, which, recomputed or offloaded, would otherwise come back after the sum has
    freed them, and under such a cap the decisions' search ends elsewhere after any change to the graph.
    ResNet-50 training b32 at 30% of its serial peak (H200 profile): 8324.7 us predicted with the sums fused,
    7361.4 (measured 7359.2) without, 8180.0 with only those fused whose output that plan keeps. At 50% the cap
    is cheap (1.09 times the uncapped list schedule, against 3.19 at 30%), and the fused sums gain 3.0% (5847.2
    against 6025.0). Charged to `work` (1.3 s of the time limit there)."""
    p = problem_for(graph, profile, options, work)
    slack = fit_slack(p, options.streams, work)
    hint = best_heuristic(p, solver_cap(graph, p.resident_bytes, cap_bytes), options.streams, slack, QUICK_EVALS,
                          work)
    return hint is None or cost(p, hint) > COSTLY_CAP * uncapped_cost(p, options.streams, slack, work)


def _measured(names: list[str], nodes: list, profile: Profile, options: Options, owner) -> list[str]:
    """`names` less those owning (`owner`) one of the fused `nodes` the profile has not measured; `--bn-relu fused`
    insists on all."""
    unmeasured = [n for n in nodes if n.signature not in profile.ops]
    if unmeasured and options.bn_relu == "fused":
        raise PlannerError(f"--bn-relu fused: the profile has not measured {len(unmeasured)} fused ops (first: "
                           f"{unmeasured[0].name}); run `planner profile` for this model on the GPU")
    missing = {owner(n) for n in unmeasured}
    return [name for name in names if name not in missing]


def _solve_concats(graph: Graph, profile: Profile, cap_bytes: int, options: Options, on_progress, on_plan,
                   work: Work, t0: float) -> Plan:
    """`solve_plan` with its concats as views or copied (see there)."""
    views = [] if options.concat == "copy" or options.baseline else concat_view_candidates(graph)
    if options.concat == "auto" and not all(n.signature in profile.ops for n in concat_view_nodes(graph)):
        views = []
    solve = lambda g, prof, hand_on=on_plan: solve_graph(  # noqa: E731
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
    one_stream = problem_for(graph, profile, options, work, streams=1)
    serial, serial_us, serial_peak = serial_baseline(one_stream)

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
            raise copied_unsearched(as_views, problem_for(graph, profile, options, work)) from None
        try:
            plan = solve(graph, profile)
        except CapTooSmall as copied:
            raise either_way(as_views, copied) from None
        plan.totals.status += f"; {len(views)} concats copied (as views no plan fits){why}"
        return plan
    plan = on_model(plan)
    plan.totals.status += f"; {len(views)} concats as views{why}"
    if options.streams > 1:  # the framework's serial plan copies its concats
        serial_plan = fitting_serial(graph, one_stream, serial, serial_peak, cap_bytes,
                                      lambda serial_plan: fits_device(graph, serial_plan, cap_bytes))
        plan = offer_serial(plan, serial_plan) if serial_plan else plan
    return _framework_baseline(plan, (serial_us, serial_peak))


def _list_schedule_us(graph: Graph, profile: Profile, options: Options, work: Work) -> float:
    """The shortest list schedule without a cap over LIST_SLACKS: a quick ranking of concats as views or copied."""
    p = problem_for(graph, profile, options, work)
    return min(list_schedule(p, float("inf"), options.streams, {}, slack, work).makespan
               for slack in LIST_SLACKS) * p.tick_us


def _framework_baseline(plan: Plan, copying: tuple[float, int]) -> Plan:
    """The plan, its baseline (makespan, peak bytes) that of the graph whose concats copy (`serial_baseline`): a
    framework's serial run copies them, so that is what the speed-up and the serial peak compare against."""
    plan.totals.baseline_makespan_us, plan.totals.baseline_peak_bytes = copying
    return plan
