"""Occupancy arithmetic against the CUDA occupancy rules (cuda_occupancy.h), worked by hand for sm_90 and older."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from planner.devices import load_device
from planner.occupancy import (
    arch_rules,
    blocks_per_sm,
    candidate_sm_fraction,
    dram_fraction,
    kernel_blocks_per_sm,
    occupancy,
    sm_fraction,
)
from planner.profile import Kernel

H100 = load_device("h100")


@pytest.mark.parametrize(
    "threads, regs, shared, expected, limited_by",
    [
        # 8 warps; 32 regs -> 1024 per warp, 16 warps per sub-partition -> 64 warps: 8 blocks, as the warp limit
        (256, 32, 0, 8, {"warps", "registers"}),
        # 255 regs -> 8160, allocated 8192 per warp; 2 warps per sub-partition -> 8 warps -> 2 blocks of 4 warps
        (128, 255, 0, 2, {"registers"}),
        # 64 regs -> 2048/warp -> 32 warps -> 4 blocks; 48 KiB + 1 KiB reserved = 50176 B -> 233472 // 50176 = 4
        (256, 64, 48 * 1024, 4, {"registers", "shared"}),
        # 40 regs -> 1280/warp: 16384 // 1280 = 12 warps per sub-partition = 48 warps -> 24 blocks of 2 warps
        # (a whole-SM division would give 65536 // 2560 = 25: the sub-partition rule matters)
        (64, 40, 0, 24, {"registers"}),
        # 3 warps, 128 regs -> 4096/warp -> 4 warps per sub-partition -> 16 warps // 3 = 5 blocks
        (96, 128, 0, 5, {"registers"}),
        # 1 warp, 16 regs: the 32-blocks-per-SM limit
        (32, 16, 0, 32, {"blocks"}),
        # 1024 threads at 64 regs: 2048 * 32 warps = the whole 64K register file -> 1 block
        (1024, 64, 0, 1, {"registers"}),
        # 227 KiB opt-in + 1 KiB reserved = 228 KiB: exactly one block fits
        (128, 32, 232448, 1, {"shared"}),
    ],
)
def test_sm90_cases(threads, regs, shared, expected, limited_by):
    occ = occupancy(H100, threads, regs, shared)
    assert occ.blocks_per_sm == expected
    assert set(occ.limited_by) == limited_by
    assert blocks_per_sm(H100, threads, regs, shared) == expected


def test_sm90_launches_that_cannot_run():
    assert blocks_per_sm(H100, 1024, 65, 0) == 0  # 65 regs -> 2304/warp x 32 warps > 64K registers per block
    assert blocks_per_sm(H100, 128, 256, 0) == 0  # more than 255 registers per thread
    assert blocks_per_sm(H100, 1025, 16, 0) == 0  # more than 1024 threads per block
    assert blocks_per_sm(H100, 128, 32, 232449) == 0  # beyond the 227 KiB opt-in limit


def test_shared_memory_granularity_and_reserve():
    # sm_90: 1000 + 1024 reserved = 2024 -> rounded to 2048 (128-byte units)
    assert occupancy(H100, 128, 32, 1000).shared_per_block_bytes == 2048
    assert occupancy(H100, 128, 32, 1000).by_shared == 233472 // 2048
    # even a kernel without shared memory pays the 1 KiB reserve on sm_80+
    assert occupancy(H100, 128, 32, 0).by_shared == 228
    # sm_70: 256-byte units, no reserve: 1000 -> 1024 of 96 KiB
    v100 = load_device("v100")
    assert occupancy(v100, 128, 32, 1000).shared_per_block_bytes == 1024
    assert occupancy(v100, 128, 32, 1000).by_shared == 96
    # sm_80: 100 KiB + 1 KiB of 164 KiB -> 1 block
    assert blocks_per_sm(load_device("a100"), 128, 32, 100 * 1024) == 1


def test_register_granularity_rounds_per_warp():
    # 33 regs -> 1056 per warp, allocated 1280: same occupancy as 40 regs
    assert occupancy(H100, 64, 33, 0).registers_per_block == 2 * 1280
    assert blocks_per_sm(H100, 64, 33, 0) == blocks_per_sm(H100, 64, 40, 0) == 24


def test_kepler_block_limit_and_rules():
    k40 = load_device("k40")
    assert blocks_per_sm(k40, 32, 16, 0) == 16
    assert arch_rules("3.5").shared_alloc_unit_bytes == 256
    assert arch_rules("9.0").shared_alloc_unit_bytes == 128
    assert arch_rules("6.0").sub_partitions == 2
    assert arch_rules("").shared_alloc_unit_bytes == 128


def test_sm_fraction():
    assert sm_fraction(H100, 132 * 8, 8) == 1.0
    assert sm_fraction(H100, 10_000, 8) == 1.0
    assert sm_fraction(H100, 66, 1) == pytest.approx(0.5)
    assert sm_fraction(H100, 33, 2) == pytest.approx(0.125)
    with pytest.raises(ValueError):
        sm_fraction(H100, 10, 0)


def test_dram_fraction():
    peak = H100.peak_dram_bytes_per_s
    assert dram_fraction(H100, peak * 1e-6, 1.0) == pytest.approx(1.0)
    assert dram_fraction(H100, peak * 1e-6, 2.0) == pytest.approx(0.5)
    assert dram_fraction(H100, peak, 1.0) == 1.0  # capped: L2 hits can beat DRAM
    assert dram_fraction(H100, 100, 0.0) == 0.0


def test_kernel_records():
    big = Kernel(name="a", duration_us=30, grid=[132, 8, 1], block=[16, 16, 1], registers_per_thread=32)
    small = Kernel(name="b", duration_us=10, grid=[66, 1, 1], block=[1024, 1, 1], registers_per_thread=64)
    assert kernel_blocks_per_sm(H100, big) == 8
    assert kernel_blocks_per_sm(H100, small) == 1
    assert candidate_sm_fraction(H100, [big, small]) == pytest.approx((30 * 1.0 + 10 * 0.5) / 40)
    assert candidate_sm_fraction(H100, []) == 1.0


REFERENCE_CPP = r"""
#include <cstdio>
#include "cuda_occupancy.h"
int main() {
    cudaOccDeviceProp p{};
    int threads, regs; size_t shared;
    while (scanf("%d %d %d %d %d %d %d %zu %zu %d %zu %zu %d %d %zu", &p.computeMajor, &p.computeMinor,
                 &p.maxThreadsPerBlock, &p.maxThreadsPerMultiprocessor, &p.regsPerBlock, &p.regsPerMultiprocessor,
                 &p.warpSize, &p.sharedMemPerBlock, &p.sharedMemPerMultiprocessor, &p.numSms,
                 &p.sharedMemPerBlockOptin, &p.reservedSharedMemPerBlock, &threads, &regs, &shared) == 15) {
        cudaOccFuncAttributes a;
        a.maxThreadsPerBlock = 1024; a.numRegs = regs; a.sharedSizeBytes = 0;
        a.partitionedGCConfig = PARTITIONED_GC_OFF; a.shmemLimitConfig = FUNC_SHMEM_LIMIT_OPTIN;
        a.maxDynamicSharedSizeBytes = p.sharedMemPerBlockOptin; a.numBlockBarriers = 1;
        cudaOccDeviceState s;
        cudaOccResult r{};
        cudaOccError e = cudaOccMaxActiveBlocksPerMultiprocessor(&r, &p, &a, &s, threads, shared);
        printf("%d\n", e == CUDA_OCC_SUCCESS ? r.activeBlocksPerMultiprocessor : -100 - (int)e);
    }
}
"""


def _official_calculator(tmp_path_factory):
    """Build NVIDIA's header-only occupancy calculator (cuda_occupancy.h) when a CUDA toolkit and g++ are here.

    The program prints cudaOccMaxActiveBlocksPerMultiprocessor for each line of device limits and launch on stdin.
    """
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    compiler = shutil.which("g++")
    if not (cuda / "cuda_occupancy.h").exists() or compiler is None:
        pytest.skip("needs cuda_occupancy.h (CUDA toolkit) and g++")
    exe = tmp_path_factory.mktemp("occ") / "occ"
    source = exe.with_suffix(".cpp")
    source.write_text(REFERENCE_CPP)
    subprocess.run([compiler, "-O1", f"-I{cuda}", str(source), "-o", str(exe)], check=True, capture_output=True)
    return exe


def test_matches_cuda_occupancy_header(tmp_path_factory):
    """Every launch of a grid on four architectures gives what CUDA's own calculator gives."""
    exe = _official_calculator(tmp_path_factory)
    cases, lines = [], []
    for name in ("h100", "a100", "v100", "k40"):
        d = load_device(name)
        major, minor = d.compute_capability.split(".")
        props = (f"{major} {minor} {d.max_threads_per_block} {d.max_threads_per_sm} {d.registers_per_block} "
                 f"{d.registers_per_sm} {d.warp_size} 49152 {d.shared_mem_per_sm_bytes} {d.sm_count} "
                 f"{d.shared_mem_per_block_optin_bytes} {d.reserved_shared_mem_per_block_bytes}")
        for threads in (32, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1025):
            for regs in (0, 16, 24, 32, 33, 40, 48, 64, 65, 72, 96, 128, 168, 200, 255):
                for shared in (0, 1, 1000, 4096, 16384, 40000, 49152, 65536, 100000, 167000, 232448, 232449):
                    cases.append((d, threads, regs, shared))
                    lines.append(f"{props} {threads} {regs} {shared}")
    out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    expected = [int(v) for v in out.stdout.split()]
    assert len(expected) == len(cases)
    mismatches = [(c[0].name, *c[1:], want, blocks_per_sm(*c)) for c, want in zip(cases, expected)
                  if blocks_per_sm(*c) != want]
    assert mismatches == []
