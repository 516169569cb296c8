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


class BnRelu(str, Enum):
    auto = "auto"
    fused = "fused"
    apart = "apart"


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
    from planner.stats import graph_stats, print_stats

    t0 = time.perf_counter()
    graph = load_graph(model, batch, dtype, train)
    stats = graph_stats(graph)
    if out is not None:
        save_model(graph, out)
    if as_json:
        print(json.dumps(stats.model_dump(), indent=1))
        return
    what = "training iteration" if graph.training and any(n.phase == "update" for n in graph.nodes) else "inference"
    print_stats(stats, what, time.perf_counter() - t0, console)
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
    analytic: Optional[str] = typer.Option(None, "--analytic", help="estimate without a GPU: h100, h200, a100, v100, "
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
        console.print(f"{fresh} op signatures measured now, {len(result.ops) - fresh} taken from {store}")
    if out is not None:
        save_model(result, out)
    print_summary(result, console)


def _profile_for(graph, profile_path: Path, analytic: Optional[str], device_name: Optional[str] = None):
    """A measured profile from a file or store directory (of the GPU named like `device_name`, or the first by
    name, said out loud where the store holds several); otherwise the analytic one, said out loud."""
    from planner.files import load_model
    from planner.profile import Profile
    from planner.store import measured_profiles_for

    def named(profile: Profile) -> bool:
        return not device_name or device_name.lower() in profile.device.name.lower()

    if analytic is None and profile_path.is_file():
        profile = load_model(Profile, profile_path, expect_graph_sha256=graph.graph_sha256)
        if not named(profile):
            raise PlannerError(f"{profile_path} was measured on {profile.device.name}, not on a {device_name!r}")
        return profile
    measured = measured_profiles_for(graph, profile_path) if analytic is None and profile_path.is_dir() else []
    if device_name:
        held = ", ".join(p.device.name for p in measured) or "none"
        measured = [p for p in measured if named(p)]
        if not measured:
            raise PlannerError(f"{profile_path} holds no measured profile of this graph on a {device_name!r} GPU "
                               f"(it holds: {held}); run `planner profile` on that GPU")
    if measured:
        if len(measured) > 1:
            others = ", ".join(p.device.name for p in measured[1:])
            console.print(f"measured on {measured[0].device.name} ({profile_path} also holds {others}: --device "
                          "picks another)", soft_wrap=True)
        return measured[0]
    from planner.analytic import estimate_profile
    from planner.devices import load_device

    device = load_device(analytic or "h100")
    console.print(f"[yellow]ESTIMATED[/]: no measured profile of every op in {profile_path}; using the analytic "
                  f"model of {device.name} (run `planner profile` on the GPU for measured costs)")
    return estimate_profile(graph, device)


def _say_behind(graph, profile, args: str) -> None:
    """A note where the measured profile lacks what the runner offers the graph now (store.behind): plans
    cannot use what was never measured."""
    from planner.store import behind

    try:
        from runner.ops import implementations
    except ImportError:
        implementations = None
    lacking = behind(graph, profile, implementations and (lambda node: implementations(graph, node)))
    if lacking:
        console.print(f"[yellow]note[/]: this profile lacks what the runner offers now: {lacking.describe()}. "
                      f"`planner profile {args}` on the {profile.device.name} measures them", soft_wrap=True)


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
    device: Optional[str] = typer.Option(None, "--device", help="the measured GPU to plan for, part of its name "
                                         "(H200): where the store holds several; default the first by name"),
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
    bn_relu: BnRelu = typer.Option(BnRelu.auto, "--bn-relu", help="training BatchNormalizations followed by a "
                                   "ReLU (or a residual Add and a ReLU), and ReLU backwards after a gradient sum: "
                                   "auto (run them as one where the profile measured that), fused, apart"),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="plan file (default plans/MODEL.train|infer.bN.DTYPE.json)"),
    png: Optional[Path] = typer.Option(None, "--png", help="with several caps: the trade-off chart"),
):
    """Choose algorithms, streams, offloads and recomputations under a memory cap with CP-SAT."""
    from planner.memsize import parse_sizes
    from planner.solve import Options, serial_device_bytes
    from planner.solve_report import print_plan_summary, print_tradeoff, solve_one
    from planner.stats import serial_peak_bytes

    graph = load_graph(model, batch, dtype, train)
    prof = _profile_for(graph, profile_path, analytic, device)
    store = f" --store {profile_path}" if profile_path.is_dir() and profile_path != DEFAULT_STORE else ""
    _say_behind(graph, prof, f"{model} -b {batch} --dtype {dtype.value}" + " --train" * train + store)
    device_bytes = prof.device.memory_bytes
    if sweep:  # 100%: what the serial plan takes on the device, its peak laid out in the driver's pages
        peak = serial_peak_bytes(graph)
        caps = [max(peak, serial_device_bytes(graph, prof)), *(int(peak * f) for f in (0.7, 0.5, 0.3))]
    else:
        caps = parse_sizes(mem, device_bytes) if mem else [device_bytes]
    options = Options(streams=streams, time_limit_s=time_limit, workers=workers, seed=seed, baseline=baseline,
                      dram=dram, concat=concat.value, bn_relu=bn_relu.value, deterministic=deterministic)
    mode = "train" if graph.training else "infer"
    name = graph.model_name if mode in graph.model_name.split(".") else f"{graph.model_name}.{mode}"
    stem = f"{name}.b{graph.batch}.{graph.dtype}" + (".baseline" if baseline else "")  # googlenet.train.onnx: once
    rows = []
    for cap in caps:
        target = out if out and len(caps) == 1 else (out.with_suffix(f".{cap >> 20}MiB.json") if out else
                                                     Path("plans") / f"{stem}.{cap >> 20}MiB.json"
                                                     if len(caps) > 1 else Path("plans") / f"{stem}.json")
        plan = solve_one(graph, prof, cap, options, len(caps) > 1, target, console)
        rows.append((cap, plan))
        if plan is None:
            continue
        save_model(plan, target)
        if len(caps) == 1:
            print_plan_summary(plan, console)
        console.print(f"plan written to {target}")
    if len(caps) > 1:
        print_tradeoff(rows, graph, png, console)
    if all(p is None for _, p in rows):
        from planner.minimum_cap import CapTooSmall

        raise CapTooSmall("no cap of the sweep can be met", 0)


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
            err_console.print(f"violation: {v}", highlight=False, soft_wrap=True)
        raise PlannerError(f"{len(report.violations)} violations in {plan_file}")
    streams = f"{plan.compute_streams} compute stream" + ("s" if plan.compute_streams != 1 else "")
    console.print(f"[green]ok[/]: {len(plan.ops)} ops, {len(plan.copies)} copies on {streams}; every rule holds")


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
    per_batch: bool = typer.Option(False, "--per-batch", help="write the fit as the runs' batch's own (one batch), "
                                                              "which solve prefers to the mode's for that batch"),
    per_dtype: bool = typer.Option(False, "--per-dtype", help="write the fit as the runs' dtype's own (one dtype), "
                                                              "which solve prefers to any fitted without one"),
    per_model: bool = typer.Option(False, "--per-model", help="write the fit as the runs' model's own (one model; "
                                                              "with --per-batch, at that batch)"),
):
    """Fit the per-op dispatch time (and, from traces, the copy slowdown) that make the plans' predictions match
    measured runs, apart for plans on one compute stream; --write stores them."""
    from planner.calibrate_report import calibrate_files

    calibrate_files(reports, plans, traces, write, console, per_batch, per_model, per_dtype)


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


def _is(e: Exception, click_class: str) -> bool:
    """Whether e is one of click's exceptions, whether typer vendors click or not."""
    return any(c.__name__ == click_class for c in type(e).__mro__)


def main() -> None:
    """Errors in the user's command line, files or options are one line and exit non-zero (usage errors 2)."""
    try:
        code = app(standalone_mode=False)
    except PlannerError as e:
        err_console.print(Text("error: ", style="red") + Text(str(e)), highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as e:
        if not _is(e, "ClickException"):
            raise
        if type(e).__name__ != "NoArgsIsHelpError":  # `planner` alone: the help it printed is the answer
            where = e.ctx.command_path if _is(e, "UsageError") and e.ctx else ""
            err_console.print(Text("error: ", style="red") + Text(e.format_message())
                              + Text(f" (see {where} --help)" if where else ""), highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
