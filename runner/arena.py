"""Offsets in one device-memory arena from the plan's residency intervals (no allocator, no fragmentation).

Pure Python so it is tested without a GPU. Placement is greedy: blocks in one order, each at the lowest offset
where it overlaps no placed block that is live at the same time. Five orders are tried (largest first, longest
lived first, largest size x lifetime first, largest size x lifetime^(1/2), then ^(1/4), first) and the smallest
arena kept: size alone is best on most shipped capped training plans, longest-lived first on GoogLeNet at 40% of
PyTorch's peak (4.3% above the live-bytes lower bound against 6.9%); where the solver packs memory to the cap,
the square root (GoogLeNet training b32 at 50%, refined with memory in its windows: 0.3% above that bound, the
others 8-13%) and the fourth root (ResNet-50 training b32 at 50%: every refined schedule at the bound, where the
others overflowed the cap by 3.7 MiB on 11 of 92 and the search lost 11 us falling back). Where none comes within
0.1% of the bound, rounds of the squeaky wheel follow: the blocks the last round put above it move ahead in the order
(ResNet-50 training b32 at 30%: 5.7% above the bound after the orders, 1.1% after 25 rounds). The result is
checked, never trusted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from planner.files import PlannerError
from planner.ir import Graph, Tensor
from planner.plan import Plan

ALIGN_BYTES = 256  # cudaMalloc's alignment; cuDNN and cuBLAS want at least 16 bytes
DRIVER_PAGE_BYTES = 2 << 20  # the driver maps device memory in 2 MiB pages (measured: runs read 406.00 MiB)


@dataclass(frozen=True)
class Block:
    name: str
    size_bytes: int
    start: float  # first instant the block is live (inclusive)
    end: float  # instant it is free again (exclusive)


def aligned(n: int, unit: int = ALIGN_BYTES) -> int:
    """n rounded up to a whole number of `unit`s."""
    return -(-n // unit) * unit


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


PLACEMENT_ORDERS = (
    lambda b: (-b.size_bytes, b.start, b.name),
    lambda b: (-(b.end - b.start), -b.size_bytes, b.name),
    lambda b: (-b.size_bytes * (b.end - b.start), b.name),
    lambda b: (-b.size_bytes * (b.end - b.start) ** 0.5, b.name),
    lambda b: (-b.size_bytes * (b.end - b.start) ** 0.25, b.name),
)
SQUEAKY_ROUNDS = 32  # placements after the orders, where none came within CLOSE of the live-bytes bound
CLOSE = 0.001  # ... (`placements`)
SQUEAKY_RAISE = 0.5  # ... each raising the priority of the blocks above that bound by this share


def _overlaps(blocks: list[Block]) -> list[np.ndarray]:
    """For each block (by position), the positions of the blocks live at some instant it is."""
    by_start = sorted(range(len(blocks)), key=lambda i: blocks[i].start)
    out: list[list[int]] = [[] for _ in blocks]
    for k, i in enumerate(by_start):
        a = blocks[i]
        for j in by_start[k + 1:]:
            if blocks[j].start >= a.end:
                break
            if _overlap_in_time(a, blocks[j]):
                out[i].append(j)
                out[j].append(i)
    return [np.array(o, dtype=np.int64) for o in out]


def _first_fit(blocks: list[Block], order, overlaps: list[np.ndarray]) -> tuple[dict[str, int], int]:
    """Blocks in `order`, each at the lowest offset clear of the placed blocks it overlaps in time: past each
    of them in offset order (by start, then end) until the gap before the next one holds it."""
    offsets = np.full(len(blocks), -1, dtype=np.int64)
    ends = np.zeros(len(blocks), dtype=np.int64)  # offset + aligned size of each placed block
    for i in sorted(range(len(blocks)), key=lambda i: order(blocks[i])):
        size = aligned(blocks[i].size_bytes)
        near = overlaps[i][offsets[overlaps[i]] >= 0]
        offset = 0
        if near.size:
            lo, hi = offsets[near], ends[near]
            by = np.lexsort((hi, lo))
            lo, reach = lo[by], np.maximum.accumulate(hi[by])
            before = np.concatenate(([0], reach[:-1]))  # the offset tried before each busy interval
            gap = np.flatnonzero(before + size <= lo)
            offset = int(before[gap[0]]) if gap.size else int(reach[-1])
        offsets[i], ends[i] = offset, offset + size
    return {b.name: int(offsets[i]) for i, b in enumerate(blocks)}, int(ends.max(initial=0))


def placements(blocks: list[Block]) -> Iterator[tuple[dict[str, int], int]]:
    """(offsets, arena bytes) of each placement in turn, until one comes within CLOSE of the live-bytes bound:
    the orders, then SQUEAKY_ROUNDS rounds that each raise by SQUEAKY_RAISE the priority of every block the last
    placement put above that bound (its rank in the best order the starting priority)."""
    bound = peak_live_bytes([Block(b.name, aligned(b.size_bytes), b.start, b.end) for b in blocks])
    close = bound * (1 + CLOSE)
    overlaps = _overlaps(blocks)
    best: tuple[dict[str, int], int, object] | None = None
    for order in PLACEMENT_ORDERS:
        offsets, arena = _first_fit(blocks, order, overlaps)
        yield offsets, arena
        if arena <= close:
            return
        if best is None or arena < best[1]:
            best = offsets, arena, order
    offsets, _, order = best
    ranked = sorted(blocks, key=order)
    priority = {b.name: float(len(ranked) - k) for k, b in enumerate(ranked)}
    for _ in range(SQUEAKY_ROUNDS):
        for b in blocks:
            if offsets[b.name] + aligned(b.size_bytes) > bound:
                priority[b.name] *= 1 + SQUEAKY_RAISE
        offsets, arena = _first_fit(blocks, lambda b: (-priority[b.name], b.name), overlaps)
        yield offsets, arena
        if arena <= close:
            return


def assign_offsets(blocks: list[Block]) -> tuple[dict[str, int], int]:
    """Offsets for every block and the arena size in bytes: the smallest of the placements (the first on ties,
    so results are deterministic)."""
    offsets, arena = min(placements(blocks), key=lambda r: r[1])
    check_offsets(blocks, offsets)
    return offsets, arena


def persistent_tensors(graph: Graph) -> list[Tensor]:
    """Weights, state, optimizer state: placed before the arena, outside its offsets."""
    return [t for t in graph.tensors.values() if t.alias_of is None and t.persistent]


def persistent_bytes(graph: Graph) -> int:
    """The persistent tensors, each aligned, as the runner places them before the arena."""
    return sum(aligned(t.bytes) for t in persistent_tensors(graph))


def device_bytes(graph: Graph, plan: Plan) -> int:
    """What the runner allocates for a plan, as the driver counts it: the aligned persistent tensors and, after
    them, the arena its offsets need, one allocation taken in whole DRIVER_PAGE_BYTES pages. The arena can exceed
    the plan's peak (placement is not perfect), which is why the solver checks this number."""
    _, arena = assign_offsets(plan_blocks(plan)[0])
    return aligned(persistent_bytes(graph) + arena, DRIVER_PAGE_BYTES)


def arena_room_bytes(graph: Graph, cap_bytes: int) -> int:
    """The largest arena that fits `cap_bytes` after the persistent tensors, in whole driver pages."""
    return cap_bytes // DRIVER_PAGE_BYTES * DRIVER_PAGE_BYTES - persistent_bytes(graph)


def placements_to_fit(graph: Graph, plan: Plan, cap_bytes: int) -> tuple[bool, int]:
    """(whether device_bytes(graph, plan) <= cap_bytes, how many placements that took or were tried): placing
    stops at the first that fits (the runner's smallest arena fits too), mostly the first order."""
    room = arena_room_bytes(graph, cap_bytes)
    tried = 0
    for tried, (_, arena) in enumerate(placements(plan_blocks(plan)[0]), 1):
        if arena <= room:
            return True, tried
    return False, tried


def first_over(blocks: list[Block], offsets: dict[str, int], limit_bytes: int) -> Block | None:
    """The earliest block that reaches past `limit_bytes` of the arena, if any: where a cap is broken."""
    over = [b for b in blocks if offsets[b.name] + b.size_bytes > limit_bytes]
    return min(over, key=lambda b: (b.start, b.name), default=None)


def check_offsets(blocks: list[Block], offsets: dict[str, int]) -> None:
    """No two blocks live at the same time share a byte."""
    overlaps = _overlaps(blocks)
    for i in sorted(range(len(blocks)), key=lambda i: blocks[i].start):
        a = blocks[i]
        for b in (blocks[j] for j in overlaps[i]):
            if _share_bytes(a, b, offsets):
                raise PlannerError(f"arena overlap: {a.name!r} and {b.name!r} share memory while both are live "
                                   f"(from {max(a.start, b.start)})")


ItemKey = tuple[str, int]  # ("op", index in plan.ops) or ("copy", index in plan.copies)


@dataclass
class BlockUse:
    """Who touches one block: the item that fills it (None for a graph input, filled before the iteration
    starts) and every item that reads or writes it while it is live."""

    writer: ItemKey | None
    users: list[ItemKey]


def plan_blocks(plan: Plan) -> tuple[list[Block], dict[str, BlockUse], dict[tuple[ItemKey, str], str]]:
    """The plan's memory as blocks: each residency interval of each tensor (`tensor#0` before an offload or a
    drop, `tensor#1` after the copy back or the recomputation) and each op's workspace (`ws:k`, live while
    op k runs). Returns the blocks, their users, and for (item, tensor) the block that item sees."""
    blocks: list[Block] = []
    uses: dict[str, BlockUse] = {}
    seen: dict[tuple[ItemKey, str], str] = {}
    residency = {r.tensor: r for r in plan.tensors}
    for r in plan.tensors:
        for k, (start, end) in enumerate(r.intervals_us):
            blocks.append(Block(f"{r.tensor}#{k}", r.bytes, start, end))
            uses[f"{r.tensor}#{k}"] = BlockUse(None, [])
    for i, op in enumerate(plan.ops):
        key: ItemKey = ("op", i)
        for t in op.reads + op.writes:
            r = residency[t]
            late = r.second_serves(op)
            if late and len(r.intervals_us) < 2:
                raise PlannerError(f"op {op.node!r} reads {t!r} after its {r.decision}, but the tensor has one "
                                   "residency interval")
            name = f"{t}#{int(late)}"
            seen[key, t] = name
            uses[name].users.append(key)
            if t in op.writes and uses[name].writer is None:
                uses[name].writer = key
        if op.workspace_bytes:
            blocks.append(Block(f"ws:{i}", op.workspace_bytes, op.start_us, op.end_us))
            uses[f"ws:{i}"] = BlockUse(key, [key])
    for j, c in enumerate(plan.copies):
        key = ("copy", j)
        name = f"{c.tensor}#{int(c.direction == 'h2d')}"
        seen[key, c.tensor] = name
        uses[name].users.append(key)
        if c.direction == "h2d":
            uses[name].writer = key
    return blocks, uses, seen


def add_reuse_waits(plan: Plan, blocks: list[Block], uses: dict[str, BlockUse], offsets: dict[str, int]) -> Plan:
    """A copy of the plan where every item that fills a block first waits for the last user, on each other
    stream, of every earlier block that shared any of its bytes. The plan's own waits follow data edges only;
    these make reuse of arena memory safe however the real timing differs from the prediction:
    writer(B).start >= end of each user(A) whenever A and B overlap in the arena and A ends before B starts.
    A wait already implied by stream order and earlier waits (vector clocks in issue order) is not added."""
    from runner.launch_order import launch_order

    plan = plan.model_copy(deep=True)
    items = {("op", i): op for i, op in enumerate(plan.ops)} | {("copy", j): c for j, c in enumerate(plan.copies)}
    key_of = {id(it): k for k, it in items.items()}
    needed: dict[ItemKey, dict[int, ItemKey]] = {}  # writer -> stream -> its last user there of reused bytes
    for b in blocks:
        writer = uses[b.name].writer
        if writer is None:
            continue
        last = needed.setdefault(writer, {})
        for a in blocks:
            if a.end > b.start or a is b or not _share_bytes(a, b, offsets):
                continue
            for u in uses[a.name].users:
                s = items[u].stream
                if s != items[writer].stream and (s not in last or items[u].end_us > items[last[s]].end_us):
                    last[s] = u
    recorder = {it.record_event: k for k, it in items.items() if it.record_event}
    used_events = set(recorder) | {e for it in items.values() for e in it.wait_events}
    position: dict[ItemKey, int] = {}
    clock: dict[ItemKey, dict[int, int]] = {}  # per item: stream -> last position known finished before it
    stream_tail: dict[int, ItemKey] = {}
    fresh = 0
    for launch in launch_order(plan):
        k = key_of[id(launch.item)]
        it = items[k]
        prev = stream_tail.get(it.stream)
        position[k] = position[prev] + 1 if prev else 0
        known = dict(clock[prev]) if prev else {}
        if prev:
            known[it.stream] = position[prev]

        def merge(u: ItemKey) -> None:
            if u in clock:
                for s, pos in clock[u].items():
                    known[s] = max(known.get(s, -1), pos)
                known[items[u].stream] = max(known.get(items[u].stream, -1), position[u])

        for e in it.wait_events:
            merge(recorder[e])
        for s, u in needed.get(k, {}).items():
            if u in position and known.get(s, -1) >= position[u]:
                continue
            user = items[u]
            if user.record_event is None:
                while f"r{fresh}" in used_events:
                    fresh += 1
                user.record_event = f"r{fresh}"
                used_events.add(user.record_event)
                recorder[user.record_event] = u
            it.wait_events.append(user.record_event)
            merge(u)
        clock[k] = known
        stream_tail[it.stream] = k
    return plan


def _share_bytes(a: Block, b: Block, offsets: dict[str, int]) -> bool:
    return offsets[a.name] < offsets[b.name] + b.size_bytes and offsets[b.name] < offsets[a.name] + a.size_bytes
