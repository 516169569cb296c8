"""The GPU this process runs on, as a DeviceInfo with measured copy ceilings."""

from __future__ import annotations

import statistics

from planner.profile import DeviceInfo
from runner.gpu import gpu


def _copy_seconds(copy, stream, reps: int = 10) -> float:
    cp = gpu().cp
    start, end = cp.cuda.Event(), cp.cuda.Event()
    copy()
    times = []
    for _ in range(reps):
        start.record(stream)
        copy()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(times)


def probe_device() -> DeviceInfo:
    cp, cudnn = gpu().cp, gpu().cudnn
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    free, total = cp.cuda.runtime.memGetInfo()
    stream = cp.cuda.Stream(non_blocking=True)
    size = 256 << 20
    a, b = cp.empty(size, cp.uint8), cp.empty(size, cp.uint8)
    host = cp.cuda.alloc_pinned_memory(size)
    d2d_s = _copy_seconds(lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, size, 3, stream.ptr), stream)
    h2d_s = _copy_seconds(lambda: cp.cuda.runtime.memcpyAsync(a.data.ptr, host.ptr, size, 1, stream.ptr), stream)
    d2h_s = _copy_seconds(lambda: cp.cuda.runtime.memcpyAsync(host.ptr, a.data.ptr, size, 2, stream.ptr), stream)
    latency_s = _copy_seconds(lambda: cp.cuda.runtime.memcpyAsync(a.data.ptr, host.ptr, 4, 1, stream.ptr), stream)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return DeviceInfo(
        name=name, sm_count=props["multiProcessorCount"], memory_bytes=total,
        sm_clock_mhz=props.get("clockRate", 0) // 1000, memory_clock_mhz=props.get("memoryClockRate", 0) // 1000,
        compute_capability=f"{props['major']}.{props['minor']}",
        driver_version=str(cp.cuda.runtime.driverGetVersion()), cuda_version=str(cp.cuda.runtime.runtimeGetVersion()),
        cudnn_version=str(cudnn.backend_version()),
        max_threads_per_sm=props["maxThreadsPerMultiProcessor"], registers_per_sm=props["regsPerMultiprocessor"],
        shared_mem_per_sm_bytes=props["sharedMemPerMultiprocessor"],
        d2d_bytes_per_s=2 * size / d2d_s, h2d_bytes_per_s=size / h2d_s, d2h_bytes_per_s=size / d2h_s,
        copy_latency_us=latency_s * 1e6,
    )
