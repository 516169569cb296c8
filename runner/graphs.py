"""Capture work as a CUDA graph whose small memsets run as kernels.

cuDNN's BatchNormalization (and a few convolution engines) starts with a 4-8 byte memset, so a captured GoogLeNet
training iteration holds about 100 memset nodes. In a graph whose branches run side by side, a memset node costs
about 5 us of latency more than a kernel doing the same (H100: four streams of kernel, memset, kernel take 10.4 us
per repetition, 5.1 us with a one-thread fill kernel in the memset's place; one stream 4.75 against 3.71 us). So
after capture every memset node of at most MEMSET_AS_KERNEL_MAX_BYTES becomes a fill-kernel node with the same
edges, through the driver API (ctypes: CuPy exposes the graph handle but no node calls).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from contextlib import suppress
from functools import lru_cache

from runner.gpu import gpu

MEMSET_AS_KERNEL_MAX_BYTES = 1 << 20
NODE_MEMSET = 2  # CU_GRAPH_NODE_TYPE_MEMSET
THREADS = 256
EDGE_CALLS = ("cuGraphNodeGetDependencies_v2", "cuGraphNodeGetDependentNodes_v2", "cuGraphAddDependencies_v2")

_FILL = r"""
extern "C" __global__ void graph_memset(char* dst, unsigned long long pitch, unsigned int value,
                                        unsigned int element_bytes, unsigned long long width,
                                        unsigned long long height) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i >= width * height) return;
    char* p = dst + (i / width) * pitch + (i % width) * element_bytes;
    if (element_bytes == 4) *(unsigned int*)p = value;
    else if (element_bytes == 2) *(unsigned short*)p = (unsigned short)value;
    else *(unsigned char*)p = (unsigned char)value;
}
"""


class MemsetParams(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("element_bytes", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class KernelParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (kern and ctx left NULL: the function handle, in the current context)."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@lru_cache(maxsize=1)
def _fill_function() -> int:
    kernel = gpu().cp.RawKernel(_FILL, "graph_memset")
    kernel.compile()
    return kernel.kernel.ptr


def _check(status: int, call: str) -> None:
    if status:
        raise RuntimeError(f"CUDA driver call {call} failed with error {status}")


def nodes(graph: int) -> list[int]:
    """The graph's node handles, in creation order."""
    cu, count = _driver(), ctypes.c_size_t(0)
    _check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    handles = (ctypes.c_void_p * count.value)()
    _check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), handles, ctypes.byref(count)), "cuGraphGetNodes")
    return [n or 0 for n in handles]


def node_type(node: int) -> int:
    kind = ctypes.c_int(-1)
    _check(_driver().cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    return kind.value


def _edges(node: int, outgoing: bool) -> tuple[list[int], list[EdgeData]]:
    """The node's incoming (or outgoing) neighbours with each edge's data."""
    cu = _driver()
    call = "cuGraphNodeGetDependentNodes_v2" if outgoing else "cuGraphNodeGetDependencies_v2"
    query, count = getattr(cu, call), ctypes.c_size_t(0)
    _check(query(ctypes.c_void_p(node), None, None, ctypes.byref(count)), call)
    if not count.value:  # a root (or leaf): the driver refuses arrays for no edges
        return [], []
    others, data = (ctypes.c_void_p * count.value)(), (EdgeData * count.value)()
    _check(query(ctypes.c_void_p(node), others, data, ctypes.byref(count)), call)
    return [n or 0 for n in others], list(data)


def _connect(graph: int, sources: list[int], targets: list[int], data: list[EdgeData]) -> None:
    if not sources:
        return
    n = len(sources)
    _check(_driver().cuGraphAddDependencies_v2(ctypes.c_void_p(graph), (ctypes.c_void_p * n)(*sources),
                                                (ctypes.c_void_p * n)(*targets), (EdgeData * n)(*data), n),
           "cuGraphAddDependencies_v2")


def _fill_node(graph: int, memset: MemsetParams) -> int:
    """A fill-kernel node (no edges yet) doing what `memset` does."""
    count = memset.width * memset.height
    args = [ctypes.c_uint64(memset.dst), ctypes.c_uint64(memset.pitch), ctypes.c_uint(memset.value),
            ctypes.c_uint(memset.element_bytes), ctypes.c_uint64(memset.width), ctypes.c_uint64(memset.height)]
    pointers = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    params = KernelParams(func=_fill_function(), grid=(ctypes.c_uint * 3)(-(-count // THREADS), 1, 1),
                          block=(ctypes.c_uint * 3)(min(THREADS, count), 1, 1),
                          params=ctypes.cast(pointers, ctypes.c_void_p))
    node = ctypes.c_void_p()
    _check(_driver().cuGraphAddKernelNode_v2(ctypes.byref(node), ctypes.c_void_p(graph), None, 0,
                                             ctypes.byref(params)), "cuGraphAddKernelNode_v2")
    return node.value


def memsets_as_kernels(graph: int) -> dict[int, int]:
    """Replace each memset node of at most MEMSET_AS_KERNEL_MAX_BYTES by a fill-kernel node with the same
    incoming and outgoing edges. Returns each fill node's creation number with that of the memset it replaced
    (new nodes take the numbers after the captured ones). A driver older than CUDA 12.3 (no edge-data calls)
    keeps its memset nodes."""
    if not all(hasattr(_driver(), call) for call in EDGE_CALLS):
        return {}
    captured = nodes(graph)
    replaced = {}
    for number, node in enumerate(captured):
        if node_type(node) != NODE_MEMSET:
            continue
        memset = MemsetParams()
        _check(_driver().cuGraphMemsetNodeGetParams(ctypes.c_void_p(node), ctypes.byref(memset)),
               "cuGraphMemsetNodeGetParams")
        if memset.width * memset.height * memset.element_bytes > MEMSET_AS_KERNEL_MAX_BYTES:
            continue
        before, before_data = _edges(node, outgoing=False)
        after, after_data = _edges(node, outgoing=True)
        fill = _fill_node(graph, memset)
        _connect(graph, before, [fill] * len(before), before_data)
        _connect(graph, [fill] * len(after), after, after_data)
        _check(_driver().cuGraphDestroyNode(ctypes.c_void_p(node)), "cuGraphDestroyNode")
        replaced[len(captured) + len(replaced)] = number
    return replaced


class Replay:
    """A captured graph with its small memsets rewritten, instantiated and uploaded; `launch(stream)` replays it.

    `replaced` maps each fill node's creation number to that of the memset it replaced, so a trace of a replay
    still finds the item that issued it (CUPTI reports creation numbers: runner/trace.py; new nodes take the next
    ones, which the H100 traces confirm: every node matched)."""

    def __init__(self, graph: int, stream):
        rt = gpu().cp.cuda.runtime
        self.graph, self.exec = graph, 0
        self.replaced = memsets_as_kernels(graph)
        self.exec = rt.graphInstantiate(graph)
        rt.graphUpload(self.exec, stream.ptr)

    def launch(self, stream) -> None:
        gpu().cp.cuda.runtime.graphLaunch(self.exec, stream.ptr)

    def __del__(self):
        with suppress(Exception):  # at interpreter exit CuPy may be gone first
            rt = gpu().cp.cuda.runtime
            if self.exec:
                rt.graphExecDestroy(self.exec)
            rt.graphDestroy(self.graph)


def capture(stream, issue: Callable[[], None]) -> Replay:
    """`issue()` captured on `stream` (which it must join back into) as a Replay."""
    rt = gpu().cp.cuda.runtime
    stream.begin_capture()
    try:
        issue()
    except BaseException:
        rt.graphDestroy(rt.streamEndCapture(stream.ptr))  # a failed issue must not leave the stream capturing
        raise
    return Replay(rt.streamEndCapture(stream.ptr), stream)
