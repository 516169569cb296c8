"""planner.serialize: a plan on several streams in serial form."""

import copy
import random
from dataclasses import replace
from pathlib import Path

import pytest

from planner.analytic import estimate_profile
from planner.memory_bounds import memory_lower_bound
from planner.check import check_plan
from planner.devices import load_device
from planner.decisions import fit_cap
from planner.heuristic import baseline, fastest_alternatives
from planner.onnx_import import import_onnx
from planner.plan import Totals
from planner.problem import TensorUse, build_problem
from planner.schedule import peak_memory, timed
from planner.serialize import serial_form
from planner.solve import Options, solve_plan
from planner.stats import serial_peak_bytes
from planner.streams import build_plan
from planner.training import build_training
from test_solver import EMPTY, random_problem

MODELS = Path(__file__).parent / "models"


@pytest.fixture(scope="module", params=[0.45, 0.6, 0.75])
def capped(request):
    """GoogLeNet training b8 at 45-75% of the room above its resident bytes: the heuristic's four-stream plan
    offloads and recomputes."""
    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=8, dtype="fp16", training=True))
    prof = estimate_profile(g, load_device("h100"))
    resident = build_problem(g, prof).resident_bytes
    cap = resident + int((serial_peak_bytes(g) - resident) * request.param)
    plan = solve_plan(g, prof, cap, Options(time_limit_s=0, streams=4, concat="copy", bn_relu="apart"))
    assert plan.compute_streams > 1 and plan.copies and any(o.recompute_of for o in plan.ops)
    return g, prof, cap, plan, build_problem(g, prof, streams=1)


def _compute_items(p, s):
    return sorted([(s.start[i], s.end(p, i), "op", i) for i in range(len(p.ops))]
                  + [(st, st + p.tensors[t].recompute.duration, "recompute", t) for t, st in s.recompute_start.items()])


def test_the_serial_form_runs_the_plans_items_one_at_a_time_in_its_order(capped):
    g, _, cap, plan, p1 = capped
    s = serial_form(p1, plan, cap)
    items = _compute_items(p1, s)
    assert all(a[1] <= b[0] for a, b in zip(items, items[1:]))  # back to back, never side by side
    names = [p1.ops[i].name if kind == "op" else f"recompute {p1.tensors[i].name}" for _, _, kind, i in items]
    in_plan = sorted(plan.ops, key=lambda o: (o.start_us, o.end_us))
    assert names == [o.node if o.recompute_of is None else f"recompute {o.recompute_of}" for o in in_plan]
    assert ({p1.tensors[t].name: d for t, d in s.decision.items()}
            == {r.tensor: r.decision for r in plan.tensors if r.decision != "keep"})
    assert set(s.d2h_start) == set(s.h2d_start) == {t for t, d in s.decision.items() if d == "offload"}
    assert all(s.h2d_start[t] >= s.d2h_start[t] + p1.tensors[t].d2h_ticks for t in s.h2d_start)
    assert peak_memory(p1, s.decision, timed(p1, s))[0] <= cap
    one = build_plan(g, p1, s, _totals(cap), 1)
    assert one.compute_streams == 1 and check_plan(one).ok


def test_each_op_takes_its_fastest_algorithm_unless_its_workspace_passes_the_cap(capped):
    """With every op on its fastest algorithm the serial form fits; give one op a faster algorithm still whose
    workspace is the whole cap and that op alone steps back, to its fastest leaner one."""
    _, _, cap, plan, p1 = capped
    fastest = fastest_alternatives(p1)
    assert serial_form(p1, plan, cap).alt == fastest
    p = copy.deepcopy(p1)
    op = p.ops[0]
    greedy = op.alternatives[fastest[0]]
    op.alternatives.append(replace(greedy, name="greedy", time_us=greedy.time_us / 2,
                                   duration=max(1, greedy.duration // 2), workspace_bytes=cap))
    assert fastest_alternatives(p)[0] == len(op.alternatives) - 1
    s = serial_form(p, plan, cap)
    assert s.alt == fastest
    assert peak_memory(p, s.decision, timed(p, s))[0] <= cap


def test_no_serial_form_where_even_the_leanest_algorithms_pass_the_cap(capped):
    _, _, _, plan, p1 = capped
    assert serial_form(p1, plan, p1.resident_bytes) is None


def test_the_serial_form_of_random_capped_plans_passes_check():
    """Random training DAGs with copies of random length, plans of the heuristic under a cap between the least
    any schedule needs and the serial peak: the serial form fits the same cap and every rule of `planner check`
    holds (copies back after copies out, residency, memory), on plans with copies among them, graph inputs' too."""
    checked = with_copies = inputs = 0
    for seed in range(300):
        rng = random.Random(seed)
        p = random_problem(rng, n_ops=rng.randint(6, 12), n_alts=3, training=True)
        for t in p.tensors:
            if t.can_offload:
                t.d2h_ticks = t.h2d_ticks = rng.randint(1, 12)
                t.d2h_us = t.h2d_us = float(t.d2h_ticks)
        if rng.random() < 0.5:  # a graph input read first and again backward: its copy out takes no time
            back, h2d = rng.randrange(len(p.ops) // 2, len(p.ops)), rng.randint(1, 12)
            p.tensors.append(TensorUse("input", rng.randint(100, 1000), None, [0], [back], False, can_offload=True,
                                       d2h_ticks=1, h2d_ticks=h2d, h2d_us=float(h2d)))
            p.ops[0].reads.append(len(p.tensors) - 1)
            p.ops[back].reads.append(len(p.tensors) - 1)
        low, high = memory_lower_bound(p)[0], peak_memory(p, {}, timed(p, baseline(p)))[0]
        cap = rng.randint(low, high)
        outcome = fit_cap(p, cap, 3)
        if outcome is None or not outcome.fits:
            continue
        plan = build_plan(EMPTY, p, outcome.schedule, _totals(cap), 3)
        s = serial_form(p, plan, cap)
        assert s is not None, seed
        one = build_plan(EMPTY, p, s, _totals(cap), 1)
        report = check_plan(one)
        assert one.compute_streams == 1 and report.ok, (seed, report.violations)
        checked, with_copies = checked + 1, with_copies + bool(plan.copies)
        inputs += any(c.tensor == "input" for c in plan.copies)
    assert checked >= 60 and with_copies >= 5 and inputs >= 3, (checked, with_copies, inputs)


def _totals(cap_bytes: int) -> Totals:
    return Totals(makespan_us=0.0, peak_bytes=0, mem_cap_bytes=cap_bytes, lower_bound_us=0.0, baseline_makespan_us=0.0,
                  status="", gap=0.0, solve_time_s=0.0)
