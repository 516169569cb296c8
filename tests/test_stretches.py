"""Stretches of the timeline searched alone at the time the plan will predict (planner.stretches)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_refine import _capped, assert_plan_valid
from test_solver import H100

from planner.problem import SM_CAPACITY, Alternative, Op, Problem
from planner.schedule import Schedule
from planner.streams import assign_streams, cross_stream_waits, predicted_cost, schedule_items, settled
from planner.stretches import anneal, place, polish, settled_span_us, stretches
from planner.window import items_of


def _fan(k: float) -> Problem:
    """A source, four unrelated ops after it, each on a quarter of the SMs for 10 us or all of them for 4, and a
    sink after them all."""
    branch = [Alternative("quarter", 10.0, 10, 0, 25), Alternative("all", 4.0, 4, 0, 100)]
    ops = [Op("src", "relu", "forward", [Alternative("all", 2.0, 2, 0, 100)])]
    ops += [Op(f"b{j}", "relu", "forward", list(branch), preds=[0]) for j in range(4)]
    ops.append(Op("sink", "relu", "forward", [Alternative("all", 2.0, 2, 0, 100)], preds=[1, 2, 3, 4]))
    return Problem("fan", False, ops, [], resident_bytes=0, tick_us=1.0, device=H100, estimated=True,
                   co_running=k)


@pytest.mark.parametrize("k,branch_alt,predicted_us", [(1.5, 1, 20.0), (0.2, 0, 15.5)])
def test_a_stretch_where_running_beside_costs_more_runs_its_ops_one_at_a_time(k, branch_alt, predicted_us):
    """Side by side on a quarter each, the four branches take 10 x (1 + k x 0.75) us: 21.25 at k 1.5, where one
    after another on all the SMs takes 16; at k 0.2 side by side (11.5) stays, and so does the schedule."""
    p = _fan(k)
    side_by_side = Schedule(alt=[0] * 6, start=[0, 2, 2, 2, 2, 12])
    polished, cost, spent = polish(p, 1 << 40, 4, side_by_side, predicted_cost(p, side_by_side), 100.0, 0)
    assert all(polished.alt[j] == branch_alt for j in range(1, 5))
    assert cost * p.tick_us == pytest.approx(predicted_us, rel=1e-3) == predicted_cost(p, polished) * p.tick_us
    assert spent > 0
    assert polish(p, 1 << 40, 4, side_by_side, predicted_cost(p, side_by_side), 0.0, 0)[0] is side_by_side


@pytest.mark.parametrize("seed", range(6))
def test_a_stretchs_settled_span_is_the_plans(seed):
    """Nothing runs across a stretch's ends, so the span it settles at alone is the one it has in the whole
    plan's settled timeline."""
    p, _, streams, s = _capped(seed)
    p.co_running = 1.5
    items = schedule_items(p, s)
    assign_streams(p, items)
    start, end, _ = settled(p, s, items, cross_stream_waits(items))
    at = {(it.kind, it.index): k for k, it in enumerate(items)}
    window_items = items_of(p, s)
    runs = stretches(window_items)
    assert runs
    for run in runs:
        mine = [at[window_items[k].kind, window_items[k].index] for k in run]
        t0 = window_items[run[0]].start
        alone = settled_span_us([window_items[k].alternatives[window_items[k].chosen] for k in run],
                                [window_items[k].start - t0 for k in run], p.co_running)
        assert alone == pytest.approx(end[mine].max() - start[mine].min(), rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_polished_random_plans_predict_no_worse_keep_their_decisions_and_pass_the_check(seed):
    p, cap, streams, start = _capped(seed)
    p.co_running = 1.5
    polished, cost, _ = polish(p, cap, streams, start, predicted_cost(p, start), 100.0, seed)
    assert cost == pytest.approx(predicted_cost(p, polished)) and cost <= predicted_cost(p, start)
    assert_plan_valid(p, start, polished, cap, streams)


@pytest.mark.parametrize("seed", range(20))
def test_placed_items_follow_their_preds_and_fit_the_sms_and_streams(seed):
    rng = random.Random(seed)
    n, streams = rng.randint(3, 12), rng.randint(1, 4)
    ways = [Alternative("w", 1.0, rng.randint(1, 9), 0, rng.randint(1, SM_CAPACITY)) for _ in range(n)]
    preds = [sorted(rng.sample(range(v), rng.randint(0, min(v, 2)))) for v in range(n)]
    start = place(ways, preds, rng.sample(range(n), n), streams)
    end = [s + w.duration for s, w in zip(start, ways)]
    assert all(end[u] <= start[v] for v in range(n) for u in preds[v])
    for t in start:
        running = [v for v in range(n) if start[v] <= t < end[v]]
        assert len(running) <= streams and sum(ways[v].sm_demand for v in running) <= SM_CAPACITY


def test_annealing_repeats_for_a_seed_and_never_returns_worse_than_its_start():
    p = _fan(1.5)
    options = [o.alternatives for o in p.ops]
    preds = [o.preds for o in p.ops]
    start_span = settled_span_us([o[0] for o in options], place([o[0] for o in options], preds, list(range(6)), 4),
                                 p.co_running)
    runs = [anneal(options, preds, [0] * 6, list(range(6)), 4, p.co_running, 300, random.Random(3)) for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] <= start_span
    assert np.isclose(runs[0][0], settled_span_us([o[a] for o, a in zip(options, runs[0][1])], runs[0][2],
                                                   p.co_running))
