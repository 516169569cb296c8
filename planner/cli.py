"""The `planner` command: a thin shell over the pipeline stages."""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.files import PlannerError, save_model
from planner.memsize import fmt_bytes

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Plan and run non-linear CNNs fast on one NVIDIA GPU under a memory budget.",
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


class DType(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"


class Concat(str, Enum):
    auto = "auto"
    view = "view"
    copy = "copy"


class SchemaName(str, Enum):
    graph = "graph"
    profile = "profile"
    plan = "plan"
    run_report = "run_report"


def load_graph(model: Path, batch: int, dtype: DType, train: bool):
    """Import MODEL (ONNX, or a graph.json written by inspect --out) and build the training iteration if asked."""
    from planner.onnx_import import import_onnx
    from planner.training import build_training

    if model.suffix == ".json":
        from planner.files import load_model
        from planner.ir import Graph

        return load_model(Graph, model)
    graph = import_onnx(model, batch=batch, dtype=dtype.value, training=train)
    return build_training(graph) if train else graph


ModelArg = typer.Argument(..., help="ONNX model file", exists=False)
BatchOpt = typer.Option(1, "--batch", "-b", min=1, help="batch size (sets a dynamic batch dimension)")
DTypeOpt = typer.Option(DType.fp32, "--dtype", help="compute data type")
TrainOpt = typer.Option(False, "--train", help="one training iteration (forward, loss, backward, SGD update)")


@app.command()
def inspect(
    model: Path = ModelArg,
    batch: int = BatchOpt,
    dtype: DType = DTypeOpt,
    train: bool = TrainOpt,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="write the graph as JSON"),
    as_json: bool = typer.Option(False, "--json", help="print the numbers as JSON"),
):
    """Import a model and report its op DAG: op counts, bytes by role, serial peak, critical path, width."""
    from planner.stats import graph_stats

    t0 = time.perf_counter()
    graph = load_graph(model, batch, dtype, train)
    stats = graph_stats(graph)
    if out is not None:
        save_model(graph, out)
    if as_json:
        print(json.dumps(stats.model_dump(), indent=1))
        return
    what = "training iteration" if graph.training and any(n.phase == "update" for n in graph.nodes) else "inference"
    console.print(f"[bold]{stats.model_name}[/] {what}, batch {stats.batch}, {stats.dtype}: "
                  f"{stats.op_count} ops, {stats.tensor_count} tensors ({time.perf_counter() - t0:.2f} s)")
    kinds = Table("op kind", "count", title="ops by kind", title_justify="left")
    for kind, count in stats.ops_by_kind.items():
        kinds.add_row(kind, str(count))
    console.print(kinds)
    sizes = Table("", "", title="memory and shape of the DAG", title_justify="left", show_header=False)
    rows = [
        ("weights", fmt_bytes(stats.weight_bytes)),
        ("running statistics", fmt_bytes(stats.state_bytes)),
        ("activations (all forward tensors)", fmt_bytes(stats.activation_bytes)),
        ("saved for backward", fmt_bytes(stats.saved_for_backward_bytes)),
        ("activation gradients (all)", fmt_bytes(stats.gradient_bytes)),
        ("weight gradients", fmt_bytes(stats.weight_gradient_bytes)),
        ("optimizer state", fmt_bytes(stats.optimizer_state_bytes)),
        ("peak memory, serial order", fmt_bytes(stats.serial_peak_bytes)),
        ("work", f"{stats.total_gflop:.2f} GFLOP"),
        ("critical path", f"{stats.critical_path_ops} ops, {stats.critical_path_gflop:.2f} GFLOP "
                          f"({100 * stats.critical_path_gflop / max(stats.total_gflop, 1e-12):.0f}% of the work)"),
        ("width (most ops that could run at once)", str(stats.width_ops)),
    ]
    for row in rows:
        sizes.add_row(*row)
    console.print(sizes)
    if out is not None:
        console.print(f"graph written to {out}")


@app.command()
def schema(name: SchemaName = typer.Argument(..., help="graph, profile or plan")):
    """Print the JSON Schema of a pipeline file format."""
    from planner.ir import Graph
    from planner.plan import Plan
    from planner.profile import Profile
    from planner.report import RunReport

    cls = {"graph": Graph, "profile": Profile, "plan": Plan, "run_report": RunReport}[name.value]
    print(json.dumps(cls.model_json_schema(), indent=1))


DEFAULT_STORE = Path("profiles/store")


@app.command()
def profile(
    model: Optional[Path] = typer.Argument(None, help="ONNX model to profile"),
    batch: int = BatchOpt,
    dtype: DType = DTypeOpt,
    train: bool = TrainOpt,
    analytic: Optional[str] = typer.Option(None, "--analytic", help="estimate without a GPU: h100, a100, v100, "
                                                                     "k40, or a JSON device spec"),
    store: Path = typer.Option(DEFAULT_STORE, "--store", help="profile store directory"),
    force: bool = typer.Option(False, "--force", help="re-measure ops already in the store"),
    counters: bool = typer.Option(False, "--counters", help="also read Nsight Compute stall counters"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="also write this model's profile as one file"),
    show: Optional[Path] = typer.Option(None, "--show", help="print the summary of a saved profile file"),
    as_json: bool = typer.Option(False, "--json", help="with --show: JSON for scripts"),
):
    """Measure every candidate algorithm of every op on the GPU (or estimate them with --analytic)."""
    from planner.files import load_model
    from planner.profile import Profile
    from planner.profile_report import print_summary

    if show is not None:
        print_summary(load_model(Profile, show), console, as_json=as_json)
        return
    if model is None:
        raise PlannerError("give a MODEL to profile, or --show PROFILE")
    if analytic is not None and counters:
        raise PlannerError("--counters reads Nsight Compute on the GPU; it cannot go with --analytic")
    graph = load_graph(model, batch, dtype, train)
    if analytic is not None:
        from planner.analytic import profile_analytic
        from planner.devices import load_device

        result, fresh = profile_analytic(graph, load_device(analytic), store, force)
        console.print(f"[yellow]ESTIMATED[/] profile (analytic model for {result.device.name}, nothing measured): "
                      f"{fresh} op signatures estimated now, {len(result.ops) - fresh} taken from {store}")
    else:
        from planner.profile_gpu import profile_on_gpu

        result, fresh = profile_on_gpu(graph, store, force=force, counters=counters, console=console)
    if out is not None:
        save_model(result, out)
    print_summary(result, console)


def _profile_for(graph, profile_path: Path, analytic: Optional[str]):
    """A measured profile from a file or store directory; otherwise the analytic one, said out loud."""
    from planner.files import load_model
    from planner.profile import Profile
    from planner.store import measured_profile_for

    if analytic is None and profile_path.is_file():
        return load_model(Profile, profile_path, expect_graph_sha256=graph.graph_sha256)
    measured = measured_profile_for(graph, profile_path) if analytic is None and profile_path.is_dir() else None
    if measured is not None:
        return measured
    from planner.analytic import estimate_profile
    from planner.devices import load_device

    device = load_device(analytic or "h100")
    console.print(f"[yellow]ESTIMATED[/]: no measured profile of every op in {profile_path}; using the analytic "
                  f"model of {device.name} (run `planner profile` on the GPU for measured costs)")
    return estimate_profile(graph, device)


@app.command()
def solve(
    model: Path = ModelArg,
    mem: Optional[str] = typer.Option(None, "--mem", help="memory cap: 11GB, 512MiB, 40% of the device; "
                                                          "several (2GB,4GB,8GB) for a trade-off sweep"),
    batch: int = BatchOpt,
    dtype: DType = DTypeOpt,
    train: bool = TrainOpt,
    profile_path: Path = typer.Option(DEFAULT_STORE, "--profile", help="profile store directory or profile file"),
    analytic: Optional[str] = typer.Option(None, "--analytic", help="use the analytic profile of this device"),
    streams: int = typer.Option(4, "--streams", min=1, max=32, help="compute streams"),
    time_limit: float = typer.Option(60.0, "--time-limit", min=0, help="budget of the whole solve, heuristic and "
                                     "search, in seconds of a 2-core machine (counted from the work done, so plans "
                                     "repeat; faster machines finish sooner, and the wall clock ends the search at the "
                                     "limit on slower ones); 0: the list-scheduling heuristic alone, no OR-Tools"),
    deterministic: bool = typer.Option(False, "--deterministic", help="no wall clock ends the search (but at 3x "
                                       "--time-limit): the same plan for a seed and worker count on any machine, "
                                       "past --time-limit where the machine is slower than the budget counts"),
    workers: int = typer.Option(8, "--workers", min=1, help="CP-SAT workers"),
    seed: int = typer.Option(0, "--seed", help="CP-SAT random seed"),
    dram: bool = typer.Option(False, "--dram", help="also keep the running ops' DRAM shares at most 1 (off by "
                                                   "default: measured slower on GoogLeNet, docs/BENCHMARKS.md)"),
    sweep: bool = typer.Option(False, "--sweep", help="solve at 100/70/50/30% of the serial peak (100%: what "
                               "the serial plan takes on the device)"),
    baseline: bool = typer.Option(False, "--baseline", help="write the framework-style plan instead (serial, "
                                                            "fastest algorithm per op, nothing offloaded)"),
    concat: Concat = typer.Option(Concat.auto, "--concat", help="concats whose producers could write into their "
                                  "channel slices: auto (views where the uncapped list schedule is faster), view, "
                                  "copy"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="plan file (default plans/MODEL.bN.DTYPE.json)"),
    png: Optional[Path] = typer.Option(None, "--png", help="with several caps: the trade-off chart"),
):
    """Choose algorithms, streams, offloads and recomputations under a memory cap with CP-SAT."""
    from planner.memsize import parse_sizes
    from planner.solve import Options, serial_device_bytes
    from planner.stats import serial_peak_bytes

    graph = load_graph(model, batch, dtype, train)
    prof = _profile_for(graph, profile_path, analytic)
    device_bytes = prof.device.memory_bytes
    if sweep:  # 100%: what the serial plan takes on the device, its peak laid out in the driver's pages
        peak = serial_peak_bytes(graph)
        caps = [max(peak, serial_device_bytes(graph, prof)), *(int(peak * f) for f in (0.7, 0.5, 0.3))]
    else:
        caps = parse_sizes(mem, device_bytes) if mem else [device_bytes]
    options = Options(streams=streams, time_limit_s=time_limit, workers=workers, seed=seed, baseline=baseline,
                      dram=dram, concat=concat.value, deterministic=deterministic)
    mode = "train" if graph.training else "infer"
    stem = f"{graph.model_name}.{mode}.b{graph.batch}.{graph.dtype}" + (".baseline" if baseline else "")
    rows = []
    for cap in caps:
        target = out if out and len(caps) == 1 else (out.with_suffix(f".{cap >> 20}MiB.json") if out else
                                                     Path("plans") / f"{stem}.{cap >> 20}MiB.json"
                                                     if len(caps) > 1 else Path("plans") / f"{stem}.json")
        plan = _solve_one(graph, prof, cap, options, len(caps) > 1, target)
        rows.append((cap, plan))
        if plan is None:
            continue
        save_model(plan, target)
        if len(caps) == 1:
            _print_plan_summary(plan)
        console.print(f"plan written to {target}")
    if len(caps) > 1:
        _print_tradeoff(rows, graph, png)
    if all(p is None for _, p in rows):
        from planner.minimum_cap import CapTooSmall

        raise CapTooSmall("no cap of the sweep can be met", 0)


def _solve_one(graph, prof, cap: int, options, sweeping: bool, target: Path):
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
                               f"{plan.totals.predicted_us:.1f} us, written to {target}; searching on")
        try:
            return solve_plan(graph, prof, cap, options, progress, first)
        except CapTooSmall as e:
            if not sweeping:
                raise
            console.print(f"[red]cap {fmt_bytes(cap)}[/]: {e}")
            return None


def _print_plan_summary(plan) -> None:
    t = plan.totals
    table = Table(show_header=False, title=f"plan for {plan.model_name} b{plan.batch} {plan.dtype}"
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
        ("lower bound, gap", f"{t.lower_bound_us:.1f} us ("
                             + ", ".join(f"{k} {v:.1f}" for k, v in t.bounds_us.items() if v > 0)
                             + f"), gap {t.gap:.1%}"),  # memory_cut is 0 where the cap forces nothing off at any cut
        ("solver", f"{t.status} in {t.solve_time_s:.1f} s (first valid plan after {t.first_plan_s:.1f} s)"),
    ]
    rows += [("simplified", s) for s in t.simplifications]
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _print_tradeoff(rows, graph, png: Optional[Path]) -> None:
    table = Table("cap", "predicted time", "vs baseline", "peak", "offloaded", "recomputed", "status",
                  title=f"time against memory: {graph.model_name} b{graph.batch} {graph.dtype}", title_justify="left")
    for cap, plan in rows:
        if plan is None:
            table.add_row(fmt_bytes(cap), "no plan", "", "", "", "", "cap too small")
            continue
        t = plan.totals
        table.add_row(fmt_bytes(cap), f"{t.predicted_us:.1f} us", f"{t.baseline_makespan_us / t.predicted_us:.2f}x",
                      fmt_bytes(t.peak_bytes), fmt_bytes(t.offloaded_bytes), fmt_bytes(t.recomputed_bytes), t.status)
    console.print(table)
    if png is not None:
        from planner.show import draw_tradeoff

        base = next((p.totals.baseline_makespan_us for _, p in rows if p is not None), 0.0)
        draw_tradeoff([(c, p.totals.predicted_us if p else None, base) for c, p in rows], png,
                      f"{graph.model_name} b{graph.batch} {graph.dtype}")
        console.print(f"trade-off chart written to {png}")


@app.command()
def check(plan_file: Path = typer.Argument(..., metavar="PLAN", help="plan JSON written by `planner solve`")):
    """Re-validate a plan by simulating its streams and waits; exit 1 on any violation."""
    from planner.check import check_plan
    from planner.files import load_model
    from planner.plan import Plan

    plan = load_model(Plan, plan_file)
    report = check_plan(plan)
    console.print(f"simulated: {report.makespan_us:.1f} us (plan says {plan.totals.makespan_us:.1f}), peak "
                  f"{fmt_bytes(report.peak_bytes)} (plan says {fmt_bytes(plan.totals.peak_bytes)}, cap "
                  f"{fmt_bytes(plan.totals.mem_cap_bytes)})")
    if not report.ok:
        for v in report.violations[:20]:
            err_console.print(f"violation: {v}")
        raise PlannerError(f"{len(report.violations)} violations in {plan_file}")
    console.print(f"[green]ok[/]: {len(plan.ops)} ops, {len(plan.copies)} copies on "
                  f"{plan.compute_streams} compute streams; every rule holds")


@app.command()
def calibrate(
    reports: list[Path] = typer.Argument(..., metavar="REPORT...", help="`planner run --report` files (CUDA-graph "
                                                                       "runs)"),
    plans: Optional[list[Path]] = typer.Option(None, "--plan", help="the plan each report ran, in order (default: "
                                                                    "the report's plan_file)"),
    traces: Optional[list[Path]] = typer.Option(None, "--trace", help="`planner run --trace` files of the same "
                                                                      "runs, in order: also fit the copy slowdown "
                                                                      "and show how ops slow beside others"),
    write: Optional[list[Path]] = typer.Option(None, "--write", help="profile files or store directories that get "
                                                                     "the fitted dispatch time (and copy slowdown)"),
):
    """Fit the per-op dispatch time (and, from traces, the copy slowdown) that make the plans' predictions match
    measured runs, apart for plans on one compute stream; --write stores them."""
    import json

    from planner.calibrate import (co_running, co_running_rows, fit, fit_copy_slowdown, pair,
                                   traced_copies, write_calibration)
    from planner.files import load_model
    from planner.plan import Plan
    from planner.report import RunReport

    for what, given in (("--plan", plans), ("--trace", traces)):
        if given and len(given) != len(reports):
            raise PlannerError(f"{len(reports)} reports but {len(given)} {what} files")
    runs, run_reports = [], []
    for k, path in enumerate(reports):
        report = load_model(RunReport, path)
        run_reports.append(report)
        runs.append(pair(report, load_model(Plan, plans[k] if plans else Path(report.plan_file)),
                         path.name.removesuffix(".json").removesuffix(".run")))
    fingerprints = {r.plan.device_fingerprint for r in runs}
    modes = {"training" if r.plan.training else "inference" for r in runs}
    if len(fingerprints) > 1 or len(modes) > 1:
        raise PlannerError("the runs mix devices or training with inference; calibrate one device and mode at a time")
    mode = modes.pop()
    copies, beside = [], []
    for r, report, trace in zip(runs, run_reports, traces or []):
        try:
            traced = json.loads(trace.read_text())
            copies += traced_copies(traced, r.plan, trace.name)
            beside += co_running(traced, r.plan, report)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PlannerError(f"{trace}: not a readable trace ({e!r})") from None
    copy_slowdown = fit_copy_slowdown(copies)
    for r in runs:
        r.copy_slowdown = copy_slowdown
    dispatch, one_stream_dispatch, interference = fit(runs)
    fitted = [f"dispatch time per op {d:.2f} us{where}" for d, where in
              ((dispatch, " on several streams"), (one_stream_dispatch, " on one stream")) if d is not None]
    fitted += [f"{d} copies x{v:.3f}" for d, v in copy_slowdown.items()]
    if not any(r.plan.copies for r in runs):
        interference = None  # nothing to fit it from: the stored value stays
    else:
        fitted.append(f"copy interference {interference:.3f} us per us of copy")
    table = Table(title=f"{mode}: " + "; ".join(fitted))
    for col in ("run", "streams", "ops", "measured us", "predicted us (error)", "at the fitted values (error)"):
        table.add_column(col, justify="left" if col == "run" else "right", overflow="fold")
    for r in runs:  # errors as `planner run` reports them: measured over predicted, minus 1
        table.add_row(r.name, str(r.plan.compute_streams), str(len(r.plan.ops)), f"{r.measured_us:.1f}",
                      f"{r.predicted_us:.1f} ({r.measured_us / r.predicted_us - 1:+.1%})",
                      f"{r.fitted_us:.1f} ({r.measured_us / r.fitted_us - 1:+.1%})")
    console.print(table)
    if beside:
        table = Table(title="ops in the traced iterations against alone (the planner prices them alone)")
        for col in ("ops", "count", "time alone us", "in the iteration us", "ratio"):
            table.add_column(col, justify="left" if col == "ops" else "right")
        for what, count, alone_us, inside_us in co_running_rows(beside):
            table.add_row(what, str(count), f"{alone_us:.1f}", f"{inside_us:.1f}", f"x{inside_us / alone_us:.2f}")
        console.print(table)
    for path in write_calibration(write or [], fingerprints.pop(), mode, dispatch, copy_slowdown, interference,
                                  one_stream_dispatch):
        console.print(f"calibration written to {path}")


@app.command()
def show(plan_file: Path = typer.Argument(..., metavar="PLAN", help="plan JSON written by `planner solve`"),
         png: Optional[Path] = typer.Option(None, "--png", help="also draw the timeline as a PNG")):
    """Print a plan's per-stream timeline (and draw it with --png)."""
    from planner.files import load_model
    from planner.plan import Plan
    from planner.show import draw_timeline, print_timeline

    plan = load_model(Plan, plan_file)
    print_timeline(plan, console)
    if png is not None:
        draw_timeline(plan, png)
        console.print(f"timeline drawn to {png}")


@app.command()
def run(
    plan_file: Path = typer.Argument(..., metavar="PLAN", help="plan JSON written by `planner solve`"),
    model: Path = typer.Option(..., "--model", help="the plan's ONNX model (checked against the plan)"),
    iters: int = typer.Option(100, "--iters", min=1, help="timed replays of the iteration"),
    weights: Optional[Path] = typer.Option(None, "--weights", help="ONNX file with weights (random otherwise)"),
    eager: bool = typer.Option(False, "--eager", help="launch op by op instead of replaying a CUDA graph"),
    validate: bool = typer.Option(True, "--validate/--no-validate", help="check the first iteration against "
                                                                          "the NumPy reference"),
    report: Optional[Path] = typer.Option(None, "--report", help="write the measurements as JSON"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="write one measured replay as a Chrome/Perfetto "
                                                               "trace (kernels and copies per plan stream)"),
):
    """Execute a plan on the GPU, validate the numbers, and compare measured with predicted time and memory."""
    from planner.files import atomic_write_text, load_model
    from planner.plan import Plan
    from planner.run import print_report, run_on_gpu, verdict

    plan = load_model(Plan, plan_file)
    graph = load_graph(model, plan.batch, DType(plan.dtype), plan.training)
    if graph.graph_sha256 != plan.graph_sha256:
        raise PlannerError(f"{plan_file} was made for another model than {model} (or another batch/dtype)")
    if trace is not None and eager:
        raise PlannerError("--trace records a CUDA-graph replay; drop --eager")
    on_trace = (lambda events: atomic_write_text(trace, json.dumps(events))) if trace else None
    result = run_on_gpu(graph, plan, plan_file, iters, eager, validate, weights, on_trace)
    print_report(result, console)
    if report is not None:
        save_model(result, report)
        console.print(f"report written to {report}")
    if trace is not None:
        console.print(f"trace of one replay written to {trace} (open in ui.perfetto.dev)")
    verdict(result)


@app.command()
def bench(
    model: Path = ModelArg,
    batch: str = typer.Option("1", "--batch", "-b", help="batch sizes, comma-separated: 1,32"),
    dtype: str = typer.Option("fp32", "--dtype", help="data types, comma-separated: fp16,fp32"),
    train: bool = TrainOpt,
    mem: Optional[str] = typer.Option(None, "--mem", help="cap for our plan: 11GB, or 50% of our serial plan's "
                                                          "peak; training adds PyTorch save_on_cpu and checkpoint"),
    profile_path: Path = typer.Option(DEFAULT_STORE, "--profile", help="profile store (missing ops are measured)"),
    rounds: int = typer.Option(10, "--rounds", min=1, help="interleaved rounds over every variant"),
    iters: int = typer.Option(5, "--iters", min=1, help="timed iterations per variant and round (rounds x iters "
                                                        ">= 50)"),
    streams: int = typer.Option(4, "--streams", min=1, max=32, help="compute streams for our plan"),
    time_limit: float = typer.Option(20.0, "--time-limit", min=0, help="budget of the whole solve (seconds of a "
                                     "2-core machine, counted from the work done); 0: the heuristic alone"),
    workers: int = typer.Option(8, "--workers", min=1, help="CP-SAT workers"),
    seed: int = typer.Option(0, "--seed", help="CP-SAT and weight seed"),
    no_torch: bool = typer.Option(False, "--no-torch", help="our variants only, even where PyTorch is installed"),
    plan: Optional[Path] = typer.Option(None, "--plan", help="time this plan (made for MODEL on this GPU) as ours "
                                                             "instead of solving; its batch, dtype and cap apply"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="JSON report (default bench/MODEL.MODE.json)"),
    png: Optional[Path] = typer.Option(None, "--png", help="bar chart (default: beside the JSON report)"),
):
    """Time our plan against our serial-fastest plan and PyTorch (eager, CUDA graph; save_on_cpu and checkpoint
    for training under a cap), interleaved in one process on this GPU."""
    from planner.bench import Settings, bench_on_gpu, parse_batches, parse_dtypes
    from planner.bench_report import print_report, save_outputs
    from planner.files import load_model
    from planner.plan import Plan

    batches, dtypes = parse_batches(batch), parse_dtypes(dtype)
    if plan is not None:
        given = load_model(Plan, plan)
        if given.training != train:
            raise PlannerError(f"{plan} is a{' training' if given.training else 'n inference'} plan: "
                               f"{'add' if given.training else 'leave out'} --train")
        batches, dtypes = [given.batch], [given.dtype]
    settings = Settings(batches=batches, dtypes=dtypes, mem=mem, rounds=rounds, iterations=iters, store=profile_path,
                        streams=streams, time_limit_s=time_limit, workers=workers, seed=seed, torch=not no_torch,
                        plan=plan)
    if not model.is_file():
        raise PlannerError(f"{model}: no such file")
    result = bench_on_gpu(lambda b, d: load_graph(model, b, DType(d), train), settings, console)
    print_report(result, console)
    target = out or Path("bench") / f"{result.rows[0].model_name}.{'train' if train else 'infer'}.json"
    save_outputs(result, target, png or target.with_suffix(".png"), console)


class ExportTarget(str, Enum):
    torch = "torch"
    trace = "trace"


@app.command()
def export(
    plan_file: Path = typer.Argument(..., metavar="PLAN", help="plan JSON written by `planner solve`"),
    to: ExportTarget = typer.Option(..., "--to", help="torch: a standalone PyTorch module; trace: Chrome/Perfetto"),
    out: Path = typer.Option(..., "--out", "-o", help="file to write"),
    model: Optional[Path] = typer.Option(None, "--model", help="the plan's ONNX model (needed for --to torch)"),
):
    """Export a plan as a standalone PyTorch module or as a timeline trace of the predicted schedule."""
    from planner.files import atomic_write_text, load_model
    from planner.plan import Plan

    plan = load_model(Plan, plan_file)
    if to is ExportTarget.trace:
        from planner.export_trace import trace_json

        atomic_write_text(out, trace_json(plan))
        console.print(f"trace of {len(plan.ops)} ops and {len(plan.copies)} copies written to {out} "
                      "(open in ui.perfetto.dev)")
        return
    from planner.export_torch import torch_module_source

    if model is None:
        raise PlannerError("--to torch needs --model MODEL.onnx (the network the plan was made for)")
    graph = load_graph(model, plan.batch, DType(plan.dtype), plan.training)
    atomic_write_text(out, torch_module_source(graph, plan))
    console.print(f"PyTorch module written to {out}: PlannedNet({str(model)!r}) runs the plan's streams and events")


def main() -> None:
    """Usage errors are reported by typer; errors in the user's files or options are one line and exit non-zero."""
    try:
        app()
    except PlannerError as e:
        err_console.print(Text("error: ", style="red") + Text(str(e)), highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
