"""A plan on the GPU: one arena, the plan's streams, events, copies and recomputations, replayed as a CUDA graph.

Memory: every non-persistent tensor and workspace lives in one device allocation at the offset that
runner/arena.py gives its residency interval; weights, their gradients, optimizer and BatchNormalization state
are separate allocations. Reusing arena bytes is made safe by extra waits (arena.add_reuse_waits), so a wrong
prediction costs time, never correctness. Every 4-D tensor is NHWC in memory (runner/ops/common.py); the NCHW
inputs are converted once, at the start of the iteration, on the first stream.

Streams: stream 0 is the origin; the others fork from it (an event after the input conversion) and join it at
the end, which is also what CUDA-graph capture needs.
"""

from __future__ import annotations

import math

import numpy as np

from planner.files import PlannerError
from planner.fuse import as_planned
from planner.ir import Graph, recompute_nodes
from planner.memsize import fmt_bytes
from planner.plan import FUSED_RECOMPUTE, Copy, Plan, ScheduledOp
from runner.arena import add_reuse_waits, aligned, assign_offsets, first_over, persistent_tensors, plan_blocks
from runner.gpu import gpu
from runner.graphs import Replay, capture
from runner.launch_order import launch_order
from runner.ops import build_op
from runner.ops.common import NUMPY_DTYPE, physical, spec
from runner.ops.norm import BatchNormApply

H2D, D2H = 1, 2  # cudaMemcpyKind


def strided_view(memptr, shape: list[int], dtype: str):
    """A CuPy array over raw device memory in the runner's layout (NHWC strides for 4-D, row-major else)."""
    cp = gpu().cp
    itemsize = np.dtype(NUMPY_DTYPE[dtype]).itemsize
    if len(shape) == 4:
        n, c, h, w = shape
        strides = tuple(s * itemsize for s in (h * w * c, 1, w * c, c))
    else:
        strides = tuple(math.prod(shape[i + 1:]) * itemsize for i in range(len(shape)))
    return cp.ndarray(tuple(shape), dtype=NUMPY_DTYPE[dtype], memptr=memptr, strides=strides)


def _device_malloc(size_bytes: int):
    """A cudaMalloc of our own, outside CuPy's pool, so the driver's free-memory counter sees exactly it."""
    cp = gpu().cp
    return cp.cuda.MemoryPointer(cp.cuda.Memory(max(size_bytes, 1)), 0)


def _same_memory_order(a: list[int], b: list[int]) -> bool:
    """A view is free when both shapes list the elements in the same memory order."""
    squeeze = lambda s: [d for d in physical(s) if d != 1]  # noqa: E731
    return squeeze(a) == squeeze(b) or len(a) != 4 and len(b) != 4


class Execution:
    """Everything one plan needs on the device, built once; `issue()` enqueues one iteration."""

    def __init__(self, graph: Graph, plan: Plan, parameters: dict[str, np.ndarray]):
        cp, cudnn = gpu().cp, gpu().cudnn
        if plan.graph_sha256 != graph.graph_sha256:
            raise PlannerError("the plan was made for another model graph (batch, dtype or file differ)")
        graph = as_planned(graph, plan.bn_relu_fused, plan.concat_views, plan.relu_sums_fused)
        self.graph, self.nodes = graph, graph.node_by_name
        blocks, uses, self.block_of = plan_blocks(plan)
        self.offsets, self.arena_bytes = assign_offsets(blocks)
        persistent = persistent_tensors(graph)
        at = np.cumsum([0] + [aligned(t.bytes) for t in persistent])
        self.persistent_bytes = int(at[-1])
        _check_cap(plan, blocks, self.offsets, self.persistent_bytes)
        self.plan = add_reuse_waits(plan, blocks, uses, self.offsets)
        self.order = launch_order(self.plan)
        self.key = {id(op): ("op", i) for i, op in enumerate(self.plan.ops)}
        self.key |= {id(c): ("copy", j) for j, c in enumerate(self.plan.copies)}
        stream_ids = sorted({op.stream for op in plan.ops} | {c.stream for c in plan.copies} | {0})
        self.streams = {s: cp.cuda.Stream(non_blocking=True) for s in stream_ids}
        self.handles = {}
        for s in {op.stream for op in plan.ops} | {0}:
            self.handles[s] = cudnn.create_handle()
            cudnn.set_stream(handle=self.handles[s], stream=self.streams[s].ptr)
        self.events = {e: cp.cuda.Event(disable_timing=True) for it in self.plan.ops + self.plan.copies
                       for e in [it.record_event, *it.wait_events] if e}
        self.fork, self.joins = cp.cuda.Event(disable_timing=True), {s: cp.cuda.Event(disable_timing=True)
                                                                      for s in stream_ids if s}
        self.staging = {t: cp.empty(graph.tensors[t].shape, NUMPY_DTYPE[graph.tensors[t].dtype])
                        for t in graph.inputs}
        self.fused = recompute_nodes(graph)
        self.ops = [self._build(i, op) for i, op in enumerate(self.plan.ops)]
        cp.cuda.Device().synchronize()
        cp.get_default_memory_pool().free_all_blocks()
        self.free_before = cp.cuda.runtime.memGetInfo()[0]
        base = _device_malloc(self.persistent_bytes + self.arena_bytes)  # one allocation: one part-used page
        self.arena = base + self.persistent_bytes
        self.persistent = {t.name: strided_view(base + int(off), t.shape, t.dtype) for t, off in zip(persistent, at)}
        cp.cuda.Device().synchronize()
        self.data_bytes = self.free_before - cp.cuda.runtime.memGetInfo()[0]
        self.load_parameters(parameters)
        self.host = {c.tensor: cp.cuda.alloc_pinned_memory(c.bytes) for c in self.plan.copies if c.direction == "d2h"}
        self.copied = {"d2h": sum(c.bytes for c in plan.copies
                                  if c.direction == "d2h" and c.tensor not in self.staging),  # staged: none
                       "h2d": sum(c.bytes for c in plan.copies if c.direction == "h2d")}

    def stage(self, inputs: dict[str, np.ndarray]) -> None:
        """The graph inputs' values, converted at each iteration's start; for an input the plan offloads, also its
        pinned host copy in the device layout, which the batch's host copy is: its copy out then copies nothing."""
        cp = gpu().cp
        for name, staged in self.staging.items():
            staged[...] = cp.asarray(inputs[name])
            if name in self.host:
                t = self.graph.tensors[name]
                device = cp.empty(t.bytes, cp.uint8)
                strided_view(device.data, t.shape, t.dtype)[...] = staged
                cp.cuda.runtime.memcpy(self.host[name].ptr, device.data.ptr, t.bytes, D2H)

    def load_parameters(self, parameters: dict[str, np.ndarray]) -> None:
        """Weights and state from host values; everything persistent without a value (momentum) to zero."""
        for name, arr in self.persistent.items():
            if name in parameters:
                arr[...] = gpu().cp.asarray(parameters[name].astype(arr.dtype))
            else:
                arr.fill(0)

    def _build(self, i: int, op: ScheduledOp):
        """(node, GPU op, candidate index) for each node the plan op runs: one; a fused recomputation's bn_apply
        node; or a recomputation's chain, where BatchNormalization is re-applied with its saved statistics and
        each other op runs the candidate named in the plan's `a+b` algorithm (its fastest); a deep recomputation's
        tail may run as one fused kernel, named last."""
        if op.recompute_of and op.algorithm.startswith(FUSED_RECOMPUTE):
            return [self._fused(op.recompute_nodes, op.algorithm, op.stream)]
        names = op.recompute_nodes or [op.node]
        wanted = op.algorithm.split("+") if op.recompute_of else [op.algorithm]
        tail = []  # a deep recomputation's tail that runs as one fused bn_apply kernel (its last `a+b` part)
        if op.recompute_of and len(wanted) < len(names) and wanted[-1].startswith(FUSED_RECOMPUTE):
            tail = [self._fused(names[len(wanted) - 1:], wanted[-1], op.stream)]
            names, wanted = names[:len(wanted) - 1], wanted[:-1]
        built = []
        for name, algorithm in zip(names, wanted if len(wanted) == len(names) else [None] * len(names)):
            node = self.nodes[name]
            if op.recompute_of and node.kind == "batchnorm":
                x = self.graph.tensors[node.inputs[0]]
                built.append((node, BatchNormApply(node.attrs, spec(x.shape, x.dtype)), 0))
                continue
            impl = build_op(self.graph, node, self.handles[op.stream], algorithm)
            candidates = [c for c, _ in impl.candidates]
            if algorithm not in candidates and not op.recompute_of:
                raise PlannerError(f"op {name!r}: the plan's algorithm {algorithm!r} does not build here "
                                   f"(this GPU builds {len(candidates)}: {', '.join(candidates[:3])}...)")
            built.append((node, impl, candidates.index(algorithm) if algorithm in candidates else 0))
        return built + tail

    def _fused(self, names: list[str], algorithm: str, stream: int):
        """(node, GPU op, candidate index) of the bn_apply kernel that runs the chain `names` as one."""
        node = self.fused[tuple(names)]
        impl = build_op(self.graph, node, self.handles[stream])
        return node, impl, [c for c, _ in impl.candidates].index(algorithm[len(FUSED_RECOMPUTE):])

    def array(self, key: tuple[str, int] | None, tensor: str):
        """The device array of `tensor` as plan item `key` sees it (None: before any item, a graph input)."""
        t = self.graph.tensors[tensor]
        storage = self.graph.storage_of(tensor)
        base = self.graph.tensors[storage]
        if t.channel_offset is None and not _same_memory_order(base.shape, t.shape):
            raise PlannerError(f"{tensor!r} is a view {t.shape} of {storage!r} {base.shape} whose NHWC memory "
                               "order differs; the runner does not transpose views yet")
        if storage in self.persistent:
            return strided_view(self.persistent[storage].data, t.shape, t.dtype)
        block = self.block_of.get((key, storage)) or f"{storage}#0"
        if block not in self.offsets:
            raise PlannerError(f"tensor {storage!r} has no residency in the plan")
        if t.channel_offset is not None:  # its producer writes straight into a concat_view's output
            whole = strided_view(self.arena + self.offsets[block], base.shape, base.dtype)
            return whole[:, t.channel_offset:t.channel_offset + t.shape[1]]
        return strided_view(self.arena + self.offsets[block], t.shape, t.dtype)

    def workspace(self, i: int):
        cp = gpu().cp
        op = self.plan.ops[i]
        if not op.workspace_bytes:
            return cp.ndarray((1,), cp.uint8, memptr=self.arena)  # never written: every candidate said 0 bytes
        return cp.ndarray((op.workspace_bytes,), cp.uint8, memptr=self.arena + self.offsets[f"ws:{i}"])

    def launch_op(self, i: int) -> None:
        op = self.plan.ops[i]
        key = ("op", i)
        workspace = self.workspace(i)
        if not op.recompute_of:
            node, impl, index = self.ops[i][0]
            impl.launch(index, [self.array(key, t) for t in node.inputs], [self.array(key, t) for t in node.outputs],
                        workspace)
            return
        made, used = {}, 0  # a chain's intermediates sit at the front of its workspace (the solver counted them)
        for k, (node, impl, index) in enumerate(self.ops[i]):
            inputs = [made.get(self.graph.storage_of(t)) for t in node.inputs]
            inputs = [a if a is not None else self.array(key, t) for a, t in zip(inputs, node.inputs)]
            outputs: list = [None] * len(node.outputs)
            first = self.graph.tensors[node.outputs[0]]
            if k == len(self.ops[i]) - 1:
                outputs[0] = self.array(key, node.outputs[0])
            else:
                outputs[0] = strided_view(workspace.data + used, first.shape, first.dtype)
                made[self.graph.storage_of(node.outputs[0])] = outputs[0]
                used += aligned(first.bytes)
            if node.kind == "batchnorm":  # unfused, re-applied: the statistics its forward pass saved
                inputs = inputs[:3] + [self.array(key, t) for t in node.outputs[3:5]] + inputs[5:]
            impl.launch(index, inputs, outputs, workspace[used:])

    def launch_copy(self, j: int, copy: Copy) -> None:
        cp = gpu().cp
        if copy.direction == "d2h" and copy.tensor in self.staging:
            return  # a graph input's host copy is staged (`stage`)
        device = self.array(("copy", j), copy.tensor)
        host = self.host[copy.tensor]
        dst, src, kind = (host.ptr, device.data.ptr, D2H) if copy.direction == "d2h" else (device.data.ptr, host.ptr, H2D)
        cp.cuda.runtime.memcpyAsync(dst, src, copy.bytes, kind, self.streams[copy.stream].ptr)

    def begin(self) -> None:
        """Convert the NCHW inputs on the origin stream; fork every other stream from it."""
        origin = self.streams[0]
        with origin:
            for name, staged in self.staging.items():
                self.array(None, name)[...] = staged
            self.fork.record(origin)
        for s, stream in self.streams.items():
            if s:
                stream.wait_event(self.fork)

    def issue_item(self, launch) -> None:
        """One plan item on its stream: its waits, its work, its record."""
        item, stream = launch.item, self.streams[launch.stream]
        for e in item.wait_events:
            stream.wait_event(self.events[e])
        kind, index = self.key[id(item)]
        with stream:
            if kind == "op":
                self.launch_op(index)
            else:
                self.launch_copy(index, item)
        if item.record_event:
            self.events[item.record_event].record(stream)

    def end(self) -> None:
        """Join every stream back into the origin."""
        for s, event in self.joins.items():
            event.record(self.streams[s])
            self.streams[0].wait_event(event)

    def issue(self) -> None:
        """Enqueue one iteration."""
        self.begin()
        for launch in self.order:
            self.issue_item(launch)
        self.end()

    def capture(self) -> Replay:
        """The iteration as one CUDA graph, captured from the origin stream (small memsets as kernels)."""
        return capture(self.streams[0], self.issue)

    def runtime_bytes(self) -> int:
        """Device memory the driver shows taken beyond the plan's buffers (`data_bytes`): kernel modules loaded
        on first launch, the instantiated CUDA graph, library state; a per-process constant like the context."""
        cp = gpu().cp
        cp.cuda.Device().synchronize()
        cp.get_default_memory_pool().free_all_blocks()
        return self.free_before - cp.cuda.runtime.memGetInfo()[0] - self.data_bytes


def _check_cap(plan: Plan, blocks, offsets: dict[str, int], persistent: int) -> None:
    """Refuse an arena that cannot fit under the plan's cap, naming the first tensor and instant that break it."""
    block = first_over(blocks, offsets, plan.totals.mem_cap_bytes - persistent)
    if block is not None:
        raise PlannerError(f"over the cap {fmt_bytes(plan.totals.mem_cap_bytes)}: {block.name.split('#')[0]!r} "
                           f"({fmt_bytes(block.size_bytes)}) at {block.start:.1f} us would end "
                           f"{fmt_bytes(offsets[block.name] + block.size_bytes + persistent)} into device memory")
