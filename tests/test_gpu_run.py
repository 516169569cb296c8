"""`planner run` end to end on a small network with every op kind: profile, solve, run the planned and the
serial baseline plan, inference and training, and capped training plans with offloads and recomputations;
every run must validate against the NumPy reference and stay under its cap. Skipped without a GPU."""

import importlib.util

import pytest

from planner.onnx_import import import_onnx
from planner.solve import CapTooSmall, Options, solve_plan
from planner.store import ProfileStore, profile_graph
from planner.training import build_training
from runner.arena import DRIVER_PAGE_BYTES
from test_gpu_ops import _small_training_model
from test_gpu_profile import _inception

pytestmark = pytest.mark.gpu
CP_SAT = importlib.util.find_spec("ortools") is not None  # without it (the GPU machine), the heuristic plans


def _options(time_limit_s: float, **kw) -> Options:
    return Options(time_limit_s=time_limit_s if CP_SAT else 0, workers=4, **kw)


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
    _run_and_check(graph, solve_plan(graph, profile, device.memory_bytes, _options(5)), device)
    baseline = solve_plan(graph, profile, device.memory_bytes, Options(baseline=True))
    assert baseline.compute_streams == 1
    _run_and_check(graph, baseline, device)


@pytest.mark.parametrize("recompute", [False, True], ids=["offload", "offload+recompute"])
def test_capped_training_plan_validates(tmp_path, recompute):
    """Under a cap that forces offloads (and recomputations, BatchNormalization with its saved statistics),
    offloaded tensors come back bit for bit and the iteration still validates. Batch 512: only saved tensors
    of 1 MiB or more may be offloaded or recomputed, and the runner's 2-MiB pages stay a tenth of the
    activations (with the analytic H100 profile, 80% of them needs copies)."""
    graph, profile, device = _profiled(tmp_path, True, batch=512)
    plan = _capped_plan(graph, profile, device, recompute)
    if plan is None:
        pytest.skip("no feasible cap from 90% of the activations down needed an offload or a recomputation")
    report = _run_and_check(graph, plan, device)
    assert any(c.what == "round_trip" for c in report.checks) == bool(plan.copies)


def _capped_plan(graph, profile, device, recompute: bool):
    """The first plan that offloads (or recomputes) as the cap steps down by 5% of the full plan's activations,
    then halves the step between the lowest cap met without and the highest too small: the uncapped plan
    spends memory on speed, so its activations overstate what the heuristic (no OR-Tools) needs, and the
    caps that force copies may lie in one step."""
    full = solve_plan(graph, profile, device.memory_bytes, _options(5))
    activations = full.totals.peak_bytes - full.totals.resident_bytes

    def attempt(cap_bytes: int):
        try:
            return solve_plan(graph, profile, cap_bytes, _options(10, recompute=recompute))
        except CapTooSmall:
            return None

    def forced(plan) -> bool:
        return bool(plan.copies) or any(op.recompute_of for op in plan.ops)

    met = too_small = None
    for twentieths in range(18, 3, -1):
        cap = full.totals.resident_bytes + activations * twentieths // 20 + DRIVER_PAGE_BYTES
        plan = attempt(cap)
        if plan is None:
            too_small = cap
            break
        if forced(plan):
            return plan
        met = cap
    for _ in range(6 if met and too_small else 0):
        cap = (met + too_small) // 2
        plan = attempt(cap)
        if plan is None:
            too_small = cap
        elif forced(plan):
            return plan
        else:
            met = cap
    return None


def _every_path_plan(graph, profile, device, deep: bool = False):
    """Each recomputable saved tensor recomputed (with `deep`, each that has a deep way that way), every other
    choosable one offloaded: the list schedule of these decisions on four streams, as a plan."""
    from planner.deep import with_deep
    from planner.heuristic import list_schedule
    from planner.problem import build_problem
    from planner.streams import build_plan

    p = build_problem(graph, profile)
    if deep:
        p = with_deep(p, {t for t, u in enumerate(p.tensors) if u.deep})
        assert any(len(u.recompute_chain) > 2 and "conv" in {p.ops[o].kind for o in u.recompute_chain}
                   for u in p.tensors if u.can_recompute)
    decision = {t: "recompute" if u.can_recompute else "offload" for t, u in enumerate(p.tensors) if u.choosable}
    recomputed = {p.ops[p.tensors[t].producer].kind for t, d in decision.items() if d == "recompute"}
    assert "conv" in recomputed and "offload" in decision.values()
    outcome = list_schedule(p, device.memory_bytes, 4, decision)
    plan = build_plan(graph, p, outcome.schedule, _totals(device.memory_bytes), 4)
    assert sum(op.recompute_of is not None for op in plan.ops) == list(decision.values()).count("recompute")
    return plan


def _totals(cap_bytes: int):
    from planner.plan import Totals

    return Totals(makespan_us=0.0, peak_bytes=0, mem_cap_bytes=cap_bytes, lower_bound_us=0.0,
                  baseline_makespan_us=0.0, status="list", gap=0.0, solve_time_s=0.0)


def test_every_recomputation_and_offload_at_once_validates(tmp_path):
    """Not what a solver would pick, but every path at once: each recomputable saved tensor recomputed
    (convolutions from their saved input, BatchNormalization with its saved statistics, chains, fused bn_apply,
    nested ones reading other recomputed tensors), every other choosable one offloaded; the list schedule of
    these decisions, as a plan, validates on the GPU."""
    graph, profile, device = _profiled(tmp_path, True, batch=1024)  # every saved tensor of 1 MiB or more
    _run_and_check(graph, _every_path_plan(graph, profile, device), device)


def test_every_deep_recomputation_at_once_validates(tmp_path):
    """The same with every deep recomputation (planner.deep): a chain that re-runs a convolution, then its
    BatchNormalization and ReLU as the fused kernel, from the convolution's input; it validates."""
    graph, profile, device = _profiled(tmp_path, True, batch=1024)
    _run_and_check(graph, _every_path_plan(graph, profile, device, deep=True), device)


def test_a_plan_in_serial_form_validates(tmp_path):
    """That plan in serial form (planner.serialize, what solve offers under a binding cap): one compute stream,
    the same copies and recomputations, each op on its fastest algorithm within the plan's peak; it validates."""
    from planner.problem import build_problem
    from planner.serialize import serial_form
    from planner.streams import build_plan

    graph, profile, device = _profiled(tmp_path, True, batch=1024)
    plan = _every_path_plan(graph, profile, device)
    p1 = build_problem(graph, profile, streams=1)
    one = build_plan(graph, p1, serial_form(p1, plan, plan.totals.peak_bytes), _totals(device.memory_bytes), 1)
    assert one.compute_streams == 1 and len(one.copies) == len(plan.copies)
    assert one.totals.peak_bytes <= plan.totals.peak_bytes
    _run_and_check(graph, one, device)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("concat", ["view", "copy"])
def test_a_concat_its_producers_write_in_place_runs_and_validates(tmp_path, concat, train):
    """The profile measures the branches' producers both ways (inference: the convs; training: the ReLUs and
    their backward, reading the gradient's slices); a plan with the Concat as a view (each producer writing its
    channel slice) and one with the copy both run, validate and stay under the cap."""
    from runner.profiler import measure_ops, probe_device

    graph = import_onnx(_inception(tmp_path), batch=4, dtype="fp16", training=train)
    graph = build_training(graph) if train else graph
    device = probe_device()
    store = ProfileStore(tmp_path / "store", device)
    profile, _ = profile_graph(graph, store, lambda nodes: measure_ops(graph, nodes, device))
    plan = solve_plan(graph, profile, device.memory_bytes, _options(5, concat=concat))
    assert len(plan.concat_views) == (concat == "view")
    _run_and_check(graph, plan, device)
