"""`planner bench`'s report: the table, the bar chart and the saved JSON, from a BenchReport (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from planner.bench import BenchReport, BenchRow, fmt_us
from planner.files import PlannerError, save_model
from planner.memsize import fmt_bytes

WIDE_COLUMNS = 150  # the table's width in logs and pipes (a terminal's own width otherwise)


def _config_label(row: BenchRow) -> str:
    return f"b{row.batch} {row.dtype} {'train' if row.training else 'infer'}"


def print_report(report: BenchReport, console: Console) -> None:
    e = report.environment
    console.print(f"[bold]{e.gpu}[/] (sm {e.compute_capability}): " + ", ".join(f"{k} {v}" for k, v in
                                                                               e.versions.items()), highlight=False)
    console.print(f"TF32: {e.tf32}", highlight=False)
    models = ", ".join(dict.fromkeys(r.model_name for r in report.rows))
    table = Table(title=f"{models}: iteration time in ms, {report.rounds} rounds x {report.iterations_per_round} "
                        "iterations per variant, interleaved", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("config", "variant", "median", "p10–p90", "peak memory", "vs best torch"):
        table.add_column(name, no_wrap=True, justify="left" if name in ("config", "variant") else "right")
    table.add_column("note", overflow="fold")
    last = None
    for r in report.rows:
        if r.config != last and last is not None:
            table.add_section()
        label, last = (_config_label(r) if r.config != last else ""), r.config
        cap = f" / {fmt_bytes(r.cap_bytes)}" if r.cap_bytes and r.framework == "ours" else ""
        ratio = f"{r.ratio_vs_best_torch:.2f}x" if r.ratio_vs_best_torch is not None else "–"
        table.add_row(label, r.variant, f"{r.median_us / 1000:.3f}", f"{r.p10_us / 1000:.3f}–{r.p90_us / 1000:.3f}",
                      fmt_bytes(r.peak_bytes) + cap, ratio, r.note, style="bold" if r.variant == "ours planned"
                      else None)
    wide = console.is_terminal or console.width >= WIDE_COLUMNS
    (console if wide else Console(file=console.file, width=WIDE_COLUMNS, highlight=False)).print(table)
    for config in dict.fromkeys(r.config for r in report.rows if r.best_torch):
        row = next(r for r in report.rows if r.config == config)
        under = row.cap_bytes and next(r for r in report.rows if r.variant == row.best_torch and r.config == config
                                       ).peak_bytes <= row.cap_bytes
        console.print(f"{_config_label(row)}: ratios against {row.best_torch}, the fastest PyTorch variant"
                      + (f" under the cap {fmt_bytes(row.cap_bytes)}" if under else ""), highlight=False)
    for c in report.checks:
        than = f"{1 - c.ratio:.0%} faster" if c.ratio <= 1 else f"{c.ratio - 1:.0%} slower"
        verdict = f"[green]{than}[/]" if c.passed else f"[yellow]{than}: the peer is handicapped[/]"
        console.print(f"check {c.model_name} b{c.batch} {c.dtype} {c.mode}: our IR's PyTorch build "
                      f"{fmt_us(c.ours_ir_us)}, torchvision {fmt_us(c.torchvision_us)} "
                      f"(lower deciles, {c.ratio:.3f}x): {verdict}")
    for note in report.notes:
        console.print(f"note: {note}", highlight=False)


def draw_chart(report: BenchReport, path: Path) -> None:
    """One column per configuration, each on its own scale: median time (whiskers p10–p90) and peak memory per
    variant, the cap dashed."""
    from planner.show import _pyplot, _save

    plt = _pyplot()
    configs = list(dict.fromkeys(r.config for r in report.rows))
    variants = list(dict.fromkeys(r.variant for r in report.rows))
    colours = {name: f"C{k % 10}" for k, name in enumerate(variants)}
    fig, axes = plt.subplots(2, len(configs), figsize=(1.2 + 0.45 * len(variants) * len(configs), 6), squeeze=False)
    for col, config in enumerate(configs):
        rows = [r for r in report.rows if r.config == config]
        at = range(len(rows))
        ax_t, ax_m = axes[0][col], axes[1][col]
        spread = [[(r.median_us - r.p10_us) / 1000 for r in rows], [(r.p90_us - r.median_us) / 1000 for r in rows]]
        ax_t.bar(at, [r.median_us / 1000 for r in rows], color=[colours[r.variant] for r in rows], yerr=spread,
                 capsize=2)
        ax_m.bar(at, [r.peak_bytes / 2**30 for r in rows], color=[colours[r.variant] for r in rows])
        if rows[0].cap_bytes:
            ax_m.axhline(rows[0].cap_bytes / 2**30, color="grey", linestyle="--")
        m, b, d, t = config
        ax_t.set_title(f"{m} b{b} {d} {'train' if t else 'infer'}", fontsize=9)
        for ax in (ax_t, ax_m):
            ax.set_xticks([])
    axes[0][0].set_ylabel("median iteration (ms)")
    axes[1][0].set_ylabel("peak device memory (GiB)")
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=colours[v]) for v in variants], variants, loc="lower center",
               ncol=min(len(variants), 4), fontsize=8)
    fig.suptitle(f"{report.environment.gpu}: medians of {report.rounds * report.iterations_per_round} interleaved "
                 "iterations per variant")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    _save(fig, path)
    plt.close(fig)


def save_outputs(report: BenchReport, out: Path, png: Path | None, console: Console) -> None:
    """The JSON (atomic), then the chart: without matplotlib the chart is skipped with a note, not an error."""
    save_model(report, out)
    console.print(f"report written to {out}")
    if png is None:
        return
    try:
        draw_chart(report, png)
    except PlannerError as e:
        console.print(f"[yellow]no chart[/]: {e}")
        return
    console.print(f"chart written to {png}")
