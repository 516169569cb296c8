"""Activity records from CUPTI: each kernel's name, duration, grid, block, registers, shared memory; and the
kernels, copies and memsets of a CUDA-graph replay with their graph node ids (for a timeline trace)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from planner.profile import Kernel

_records: list = []
_registered = False


@dataclass(frozen=True)
class Activity:
    kind: str  # kernel, memcpy or memset
    name: str
    start_ns: int
    end_ns: int
    graph_node_id: int
    kernel: Kernel | None = None
    bytes: int = 0


def _ensure_registered():
    global _registered
    from cupti import cupti

    if not _registered:
        kinds = {cupti.ActivityKind.CONCURRENT_KERNEL: "kernel", cupti.ActivityKind.MEMCPY: "memcpy",
                 cupti.ActivityKind.MEMSET: "memset"}
        cupti.activity_register_callbacks(lambda: (8 << 20, 0), lambda activities: _records.extend(
            _activity(kinds[a.kind], a) for a in activities if a.kind in kinds))
        _registered = True
    return cupti


def _activity(kind: str, a) -> Activity:
    kernel = name = None
    if kind == "kernel":
        name = a.name
        kernel = Kernel(name=a.name, duration_us=(a.end - a.start) / 1e3, grid=[a.grid_x, a.grid_y, a.grid_z],
                        block=[a.block_x, a.block_y, a.block_z], registers_per_thread=a.registers_per_thread,
                        static_shared_bytes=a.static_shared_memory, dynamic_shared_bytes=a.dynamic_shared_memory)
    return Activity(kind=kind, name=name or kind, start_ns=a.start, end_ns=a.end,
                    graph_node_id=getattr(a, "graph_node_id", 0), kernel=kernel, bytes=getattr(a, "bytes", 0))


@contextmanager
def record_activity(synchronize, kinds: tuple[str, ...] = ("kernel",)):
    """Collect the activities of `kinds` (kernel, memcpy, memset) launched inside the block, in start order
    (`synchronize` waits for them to finish)."""
    cupti = _ensure_registered()
    enums = {"kernel": cupti.ActivityKind.CONCURRENT_KERNEL, "memcpy": cupti.ActivityKind.MEMCPY,
             "memset": cupti.ActivityKind.MEMSET}
    _records.clear()
    for kind in kinds:
        cupti.activity_enable(enums[kind])
    activities: list[Activity] = []
    try:
        yield activities
        synchronize()
    finally:
        cupti.activity_flush_all(1)
        for kind in kinds:
            cupti.activity_disable(enums[kind])
        activities.extend(sorted(_records, key=lambda a: a.start_ns))
        _records.clear()


@contextmanager
def record_kernels(synchronize):
    """Collect the kernels launched inside the block (`synchronize` waits for them to finish)."""
    kernels: list[Kernel] = []
    with record_activity(synchronize) as activities:
        yield kernels
    kernels.extend(a.kernel for a in activities)
