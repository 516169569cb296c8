"""Plans on several streams settle their timeline under the co-running slowdown; `planner calibrate` fits it."""

import random
from pathlib import Path

import numpy as np
import pytest
from test_bounds import settled_us, with_shares
from test_calibrate import _report
from test_solver import H100, place, random_problem
from typer.testing import CliRunner

from planner.analytic import estimate_profile
from planner.bounds import lower_bounds_us
from planner.calibrate import Calibrated, fit, misranked, simulated_makespan_us
from planner.check import check_plan
from planner.cli import app
from planner.co_running import area_us as co_running_area_us
from planner.co_running import lower_bound_us as co_running_lp_us
from planner.co_running import occupancy, settle, slot_area_us, slot_rates
from planner.devices import load_device
from planner.files import load_model, save_model
from planner.onnx_import import import_onnx
from planner.problem import Alternative, Op, Problem, build_problem
from planner.profile import Profile
from planner.schedule import Schedule
from planner.show import sm_time_us
from planner.streams import Item, maximal_predecessors
from planner.solve import Options, solve_plan
from planner.stats import serial_peak_bytes
from planner.training import build_training

MODELS = Path(__file__).parent / "models"


def test_occupancy_is_the_others_share_averaged_over_each_item():
    start, end, share = np.array([0.0, 5.0, 20.0]), np.array([10.0, 15.0, 30.0]), np.array([0.5, 0.3, 0.9])
    assert occupancy(start, end, share) == pytest.approx([0.3 * 5 / 10, 0.5 * 5 / 10, 0.0])


def test_two_ops_side_by_side_settle_where_each_runs_one_plus_k_times_the_others_share():
    """Two 10-us ops on streams of their own, half the SMs each, k = 1: each runs 15 us at the fixed point; an op
    after both starts when the slower one ends."""
    def replay(duration):
        start = np.array([0.0, 0.0, max(duration[0], duration[1])])
        return start, start + duration

    start, end, slowdown = settle(np.array([10.0, 10.0, 4.0]), np.array([0.5, 0.5, 1.0]), 1.0, replay)
    assert end == pytest.approx([15.0, 15.0, 19.0], abs=0.01)
    assert slowdown == pytest.approx([1.5, 1.5, 1.0], abs=1e-3)
    assert settle(np.array([10.0, 10.0, 4.0]), np.array([0.5, 0.5, 1.0]), 0.0, replay)[1] == pytest.approx(
        [10.0, 10.0, 14.0])


@pytest.mark.parametrize("seed", range(20))
def test_an_item_waits_for_those_ended_by_its_start_that_nothing_ended_after_them_follows(seed):
    """maximal_predecessors against its definition, on random intervals with ties and zero lengths: A with
    end(A) <= start(B), and no other such A' with start(A') >= end(A)."""
    rng = random.Random(seed)
    items = sorted((Item("op", i, t, t + rng.choice([0, 1, 2, 3, 5]), 1.0)
                    for i, t in enumerate(rng.randint(0, 20) for _ in range(rng.randint(1, 30)))),
                   key=lambda it: (it.start, it.end))
    for b, preds in zip(items, maximal_predecessors(items)):
        before = [a for a, it in enumerate(items) if it.end <= b.start]
        assert preds == [a for a in before if not any(items[c].start >= items[a].end for c in before)]


def test_a_copy_beside_kernels_keeps_its_duration():
    """A copy runs on its copy engine: the kernels beside it do not slow it (before this, a capped Inception v3
    training plan's copies ran 1.74 times their price at k 1.34, and the replay ended copy-bound 72% late)."""
    def replay(duration):
        start = np.zeros(2)
        return start, start + duration

    start, end, slowdown = settle(np.array([10.0, 10.0]), np.array([0.0, 0.8]), 1.0, replay)
    assert end == pytest.approx([10.0, 10.0]) and slowdown == pytest.approx([1.0, 1.0])


@pytest.fixture(scope="module")
def googlenet_b1():
    g = import_onnx(MODELS / "googlenet.onnx", batch=1, dtype="fp16")
    return g, estimate_profile(g, load_device("h100"))


def test_solve_settles_plans_on_several_streams_and_the_check_agrees(googlenet_b1):
    g, prof = googlenet_b1
    plain = solve_plan(g, prof, prof.device.memory_bytes, Options(time_limit_s=0))
    prof = prof.model_copy(deep=True)
    prof.device.co_running["inference"] = 1.0
    slowed = solve_plan(g, prof, prof.device.memory_bytes, Options(time_limit_s=0))
    assert slowed.compute_streams > 1 and slowed.totals.co_running == 1.0
    assert all(op.slowdown >= 1.0 for op in slowed.ops) and max(op.slowdown for op in slowed.ops) > 1.2
    assert slowed.totals.makespan_us > plain.totals.makespan_us
    report = check_plan(slowed)
    assert report.ok, report.violations
    assert report.makespan_us == pytest.approx(slowed.totals.makespan_us, rel=1e-6)
    parts = sm_time_us(slowed)  # `planner show` names what the slowdown costs
    assert parts["co-running slowdown"] > 0 and sum(parts.values()) == pytest.approx(slowed.totals.makespan_us)
    serial = solve_plan(g, prof, prof.device.memory_bytes, Options(streams=1, time_limit_s=0))
    assert serial.totals.co_running == 0.0 and all(op.slowdown == 1.0 for op in serial.ops)


def test_the_search_keeps_the_schedule_that_settles_fastest():
    """The search ranks schedules at times alone; a tighter packing can lose more to co-running than it gains.
    At k 3 the refined GoogLeNet b32 schedule is shorter alone but settles longer than the heuristic's, so the
    heuristic's is kept: searching never predicts worse than the heuristic."""
    g = import_onnx(MODELS / "googlenet.onnx", batch=32, dtype="fp16")
    prof = estimate_profile(g, load_device("h100"))
    prof.device.co_running["inference"] = 3.0
    heuristic, searched = (solve_plan(g, prof, prof.device.memory_bytes,
                                      Options(time_limit_s=limit, deterministic=True)) for limit in (0, 3))
    assert searched.compute_streams > 1
    assert searched.totals.predicted_us <= heuristic.totals.predicted_us


def test_a_settled_plan_under_a_cap_keeps_to_it():
    """Slowing ops keeps every order the schedule made, so memory stays within what the solver checked."""
    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=8, dtype="fp16", training=True))
    prof = estimate_profile(g, load_device("h100"))
    prof.device.co_running["training"] = 1.5
    resident = build_problem(g, prof).resident_bytes
    cap = resident + int((serial_peak_bytes(g) - resident) * 0.6)
    plan = solve_plan(g, prof, cap, Options(time_limit_s=0))
    assert plan.copies or plan.totals.recomputed_bytes
    assert max(op.slowdown for op in plan.ops) > 1.1
    report = check_plan(plan)
    assert report.ok, report.violations
    assert report.peak_bytes <= cap


def test_the_fit_recovers_the_slowdown_and_dispatch_time_that_made_two_runs(googlenet_b1):
    g, prof = googlenet_b1
    plans = [solve_plan(g, prof, prof.device.memory_bytes, Options(streams=s, time_limit_s=0)) for s in (2, 4)]
    runs = [Calibrated(f"s{p.compute_streams}", p, simulated_makespan_us(p, 1.5, None, 0.8)) for p in plans]
    assert runs[0].measured_us / plans[0].totals.makespan_us != pytest.approx(
        runs[1].measured_us / plans[1].totals.makespan_us, rel=1e-3)  # k shows: the plans overlap differently
    fitted = fit(runs)
    assert fitted.co_running == pytest.approx(0.8, abs=0.03)
    assert fitted.dispatch_us == pytest.approx(1.5, abs=0.1)
    assert all(r.fitted_us == pytest.approx(r.measured_us, rel=2e-3) for r in runs)


def test_calibrate_writes_the_slowdown_and_solve_settles_with_it(googlenet_b1, tmp_path):
    g, prof = googlenet_b1
    profile_file = tmp_path / "profile.json"
    save_model(prof, profile_file)
    reports = [tmp_path / f"s{streams}.json" for streams in (2, 4)]
    for streams, report in zip((2, 4), reports):
        plan = solve_plan(g, prof, prof.device.memory_bytes, Options(streams=streams, time_limit_s=0))
        save_model(plan, tmp_path / f"s{streams}.plan.json")
        measured = simulated_makespan_us(plan, 1.5, None, 0.8)
        save_model(_report(plan, tmp_path / f"s{streams}.plan.json", measured), report)
    result = CliRunner().invoke(app, ["calibrate", *map(str, reports), "--write", str(profile_file)])
    assert result.exit_code == 0, result.output
    assert "co-running slowdown" in result.output and "warning" not in result.output
    device = load_model(Profile, profile_file).device
    assert device.co_running["inference"] == pytest.approx(0.8, abs=0.03)
    again = solve_plan(g, load_model(Profile, profile_file), prof.device.memory_bytes, Options(time_limit_s=0))
    assert again.totals.co_running == device.co_running["inference"] and check_plan(again).ok


def test_calibrate_warns_when_the_runs_cannot_tell_k_from_the_dispatch_time(googlenet_b1, tmp_path):
    """Two runs of one plan lose alike to co-running: whatever k, a dispatch time fits them both."""
    g, prof = googlenet_b1
    plan = solve_plan(g, prof, prof.device.memory_bytes, Options(time_limit_s=0))
    save_model(plan, plan_file := tmp_path / "plan.json")
    reports = [tmp_path / f"r{i}.json" for i in range(2)]
    for report, measured in zip(reports, (1.02, 1.03)):
        save_model(_report(plan, plan_file, measured * plan.totals.predicted_us), report)
    result = CliRunner().invoke(app, ["calibrate", *map(str, reports)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "co-running slowdown k" in text and "lose alike to co-running" in text


def test_calibrate_names_the_runs_of_one_graph_that_the_fit_ranks_the_wrong_way_round(googlenet_b1):
    """Runs more than 1% apart that the fit orders the other way round; runs closer than that, or of another graph,
    are not compared."""
    g, prof = googlenet_b1
    plan = solve_plan(g, prof, prof.device.memory_bytes, Options(time_limit_s=0))
    other = plan.model_copy(update={"graph_sha256": "another graph"})

    def run(name, graph_plan, measured_us, fitted_us):
        return Calibrated(name, graph_plan, measured_us, fitted_us=fitted_us)

    shipped, solved, close, elsewhere = (run("shipped", plan, 3757.9, 3820.2), run("solved", plan, 3809.4, 3785.4),
                                         run("close", plan, 3780.0, 3700.0), run("other", other, 3900.0, 3600.0))
    assert [(a.name, b.name) for a, b in misranked([shipped, solved, close, elsewhere])] == [("shipped", "solved")]
    assert misranked([shipped, run("same graph", plan, 3900.0, 3600.0)]) != []  # as `elsewhere`, but one graph


def side_by_side(k: float) -> Problem:
    """Two unrelated 10-us ops on half the SMs each."""
    ops = [Op(f"op{i}", "relu", "forward", [Alternative("a", 10.0, 10, 0, 50)]) for i in range(2)]
    return Problem("pair", False, ops, [], resident_bytes=0, tick_us=1.0, device=H100, estimated=True, co_running=k)


def test_the_bound_prices_running_side_by_side():
    """Side by side at k 1 each runs 15 us, the settled time; at k 3 they would take 25, so one after another (20)
    is the least; on one stream nothing runs beside anything and the bound is not offered."""
    assert lower_bounds_us(side_by_side(1.0), 2)["co_running"] == pytest.approx(15.0)
    assert lower_bounds_us(side_by_side(3.0), 2)["co_running"] == pytest.approx(20.0)
    assert "co_running" not in lower_bounds_us(side_by_side(1.0), 1)
    assert max(lower_bounds_us(side_by_side(0.0), 2).values()) == pytest.approx(10.0)


def settled_makespan_us(p: Problem, streams: int, rng: random.Random) -> float:
    """A random active schedule (random alternatives, a random topological order placed as early as the SM share
    and the streams allow), settled as `build_plan` settles it."""
    alt = [rng.randrange(len(o.alternatives)) for o in p.ops]
    start, end, placed = [0] * len(p.ops), {}, []
    while len(end) < len(p.ops):
        i = rng.choice([i for i, o in enumerate(p.ops) if i not in end and all(j in end for j in o.preds)])
        a = p.ops[i].alternatives[alt[i]]
        t = place(a, max((end[j] for j in p.ops[i].preds), default=0), placed, streams)
        start[i], end[i] = t, t + a.duration
        placed.append((t, t + a.duration, a.sm_demand))
    return settled_us(p, Schedule(alt, start))


@pytest.mark.parametrize("seed", range(12))
def test_no_settled_schedule_of_a_random_dag_beats_the_bound(seed):
    rng = random.Random(seed)
    p = with_shares(random_problem(rng, n_ops=4 + seed % 5, n_alts=1 + seed % 3), rng)
    p.co_running = rng.choice([0.5, 1.05, 2.0])
    streams = rng.choice([2, 3, 4])
    bound = lower_bounds_us(p, streams)["co_running"]
    shortest = min(settled_makespan_us(p, streams, rng) for _ in range(200))
    assert bound <= shortest * (1 + 1e-9), (bound, shortest)
    alts = [o.alternatives for o in p.ops]
    area = co_running_area_us(alts, p.co_running)  # a dual solution of the LP: never above it, and it holds alone
    assert area <= co_running_lp_us(alts, np.ones((len(alts), len(alts)), dtype=bool), len(alts), p.co_running) + 1e-6
    assert area <= shortest * (1 + 1e-9)
    slots = slot_area_us(alts, slot_rates(alts, streams, p.co_running))  # another, over streams' worth of ops
    assert area - 1e-6 <= slots <= co_running_lp_us(alts, np.ones((len(alts), len(alts)), dtype=bool), streams,
                                                    p.co_running) + 1e-6
    assert slots <= shortest * (1 + 1e-9)


def test_the_area_bound_is_exact_for_a_pair_and_holds_past_the_lp():
    """Two half-width ops: 15 us at k 1 (side by side), 20 at k 3 (one after another), as the LP; a segment with
    too many configurations for the LP keeps the area bound, over the SM work."""
    pair = [o.alternatives for o in side_by_side(1.0).ops]
    assert co_running_area_us(pair, 1.0) == pytest.approx(15.0) and co_running_area_us(pair, 3.0) == pytest.approx(20.0)
    ops = [Op(f"op{i}", "relu", "forward", [Alternative("a", 10.0, 10, 0, 25)]) for i in range(60)]
    many = Problem("many", False, ops, [], resident_bytes=0, tick_us=1.0, device=H100, estimated=True, co_running=1.0)
    assert co_running_lp_us([o.alternatives for o in ops], np.ones((60, 60), dtype=bool), 4, 1.0) is None
    bounds = lower_bounds_us(many, 4)
    assert bounds["sm_work"] == pytest.approx(150.0)
    assert bounds["co_running"] == pytest.approx(60 * 10 * 0.25 * 1.75)


def test_past_the_lp_narrow_ops_hold_the_streams():
    """60 ops on a tenth of the SMs each, 4 streams, k 1: four at once fill 40% of the SMs and each runs 13 us, so
    15 such rounds (195 us) is the least. The area bound (114 us) pretends ten run at once; the stream-slot bound
    finds 195 where the LP has too many configurations."""
    ops = [Op(f"op{i}", "relu", "forward", [Alternative("a", 10.0, 10, 0, 10)]) for i in range(60)]
    narrow = Problem("narrow", False, ops, [], resident_bytes=0, tick_us=1.0, device=H100, estimated=True,
                     co_running=1.0)
    alts = [o.alternatives for o in ops]
    assert co_running_area_us(alts, 1.0) == pytest.approx(114.0)
    assert co_running_lp_us(alts, np.ones((60, 60), dtype=bool), 4, 1.0) is None
    assert lower_bounds_us(narrow, 4)["co_running"] == pytest.approx(195.0)
