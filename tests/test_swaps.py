"""Algorithm swaps judged at the time the plan will predict (planner.swaps)."""

from __future__ import annotations

import pytest
from test_refine import _capped, assert_plan_valid
from test_solver import H100

from planner.problem import Alternative, Op, Problem
from planner.schedule import Schedule
from planner.streams import predicted_cost
from planner.swaps import swap_pass


@pytest.mark.parametrize("k,predicted_us,b_alt", [(1.5, 16.0, 1), (0.5, 12.5, 0)])
def test_a_wider_faster_algorithm_replaces_a_narrow_one_where_running_beside_costs_more(k, predicted_us, b_alt):
    """a and b, unrelated, run side by side on half the SMs each for 10 us, slowed by 1 + k x 0.5. b may instead
    take 6 us on all the SMs, after a: 16 us. At k 1.5 side by side settles at 17.5 us, so b swaps; at k 0.5 at
    12.5, so it stays (its times alone never change: the windows would not propose it)."""
    ops = [Op("a", "relu", "forward", [Alternative("half", 10.0, 10, 0, 50)]),
           Op("b", "relu", "forward", [Alternative("half", 10.0, 10, 0, 50), Alternative("all", 6.0, 6, 0, 100)])]
    p = Problem("pair", False, ops, [], resident_bytes=0, tick_us=1.0, device=H100, estimated=True, co_running=k)
    side_by_side = Schedule(alt=[0, 0], start=[0, 0])
    swapped, cost, spent = swap_pass(p, 1 << 40, 2, side_by_side, predicted_cost(p, side_by_side), 1.0, 0.01)
    assert swapped.alt[1] == b_alt and cost * p.tick_us == pytest.approx(predicted_us, rel=1e-3)
    assert spent == pytest.approx(0.03)  # a after b, b after a, b on all the SMs after a
    assert swap_pass(p, 1 << 40, 2, side_by_side, predicted_cost(p, side_by_side), 0.005, 0.01)[0] is side_by_side


@pytest.mark.parametrize("seed", range(6))
def test_swapped_random_plans_predict_no_worse_keep_their_decisions_and_pass_the_check(seed):
    p, cap, streams, start = _capped(seed)
    p.co_running = 1.5
    swapped, cost, _ = swap_pass(p, cap, streams, start, predicted_cost(p, start), 100.0, 0.01)
    assert cost == pytest.approx(predicted_cost(p, swapped)) and cost <= predicted_cost(p, start)
    assert_plan_valid(p, start, swapped, cap, streams)
