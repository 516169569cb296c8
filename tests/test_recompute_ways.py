"""A recomputation's ways (TensorUse.recompute_alternatives): the lean one, whose workspace fits where memory is
tightest, and a faster one needing more; the list scheduler, the windows and CP-SAT choose between them by what
fits, and the plan runs the one chosen."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from test_solver import _plan_of, chain_problem, solve_tiny

from planner import cpsat
from planner.bounds import lower_bounds_us
from planner.check import check_plan
from planner.heuristic import list_schedule
from planner.plan import FUSED_RECOMPUTE
from planner.problem import Alternative
from planner.refine import refine
from planner.schedule import timed
from planner.serialize import serialized

LEAN = Alternative("lean", 6.0, 6, 0, 100)
CAP = 4000  # chain_problem(6) keeps 6000 bytes of a_i at the turn: under this, some must be recomputed


def two_ways(fast_workspace: int = 800):
    """chain_problem(6), where a1..a5 are recomputed (not offloaded) in 6 ticks without workspace, or in 1 tick
    with `fast_workspace` bytes of it."""
    p = chain_problem(6)
    for t in p.tensors:
        if t.can_recompute:
            t.can_offload = False
            t.recompute_alternatives = [LEAN, Alternative("fast", 1.0, 1, fast_workspace, 100)]
    return p


def lean_only(p):
    return replace(p, tensors=[replace(t, recompute_alternatives=t.recompute_alternatives[:1]) for t in p.tensors])


def test_conv1_recomputes_on_the_stem_kernel(googlenet_train_b32):
    """GoogLeNet training b32 fp16 on the measured H100 profile: conv1's output (49 MiB) recomputes one way, the
    wgmma stem kernel, in 39.5 us (with the fitted 0.13 us an op) without workspace; it dominates cuDNN's ways,
    which before the stem were two (196.7 us lean, 91.0 us with 12.3 MiB). A ReLU output recomputed as the fused
    kernel has that one way, and its deep way re-runs the stem, then the fused kernel. Where a tensor has several
    ways, each faster needs more workspace."""
    p = googlenet_train_b32
    conv1 = next(t for t in p.tensors if t.name == "/conv1/conv/Conv_output_0")
    assert conv1.recompute_alternatives == [conv1.recompute] and conv1.recompute.name == "stem:wgmma"
    assert conv1.recompute.workspace_bytes == 0 and conv1.recompute.time_us == pytest.approx(39.5, abs=0.1)
    relu = next(t for t in p.tensors if t.name == "/conv1/Relu_output_0")
    assert len(relu.recompute_alternatives) == 1 and relu.recompute.name.startswith(FUSED_RECOMPUTE)
    for t in p.tensors:
        for a, b in zip(t.recompute_alternatives, t.recompute_alternatives[1:]):
            assert b.time_us < a.time_us and b.workspace_bytes > a.workspace_bytes
    (deep,) = relu.deep[2]
    assert deep.name == f"{conv1.recompute.name}+{relu.recompute.name}"
    assert deep.time_us == pytest.approx(conv1.recompute.time_us + relu.recompute.time_us, rel=0.01)


@pytest.mark.parametrize("fast_workspace,way", [(800, 1), (1 << 20, 0)])
def test_the_list_schedule_takes_the_fast_way_where_its_workspace_fits(fast_workspace, way):
    """Recomputing a3 and a4 under ample memory: both run the fast way and the plan names it; where the fast
    way's workspace is more than the cap, the lean way runs. The serial form reads the way back off the plan."""
    p = two_ways(fast_workspace)
    cap = 1 << 19
    out = list_schedule(p, cap, 4, {3: "recompute", 4: "recompute"})
    assert out.fits
    assert {out.schedule.recompute_alt.get(t, 0) for t in (3, 4)} == {way}
    tm = timed(p, out.schedule)
    assert all(tm.recompute[t][1] - tm.recompute[t][0] == (6, 1)[way] for t in (3, 4))
    plan = _plan_of(p, out.schedule, cap)
    assert {o.algorithm for o in plan.ops if o.recompute_of} == {("lean", "fast")[way]}
    assert check_plan(plan).ok and plan.totals.peak_bytes <= cap
    again = serialized(p, plan, out.schedule.alt)
    assert {again.recompute_alt.get(t, 0) for t in (3, 4)} == {way}


@pytest.mark.parametrize("fast_workspace,faster", [(800, True), (1 << 20, False)])
def test_cp_sat_chooses_the_way_the_cap_allows(fast_workspace, faster):
    """Under CAP, CP-SAT's optimum takes the fast way and beats the lean ways' optimum when its workspace fits,
    and equals it, every recomputation lean, when it does not."""
    p = two_ways(fast_workspace)
    lean = cpsat.solve(lean_only(p), CAP, 4, 200, time_limit_s=10, workers=2)
    both = cpsat.solve(p, CAP, 4, 200, time_limit_s=10, workers=2)
    assert lean.status == both.status == "OPTIMAL"
    s = both.schedule
    ways = {s.recompute_alt.get(t, 0) for t, how in s.decision.items() if how == "recompute"}
    assert ways == {int(faster)} and (s.makespan(p) < lean.schedule.makespan(p)) == faster
    plan = _plan_of(p, s, CAP)
    assert check_plan(plan).ok and plan.totals.peak_bytes <= CAP


def test_a_window_switches_a_recomputation_to_its_fast_way():
    """From a schedule whose recomputations run the lean way, the windows take the fast one: shorter, and the
    plan checks."""
    p, cap = two_ways(), 1 << 19
    start = list_schedule(lean_only(p), cap, 4, {3: "recompute", 4: "recompute"}).schedule
    refined, _, _ = refine(p, cap, 4, start, budget_s=5.0)
    assert refined.recompute_alt == {3: 1, 4: 1} and refined.makespan(p) < start.makespan(p)
    assert check_plan(_plan_of(p, refined, cap)).ok


def test_the_memory_cut_prices_a_recomputation_at_its_cheapest_way():
    """Under CAP the bound's LP recomputes; offered the fast way, it prices that, below the lean ways' bound and
    at or below CP-SAT's optimum."""
    p = two_ways()
    both, lean = lower_bounds_us(p, 4, CAP)["memory_cut"], lower_bounds_us(lean_only(p), 4, CAP)["memory_cut"]
    assert both < lean
    assert both <= cpsat.solve(p, CAP, 4, 200, time_limit_s=10, workers=2).schedule.makespan(p)


@pytest.mark.parametrize("seed", range(8))
def test_random_chains_with_two_way_recomputations_solve_and_check(seed):
    """Random chain_problems: each a_i recomputed lean in 2-6 ticks or in 1 tick with 100-1500 bytes of workspace
    (at full or half the SMs), under a random cap. CP-SAT's optimum with both ways is never above the lean ways'
    optimum, and its plan, and that plan refined window by window, pass the independent check within the cap."""
    rng = random.Random(300 + seed)
    depth = rng.randint(5, 8)
    p = chain_problem(depth)
    for t in p.tensors:
        if t.can_recompute:
            t.can_offload, lean_ticks = False, rng.randint(2, 6)
            t.recompute_alternatives = [Alternative("lean", lean_ticks, lean_ticks, 0, 100),
                                        Alternative("fast", 1, 1, rng.choice([100, 500, 1500]), rng.choice([50, 100]))]
    cap = int(50 + 1000 * depth * rng.uniform(0.55, 0.9))
    both, lean = solve_tiny(p, cap, 4), solve_tiny(lean_only(p), cap, 4)
    assert both.status == lean.status == "OPTIMAL"
    assert both.schedule.makespan(p) <= lean.schedule.makespan(p)
    refined, _, _ = refine(p, cap, 4, both.schedule, budget_s=1.0)
    for s in (both.schedule, refined):
        plan = _plan_of(p, s, cap)
        assert check_plan(plan).ok and plan.totals.peak_bytes <= cap
