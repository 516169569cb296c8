"""What `planner solve` shows: progress while it solves, the first valid plan as soon as it is found, the plan's
summary, and across several caps the time-against-memory table and chart."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.files import save_model
from planner.memsize import fmt_bytes


def solve_one(graph, prof, cap: int, options, sweeping: bool, target: Path, console: Console):
    """Solve under one cap; the first valid plan is written to `target` as soon as it is found, so that an
    interrupted solve leaves a plan (the caller writes the final one)."""
    from rich.live import Live

    from planner.minimum_cap import CapTooSmall
    from planner.solve import solve_plan

    status = Text(f"solving at cap {fmt_bytes(cap)}: building the model…")
    written: list[float] = []
    with Live(status, console=console, transient=True, refresh_per_second=4) as live:
        def progress(best_us: float, bound_us: float, elapsed_s: float) -> None:
            status.plain = (f"solving at cap {fmt_bytes(cap)}: {elapsed_s:5.1f} s, best {best_us:.1f} us, "
                            f"bound {bound_us:.1f} us")

        def first(plan) -> None:
            if written and written[0] <= plan.totals.predicted_us:
                return
            save_model(plan, target)
            written[:] = [plan.totals.predicted_us]
            live.console.print(f"first valid plan after {plan.totals.first_plan_s:.1f} s: "
                               f"{plan.totals.predicted_us:.1f} us, written to {target}; searching on", soft_wrap=True)
        try:
            return solve_plan(graph, prof, cap, options, progress, first)
        except CapTooSmall as e:
            if not sweeping:
                raise
            console.print(f"[red]cap {fmt_bytes(cap)}[/]: {e}")
            return None


def print_plan_summary(plan, console: Console) -> None:
    from planner.show import sm_time_text

    t = plan.totals
    table = Table(show_header=False, title=f"plan for {plan.model_name} b{plan.batch} {plan.dtype} on "
                  f"{plan.device_fingerprint.rsplit('-', 3)[0].replace('_', ' ')}"
                  + (" [yellow](ESTIMATED profile)[/]" if plan.estimated else ""), title_justify="left")
    rows = [
        ("predicted iteration time", f"{t.predicted_us:.1f} us" + (
            f" (makespan {t.makespan_us:.1f} + copy interference {t.copy_interference_us:.1f})"
            if t.copy_interference_us else "")),
        ("baseline (serial, fastest algorithm, all kept)", f"{t.baseline_makespan_us:.1f} us, "
                                                          f"peak {fmt_bytes(t.baseline_peak_bytes)}"),
        ("speed-up over the baseline", f"{t.baseline_makespan_us / t.predicted_us:.2f}x"),
        ("predicted peak memory / cap", f"{fmt_bytes(t.peak_bytes)} / {fmt_bytes(t.mem_cap_bytes)}"),
        ("offloaded / recomputed", f"{fmt_bytes(t.offloaded_bytes)} / {fmt_bytes(t.recomputed_bytes)}"),
        ("compute streams / events", f"{t.streams_used} / {t.events_used}"),
        ("concats written in place", f"{len(plan.concat_views)}"),
        ("BatchNormalizations running their ReLUs", f"{len(plan.bn_relu_fused)}"),
        ("ReLU backwards adding up their gradients", f"{len(plan.relu_sums_fused)}"),
        ("lower bound, gap", f"{t.lower_bound_us:.1f} us ("
                             + ", ".join(f"{k} {v:.1f}" for k, v in t.bounds_us.items() if v > 0)
                             + f"), gap {t.gap:.1%}"),  # memory_cut is 0 where the cap forces nothing off at any cut
        ("makespan by SM share", sm_time_text(plan)),
        ("solver", f"{t.status} in {t.solve_time_s:.1f} s (first valid plan after {t.first_plan_s:.1f} s)"),
    ]
    rows += [("simplified", s) for s in t.simplifications]
    for row in rows:
        table.add_row(*row)
    console.print(table)


def print_tradeoff(rows, graph, png: Path | None, console: Console) -> None:
    """One row per cap, in MiB and us so that it fits 80 columns; each plan's whole status is in its file."""
    table = Table("cap MiB", "time us", "speed-up", "peak MiB", "offload MiB", "recompute MiB", "solved by",
                  title=f"time against memory: {graph.model_name} b{graph.batch} {graph.dtype}", title_justify="left")
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    for cap, plan in rows:
        if plan is None:
            table.add_row(mib(cap), "no plan", "", "", "", "", "cap too small")
            continue
        t = plan.totals
        table.add_row(mib(cap), f"{t.predicted_us:.1f}", f"{t.baseline_makespan_us / t.predicted_us:.2f}x",
                      mib(t.peak_bytes), mib(t.offloaded_bytes), mib(t.recomputed_bytes), t.status.split(";")[0])
    console.print(table)
    if png is not None:
        from planner.show import draw_tradeoff

        base = next((p.totals.baseline_makespan_us for _, p in rows if p is not None), 0.0)
        draw_tradeoff([(c, p.totals.predicted_us if p else None, base) for c, p in rows], png,
                      f"{graph.model_name} b{graph.batch} {graph.dtype}")
        console.print(f"trade-off chart written to {png}")
