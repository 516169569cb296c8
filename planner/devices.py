"""Built-in device specs for the analytic profile, and JSON device spec files.

Peak rates are the vendor's dense (no sparsity) figures; bandwidths the datasheet's. The H100's and H200's copy
rates are measured ones (device-to-device counting read + write, pinned host copies, `runner.probe`), the others
typical PCIe figures. The H200 is the H100's chip with more and faster memory: the same SMs and arithmetic peaks.
Built-in specs have no cuDNN version, so their fingerprint says "analytic" and never matches a measured device.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from planner.files import PlannerError
from planner.profile import DeviceInfo

MiB = 1 << 20

H100 = DeviceInfo(
    name="NVIDIA H100 80GB HBM3", sm_count=132, memory_bytes=81559 * MiB, sm_clock_mhz=1980,
    memory_clock_mhz=2619, compute_capability="9.0", max_threads_per_sm=2048, max_blocks_per_sm=32,
    registers_per_sm=65536, shared_mem_per_sm_bytes=233472, shared_mem_per_block_optin_bytes=232448,
    reserved_shared_mem_per_block_bytes=1024, peak_dram_bytes_per_s=3.35e12, peak_flops_fp32=66.9e12,
    peak_flops_tf32=494.7e12, peak_flops_fp16=989.4e12, d2d_bytes_per_s=3.0e12, h2d_bytes_per_s=45e9,
    d2h_bytes_per_s=45e9, copy_latency_us=8.0,
)

BUILTIN: dict[str, DeviceInfo] = {
    "h100": H100,
    "h200": H100.model_copy(update=dict(
        name="NVIDIA H200", memory_bytes=143156 * MiB, memory_clock_mhz=3201, peak_dram_bytes_per_s=4.8e12,
        d2d_bytes_per_s=3.98e12, h2d_bytes_per_s=55e9, d2h_bytes_per_s=55e9, copy_latency_us=5.9,
    ), deep=True),
    "a100": DeviceInfo(
        name="NVIDIA A100-SXM4-80GB", sm_count=108, memory_bytes=81920 * MiB, sm_clock_mhz=1410,
        memory_clock_mhz=1593, compute_capability="8.0", max_threads_per_sm=2048, max_blocks_per_sm=32,
        registers_per_sm=65536, shared_mem_per_sm_bytes=167936, shared_mem_per_block_optin_bytes=166912,
        reserved_shared_mem_per_block_bytes=1024, peak_dram_bytes_per_s=2.039e12, peak_flops_fp32=19.5e12,
        peak_flops_tf32=156e12, peak_flops_fp16=312e12, d2d_bytes_per_s=1.75e12, h2d_bytes_per_s=24e9,
        d2h_bytes_per_s=24e9, copy_latency_us=8.0,
    ),
    "v100": DeviceInfo(
        name="Tesla V100-SXM2-32GB", sm_count=80, memory_bytes=32510 * MiB, sm_clock_mhz=1530,
        memory_clock_mhz=877, compute_capability="7.0", max_threads_per_sm=2048, max_blocks_per_sm=32,
        registers_per_sm=65536, shared_mem_per_sm_bytes=98304, shared_mem_per_block_optin_bytes=98304,
        reserved_shared_mem_per_block_bytes=0, peak_dram_bytes_per_s=900e9, peak_flops_fp32=15.7e12,
        peak_flops_tf32=0.0, peak_flops_fp16=125e12, d2d_bytes_per_s=780e9, h2d_bytes_per_s=12e9,
        d2h_bytes_per_s=12e9, copy_latency_us=10.0,
    ),
    "k40": DeviceInfo(
        name="Tesla K40m", sm_count=15, memory_bytes=11441 * MiB, sm_clock_mhz=875, memory_clock_mhz=3004,
        compute_capability="3.5", max_threads_per_sm=2048, max_blocks_per_sm=16, registers_per_sm=65536,
        shared_mem_per_sm_bytes=49152, shared_mem_per_block_optin_bytes=49152,
        reserved_shared_mem_per_block_bytes=0, peak_dram_bytes_per_s=288e9, peak_flops_fp32=5.04e12,
        peak_flops_tf32=0.0, peak_flops_fp16=5.04e12, d2d_bytes_per_s=200e9, h2d_bytes_per_s=10e9,
        d2h_bytes_per_s=10e9, copy_latency_us=10.0, max_threads_per_block=1024,
    ),
}


def load_device(spec: str | Path) -> DeviceInfo:
    """A built-in name (h100, h200, a100, v100, k40) or a JSON file: a full DeviceInfo, or {"base": NAME,
    ...overrides}."""
    key = str(spec).lower()
    if key in BUILTIN:
        return BUILTIN[key].model_copy(deep=True)
    path = Path(spec)
    if not path.exists():
        raise PlannerError(f"unknown device {str(spec)!r}: use one of {', '.join(BUILTIN)} or a JSON device spec file")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlannerError(f"{path}: not a readable JSON device spec ({e})") from None
    if not isinstance(raw, dict):
        raise PlannerError(f"{path}: a device spec is a JSON object")
    if raw.get("kind") == "profile" and isinstance(raw.get("device"), dict):
        raw = raw["device"]
    base = raw.pop("base", None)
    if base is not None:
        if str(base).lower() not in BUILTIN:
            raise PlannerError(f"{path}: unknown base device {base!r} (known: {', '.join(BUILTIN)})")
        raw = BUILTIN[str(base).lower()].model_dump() | raw
    try:
        device = DeviceInfo.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise PlannerError(f"{path}: invalid device spec: {where}: {first['msg']}") from None
    if device.peak_dram_bytes_per_s <= 0 or device.peak_flops_fp32 <= 0:
        raise PlannerError(f"{path}: the analytic model needs peak_dram_bytes_per_s and peak_flops_fp32 > 0")
    return device


def require_gpu(purpose: str):
    """The runner's GPU stack (CuPy and cuDNN) with a CUDA device to use, or one line that says what is missing:
    `purpose` names the command ("measuring", "running", "bench")."""
    try:
        from runner.gpu import gpu

        stack = gpu()
        count = stack.cp.cuda.runtime.getDeviceCount()
    except ImportError as e:
        raise PlannerError(f"{purpose} needs the GPU extra (pip install -e '.[gpu]'): {e}") from None
    except Exception as e:  # noqa: BLE001 - no driver, no device: one line, no traceback
        raise PlannerError(f"{purpose} needs a CUDA GPU: {type(e).__name__}: {str(e)[:160]}") from None
    if count < 1:
        raise PlannerError(f"{purpose} needs a CUDA GPU: none found")
    return stack
