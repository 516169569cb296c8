"""`planner run` end to end on a small network with every op kind: profile, solve, run the planned and the
serial baseline plan, inference and training, and a capped training plan with offloads; every run must
validate against the NumPy reference and stay under its cap. Skipped without a GPU."""

import pytest

from planner.onnx_import import import_onnx
from planner.solve import CapTooSmall, Options, solve_plan
from planner.store import ProfileStore, profile_graph
from planner.training import build_training
from test_gpu_ops import _small_training_model

pytestmark = pytest.mark.gpu


def _profiled(tmp_path, train: bool):
    from runner.profiler import measure_ops, probe_device

    graph = import_onnx(_small_training_model(tmp_path), batch=4, dtype="fp16", training=train)
    graph = build_training(graph) if train else graph
    device = probe_device()
    store = ProfileStore(tmp_path / "store", device)
    profile, _ = profile_graph(graph, store, lambda nodes: measure_ops(graph, nodes, device))
    return graph, profile, device


def _run_and_check(graph, plan, device):
    from runner.replay import run_plan

    report = run_plan(graph, plan, "plan.json", device.name, iterations=3)
    failed = [c for c in report.checks if not c.passed]
    assert report.checks and not failed, failed
    assert report.measured_peak_bytes <= plan.totals.mem_cap_bytes
    assert report.measured_median_us > 0 and len(report.ops) == len(plan.ops)
    return report


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_planned_and_baseline_runs_validate(tmp_path, train):
    graph, profile, device = _profiled(tmp_path, train)
    options = Options(time_limit_s=5, workers=4)
    _run_and_check(graph, solve_plan(graph, profile, device.memory_bytes, options), device)
    baseline = solve_plan(graph, profile, device.memory_bytes, Options(baseline=True))
    assert baseline.compute_streams == 1
    _run_and_check(graph, baseline, device)


def test_offloaded_tensors_come_back_bit_identical(tmp_path):
    graph, profile, device = _profiled(tmp_path, True)
    full = solve_plan(graph, profile, device.memory_bytes, Options(time_limit_s=5, workers=4))
    cap = full.totals.resident_bytes + (full.totals.peak_bytes - full.totals.resident_bytes) * 6 // 10
    try:
        plan = solve_plan(graph, profile, cap, Options(time_limit_s=10, workers=4, recompute=False))
    except CapTooSmall as e:
        pytest.skip(f"no offload plan at 60% of the activations: {e}")
    report = _run_and_check(graph, plan, device)
    if plan.copies:
        assert any(c.what == "round_trip" for c in report.checks)
