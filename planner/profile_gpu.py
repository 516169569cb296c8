"""`planner profile` on a GPU: probe the device, measure what the store lacks, with a progress bar and ETA.

The measuring itself lives in runner/ (imported lazily, so the planner works without a GPU stack).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from planner.files import PlannerError
from planner.ir import Graph
from planner.profile import Profile
from planner.store import ProfileStore, profile_graph


def _runner():
    try:
        from runner import profiler
    except ImportError as e:
        raise PlannerError(f"measuring needs the GPU extra (pip install -e '.[gpu]'): {e}; "
                           "without a GPU use --analytic h100") from None
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
            for op in profiler.measure_ops(graph, nodes, device, counters=counters):
                bar.update(task, advance=1, description=f"{graph.model_name}: {op.kind}")
                yield op

        return profile_graph(graph, store, measure, force=force)
