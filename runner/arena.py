"""Offsets in one device-memory arena from the plan's residency intervals (no allocator, no fragmentation).

Pure Python so it is tested without a GPU. Placement is greedy by size (largest first, each at the lowest
offset where it overlaps no placed block that is live at the same time), which is close to the live-bytes
lower bound on CNN lifetimes; the result is checked, never trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.files import PlannerError

ALIGN_BYTES = 256  # cudaMalloc's alignment; cuDNN and cuBLAS want at least 16 bytes


@dataclass(frozen=True)
class Block:
    name: str
    size_bytes: int
    start: float  # first instant the block is live (inclusive)
    end: float  # instant it is free again (exclusive)


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _overlap_in_time(a: Block, b: Block) -> bool:
    return a.start < b.end and b.start < a.end


def peak_live_bytes(blocks: list[Block]) -> int:
    """The most bytes live at one instant: no arena can be smaller than this."""
    events = sorted([(b.start, 1, b.size_bytes) for b in blocks] + [(b.end, 0, -b.size_bytes) for b in blocks])
    live = peak = 0
    for _, _, delta in events:  # frees (0) sort before allocations (1) at the same instant
        live += delta
        peak = max(peak, live)
    return peak


def assign_offsets(blocks: list[Block]) -> tuple[dict[str, int], int]:
    """Offsets for every block and the arena size in bytes."""
    placed: list[tuple[Block, int, int]] = []  # block, offset, aligned size
    offsets: dict[str, int] = {}
    for block in sorted(blocks, key=lambda b: (-b.size_bytes, b.start, b.name)):
        size = _aligned(block.size_bytes)
        busy = sorted((off, off + sz) for other, off, sz in placed if _overlap_in_time(block, other))
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        offsets[block.name] = offset
        placed.append((block, offset, size))
    arena = max((off + sz for _, off, sz in placed), default=0)
    check_offsets(blocks, offsets)
    return offsets, arena


def check_offsets(blocks: list[Block], offsets: dict[str, int]) -> None:
    """No two blocks live at the same time share a byte."""
    by_start = sorted(blocks, key=lambda b: b.start)
    for i, a in enumerate(by_start):
        for b in by_start[i + 1:]:
            if b.start >= a.end:
                break
            if offsets[a.name] < offsets[b.name] + b.size_bytes and offsets[b.name] < offsets[a.name] + a.size_bytes:
                raise PlannerError(f"arena overlap: {a.name!r} and {b.name!r} share memory while both are live "
                                   f"(from {max(a.start, b.start)})")
