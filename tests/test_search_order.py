"""The order fit_cap's local search tries tensors in (decisions.improve): as made, or largest first, which ends in
another local optimum; solve takes the better of the two where the cap costs most (solve_graph.COSTLY_CAP)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_solver import H100, MODELS

from planner.analytic import estimate_profile
from planner.arena_fit import ARENA_STEP, solver_cap
from planner.decisions import best_heuristic, budgeted_runs, fit_cap, fit_slack, improve
from planner.files import load_model
from planner.heuristic import cost
from planner.onnx_import import import_onnx
from planner.problem import build_problem
from planner.profile import Profile
from planner.solve_graph import COSTLY_CAP, uncapped_cost
from planner.stats import serial_peak_bytes
from planner.training import build_training


def _changed(before: dict, after: dict) -> set[int]:
    return {t for t in set(before) | set(after) if before.get(t, "keep") != after.get(t, "keep")}


@pytest.mark.parametrize("largest_first", [False, True], ids=["as-made", "largest-first"])
def test_improve_tries_tensors_in_its_order(largest_first):
    g = build_training(import_onnx(MODELS / "googlenet.train.onnx", batch=1, dtype="fp16", training=True))
    p = build_problem(g, estimate_profile(g, H100))
    cap = p.resident_bytes + int((serial_peak_bytes(g) - p.resident_bytes) * 0.7)
    start = fit_cap(p, cap, 4, 40, 1.0)
    assert start is not None and start.fits
    run, left = budgeted_runs(p, cap, 4, 1.0, None, False, 10**6)
    tried: list[int] = []

    def spy(decision):
        tried.extend(t for t in sorted(_changed(start.schedule.decision, decision)) if t not in tried)
        return run(decision)

    best = improve(p, start, spy, lambda: len(tried) < 12, largest_first=largest_first)
    assert best.fits and cost(p, best.schedule) <= cost(p, start.schedule)
    choosable = [t for t, u in enumerate(p.tensors) if u.choosable]
    expected = sorted(choosable, key=lambda t: (-p.tensors[t].bytes, t)) if largest_first else choosable
    assert tried[:5] == expected[:5]


@pytest.mark.slow
def test_largest_first_finds_the_shorter_plan_where_the_cap_costs_most():
    """ResNet-50 training b32 on the H200 profile at 30% of its serial peak, under the solver cap two arena steps
    down (where the solve's fuller search fits the arena): as made, the search offloads layer1's and layer2's
    block outputs and the forward pass waits for the copy engine; largest first it ends 10% shorter. The cap
    costs that plan far more than COSTLY_CAP of the uncapped list schedule, so solve searches both orders."""
    g = build_training(import_onnx(MODELS / "resnet50.train.onnx", batch=32, dtype="fp16", training=True))
    profile = Path(__file__).parent.parent / "profiles/h200/resnet50.train.b32.fp16.json"
    p = build_problem(g, load_model(Profile, profile), streams=4)
    cap = int(0.3 * serial_peak_bytes(g))
    target = solver_cap(g, p.resident_bytes, cap) - int(2 * ARENA_STEP * (cap - p.resident_bytes))
    slack = fit_slack(p, 4)
    as_made = best_heuristic(p, target, 4, slack, refined=True)
    largest = best_heuristic(p, target, 4, slack, refined=True, largest_first=True)
    assert cost(p, as_made) > COSTLY_CAP * uncapped_cost(p, 4, slack, None)
    assert cost(p, largest) < 0.9 * cost(p, as_made)
