"""Plan -> the order in which the host issues work (pure Python, so it is tested without a GPU).

CUDA's cudaStreamWaitEvent waits for the event's most recent record at the time of the call, so the host must
issue every record before any wait on it, while keeping each stream's own order. We merge the per-stream queues,
always issuing the ready item with the earliest predicted start; a plan whose waits can never be satisfied is
rejected (it would deadlock or wait on nothing).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from planner.files import PlannerError
from planner.plan import Copy, Plan, ScheduledOp


@dataclass(frozen=True)
class Launch:
    stream: int
    item: ScheduledOp | Copy


def stream_queues(plan: Plan) -> dict[int, list[ScheduledOp | Copy]]:
    """Each stream's items in the plan's order (by predicted start, plan order breaking ties)."""
    queues: dict[int, list] = {}
    items = list(plan.ops) + list(plan.copies)
    for index, item in sorted(enumerate(items), key=lambda p: (p[1].start_us, p[0])):
        queues.setdefault(item.stream, []).append(item)
    return queues


def launch_order(plan: Plan) -> list[Launch]:
    queues = stream_queues(plan)
    recorders = {}
    for stream, items in queues.items():
        for it in items:
            if it.record_event is not None:
                if it.record_event in recorders:
                    raise PlannerError(f"event {it.record_event!r} is recorded twice")
                recorders[it.record_event] = it
    for items in queues.values():
        for it in items:
            missing = [e for e in it.wait_events if e not in recorders]
            if missing:
                raise PlannerError(f"{_label(it)} waits on event {missing[0]!r} that nothing records")

    recorded: set[str] = set()
    heads = {s: 0 for s in queues}
    ready: list[tuple[float, int]] = []  # (predicted start, stream) of stream heads whose waits are recorded
    queued: set[int] = set()

    def push_if_ready(stream: int) -> None:
        i = heads[stream]
        if stream not in queued and i < len(queues[stream]) and all(
                e in recorded for e in queues[stream][i].wait_events):
            heapq.heappush(ready, (queues[stream][i].start_us, stream))
            queued.add(stream)

    for s in queues:
        push_if_ready(s)
    order: list[Launch] = []
    while ready:
        _, stream = heapq.heappop(ready)
        queued.discard(stream)
        item = queues[stream][heads[stream]]
        order.append(Launch(stream, item))
        heads[stream] += 1
        if item.record_event is not None:
            recorded.add(item.record_event)
            for s in queues:  # the new record may release another stream's head
                push_if_ready(s)
        push_if_ready(stream)
    total = sum(len(q) for q in queues.values())
    if len(order) != total:
        stuck = next(queues[s][heads[s]] for s in queues if heads[s] < len(queues[s]))
        raise PlannerError(f"plan deadlocks: {_label(stuck)} waits on events recorded only after it")
    return order


def _label(item: ScheduledOp | Copy) -> str:
    return f"op {item.node!r}" if isinstance(item, ScheduledOp) else f"{item.direction} copy of {item.tensor!r}"
