"""`planner run`: a plan on the GPU (runner/, imported lazily), and the report of measured against predicted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from planner.devices import require_gpu
from planner.files import PlannerError
from planner.ir import Graph
from planner.memsize import fmt_bytes
from planner.plan import Plan
from planner.report import RunReport


class RunFailed(PlannerError):
    """The plan ran but broke a promise: wrong numbers, or more memory than the cap."""

    exit_code = 4


def onnx_weights(path: Path, graph: Graph) -> dict[str, np.ndarray]:
    """The graph's persistent tensors that the ONNX file's initializers give values for."""
    import onnx
    from onnx import numpy_helper

    try:
        model = onnx.load(str(path))
    except Exception as e:  # noqa: BLE001 - any unreadable file is one clear error
        raise PlannerError(f"{path}: cannot read weights ({str(e).splitlines()[0][:160]})") from None
    out = {}
    for init in model.graph.initializer:
        t = graph.tensors.get(init.name)
        if t is None or not t.persistent or not (init.raw_data or init.float_data):
            continue
        value = numpy_helper.to_array(init)
        if list(value.shape) == t.shape:
            out[init.name] = value.astype(np.float64)
    if not out:
        raise PlannerError(f"{path}: no initializer with data matches a weight of {graph.model_name}")
    return out


def require_runnable(plan: Plan, device) -> None:
    """A plan runs only on the GPU and cuDNN it was measured on, with real cuDNN plan names."""
    if plan.estimated:
        raise PlannerError("the plan was made from an analytic (estimated) profile: its algorithm names are not "
                           "cuDNN plans; profile on this GPU and solve again")
    if device.fingerprint != plan.device_fingerprint:
        raise PlannerError(f"the plan was made for {plan.device_fingerprint}, this GPU is {device.fingerprint} "
                           "(another GPU or cuDNN version): profile here and solve again")


def run_on_gpu(graph: Graph, plan: Plan, plan_file: Path, iterations: int, eager: bool, check: bool,
               weights: Path | None, on_trace: Callable[[dict], None] | None = None) -> RunReport:
    require_gpu("running")
    from runner.probe import probe_device
    from runner.replay import run_plan

    device = probe_device()
    require_runnable(plan, device)
    parameters = onnx_weights(weights, graph) if weights else None
    return run_plan(graph, plan, str(plan_file), device.name, iterations, eager, check, parameters, on_trace)


def print_report(r: RunReport, console: Console) -> None:
    table = Table(show_header=False, title=f"{r.model_name} b{r.batch} {r.dtype} "
                                            f"{'training' if r.training else 'inference'} on {r.device} ({r.mode})")
    table.add_row("measured iteration (median, min–max)",
                  f"{r.measured_median_us:.1f} us ({r.measured_min_us:.1f}–{r.measured_max_us:.1f}) "
                  f"over {r.iterations} replays")
    table.add_row("predicted", f"{r.predicted_us:.1f} us (error {r.error:+.1%})")
    table.add_row("device memory (driver)", f"{fmt_bytes(r.measured_peak_bytes)}: arena {fmt_bytes(r.arena_bytes)} "
                  f"+ persistent {fmt_bytes(r.persistent_bytes)} ({r.measured_peak_bytes / r.predicted_peak_bytes - 1:+.1%} "
                  f"against predicted); runtime +{fmt_bytes(r.runtime_bytes)} (modules, CUDA graph, libraries)")
    table.add_row("predicted peak / cap", f"{fmt_bytes(r.predicted_peak_bytes)} / {fmt_bytes(r.cap_bytes)}")
    table.add_row("copied d2h / h2d", f"{fmt_bytes(r.d2h_bytes)} / {fmt_bytes(r.h2d_bytes)}")
    if r.validated:
        bad = [c for c in r.checks if not c.passed]
        worst = max(r.checks, key=lambda c: c.relative_error / max(c.tolerance, 1e-30), default=None)
        verdict = "[green]passed[/]" if not bad else f"[red]FAILED[/] ({len(bad)} of {len(r.checks)})"
        table.add_row("validation", f"{verdict}; worst {worst.what} {worst.tensor}: {worst.relative_error:.2e} "
                                    f"(tolerance {worst.tolerance:g})" if worst else verdict)
    else:
        table.add_row("validation", "skipped (--no-validate)")
    console.print(table)
    slowest = sorted(r.ops, key=lambda o: o.measured_us - o.predicted_us, reverse=True)[:5]
    if slowest:
        console.print("ops slower than predicted (run alone): " + ", ".join(
            f"{o.node} {o.measured_us:.1f}/{o.predicted_us:.1f} us" for o in slowest if o.measured_us > o.predicted_us))


def verdict(r: RunReport) -> None:
    """Raise RunFailed when the run broke the plan's promises."""
    bad = [c for c in r.checks if not c.passed]
    if bad:
        raise RunFailed(f"validation failed on {len(bad)} tensors; first: {bad[0].what} {bad[0].tensor!r} "
                        f"relative error {bad[0].relative_error:.2e} > {bad[0].tolerance:g}")
    if r.measured_peak_bytes > r.cap_bytes:
        raise RunFailed(f"the run took {fmt_bytes(r.measured_peak_bytes)}, over the cap {fmt_bytes(r.cap_bytes)}")
