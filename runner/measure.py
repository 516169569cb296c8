"""Measure every candidate of every op on the GPU (one registry, runner/ops, for every kind): time by CUDA-graph
replay, output checked once against the float64 reference at the profiled shape.

Timing: R and 2R launches of a candidate (inputs rotated over several random sets, so caches do not flatter)
are captured as two CUDA graphs, replayed in turn; the difference of their medians over R is the time: what the
op adds inside a graph, as it runs inside the plan's. A graph's launch has a fixed cost of its own (about 4 us on
the H200) that a single graph's time divided by R charged to every op: 0.48 us each on GoogLeNet inference batch 1,
whose serial plan was predicted 15% over its run (docs/BENCHMARKS.md, fifty-first session). A single launch timed
from Python would measure launch overhead, not the kernel. R is 10, fewer for slow candidates (judged by the
CUPTI-timed check run, which also drops those over 50x the best before any replay).
"""

from __future__ import annotations

import math
import statistics
from typing import Iterator

import numpy as np

from planner.analytic import estimate_ops
from planner.ir import Graph, Node
from planner.occupancy import candidate_sm_fraction, dram_fraction, kernel_blocks_per_sm
from planner.ops import KINDS
from planner.profile import (TIMING, Candidate, DeviceInfo, OpProfile, Unsupported, describe_op,
                             prune_candidates)
from planner.reference import KERNELS as REFERENCE
from runner.cupti_trace import record_kernels
from runner.gpu import gpu
from runner.graphs import capture
from runner.ops import build_op, host_inputs, implementations, in_place, node_specs
from runner.ops.common import device_empty, to_device

LAUNCHES_PER_GRAPH = 10
GRAPH_TARGET_US = 500.0  # slow candidates get fewer launches per graph: the graph, not the launch count, is timed
REPLAYS = 10
MIN_MARGINAL_SHARE = 0.5  # a floor on the marginal time against the R-launch graph's time per launch (noise)
INPUT_SETS = 3
SLOWER_THAN_BEST_LIMIT = 50.0
WORKSPACE_LIMIT_BYTES = 4 << 30
TOLERANCE = {"fp16": 2e-2, "fp32": 5e-3}  # relative L2 error; fp32 convs may use TF32


def launches_for(kernel_us: float) -> int:
    """Launches per captured graph: up to LAUNCHES_PER_GRAPH, fewer once the graph would exceed GRAPH_TARGET_US."""
    return max(1, min(LAUNCHES_PER_GRAPH, math.ceil(GRAPH_TARGET_US / max(kernel_us, 1e-3))))


def replay_time_us(launch, stream, reps: int = REPLAYS, launches: int = LAUNCHES_PER_GRAPH) -> float:
    """What one more launch of `launch(i)` adds inside a CUDA graph: graphs of `launches` and twice as many launches
    (i = 0, 1, ...) replayed in turn, the difference of their median times over `launches` (module docstring)."""
    cp = gpu().cp

    def launch_all(count: int):
        def issue():
            for i in range(count):
                launch(i)
        return issue

    with stream:
        launch(0)  # warm-up outside the capture: lazy initialisation must not be captured
        graphs = [capture(stream, launch_all(count)) for count in (launches, 2 * launches)]  # memsets as kernels
    for graph in graphs:
        graph.launch(stream)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times: list[list[float]] = [[], []]
    for _ in range(reps):
        for graph, kept in zip(graphs, times):
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            kept.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    single, double = (statistics.median(t) for t in times)
    return max((double - single) / launches, MIN_MARGINAL_SHARE * single / launches)


def output_error(outputs: list, want: list) -> float:
    """Worst relative L2 error of the float outputs; inf if an integer output (a mask) differs at all. `want`
    holds the reference outputs on the device (float64 for float outputs), so a large output is compared
    there, not copied to the host for every candidate."""
    cp = gpu().cp
    worst = 0.0
    for arr, expected in zip(outputs, want):
        if expected.dtype.kind != "f":
            if not bool(cp.array_equal(arr, expected)):
                return float("inf")
            continue
        err = float(cp.linalg.norm(arr.astype(cp.float64) - expected) / max(float(cp.linalg.norm(expected)), 1e-30))
        if not np.isfinite(err):
            return float("inf")
        worst = max(worst, err)
    return worst


def cost_vector(device: DeviceInfo, name: str, time_us: float, workspace_bytes: int, kernels, min_bytes: int):
    """A Candidate from its time and its kernels' launch records: occupancy, SM share, DRAM share."""
    for k in kernels:
        k.blocks_per_sm = kernel_blocks_per_sm(device, k)
    main = max(kernels, key=lambda k: k.duration_us, default=None)
    return Candidate(
        name=name, time_us=time_us, workspace_bytes=workspace_bytes, kernels=kernels,
        registers_per_thread=max((k.registers_per_thread for k in kernels), default=0),
        shared_mem_bytes=max((k.static_shared_bytes + k.dynamic_shared_bytes for k in kernels), default=0),
        threads_per_block=int(np.prod(main.block)) if main else 0, grid_blocks=int(np.prod(main.grid)) if main else 0,
        sm_fraction=candidate_sm_fraction(device, kernels), dram_fraction=dram_fraction(device, min_bytes, time_us),
    )


class NodeData:
    """INPUT_SETS random input sets of one node on the device, their host copies, and the outputs each set's
    launch writes (the set's own inputs where the node updates in place, shared buffers otherwise)."""

    def __init__(self, graph: Graph, node: Node, rng):
        self.in_specs, self.out_specs = node_specs(graph, node)
        self.hosts = [host_inputs(node.kind, self.in_specs, rng) for _ in range(INPUT_SETS)]
        self.inputs = [[to_device(h, s) for h, s in zip(hosts, self.in_specs)] for hosts in self.hosts]
        aliases = in_place(graph, node)
        self.in_place = aliases
        shared = [None if j in aliases else device_empty(s) for j, s in enumerate(self.out_specs)]
        self.outputs = [[ins[aliases[j]] if j in aliases else shared[j] for j in range(len(shared))]
                        for ins in self.inputs]
        self.shared = [a for a in shared if a is not None]

    def reset(self) -> None:
        """Set 0 as the reference saw it (undoing in-place updates); poison the outputs so a missed write shows."""
        for j in self.in_place.values():
            self.inputs[0][j][...] = gpu().cp.asarray(self.hosts[0][j])
        for arr in self.shared:
            arr.fill(np.nan if arr.dtype.kind == "f" else 2)

    def reference(self, kind: str, attrs: dict) -> list:
        values = [h.astype(np.float64) if h.dtype.kind == "f" else h for h in self.hosts[0]]
        return REFERENCE[kind](values, attrs)


def measure_node(graph: Graph, node: Node, device: DeviceInfo, handle, stream, rng) -> OpProfile:
    """Every candidate of one node: run once on input set 0 and checked against the reference (kernels recorded
    by CUPTI), then timed by CUDA-graph replay over the rotated input sets."""
    cp = gpu().cp
    describe = describe_op(node, graph)
    try:
        op = build_op(graph, node, handle)
    except Exception as e:  # noqa: BLE001 - no implementation takes this node: say why, estimate it
        return _estimated(graph, node, device, [Unsupported(name=node.kind, reason=f"{type(e).__name__}: {e}")])
    data = NodeData(graph, node, rng)
    want = [cp.asarray(np.asarray(w, dtype=np.float64) if s.dtype.startswith("fp") else w)
            for w, s in zip(data.reference(node.kind, node.attrs), data.out_specs)]
    unsupported = [Unsupported(name=n, reason=r) for n, r in op.unsupported]
    min_bytes = sum(graph.tensors[t].bytes for t in node.inputs + node.outputs)
    candidates, best = [], float("inf")
    for index, (name, workspace_bytes) in enumerate(op.candidates):
        if workspace_bytes > WORKSPACE_LIMIT_BYTES:
            unsupported.append(Unsupported(name=name, reason=f"workspace {workspace_bytes} bytes over the limit"))
            continue
        workspace = cp.empty(max(workspace_bytes, 1), cp.uint8)
        try:
            data.reset()
            with record_kernels(stream.synchronize) as kernels:
                op.launch(index, data.inputs[0], data.outputs[0], workspace)
            err = output_error(data.outputs[0], want)
            if not err <= TOLERANCE[graph.dtype]:
                unsupported.append(Unsupported(name=name, reason=f"wrong output (relative error {err:.2e})"))
                continue
            kernel_us = sum(k.duration_us for k in kernels)  # the checked run, as CUPTI timed its kernels
            if kernel_us > SLOWER_THAN_BEST_LIMIT * best:
                unsupported.append(Unsupported(name=name, reason=f"{kernel_us:.0f} us: over 50x the best"))
                continue
            time_us = replay_time_us(lambda i: op.launch(index, data.inputs[i % INPUT_SETS],
                                                         data.outputs[i % INPUT_SETS], workspace), stream,
                                     launches=launches_for(kernel_us))
        except Exception as e:  # noqa: BLE001 - an implementation that fails to run is recorded with its reason
            unsupported.append(Unsupported(name=name, reason=f"{type(e).__name__}: {str(e)[:160]}"))
            continue
        if time_us > SLOWER_THAN_BEST_LIMIT * best:
            unsupported.append(Unsupported(name=name, reason=f"{time_us:.0f} us: over 50x the best"))
            continue
        best = min(best, time_us)
        candidates.append(cost_vector(device, name, time_us, workspace_bytes, kernels, min_bytes))
    if not candidates:
        return _estimated(graph, node, device, unsupported)
    return OpProfile(signature=node.signature, kind=node.kind, describe=describe, timing=TIMING,
                     candidates=prune_candidates(candidates), measured_count=len(candidates), unsupported=unsupported,
                     implementations=implementations(graph, node))


def _estimated(graph: Graph, node: Node, device: DeviceInfo, unsupported: list[Unsupported]) -> OpProfile:
    """The analytic estimate, marked estimated, for a node no GPU candidate could run correctly."""
    op = estimate_ops(graph, device, [node])[0]
    op.estimated = True
    op.unsupported = unsupported + op.unsupported
    return op


def measure_ops(graph: Graph, nodes: list[Node], device: DeviceInfo) -> Iterator[OpProfile]:
    """Measured profiles of the given nodes; views cost nothing and get the analytic model's zero-cost entry."""
    cp, cudnn = gpu().cp, gpu().cudnn
    handle = cudnn.create_handle()
    stream = cp.cuda.Stream(non_blocking=True)
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    rng = np.random.default_rng(0)
    for node in nodes:
        if KINDS[node.kind].view:
            yield from estimate_ops(graph, device, [node])
            continue
        with stream:
            profile = measure_node(graph, node, device, handle, stream, rng)
        cp.get_default_memory_pool().free_all_blocks()
        yield profile
