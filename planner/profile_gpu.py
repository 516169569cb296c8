"""`planner profile` on a GPU: probe the device, measure what the store lacks, with a progress bar and ETA.

The measuring itself lives in runner/ (imported lazily, so the planner works without a GPU stack).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from planner.devices import require_gpu
from planner.files import PlannerError
from planner.ir import Graph
from planner.profile import Candidate, Profile
from planner.store import ProfileStore, profile_graph, profiled_nodes


def _runner():
    try:
        require_gpu("measuring")
    except PlannerError as e:
        raise PlannerError(f"{e}; without a GPU use --analytic h100") from None
    from runner import profiler

    return profiler


def profile_on_gpu(graph: Graph, store_dir: Path, force: bool = False, counters: bool = False,
                   console: Console | None = None) -> tuple[Profile, int]:
    profiler = _runner()
    device = profiler.probe_device()
    store = ProfileStore(store_dir, device)
    columns = (TextColumn("[bold]profiling[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(graph.model_name, total=None)

        def measure(nodes):
            bar.update(task, total=len(nodes))
            for op in profiler.measure_ops(graph, nodes, device):
                bar.update(task, advance=1, description=f"{graph.model_name}: {op.kind}")
                yield op

        profile, fresh = profile_graph(graph, store, measure, force=force,
                                       offered=lambda node: profiler.implementations(graph, node))
    if counters:
        profile = add_counters(graph, store, profile, profiler, console or Console())
    return profile, fresh


def counter_targets(profile: Profile) -> list[tuple[str, Candidate]]:
    """(signature, candidate) pairs still without counters: per measured op, the ends of its trade-offs
    (fastest, least workspace, smallest SM share) -- the candidates a plan picks."""
    targets = []
    for sig, op in profile.ops.items():
        if op.estimated or not op.candidates or op.candidates[0].name == "view":
            continue
        ends = (min(op.candidates, key=key) for key in (lambda c: c.time_us, lambda c: (c.workspace_bytes, c.time_us),
                                                         lambda c: (c.sm_fraction, c.time_us)))
        chosen = list({id(c): c for c in ends}.values())
        targets += [(sig, c) for c in chosen if c.counters is None and c.kernels]
    return targets


def add_counters(graph: Graph, store: ProfileStore, profile: Profile, profiler, console: Console) -> Profile:
    """Nsight Compute readings for the counter targets, saved into the store entries they belong to."""
    targets = counter_targets(profile)
    if not targets:
        console.print("counters: every chosen candidate already has Nsight Compute readings")
        return profile
    first = {}
    for n in profiled_nodes(graph):
        first.setdefault(n.signature, n)
    with console.status(f"Nsight Compute: reading counters of {len(targets)} candidates"):
        try:
            readings = profiler.read_counters(graph, [(first[sig], c) for sig, c in targets])
        except RuntimeError as e:
            raise PlannerError(f"--counters: {e}") from None
    for (_, candidate), counters in zip(targets, readings):
        candidate.counters = counters
    store.put_many(profile.ops[sig] for sig in dict.fromkeys(sig for sig, _ in targets))
    console.print(f"counters: Nsight Compute read {len(targets)} candidates")
    return store.assemble(graph)
