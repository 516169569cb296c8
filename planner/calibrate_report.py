"""`planner calibrate` over files: pair each run report with its plan, fit the dispatch time and co-running
slowdown (and from traces the copy slowdown), show the fit and how ops slow beside others, and write the fitted
values."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich.console import Console
from rich.table import Table

from planner.calibrate import (co_running_cost, co_running_rows, fit, fit_copy_slowdown, misranked, pair,
                               traced_copies, traced_slowdowns, unidentified_co_running, write_calibration)
from planner.files import PlannerError, load_model
from planner.plan import Plan
from planner.profile import CALIBRATION_KEY, calibration_key
from planner.report import RunReport


def calibrate_files(reports: list[Path], plans: list[Path] | None, traces: list[Path] | None,
                    write: list[Path] | None, console: Console, per_batch: bool = False,
                    per_model: bool = False, per_dtype: bool = False) -> None:
    """Fit on the reports (with their plans and traces, in order), print the fit, write it to `write` (with
    `per_batch`, `per_model` or `per_dtype`, as the runs' batch's, model's or dtype's own values: they must share
    it)."""
    for what, given in (("--plan", plans), ("--trace", traces)):
        if given and len(given) != len(reports):
            raise PlannerError(f"{len(reports)} reports but {len(given)} {what} files")
    runs, run_reports = _paired_runs(reports, plans)
    fingerprints = {r.plan.device_fingerprint for r in runs}
    modes = {"training" if r.plan.training else "inference" for r in runs}
    if len(fingerprints) > 1 or len(modes) > 1:
        raise PlannerError("the runs mix devices or training with inference; calibrate one device and mode at a time")
    mode = calibration_key(modes.pop() == "training", _shared(runs, "batch") if per_batch else None,
                           _shared(runs, "model_name") if per_model else None,
                           _shared(runs, "dtype") if per_dtype else None)
    if not re.match(CALIBRATION_KEY, mode):
        raise PlannerError(f"--per-model: the model name in {mode!r} has white space; rename the model file")
    copies, beside = _traced(runs, run_reports, traces)
    copy_slowdown = fit_copy_slowdown(copies)
    for r in runs:
        r.copy_slowdown = copy_slowdown
    with console.status(f"replaying {len(runs)} plans to fit the dispatch time and co-running slowdown"):
        fitted_values = fit(runs)
    interference = fitted_values.copy_interference
    fitted = [f"dispatch time per op {d:.2f} us{where}" for d, where in
              ((fitted_values.dispatch_us, " on several streams"),
               (fitted_values.one_stream_dispatch_us, " on one stream")) if d is not None]
    if fitted_values.co_running is not None:
        fitted.append(f"co-running slowdown k {fitted_values.co_running:.2f}")
    fitted += [f"{d} copies x{v:.3f}" for d, v in copy_slowdown.items()]
    if not any(r.plan.copies for r in runs):
        interference = None  # nothing to fit it from: the stored value stays
    else:
        fitted.append(f"copy interference {interference:.3f} us per us of copy")
    table = Table(title=f"{mode}: " + "; ".join(fitted))
    for col in ("run", "streams", "ops", "measured us", "predicted us (error)", "at the fitted values (error)",
                "of which co-running"):
        table.add_column(col, justify="left" if col == "run" else "right", overflow="fold")
    for r in runs:  # errors as `planner run` reports them: measured over predicted, minus 1
        table.add_row(r.name, str(r.plan.compute_streams), str(len(r.plan.ops)), f"{r.measured_us:.1f}",
                      f"{r.predicted_us:.1f} ({r.measured_us / r.predicted_us - 1:+.1%})",
                      f"{r.fitted_us:.1f} ({r.measured_us / r.fitted_us - 1:+.1%})",
                      f"{co_running_cost(r, r.co_running):+.1%}" if r.co_running else "")
    console.print(table)
    if fitted_values.co_running is not None and (alike := unidentified_co_running(runs)):
        console.print(f"[yellow]warning:[/yellow] k {fitted_values.co_running:.2f} rests on runs that lose alike to "
                      f"co-running ({alike[0]:.1%}-{alike[1]:.1%} of their time at k 1), which cannot tell it from "
                      "the dispatch time; add the run of a plan that packs its ops closer (a refined one: planner "
                      "solve --time-limit 60) before trusting it")
    for faster, slower in misranked(runs):
        console.print(f"[yellow]warning:[/yellow] {faster.name} ran {slower.measured_us / faster.measured_us - 1:.1%} "
                      f"faster than {slower.name}, but the fit ranks it {faster.fitted_us / slower.fitted_us - 1:.1%} "
                      "slower: between such plans the model cannot choose; keep the one measured faster")
    if beside:
        table = Table(title="ops in the traced iterations against alone (the planner prices them alone)")
        for col in ("ops", "count", "time alone us", "in the iteration us", "ratio"):
            table.add_column(col, justify="left" if col == "ops" else "right")
        for what, count, alone_us, inside_us in co_running_rows(beside):
            table.add_row(what, str(count), f"{alone_us:.1f}", f"{inside_us:.1f}", f"x{inside_us / alone_us:.2f}")
        console.print(table)
    for path in write_calibration(write or [], fingerprints.pop(), mode, fitted_values.dispatch_us, copy_slowdown,
                                  interference, fitted_values.one_stream_dispatch_us, fitted_values.co_running):
        console.print(f"calibration ({mode}) written to {path}")


def _shared(runs: list, field: str):
    """The one value of the runs' plans' `field` (their batch, model or dtype), which a fit of one's own needs."""
    values = {getattr(r.plan, field) for r in runs}
    if len(values) > 1:
        what = {"batch": "batches", "model_name": "models", "dtype": "dtypes"}[field]
        raise PlannerError(f"the runs are of {what} {sorted(values)}: a fit of one's own takes runs of one")
    return values.pop()


def _paired_runs(reports: list[Path], plans: list[Path] | None) -> tuple[list, list[RunReport]]:
    """(each report paired with its plan, the reports)."""
    runs, run_reports = [], []
    for k, path in enumerate(reports):
        report = load_model(RunReport, path)
        run_reports.append(report)
        runs.append(pair(report, load_model(Plan, plans[k] if plans else Path(report.plan_file)),
                         path.name.removesuffix(".json").removesuffix(".run")))
    return runs, run_reports


def _traced(runs: list, run_reports: list[RunReport], traces: list[Path] | None) -> tuple[list, list]:
    """(the traced copies, the traced ops beside others), from each run's trace."""
    copies, beside = [], []
    for r, report, trace in zip(runs, run_reports, traces or []):
        try:
            traced = json.loads(trace.read_text())
            copies += traced_copies(traced, r.plan, trace.name)
            beside += traced_slowdowns(traced, r.plan, report)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PlannerError(f"{trace}: not a readable trace ({e!r})") from None
    return copies, beside
