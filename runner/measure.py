"""Measure every candidate of every op on the GPU: time by CUDA-graph replay, output checked once.

Timing: R launches of a candidate (inputs rotated over several random sets, so caches do not flatter) are
captured once as a CUDA graph; the graph is replayed and the median over replays, divided by R, is the time.
A single launch timed from Python would measure launch overhead, not the kernel.
"""

from __future__ import annotations

import statistics
from typing import Iterator

import numpy as np

from planner.analytic import estimate_ops
from planner.ir import Graph, Node
from planner.occupancy import candidate_sm_fraction, dram_fraction, kernel_blocks_per_sm
from planner.profile import Candidate, DeviceInfo, OpProfile, Unsupported, describe_op, prune_candidates
from planner.reference import KERNELS as REFERENCE
from runner.cupti_trace import record_kernels
from runner.gpu import cupy_dtype, gpu, nhwc_empty
from runner.ops.conv import CONV_KINDS, ConvOp

LAUNCHES_PER_GRAPH = 10
REPLAYS = 10
INPUT_SETS = 3
SLOWER_THAN_BEST_LIMIT = 50.0
WORKSPACE_LIMIT_BYTES = 4 << 30
TOLERANCE = {"fp16": 2e-2, "fp32": 5e-3}  # relative L2 error; fp32 convs may use TF32


def replay_time_us(launch, stream, reps: int = REPLAYS) -> float:
    """Median per-launch time of `launch(i)` for i in range(LAUNCHES_PER_GRAPH), captured as one CUDA graph."""
    cp = gpu().cp
    with stream:
        launch(0)  # warm-up outside the capture: lazy initialisation must not be captured
        stream.begin_capture()
        for i in range(LAUNCHES_PER_GRAPH):
            launch(i)
        graph = stream.end_capture()
    graph.upload(stream)
    graph.launch(stream)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / LAUNCHES_PER_GRAPH)
    return statistics.median(times)


def _random_nhwc(dims, dtype, rng):
    arr = nhwc_empty(dims, dtype)
    host = rng.standard_normal(dims).astype(np.float32)
    arr[...] = gpu().cp.asarray(host).astype(cupy_dtype(dtype))
    return arr, host


def _relative_error(got, want) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


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


def measure_conv(graph: Graph, node: Node, device: DeviceInfo, handle, stream, rng) -> OpProfile:
    cp = gpu().cp
    a_name, b_name = node.inputs[0], node.inputs[1]
    out_name = node.outputs[0]
    dims = {t: graph.tensors[t].shape for t in (a_name, b_name, out_name)}
    attrs = node.attrs
    if node.kind == "conv":
        x_dims, w_dims, y_dims = dims[a_name], dims[b_name], dims[out_name]
    elif node.kind == "conv_bwd_data":
        x_dims, w_dims, y_dims = dims[out_name], dims[b_name], dims[a_name]
    else:
        x_dims, w_dims, y_dims = dims[a_name], dims[out_name], dims[b_name]
    op = ConvOp(node.kind, attrs, x_dims, w_dims, y_dims, graph.dtype, handle)
    sets = [(_random_nhwc(dims[a_name], graph.dtype, rng), _random_nhwc(dims[b_name], graph.dtype, rng))
            for _ in range(INPUT_SETS)]
    out = nhwc_empty(dims[out_name], graph.dtype)
    (ha, hb) = sets[0][0][1], sets[0][1][1]
    ref_attrs = {**attrs, "x_shape": x_dims, "w_shape": w_dims}
    want = REFERENCE[node.kind]([ha.astype(np.float64), hb.astype(np.float64)], ref_attrs)[0]
    unsupported = [Unsupported(name=n, reason=r) for n, r in op.unsupported]
    min_bytes = sum(graph.tensors[t].bytes for t in (a_name, b_name, out_name))
    candidates, best = [], float("inf")
    for index, name, workspace_bytes in op.candidates:
        if workspace_bytes > WORKSPACE_LIMIT_BYTES:
            unsupported.append(Unsupported(name=name, reason=f"workspace {workspace_bytes} bytes over the limit"))
            continue
        workspace = cp.empty(max(workspace_bytes, 1), cp.uint8)
        try:
            out[...] = cp.nan
            with record_kernels(stream.synchronize) as kernels:
                op.launch(index, sets[0][0][0], sets[0][1][0], out, workspace)
            err = _relative_error(cp.asnumpy(out.astype(cp.float32)), want)
            if not err <= TOLERANCE[graph.dtype]:
                unsupported.append(Unsupported(name=name, reason=f"wrong output (relative error {err:.2e})"))
                continue
            time_us = replay_time_us(lambda i: op.launch(index, sets[i % INPUT_SETS][0][0],
                                                         sets[i % INPUT_SETS][1][0], out, workspace), stream)
        except Exception as e:  # noqa: BLE001 - an engine that fails to run is recorded with its reason
            unsupported.append(Unsupported(name=name, reason=f"{type(e).__name__}: {str(e)[:160]}"))
            continue
        if time_us > SLOWER_THAN_BEST_LIMIT * best:
            unsupported.append(Unsupported(name=name, reason=f"{time_us:.0f} us: over 50x the best"))
            continue
        best = min(best, time_us)
        candidates.append(cost_vector(device, name, time_us, workspace_bytes, kernels, min_bytes))
    return OpProfile(signature=node.signature, kind=node.kind, describe=describe_op(node, graph),
                     candidates=prune_candidates(candidates), measured_count=len(candidates), unsupported=unsupported)


def measure_ops(graph: Graph, nodes: list[Node], device: DeviceInfo, counters: bool = False) -> Iterator[OpProfile]:
    """Measured profiles for convolution kinds; other kinds get analytic estimates, marked estimated."""
    cp, cudnn = gpu().cp, gpu().cudnn
    handle = cudnn.create_handle()
    stream = cp.cuda.Stream(non_blocking=True)
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    rng = np.random.default_rng(0)
    others = [n for n in nodes if n.kind not in CONV_KINDS]
    for op in estimate_ops(graph, device, others):
        op.estimated = True
        yield op
    for node in nodes:
        if node.kind in CONV_KINDS:
            with stream:
                yield measure_conv(graph, node, device, handle, stream, rng)
            cp.get_default_memory_pool().free_all_blocks()
