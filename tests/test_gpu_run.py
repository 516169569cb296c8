"""`planner run` end to end on a small network with every op kind: profile, solve, run the planned and the
serial baseline plan, inference and training, and capped training plans with offloads and recomputations;
every run must validate against the NumPy reference and stay under its cap. Skipped without a GPU."""

import pytest

from planner.onnx_import import import_onnx
from planner.solve import CapTooSmall, Options, solve_plan
from planner.store import ProfileStore, profile_graph
from planner.training import build_training
from runner.arena import DRIVER_PAGE_BYTES
from test_gpu_ops import _small_training_model

pytestmark = pytest.mark.gpu


def _profiled(tmp_path, train: bool, batch: int = 4):
    from runner.profiler import measure_ops, probe_device

    graph = import_onnx(_small_training_model(tmp_path), batch=batch, dtype="fp16", training=train)
    graph = build_training(graph) if train else graph
    device = probe_device()
    store = ProfileStore(tmp_path / "store", device)
    profile, _ = profile_graph(graph, store, lambda nodes: measure_ops(graph, nodes, device))
    return graph, profile, device


def _run_and_check(graph, plan, device):
    from runner.replay import run_plan

    traces = []
    report = run_plan(graph, plan, "plan.json", device.name, iterations=3, on_trace=traces.append)
    failed = [c for c in report.checks if not c.passed]
    assert report.checks and not failed, failed
    assert report.measured_peak_bytes <= plan.totals.mem_cap_bytes
    assert report.measured_median_us > 0 and len(report.ops) == len(plan.ops)
    # the replay's trace: every kernel and copy matched to the plan item that launched it, on its stream
    (trace,) = traces
    assert trace["otherData"]["unmatched"] == 0 and trace["otherData"]["activities"] > 0
    labelled = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    missing = [o.node for o, op in zip(report.ops, plan.ops)
               if o.measured_us > 0 and not op.recompute_of and o.node not in labelled]
    assert not missing, missing
    return report


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_planned_and_baseline_runs_validate(tmp_path, train):
    graph, profile, device = _profiled(tmp_path, train)
    options = Options(time_limit_s=5, workers=4)
    _run_and_check(graph, solve_plan(graph, profile, device.memory_bytes, options), device)
    baseline = solve_plan(graph, profile, device.memory_bytes, Options(baseline=True))
    assert baseline.compute_streams == 1
    _run_and_check(graph, baseline, device)


@pytest.mark.parametrize("recompute", [False, True], ids=["offload", "offload+recompute"])
def test_capped_training_plan_validates(tmp_path, recompute):
    """Under a cap that forces offloads (and recomputations, BatchNormalization with its saved statistics),
    offloaded tensors come back bit for bit and the iteration still validates. Batch 256: only saved tensors
    of 1 MiB or more may be offloaded or recomputed (with the analytic H100 profile, 90% of the activations
    already needs 4 copies, or 1 recomputation)."""
    graph, profile, device = _profiled(tmp_path, True, batch=256)
    full = solve_plan(graph, profile, device.memory_bytes, Options(time_limit_s=5, workers=4))
    activations = full.totals.peak_bytes - full.totals.resident_bytes
    plan = None
    for tenths in range(9, 1, -1):
        try:
            plan = solve_plan(graph, profile, full.totals.resident_bytes + activations * tenths // 10
                              + 2 * DRIVER_PAGE_BYTES, Options(time_limit_s=10, workers=4, recompute=recompute))
        except CapTooSmall:
            break
        if plan.copies or any(op.recompute_of for op in plan.ops):
            break
    if plan is None or not (plan.copies or any(op.recompute_of for op in plan.ops)):
        pytest.skip("no feasible cap from 90% down to 20% of the activations needed an offload or a recomputation")
    report = _run_and_check(graph, plan, device)
    assert any(c.what == "round_trip" for c in report.checks) == bool(plan.copies)
