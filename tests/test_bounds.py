"""Makespan lower bounds (planner/bounds.py): never above the optimum, and stronger than the plain ones."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from test_solver import H100, brute_force_makespan, chain_problem, random_problem, solve_tiny, sum_problem

from planner import cpsat, solve
from planner.bounds import head_tail_us, heads_tails_us, lower_bounds_us, segment_heads_tails, separators
from planner.dag import Dag
from planner.memory_bounds import memory_lower_bound
from planner.heuristic import list_schedule
from planner.problem import Alternative, Op, Problem, TensorUse
from planner.schedule import peak_memory, timed
from planner.streams import assign_streams, cross_stream_waits, schedule_items, settled

OLD = ("critical_path", "sm_work", "streams")  # the bounds plans reported before heads, tails and big ops


def with_shares(p: Problem, rng: random.Random) -> Problem:
    """The problem with SM shares drawn around the thresholds the bounds test (1-50-100 and the DFF steps)."""
    for o in p.ops:
        o.alternatives = [replace(a, sm_demand=rng.choice([1, 5, 20, 45, 50, 51, 60, 80, 95, 100]))
                          for a in o.alternatives]
    return p


@pytest.mark.parametrize("seed", range(36))
def test_every_bound_is_at_most_the_optimum_on_tiny_dags(seed):
    rng = random.Random(seed)
    p = random_problem(rng, n_ops=3 + seed % 4, n_alts=1 + seed % 3)
    if seed % 2:
        p = with_shares(p, rng)
    streams = rng.choice([1, 2, 3, 4])
    optimum = brute_force_makespan(p, streams) * p.tick_us  # tick_us 1: time_us equals the duration in ticks
    bounds = lower_bounds_us(p, streams)
    assert {"disjunctive", "head_tail"} <= bounds.keys()
    for name, bound in bounds.items():
        assert bound <= optimum + 1e-9, (name, bound, optimum)


def op(name: str, time_us: float, sm_demand: int, preds: list[int]) -> Op:
    return Op(name, "relu", "forward", [Alternative("a", time_us, round(time_us), 0, sm_demand)], preds)


def tiny(ops: list[Op]) -> Problem:
    return Problem("tiny", False, ops, [], resident_bytes=0, tick_us=1.0, device=H100, estimated=True)


def test_a_big_op_beside_a_chain_runs_alone():
    """A pool filling the GPU beside a two-op branch: nothing overlaps it, so 10 + 20; the old bounds say 20."""
    p = tiny([op("pool", 10, 100, []), op("conv", 10, 40, []), op("bn", 10, 40, [1])])
    bounds = lower_bounds_us(p, 4)
    assert brute_force_makespan(p, 4) == 30
    assert bounds["disjunctive"] == bounds["head_tail"] == 30
    assert max(bounds[k] for k in OLD) == 20


def test_heads_add_a_window_of_wide_ops_to_the_chain_before_it():
    """x -> (y1, y2) -> z: y1 and y2 take 60% each so run one after the other, 10 + 20 + 10. The head of z (x's
    end, then both y's energy counted by the DFF at 50%) sees it, and so does the chain x, y1, z with y2 fitting
    nowhere beside it; the other bounds stop at 30."""
    p = tiny([op("x", 10, 10, []), op("y1", 10, 60, [0]), op("y2", 10, 60, [0]), op("z", 10, 10, [1, 2])])
    bounds = lower_bounds_us(p, 4)
    assert brute_force_makespan(p, 4) == 40
    assert bounds["head_tail"] == bounds["chain_fill"] == 40
    assert max(v for k, v in bounds.items() if k not in ("head_tail", "chain_fill")) == 30


def fit_block(first: int, after: list[int]) -> list[Op]:
    """Chain ops c0 -> c1 and fillers f0, f1, from position `first`, after the ops `after`."""
    return [Op("c0", "relu", "forward", [Alternative("a", 10, 10, 0, 100), Alternative("b", 18, 18, 0, 50)], after),
            Op("c1", "relu", "forward", [Alternative("a", 10, 10, 0, 100), Alternative("b", 18, 18, 0, 40)], [first]),
            Op("f0", "relu", "forward", [Alternative("a", 6, 6, 0, 30), Alternative("b", 10, 10, 0, 20)], after),
            Op("f1", "relu", "forward", [Alternative("a", 8, 8, 0, 30), Alternative("b", 20, 20, 0, 20)], after)]


def test_the_chain_counts_what_cannot_fit_beside_it():
    """c0 -> c1 fill the GPU at 10 us each, or leave half of it free at 18 us; f0 and f1 fit beside the narrow
    ones only on their slow 20% alternatives. Least areas (20.4) pretend the fillers pack anywhere; the chain with
    its fillers placed by room says 23.1 (optimum 28)."""
    p = tiny(fit_block(0, []))
    bounds = lower_bounds_us(p, 4)
    assert max(v for k, v in bounds.items() if k != "chain_fill") == pytest.approx(20.4)
    assert bounds["chain_fill"] == pytest.approx(23.111, abs=1e-3)
    assert brute_force_makespan(p, 4) == 28


def test_segments_run_one_after_another():
    """Two such blocks, the second after all of the first: no op is a cut between them, but position 4 separates
    them, and each op of the second starts after the first block's chain_fill bound (23.1), which the window heads
    (20.4) do not see; each op of the first ends that long before the end."""
    p = tiny(fit_block(0, []) + fit_block(4, [1, 2, 3]))
    dag = Dag.of(p)
    anc = dag.ancestors()
    assert separators(anc) == [4]
    heads, tails, _ = heads_tails_us(dag, 4)
    raised_heads, raised_tails, total = segment_heads_tails(dag, anc, heads, tails, 4)
    assert heads[4] == pytest.approx(20.4)
    assert raised_heads[4] == pytest.approx(23.111, abs=1e-3)
    assert all(raised_heads[4:] >= raised_heads[4])
    assert all(raised_tails[:4] >= 23.111)
    assert total == lower_bounds_us(p, 4)["head_tail"] == pytest.approx(2 * 23.111, abs=1e-3)


def test_the_bounds_do_not_depend_on_the_order_of_the_ops():
    p = random_problem(random.Random(7), n_ops=6, n_alts=2)
    order = [5, 3, 4, 1, 2, 0]
    where = {old: new for new, old in enumerate(order)}
    shuffled = [replace(p.ops[old], preds=[where[u] for u in p.ops[old].preds]) for old in order]
    assert any(u > v for v, o in enumerate(shuffled) for u in o.preds)  # not in topological order
    assert head_tail_us(Dag.of(replace(p, ops=shuffled)), 2) == pytest.approx(head_tail_us(Dag.of(p), 2))


def test_solve_still_offers_the_bounds_under_their_old_names():
    assert solve.lower_bounds_us is lower_bounds_us
    assert solve.memory_lower_bound(tiny([op("x", 1, 1, [])])) == (0, "")


def test_without_room_for_chain_matrices_the_bound_is_weaker_but_holds(monkeypatch):
    p = with_shares(random_problem(random.Random(3), n_ops=6, n_alts=2), random.Random(3))
    full = head_tail_us(Dag.of(p), 2)
    monkeypatch.setattr("planner.bounds.CHAIN_CELLS", 0)
    assert head_tail_us(Dag.of(p), 2) <= full <= brute_force_makespan(p, 2)


def without_interference(p: Problem) -> Problem:
    return replace(p, device=H100.model_copy(update={"copy_interference": 0.0}))


def random_chain(rng: random.Random) -> Problem:
    """`chain_problem` with random sizes, copy times and recomputation times: every op is a cut."""
    p = without_interference(chain_problem(rng.randint(3, 6)))
    for t in p.tensors:
        t.bytes = rng.randint(500, 1500) if t.choosable else t.bytes
        if t.can_offload:
            t.d2h_us = t.h2d_us = t.d2h_ticks = t.h2d_ticks = rng.randint(5, 40)
        if t.can_recompute:
            t.recompute = replace(t.recompute, time_us=(d := rng.randint(1, 4)), duration=d,
                                  sm_demand=rng.choice([30, 100]))
    return p


@pytest.mark.parametrize("seed", range(12))
def test_the_memory_cut_is_at_most_the_optimum_under_a_binding_cap(seed):
    rng = random.Random(seed)
    p = random_chain(rng)
    keep_all = list_schedule(p, float("inf"), 4, {}).schedule
    peak = peak_memory(p, {}, timed(p, keep_all))[0]
    cap = rng.randint(memory_lower_bound(p)[0] + 500, peak)
    result = solve_tiny(p, cap, 4)
    assert result.status == "OPTIMAL", (cap, result.status)
    bounds = lower_bounds_us(p, 4, cap)
    assert bounds["memory_cut"] <= result.schedule.makespan(p) + 1e-6


@pytest.mark.parametrize("seed", [0, 1, 35, 38, 54, 58])
def test_the_memory_cut_with_recomputations_beside_the_chain_stays_under_the_optimum(seed, monkeypatch):
    """With room beside the chain's ops, recomputations may fill it: the cut's chain-and-fillers rows count only
    what cannot, and raise the bound (these seeds) without passing the optimum."""
    rng = random.Random(seed)
    p = random_chain(rng)
    for o in p.ops:
        o.alternatives = [replace(a, sm_demand=rng.choice([40, 60, 70, 100])) for a in o.alternatives]
    keep_all = list_schedule(p, float("inf"), 4, {}).schedule
    cap = rng.randint(memory_lower_bound(p)[0] + 500, peak_memory(p, {}, timed(p, keep_all))[0])
    result = solve_tiny(p, cap, 4)
    assert result.status == "OPTIMAL"
    with_chain = lower_bounds_us(p, 4, cap)["memory_cut"]
    assert with_chain <= result.schedule.makespan(p) + 1e-6
    monkeypatch.setattr("planner.memory_bounds.CHAIN_FILL_CUTS", 0)
    assert lower_bounds_us(p, 4, cap)["memory_cut"] < with_chain


def slow_copy_chain(depth: int) -> Problem:
    """The chain with 10-tick copies: offloading a saved activation costs more than recomputing it (1 tick)."""
    p = without_interference(chain_problem(depth))
    for t in p.tensors:
        if t.can_offload:
            t.d2h_us = t.h2d_us = t.d2h_ticks = t.h2d_ticks = 10
    return p


def test_a_cap_that_forces_recomputation_raises_the_bound_by_it():
    """Keeping all six activations needs 6050 bytes at the turn; under 3500 at least 2.55 of them go (the cut
    at f5 holds a4 and a5: 2050), each recomputed at 1 us of the whole GPU after the turn: 48 + 0.95 (of the
    copies, the one out hides in the forward pass, the one back delays b5... by less than a recomputation)."""
    p = slow_copy_chain(6)
    bounds = lower_bounds_us(p, 4, 3500)
    assert bounds["head_tail"] == 48
    result = solve_tiny(p, 3500, 4)
    assert result.status == "OPTIMAL"
    assert 48 < bounds["memory_cut"] <= result.schedule.makespan(p)
    assert lower_bounds_us(p, 4, 7000)["memory_cut"] == 0  # nothing has to go


def test_the_memory_cut_copies_a_tensor_out_after_it_is_made_and_back_before_it_is_read():
    """Copies only, 10 us each way (a0's 100): under 4150 bytes two activations go at the turn. One engine each
    way copies a1..a4 out after f1 ends (8 us) and back before b1 starts (8 us before the end): about 8 + 20 us
    before the turn and as much after it (27.6 each, a sliver of a0 taken), where pricing every copy from a0's
    release and to its due (4 us) gave 51.0 in all."""
    p = slow_copy_chain(6)
    for t in p.tensors:
        t.can_recompute = False
    a0 = p.tensors[0]
    a0.d2h_us = a0.h2d_us = a0.d2h_ticks = a0.h2d_ticks = 100
    result = solve_tiny(p, 4150, 4)
    assert result.status == "OPTIMAL"
    assert 55 < lower_bounds_us(p, 4, 4150)["memory_cut"] <= result.schedule.makespan(p)


def test_on_one_stream_the_memory_cut_counts_a_narrow_recomputation_whole(monkeypatch):
    """A recomputation on 30% of the SMs adds 0.3 us of SM work per us, but on one stream nothing runs beside it:
    the cut's rows at rate 1 / streams count its whole time (without the chain-and-fillers rows, which also do)."""
    monkeypatch.setattr("planner.memory_bounds.CHAIN_FILL_CUTS", 0)
    p = slow_copy_chain(6)
    for t in p.tensors:
        if t.can_recompute:
            t.can_offload, t.recompute = False, replace(t.recompute, sm_demand=30)
    one_stream = lower_bounds_us(p, 1, 3500)["memory_cut"]
    assert lower_bounds_us(p, 4, 3500)["memory_cut"] < 48 + 1.5 < one_stream
    result = solve_tiny(p, 3500, 1)
    assert result.status == "OPTIMAL" and one_stream <= result.schedule.makespan(p)


def settled_us(p: Problem, schedule) -> float:
    """The schedule's makespan once each op is slowed by what runs beside it, as `build_plan` settles it."""
    items = schedule_items(p, schedule)
    assign_streams(p, items)
    return float(settled(p, schedule, items, cross_stream_waits(items))[1].max())


def test_with_co_running_the_memory_cut_prices_a_narrow_recomputation_slowed(monkeypatch):
    """A recomputation on 30% of the SMs costs 0.3 us of SM work per us, but at k 3 it leaves SMs idle or slows
    what runs beside it: the cut counts it at phi(0.3) = 0.93 (`co_running.area_rate`), where the co-running
    tails, which price no recomputation, stay at the chain's 48 us."""
    monkeypatch.setattr("planner.memory_bounds.CHAIN_FILL_CUTS", 0)
    p = slow_copy_chain(6)
    for t in p.tensors:
        if t.can_recompute:
            t.can_offload, t.recompute = False, replace(t.recompute, sm_demand=30)
    alone = lower_bounds_us(p, 4, 3500)
    p.co_running = 3.0
    slowed = lower_bounds_us(p, 4, 3500)
    assert slowed["co_running"] == pytest.approx(48)
    assert alone["memory_cut"] + 1 < slowed["memory_cut"] < 48 + 3
    result = solve_tiny(p, 3500, 4)
    assert result.status == "OPTIMAL" and slowed["memory_cut"] <= settled_us(p, result.schedule)


@pytest.mark.parametrize("seed", range(12))
def test_with_co_running_the_memory_cut_is_at_most_the_optimal_schedule_settled(seed):
    rng = random.Random(seed)
    p = with_shares(random_chain(rng), rng)
    for t in p.tensors:
        if t.can_recompute:
            t.recompute = replace(t.recompute, sm_demand=rng.choice([10, 30, 60]))
    p.co_running = rng.choice([0.5, 1.4, 3.0])
    keep_all = list_schedule(p, float("inf"), 4, {}).schedule
    cap = rng.randint(memory_lower_bound(p)[0] + 500, peak_memory(p, {}, timed(p, keep_all))[0])
    result = solve_tiny(p, cap, 4)
    assert result.status == "OPTIMAL"
    assert lower_bounds_us(p, 4, cap)["memory_cut"] <= settled_us(p, result.schedule) + 1e-6


@pytest.mark.parametrize("seed", range(12))
def test_on_one_stream_the_memory_cut_is_at_most_the_optimum(seed):
    rng = random.Random(seed)
    p = random_chain(rng)
    keep_all = list_schedule(p, float("inf"), 1, {}).schedule
    cap = rng.randint(memory_lower_bound(p)[0] + 500, peak_memory(p, {}, timed(p, keep_all))[0])
    result = solve_tiny(p, cap, 1)
    assert result.status == "OPTIMAL"
    assert lower_bounds_us(p, 1, cap)["memory_cut"] <= result.schedule.makespan(p) + 1e-6


def test_the_minimum_cap_counts_what_a_cut_must_hold():
    """At f5 every path passes: a4 (read) and a5 (written) are there, the others may be away; the graph input
    the chain starts from, when it can be neither copied nor recomputed, must stay as well."""
    p = chain_problem(6)
    assert memory_lower_bound(p) == (50 + 2000, "f1")
    p.tensors[0].can_offload = False
    assert memory_lower_bound(p) == (50 + 3000, "f2")


def test_the_minimum_cap_counts_what_waits_across_an_op_whichever_side_the_ops_beside_it_run():
    """At s: its two inputs and its output (2000) and, w running before or after it, x (1000) or g's output (500)
    held across it: 2550, where what s reads and writes alone gives 2050; CP-SAT's least peak is 2560 (w's
    output beside x and g's)."""
    p = sum_problem()
    assert memory_lower_bound(p) == (50 + 2500, "s")
    least = cpsat.solve(p, 10**6, 4, 40, 5.0, 2, minimize_memory=True)
    assert least.status == "OPTIMAL" and least.peak_bytes == 2560


@pytest.mark.parametrize("seed", [7, 18, 26, 0])
def test_the_minimum_cap_is_at_most_every_schedules_peak(seed):
    """Random training DAGs (the first three where the minimum cut says more than each op alone): the floor is
    never above the peak of the leanest schedule CP-SAT finds, nor of the heuristic's list schedule."""
    p = random_problem(random.Random(seed), n_ops=8, n_alts=2, training=True)
    floor = memory_lower_bound(p)[0]
    least = cpsat.solve(p, 10**7, 4, 100, 0.3, 2, minimize_memory=True)
    assert least.schedule is not None and floor <= least.peak_bytes
    keep_all = list_schedule(p, float("inf"), 4, {}).schedule
    assert floor <= peak_memory(p, {}, timed(p, keep_all))[0]


def test_cp_sat_s_bound_in_real_time_allows_for_times_rounded_to_ticks():
    """A chain of three 0.26-us ops rounds to 3 ticks of 0.1 us each: the ticks' optimum, 9, is 0.9 us, over the
    real one, 0.78. Scaled by the least real over tick time the bound holds; a copy that takes no time (a graph
    input's copy out) still takes a tick, and is taken off."""
    ops = [Op(f"op{i}", "relu", "forward", [Alternative("a", 0.26, 3, 0, 100)], [i - 1] if i else [])
           for i in range(3)]
    p = Problem("chain", False, ops, [], resident_bytes=0, tick_us=0.1, device=H100, estimated=True)
    ratio, untimed = p.bound_scale()
    assert (ratio, untimed) == (pytest.approx(0.26 / 0.3), 0)
    assert (9 - untimed) * p.tick_us * ratio == pytest.approx(0.78)
    copied = TensorUse("input", 100, None, [0], [2], is_output=False, can_offload=True, d2h_ticks=1, h2d_ticks=2,
                       d2h_us=0.0, h2d_us=0.2)
    assert replace(p, tensors=[copied]).bound_scale() == (pytest.approx(0.26 / 0.3), 1)
