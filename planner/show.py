"""Readable views of a plan: a per-stream text timeline, a PNG Gantt chart, the memory-cap trade-off chart."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from planner.files import PlannerError, atomic_write_bytes
from planner.export_trace import memory_counter, step_levels
from planner.plan import Plan
from planner.training import LOSS_OP

BAR_MIN_WIDTH = 20


def _stream_name(plan: Plan, stream: int) -> str:
    if stream < plan.compute_streams:
        return f"compute {stream}"
    directions = {c.stream: c.direction for c in plan.copies}
    return f"copy {directions.get(stream, stream)}"


def _items_by_stream(plan: Plan) -> dict[int, list]:
    out: dict[int, list] = {}
    for it in sorted([*plan.ops, *plan.copies], key=lambda it: it.start_us):
        out.setdefault(it.stream, []).append(it)
    return dict(sorted(out.items()))


def _label(it) -> str:
    if hasattr(it, "node"):
        return (f"recompute {it.recompute_of}" if it.recompute_of else it.node) + f" [{it.algorithm}]"
    return f"{it.direction} {it.tensor}"


def sm_time_us(plan: Plan, since_us: float = 0.0, until_us: float | None = None) -> dict[str, float]:
    """The makespan (or the window [since_us, until_us)) split by what the SMs do, in us of the whole GPU (time x
    SM share): at every instant the running items' SM shares and the idle share sum to 1, so the parts sum to the
    window. Over the whole plan on several streams the ops' part splits into the `sm_work` bound (each op on its
    least-area algorithm), what the chosen algorithms take beyond it and what the ops beside them slow them by
    (planner.co_running): with the idle SMs, that is what a plan spends above its SM work. A one-stream plan
    prices its ops apart from that bound (one-stream dispatch), so there, as in a window, it stays whole."""
    until = plan.totals.makespan_us if until_us is None else until_us

    def area(ops) -> float:
        return sum(max(0.0, min(o.end_us, until) - max(o.start_us, since_us)) * o.sm_fraction for o in ops)

    ops = area(o for o in plan.ops if not o.recompute_of)
    recomputations = area(o for o in plan.ops if o.recompute_of)
    least = plan.totals.bounds_us.get("sm_work")
    whole = since_us == 0.0 and until_us is None
    if whole and least is not None and plan.compute_streams > 1:
        slowed = sum((o.end_us - o.start_us) * (1 - 1 / o.slowdown) * o.sm_fraction for o in plan.ops
                     if not o.recompute_of)
        parts = {"least-area work": least, "wider algorithms": ops - least - slowed,
                 **({"co-running slowdown": slowed} if slowed else {})}
    else:
        parts = {"ops' work": ops}
    return {**parts, "recomputations": recomputations, "idle SMs": until - since_us - ops - recomputations}


def passes_us(plan: Plan) -> list[tuple[str, float, float]]:
    """A training plan's two passes, (name, start, end): before the loss and from the loss on; none otherwise."""
    loss = next((o.start_us for o in plan.ops if o.node == LOSS_OP and not o.recompute_of), None)
    if not plan.training or loss is None:
        return []
    return [("before the loss", 0.0, loss), ("from the loss on", loss, plan.totals.makespan_us)]


def sm_time_text(plan: Plan, since_us: float = 0.0, until_us: float | None = None) -> str:
    span = (plan.totals.makespan_us if until_us is None else until_us) - since_us
    return f"{span:.1f} us = " + " + ".join(f"{round(v, 1) + 0.0:.1f} {k}"  # no -0.0
                                            for k, v in sm_time_us(plan, since_us, until_us).items())


def print_timeline(plan: Plan, console: Console, ops_per_stream: int = 12) -> None:
    """A bar per stream (█ busy, · idle) on one time axis, then each stream's items."""
    t = plan.totals
    span = max(t.makespan_us, 1e-9)
    console.print(f"[bold]{plan.model_name}[/] {'training' if plan.training else 'inference'}, batch {plan.batch}, "
                  f"{plan.dtype}: {t.predicted_us:.1f} us predicted (baseline {t.baseline_makespan_us:.1f} us), "
                  f"peak {t.peak_bytes / 2**20:.1f} MiB of {t.mem_cap_bytes / 2**20:.1f} MiB"
                  + (" [yellow](ESTIMATED profile)[/]" if plan.estimated else ""))
    console.print(f"where the makespan goes, in us of all the SMs: {sm_time_text(plan)}; lower bound "
                  f"{t.lower_bound_us:.1f} us, gap {t.gap:.1%}")
    for name, since, until in passes_us(plan):
        console.print(f"  {name}: {sm_time_text(plan, since, until)}")
    by_stream = _items_by_stream(plan)
    width = max(BAR_MIN_WIDTH, console.width - 20)
    for stream, items in by_stream.items():
        cells = [0.0] * width
        for it in items:
            a, b = it.start_us / span * width, it.end_us / span * width
            for k in range(int(a), min(width, int(b) + 1)):
                cells[k] += max(0.0, min(b, k + 1) - max(a, k))
        bar = "".join("█" if c >= 0.5 else ("▌" if c > 0 else "·") for c in cells)
        busy = sum(it.end_us - it.start_us for it in items) / span
        console.print(f"{_stream_name(plan, stream):>12} {bar} {busy:4.0%}")
    console.print(f"{'':>12} 0{'':{width - 12}}{span:9.1f} us")
    for stream, items in by_stream.items():
        table = Table("start us", "end us", "item", "waits", title=f"{_stream_name(plan, stream)}: {len(items)} items",
                      title_justify="left")
        shown = items if len(items) <= ops_per_stream else items[:ops_per_stream]
        for it in shown:
            table.add_row(f"{it.start_us:.1f}", f"{it.end_us:.1f}", _label(it), ", ".join(it.wait_events))
        if len(items) > len(shown):
            table.add_row("…", "", f"{len(items) - len(shown)} more (all in the plan file)", "")
        console.print(table)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlannerError("drawing PNGs needs matplotlib: pip install 'cnn-planner[plot]'") from None
    return plt


def _save(fig, path: Path) -> None:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def sm_share_in_use(plan: Plan) -> list[tuple[float, float]]:
    """(time_us, SM share the running ops and recomputations take from then on) at every change."""
    return [(t, max(0.0, share)) for t, share in step_levels((op.start_us, op.end_us, op.sm_fraction)
                                                             for op in plan.ops)]


def draw_timeline(plan: Plan, path: Path) -> None:
    """Gantt chart: one row per stream, ops, recomputations and copies apart; below it the SM share in use and
    the device memory against the cap, on the same time axis."""
    plt = _pyplot()
    by_stream = _items_by_stream(plan)
    fig, (ax, sms, mem) = plt.subplots(3, 1, sharex=True, figsize=(14, 3.6 + 0.5 * len(by_stream)),
                                       gridspec_kw={"height_ratios": [max(2, len(by_stream)), 1.3, 1.3]})
    for row, (stream, items) in enumerate(by_stream.items()):
        for it in items:
            colour = ("tab:orange" if not hasattr(it, "node") else "tab:red" if it.recompute_of
                      else "tab:blue")
            ax.broken_barh([(it.start_us, it.end_us - it.start_us)], (row - 0.4, 0.8), color=colour,
                           edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(by_stream)), [_stream_name(plan, s) for s in by_stream])
    ax.invert_yaxis()
    ax.set_title(f"{plan.model_name} b{plan.batch} {plan.dtype}: {plan.totals.makespan_us:.0f} us, "
                 f"peak {plan.totals.peak_bytes / 2**20:.0f} MiB (blue ops, red recomputations, orange copies)")
    times, shares = zip(*sm_share_in_use(plan)) if plan.ops else ((0.0,), (0.0,))
    sms.fill_between(times, shares, step="post", color="tab:blue", alpha=0.6, linewidth=0)
    sms.set_ylim(0, 1.05)
    sms.set_ylabel("SM share")
    sms.set_title(f"SMs in use; idle: {sm_time_us(plan)['idle SMs']:.0f} us of all the SMs", fontsize=9, loc="left")
    levels = [(0.0, 0), *memory_counter(plan)]
    mem.step([t for t, _ in levels], [(plan.totals.resident_bytes + b) / 2**20 for _, b in levels], where="post",
             color="tab:green")
    mem.axhline(plan.totals.mem_cap_bytes / 2**20, color="tab:red", linestyle="--", linewidth=0.8, label="cap")
    mem.set_ylabel("MiB")
    mem.set_title("device memory (resident bytes, tensors and workspaces)", fontsize=9, loc="left")
    mem.legend(loc="upper right", fontsize=8)
    mem.set_xlabel("time (us)")
    for _, loss, _ in passes_us(plan)[1:]:  # the loss: the backward pass from here
        for panel in (ax, sms, mem):
            panel.axvline(loss, color="grey", linestyle=":", linewidth=0.8)
    _save(fig, path)
    plt.close(fig)


def draw_tradeoff(rows: list[tuple[int, float | None, float]], path: Path, title: str) -> None:
    """Predicted iteration time against the memory cap; rows are (cap bytes, time us or None, baseline us)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    solved = [(c / 2**30, t) for c, t, _ in rows if t is not None]
    if solved:
        ax.plot(*zip(*solved), marker="o", label="planned")
    ax.axhline(rows[0][2], color="grey", linestyle="--", label="serial fastest, uncapped")
    ax.set_xlabel("memory cap (GiB)")
    ax.set_ylabel("predicted iteration time (us)")
    ax.set_title(title)
    ax.legend()
    _save(fig, path)
    plt.close(fig)
