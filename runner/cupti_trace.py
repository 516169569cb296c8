"""Kernel activity records from CUPTI: each kernel's name, duration, grid, block, registers, shared memory."""

from __future__ import annotations

from contextlib import contextmanager

from planner.profile import Kernel

_records: list = []
_registered = False


def _ensure_registered():
    global _registered
    from cupti import cupti

    if not _registered:
        cupti.activity_register_callbacks(lambda: (8 << 20, 0), lambda activities: _records.extend(
            _kernel(a) for a in activities if a.kind == cupti.ActivityKind.CONCURRENT_KERNEL))
        _registered = True
    return cupti


def _kernel(a) -> Kernel:
    return Kernel(name=a.name, duration_us=(a.end - a.start) / 1e3, grid=[a.grid_x, a.grid_y, a.grid_z],
                  block=[a.block_x, a.block_y, a.block_z], registers_per_thread=a.registers_per_thread,
                  static_shared_bytes=a.static_shared_memory, dynamic_shared_bytes=a.dynamic_shared_memory)


@contextmanager
def record_kernels(synchronize):
    """Collect the kernels launched inside the block (`synchronize` waits for them to finish)."""
    cupti = _ensure_registered()
    _records.clear()
    cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
    kernels: list[Kernel] = []
    try:
        yield kernels
        synchronize()
    finally:
        cupti.activity_flush_all(1)
        cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
        kernels.extend(_records)
        _records.clear()
