"""Occupancy arithmetic: how many blocks of a kernel fit on one SM, and how much of the GPU a grid takes.

The rules follow CUDA's cuda_occupancy.h (CUDA 12, `cudaOccMaxActiveBlocksPerMultiprocessor`) with the default
shared-memory carveout and no partitioned global caching: registers are allocated per warp in units of 256 and
spread over the SM's 4 sub-partitions (warps that fit in one sub-partition's quarter of the register file, times
4); shared memory per block is static + dynamic + the driver's reserved 1 KiB (sm_80+), rounded up to 128 bytes
(256 before sm_80); warps per SM, blocks per SM and threads per block bound it too. The device sizes come from
DeviceInfo (cudaDeviceProp); the allocation granularities depend only on the compute capability.
tests/test_occupancy.py compares a grid of launches on sm_90/80/70/35 with the header itself where a CUDA toolkit
is installed. One deliberate difference: the header accepts 256 registers per thread on sm_70+, the ISA stops at 255.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.profile import DeviceInfo, Kernel

MAX_REGISTERS_PER_THREAD = 255  # the ISA limit since Kepler GK110; ptxas never allocates more


@dataclass(frozen=True)
class ArchRules:
    """Allocation granularities that cudaDeviceProp does not report."""

    shared_alloc_unit_bytes: int
    register_alloc_unit: int  # registers, allocated per warp
    sub_partitions: int


def arch_rules(compute_capability: str) -> ArchRules:
    """Granularities by compute capability; an unknown or empty one gets the sm_80+ rules (the newest known)."""
    try:
        major, minor = (int(p) for p in compute_capability.split(".")[:2])
    except ValueError:
        major, minor = 9, 0
    return ArchRules(
        shared_alloc_unit_bytes=128 if major >= 8 else 256,
        register_alloc_unit=256,
        sub_partitions=2 if (major, minor) == (6, 0) else 4,
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


@dataclass(frozen=True)
class Occupancy:
    """Blocks per SM allowed by each limit; the smallest one is the occupancy (0: the launch cannot run)."""

    by_warps: int
    by_registers: int
    by_shared: int
    by_blocks: int
    registers_per_block: int
    shared_per_block_bytes: int

    @property
    def blocks_per_sm(self) -> int:
        return min(self.by_warps, self.by_registers, self.by_shared, self.by_blocks)

    @property
    def limited_by(self) -> list[str]:
        n = self.blocks_per_sm
        names = ("warps", "registers", "shared", "blocks")
        return [k for k, v in zip(names, (self.by_warps, self.by_registers, self.by_shared, self.by_blocks)) if v == n]


def occupancy(device: DeviceInfo, threads_per_block: int, registers_per_thread: int, shared_bytes: int) -> Occupancy:
    """Every limit separately, so tests and reports can say what bounds a kernel."""
    if threads_per_block <= 0:
        raise ValueError(f"threads_per_block must be positive, got {threads_per_block}")
    if registers_per_thread < 0 or shared_bytes < 0:
        raise ValueError("registers and shared memory cannot be negative")
    rules = arch_rules(device.compute_capability)
    big = 1 << 30
    warps = _ceil_div(threads_per_block, device.warp_size)

    max_warps = device.max_threads_per_sm // device.warp_size
    by_warps = 0 if threads_per_block > device.max_threads_per_block else max_warps // warps

    regs_per_warp = _round_up(registers_per_thread * device.warp_size, rules.register_alloc_unit)
    regs_per_block = regs_per_warp * warps
    regs_checked_by_hw = regs_per_warp * _round_up(warps, rules.sub_partitions)
    if (registers_per_thread > MAX_REGISTERS_PER_THREAD or regs_checked_by_hw > device.registers_per_block
            or regs_per_block > device.registers_per_block):
        by_registers = 0
    elif regs_per_warp == 0:
        by_registers = big
    else:
        warps_per_sub_partition = (device.registers_per_sm // rules.sub_partitions) // regs_per_warp
        by_registers = warps_per_sub_partition * rules.sub_partitions // warps

    shared = _round_up(shared_bytes + device.reserved_shared_mem_per_block_bytes, rules.shared_alloc_unit_bytes)
    shared_limit = device.shared_mem_per_block_optin_bytes + device.reserved_shared_mem_per_block_bytes
    if shared > shared_limit:
        by_shared = 0
    elif shared == 0:
        by_shared = big
    else:
        by_shared = device.shared_mem_per_sm_bytes // shared

    return Occupancy(by_warps, by_registers, by_shared, device.max_blocks_per_sm, regs_per_block, shared)


def blocks_per_sm(device: DeviceInfo, threads_per_block: int, registers_per_thread: int, shared_bytes: int) -> int:
    """Resident blocks per SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor); shared_bytes = static + dynamic."""
    return occupancy(device, threads_per_block, registers_per_thread, shared_bytes).blocks_per_sm


def sm_fraction(device: DeviceInfo, grid_blocks: int, blocks_per_sm: int) -> float:
    """Share of the GPU's resident-block slots the grid fills; 1.0 means no other kernel's block fits beside it."""
    if blocks_per_sm <= 0:
        raise ValueError("a kernel with 0 resident blocks per SM cannot launch")
    return min(1.0, max(grid_blocks, 0) / (blocks_per_sm * device.sm_count))


def dram_fraction(device: DeviceInfo, min_bytes: float, time_us: float) -> float:
    """Minimum bytes moved / time / peak bandwidth, capped at 1 (L2 hits can beat DRAM peak on small tensors)."""
    if time_us <= 0 or device.peak_dram_bytes_per_s <= 0:
        return 0.0
    return min(1.0, min_bytes / (time_us * 1e-6) / device.peak_dram_bytes_per_s)


def kernel_blocks_per_sm(device: DeviceInfo, kernel: Kernel) -> int:
    """Occupancy of one recorded kernel launch."""
    return blocks_per_sm(device, math.prod(kernel.block), kernel.registers_per_thread,
                         kernel.static_shared_bytes + kernel.dynamic_shared_bytes)


def candidate_sm_fraction(device: DeviceInfo, kernels: list[Kernel]) -> float:
    """Duration-weighted sm_fraction of a candidate's kernels, so a short helper kernel does not dominate."""
    total_us = sum(k.duration_us for k in kernels)
    if not kernels:
        return 1.0
    fractions = []
    for k in kernels:
        blocks = k.blocks_per_sm or kernel_blocks_per_sm(device, k)
        fractions.append(sm_fraction(device, math.prod(k.grid), max(blocks, 1)))
    if total_us <= 0:
        return max(fractions)
    return sum(f * k.duration_us for f, k in zip(fractions, kernels)) / total_us
