"""Run a plan: validate the first iteration against the NumPy reference, replay it, measure time and memory.

Validation compares, on the same random weights and inputs (rounded to the device dtypes first), the
inference outputs, or for training the loss, every weight gradient and every updated weight; NaN or Inf fails.
Per-op times come from a separate pass that runs each item alone between device synchronisations and sums its
kernels' CUPTI durations; iteration times from CUDA events around each replay of the captured graph.
"""

from __future__ import annotations

import statistics

import numpy as np

from planner import reference
from planner.ir import Graph
from planner.plan import Plan
from planner.report import Check, OpTiming, RunReport
from runner.cupti_trace import record_kernels
from runner.executor import Execution
from runner.gpu import gpu
from runner.ops.common import NUMPY_DTYPE

TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2}  # relative L2 error; fp32 allows TF32
WARMUP = 3


def _rounded(graph: Graph, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each value in its tensor's storage dtype (what the device holds)."""
    return {k: np.asarray(v).astype(NUMPY_DTYPE[graph.tensors[k].dtype]) for k, v in values.items()}


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), np.asarray(want, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _checked(graph: Graph) -> list[tuple[str, str]]:
    """(tensor, what) to compare after one iteration."""
    if not graph.training:
        return [(t, "output") for t in graph.outputs]
    out = [(n.outputs[0], "loss") for n in graph.nodes if n.kind == "softmax_xent"]
    out += [(t, "weight_gradient") for t, v in graph.tensors.items() if v.role == "gradient" and v.persistent
            and v.alias_of is None]
    out += [(n.outputs[0], "updated_weight") for n in graph.nodes if n.kind == "sgd"]
    return out


def validate(exe: Execution, graph: Graph, host_values: dict[str, np.ndarray]) -> list[Check]:
    env = reference.run(graph, {k: v.astype(np.float64) if v.dtype.kind == "f" else v
                                for k, v in host_values.items()})
    tolerance = TOLERANCE[graph.dtype]
    checks = []
    for tensor, what in _checked(graph):
        got = gpu().cp.asnumpy(exe.array(None, tensor))
        err = _relative_error(got, env[tensor])
        checks.append(Check(tensor=tensor, what=what, relative_error=err, tolerance=tolerance, passed=err <= tolerance))
    return checks


def per_op_times(exe: Execution) -> tuple[dict[int, float], list[Check]]:
    """Each op run alone: measured us by plan op index. Offloaded tensors are checked bit for bit on the way:
    what the d2h copy took from the device must be what the h2d copy put back."""
    cp = gpu().cp
    sync = cp.cuda.Device().synchronize
    times, snapshots, checks = {}, {}, []
    exe.begin()
    for launch in exe.order:
        kind, index = exe.key[id(launch.item)]
        with record_kernels(sync) as kernels:
            exe.issue_item(launch)
        if kind == "op":
            times[index] = sum(k.duration_us for k in kernels)
        elif launch.item.direction == "d2h":
            snapshots[launch.item.tensor] = cp.asnumpy(exe.array(("copy", index), launch.item.tensor))
        else:
            back = cp.asnumpy(exe.array(("copy", index), launch.item.tensor))
            same = np.array_equal(back.view(np.uint8), snapshots[launch.item.tensor].view(np.uint8))
            checks.append(Check(tensor=launch.item.tensor, what="round_trip", relative_error=0.0 if same else 1.0,
                                tolerance=0.0, passed=same))
    exe.end()
    sync()
    return times, checks


def run_plan(graph: Graph, plan: Plan, plan_file: str, device_name: str, iterations: int = 100,
             eager: bool = False, check: bool = True, parameters: dict[str, np.ndarray] | None = None) -> RunReport:
    cp = gpu().cp
    values = reference.random_parameters(graph) | (parameters or {})
    host = _rounded(graph, values | reference.random_inputs(graph))
    params = {k: host[k] for k in values}
    exe = Execution(graph, plan, params)
    for name, staged in exe.staging.items():
        staged[...] = cp.asarray(host[name])
    origin = exe.streams[0]
    exe.issue()  # eager first: kernels compile and modules load outside any capture
    origin.synchronize()
    exe.load_parameters(params)  # the validated iteration starts from the same weights as the reference
    replay = exe.issue if eager else exe.capture()
    launch = replay if eager else (lambda: replay.launch(origin))
    launch()
    origin.synchronize()
    checks = validate(exe, graph, host) if check else []
    for _ in range(WARMUP):
        launch()
    times = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(iterations):
        start.record(origin)
        launch()
        end.record(origin)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    measured_bytes = exe.measured_bytes()
    op_times, round_trips = per_op_times(exe)
    median = statistics.median(times)
    predicted = plan.totals.makespan_us
    return RunReport(
        plan_file=plan_file, model_name=graph.model_name, batch=graph.batch, dtype=graph.dtype,
        training=graph.training, device=device_name, mode="eager" if eager else "graph", iterations=iterations,
        measured_median_us=median, measured_min_us=min(times), measured_max_us=max(times), predicted_us=predicted,
        error=(median - predicted) / predicted, measured_peak_bytes=measured_bytes, arena_bytes=exe.arena_bytes,
        persistent_bytes=exe.persistent_bytes, predicted_peak_bytes=plan.totals.peak_bytes,
        cap_bytes=plan.totals.mem_cap_bytes, d2h_bytes=exe.copied["d2h"], h2d_bytes=exe.copied["h2d"],
        validated=check, checks=checks + round_trips,
        ops=[OpTiming(node=op.node, algorithm=op.algorithm, stream=op.stream, predicted_us=op.end_us - op.start_us,
                      measured_us=op_times.get(i, 0.0)) for i, op in enumerate(plan.ops)])
