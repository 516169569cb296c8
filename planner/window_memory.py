"""Memory in a refine window: the tensors and workspaces alive in it as a cumulative under the cap.

Without it, a window's best move is rejected whole when the schedule it makes overflows the cap, though a
slightly different move would fit: GoogLeNet training b32 at 50%, the window over the last 600 us moves the
weight gradients of conv2 and conv3 beside conv1's, on a narrower algorithm, 44 us shorter, but keeps their
inputs 10 MiB past the cap. With memory in the model the same window finds one that fits, 27 us shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.problem import Problem
from planner.schedule import Schedule


@dataclass
class Residency:
    """One stretch of device memory a tensor holds (schedule.residency), by the items that bound it: from the
    earliest start of `born` (none: time 0) to the latest end of `until` (none: the end of the iteration)."""

    bytes: int
    born: list[int]
    until: list[int]


def residencies(p: Problem, s: Schedule, items: list) -> list[Residency]:
    """schedule.residency in terms of items (window.items_of), so a window can state them over its variables."""
    at = {(it.kind, it.index): k for k, it in enumerate(items)}
    extra: dict[tuple[int, bool], list[int]] = {}  # (tensor, second residency) -> recomputations reading it
    for t in s.recompute_start:
        for u in p.tensors[t].recompute_reads:
            extra.setdefault((u, s.decision.get(u, "keep") != "keep"), []).append(at["recompute", t])
    out = []
    for i, t in enumerate(p.tensors):
        born = [at["op", w] for w in t.writers]
        first = born + [at["op", c] for c in t.early] + extra.get((i, False), [])
        late = [at["op", c] for c in t.late] + extra.get((i, True), [])
        how = s.decision.get(i, "keep")
        if how == "keep":
            out.append(Residency(t.bytes, born, [] if t.is_output else first + late))
        elif how == "offload":
            out.append(Residency(t.bytes, born, first + [at["d2h", i]]))
            out.append(Residency(t.bytes, [at["h2d", i]], late))
        else:
            out.append(Residency(t.bytes, born, first))
            out.append(Residency(t.bytes, [at["recompute", i]], late))
    return out


def add_window_memory(w, items: list, lives: list[Residency], room_bytes: int) -> None:
    """sum of the bytes of residencies and workspaces alive at any instant of [lo, E] <= room_bytes (the cap less
    resident bytes), each clipped to [lo, E] (window.new_window): before lo nothing moves; after E only shifted
    items run, and every residency alive at an instant there was alive `shift` later before the move. One that
    spans [lo, E] whatever the shift only lowers the room."""
    lo, latest, reach = w.span
    m, t0, t1, width = w.model, w.t0, w.t1, w.t1 - w.t0

    def clip(expr):
        """min(expr, E) for a shifted item's time."""
        var = m.new_int_var(lo, latest, "")
        m.add_min_equality(var, [expr, latest])
        return var

    def edge(ks: list[int], end: bool, empty: int):
        """The earliest start (latest end) of items ks in the window's terms, clipped to [lo, E]."""
        if not ks:
            return empty
        pick = max if end else min
        parts = [(w.end if end else w.start)[k] for k in ks if k in w.present]
        fixed = [int(items[k].end if end else items[k].start) for k in ks if items[k].start < t0]
        moved = [int(items[k].end if end else items[k].start) for k in ks if items[k].start >= t1]
        if fixed:
            parts.append(min(max(pick(fixed), lo), latest))
        if moved:
            parts.append(latest if pick(moved) - width >= latest else clip(pick(moved) - w.shift))
        if all(isinstance(x, int) for x in parts):
            return pick(parts)
        if len(parts) == 1:
            return parts[0]
        var = m.new_int_var(lo, latest, "")
        (m.add_max_equality if end else m.add_min_equality)(var, parts)
        return var

    intervals, demands = [], []
    spans = [(life.born, life.until, life.bytes) for life in lives]
    spans += [([k], [k], alt.workspace_bytes) for _, k, alt in w.intervals
              if alt.workspace_bytes and k not in w.present]
    for born, until, size in spans:
        old_end = max(items[k].end for k in until) if until else reach
        if old_end <= lo or min((items[k].start for k in born), default=0) >= reach:
            continue
        start, end = edge(born, False, lo), edge(until, True, latest)
        if isinstance(start, int) and isinstance(end, int) and (start, end) == (lo, latest):
            room_bytes -= size
        elif isinstance(start, int) and isinstance(end, int):
            intervals.append(m.new_fixed_size_interval_var(start, end - start, ""))
            demands.append(size)
        else:
            intervals.append(m.new_interval_var(start, m.new_int_var(0, latest - lo, ""), end, ""))
            demands.append(size)
    for iv, k, alt in w.intervals:
        if alt.workspace_bytes and k in w.present:
            intervals.append(iv)
            demands.append(alt.workspace_bytes)
    m.add_cumulative(intervals, demands, max(0, room_bytes))
