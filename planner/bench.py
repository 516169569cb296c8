"""`planner bench`: our planned execution beside our serial-fastest plan and PyTorch, on one GPU, in one process.

For each (dtype, batch) every variant is built once and warmed up; then R rounds run every variant in turn (the
order rotates each round, so drift and noise hit all alike), M timed iterations each after one untimed one.
Each iteration is timed alone, CUDA events around it and a synchronisation after, as `planner run` times, so
a median is one iteration's latency. Ratios are against the fastest PyTorch variant of the same configuration;
under a cap, the fastest whose measured peak stayed under it, when one did.

Everything except `bench_on_gpu` works without a GPU (the report's table, JSON and chart: planner/bench_report.py),
and the GPU side imports runner/ and torch lazily: without torch the benchmark runs our variants only and says so.
"""

from __future__ import annotations

import gc
import platform
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from rich.console import Console

from planner.devices import require_gpu
from planner.files import FORMAT_VERSION, PlannerError, load_model
from planner.ir import Graph
from planner.memsize import fmt_bytes, parse_size
from planner.plan import Plan

MIN_ITERATIONS = 50  # per variant, over all rounds
EQUIVALENT = 0.05  # our IR's PyTorch build may run at most 5% slower than torchvision's
DTYPES = ("fp16", "fp32")


class BenchRow(BaseModel):
    model_name: str
    batch: int
    dtype: str
    training: bool
    variant: str
    framework: Literal["ours", "torch"]
    iterations: int
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    max_us: float
    peak_bytes: int = Field(description="ours: the plan's buffers as the driver counts them (arena + persistent); "
                            "PyTorch: most bytes its allocator held allocated for this variant, weights included")
    cap_bytes: int | None = Field(None, description="the memory cap our plan was solved for, if one was given")
    ratio_vs_best_torch: float | None = Field(None, description="median over the best PyTorch variant's median")
    best_torch: str | None = None
    note: str = ""

    @property
    def config(self) -> tuple:
        return self.model_name, self.batch, self.dtype, self.training


class Environment(BaseModel):
    gpu: str
    compute_capability: str = ""
    versions: dict[str, str] = Field(default_factory=dict, description="driver, CUDA runtime, cuDNN (ours), CuPy, "
                                     "Python; torch, its CUDA and cuDNN, torchvision when present")
    tf32: str = ""


class EquivalenceCheck(BaseModel):
    """Our IR's PyTorch build against torchvision's network of the same architecture, timed in the same rounds:
    eager (framework overhead included) and as CUDA graphs (the GPU work alone). Both builds are compared on
    their lower decile: an eager iteration is CPU-bound and jitters with the host's scheduling (H100 machine: p10
    to p90 spans 3.1-5.0 ms), and over three runs the builds' ratio of medians ranged 0.96-1.09, of lower deciles
    0.98-1.02. The check is one-sided: our build is the PyTorch peer the planner is compared against, so only a
    slower one handicaps PyTorch; a faster one makes the comparison harder for the planner. Eager, ours runs
    faster when the host does (six runs on the H100 machine: lower deciles 2896-5004 us, ratios 0.955-1.025, the
    lowest on the slowest runs), and a two-sided 5% failed one GPU test run in about eight."""

    model_name: str
    batch: int
    dtype: str
    training: bool
    mode: Literal["eager", "graph"]
    ours_ir_us: float = Field(description="lower decile of our IR's build")
    torchvision_us: float = Field(description="lower decile of torchvision's build")
    ratio: float = Field(description="ours_ir_us / torchvision_us")
    passed: bool = Field(description=f"ours at most {EQUIVALENT:.0%} slower than torchvision's")


class BenchReport(BaseModel):
    kind: Literal["bench_report"] = "bench_report"
    format_version: int = FORMAT_VERSION
    environment: Environment
    rounds: int
    iterations_per_round: int
    method: str = ("variants interleaved round by round; each iteration timed alone with CUDA events; medians "
                   "over all rounds; same dtype and TF32 setting for every variant")
    rows: list[BenchRow]
    checks: list[EquivalenceCheck] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def parse_batches(text: str) -> list[int]:
    """`1,32` -> [1, 32]."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise PlannerError(f"--batch {text!r}: give batch sizes of at least 1, comma-separated, e.g. 1,32")
    return list(dict.fromkeys(map(int, parts)))


def parse_dtypes(text: str) -> list[str]:
    """`fp16,fp32` -> ['fp16', 'fp32']."""
    dtypes = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not dtypes or not set(dtypes) <= set(DTYPES):
        raise PlannerError(f"--dtype {text!r}: give one or more of {', '.join(DTYPES)}, e.g. fp16,fp32")
    return list(dict.fromkeys(dtypes))


def cap_for(mem: str | None, serial_peak_bytes: int) -> int | None:
    """The memory cap of `--mem`: bytes as written, or a percentage of our serial-fastest plan's peak."""
    if mem is not None and "," in mem:
        raise PlannerError(f"--mem {mem!r}: bench takes one cap")
    return None if mem is None else parse_size(mem, serial_peak_bytes)


@dataclass
class Settings:
    batches: list[int]
    dtypes: list[str]
    mem: str | None = None
    rounds: int = 10
    iterations: int = 5
    store: Path = Path("profiles/store")
    streams: int = 4
    time_limit_s: float = 20.0
    workers: int = 8
    seed: int = 0
    torch: bool = True
    plan: Path | None = None  # time this plan as "ours planned" instead of solving one (its cap applies)

    def __post_init__(self):
        if self.rounds * self.iterations < MIN_ITERATIONS:
            raise PlannerError(f"--rounds {self.rounds} x --iters {self.iterations} = "
                               f"{self.rounds * self.iterations} timed iterations; medians need at least "
                               f"{MIN_ITERATIONS} per variant")
        cap_for(self.mem, 1 << 40)  # reads, before any GPU work
        if self.plan is not None and self.mem is not None:
            raise PlannerError("--plan brings its own cap: leave out --mem")


@dataclass
class Variant:
    """One way to run the network: `time_us(n)` runs one untimed iteration then n timed ones."""

    name: str
    framework: Literal["ours", "torch"]
    time_us: Callable[[int], list[float]]
    peak_bytes: Callable[[], int]
    note: str = ""
    keep: list = field(default_factory=list)  # what must live while it is timed


def interleave(variants: list[Variant], rounds: int, iterations: int) -> dict[str, list[float]]:
    """Every variant's iteration times, from `rounds` rounds of each variant in turn, the order rotating."""
    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for i in range(len(variants)):
            v = variants[(i + r) % len(variants)]
            samples[v.name] += v.time_us(iterations)
    return samples


def make_row(graph_key: tuple, variant: Variant, times_us: list[float], cap_bytes: int | None) -> BenchRow:
    model_name, batch, dtype, training = graph_key
    ordered = sorted(times_us)
    deciles = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else ordered * 9
    return BenchRow(model_name=model_name, batch=batch, dtype=dtype, training=training, variant=variant.name,
                    framework=variant.framework, iterations=len(ordered), median_us=statistics.median(ordered),
                    p10_us=deciles[0], p90_us=deciles[-1], min_us=ordered[0], max_us=ordered[-1],
                    peak_bytes=variant.peak_bytes(), cap_bytes=cap_bytes, note=variant.note)


def add_ratios(rows: list[BenchRow]) -> None:
    """Each row's median against the best PyTorch variant of its configuration (none without PyTorch rows)."""
    for config in dict.fromkeys(r.config for r in rows):
        group = [r for r in rows if r.config == config]
        torch_rows = [r for r in group if r.framework == "torch"]
        fitting = [r for r in torch_rows if r.cap_bytes is None or r.peak_bytes <= r.cap_bytes]
        if not torch_rows:
            continue
        best = min(fitting or torch_rows, key=lambda r: r.median_us)
        for r in group:
            r.ratio_vs_best_torch, r.best_torch = r.median_us / best.median_us, best.variant


def equivalence_checks(rows: list[BenchRow]) -> list[EquivalenceCheck]:
    """Our IR's PyTorch build against torchvision's, eager and graph, where both ran."""
    out = []
    for config in dict.fromkeys(r.config for r in rows):
        by_name = {r.variant: r for r in rows if r.config == config}
        for mode in ("eager", "graph"):
            ours, tv = by_name.get(f"torch {mode}"), by_name.get(f"torchvision {mode}")
            if ours and tv:
                ratio = ours.p10_us / tv.p10_us
                out.append(EquivalenceCheck(model_name=config[0], batch=config[1], dtype=config[2],
                                            training=config[3], mode=mode, ours_ir_us=ours.p10_us,
                                            torchvision_us=tv.p10_us, ratio=ratio,
                                            passed=ratio <= 1 + EQUIVALENT))
    return out


def fmt_us(t: float) -> str:
    return f"{t / 1000:.3f} ms" if t >= 1000 else f"{t:.1f} us"


def bench_on_gpu(load: Callable[[int, str], Graph], settings: Settings, console: Console) -> BenchReport:
    """Every (dtype, batch) configuration of the model that `load(batch, dtype)` imports, timed on this GPU."""
    stack = require_gpu("bench")
    cp, cudnn_version = stack.cp, str(stack.cudnn.backend_version())
    from runner.probe import probe_device
    from runner.torch_peer import TF32, setup, torch_missing

    device = probe_device()
    missing = torch_missing() if settings.torch else "--no-torch given"
    notes = [f"no PyTorch variants: {missing}; our variants only"] if missing else []
    if missing:
        console.print(f"[yellow]{notes[0]}[/]")
    versions = {"driver": device.driver_version, "cuda_runtime": device.cuda_version, "cudnn": cudnn_version,
                "cupy": cp.__version__, "python": platform.python_version()} | ({} if missing else setup())
    env = Environment(gpu=device.name, compute_capability=device.compute_capability, versions=versions, tf32=TF32)
    rows: list[BenchRow] = []
    for dtype in settings.dtypes:
        for batch in settings.batches:
            rows += _bench_config(load(batch, dtype), device, settings, not missing, console, notes)
            _release(not missing)
    add_ratios(rows)
    return BenchReport(environment=env, rounds=settings.rounds, iterations_per_round=settings.iterations, rows=rows,
                       checks=equivalence_checks(rows), notes=notes)


def _bench_config(graph: Graph, device, s: Settings, with_torch: bool, console: Console,
                  notes: list[str]) -> list[BenchRow]:
    """One configuration: our two plans (and the PyTorch peers) built, warmed, interleaved, released."""
    from planner.minimum_cap import CapTooSmall
    from planner.solve import Options, solve_plan

    label = f"{graph.model_name} b{graph.batch} {graph.dtype} {'train' if graph.training else 'infer'}"
    profile = _measured_profile(graph, s.store, device, console)
    serial = solve_plan(graph, profile, device.memory_bytes, Options(baseline=True))
    if s.plan is not None:
        planned, cap = given_plan(s.plan, graph, device)
    else:
        cap = cap_for(s.mem, serial.totals.peak_bytes)
        options = Options(streams=s.streams, time_limit_s=s.time_limit_s, workers=s.workers, seed=s.seed)
        console.print(f"{label}: solving (CP-SAT, {s.time_limit_s:g} s limit)"
                      + (f" under a cap of {fmt_bytes(cap)}" if cap else ""))
        try:
            planned = solve_plan(graph, profile, cap or device.memory_bytes, options)
        except CapTooSmall as e:
            notes.append(f"{label}: no planned variant: {e}")
            planned = None
    host, params = _values(graph)
    variants = []
    if planned is not None:
        t = planned.totals
        variants.append(_our_variant("ours planned", graph, planned, host, params,
                                     f"{t.streams_used} stream{'s' * (t.streams_used != 1)}, predicted "
                                     f"{fmt_us(t.predicted_us)}"
                                     + (f", offloads {fmt_bytes(t.offloaded_bytes)}" if t.offloaded_bytes else "")
                                     + (f", recomputes {fmt_bytes(t.recomputed_bytes)}" if t.recomputed_bytes
                                        else "")))
    over = cap is not None and serial.totals.peak_bytes > cap
    variants.append(_our_variant("ours serial", graph, serial, host, params, "serial, fastest algorithm per op"
                                 + (", ignores the cap" if over else "")))
    if with_torch:
        from runner.torch_peer import build_peers

        peers, left_out = build_peers(graph, capped=cap is not None, seed=s.seed)
        notes += [f"{label}: {n}" for n in left_out]
        variants += [Variant(p.name, "torch", _tracked(p), (lambda p=p: p.peak_bytes), p.note, [p]) for p in peers]
    console.print(f"{label}: timing {len(variants)} variants, {s.rounds} rounds x {s.iterations} iterations")
    samples = interleave(variants, s.rounds, s.iterations)
    key = (graph.model_name, graph.batch, graph.dtype, graph.training)
    return [make_row(key, v, samples[v.name], cap) for v in variants]


def given_plan(path: Path, graph: Graph, device) -> tuple[Plan, int | None]:
    """A plan file made for this graph and this GPU, and the cap it was solved under (None: uncapped)."""
    from planner.run import require_runnable

    plan = load_model(Plan, path, expect_graph_sha256=graph.graph_sha256)
    require_runnable(plan, device)
    cap = plan.totals.mem_cap_bytes
    return plan, (cap if cap < device.memory_bytes else None)


def _measured_profile(graph: Graph, store_dir: Path, device, console: Console):
    """The graph's measured profile for this GPU; ops the store lacks are measured now."""
    from planner.profile_gpu import profile_on_gpu
    from planner.store import ProfileStore

    store = ProfileStore(store_dir, device)
    missing = store.missing(graph)
    if not missing:
        return store.assemble(graph)
    console.print(f"{graph.model_name}: {len(missing)} op signatures not in {store_dir}; measuring them")
    return profile_on_gpu(graph, store_dir, console=console)[0]


def _values(graph: Graph):
    """Random weights and inputs, rounded to the device dtypes, as `planner run` makes them."""
    from planner import reference
    from runner.validate import rounded

    values = reference.random_parameters(graph)
    host = rounded(graph, values | reference.random_inputs(graph))
    return host, {k: host[k] for k in values}


def _our_variant(name: str, graph: Graph, plan, host, params, note: str) -> Variant:
    from runner.replay import prepare

    ready = prepare(graph, plan, host, params)
    return Variant(name, "ours", event_timer(ready.launch, ready.origin), lambda: ready.exe.data_bytes, note, [ready])


def _tracked(peer) -> Callable[[int], list[float]]:
    from runner.gpu import gpu

    with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external, which older CuPy lacks
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = gpu().cp.cuda.ExternalStream(peer.stream_ptr)
    timer = event_timer(peer.step, stream)
    return lambda n: peer.tracked(lambda: timer(n))


def event_timer(launch: Callable[[], None], stream) -> Callable[[int], list[float]]:
    """n iterations of `launch` (which enqueues on the CuPy `stream`), each timed alone with CUDA events as
    `planner run` times them, after one untimed iteration."""
    from runner.replay import timed_us

    def time_us(n: int) -> list[float]:
        launch()
        stream.synchronize()
        return timed_us(launch, stream, n)
    return time_us


def _release(with_torch: bool) -> None:
    """Give a finished configuration's device memory back before the next is built."""
    from runner.gpu import gpu

    gc.collect()
    gpu().cp.cuda.Device().synchronize()
    gpu().cp.get_default_memory_pool().free_all_blocks()
    if with_torch:
        import torch

        torch.cuda.empty_cache()
