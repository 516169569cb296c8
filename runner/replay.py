"""Run a plan: validate the first iteration against the NumPy reference, replay it, measure time and memory.

Validation (runner/validate.py): inference outputs, or the training loss, end to end; every op's output
(inference), or every weight gradient and updated weight (training), op by op; NaN or Inf fails.
Per-op times come from a separate pass that runs each item alone between device synchronisations: the time its
kernels keep the GPU busy (CUPTI; `busy_us`); iteration times from CUDA events around each replay of the captured graph.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from planner import reference
from planner.ir import Graph
from planner.plan import Plan
from planner.report import Check, OpTiming, RunReport
from runner.cupti_trace import record_activity
from runner.executor import Execution
from runner.gpu import gpu
from runner.trace import NODE_KINDS, owners, replay_trace
from runner.validate import end_to_end, outputs_op_by_op, rounded, weights_op_by_op

WARMUP = 3


def timed_us(launch: Callable[[], None], stream, iterations: int) -> list[float]:
    """`iterations` runs of `launch` (which enqueues on `stream`), each timed alone with CUDA events."""
    cp = gpu().cp
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(iterations):
        start.record(stream)
        launch()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return times


def busy_us(kernels: list) -> float:
    """The length of the union of the kernels' [start, end] intervals: some cuDNN engines run kernels side by
    side (GoogLeNet fp32 `eng1`: four convolution kernels of ~42 us at once, 214 us summed, 56 us replayed), and
    the host's gaps between launches are not the op's."""
    total, reach = 0, 0
    for a in sorted(kernels, key=lambda a: a.start_ns):
        total += max(0, a.end_ns - max(a.start_ns, reach))
        reach = max(reach, a.end_ns)
    return total / 1e3


def per_op_times(exe: Execution) -> tuple[dict[int, float], list[Check], list]:
    """Each op run alone: measured us by plan op index. Offloaded tensors are checked bit for bit on the way:
    what the d2h copy took from the device must be what the h2d copy put back. Also the graph nodes each item
    creates, in capture order (for the trace)."""
    cp = gpu().cp
    sync = cp.cuda.Device().synchronize
    times, snapshots, checks = {}, {}, []
    with record_activity(sync, NODE_KINDS) as activities:
        exe.begin()
    nodes = owners("iteration start", 0, activities)
    for launch in exe.order:
        kind, index = exe.key[id(launch.item)]
        with record_activity(sync, NODE_KINDS) as activities:
            exe.issue_item(launch)
        nodes += owners(launch.item.trace_label, launch.stream, activities)
        if kind == "op":
            times[index] = busy_us([a for a in activities if a.kernel])
        elif launch.item.direction == "d2h":
            snapshots[launch.item.tensor] = cp.asnumpy(exe.array(("copy", index), launch.item.tensor))
        else:
            back = cp.asnumpy(exe.array(("copy", index), launch.item.tensor))
            same = np.array_equal(back.view(np.uint8), snapshots[launch.item.tensor].view(np.uint8))
            checks.append(Check(tensor=launch.item.tensor, what="round_trip", relative_error=0.0 if same else 1.0,
                                tolerance=0.0, passed=same))
    with record_activity(sync, NODE_KINDS) as activities:
        exe.end()
    return times, checks, nodes + owners("iteration end", 0, activities)


class Prepared(NamedTuple):
    launch: Callable[[], None]  # enqueues one iteration on `origin`
    origin: object  # the CuPy stream every iteration starts and ends on
    exe: Execution
    replay: object  # the captured CUDA graph (None in eager mode)


def prepare(graph: Graph, plan: Plan, host: dict[str, np.ndarray], params: dict[str, np.ndarray],
            eager: bool = False) -> Prepared:
    """A plan ready to launch: built on `params`, inputs staged from `host`, one eager iteration first (kernels
    compile and modules load outside any capture), weights reset, then captured as one CUDA graph unless eager.
    Shared by `planner run` and `planner bench`, so both time the same launches."""
    exe = Execution(graph, plan, params)
    exe.stage(host)
    origin = exe.streams[0]
    exe.issue()
    origin.synchronize()
    exe.load_parameters(params)  # the validated iteration starts from the same weights as the reference
    replay = None if eager else exe.capture()
    launch = exe.issue if eager else (lambda: replay.launch(origin))
    return Prepared(launch, origin, exe, replay)


def run_plan(graph: Graph, plan: Plan, plan_file: str, device_name: str, iterations: int = 100,
             eager: bool = False, check: bool = True, parameters: dict[str, np.ndarray] | None = None,
             on_trace: Callable[[dict], None] | None = None) -> RunReport:
    """Validate, time and measure a plan; `on_trace` receives the trace of one replay (graph mode only)."""
    values = reference.random_parameters(graph) | (parameters or {})
    host = rounded(graph, values | reference.random_inputs(graph))
    params = {k: host[k] for k in values}
    launch, origin, exe, replay = prepare(graph, plan, host, params, eager)
    launch()
    origin.synchronize()
    checks = end_to_end(exe, graph, host) if check else []
    if check:
        checks += weights_op_by_op(exe, graph) if graph.training else outputs_op_by_op(exe, graph)
    for _ in range(WARMUP):
        launch()
    times = timed_us(launch, origin, iterations)
    op_times, round_trips, nodes = per_op_times(exe)
    if on_trace and not eager:
        on_trace(replay_trace(replay, origin, nodes, plan))
    runtime_bytes = exe.runtime_bytes()
    median = statistics.median(times)
    predicted = plan.totals.predicted_us
    return RunReport(
        plan_file=plan_file, model_name=graph.model_name, batch=graph.batch, dtype=graph.dtype,
        training=graph.training, device=device_name, mode="eager" if eager else "graph", iterations=iterations,
        measured_median_us=median, measured_min_us=min(times), measured_max_us=max(times), predicted_us=predicted,
        error=(median - predicted) / predicted, measured_peak_bytes=exe.data_bytes, runtime_bytes=runtime_bytes,
        arena_bytes=exe.arena_bytes,
        persistent_bytes=exe.persistent_bytes, predicted_peak_bytes=plan.totals.peak_bytes,
        cap_bytes=plan.totals.mem_cap_bytes, d2h_bytes=exe.copied["d2h"], h2d_bytes=exe.copied["h2d"],
        validated=check, checks=checks + round_trips,
        ops=[OpTiming(node=op.node, algorithm=op.algorithm, stream=op.stream, predicted_us=op.end_us - op.start_us,
                      measured_us=op_times.get(i, 0.0)) for i, op in enumerate(plan.ops)])
